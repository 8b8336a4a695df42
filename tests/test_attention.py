"""The attention entry point (`flaxlm.models.attention`): every backend computes the reference's
function, forward and backward, for causal, segment-masked and grouped-query attention (the
splash kernel in Pallas interpret mode on this CPU); `xla` is exactly the call that ran before
the backends existed; `auto` picks by platform and chip generation, and a backend that cannot
run where it is asked for is refused before anything compiles, naming model.attention; a
kernel that does not compile anyway is one paragraph, not the compiler's traceback."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY, compose, mesh_config, model_config
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from numerics import assert_close, tolerance, transformer

from flaxlm.config import AttentionBackend
from flaxlm.errors import FlaxlmError
from flaxlm.models.attention import (
    Choice,
    attention,
    choose_backend,
    kernel_compile_error,
    reference_attention,
    splash_attention,
    splash_block_sizes,
)
from flaxlm.models.build import build_lm
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import (
    BATCH_AXES,
    Accelerator,
    accelerator_of,
    make_mesh,
    run_accelerator,
    traced_on,
)
from flaxlm.tasks.base import attention_choice


def softmax_slope(q, k) -> float:
    """exp turns a score's absolute error into its weight's relative error, and a score's
    error is a fraction of the score: the attention's errors carry the largest |score| (at
    least 1) as a factor."""
    group = q.shape[2] // k.shape[2]
    scores = np.einsum("bqnh,bknh->bnqk", np.asarray(q, np.float64),
                       np.repeat(np.asarray(k, np.float64), group, axis=2)) / np.sqrt(q.shape[-1])
    return max(1.0, float(np.abs(scores).max()))


def attention_settings(q, k, *, backward: bool = False) -> dict:
    """Two evaluations of attention (another backend, or order of its sums): the scores (a
    product of the head width H), the softmax and the weighted values (sums over the L keys),
    3 stages, which a gradient goes back through again; × the softmax's slope."""
    return dict(terms=max(k.shape[1], q.shape[-1]), depth=6 if backward else 3,
                amplification=softmax_slope(q, k))


def qkv(seed: int, B: int, L: int, N: int, G: int, H: int, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, L, N, H), dtype),
            jax.random.normal(keys[1], (B, L, G, H), dtype),
            jax.random.normal(keys[2], (B, L, G, H), dtype))


def packed_segments(seed: int, B: int, L: int, max_docs: int = 4) -> jax.Array:
    """Each row's document index, non-decreasing, as packing makes them."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, max_docs, (B, L)), axis=1), jnp.int32)


def run(backend, q, k, v, segment_ids=None, is_causal=True):
    return attention(q, k, v, dropout_rate=0.0, rngs=None, is_causal=is_causal,
                     segment_ids_BxL=segment_ids, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend", "is_causal"))
def loss_and_grads(q, k, v, segment_ids, *, backend, is_causal):
    """The output, and the gradients wrt q, k, v of a fixed random projection of it."""
    probe = jax.random.normal(jax.random.key(99), q.shape, jnp.float32)

    def loss(q, k, v):
        out = run(backend, q, k, v, segment_ids, is_causal)
        return jnp.sum(out.astype(jnp.float32) * probe)

    return run(backend, q, k, v, segment_ids, is_causal), jax.grad(loss, (0, 1, 2))(q, k, v)


def assert_computes_the_reference(backend, q, k, v, segment_ids, is_causal=True):
    out, grads = loss_and_grads(q, k, v, segment_ids, backend=backend, is_causal=is_causal)
    ref_out, ref_grads = loss_and_grads(q, k, v, segment_ids, backend="reference",
                                        is_causal=is_causal)
    assert_close(out, ref_out, **attention_settings(q, k))
    for grad, ref_grad in zip(grads, ref_grads):
        assert_close(grad, ref_grad, **attention_settings(q, k, backward=True))


# ------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("G,causal", [(4, True), pytest.param(2, True, marks=pytest.mark.slow),
                                      pytest.param(1, False, marks=pytest.mark.slow)])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), max_docs=st.integers(1, 6))
def test_xla_computes_the_reference_function(G, causal, seed, max_docs):
    """Multi-head, grouped-query and multi-query; any packing of documents (one document:
    no segment mask to speak of); causal or not. Shapes stay fixed so that each case
    compiles once."""
    q, k, v = qkv(seed, 2, 12, 4, G, 8)
    assert_computes_the_reference("xla", q, k, v, packed_segments(seed, 2, 12, max_docs), causal)


@pytest.mark.parametrize("case", [pytest.param("causal", marks=pytest.mark.slow),
                                  pytest.param("segments", marks=pytest.mark.slow), "gqa"])
def test_splash_computes_the_reference_function_in_interpret_mode(case):
    """One 128-token block (the kernel's smallest), GQA 4 query heads on 2 (or 1) key heads."""
    N, G = (4, 2) if case == "gqa" else (2, 2)
    q, k, v = qkv(1, 1, 128, N, G, 16)
    segments = packed_segments(2, 1, 128) if case in ("segments", "gqa") else None
    assert_computes_the_reference("splash", q, k, v, segments)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), heads=st.sampled_from([(2, 2), (4, 1)]),
       max_docs=st.integers(1, 12))
def test_splash_keeps_documents_apart_for_any_packing(seed, heads, max_docs):
    N, G = heads
    q, k, v = qkv(seed, 1, 128, N, G, 8)
    segments = packed_segments(seed, 1, 128, max_docs)
    assert_close(run("splash", q, k, v, segments), run("reference", q, k, v, segments),
                 **attention_settings(q, k))


@settings(max_examples=200, deadline=None)
@given(q_blocks=st.integers(1, 512), kv_blocks=st.integers(1, 512),
       head_width=st.sampled_from([64, 128, 256]), segments=st.booleans())
def test_splash_blocks_divide_both_lengths_and_grow_only_for_long_rows_of_narrow_heads(
        q_blocks, kv_blocks, head_width, segments):
    """Every block divides its length (the kernel refuses one that does not); the larger
    blocks measured on the chip at 16k tokens with heads of 64 come only there: wider heads
    need more of the kernel's VMEM than those blocks leave, and segment ids take keys of 1024,
    not 2048 (the chip's compiler refused 1024 / 2048 with documents at 16k)."""
    q_len, kv_len = 128 * q_blocks, 128 * kv_blocks
    sizes = splash_block_sizes(q_len, kv_len, head_width, segments)
    for name in ("block_q", "block_q_dkv"):
        assert q_len % sizes[name] == 0
    for name in ("block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute"):
        assert kv_len % sizes[name] == 0
    long_kv = 1024 if segments else 2048
    large = (sizes["block_q"], sizes["block_kv"]) == (1024, long_kv)
    assert large == (kv_len >= 16384 and head_width <= 64
                     and q_len % 1024 == 0 and kv_len % long_kv == 0)
    if not large:
        assert max(sizes["block_q"], sizes["block_kv"]) <= 512
    assert sizes["use_fused_bwd_kernel"]


def test_xla_is_exactly_the_call_that_ran_before_the_backends():
    """The quickstart's figures (and resumed runs) depend on it: same bits, not close ones."""
    q, k, v = qkv(3, 2, 16, 4, 2, 8)
    segments = packed_segments(3, 2, 16)
    same_segment = segments[:, None, :, None] == segments[:, None, None, :]
    before = jax.nn.dot_product_attention(q, k, v, mask=same_segment, is_causal=True)
    np.testing.assert_array_equal(run("xla", q, k, v, segments), before)
    np.testing.assert_array_equal(run("xla", q, k, v),
                                  jax.nn.dot_product_attention(q, k, v, is_causal=True))


def test_training_with_attention_dropout_takes_the_reference_path_whatever_the_backend():
    q, k, v = qkv(4, 1, 128, 2, 2, 8)
    segments = packed_segments(4, 1, 128)
    outs = [attention(q, k, v, dropout_rate=0.3, rngs=nnx.Rngs(dropout=7), is_causal=True,
                      segment_ids_BxL=segments, backend=backend)
            for backend in ("reference", "xla", "splash")]
    dropped = reference_attention(q, k, v, None, True, segments, 0.3, nnx.Rngs(dropout=7).dropout())
    for out in outs:
        np.testing.assert_array_equal(out, dropped)


def test_splash_runs_per_device_under_a_mesh_as_it_does_on_one():
    """Inside a step traced on a mesh the kernel runs under shard_map, each device on its
    rows (and heads, with a tensor axis); the result is the one-device result."""
    mesh = make_mesh(8, mesh_config(data=2, fsdp=2, tensor=2))
    q, k, v = qkv(5, 4, 128, 4, 2, 8)
    segments = packed_segments(5, 4, 128)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))  # as the step's batch arrives
    placed = [jax.device_put(x, rows) for x in (q, k, v, segments)]
    step = traced_on(mesh, lambda q, k, v, s: splash_attention(q, k, v, True, s))
    assert "shard_map" in str(jax.make_jaxpr(step)(*placed))
    assert_close(jax.jit(step)(*placed), run("reference", q, k, v, segments),
                 **attention_settings(q, k))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_with_splash_computes_what_it_computes_with_xla(family):
    """The backend reaches every block: the whole model's logits agree, packed documents and
    (Llama) grouped-query attention included."""
    fields = dict(num_layers=2, hidden_size=32, num_heads=4, max_positions=128, vocab_size=64,
                  attention_dropout=0.0)
    if family == "llama":
        fields["num_kv_heads"] = 2
    logits = {}
    ids = jax.random.randint(jax.random.key(0), (1, 128), 0, 64)
    segments = packed_segments(6, 1, 128)
    for backend in ("xla", "splash"):
        config = model_config(family, attention=backend, **fields)
        model = build_lm(TransformerSpec(config), nnx.Rngs(0))
        logits[backend] = model(ids, None, segment_ids_BxL=segments)
    # The same model, its attention's sums in another order: 2 layers, the sequence (128) the
    # widest reduction.
    assert_close(logits["splash"], logits["xla"], **transformer(2, 128))


# ---------------------------------------------------------------------- selection


@pytest.mark.parametrize("platform,dtype,seq_len,head_width,causal_lm,expected", [
    ("cpu", "float32", 2048, 64, True, "xla"),
    ("cpu", "bfloat16", 2048, 64, True, "xla"),
    ("gpu", "bfloat16", 2048, 64, True, "cudnn"),
    ("gpu", "float16", 2048, 128, True, "cudnn"),
    ("gpu", "float32", 2048, 64, True, "xla"),  # cuDNN's flash attention: half precision only
    ("gpu", "bfloat16", 2048, 256, True, "xla"),  # heads wider than it takes everywhere
    ("gpu", "bfloat16", 2047, 64, True, "xla"),  # it trains on even lengths
    ("tpu", "bfloat16", 2048, 64, True, "splash"),
    ("tpu", "float32", 384, 64, True, "splash"),
    ("tpu", "bfloat16", 1000, 64, True, "xla"),  # no kernel block divides the sequence
    ("tpu", "bfloat16", 2048, 64, False, "xla"),  # a classifier's padding mask
])
def test_auto_picks_by_platform_dtype_and_shape(platform, dtype, seq_len, head_width, causal_lm,
                                                expected):
    choice = choose_backend("auto", Accelerator(platform), dtype, seq_len, head_width,
                            causal_lm=causal_lm)
    assert choice.backend is AttentionBackend(expected)
    assert choice.describe() == f"attention {expected} (auto on {platform})"


@pytest.mark.parametrize("requested,platform,dtype,seq_len,named", [
    ("cudnn", "cpu", "float32", 2048, "NVIDIA GPU"),
    ("cudnn", "tpu", "bfloat16", 2048, "NVIDIA GPU"),
    ("cudnn", "gpu", "float32", 2048, "bfloat16 or float16"),
    ("splash", "cpu", "float32", 2048, "TPU"),
    ("splash", "gpu", "bfloat16", 2048, "TPU"),
    ("splash", "tpu", "bfloat16", 1000, "task.max_seq_length"),
    ("flash", "gpu", "bfloat16", 2048, "auto, xla, cudnn, splash, reference"),
])
def test_a_backend_that_cannot_run_here_is_refused_naming_what_to_set(requested, platform, dtype,
                                                                      seq_len, named):
    with pytest.raises(FlaxlmError) as error:
        choose_backend(requested, Accelerator(platform), dtype, seq_len, 64)
    message = str(error.value)
    assert f"model.attention={requested}" in message.replace("'", "") and named in message
    assert "\n" not in message


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_xla_and_reference_run_everywhere(backend, platform):
    assert choose_backend(backend, Accelerator(platform), "float32", 100,
                          256).backend.value == backend


def test_the_banner_says_when_training_drops_out_on_the_reference_path():
    choice = choose_backend("auto", Accelerator("tpu", "TPU v4"), "bfloat16", 1024, 64,
                            attention_dropout=0.1)
    assert choice.backend is AttentionBackend.splash
    assert choice.describe() == ("attention splash (auto on TPU v4), reference while training "
                                 "(attention dropout)")
    assert choose_backend("xla", Accelerator("cpu"), "float32", 64, 16).describe() == \
        "attention xla"


def test_the_run_resolves_its_backend_from_its_config():
    """model.attention's default is auto (conf/), which the quickstart's CPU run takes as xla;
    a TPU preset's llama takes splash, on a TPU v4 or newer (a plan from this CPU reads the
    chips from hardware.topology)."""
    from omegaconf import OmegaConf

    quickstart = OmegaConf.to_object(compose(TINY))
    assert quickstart.model.attention is AttentionBackend.auto
    assert attention_choice(quickstart, quickstart.model,
                            pads_rows=False).backend is AttentionBackend.xla
    tpu = OmegaConf.to_object(compose(["model=llama-tiny", "hardware=tpu-v5e-8",
                                       "task.max_seq_length=256"]))
    assert run_accelerator(tpu.hardware) == Accelerator("tpu", "TPU v5e")
    assert attention_choice(tpu, tpu.model, pads_rows=False).backend is AttentionBackend.splash
    # A task whose rows are padded (a classifier) needs the padding mask splash does not take.
    assert attention_choice(tpu, tpu.model, pads_rows=True).backend is AttentionBackend.xla
    v3 = OmegaConf.to_object(compose(["model=llama-tiny", "hardware=tpu-v3-8",
                                      "task.max_seq_length=256"]))
    assert attention_choice(v3, v3.model, pads_rows=False).describe() == (
        "attention xla (auto on TPU v3; the splash kernel does not compile in bfloat16 before "
        "TPU v4)")


# Chips as JAX names them (`device_kind`), and their generations.
TPU_KINDS = {"TPU v2": 2, "TPU v3": 3, "TPU v4": 4, "TPU v5 lite": 5, "TPU v5": 5, "TPU v5p": 5,
             "TPU v6 lite": 6, "TPU7x": 7, "TPU v5e": 5, "a TPU of a name unknown": None}


@pytest.mark.parametrize("kind", sorted(TPU_KINDS))
def test_auto_takes_splash_in_half_precision_only_from_tpu_v4(kind):
    """Mosaic compiles no bfloat16 matmul for TPU v2 and v3: auto takes xla there and says
    why; splash asked for is refused before anything compiles. In float32 it compiles. A kind
    that does not say its generation is not held back."""
    chip = Accelerator("tpu", kind)
    assert chip.tpu_generation == TPU_KINDS[kind]
    old = TPU_KINDS[kind] in (2, 3)
    choice = choose_backend("auto", chip, "bfloat16", 1024, 64)
    assert choice.backend is (AttentionBackend.xla if old else AttentionBackend.splash)
    assert choice.reason == (f"auto on {kind}; the splash kernel does not compile in bfloat16 "
                             "before TPU v4" if old else f"auto on {kind}")
    assert choose_backend("auto", chip, "float32", 1024, 64).backend is AttentionBackend.splash
    if old:
        with pytest.raises(FlaxlmError, match=(
                rf"model.attention=splash cannot run here: the splash kernel does not compile "
                rf"in bfloat16 before TPU v4, and this run is on {kind} .*"
                r"hardware.compute_dtype=float32.*model.attention=auto")):
            choose_backend("splash", chip, "bfloat16", 1024, 64)
    else:
        assert choose_backend("splash", chip, "bfloat16", 1024, 64).backend.value == "splash"


# NVIDIA GPUs as JAX names them, with their compute capabilities.
GPUS = [("Tesla T4", "7.5"), ("Tesla V100-SXM2-16GB", "7.0"), ("NVIDIA A100-SXM4-40GB", "8.0"),
        ("NVIDIA A10G", "8.6"), ("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA B200", "10.0"),
        ("an unknown GPU", "")]


@pytest.mark.parametrize("kind,capability", GPUS)
def test_auto_takes_cudnn_only_from_compute_capability_8(kind, capability):
    """cuDNN's fused attention needs an Ampere-or-newer GPU (compute capability 8.0): on a T4
    or V100 auto takes xla and says why, and cudnn asked for is refused; a GPU whose compute
    capability is unknown is not held back."""
    gpu = accelerator_of(type("Device", (), {"platform": "gpu", "device_kind": kind,
                                             "compute_capability": capability})())
    assert gpu == Accelerator("gpu", kind, capability)
    old = capability in ("7.5", "7.0")
    choice = choose_backend("auto", gpu, "bfloat16", 2048, 64)
    assert choice.backend is (AttentionBackend.xla if old else AttentionBackend.cudnn)
    assert choice.reason == (f"auto on {kind}; cuDNN's fused attention needs compute "
                             "capability 8.0 (Ampere) or newer" if old else f"auto on {kind}")
    if old:
        with pytest.raises(FlaxlmError, match=(
                rf"model.attention=cudnn cannot run here: .*8.0 \(Ampere\) or newer, and this "
                rf"run is on {kind} \(compute capability {capability}\)")):
            choose_backend("cudnn", gpu, "bfloat16", 2048, 64)
    else:
        assert choose_backend("cudnn", gpu, "bfloat16", 2048, 64).backend.value == "cudnn"


# What jax raises when Mosaic refuses the splash kernel (planning gpt2-xl for a TPU v3 with a
# splash kernel in bfloat16): the error jax's Pallas raises, from XLA's.
MOSAIC_SAYS = ("INTERNAL: Mosaic failed to compile TPU kernel: E2001: "
               "CompileTimeMosaicUnsupportedRhsType: Unsupported matmul RHS type on target: "
               "vector<128x128xbf16>")


def mosaic_error() -> Exception:
    from jax._src.pallas.mosaic.error_handling import MosaicError

    try:
        try:
            raise jax.errors.JaxRuntimeError(f"{MOSAIC_SAYS}\n\nThe MLIR operation involved:\n"
                                             "  %1275 = \"tpu.matmul\"(...)")
        except jax.errors.JaxRuntimeError as xla:
            raise MosaicError(f"{MOSAIC_SAYS}\n\nThe MLIR operation involved:") from xla
    except MosaicError as err:
        return err


def test_a_kernel_the_compiler_refuses_is_one_paragraph_naming_xla():
    splash = Choice(AttentionBackend.splash, "auto on TPU v4", dropout=False)
    error = kernel_compile_error(RuntimeError("while compiling"), splash)
    assert error is None  # not the kernel's
    wrapped = RuntimeError("while compiling")
    wrapped.__cause__ = mosaic_error()
    error = kernel_compile_error(wrapped, splash)
    assert str(error) == (
        "A step did not compile: Mosaic refused the splash attention kernel (attention splash "
        f"(auto on TPU v4)): {MOSAIC_SAYS}. Set model.attention=xla, which compiles on every "
        "device (this run has model.attention=auto).")
    # Mosaic's words mean nothing to a run on another backend, and running out of memory is
    # not a kernel's refusal, whatever buffers the message lists.
    xla = Choice(AttentionBackend.xla, "auto on TPU v4", dropout=False)
    assert kernel_compile_error(mosaic_error(), xla) is None
    assert kernel_compile_error(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\n  mosaic custom call"),
        splash) is None
    # A kernel's blocks larger than a core's VMEM is flaxlm's choice, not the run's memory: no
    # remat or smaller batch helps, whatever "RESOURCE_EXHAUSTED" suggests.
    vmem = kernel_compile_error(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Scoped allocation with size "
        "20.00M and limit 16.00M exceeded scoped vmem limit"), splash)
    assert "VMEM" in str(vmem) and "model.attention=xla" in str(vmem)
    assert "Scoped allocation with size 20.00M" in str(vmem)
    cudnn = Choice(AttentionBackend.cudnn, "", dropout=False)
    refused = kernel_compile_error(jax.errors.JaxRuntimeError(
        "INTERNAL: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED\nin fused attention"), cudnn)
    assert "cuDNN refused the cudnn attention kernel (attention cudnn): INTERNAL: cuDNN error: " \
           "CUDNN_STATUS_NOT_SUPPORTED. Set model.attention=xla" in str(refused)
    assert "this run has model.attention=cudnn" in str(refused)


@pytest.mark.slow
def test_a_training_run_whose_kernel_does_not_compile_exits_2_with_one_paragraph(
        tmp_path, monkeypatch, train_cli):
    """A kernel that does not compile when the first step does: its run stops with one
    paragraph naming the backend and model.attention=xla, no traceback, and its status says
    it. (On this CPU the run takes xla; the kernel and its refusal are stood in for.)"""
    from flaxlm import job

    def splash_on_a_tpu(config, model, pads_rows):
        return Choice(AttentionBackend.splash, "auto on TPU v4", dropout=False)

    def refused(*args, **kwargs):
        raise mosaic_error()

    monkeypatch.setattr(job, "attention_choice", splash_on_a_tpu)
    monkeypatch.setattr(jax.nn, "dot_product_attention", refused)
    run_dir = tmp_path / "run"
    done = train_cli(*TINY, "model.attention_dropout=0", "trainer.max_steps=1",
                     "trainer.eval_before_training=false",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "MLIR" not in done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("flaxlm: error: A step did not compile: Mosaic refused the "
                              "splash attention kernel")
    assert "Set model.attention=xla" in message
    assert "Mosaic refused" in (run_dir / "status.json").read_text()


# ------------------------------------------------------------------ backends script


@pytest.mark.slow
def test_the_backends_script_runs_on_tiny_shapes_on_a_cpu(tmp_path):
    """benchmarks/attention_backends.py on this CPU: xla, reference and splash (interpret
    mode) in float32 and bfloat16 against the float32 reference; cudnn fails soft (no GPU)
    and the table and JSON still come out."""
    out = tmp_path / "attention.json"
    # src first, and whatever else the path holds (a TPU VM's packages live there).
    path = [os.path.join(REPO, "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "attention_backends.py"), "--tiny",
         "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {row["backend"] for row in rows} == {"xla", "reference", "cudnn", "splash"}
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"}
    assert all(row["error"] for row in rows if row["backend"] == "cudnn")
    # rel_diff is the largest difference over the reference's largest magnitude: what
    # assert_close's absolute floor bounds. Its inputs give the softmax's slope. A bfloat16 row
    # rounds each stage's output to bfloat16 once (its products summed in float32), a bound
    # that the slope makes loose: it is also held to twice the bfloat16 reference's own error,
    # as tests/test_tpu.py holds splash on the chip (a wrong mask or scale is off by order one).
    script = importlib.util.spec_from_file_location(
        "attention_backends", os.path.join(REPO, "benchmarks", "attention_backends.py"))
    module = importlib.util.module_from_spec(script)
    script.loader.exec_module(module)
    [case] = module.TINY_CASES
    floor = {(row["mask"], key): row[key] for row in rows
             if row["backend"] == "reference" and row["dtype"] == "bfloat16"
             for key in ("rel_diff_out", "rel_diff_grad")}
    for row in rows:
        if row["backend"] in ("xla", "splash"):
            q, k, *_ = module.inputs(*case, segmented=row["mask"] == "causal+segments")
            stages = attention_settings(q, k)
            if row["dtype"] == "bfloat16":
                stages["terms"] = 1
            for key, depth in (("rel_diff_out", 3), ("rel_diff_grad", 6)):
                assert row[key] < tolerance(row["dtype"], **dict(stages, depth=depth)), row
                if row["dtype"] == "bfloat16":
                    assert row[key] <= 2 * max(floor[row["mask"], key], 2**-9), row
    assert "backend" in done.stdout
