"""What the command-line tools besides flaxlm-train (which is Hydra's) share: argparse with
`--flags`, the project's error style, and the options several tools take; and, flaxlm-train
too, how a command keeps Python's garbage collector from walking the libraries' objects while
they load and at its end.

    flaxlm-export RUN_DIR --out DIR [--step N] [--overwrite]
    flaxlm-generate RUN_DIR [--prompt TEXT ...] [--greedy | --temperature T ...]
    flaxlm-report DIR... [--objective METRIC] [--out DIR]
    flaxlm-pairs OUT_DIR [--train N] [--validation N] [--seed S]

A mistake on the command line is one line on stderr, `flaxlm: error: <tool>: <what> (see <tool>
--help)`, and exit status 2; so is the `key=value` spelling these tools once took, with the
same command spelled with flags. A FlaxlmError from below is its one paragraph and its exit
code; a full disk is one paragraph and status 2. `--help` lists every option with its meaning
and its default.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import gc
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from flaxlm.errors import FlaxlmError

# An argument of the old spelling: a setting's name, `=`, its value.
_KEY_VALUE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


class UsageError(FlaxlmError):
    """A command line that the tool's parser does not accept."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default after its meaning, unless the meaning
    already says it (an option without a value, or one whose default is a rule, not a value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.nargs == 0 or not action.option_strings
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's parser with flaxlm's error style (see the module's docstring)."""

    def __init__(self, prog: str, description: str, epilog: str | None = None):
        super().__init__(prog=prog, description=description, epilog=epilog,
                         formatter_class=HelpFormatter, allow_abbrev=False)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        if old := old_settings(self, argv):
            raise UsageError(
                f"{self.prog} takes --flags, not key=value settings ({', '.join(old)}); "
                f"the same command: {shlex.join(new_spelling(self, argv))} "
                f"(see {self.prog} --help)."
            )
        return super().parse_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help).")


def add_run_dir(parser: Parser, use: str) -> None:
    """The run directory a tool reads, its first argument."""
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help=f"a flaxlm-train run directory (outputs/<task>/runs/<time>), or "
                             f"a bucket run's output_url (gs://bucket/runs/<name>), {use}")


def add_step(parser: Parser) -> None:
    parser.add_argument("--step", type=int, metavar="N",
                        help="the checkpoint to use (default: the latest complete one; a run "
                             "without checkpoints: the model it exported at its end)")


def run_command(run: Callable[[Sequence[str]], Any], argv: Sequence[str] | None) -> None:
    """Run a tool's `run(argv)` (argv: the process's arguments when None); a FlaxlmError, or a
    full disk, is one paragraph on stderr and the error's exit status."""
    end_without_final_collection()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except FlaxlmError as err:
        exit_with_error(str(err), err.exit_code)
    except Exception as err:
        from flaxlm.training.checkpoint.manager import disk_full_text  # only now: it loads JAX

        text = disk_full_text(err)
        if text is None:
            raise
        exit_with_error(f"A disk is full (or over its quota): {text}. Free some space, or "
                        "write to another disk, and run the same command again.",
                        FlaxlmError.exit_code)


@functools.cache  # once a process
def end_without_final_collection() -> None:
    """At its exit, this process leaves the objects it made to the operating system, as it
    does their memory, instead of having Python's final garbage collection walk them all: once
    JAX, transformers and PyTorch are loaded, that walk is a noticeable pause at the end of
    every command. The atexit handlers (W&B's, logging's) still run, and objects freed by
    reference counting are still finalized; only the collection of what is left in reference
    cycles is skipped, whose finalizers Python does not promise to run at exit anyway."""
    atexit.register(gc.freeze)


@contextlib.contextmanager
def collector_paused_while_importing() -> Iterator[None]:
    """For the block that imports a command's libraries (JAX, transformers, datasets, orbax):
    the objects they make live as long as the process, and Python's garbage collector, run
    again and again as they arrive, would walk all of them each time, a good part of the time
    the imports take. It is paused for the block; what exists at its end is frozen, so that no
    later collection walks it either."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def exit_with_error(message: str, exit_code: int) -> NoReturn:
    print(f"flaxlm: error: {message}", file=sys.stderr)
    sys.exit(exit_code)


# ---------------------------------------------------------------- the old key=value spelling


def old_settings(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The `key=value` arguments in `argv` whose key names one of the parser's arguments
    (`run_dir=`, `max_new_tokens=`); an option's value (`--prompt a=b`) is not one."""
    actions = _actions_by_key(parser)
    found, value_next = [], False
    for arg in argv:
        if value_next:
            value_next = False
        elif arg == "--":
            break
        elif arg.startswith("-"):
            action = _option(parser, arg)
            value_next = action is not None and action.nargs != 0 and "=" not in arg
        elif (match := _KEY_VALUE.fullmatch(arg)) and match[1] in actions:
            found.append(f"{match[1]}=")
    return list(dict.fromkeys(found))


def new_spelling(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with each old `key=value` argument as the flag (or positional argument) that
    replaced it: `run_dir=R out=O greedy=true prompt=[a, b]` → `R --out O --greedy --prompt a
    --prompt b`."""
    actions = _actions_by_key(parser)
    old = set(old_settings(parser, argv))
    words = [parser.prog]
    for arg in argv:
        match = _KEY_VALUE.fullmatch(arg)
        if match is None or f"{match[1]}=" not in old:
            words.append(arg)
            continue
        action, value = actions[match[1]], match[2]
        flag = max(action.option_strings, key=len) if action.option_strings else None
        if flag is None:
            words.append(value)
        elif action.nargs == 0:
            words += [flag] if value.lower() in ("true", "yes", "1", "on") else []
        else:
            for item in _items(value) if isinstance(action, argparse._AppendAction) else [value]:
                words += [flag, item]
    return words


def _actions_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's arguments by the name the old spelling gave them (`max_new_tokens`)."""
    return {action.dest: action for action in parser._actions
            if action.dest not in ("help", argparse.SUPPRESS)}


def _option(parser: argparse.ArgumentParser, arg: str) -> argparse.Action | None:
    return parser._option_string_actions.get(arg.partition("=")[0])


def _items(text: str) -> list[str]:
    """`[a, b]` (a list as Hydra writes one) → its items; anything else is one item."""
    if text.startswith("[") and text.endswith("]"):
        return [item.strip() for item in text[1:-1].split(",")]
    return [text]
