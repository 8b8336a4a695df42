"""What only a real TPU shows: the splash kernel compiled by Mosaic (not interpreted) against
the reference in bfloat16, a train step on the chip that lowers the loss, a checkpoint saved
from and restored to the chip's memory, and generation with the KV cache on the chip.

Run on a TPU VM, in one process (one program at a time holds the chip):
    FLAXLM_TEST_TPU=1 python -m pytest -m tpu tests/test_tpu.py
Elsewhere they are skipped with that reason (conftest.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import compose, config_node, leaves_equal
from flax import nnx

from flaxlm.generate import GenerationSettings, generate_ids
from flaxlm.models.attention import reference_attention, splash_attention
from flaxlm.models.layers import TransformerSpec
from flaxlm.models.llama import LlamaForCausalLM
from flaxlm.training.checkpoint.manager import Checkpointer
from flaxlm.training.step import create_state

pytestmark = pytest.mark.tpu


def rms(x) -> float:
    return float(jnp.sqrt(jnp.mean(jnp.square(jnp.asarray(x, jnp.float32)))))


def relative_error(x, exact) -> float:
    return rms(jnp.asarray(x, jnp.float32) - exact) / rms(exact)


def test_the_chip_is_a_tpu():
    assert jax.default_backend() == "tpu", jax.devices()


def test_splash_compiled_for_the_chip_computes_the_reference_in_bfloat16():
    """Forward and gradients of splash attention (causal, packed documents, grouped-query) in
    bfloat16 are as close to the exact function as the bfloat16 reference path is: the exact
    one is the reference in float32 at full matmul precision on the same bfloat16 inputs. A
    wrong mask or scale is off by order one; bfloat16's own rounding is about 2⁻⁸."""
    B, L, N, G, H = 2, 1024, 8, 2, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, L, heads, H), jnp.bfloat16)
               for key, heads in zip(keys, (N, G, G)))
    segments = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 5, (B, L)), 1), jnp.int32)
    probe = jax.random.normal(keys[3], (B, L, N, H), jnp.float32)

    def value_and_grads(attend):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * probe)
        out = attend(q, k, v)
        return out, jax.grad(loss, (0, 1, 2))(q, k, v)

    splash = jax.jit(lambda q, k, v: splash_attention(q, k, v, True, segments))
    bf16_reference = jax.jit(lambda q, k, v: reference_attention(q, k, v, None, True, segments))

    def exact(q, k, v):
        with jax.default_matmul_precision("highest"):
            as_f32 = (x.astype(jnp.float32) for x in (q, k, v))
            return reference_attention(*as_f32, None, True, segments)

    exact_out, exact_grads = jax.jit(lambda: value_and_grads(exact))()
    out, grads = value_and_grads(splash)
    ref_out, ref_grads = value_and_grads(bf16_reference)
    assert relative_error(ref_out, exact_out) < 2**-6  # the reference is right in bfloat16
    assert relative_error(out, exact_out) <= 2 * max(relative_error(ref_out, exact_out), 2**-9)
    for grad, ref_grad, exact_grad in zip(grads, ref_grads, exact_grads):
        assert relative_error(grad, exact_grad) <= 2 * max(relative_error(ref_grad, exact_grad),
                                                           2**-9)


def test_splash_under_the_context_axis_and_in_the_balanced_order_computes_xla_attention():
    """On one chip, the context axis' splash path compiled by Mosaic: `context_attention` with
    the kernel on a mesh whose context axis has one device (the kernel's mask sharded by
    `q_seq_shards`, the keys all-gathered), and the kernel over queries in the balanced order
    of a context axis of 4 (the causal mask at the queries' places, with the blocks that
    order empties skipped), each with packed documents and grouped-query heads, forward and
    gradients, against attention in float32 on the same inputs: as close as the bfloat16
    reference path is (bfloat16's rounding is about 2⁻⁸; a key seen from the wrong place is
    off by order one)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from flaxlm.config import AttentionBackend
    from flaxlm.models.attention import context_attention, splash_block_sizes
    from flaxlm.models.context_parallel import balanced_order, splash_causal_mask
    from flaxlm.parallel import make_mesh

    B, L, N, G, H = 2, 2048, 8, 2, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, L, heads, H), jnp.bfloat16)
               for key, heads in zip(keys, (N, G, G)))
    segments = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 5, (B, L)), 1), jnp.int32)
    probe = jax.random.normal(keys[3], (B, L, N, H), jnp.float32)
    order = balanced_order(L, 4)

    def value_and_grads(attend, probe=probe):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * probe)
        return jax.jit(lambda q, k, v: (attend(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)))(
            q, k, v)

    def exact(q, k, v):
        with jax.default_matmul_precision("highest"):
            as_f32 = (x.astype(jnp.float32) for x in (q, k, v))
            return reference_attention(*as_f32, None, True, segments)

    mesh = make_mesh(1)

    def context_path(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return context_attention(q, k, v, True, segments, AttentionBackend.splash)

    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash_causal_mask(L, order)] * N), head_shards=1,
        q_seq_shards=1, block_sizes=splash.BlockSizes(**splash_block_sizes(L // 8, L, H)))

    def balanced(q, k, v):  # the queries in the balanced order, the keys in the row's
        def one_row(q_LxNxH, k_LxGxH, v_LxGxH, segments_L):
            q_NxLxH = jnp.swapaxes(q_LxNxH[order], 0, 1) / np.sqrt(H).astype(q.dtype)
            return kernel(q_NxLxH, jnp.swapaxes(k_LxGxH, 0, 1), jnp.swapaxes(v_LxGxH, 0, 1),
                          splash.SegmentIds(segments_L[order], segments_L))
        return jnp.swapaxes(jax.vmap(one_row)(q, k, v, segments), 1, 2)

    exact_out, exact_grads = value_and_grads(exact)
    ref_out, ref_grads = value_and_grads(
        lambda q, k, v: reference_attention(q, k, v, None, True, segments))
    assert relative_error(ref_out, exact_out) < 2**-6  # the reference is right in bfloat16
    bound = 2 * max(relative_error(ref_out, exact_out), 2**-9)

    out, grads = value_and_grads(context_path)
    assert relative_error(out, exact_out) <= bound
    # The balanced kernel's outputs are in its queries' order: the probe taken in that order.
    out, grads_balanced = value_and_grads(balanced, probe[:, order])
    assert relative_error(out, exact_out[:, order]) <= bound
    for pair in (grads, grads_balanced):
        for grad, ref_grad, exact_grad in zip(pair, ref_grads, exact_grads):
            assert relative_error(grad, exact_grad) <= 2 * max(
                relative_error(ref_grad, exact_grad), 2**-9)


def tiny_llama(tmp_path, *overrides):
    return compose([
        "model=llama-tiny", "model.num_layers=2", "model.hidden_size=128", "model.num_heads=4",
        "model.num_kv_heads=2", "model.mlp_size=256", "model.vocab_size=1024",
        "task.max_seq_length=256", "hardware=tpu", "hardware.per_device_batch_size=8",
        "logger=none", "samples.prompts=[The]", "language.max_eval_docs=6",
        "trainer.max_steps=60", "trainer.eval_every_steps=30", "checkpoint.every_steps=30",
        "optimizer.lr=3e-3", "optimizer.warmup_steps=5", *overrides], run_dir=tmp_path / "run")


def test_a_run_on_the_chip_trains_with_splash_lowers_the_loss_and_exports(tmp_path, capsys):
    from flaxlm.job import train

    train(tiny_llama(tmp_path))
    assert "attention splash (auto on" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_a_checkpoint_is_saved_from_and_restored_to_the_chip(tmp_path):
    model_settings = config_node("model", ["model=llama-tiny"], num_layers=2, hidden_size=64,
                                 num_heads=4, num_kv_heads=2, mlp_size=128, vocab_size=256)
    model = LlamaForCausalLM(TransformerSpec(model_settings, jnp.bfloat16, jnp.float32),
                             nnx.Rngs(params=0))
    _, state = create_state(model, optax.adamw(1e-3))
    assert {d.platform for leaf in jax.tree.leaves(state) for d in leaf.devices()} == {"tpu"}
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(7, state, {"step": 7}, {"config": {}})
    checkpointer.wait()
    restored = checkpointer.restore_latest(jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), state))
    checkpointer.close()
    assert restored.step == 7
    assert leaves_equal(restored.state, state)
    assert {d.platform for leaf in jax.tree.leaves(restored.state)
            for d in leaf.devices()} == {"tpu"}


def test_generation_with_the_kv_cache_on_the_chip_equals_recomputing_the_prefix():
    """Greedy tokens from the cached decode equal those of the full forward pass over the
    whole prefix at each step, at full float32 matmul precision, where a wrong position or
    mask changes the tokens of a random model with a wide initialisation."""
    settings_ = config_node("model", ["model=llama-tiny"], num_layers=2, hidden_size=64,
                            num_heads=4, num_kv_heads=2, mlp_size=128, vocab_size=97,
                            max_positions=64, initializer_range=0.2)
    model = LlamaForCausalLM(TransformerSpec(settings_, jnp.float32, jnp.float32),
                             nnx.Rngs(params=0))
    prompts = [np.random.default_rng(n).integers(0, 97, n).tolist() for n in (3, 9, 1, 20)]
    full = nnx.jit(lambda model, ids: model(ids))
    with jax.default_matmul_precision("highest"):
        cached = generate_ids(model, prompts, GenerationSettings(max_new_tokens=12, greedy=True),
                              eos_token_id=None)
        for prompt, tokens in zip(prompts, cached):
            ids = list(prompt)
            for _ in range(12):
                padded = np.zeros((1, 64), np.int32)
                padded[0, : len(ids)] = ids
                ids.append(int(jnp.argmax(full(model, jnp.asarray(padded))[0, len(ids) - 1])))
            assert tokens == ids[len(prompt):]
    assert len({tuple(tokens) for tokens in cached}) == len(prompts)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_block_keeps_the_kernels_residuals_and_gives_the_gradients_of_no_remat(
        scan_layers):
    """model.remat=block keeps what the splash kernel hands its backward pass (named
    KERNEL_RESIDUALS) instead of running the kernel again: the same gradients as without
    remat, up to bfloat16's rounding of what it recomputes (2⁻⁸ per element; a dropped
    residual or a wrong policy is off by order one)."""
    def grads(remat):
        settings_ = config_node("model", ["model=llama-tiny"], num_layers=2, hidden_size=256,
                                num_heads=4, num_kv_heads=2, mlp_size=512, vocab_size=512,
                                max_positions=1024, attention="splash", remat=remat,
                                scan_layers=scan_layers)
        model = LlamaForCausalLM(TransformerSpec(settings_, jnp.bfloat16, jnp.float32),
                                 nnx.Rngs(params=0))
        ids = jax.random.randint(jax.random.key(1), (2, 1024), 0, 512)

        def loss(model):
            logits = model(ids).astype(jnp.float32)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
        return jax.tree.leaves(nnx.jit(nnx.grad(loss))(model))

    for block, none in zip(grads("block"), grads("none"), strict=True):
        assert relative_error(block, none) < 2**-7


def test_megablox_and_ragged_dispatch_on_the_chip_compute_the_dense_reference():
    """The MoE MLP's grouped matmul compiled for the chip (megablox's Pallas kernel, and
    ragged_dot as the TPU runs it), forward and gradients (the tokens', the routing
    weights' and the experts' matrices') in float32, against every token through every
    expert. Both are sums of D or F products per element (the matrices' gradients of a
    group's rows), as the reference's: at the chip's default float32 matmul precision
    (bfloat16 passes) they differ from it by rounding of about 2⁻⁸ of their size, a dropped
    or misrouted copy, or a wrongly transposed matrix, by order one."""
    import dataclasses

    from flaxlm.config import MoeDispatch
    from flaxlm.models import moe

    cfg = config_node("model", ["model=moe-tiny"], init_from=None)
    T, K = 4096, cfg.moe.top_k
    layer = moe.MoeMLP(TransformerSpec(cfg), nnx.Rngs(0), shared_mlp=None)
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.hidden_size), jnp.float32)
    logits = jax.random.normal(jax.random.key(2), (1, T, cfg.moe.num_experts))
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), K)
    matrices = layer.experts.matrices()

    class Experts:  # the layer's experts, their matrices an argument to differentiate
        activation = staticmethod(layer.experts.activation)

        def __init__(self, matrices):
            self.held = matrices

        def matrices(self):
            return self.held

    def value_and_grads(dispatch):
        settings = dataclasses.replace(cfg.moe, dispatch=MoeDispatch(dispatch))

        @jax.jit
        def run(x, weights, matrices):
            def loss(x, weights, matrices):
                out, _ = moe.dispatch(x, experts, weights, Experts(matrices), settings)
                return jnp.sum(out ** 2), out
            (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
                x, weights, matrices)
            return out, grads

        return run(x, weights, matrices)

    exact = value_and_grads("dense")
    for dispatch in ("megablox", "ragged"):
        out, (grad_x, grad_weights, grad_matrices) = value_and_grads(dispatch)
        assert relative_error(out, exact[0]) < 2**-6, dispatch
        assert relative_error(grad_x, exact[1][0]) < 2**-6, dispatch
        assert relative_error(grad_weights, exact[1][1]) < 2**-6, dispatch
        for name, grad, reference in zip(moe.EXPERT_MATRICES, grad_matrices, exact[1][2],
                                         strict=True):
            assert relative_error(grad, reference) < 2**-6, (dispatch, name)
