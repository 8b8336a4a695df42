"""End to end: `train(cfg)` on the builtin corpus, and the `flaxlm-train` CLI with a multirun."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from conftest import TINY, compose
from omegaconf import OmegaConf
from wandb_records import items, of_type, read_wandb_records

from flaxlm.job import train

SHORT_RUN = [
    *TINY,
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=10",
    "trainer.max_steps=120",
    "trainer.eval_every_steps=60",
    "trainer.log_every_steps=20",
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
    assert [r["step"] for r in evals] == [0, 60, 120]  # before training, eval_every, the end
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


@pytest.mark.slow
def test_multirun_gives_each_job_its_own_run_dir_and_wandb_run(tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = [o for o in TINY if not o.startswith("logger")]
    result = subprocess.run(
        [sys.executable, "-m", "flaxlm.cli.train", "-m", "optimizer.lr=1e-3,3e-4",
         *overrides, "logger=wandb", "trainer.max_steps=2", "language.max_train_docs=40",
         "language.max_eval_docs=10", f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"}, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job_dirs = sorted(glob.glob(str(sweep_dir / "[0-9]*")))
    assert [os.path.basename(d) for d in job_dirs] == ["0", "1"]
    runs = []
    for job_dir in job_dirs:
        assert any("eval/loss" in r for r in read_metrics(job_dir))
        [log] = glob.glob(os.path.join(job_dir, "wandb", "offline-run-*", "*.wandb"))
        records = read_wandb_records(Path(log))
        [run] = of_type(records, "run")
        runs.append(run)
        config = items(run.config.update)
        assert config["choices"]["model"] == "gpt2-tiny"
        assert any("eval/loss" in items(h.item) for h in of_type(records, "history"))
        assert [e.exit_code for e in of_type(records, "exit")] == [0]
        # The summary: the objective's best so far, and the value the sweeper was handed.
        summary = {}
        for update in of_type(records, "summary"):
            summary.update(items(update.update))
        best = min(r["eval/loss"] for r in read_metrics(job_dir) if "eval/loss" in r)
        assert summary["eval/loss"] == {"min": pytest.approx(best)}
        assert summary["objective"] == pytest.approx(best)
        assert OmegaConf.load(os.path.join(job_dir, "config.yaml")).trainer.objective == (
            "eval/loss")
    assert [items(r.config.update)["optimizer"]["lr"] for r in runs] == [1e-3, 3e-4]
    assert runs[0].run_group == runs[1].run_group == sweep_dir.name
    assert "optimizer.lr=0.001" in runs[0].display_name
    assert "optimizer.lr=0.0003" in runs[1].display_name
