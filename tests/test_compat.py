"""Runs stopped by earlier releases resume on this one: a small run made by an earlier flaxlm
(tests/data/run-v0: 4 steps planned, killed after its step-2 checkpoint) continues to its end
and logs what that release logged for the same run never stopped.

The data was made with main at 21b1554: `flaxlm-train <OVERRIDES> run_dir=run` in a directory
holding corpus.txt, its metrics.jsonl kept as uninterrupted-metrics.jsonl; then checkpoint 4,
model/, .lock and the metrics lines after step 2 removed, as a kill after the step-2 save
leaves it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import compose
from numerics import assert_close, transformer_depth

DATA = Path(__file__).parent / "data" / "run-v0"

# The command the old run was started with (in a directory holding corpus.txt), in today's
# spelling of its keys.
OVERRIDES = [
    "logger=none", "hardware=cpu-8", "language=files", "language.files=[corpus.txt]",
    "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.max_positions=32",
    "model.vocab_size=300", "hardware.per_device_batch_size=1", "trainer.max_steps=4",
    "trainer.log_every_steps=1", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
    "checkpoint.keep_best=0", "samples.prompts=[]",
]
MEASURED = ("time", "train/tokens_per_second")  # wall-clock figures, different every run
# The resumed run continues from the step-2 checkpoint of the very run that logged the expected
# metrics: bit for bit the same state, but steps 3 and 4 (and the evaluation after them) run
# here, on another CPU (whose XLA code rounds otherwise) and another release. 2 steps of 1 layer
# forward and back and one forward pass; the widest reduction is the vocabulary (300; a step's
# targets are 8 × 31).
RESUMED = dict(terms=300, depth=2 * transformer_depth(1, backward=True) + transformer_depth(1))


def _records(path):
    return [{k: v for k, v in json.loads(line).items() if k not in MEASURED}
            for line in open(path, encoding="utf-8")]


@pytest.mark.slow
def test_a_run_stopped_by_an_earlier_release_resumes_to_the_same_metrics(tmp_path, monkeypatch):
    from flaxlm.job import train

    shutil.copytree(DATA / "run", tmp_path / "run")
    shutil.copy(DATA / "corpus.txt", tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    train(compose(OVERRIDES, run_dir="run"))

    resumed = _records(tmp_path / "run" / "metrics.jsonl")
    expected = _records(DATA / "uninterrupted-metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in expected]
    for got, want in zip(resumed, expected):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if key in ("step", "tokens_seen", "epoch"):  # counts, and their ratio in Python
                assert got[key] == value, (got["step"], key)
            else:  # exp makes the loss's absolute error perplexity's relative one: × the loss
                slope = max(1.0, np.log(value)) if key == "eval/perplexity" else 1.0
                assert_close(got[key], value, **RESUMED, amplification=slope,
                             err_msg=f"step {got['step']}: {key}")
