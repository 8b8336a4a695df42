"""Attention, the one entry point every model family calls, and its interchangeable backends.

`model.attention` names the backend (`AttentionBackend`); every backend computes the same
function, softmax(q·kᵀ/√H)·v over the keys each query may see, and takes the same masks:
causal, segment ids (a packed block's documents, `task.document_masking`), grouped-query
attention (keys and values with G heads, G dividing N; query head n reads key head n // (N/G))
and a sliding window (`model.sliding_window` W: query i sees keys i - W + 1 … i, itself and the
W - 1 before it, as transformers' Mistral and Qwen2 count; within a document the places in the
row are its positions).

- `reference`: spelled out with einsums, the softmax in float32; builds the L×K scores. The
  only path that can drop attention probabilities out, so a model that trains with
  attention dropout uses it in training whatever the setting says (evaluation does not).
- `xla`: `jax.nn.dot_product_attention(implementation="xla")`, what XLA fuses on any device.
- `cudnn`: the same call with `implementation="cudnn"`: cuDNN's fused flash attention on an
  NVIDIA GPU, bfloat16/float16 only; the causal mask is never built, segment ids enter as a
  mask (cuDNN takes it as a B×1×L×K bias). Not with a sliding window (`WINDOW_BACKENDS`).
- `splash`: JAX's Pallas TPU splash attention kernel
  (`jax.experimental.pallas.ops.tpu.splash_attention`): blocks of the causal mask that are
  empty are skipped, segment ids are taken as such (no L×K mask anywhere), grouped-query
  attention natively, a window as its local mask (blocks wholly outside it skipped too).
  Under a device mesh it runs per device (`jax.shard_map` over the batch's
  mesh axes, and the heads' when `tensor` splits them). On a machine without a TPU (tests) the
  kernel runs in Pallas interpret mode.
- `auto`: `choose_backend` picks by the devices (platform and chip generation), dtype and
  shape: only a kernel that compiles there.

With a `context` mesh axis (`hardware.mesh.context`, context parallelism) each device holds a
slice of every row's queries, keys and values (contiguous, or in the balanced order of
`flaxlm.models.context_parallel`); `context_attention` gathers the row's keys and values onto
each device of the axis (MaxText's all-gather variant) and masks by the queries' and keys'
places in the row (the window's too), with the reference path, XLA's or the splash kernel
(its mask's queries at their places, the kernel sharded over the axis by its `q_seq_shards`);
or, with `model.context_attention=ring`, the keys and values travel round the axis a slice at
a time (`flaxlm.models.ring_attention`, contiguous slices).

Shapes are in the names: B batch, L query length, K key length, N query heads, G key/value
heads, H head width.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from flaxlm.config import AttentionBackend, ContextAttention
from flaxlm.errors import FlaxlmError, causes
from flaxlm.models import context_parallel
from flaxlm.models.dropout import dropout
from flaxlm.models.ring_attention import ring_attention
from flaxlm.parallel import (
    BATCH_AXES,
    CONTEXT_AXIS,
    TENSOR_AXIS,
    Accelerator,
    accelerator_of,
    sequence_axis,
)

# What cuDNN's flash attention runs: its dtypes, and head widths up to 128 in multiples of 8
# (jax's `check_is_flash_attention`; Hopper allows 256, older GPUs 128).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_WIDTH = 128
# Splash attention's query and key block lengths: the largest of these dividing the sequence
# (its key blocks must be whole multiples of a TPU vector register's 128 lanes).
SPLASH_BLOCKS = (512, 256, 128)
# Rows from which the splash kernel takes larger blocks (`splash_block_sizes`).
LONG_ROWS = 16384
# The backends that take a sliding window. Not cuDNN: jax hands it to cuDNN as its
# `sliding_window_length` beside a causal mask type, with segment ids as a bias, a combination
# no test here can run (there is no GPU) and no benchmark has checked, so a windowed model
# does not reach it; `auto` takes XLA on a GPU for it.
WINDOW_BACKENDS = (AttentionBackend.reference, AttentionBackend.xla, AttentionBackend.splash)

# The oldest chips each kernel compiles for. Where the generation is unknown (a kind or compute
# capability these rules cannot read) the kernel is not held back.
# - splash: Mosaic, Pallas' TPU compiler, has no bfloat16 matmul on TPU v2 and v3: planning
#   gpt2-xl for a v3-8 stopped at "E2001: CompileTimeMosaicUnsupportedRhsType: Unsupported
#   matmul RHS type on target: vector<128x128xbf16>". In float32 the kernel compiles there
#   (llama-tiny planned for tpu-v3-8); any other dtype is held back.
SPLASH_OLDEST_TPU_IN_HALF_PRECISION = 4
# - cudnn: "cudnn SDPA operation requires SM80 (Ampere) or newer architectures" (NVIDIA's cuDNN
#   frontend, Attention: support matrix), so not a T4 (7.5) or V100 (7.0). jax 0.10.2 does not
#   check it: jax/_src/cudnn/fused_attention_stablehlo.py's `check_is_flash_attention` reads the
#   compute capability only for the head width (256 from Hopper, 9.0; 128 before), and its
#   `dot_product_attention` leaves the rest to cuDNN ("TODO(b/380898464): Check the compute
#   capability"), which fails only when the step compiles.
CUDNN_OLDEST_COMPUTE_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend a run uses, and why, as the banner says it."""

    backend: AttentionBackend
    # e.g. "auto on TPU v4", "auto on TPU v3; the splash kernel does not compile in bfloat16
    # before TPU v4"; "" when model.attention named it
    reason: str
    dropout: bool  # training drops attention probabilities: the reference path then

    def describe(self) -> str:
        how = f" ({self.reason})" if self.reason else ""
        if self.dropout:
            return (f"attention {self.backend.value}{how}, reference while training "
                    "(attention dropout)")
        return f"attention {self.backend.value}{how}"


def choose_backend(requested: AttentionBackend | str, accelerator: Accelerator, compute_dtype,
                   seq_len: int, head_width: int, *, causal_lm: bool = True,
                   attention_dropout: float = 0.0, context: int = 1,
                   window: int | None = None) -> Choice:
    """The backend `model.attention=requested` means for a run on `accelerator` (the platform,
    "cpu", "gpu" or "tpu", and the chip: `flaxlm.parallel.run_accelerator`) in
    `compute_dtype` over blocks of `seq_len` tokens: `auto` picks cuDNN on an Ampere-or-newer
    GPU in bfloat16/float16, splash on a TPU when a kernel block divides the sequence (and,
    in half precision, the TPU is a v4 or newer), else XLA. A backend named explicitly that
    cannot run there is a FlaxlmError, raised before anything compiles. `causal_lm` is False
    for the classifiers, whose padding masks only the reference and XLA paths (and cuDNN)
    take. `context`: hardware.mesh.context (-1: the devices the other axes leave); over a
    context axis the attention is `context_attention`'s, with the splash kernel on each
    device's slice of queries (its blocks must divide the slice) or XLA's; cuDNN's kernel is
    not wired for slices. A sliding `window` (model.sliding_window) keeps `auto` to the
    backends that take one (`WINDOW_BACKENDS`; under a context axis, not splash)."""
    backend = _backend(requested)
    reason = ""
    if context != 1 and backend is AttentionBackend.cudnn:
        raise FlaxlmError(
            f"model.attention=cudnn with hardware.mesh.context={context}: under a context axis "
            "each device attends from its slice of every row's queries to the whole row's "
            "keys, which cuDNN's fused attention is not wired for (it takes no query offset "
            "into the row). Set model.attention=auto (splash on a TPU, xla elsewhere) or xla, "
            "or hardware.mesh.context=1.")
    # The splash kernel's query blocks must divide each device's slice of a row.
    slice_len = seq_len // context if context > 1 and seq_len % context == 0 else seq_len
    if backend is AttentionBackend.auto:
        backend = _auto(accelerator, compute_dtype, slice_len, head_width, causal_lm, window,
                        context)
        reason = f"auto on {accelerator.name}" + (" under a context axis" if context != 1
                                                   else "")
        passed_over = _too_old(_KERNELS.get(accelerator.platform), accelerator, compute_dtype)
        if context != 1 and backend is AttentionBackend.cudnn:
            backend = AttentionBackend.xla
        elif backend is AttentionBackend.xla and passed_over:
            reason += f"; {passed_over}"
    else:
        problem = _why_not(backend, accelerator, compute_dtype, slice_len, head_width, causal_lm,
                           window, context)
        if problem and slice_len != seq_len:
            problem += (f" (under hardware.mesh.context={context} each device's slice of a "
                        f"row of {seq_len} is {slice_len} positions)")
        if problem:
            picks = ("xla on a GPU, splash on a TPU v4 or newer" if window is not None else
                     "cudnn on an Ampere-or-newer GPU, splash on a TPU v4 or newer")
            raise FlaxlmError(
                f"model.attention={backend.value} cannot run here: {problem}. Set "
                f"model.attention=auto (picks {picks}, xla otherwise), or xla, which runs "
                "everywhere."
            )
    return Choice(backend, reason, attention_dropout > 0)


# The compiler of each kernel, as its errors name it.
_KERNEL_COMPILERS = {AttentionBackend.splash: "Mosaic", AttentionBackend.cudnn: "cuDNN"}


def kernel_compile_error(err: BaseException, choice: Choice) -> FlaxlmError | None:
    """A step that did not compile because `choice`'s kernel did not (Mosaic refusing the
    splash kernel, cuDNN its fused attention), as one paragraph naming the backend and what to
    set; None for any other error. `choose_backend` keeps each kernel off the chips it is
    known not to compile for; this is for those no rule knows yet."""
    compiler = _KERNEL_COMPILERS.get(choice.backend)
    if compiler is None:
        return None
    for cause in causes(err):
        text = str(cause)
        if "VmemOom" in text:  # a kernel's blocks, not the run, too large for a core's VMEM
            said = text.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]
            return FlaxlmError(
                f"A step did not compile: a Pallas kernel's blocks do not fit a core's VMEM "
                f"(its on-chip scratch memory, not the HBM a smaller batch or remat frees): "
                f"{said[:300]}. The kernels' blocks are flaxlm's choice for these shapes "
                f"(splash attention's by the row length, megablox's by the MoE widths): "
                f"please report the command. Meanwhile model.attention=xla (this run: "
                f"{choice.describe()}) or, for an MoE model, model.moe.dispatch=ragged "
                f"avoids them."
            )
        if "RESOURCE_EXHAUSTED" in text:  # out of memory, whatever buffers it names
            return None
        said = [line.strip() for line in text.splitlines() if compiler.lower() in line.lower()]
        if said:
            requested = "auto" if choice.reason else choice.backend.value
            return FlaxlmError(
                f"A step did not compile: {compiler} refused the {choice.backend.value} "
                f"attention kernel ({choice.describe()}): {said[0][:400]}. Set "
                f"model.attention=xla, which compiles on every device (this run has "
                f"model.attention={requested})."
            )
    return None


def _backend(requested) -> AttentionBackend:
    try:
        return AttentionBackend(requested)
    except ValueError:
        names = ", ".join(b.value for b in AttentionBackend)
        raise FlaxlmError(
            f"model.attention={requested!r} is not an attention backend: use one of {names} "
            "(auto picks by the devices)."
        ) from None


def _auto(accelerator, compute_dtype, seq_len, head_width, causal_lm,
          window=None, context=1) -> AttentionBackend:
    for backend in (AttentionBackend.cudnn, AttentionBackend.splash):
        if not _why_not(backend, accelerator, compute_dtype, seq_len, head_width, causal_lm,
                        window, context):
            return backend
    return AttentionBackend.xla


# Each platform's fused kernel, which `auto` prefers there.
_KERNELS = {"gpu": AttentionBackend.cudnn, "tpu": AttentionBackend.splash}


def _why_not(backend, accelerator, compute_dtype, seq_len, head_width, causal_lm,
             window=None, context=1) -> str:
    """Why `backend` cannot run this model on `accelerator` ("" when it can)."""
    platform = accelerator.platform
    if window is not None and context != 1 and backend is AttentionBackend.splash:
        return (f"flaxlm's splash kernel under a context axis (hardware.mesh.context="
                f"{context}) takes no sliding window (model.sliding_window={window}) yet; "
                "xla does")
    if window is not None and backend not in WINDOW_BACKENDS:
        return (f"flaxlm gives {backend.value} no sliding window (model.sliding_window="
                f"{window}): jax's cuDNN call would take it, but that path has never run on a "
                "GPU here, so a windowed model attends with "
                f"{', '.join(b.value for b in WINDOW_BACKENDS)} only")
    if backend is AttentionBackend.cudnn:
        if platform != "gpu":
            return f"cuDNN's fused attention runs on an NVIDIA GPU, and this run is on {platform}"
        if jnp.dtype(compute_dtype) not in CUDNN_DTYPES:
            return (f"cuDNN's fused attention runs in bfloat16 or float16, and "
                    f"hardware.compute_dtype is {jnp.dtype(compute_dtype).name}")
        if head_width > CUDNN_MAX_HEAD_WIDTH or head_width % 8:
            return (f"cuDNN's fused attention takes heads of up to {CUDNN_MAX_HEAD_WIDTH} "
                    f"values in multiples of 8, and this model's are {head_width} wide")
        if seq_len % 2:  # what it trains with a mask (segment ids, padding) on
            return (f"cuDNN's fused attention trains on sequences of an even length, and "
                    f"this run's are {seq_len} tokens (set task.max_seq_length)")
    if backend is AttentionBackend.splash:
        if platform != "tpu":
            return f"the splash attention kernel runs on a TPU, and this run is on {platform}"
        if not causal_lm:
            return ("the splash attention kernel is wired for causal language models "
                    "(task=clm), and this run's model masks padding")
        if splash_block(seq_len) is None:
            return (f"its blocks are {SPLASH_BLOCKS[-1]} tokens or a multiple, and the sequence "
                    f"is {seq_len} tokens (set task.max_seq_length to a multiple of "
                    f"{SPLASH_BLOCKS[-1]})")
    too_old = _too_old(backend, accelerator, compute_dtype)
    if too_old and backend is AttentionBackend.splash:
        return (f"{too_old}, and this run is on {accelerator.name} (in float32 it compiles "
                "there: hardware.compute_dtype=float32)")
    if too_old:
        return (f"{too_old}, and this run is on {accelerator.name} (compute capability "
                f"{accelerator.compute_capability})")
    return ""


def _too_old(backend, accelerator: Accelerator, compute_dtype) -> str:
    """Why `backend` does not compile for `accelerator`'s generation of chip ("" when it
    does, or when the generation is unknown); the rules' reasons are at their tables."""
    if backend is AttentionBackend.splash and accelerator.platform == "tpu":
        generation, dtype = accelerator.tpu_generation, jnp.dtype(compute_dtype)
        if (generation is not None and generation < SPLASH_OLDEST_TPU_IN_HALF_PRECISION
                and dtype != jnp.float32):
            return (f"the splash kernel does not compile in {dtype.name} before "
                    f"TPU v{SPLASH_OLDEST_TPU_IN_HALF_PRECISION}")
    if backend is AttentionBackend.cudnn and accelerator.platform == "gpu":
        capability = accelerator.cuda_capability
        if capability is not None and capability < CUDNN_OLDEST_COMPUTE_CAPABILITY:
            oldest = ".".join(map(str, CUDNN_OLDEST_COMPUTE_CAPABILITY))
            return (f"cuDNN's fused attention needs compute capability {oldest} (Ampere) or "
                    "newer")
    return ""


def splash_block(seq_len: int) -> int | None:
    """The splash kernel's block length for sequences of `seq_len`; None: none divides it."""
    return next((block for block in SPLASH_BLOCKS if seq_len % block == 0), None)


# ------------------------------------------------------------------------ the entry point


def attention(q_BxLxNxH: jax.Array, k_BxKxGxH: jax.Array, v_BxKxGxH: jax.Array, *,
              dropout_rate: float, rngs: nnx.Rngs | None, mask=None,
              is_causal: bool = False, segment_ids_BxL: jax.Array | None = None,
              backend: AttentionBackend | str = AttentionBackend.xla,
              window: int | None = None,
              row_order: np.ndarray | None = None,
              context: ContextAttention | str = ContextAttention.all_gather) -> jax.Array:
    """Multi-head attention, (B, L, N, H), by `backend` (`auto` here: by the devices the
    step is traced for). `mask` (broadcastable to B×N×L×K) says which keys each query sees;
    `is_causal` adds the causal mask; `segment_ids_BxL` (self-attention: the same ids for
    queries and keys) keeps each query to the keys of its own segment; `window` (W, with
    is_causal) keeps query i to keys i - W + 1 … i. Training (`rngs` given, rate > 0) drops
    attention probabilities out, on the reference path. `row_order`: the rows' positions are
    in the context axis' balanced order, these places in the row
    (`flaxlm.models.context_parallel.row_order`), and the causal mask compares places.

    Segment ids, not a ready mask, are what this takes: the fused kernels take them as such
    and never build the L×K mask. `context` is the variant under a `context` mesh axis
    (`model.context_attention`: gathered keys and values, or the ring's)."""
    backend = AttentionBackend(backend)
    if rngs is not None and dropout_rate > 0:
        if is_causal and row_order is not None:  # causal over the rows' places, not indices
            causal_LxK = jnp.asarray(row_order[:, None] >= row_order[None, :])
            if window is not None:  # the window too: by places
                causal_LxK = window_mask(jnp.asarray(row_order), jnp.asarray(row_order), window)
                window = None
            mask, is_causal = (causal_LxK if mask is None else mask & causal_LxK), False
        return reference_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, mask, is_causal,
                                   segment_ids_BxL, dropout_rate, rngs.dropout(), window=window)
    if backend is AttentionBackend.auto:
        backend = _traced_auto(q_BxLxNxH, mask, window)
    if sequence_axis(q_BxLxNxH.shape[1]) and mask is None:
        if ContextAttention(context) is ContextAttention.ring:  # its own einsums, any backend
            if window is not None or row_order is not None:
                raise ValueError("ring attention takes contiguous slices and no window "
                                 "(model_spec and attention_choice keep them off it)")
            return ring_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal, segment_ids_BxL,
                                  _head_axis(jax.sharding.get_abstract_mesh(),
                                             q_BxLxNxH.shape[2], k_BxKxGxH.shape[2]))
        if backend is AttentionBackend.cudnn:
            raise ValueError("cudnn attention under a context axis: reference, xla or splash "
                             "(choose_backend refuses cudnn there)")
        return context_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal, segment_ids_BxL,
                                 backend, window, row_order)
    if backend is AttentionBackend.reference:
        return reference_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, mask, is_causal,
                                   segment_ids_BxL, window=window)
    if backend is AttentionBackend.splash:
        if mask is not None:
            raise ValueError("splash attention takes causal and segment masks, not a mask")
        return splash_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal, segment_ids_BxL,
                                window)
    if window is not None and backend not in WINDOW_BACKENDS:
        raise ValueError(f"{backend.value} attention with a sliding window: "
                         f"{', '.join(b.value for b in WINDOW_BACKENDS)} (choose_backend "
                         "refuses the others)")
    mask = _with_segments(mask, segment_ids_BxL)
    # jax's window is (keys before, keys after) each query, besides itself.
    return jax.nn.dot_product_attention(
        q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, mask=mask, is_causal=is_causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=backend.value)


def context_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal: bool,
                      segment_ids_BxL: jax.Array | None, backend: AttentionBackend,
                      window: int | None = None,
                      row_order: np.ndarray | None = None) -> jax.Array:
    """Self-attention with each row's positions split over the mesh's `context` axis: under
    `jax.shard_map`, each device of the axis holds a slice of the row's queries, keys and
    values (its rows, and its heads when `tensor` splits them); it gathers the whole row's
    keys and values (an all-gather, which XLA overlaps with what it can) and attends from its
    queries to them. The slices are contiguous (slice c holds places c·L/C …), or in the
    balanced order whose places `row_order` lists; the causal mask compares the queries'
    places with the keys', as does a `window`. Segment ids (whole rows on every device, in the
    rows' order of positions) keep each query to its own document, also across slices. The
    reference path, XLA's, or the splash kernel (`_context_splash`; no window there:
    choose_backend keeps a windowed model off it under the axis)."""
    if backend is AttentionBackend.splash:
        if window is not None:
            raise ValueError("splash attention under a context axis takes no window "
                             "(choose_backend keeps a windowed model to xla there)")
        return _context_splash(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal, segment_ids_BxL,
                               row_order)
    mesh = jax.sharding.get_abstract_mesh()
    heads = _head_axis(mesh, q_BxLxNxH.shape[2], k_BxKxGxH.shape[2])
    slices = PartitionSpec(BATCH_AXES, CONTEXT_AXIS, heads)
    rows = None if segment_ids_BxL is None else PartitionSpec(BATCH_AXES)
    places_L = context_parallel.places(q_BxLxNxH.shape[1], row_order)

    def per_device(q_BxSxNxH, k_BxSxGxH, v_BxSxGxH, segment_ids_BxL):
        S = q_BxSxNxH.shape[1]
        k_BxLxGxH = jax.lax.all_gather(k_BxSxGxH, CONTEXT_AXIS, axis=1, tiled=True)
        v_BxLxGxH = jax.lax.all_gather(v_BxSxGxH, CONTEXT_AXIS, axis=1, tiled=True)
        start = jax.lax.axis_index(CONTEXT_AXIS) * S
        mask = None
        places_S = jax.lax.dynamic_slice_in_dim(jnp.asarray(places_L), start, S)
        if is_causal:
            mask = (places_S[:, None] >= places_L[None, :])[None, None]
        if window is not None:
            in_window_1x1xSxL = window_mask(places_S, places_L, window)[None, None]
            mask = in_window_1x1xSxL if mask is None else mask & in_window_1x1xSxL
        if segment_ids_BxL is not None:
            queries_BxS = jax.lax.dynamic_slice_in_dim(segment_ids_BxL, start, S, axis=1)
            same_Bx1xSxL = queries_BxS[:, None, :, None] == segment_ids_BxL[:, None, None, :]
            mask = same_Bx1xSxL if mask is None else mask & same_Bx1xSxL
        if backend is AttentionBackend.reference:
            return reference_attention(q_BxSxNxH, k_BxLxGxH, v_BxLxGxH, mask)
        return jax.nn.dot_product_attention(q_BxSxNxH, k_BxLxGxH, v_BxLxGxH, mask=mask,
                                            implementation=backend.value)

    return jax.shard_map(per_device, mesh=mesh, in_specs=(slices, slices, slices, rows),
                         out_specs=slices, check_vma=False)(
        q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, segment_ids_BxL)


def _traced_auto(q_BxLxNxH: jax.Array, mask, window: int | None = None) -> AttentionBackend:
    """`auto` for a model called outside training's set-up (which resolves it first, with
    `choose_backend`): the choice for the devices the step is traced for."""
    B, L, N, H = q_BxLxNxH.shape
    context = dict(jax.sharding.get_abstract_mesh().shape)[CONTEXT_AXIS] if (
        sequence_axis(L) and mask is None) else 1
    return choose_backend(AttentionBackend.auto, _traced_accelerator(), q_BxLxNxH.dtype, L, H,
                          causal_lm=mask is None, context=context, window=window).backend


def _traced_accelerator() -> Accelerator:
    """The devices of the mesh the step is traced on (a TPU slice's when a plan compiles for
    one on a CPU), else the default device. A mesh's abstract device has no compute
    capability: when it is the attached kind, the attached device's is taken."""
    attached = accelerator_of(jax.devices()[0])
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is None or (device.platform, device.device_kind) == (attached.platform,
                                                                   attached.kind):
        return attached
    return accelerator_of(device)


def window_mask(query_places_L: jax.Array, key_places_K: jax.Array, window: int) -> jax.Array:
    """(L, K): which keys each query sees through a sliding window of `window` places, itself
    and the window - 1 before it (transformers' `sliding_window_overlay` with its causal
    mask: key place > query place - window, and ≤ the query's)."""
    behind_LxK = query_places_L[:, None] - key_places_K[None, :]
    return (behind_LxK >= 0) & (behind_LxK < window)


def _with_segments(mask, segment_ids_BxL):
    """`mask` and-ed with "the same segment" (B×1×L×L) when there are segment ids."""
    if segment_ids_BxL is None:
        return mask
    same_segment_Bx1xLxK = segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :]
    return same_segment_Bx1xLxK if mask is None else mask & same_segment_Bx1xLxK


def reference_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, mask=None, is_causal: bool = False,
                        segment_ids_BxL=None, dropout_rate: float = 0.0,
                        key: jax.Array | None = None, *, window: int | None = None) -> jax.Array:
    """Attention spelled out, as HF's models compute it: scores in the compute dtype, softmax
    in float32, then dropout on the probabilities (`dropout_rate` > 0, with `key`). A large
    finite negative (not -inf) keeps a row that sees no key at all (a filler row of the last
    eval batch) finite, as the fused paths do. `window`: `window_mask` over the row's places."""
    L, K, H = q_BxLxNxH.shape[1], k_BxKxGxH.shape[1], q_BxLxNxH.shape[-1]
    mask = _with_segments(mask, segment_ids_BxL)
    if is_causal:
        causal_LxK = jnp.tril(jnp.ones((L, K), dtype=bool))
        mask = causal_LxK if mask is None else mask & causal_LxK
    if window is not None:
        in_window_LxK = window_mask(jnp.arange(L), jnp.arange(K), window)
        mask = in_window_LxK if mask is None else mask & in_window_LxK
    # Grouped-query attention: each key/value head serves N / G query heads in a row.
    group = q_BxLxNxH.shape[2] // k_BxKxGxH.shape[2]
    k_BxKxNxH = jnp.repeat(k_BxKxGxH, group, axis=2)
    v_BxKxNxH = jnp.repeat(v_BxKxGxH, group, axis=2)
    scores_BxNxLxK = jnp.einsum("bqnh,bknh->bnqk", q_BxLxNxH, k_BxKxNxH) / jnp.sqrt(H)
    scores_BxNxLxK = scores_BxNxLxK.astype(jnp.float32)
    if mask is not None:
        scores_BxNxLxK = jnp.where(mask, scores_BxNxLxK, jnp.finfo(jnp.float32).min)
    probs_BxNxLxK = jax.nn.softmax(scores_BxNxLxK, axis=-1)
    if dropout_rate > 0:
        probs_BxNxLxK = dropout(probs_BxNxLxK, dropout_rate, key)
    return jnp.einsum("bnqk,bknh->bqnh", probs_BxNxLxK.astype(v_BxKxNxH.dtype), v_BxKxNxH)


# ------------------------------------------------------------------------------ splash


# The name the splash kernel gives what its backward pass reads (its output and the softmax's
# log-sum-exp per query), for a remat policy to keep (flaxlm.models.layers, model.remat=block).
KERNEL_RESIDUALS = "attention_kernel_residuals"


def splash_attention(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal: bool,
                     segment_ids_BxL: jax.Array | None,
                     window: int | None = None) -> jax.Array:
    """The splash kernel over a batch. Inside a step traced on a device mesh it runs per
    device under `jax.shard_map`: a Pallas kernel is one device's program, which the compiler
    cannot split; each device takes its rows (and its heads when `tensor` splits them)."""
    q_BxNxLxH = jnp.swapaxes(q_BxLxNxH, 1, 2) / np.sqrt(q_BxLxNxH.shape[-1]).astype(
        q_BxLxNxH.dtype)  # the kernel does not scale
    k_BxGxKxH = jnp.swapaxes(k_BxKxGxH, 1, 2)
    v_BxGxKxH = jnp.swapaxes(v_BxKxGxH, 1, 2)
    segments = None if segment_ids_BxL is None else segment_ids_BxL.astype(jnp.int32)
    run = functools.partial(_splash_rows, is_causal=is_causal, window=window,
                            interpret=_traced_accelerator().platform != "tpu")
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and all(axis in mesh.axis_names for axis in BATCH_AXES):
        heads = _head_axis(mesh, q_BxNxLxH.shape[1], k_BxGxKxH.shape[1])
        qkv = PartitionSpec(BATCH_AXES, heads)
        rows = None if segments is None else PartitionSpec(BATCH_AXES)
        run = jax.shard_map(run, mesh=mesh, in_specs=(qkv, qkv, qkv, rows), out_specs=qkv,
                            check_vma=False)
    # Named as the kernel names its residuals: the output is also what the next matmul's
    # backward reads, and a remat policy that kept only the residuals' copy would run the
    # kernel's forward again for it.
    out_BxNxLxH = checkpoint_name(run(q_BxNxLxH, k_BxGxKxH, v_BxGxKxH, segments),
                                  KERNEL_RESIDUALS)
    return jnp.swapaxes(out_BxNxLxH, 1, 2)


def _context_splash(q_BxLxNxH, k_BxKxGxH, v_BxKxGxH, is_causal: bool,
                    segment_ids_BxL: jax.Array | None, row_order: np.ndarray | None):
    """`context_attention` with the splash kernel. One kernel is made for the whole row's
    mask, causal at the queries' places (`context_parallel.splash_causal_mask`), with
    `q_seq_shards` = C: its block map is cut into the axis' C slices of queries, and
    `jax.shard_map` hands each device its own (the kernel's `manual_sharding_spec`), so the
    device's blocks are those of its queries' places, with the blocks they cannot see
    skipped. Each device gathers the row's keys and values and puts them back in the row's
    order, which is where the kernel's key indices count from; its queries' segment ids are
    its slice of the row's, its keys' the whole row's in the row's order."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mesh = jax.sharding.get_abstract_mesh()
    context = mesh.shape[CONTEXT_AXIS]
    B, L, N, H = q_BxLxNxH.shape
    heads = _head_axis(mesh, N, k_BxKxGxH.shape[2])
    local_heads = N // (mesh.shape[heads] if heads else 1)
    # Query blocks within one chunk of the balanced order: a block across two chunks would
    # hold an early and a late part of the row, and be skipped less.
    chunk = L // context // (1 if row_order is None else 2)
    q_span = chunk if splash_block(chunk) is not None else L // context
    head_mask = (context_parallel.splash_causal_mask(L, row_order) if is_causal
                 else splash.FullMask((L, L)))
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([head_mask] * local_heads), head_shards=1, q_seq_shards=context,
        residual_checkpoint_name=KERNEL_RESIDUALS,
        block_sizes=splash.BlockSizes(**splash_block_sizes(
            q_span, L, H, segments=segment_ids_BxL is not None)),
        interpret=_traced_accelerator().platform != "tpu")
    kernel_spec = kernel.manual_sharding_spec(
        jax.sharding.NamedSharding(mesh, PartitionSpec(None, CONTEXT_AXIS)))

    def in_row_order(x, axis):
        if row_order is None:
            return x
        return context_parallel.whole_row_contiguous(x, context, axis)

    def per_device(kernel, q_BxNxSxH, k_BxGxSxH, v_BxGxSxH, segment_ids_BxL):
        k_BxGxLxH = in_row_order(
            jax.lax.all_gather(k_BxGxSxH, CONTEXT_AXIS, axis=2, tiled=True), axis=2)
        v_BxGxLxH = in_row_order(
            jax.lax.all_gather(v_BxGxSxH, CONTEXT_AXIS, axis=2, tiled=True), axis=2)
        if segment_ids_BxL is None:
            return jax.vmap(kernel)(q_BxNxSxH, k_BxGxLxH, v_BxGxLxH)
        S = q_BxNxSxH.shape[2]
        start = jax.lax.axis_index(CONTEXT_AXIS) * S
        queries_BxS = jax.lax.dynamic_slice_in_dim(segment_ids_BxL, start, S, axis=1)
        keys_BxL = in_row_order(segment_ids_BxL, axis=1)
        return jax.vmap(lambda q, k, v, queries_S, keys_L: kernel(
            q, k, v, splash.SegmentIds(queries_S, keys_L)))(
            q_BxNxSxH, k_BxGxLxH, v_BxGxLxH, queries_BxS, keys_BxL)

    slices = PartitionSpec(BATCH_AXES, heads, CONTEXT_AXIS)
    rows = None if segment_ids_BxL is None else PartitionSpec(BATCH_AXES)
    run = jax.shard_map(per_device, mesh=mesh,
                        in_specs=(kernel_spec, slices, slices, slices, rows),
                        out_specs=slices, check_vma=False)
    q_BxNxLxH = jnp.swapaxes(q_BxLxNxH, 1, 2) / np.sqrt(H).astype(q_BxLxNxH.dtype)
    segments = None if segment_ids_BxL is None else segment_ids_BxL.astype(jnp.int32)
    # Named as `splash_attention` names its output, for the same reason.
    out_BxNxLxH = checkpoint_name(
        run(kernel, q_BxNxLxH, jnp.swapaxes(k_BxKxGxH, 1, 2), jnp.swapaxes(v_BxKxGxH, 1, 2),
            segments), KERNEL_RESIDUALS)
    return jnp.swapaxes(out_BxNxLxH, 1, 2)


def splash_block_sizes(q_len: int, kv_len: int, head_width: int,
                       segments: bool = False) -> dict[str, int | bool]:
    """The splash kernel's blocks (`BlockSizes`' arguments) for `q_len` queries over `kv_len`
    keys in heads `head_width` wide, with or without `segments` (document masking): the
    longest of SPLASH_BLOCKS that divides each length, for the forward pass and the backward
    pass alike. From LONG_ROWS keys on, with heads of at most 64, larger blocks where they
    divide, as measured on a TPU v5e (docs/benchmarks.md, "Long rows on one TPU v5e chip"):
    queries of 1024 over keys of 2048 without segments (forward + backward over 16,384 tokens
    with 9 heads of 64: 16.5 ms against 20.2 ms in blocks of 512), and 1024 over 1024 with
    them, whose segment ids take more of the kernel's VMEM (the chip's compiler refused
    1024 / 2048 there; smollm-135m's step at 16,384 tokens with documents went from 47.9% to
    56.7% MFU). Wider heads need more VMEM still and keep the short rows' blocks. One backward
    kernel for dq, dk and dv (the fused one) rather than two that each recompute the
    probabilities: 11% less time at 2048 tokens with heads of 64 ("MFU on one TPU v5e
    chip")."""
    q_block, kv_block = splash_block(q_len), splash_block(kv_len)
    long_kv_block = 1024 if segments else 2048
    if (kv_len >= LONG_ROWS and head_width <= 64 and q_len % 1024 == 0
            and kv_len % long_kv_block == 0):
        q_block, kv_block = 1024, long_kv_block
    return dict(block_q=q_block, block_kv=kv_block, block_kv_compute=kv_block,
                block_q_dkv=q_block, block_kv_dkv=kv_block, block_kv_dkv_compute=kv_block,
                use_fused_bwd_kernel=True)


def _head_axis(mesh, num_heads: int, num_kv_heads: int) -> str | None:
    """The mesh axis the heads are split over, as the q/k/v projections split them."""
    tensor = mesh.shape.get(TENSOR_AXIS, 1)
    if tensor > 1 and num_heads % tensor == 0 and num_kv_heads % tensor == 0:
        return TENSOR_AXIS
    return None


def _splash_rows(q_BxNxLxH, k_BxGxKxH, v_BxGxKxH, segment_ids_BxL, *, is_causal: bool,
                 interpret: bool, window: int | None = None):
    """One device's rows: the kernel (made for its head count and length) mapped over them."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, N, L, _ = q_BxNxLxH.shape
    K = k_BxGxKxH.shape[2]
    if splash_block(L) is None or splash_block(K) is None:
        raise ValueError(f"splash attention needs lengths in multiples of {SPLASH_BLOCKS[-1]}: "
                         f"{L} queries, {K} keys")
    head_mask = _splash_mask(splash, L, K, is_causal, window)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([head_mask] * N), head_shards=1, q_seq_shards=1,
        residual_checkpoint_name=KERNEL_RESIDUALS,
        block_sizes=splash.BlockSizes(**splash_block_sizes(
            L, K, q_BxNxLxH.shape[-1], segments=segment_ids_BxL is not None)),
        interpret=interpret)

    if segment_ids_BxL is None:
        return jax.vmap(kernel)(q_BxNxLxH, k_BxGxKxH, v_BxGxKxH)

    def one_row(q_NxLxH, k_GxKxH, v_GxKxH, segment_ids_L):
        return kernel(q_NxLxH, k_GxKxH, v_GxKxH, splash.SegmentIds(segment_ids_L, segment_ids_L))

    return jax.vmap(one_row)(q_BxNxLxH, k_BxGxKxH, v_BxGxKxH, segment_ids_BxL)


def _splash_mask(splash, L: int, K: int, is_causal: bool, window: int | None):
    """One head's mask for the splash kernel: causal, full, or a sliding window, which its
    LocalMask spells as (window - 1 keys before, none after): causal within the window."""
    if window is not None:
        return splash.LocalMask((L, K), window_size=(window - 1, 0), offset=0)
    return splash.CausalMask((L, K)) if is_causal else splash.FullMask((L, K))
