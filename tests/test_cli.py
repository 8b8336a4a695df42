"""The command-line style of the tools besides flaxlm-train: argparse with `--flags`, every one
registered in pyproject.toml, `--help` naming every option with its meaning and default, a
mistake as one `flaxlm: error:` line and exit status 2, the old `key=value` spelling as an error
that spells the same command with flags. Every command, flaxlm-train too, leaves its objects to
the system at exit."""

from __future__ import annotations

import argparse
import gc
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as REPO_DIR

import flaxlm
import flaxlm.cli
from flaxlm.cli.common import (
    collector_paused_while_importing,
    new_spelling,
    old_settings,
    run_command,
)
from flaxlm.errors import PEER_EXIT_CODE, FlaxlmError, PeerError

REPO = Path(REPO_DIR)


def _scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] (a TOML table of plain strings; tomllib is not in
    Python 3.10)."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', table, re.MULTILINE))


SCRIPTS = _scripts()
TOOLS = {name: target.partition(":")[0] for name, target in SCRIPTS.items()
         if name != "flaxlm-train"}  # Hydra's command line, tested in test_cli_failures


def parser_of(tool: str) -> argparse.ArgumentParser:
    return importlib.import_module(TOOLS[tool]).parser()


def test_every_entry_point_is_registered_and_only_the_cli_package_has_them():
    """A module that runs as a program is a tool of flaxlm.cli with a `main`, and pyproject
    names it; no module elsewhere is a fifth, unregistered entry point."""
    registered = {target.partition(":")[0] for target in SCRIPTS.values()}
    assert all(target.endswith(":main") for target in SCRIPTS.values()), SCRIPTS
    with_main = set()
    for info in pkgutil.walk_packages(flaxlm.__path__, "flaxlm."):
        path = REPO / "src" / (info.name.replace(".", "/") + ("/__init__.py" if info.ispkg
                                                                else ".py"))
        if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8"):
            with_main.add(info.name)
    assert with_main == registered
    assert all(name.startswith("flaxlm.cli.") for name in registered)
    assert {f"flaxlm.cli.{m.name}" for m in pkgutil.iter_modules(flaxlm.cli.__path__)} >= registered


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_lists_every_option_with_its_meaning_and_default(tool, capsys):
    parser = parser_of(tool)
    assert parser.prog == tool
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(TOOLS[tool]).main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        names = action.option_strings or [action.metavar]
        assert all(name in text for name in names), (names, text)
        assert action.help, f"{names} has no help text"
        if action.required and action.option_strings:
            assert "required" in action.help
        elif action.option_strings and action.nargs != 0:  # an option that takes a value
            shown = formatter._expand_help(action)
            assert "default" in shown, f"{tool} {names}: no default in {shown!r}"


@pytest.mark.parametrize("tool, argv, flags", [
    ("flaxlm-export", ["run_dir=runs/a", "out=my-model", "step=200", "overwrite=true"],
     "flaxlm-export runs/a --out my-model --step 200 --overwrite"),
    ("flaxlm-generate", ["run_dir=runs/a", "prompt=[The list, A dict]", "greedy=true",
                         "max_new_tokens=9"],
     "flaxlm-generate runs/a --prompt 'The list' --prompt 'A dict' --greedy "
     "--max-new-tokens 9"),
    ("flaxlm-generate", ["runs/a", "prompt=Return the", "greedy=false"],
     "flaxlm-generate runs/a --prompt 'Return the'"),
])
def test_the_old_key_value_spelling_is_one_line_that_spells_the_command_with_flags(
        tool, argv, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(TOOLS[tool]).main(argv)
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"flaxlm: error: {tool} takes --flags, not key=value settings")
    assert f"the same command: {flags} (see {tool} --help)." in line, line


def test_an_options_value_may_hold_an_equals_sign():
    parser = parser_of("flaxlm-generate")
    argv = ["runs/a", "--prompt", "max_new_tokens=3", "--prompt=top_k=1"]
    assert old_settings(parser, argv) == []
    assert new_spelling(parser, argv) == ["flaxlm-generate", *argv]
    assert parser.parse_args(argv).prompt == ["max_new_tokens=3", "top_k=1"]


@pytest.mark.parametrize("tool, argv, message", [
    ("flaxlm-report", [], "flaxlm-report: the following arguments are required: DIR"),
    ("flaxlm-export", ["runs/a", "--out"], "flaxlm-export: argument --out: expected one argument"),
    ("flaxlm-export", ["runs/a", "--out", "o", "--ste", "2"],
     "flaxlm-export: unrecognized arguments: --ste 2"),  # no abbreviations
    ("flaxlm-generate", ["runs/a", "--top-k", "many"],
     "flaxlm-generate: argument --top-k: invalid int value: 'many'"),
    ("flaxlm-pairs", ["a", "b"], "flaxlm-pairs: unrecognized arguments: b"),
])
def test_a_bad_argument_is_one_line_and_exit_status_2(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(TOOLS[tool]).main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"flaxlm: error: {message} (see {tool} --help).\n"
    assert captured.out == ""


@pytest.mark.parametrize("error, code", [(FlaxlmError("Bad input.\nFix it."), 2),
                                         (PeerError("A peer is gone."), PEER_EXIT_CODE)])
def test_an_error_from_below_is_its_paragraph_and_its_exit_code(error, code, capsys):
    def run(argv):
        raise error

    with pytest.raises(SystemExit) as exit_info:
        run_command(run, [])
    assert exit_info.value.code == code
    assert capsys.readouterr().err == f"flaxlm: error: {error}\n"


@pytest.mark.slow
def test_flaxlm_pairs_writes_a_pair_dataset(tmp_path, capsys):
    from flaxlm.cli import pairs

    paths = pairs.run([str(tmp_path / "pairs"), "--train", "6", "--validation", "4"])
    assert [p.rsplit("/", 1)[1] for p in paths] == ["validation.tsv", "train.tsv"]
    rows = [open(p).read().splitlines() for p in paths]
    assert [len(r) for r in rows] == [5, 7]  # with the header
    assert rows[0][0] == "sentence1\tsentence2\tlabel"
    assert "flaxlm: wrote 6 pairs to" in capsys.readouterr().out


# Registered before the command runs, so run after its own atexit handlers.
FROZEN_AT_EXIT = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("objects frozen at exit:", gc.get_freeze_count() > 0))
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__")
"""


@pytest.mark.parametrize("module", ["flaxlm.cli.train", "flaxlm.cli.report"])
def test_a_command_leaves_its_objects_to_the_system_at_exit(module):
    """Python's final garbage collection would walk every object JAX and transformers made:
    most of a second at the end of each command (end_without_final_collection)."""
    done = subprocess.run([sys.executable, "-c", FROZEN_AT_EXIT, module, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "objects frozen at exit: True"


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_paused_while_importing_and_what_was_loaded_is_frozen(enabled_before):
    was_enabled = gc.isenabled()
    frozen = gc.get_freeze_count()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with collector_paused_while_importing():
            assert not gc.isenabled()
            loaded = [[] for _ in range(1000)]  # what an import makes
        assert gc.get_freeze_count() >= frozen + len(loaded)
        assert gc.isenabled() == enabled_before
    finally:
        (gc.enable if was_enabled else gc.disable)()
