"""Steps per second of a small training run kept in a slow bucket, against the same run on the
local disk (issue 55, point 4: "a slow endpoint does not slow training").

The bucket is moto's S3 server on localhost behind the tests' proxy (tests/faulty_proxy.py),
which holds every request `--delay` seconds (200 ms by default) before forwarding it: each of
the run's bucket calls (its checkpoints' arrays and metadata, its small files, its final
model) meets that latency. The run itself (tiny GPT-2 on the CPU, checkpoints, evaluations and
log lines every few dozen steps) is the same in both places; each contender runs once per round
in a fresh process, alternating (harness.py), and the rate compared is the run's own: steps
between its first and last logged training lines over the wall time between them, read from
metrics.jsonl. That window leaves out the start (imports, data, compiles) and the final wait,
and keeps everything the training thread does in between: evaluations, the start of each
checkpoint save, the copies of the run's small files. Nothing is asserted; one table.

    python benchmarks/bucket_latency.py                    # 3 rounds, 200 ms per request
    python benchmarks/bucket_latency.py --rounds 5 --delay 0.5 -- trainer.max_steps=600
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import uuid

import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

# Tiny GPT-2 on one CPU device: a few milliseconds a step, so that anything the bucket's
# latency adds to the training thread shows. Two epochs of the builtin corpus (1,872 steps
# each), a line every 10 steps, an evaluation every 312 (each one's small files copied), an
# asynchronous checkpoint every 936 (half an epoch, so that the epoch ends' saves are the same
# ones; some 30 s of training here). A save in the slow bucket is some 14 s of requests in a
# row, and a save due while the previous one is still being written waits for it (orbax
# keeps one save in flight): checkpoints closer than that would time the bucket, not the
# training thread. A run checkpoints every few minutes in practice.
RUN = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
       "model.max_positions=64", "model.vocab_size=512", "hardware=cpu",
       "hardware.per_device_batch_size=4", "logger=none", "samples.prompts=[]",
       "language.max_eval_docs=4", "trainer.num_epochs=2", "trainer.log_every_steps=10",
       "trainer.eval_every_steps=312", "checkpoint.every_steps=936",
       "trainer.eval_before_training=false"]
SKIPPED_LINES = 1  # the first logged window holds the first steps' compiles


def worker(name: str, run_dir: str, overrides: list[str]) -> None:
    from flaxlm.cli.train import main

    sys.argv = ["flaxlm-train", *RUN, *overrides, f"hydra.run.dir={run_dir}"]
    if name == "s3":
        sys.argv.append(f"output_url={os.environ['BENCH_BUCKET_URL']}/{uuid.uuid4().hex[:8]}")
    try:
        main()
    except SystemExit as done:
        if done.code:
            raise
    rate, paused = timing(os.path.join(run_dir, "metrics.jsonl"))
    harness.emit(1 / rate, steps_per_second=rate, paused=paused)


def timing(metrics_file: str) -> tuple[float, float]:
    """Steps per second between the run's first timed and its last training line, and the
    share of that time the training thread spent paused: each interval between two lines
    beyond the median one (what a save, an evaluation or a copy added to its steps). The
    second is the figure a shared machine's load moves least: it slows every step alike."""
    with open(metrics_file) as f:
        lines = [json.loads(line) for line in f]
    train = [line for line in lines if "train/loss" in line][SKIPPED_LINES:]
    if len(train) < 3:
        raise SystemExit(f"{metrics_file} has too few training lines to time: raise "
                         "trainer.num_epochs")
    seconds = train[-1]["time"] - train[0]["time"]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(train, train[1:]))
    median = gaps[len(gaps) // 2]
    paused = sum(gap - median for gap in gaps if gap > median)
    return (train[-1]["step"] - train[0]["step"]) / seconds, paused / seconds


def s3_server():
    """moto's S3 server on localhost, with one bucket: (server, endpoint, bucket URL)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="bench",
                      secret="bench").mkdir("bench")
    return server, endpoint, "s3://bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(parser, timed_steps=False, choose=False)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds held per request")
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="flaxlm-train overrides for both runs")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.run_dir, args.overrides)
        return

    from faulty_proxy import FaultyProxy

    scratch = tempfile.mkdtemp(prefix="bucket-latency-")
    server, endpoint, bucket = s3_server()
    aws = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    base_env = {"FLAXLM_CACHE": os.path.join(scratch, "cache"), "JAX_PLATFORMS": "cpu"}
    with FaultyProxy(endpoint, delay_s=args.delay) as proxy:
        contenders = []
        for name in ("local", "s3"):
            env = dict(base_env)
            if name == "s3":
                env.update(aws, AWS_ENDPOINT_URL_S3=proxy.url, BENCH_BUCKET_URL=bucket)
            command = (sys.executable, os.path.abspath(__file__), "--worker", name, "--run-dir",
                       os.path.join(scratch, name, "run-{round}"), "--", *args.overrides)
            contenders.append(harness.Contender(name, command, env))
        # A fresh run folder per round: the command names one, the harness runs it as given.
        print(f"{harness.machine_description(('jax', 'flax', 'orbax-checkpoint', 's3fs'))}\n"
              f"every bucket request held {args.delay * 1000:.0f} ms; run: {' '.join(RUN)} "
              f"{' '.join(args.overrides)}", flush=True)
        rates = {c.name: [] for c in contenders}
        paused = {c.name: [] for c in contenders}
        notes = {}
        for index in range(args.rounds):
            rounds = [harness.Contender(c.name, tuple(part.replace("{round}", str(index))
                                                      for part in c.command), c.env)
                      for c in contenders]
            more, failed, results = harness.run_rounds(
                [rounds[i] for i in (0, 1)] if index % 2 == 0 else [rounds[1], rounds[0]],
                rounds=1, units_per_step=1.0)
            for name, values in more.items():
                rates[name].extend(values)
                if values:
                    paused[name].append(results[name]["paused"])
            notes.update(failed)
        print(f"{proxy.requests} bucket requests held in all", flush=True)
    server.stop()
    rows = harness.summarise(rates, notes, baseline="local")
    print(harness.format_table(rows, unit="steps/s", baseline="local"))
    for name, shares in paused.items():
        if shares:
            print(f"{name}: the training thread paused {statistics.median(shares):.1%} of the "
                  f"time (median of {', '.join(f'{share:.1%}' for share in shares)})")


if __name__ == "__main__":
    main()
