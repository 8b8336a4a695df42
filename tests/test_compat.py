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

import pytest
from conftest import compose

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
            assert got[key] == pytest.approx(value, rel=1e-5), (got["step"], key)
