"""What a command pays before it does anything: each tool's `--help` and the train path's imports,
in fresh processes (issue 52, goal 5).

    python benchmarks/startup_imports.py              # 5 processes per figure, the median
    python benchmarks/startup_imports.py --runs 3 --json startup.json

Prints, per tool, the seconds of `<tool> --help`; for `import flaxlm.job, flaxlm.tasks.clm` (what
flaxlm-train imports once its config is composed), the seconds in all, the seconds of flaxlm's
own modules (their code, without what they import) and the heaviest packages they pull in
(`python -X importtime`: each package's first import with what it imported, so the figures
overlap: pandas, imported by datasets, is in both). Figures depend on the disk cache, the CPU
and what else runs: run it twice on an idle machine, and read the second run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_PATH = "import flaxlm.job, flaxlm.tasks.clm"
# `main` of each tool, as pyproject's [project.scripts] names it; flaxlm-train's reads sys.argv.
HELP = "import sys; sys.argv = ['{tool}', '--help']; from {module} import main; main()"
# `-X importtime`'s lines: "import time: <self us> | <cumulative us> | <indent><module>".
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)")


def tools() -> dict[str, str]:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return {name: target.partition(":")[0]
            for name, target in re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', table, re.MULTILINE)}


def seconds(code: str, runs: int) -> float:
    """The median wall time of `python -c code` in `runs` fresh processes."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def import_profile(code: str) -> dict:
    """flaxlm's own import seconds and the heaviest top-level packages, from one process."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], check=True,
                          capture_output=True, text=True)
    own, packages = 0.0, {}
    for self_us, cumulative_us, module in _IMPORT_LINE.findall(done.stderr):
        if module.split(".")[0] == "flaxlm":
            own += int(self_us) / 1e6
        elif "." not in module:  # a package's first import, wherever it happened
            packages[module] = int(cumulative_us) / 1e6
    heaviest = dict(sorted(packages.items(), key=lambda item: -item[1])[:8])
    return {"flaxlm_own_s": round(own, 3),
            "heaviest_packages_s": {name: round(s, 2) for name, s in heaviest.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per figure (median)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args()

    figures = {"help_s": {}}
    for tool, module in tools().items():
        figures["help_s"][tool] = round(seconds(HELP.format(tool=tool, module=module),
                                                args.runs), 2)
        print(f"{tool} --help: {figures['help_s'][tool]:.2f} s", flush=True)
    figures["train_path_import_s"] = round(seconds(TRAIN_PATH, args.runs), 2)
    figures.update(import_profile(TRAIN_PATH))
    print(f"{TRAIN_PATH}: {figures['train_path_import_s']:.2f} s, flaxlm's own modules "
          f"{figures['flaxlm_own_s']:.2f} s; heaviest: "
          + ", ".join(f"{name} {s:.2f}" for name, s in figures["heaviest_packages_s"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
