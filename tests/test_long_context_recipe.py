"""The long-context recipe's CPU rehearsal (experiment=llama-tiny-long-offline): YaRN over the
rows under the context axis, with documents, trains, evaluates by position and checkpoints."""

from __future__ import annotations

import math

import pytest
from conftest import metrics_of

from flaxlm.models import attention, llama


@pytest.mark.slow
def test_the_offline_long_context_recipe_trains_with_yarn_under_the_context_axis(
        train_cli, tmp_path, monkeypatch):
    """Narrowed to a width of 64 and one step, the preset still runs its rows of 1024 with
    YaRN's frequencies over llama-tiny's 256 and attention split over 8 context devices; its
    evaluation logs a finite loss for each of the three position buckets, and it saves."""
    yarn_settings, context_calls = [], []

    def spied_yarn(base_R, theta, scaling):
        yarn_settings.append(scaling)
        return real_yarn(base_R, theta, scaling)

    def spied_context(*args, **kwargs):
        context_calls.append(args[0].shape)  # the queries as the axis's devices hold them
        return real_context(*args, **kwargs)

    real_yarn, real_context = llama.yarn_frequencies, attention.context_attention
    monkeypatch.setattr(llama, "yarn_frequencies", spied_yarn)
    monkeypatch.setattr(attention, "context_attention", spied_context)
    run_dir = tmp_path / "run"
    result = train_cli("experiment=llama-tiny-long-offline", "model.hidden_size=64",
                       "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_size=128",
                       "model.vocab_size=512", "logger=none", "trainer.max_steps=1",
                       "optimizer.warmup_steps=0",
                       "trainer.eval_every_steps=1", "checkpoint.every_steps=1",
                       "language.max_train_docs=20", "language.max_eval_docs=4",
                       f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    assert {(s.type, s.factor, s.original_max_positions) for s in yarn_settings} == {
        ("yarn", 4.0, 256)}
    assert context_calls, "attention never went through the context axis"
    last = [record for record in metrics_of(run_dir) if "eval/loss" in record][-1]
    for bucket in ("0-256", "256-512", "512-1024"):
        loss = last[f"eval/position/{bucket}/loss"]
        assert math.isfinite(loss) and loss > 0, bucket
    assert (run_dir / "checkpoints" / "1").is_dir()
