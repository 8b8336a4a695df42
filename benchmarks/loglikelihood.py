"""Log-likelihood throughput: flaxlm's lm-evaluation-harness backend against the harness's own
`hf` backend (transformers' PyTorch model) on the run's export.

Both score the same requests, a multiple-choice task's (`next_sentence_task.py`: three lines
of context, four choices), at the same batch size; requests per second, median over rounds,
each contender in a process of its own, alternating (harness.py). The first pass compiles
(flaxlm) or warms up (PyTorch) on the same requests and is not timed.

    python benchmarks/loglikelihood.py RUN_DIR [--requests 400] [--batch 32] [--rounds 3]

RUN_DIR: a finished flaxlm-train run (its model/ export is what the hf backend loads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from next_sentence_task import write_task  # noqa: E402


def requests(task_dir: str, count: int):
    """The first `count` loglikelihood requests of the next_line task."""
    from lm_eval.api.instance import Instance

    rows = [json.loads(line) for line in open(os.path.join(task_dir, "next_line.jsonl"))]
    pairs = [(row["context"], choice) for row in rows for choice in row["choices"]][:count]
    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(pairs)]


def flaxlm_worker(args, instances) -> None:
    from flaxlm.harness import FlaxlmLM

    lm = FlaxlmLM(run_dir=args.run_dir, batch_size=args.batch)
    harness.emit(harness.time_steps(lambda: lm.loglikelihood(instances, disable_tqdm=True),
                                    warmup=1, steps=args.repeats))


def hf_worker(args, instances) -> None:
    import torch
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(args.threads)
    lm = HFLM(pretrained=os.path.join(args.run_dir, "model"), dtype="float32",
              batch_size=args.batch, device="cpu")
    harness.emit(harness.time_steps(lambda: lm.loglikelihood(instances, disable_tqdm=True),
                                    warmup=1, steps=args.repeats),
                 threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32, help="rows per forward pass")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per process")
    parser.add_argument("--task-dir", default=None, help=argparse.SUPPRESS)
    harness.add_arguments(parser, timed_steps=False, choose=False)
    args = parser.parse_args()

    workers = {"flaxlm": flaxlm_worker, "hf": hf_worker}
    if args.worker:
        workers[args.worker](args, requests(args.task_dir, args.requests))
        return

    task_dir = tempfile.mkdtemp(prefix="next-line-")
    write_task(task_dir, count=-(-args.requests // 4))
    print(f"loglikelihood requests, {args.run_dir}: {args.requests} requests (next_line: 3 "
          f"lines of context, 4 choices), batch {args.batch}; PyTorch {args.threads} threads")
    print(harness.machine_description(("jax", "flax", "torch", "transformers", "lm_eval")))
    script = os.path.abspath(__file__)
    argv = [*sys.argv[1:], "--task-dir", task_dir]
    chosen = [harness.Contender(name, harness.worker_command(script, argv, name))
              for name in workers]
    rates, notes, _ = harness.run_rounds(chosen, args.rounds, args.requests,
                                         profile=args.profile)
    rows = harness.summarise(rates, notes, baseline="flaxlm")
    print()
    print(harness.format_table(rows, "requests/s", "flaxlm"))


if __name__ == "__main__":
    main()
