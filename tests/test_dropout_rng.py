"""hardware.dropout_rng: the run's keys made on the host are JAX's own, bit for bit; auto picks
the TPU's RngBitGenerator there and Threefry elsewhere; a run with rbg dropout trains, draws
other masks than Threefry's, resumes exactly, and refuses to resume with another generator."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from conftest import TINY, compose, metrics_of, stop_at

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.training.keys import dropout_impl, run_keys
from flaxlm.training.stop import Preempted


def data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


@pytest.mark.parametrize("seed", [0, 42, -7])
def test_an_rbg_dropout_key_made_on_the_host_is_jax_randoms_own(seed):
    rbg = run_keys(seed, "rbg")[1]
    assert str(jax.random.key_impl(rbg)) == "rbg"
    np.testing.assert_array_equal(data(rbg),
                                  data(jax.random.split(jax.random.key(seed, impl="rbg"))[1]))
    assert str(jax.random.key_impl(run_keys(seed, "unsafe_rbg")[1])) == "unsafe_rbg"


def test_auto_is_unsafe_rbg_on_a_tpu_and_threefry_elsewhere():
    assert dropout_impl("auto", "tpu") == "unsafe_rbg"
    assert dropout_impl("auto", "cpu") == dropout_impl("auto", "gpu") == "threefry2x32"
    assert dropout_impl("threefry", "tpu") == "threefry2x32"
    assert dropout_impl("unsafe_rbg", "cpu") == "unsafe_rbg"


# 6 steps, checkpoints every 2; gpt2's dropout (0.1 everywhere) on.
RUN = [*TINY, "language.max_train_docs=8", "language.max_eval_docs=2", "trainer.max_steps=6",
       "trainer.log_every_steps=1", "checkpoint.every_steps=2",
       "trainer.eval_before_training=false"]
RBG = [*RUN, "hardware.dropout_rng=unsafe_rbg"]  # what auto comes to on a TPU
NO_DROPOUT = ["model.hidden_dropout=0", "model.embedding_dropout=0", "model.attention_dropout=0"]


def train_losses(run_dir) -> list[float]:
    return [record["train/loss"] for record in metrics_of(run_dir) if "train/loss" in record]


@pytest.mark.slow
def test_rbg_dropout_trains_and_resumes_exactly_in_its_own_generator_only(
        tmp_path, monkeypatch, capsys):
    train(compose(RBG, run_dir=tmp_path / "straight"))
    rbg = train_losses(tmp_path / "straight")
    assert len(rbg) == 6 and all(math.isfinite(loss) for loss in rbg)
    # Dropout is on, and its masks are rbg's: the losses differ from no dropout's and from
    # Threefry's (the CPU's default, which the first step's equal weights would otherwise match).
    train(compose([*RBG, *NO_DROPOUT], run_dir=tmp_path / "no-dropout"))
    train(compose(RUN, run_dir=tmp_path / "threefry"))
    assert rbg[0] != train_losses(tmp_path / "no-dropout")[0]
    assert rbg[0] != train_losses(tmp_path / "threefry")[0]

    with monkeypatch.context() as patch:
        stop_at(patch, 3)
        with pytest.raises(Preempted):
            train(compose(RBG, run_dir=tmp_path / "resumed"))
    # On a CPU, auto comes to threefry: the checkpoint's unsafe_rbg key cannot continue there.
    with pytest.raises(FlaxlmError) as refused:
        train(compose(RUN, run_dir=tmp_path / "resumed"))
    assert "with the unsafe_rbg generator" in str(refused.value)
    assert "Resume with hardware.dropout_rng=unsafe_rbg" in str(refused.value)
    capsys.readouterr()
    train(compose(RBG, run_dir=tmp_path / "resumed"))
    assert "from its checkpoint at step 3" in capsys.readouterr().out
    assert metrics_of(tmp_path / "resumed") == metrics_of(tmp_path / "straight")
