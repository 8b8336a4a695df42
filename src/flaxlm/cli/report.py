"""`flaxlm-report <run dir | multirun dir | bucket URL>...`: the runs of a sweep side by side.

    flaxlm-report outputs/clm/multiruns/<time>
    flaxlm-report gs://bucket/runs            # every run (output_url) in that folder
    flaxlm-report outputs/classify/multiruns/<time> --objective eval/accuracy
    flaxlm-report outputs/clm/runs/<a> outputs/clm/runs/<b> --out my-report

Prints a table of the runs sorted by the objective (by default the one they were trained for,
their saved `trainer.objective`) and writes `report.md` and PNG plots into
`--out` (default: the first directory given; for a bucket URL, report-<its last part> in the
current directory). It reads only each run's config.yaml,
metrics.jsonl and status.json (and a sweep's job statuses), so it works offline on a copy of the
run directories. A run whose files are damaged is a row marked `damaged`, with the reason below
the table, and the others are reported (exit 0); a metrics.jsonl whose last line was cut off is
read without that line, with a warning. A mistake, or runs of which none has a metric to
report, is one paragraph on stderr and exit status 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from flaxlm.cli.common import Parser, run_command
from flaxlm.errors import writable_dir
from flaxlm.report import (
    build_table,
    collect_runs,
    report_objective,
    sort_runs,
    status_notes,
    write_markdown,
    write_plots,
)
from flaxlm.storage import is_url


def parser() -> Parser:
    parse = Parser("flaxlm-report",
                   "Compare flaxlm runs: a table sorted by the objective, report.md and plots.")
    parse.add_argument("dirs", nargs="+", metavar="DIR",
                       help="a run directory, or a multirun directory of numbered job folders, or "
                            "a bucket URL (gs://, s3://): a run's output_url or a folder of them")
    parse.add_argument("--objective",
                       help="the metric to sort by (default: the trainer.objective the runs "
                            "were trained for, else eval/loss)")
    direction = parse.add_mutually_exclusive_group()
    direction.add_argument("--maximize", dest="maximize", action="store_const", const=True,
                           help="higher objective is better (default: the direction the runs "
                                "were trained for, else lower for a loss, higher for the rest)")
    direction.add_argument("--minimize", dest="maximize", action="store_const", const=False,
                           help="lower objective is better")
    parse.add_argument("--out", metavar="DIR",
                       help="where report.md and the plots go (default: the first DIR)")
    return parse


def run(argv: Sequence[str]) -> str:
    """Report as the command line says; returns the path of report.md."""
    args = parser().parse_args(argv)
    runs = collect_runs(args.dirs)
    first = args.dirs[0]
    if is_url(first):  # the report is written here, in a folder named after the bucket's
        first = f"report-{first.rstrip('/').rsplit('/', 1)[-1]}"
    out = writable_dir(args.out or first, "--out",
                       "Choose an --out you can write to." if args.out else
                       "report.md and the plots go into the first DIR unless --out names "
                       "another folder: pass --out with a directory you can write to.")
    objective, maximize = report_objective(runs, args.objective, args.maximize)
    runs = sort_runs(runs, objective, maximize)
    table = build_table(runs, objective, maximize)
    print(table.text())
    notes = status_notes(runs)
    for note in notes:
        print(f"  {note}")
    plots = write_plots(runs, out, objective, maximize)
    path = write_markdown(table, plots, out, objective, maximize, notes, runs)
    print(f"flaxlm: wrote {path} and {len(plots)} plot(s) in {out}")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()
