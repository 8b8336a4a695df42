"""`flaxlm-eval RUN_DIR --tasks NAMES`: EleutherAI's lm-evaluation-harness on a run's model (its
latest checkpoint, or `--step`; a run without checkpoints uses the model it exported at its
end), with flaxlm's backend: no conversion to PyTorch, requests batched and split over every
device.

    flaxlm-eval outputs/clm/runs/<time> --tasks hellaswag,arc_easy --limit 200
    flaxlm-eval outputs/clm/runs/<time> --tasks my_task --include-path my_tasks/
    flaxlm-eval outputs/clm/runs/<time> --tasks lambada_openai --num-fewshot 0 --batch-size 64

Prints the harness's table and writes its results to RUN_DIR/eval/harness-<step>.json. The
metrics, `eval/<task>/<metric>`, are logged at the checkpoint's step to the run's
metrics.jsonl and to its W&B run and TensorBoard files where it has them (not while a run is
training in the directory). A task of your own, or a standard task pointed at a local copy of
its data, is a YAML file in the `--include-path` folder (docs/evaluating.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flaxlm.cli.common import Parser, add_run_dir, add_step, run_command


def parser() -> Parser:
    from flaxlm.tool_defaults import DEFAULT_BATCH_ROWS  # the defaults' one home, without JAX

    parse = Parser("flaxlm-eval", __doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    add_run_dir(parse, "whose model is evaluated")
    parse.add_argument("--tasks", required=True, metavar="NAMES",
                       help="required: harness tasks or groups, comma-separated (e.g. "
                            "hellaswag,arc_easy)")
    add_step(parse)
    parse.add_argument("--limit", type=float, metavar="N",
                       help="evaluate the first N examples of each task (below 1: that "
                            "fraction); default: all")
    parse.add_argument("--num-fewshot", type=int, metavar="K",
                       help="examples shown before each question (default: the task's own)")
    parse.add_argument("--include-path", metavar="DIR",
                       help="a folder of task YAML files of your own (tasks on local data); "
                            "default: the harness's tasks only")
    parse.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_ROWS, metavar="N",
                       help="rows per forward pass, split over the devices")
    parse.add_argument("--seed", type=int, default=0,
                       help="seed of the few-shot examples' choice and of sampled generation")
    return parse


def run(argv: Sequence[str]) -> dict[str, float]:
    """Evaluate as the command line says; print the harness's table; write and log the
    results. Returns the metrics, `eval/<task>/<metric>`."""
    args = parser().parse_args(argv)
    from flaxlm.downstream import record_bucket_results, record_results
    from flaxlm.harness import FlaxlmLM, evaluate
    from flaxlm.run_model import bucket_run_copy
    from flaxlm.storage import is_url

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    lm = FlaxlmLM(run_dir=args.run_dir, step=args.step, batch_size=args.batch_size)
    print(f"flaxlm: evaluating {lm.source} on {', '.join(tasks)}", file=sys.stderr)
    results = evaluate(lm, tasks, limit=limit, num_fewshot=args.num_fewshot,
                       include_path=args.include_path, seed=args.seed)
    print(results.table)
    if is_url(args.run_dir):  # a bucket run: the JSON beside its checkpoints
        record_bucket_results(args.run_dir, bucket_run_copy(args.run_dir), lm.step, results)
    else:
        record_results(args.run_dir, lm.step, results)
    return results.metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()
