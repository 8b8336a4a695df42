"""`flaxlm-export run_dir=… [step=…] out=… [overwrite=true]`: a run's checkpoint (the latest, or
`step`) as a Hugging Face model directory, with the run's tokenizer, a generation config and a
model card. Settings are `key=value`, as with flaxlm-train; a mistake is one paragraph on stderr
and exit status 2.

This module also holds the small `key=value` parser that flaxlm-generate shares.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from flaxlm.errors import FlaxlmError

USAGE = """usage: flaxlm-export run_dir=DIR out=DIR [step=N] [overwrite=true]

  run_dir    a flaxlm-train run directory (outputs/clm/runs/<timestamp>)
  out        the Hugging Face directory to write; an existing one is replaced only if it is an
             earlier flaxlm export, never if it holds or contains a run
  step       the checkpoint to export (default: the latest complete one)
  overwrite  also replace a run's own model/ folder that holds only the tokenizer and config
             written when the run started (default: false)"""


@dataclasses.dataclass
class Setting:
    """One `key=value` argument: how to read its value, its default, and whether it repeats."""

    parse: Callable[[str], Any]
    default: Any = None
    required: bool = False
    repeated: bool = False  # key=a key=b, or key=[a,b], collect a list


def parse_settings(argv: Sequence[str], settings: dict[str, Setting], program: str,
                   usage: str) -> dict[str, Any]:
    """`key=value` arguments → {key: value}; `-h` / `--help` prints `usage` and exits."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage)
        sys.exit(0)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep or key not in settings:
            raise FlaxlmError(
                f"{program}: {arg!r} is not a setting. Settings are key=value, with keys "
                f"{', '.join(settings)} (see {program} --help)."
            )
        setting = settings[key]
        try:
            if setting.repeated:
                values.setdefault(key, []).extend(setting.parse(item) for item in _items(text))
            else:
                values[key] = setting.parse(text)
        except ValueError as err:
            raise FlaxlmError(f"{program}: {key}={text!r} is not valid: {err}.") from None
    missing = [key for key, s in settings.items() if s.required and key not in values]
    if missing:
        raise FlaxlmError(
            f"{program} needs {' and '.join(f'{key}=…' for key in missing)}. "
            f"{usage.splitlines()[0]}"
        )
    return {key: values.get(key, s.default) for key, s in settings.items()}


def _items(text: str) -> list[str]:
    """`[a, b]` (YAML flow list, as Hydra writes lists) → its items; anything else is one item,
    commas and all."""
    if text.startswith("[") and text.endswith("]"):
        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"not a list ({err})") from None
        return ["" if item is None else str(item) for item in items]
    return [text]


def optional_int(text: str) -> int | None:
    return None if text in ("null", "None", "") else int(text)


def boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise ValueError("expected true or false")


SETTINGS = {
    "run_dir": Setting(str, required=True),
    "out": Setting(str, required=True),
    "step": Setting(optional_int),
    "overwrite": Setting(boolean, default=False),
}


def run(argv: Sequence[str]) -> str:
    """Export as the command line says; returns the output directory."""
    args = parse_settings(argv, SETTINGS, "flaxlm-export", USAGE)
    from flaxlm.export import (
        check_destination,
        eval_metrics_at,
        export_hf,
        load_run_model,
        run_generation_settings,
    )

    check_destination(args["out"], args["overwrite"], args["run_dir"])  # before reading
    run_model = load_run_model(args["run_dir"], args["step"])
    metrics = eval_metrics_at(args["run_dir"], run_model.step)
    out = export_hf(
        args["out"], run_model.params, run_model.model_config, run_model.tokenizer,
        run_config=run_model.run_config, eval_metrics=metrics,
        hf_config=run_model.hf_config,  # a classifier's; None → the LM's GPT2Config
        generation=(None if run_model.hf_config is not None
                    else run_generation_settings(run_model.run_config)),
        source=run_model.source, overwrite=args["overwrite"], run_dir=args["run_dir"],
        own_conventions=run_model.own_conventions,
    )
    print(f"flaxlm: exported {run_model.source} to {out}")
    return out


def run_command(run_fn: Callable[[Sequence[str]], Any], argv: Sequence[str] | None) -> None:
    """Run a command's `run(argv)`; a user's mistake, or a full disk, is one paragraph on
    stderr, status 2."""
    try:
        run_fn(sys.argv[1:] if argv is None else argv)
    except FlaxlmError as err:
        _exit_with_error(str(err))
    except Exception as err:
        from flaxlm.training.checkpoint import disk_full_text  # only now: it loads JAX

        text = disk_full_text(err)
        if text is None:
            raise
        _exit_with_error(f"A disk is full (or over its quota): {text}. Free some space, or "
                         "write to another disk, and run the same command again.")


def _exit_with_error(message: str) -> None:
    print(f"flaxlm: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()
