"""End to end: `train(cfg)` on the builtin corpus, and the `flaxlm-train` CLI with a multirun."""

import json
import os

import pytest
import transformers
from conftest import TINY, compose

from flaxlm.job import train

SHORT_RUN = [
    *TINY,
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=5",
    "trainer.max_steps=60",
    "trainer.eval_every_steps=30",
    "trainer.log_every_steps=10",
]


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_short_run_on_the_builtin_corpus_learns(tmp_path):
    run_dir = tmp_path / "run"
    final_loss = train(compose(SHORT_RUN, run_dir=run_dir))

    records = read_metrics(run_dir)
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]  # before training, eval_every, the end
    assert final_loss == evals[-1]["eval/loss"]
    # From uniform over 512 tokens (ln 512 = 6.24 nats) to well below: more than 0.8 nats.
    assert final_loss < evals[0]["eval/loss"] - 0.8
    assert evals[-1]["eval/perplexity"] < 0.45 * evals[0]["eval/perplexity"]
    train_logs = [r for r in records if "train/loss" in r]
    assert len(train_logs) == 6
    for key in ("train/learning_rate", "train/grad_norm", "train/tokens_per_second", "epoch"):
        assert all(key in r for r in train_logs[1:]), key
    assert not any("train/mfu" in r for r in records)  # a CPU's peak is not known: no MFU
    tokens_per_step = 8 * 2 * 64  # TINY: 8 devices × 2 rows × 64 positions
    assert all(r["tokens_seen"] == r["step"] * tokens_per_step for r in train_logs + evals)

    assert (run_dir / "config.yaml").exists()
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "model")
    # A prompt is read as the start of a document: the packed stream's separator, then text.
    ids = tokenizer("Return the value of x.")["input_ids"]
    assert ids[0] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Return the value of x."
    gpt2 = json.loads((run_dir / "model" / "config.json").read_text())
    assert (gpt2["n_layer"], gpt2["eos_token_id"]) == (2, tokenizer.eos_token_id)
    assert (run_dir / "model" / "model.safetensors").exists()
