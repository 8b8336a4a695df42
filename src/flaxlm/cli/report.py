"""`flaxlm-report <run dir | multirun dir>...`: the runs of a sweep side by side.

    flaxlm-report outputs/clm/multiruns/<time>
    flaxlm-report outputs/classify/multiruns/<time> --objective eval/f1 --maximize
    flaxlm-report outputs/clm/runs/<a> outputs/clm/runs/<b> --out my-report

Prints a table of the runs sorted by the objective and writes `report.md` and PNG plots into
`--out` (default: the first directory given). It reads only each run's config.yaml and
metrics.jsonl, so it works offline on a copy of the run directories. A mistake is one paragraph
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from flaxlm.cli.export import run_command
from flaxlm.cli.sweep import job_statuses
from flaxlm.report import build_table, collect_runs, sort_runs, write_markdown, write_plots


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="flaxlm-report",
        description="Compare flaxlm runs: a table sorted by the objective, report.md and plots.")
    parse.add_argument("dirs", nargs="+", metavar="DIR",
                       help="a run directory, or a multirun directory of numbered job folders")
    parse.add_argument("--objective", default="eval/loss",
                       help="the metric to sort by (default: eval/loss)")
    parse.add_argument("--maximize", action="store_true",
                       help="higher objective is better (eval/accuracy, eval/f1, ...)")
    parse.add_argument("--out", metavar="DIR",
                       help="where report.md and the plots go (default: the first DIR)")
    return parse


def run(argv: Sequence[str]) -> str:
    """Report as the command line says; returns the path of report.md."""
    args = parser().parse_args(list(argv))
    runs = sort_runs(collect_runs(args.dirs, job_statuses), args.objective, args.maximize)
    table = build_table(runs, args.objective, args.maximize)
    print(table.text())
    out = args.out or args.dirs[0]
    plots = write_plots(runs, out, args.objective, args.maximize)
    path = write_markdown(table, plots, out, args.objective, args.maximize)
    print(f"flaxlm: wrote {path} and {len(plots)} plot(s) in {out}")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()
