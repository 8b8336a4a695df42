"""What every model family is built from: the spec (model config plus dtypes), the Flax layers
with their initialisers and logical axis names (attention: `flaxlm.models.attention`),
rematerialisation of a block, the layers run one by one or stacked and scanned
(`model.scan_layers`, with `stack_layers` / `unstack_layers` between the two parameter
layouts), the key/value cache of generation, and the record of how Hugging Face names a family
(`HFNames`, one per family module, read by `flaxlm.models.hf`).

Every parameter carries `logical_axes` metadata, one name per dimension ("embed", "vocab",
"heads", "mlp", ...): what the dimension means, from which `flaxlm.parallel.LOGICAL_AXIS_RULES`
decides how the device mesh splits it. Models name their axes and never mention a mesh.

Shapes are in the names: B batch, L query length, K key length, N heads, H head width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from flaxlm.config import (
    MOE_FAMILIES,
    WINDOW_FAMILIES,
    AttentionBackend,
    ContextAttention,
    ModelConfig,
    ModelFamily,
    Remat,
)
from flaxlm.errors import FlaxlmError
from flaxlm.models import lora
from flaxlm.models.attention import KERNEL_RESIDUALS, attention
from flaxlm.parallel import constrain_batch

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's tanh approximation
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,  # Llama's SwiGLU gate
}


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """Everything a network needs to know: the model config plus the dtypes it runs in."""

    model: ModelConfig
    compute_dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    # hardware.mesh.balance_context: rows split over a context axis in the balanced order
    # (`flaxlm.models.context_parallel`), else in contiguous slices.
    balance_context: bool = True

    @property
    def mlp_width(self) -> int:
        return self.model.mlp_size or 4 * self.model.hidden_size

    @property
    def balanced_rows(self) -> bool:
        """Whether rows split over a context axis go in the balanced order: asked for, and the
        all-gather's. The ring skips the slices wholly in a device's future, which the
        balanced order has none of, so it keeps contiguous slices."""
        return (self.balance_context and ContextAttention(self.model.context_attention)
                is ContextAttention.all_gather)


def check_shape(spec: TransformerSpec) -> None:
    """The settings every family needs to make sense: whole heads, a known activation and
    adapters (model.lora) on projections the family has."""
    cfg = spec.model
    if cfg.head_dim is None and cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} is not divisible by "
                         f"model.num_heads={cfg.num_heads}")
    check_head_width(cfg)
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(
            f"model.activation={cfg.activation!r} is not one of "
            f"{sorted(ACTIVATIONS)}"
        )
    lora.check_lora(cfg)
    check_experts_family(cfg)
    check_sliding_window(cfg)


def check_head_width(cfg: ModelConfig) -> None:
    """model.head_dim, where set: rotary positions turn a head's values in pairs."""
    if cfg.head_dim is not None and (cfg.head_dim < 2 or cfg.head_dim % 2):
        raise FlaxlmError(
            f"model.head_dim={cfg.head_dim} must be a positive even number: rotary positions "
            "turn each head's values in pairs (null: model.hidden_size / model.num_heads).")


def check_sliding_window(cfg: ModelConfig) -> None:
    """model.sliding_window on a family whose checkpoints can say it, of at least one token,
    and full_attention_layers a count of the model's layers (all of them one kind under a
    scan)."""
    window, full = cfg.sliding_window, cfg.full_attention_layers
    family = ModelFamily(cfg.family)
    families = " or ".join(f.value for f in WINDOW_FAMILIES)
    if window is not None and family not in WINDOW_FAMILIES:
        raise FlaxlmError(
            f"model.sliding_window={window} on model.family={family.value}, which has no "
            "sliding window: its checkpoints (and transformers' config) cannot say one, so an "
            f"export would attend otherwise than the run trained. Use model.family={families} "
            "(Llama's decoder, exported as Mistral's or Qwen2's), or model.sliding_window=null.")
    if window is not None and window < 1:
        raise FlaxlmError(
            f"model.sliding_window={window} must be at least 1: the tokens each token attends "
            "to, itself included (Mistral-7B-v0.1's: 4096), or null for the whole row.")
    if not 0 <= full < max(cfg.num_layers, 1) or (full and window is None):
        raise FlaxlmError(
            f"model.full_attention_layers={full} must count the first layers that attend to "
            f"the whole row beside a sliding window (Qwen2's max_window_layers): from 0 to "
            f"model.num_layers - 1 = {cfg.num_layers - 1}, and 0 without "
            "model.sliding_window.")
    if full and cfg.scan_layers:
        raise FlaxlmError(
            f"model.full_attention_layers={full} with model.scan_layers=true: a scan runs one "
            "kind of layer, and the first layers attend to the whole row while the others "
            "slide a window; set model.scan_layers=false (or model.full_attention_layers=0).")


def check_experts_family(cfg: ModelConfig) -> None:
    """Experts (model.moe) exactly on the Mixture-of-Experts families: the others' checkpoints
    and transformers' classes hold one dense MLP per layer."""
    family = ModelFamily(cfg.family)
    moe_families = ", ".join(f.value for f in MOE_FAMILIES)
    if cfg.moe.num_experts is None and family in MOE_FAMILIES:
        raise FlaxlmError(
            f"model.family={family.value} is a Mixture-of-Experts family, but "
            "model.moe.num_experts is not set. Set it (e.g. model.moe.num_experts=8 "
            "model.moe.top_k=2), or start from an MoE preset such as model=moe-tiny.")
    if cfg.moe.num_experts is not None and family not in MOE_FAMILIES:
        raise FlaxlmError(
            f"model.moe.num_experts={cfg.moe.num_experts} on model.family={family.value}, "
            "which has no experts: its checkpoints (and transformers' classes) hold one dense "
            f"MLP per layer. Use a Mixture-of-Experts family ({moe_families}), e.g. "
            "model=moe-tiny, or leave model.moe.num_experts null.")


def axes(*names: str | None) -> dict:
    """A parameter's metadata naming its dimensions' logical axes (None: never split)."""
    return {"logical_axes": names}


def dense(in_features: int, out_features: int, spec: TransformerSpec, rngs: nnx.Rngs,
          std: float, use_bias: bool = True, *,
          logical_axes: tuple[str | None, str | None], name: str | None = None) -> nnx.Linear:
    """A Linear layer; `logical_axes` names its (input, output) dimensions. A block's
    projection passes its HF module `name`: it is then a `lora.Projection`, called with the
    step's rngs, and carries an adapter when model.lora targets that name."""
    linear = dict(
        use_bias=use_bias,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        kernel_metadata=axes(*logical_axes),
        bias_metadata=axes(logical_axes[1]),
        rngs=rngs,
    )
    if name is None:
        return nnx.Linear(in_features, out_features, **linear)
    adapted = lora.enabled(spec.model) and name in lora.targets(spec.model)
    return lora.Projection(in_features, out_features, lora=spec.model.lora if adapted else None,
                           logical_axes=logical_axes, **linear)


def embedding(num_embeddings: int, spec: TransformerSpec, rngs: nnx.Rngs,
              rows: str = "positions") -> nnx.Embed:
    """A table of `num_embeddings` rows of the model width; `rows` names the row axis
    ("vocab" for token tables)."""
    return nnx.Embed(
        num_embeddings,
        spec.model.hidden_size,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        embedding_init=nnx.initializers.normal(spec.model.initializer_range),
        embedding_metadata=axes(rows, "embed"),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """x / rms(x) × scale, as HF's LlamaRMSNorm: normalised in float32 whatever the compute
    dtype, cast back, then scaled (a bfloat16 mean of squares loses the small components)."""

    def __init__(self, spec: TransformerSpec, width: int | None = None,
                 logical_axis: str | None = "embed"):
        """`width`: what it normalises, the model width unless given (a head's, for Qwen3's
        query and key norms), its dimension named `logical_axis`."""
        self.epsilon = spec.model.layer_norm_eps
        self.scale = nnx.Param(jnp.ones(width or spec.model.hidden_size, spec.param_dtype),
                               **axes(logical_axis))
        self.dtype = spec.compute_dtype

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32_BxLxD = x_BxLxD.astype(jnp.float32)
        mean_square_BxLx1 = jnp.mean(jnp.square(x32_BxLxD), axis=-1, keepdims=True)
        normed_BxLxD = (x32_BxLxD * lax.rsqrt(mean_square_BxLx1 + self.epsilon)).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed_BxLxD


def layer_norm(spec: TransformerSpec, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        spec.model.hidden_size,
        epsilon=spec.model.layer_norm_eps,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        scale_metadata=axes("embed"),
        bias_metadata=axes("embed"),
        rngs=rngs,
    )


# What the backward pass may keep from a block's forward pass, by model.remat: `block` keeps
# the matmul outputs without a batch dimension (the projections) and what the splash kernel
# hands its backward pass (its output and softmax statistics, named KERNEL_RESIDUALS, where
# recomputing them runs the kernel's forward again, about a tenth of smollm-135m's step on a
# TPU v5e), and recomputes norms, activations and attention's XLA path, which are cheap per
# byte; `full` keeps nothing but the block's input.
# `dots_saveable` also keeps attention's batched matmuls, its L × L scores per head.
_REMAT_POLICIES = {
    Remat.block: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(KERNEL_RESIDUALS)),
    Remat.dots_with_no_batch_dims_saveable:
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    Remat.dots_saveable: jax.checkpoint_policies.dots_saveable,
    Remat.full: jax.checkpoint_policies.nothing_saveable,
    Remat.nothing_saveable: jax.checkpoint_policies.nothing_saveable,
    Remat.everything_saveable: jax.checkpoint_policies.everything_saveable,
}


def run_block(block: nnx.Module, remat: Remat, x_BxLxD: jax.Array, *args):
    """`block(x_BxLxD, *args)`, rematerialised in the backward pass as `remat` says. Within a
    step traced on a device mesh, the hidden states going in and out keep their rows split
    over the batch's mesh axes (`constrain_batch`): each device holds its rows' activations."""
    x_BxLxD = constrain_batch(x_BxLxD)
    if Remat(remat) is Remat.none:
        return _constrain_output(block(x_BxLxD, *args))
    rematerialised = nnx.remat(lambda block, *args: block(*args),
                               policy=_REMAT_POLICIES[Remat(remat)])
    return _constrain_output(rematerialised(block, x_BxLxD, *args))


def _constrain_output(output):
    """A block's hidden states, or (hidden states, what else it returns), laid out by rows."""
    if isinstance(output, tuple):
        return constrain_batch(output[0]), *output[1:]
    return constrain_batch(output)


# ---------------------------------------------------------------- scanned layers

LAYERS_AXIS = "layers"  # the logical axis of a scanned model's stacked parameters


def _is_variable(node) -> bool:
    return isinstance(node, nnx.Variable)


def _stacked_variable(*layers: nnx.Variable) -> nnx.Variable:
    axes_names = layers[0].get_metadata().get("logical_axes", ())
    return layers[0].replace(jnp.stack([layer[...] for layer in layers]),
                             logical_axes=(LAYERS_AXIS, *axes_names))


def stack_blocks(blocks: list[nnx.Module]) -> nnx.Module:
    """One module of `blocks`' kind whose every parameter holds all of theirs, stacked on a
    leading `layers` axis (named in its `logical_axes`, so the mesh never splits it): what
    `scan_blocks` runs. Built from the blocks one by one, so a scanned model starts from the
    same weights as the unrolled one of the same seed."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(block) for block in blocks]
    return nnx.merge(graphdef, jax.tree.map(_stacked_variable, *states, is_leaf=_is_variable))


def scan_blocks(blocks: nnx.Module, step: Callable, x_BxLxD: jax.Array, per_layer=()):
    """`x_BxLxD` through every layer of the stacked `blocks` (`stack_blocks`) with `lax.scan`:
    the block is traced and compiled once, however deep the model.

    `step(block, x_BxLxD, *inputs) -> (x_BxLxD, outputs)` runs one layer; `per_layer` holds
    each layer's inputs stacked on a leading axis (dropout keys, a cache's keys and values),
    and the layers' outputs come back stacked the same way."""
    graphdef, state = nnx.split(blocks)

    def layer(x_BxLxD, layer_state_and_inputs):
        layer_state, inputs = layer_state_and_inputs
        return step(nnx.merge(graphdef, layer_state), x_BxLxD, *inputs)

    return lax.scan(layer, x_BxLxD, (state, per_layer))


def num_stacked(blocks: nnx.Module) -> int:
    """How many layers the stacked `blocks` hold."""
    return jax.tree.leaves(nnx.state(blocks))[0].shape[0]


def run_layers(layers: nnx.Module, scanned: bool, call: Callable, x_BxLxD: jax.Array,
               rngs: nnx.Rngs | None) -> jax.Array:
    """`x_BxLxD` through every layer, `call(layer, x_BxLxD, rngs) -> x_BxLxD` each: a Python
    loop over `layers` (an nnx.List), or, `scanned`, one `scan_blocks` over stacked ones. A
    scan cannot draw from `rngs` inside its body, so each layer gets a stream of its own
    from one key split ahead: dropout masks of the same law as the loop's, not the same."""
    if not scanned:
        for layer in layers:
            x_BxLxD = call(layer, x_BxLxD, rngs)
        return x_BxLxD
    keys = None if rngs is None else jax.random.split(rngs.dropout(), num_stacked(layers))

    def step(layer, x_BxLxD, key):
        return call(layer, x_BxLxD, None if key is None else nnx.Rngs(dropout=key)), None

    return scan_blocks(layers, step, x_BxLxD, (keys,))[0]


def run_layers_collecting(layers: nnx.Module, scanned: bool, call: Callable,
                          x_BxLxD: jax.Array, rngs: nnx.Rngs | None):
    """`run_layers` for layers that report something besides their hidden states:
    `call(layer, x_BxLxD, rngs) -> (x_BxLxD, report)`, a report a pytree of arrays or None.
    The last hidden states, and the layers' reports stacked on a leading axis in layer order
    (those that reported None left out; None if none reported)."""
    if scanned:
        keys = None if rngs is None else jax.random.split(rngs.dropout(), num_stacked(layers))

        def step(layer, x_BxLxD, key):
            return call(layer, x_BxLxD, None if key is None else nnx.Rngs(dropout=key))

        return scan_blocks(layers, step, x_BxLxD, (keys,))
    reports = []
    for layer in layers:
        x_BxLxD, report = call(layer, x_BxLxD, rngs)
        if report is not None:
            reports.append(report)
    return x_BxLxD, (jax.tree.map(lambda *r: jnp.stack(r), *reports) if reports else None)


def decode_layers(layers: nnx.Module, scanned: bool, decode_layer: Callable,
                  x_BxLxD: jax.Array, cache: KVCache):
    """`x_BxLxD` through every layer, `decode_layer(layer, x_BxLxD, keys, values) -> (x_BxLxD,
    keys, values)` each, attending over its part of `cache`: the last hidden states and the
    layers' new keys and values (stacked for a scanned model, as its cache holds them)."""
    if scanned:
        def step(layer, x_BxLxD, keys_BxSxGxH, values_BxSxGxH):
            x_BxLxD, keys_BxSxGxH, values_BxSxGxH = decode_layer(
                layer, x_BxLxD, keys_BxSxGxH, values_BxSxGxH)
            return x_BxLxD, (keys_BxSxGxH, values_BxSxGxH)

        x_BxLxD, (keys, values) = scan_blocks(layers, step, x_BxLxD,
                                              (cache.keys_BxSxGxH, cache.values_BxSxGxH))
        return x_BxLxD, keys, values
    keys, values = [], []
    for layer, keys_BxSxGxH, values_BxSxGxH in zip(layers, cache.keys_BxSxGxH,
                                                   cache.values_BxSxGxH):
        x_BxLxD, keys_BxSxGxH, values_BxSxGxH = decode_layer(layer, x_BxLxD, keys_BxSxGxH,
                                                             values_BxSxGxH)
        keys.append(keys_BxSxGxH)
        values.append(values_BxSxGxH)
    return x_BxLxD, tuple(keys), tuple(values)


def _stack_arrays(arrays):
    """Host arrays stay on the host; shapes (an abstract model's) stay shapes."""
    arrays = list(arrays)
    if isinstance(arrays[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(arrays), *arrays[0].shape), arrays[0].dtype)
    return np.stack(arrays) if isinstance(arrays[0], np.ndarray) else jnp.stack(arrays)


def _layer_of(array, index: int):
    if isinstance(array, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(array.shape[1:], array.dtype)
    return array[index]


def stack_layers(params: dict, layers_key: str) -> dict:
    """A nested parameter dict (as `nnx.to_pure_dict` gives) in the scanned layout: the
    per-layer dicts under `layers_key` (`{0: {...}, 1: {...}}`, HF's layout) become one dict
    of arrays stacked on a leading layer axis. A dict already stacked is returned as it is."""
    return _convert_layers(params, layers_key, stack=True)


def unstack_layers(params: dict, layers_key: str) -> dict:
    """`stack_layers` undone: one dict per layer under `layers_key`, keyed by layer index. A
    dict already unrolled is returned as it is."""
    return _convert_layers(params, layers_key, stack=False)


def is_unrolled(layers: dict) -> bool:
    """Whether a layer collection's dict is keyed by layer index (else it is stacked)."""
    return bool(layers) and all(isinstance(key, int) or str(key).isdigit() for key in layers)


def has_stacked_layers(params: dict, layers_key: str) -> bool:
    """Whether the nested parameter dict is in the scanned layout (see `stack_layers`)."""
    return any(isinstance(child, dict) and (
        (key == layers_key and not is_unrolled(child)) or
        (key != layers_key and has_stacked_layers(child, layers_key)))
        for key, child in params.items())


def per_layer_paths(path: tuple, layers_key: str, num_layers: int) -> list[tuple] | None:
    """The per-layer (HF layout) paths of the leaf at `path` of a scanned-layout dict, layer by
    layer; None when the leaf is not stacked (outside the layers, or already one per layer)."""
    if layers_key not in path[:-1]:
        return None
    at = path.index(layers_key) + 1
    if isinstance(path[at], int) or str(path[at]).isdigit():
        return None
    return [(*path[:at], layer, *path[at:]) for layer in range(num_layers)]


def _convert_layers(params: dict, layers_key: str, stack: bool) -> dict:
    converted = {}
    for key, child in params.items():
        if not isinstance(child, dict):
            converted[key] = child
        elif key != layers_key:
            converted[key] = _convert_layers(child, layers_key, stack)
        elif stack and is_unrolled(child):
            layers = [child[index] for index in sorted(child, key=int)]
            converted[key] = jax.tree.map(lambda *leaves: _stack_arrays(leaves), *layers)
        elif not stack and not is_unrolled(child):
            num_layers = jax.tree.leaves(child)[0].shape[0]
            converted[key] = {index: jax.tree.map(lambda leaf, i=index: _layer_of(leaf, i), child)
                              for index in range(num_layers)}
        else:
            converted[key] = child
    return converted


def last_token_states(x_BxLxD: jax.Array, attention_mask_BxL: jax.Array) -> jax.Array:
    """Each row's hidden state at its last real token, the rightmost position the mask keeps
    (HF's decoder classifiers: the rightmost token that is not padding), (B, D). A filler row
    with no tokens at all (the last eval batch) reads position 0."""
    kept_positions_BxL = jnp.arange(x_BxLxD.shape[1])[None] * (attention_mask_BxL > 0)
    last_B = jnp.argmax(kept_positions_BxL, axis=-1)
    return jnp.take_along_axis(x_BxLxD, last_B[:, None, None], axis=1)[:, 0]


# ---------------------------------------------------------------- generation


@struct.dataclass
class KVCache:
    """What generation carries from step to step: every layer's keys and values, preallocated
    to S slots (prompt + new tokens), which slots hold a real token, and the next free slot.
    G is the number of key/value heads (N, or fewer under grouped-query attention).

    Prompts are left-padded (right-aligned), so every row's next token goes to the same slot;
    `filled_BxS` keeps the padding out of attention and out of the position count.
    """

    # One per layer: a tuple, or for a scanned model one array stacked on a leading layer axis
    # (which `scan_blocks` reads and writes layer by layer).
    keys_BxSxGxH: tuple[jax.Array, ...] | jax.Array
    values_BxSxGxH: tuple[jax.Array, ...] | jax.Array
    filled_BxS: jax.Array  # bool
    index: jax.Array  # int32 scalar: the slot the next token is written to


def empty_cache(batch_size: int, num_slots: int, num_layers: int, num_kv_heads: int,
                head_width: int, dtype, stacked: bool = False) -> KVCache:
    """A cache for `batch_size` rows of up to `num_slots` tokens, prompt included; `stacked`:
    each layer's keys and values in one array (a scanned model's)."""
    shape = (batch_size, num_slots, num_kv_heads, head_width)
    if stacked:
        zeros = jnp.zeros((num_layers, *shape), dtype)
    else:
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(zeros, zeros, jnp.zeros((batch_size, num_slots), bool),
                   jnp.zeros((), jnp.int32))


def decode_step(cache: KVCache, input_mask_BxL: jax.Array | None, L: int,
                branches_BxL: jax.Array | None = None):
    """Where L new tokens go: their positions (B, L), the cache's filled slots with them
    (B, S), and which slots each may attend to (B, L, S).

    `branches_BxL` (0: the trunk) makes the new tokens a tree: a token of branch b > 0 sees
    everything before it in the cache and in the trunk, and the earlier tokens of its own
    branch, never another branch. Several continuations of one context are then read in one
    row, each as if it alone followed the context (`flaxlm.scoring`).

    A token's position is the number of tokens it sees before itself, so left padding shifts
    nothing (a padded row sees the positions it would see alone) and every branch starts
    where the trunk ends.
    """
    B = cache.filled_BxS.shape[0]
    if input_mask_BxL is None:
        input_mask_BxL = jnp.ones((B, L), bool)
    input_mask_BxL = input_mask_BxL.astype(bool)
    filled_BxS = lax.dynamic_update_slice_in_dim(
        cache.filled_BxS, input_mask_BxL, cache.index, axis=1
    )
    slots_S = jnp.arange(filled_BxS.shape[1])
    query_slots_L = cache.index + jnp.arange(L)
    causal_LxS = slots_S[None, :] <= query_slots_L[:, None]
    mask_BxLxS = causal_LxS[None] & filled_BxS[:, None, :]
    if branches_BxL is not None:
        slot_branches_BxS = lax.dynamic_update_slice_in_dim(
            jnp.zeros(filled_BxS.shape, jnp.int32), branches_BxL.astype(jnp.int32),
            cache.index, axis=1)
        same_branch_BxLxS = ((slot_branches_BxS[:, None, :] == 0)
                             | (slot_branches_BxS[:, None, :] == branches_BxL[:, :, None]))
        mask_BxLxS = mask_BxLxS & same_branch_BxLxS
    positions_BxL = jnp.maximum(mask_BxLxS.sum(axis=-1) - 1, 0)
    return positions_BxL, filled_BxS, mask_BxLxS


def windowed(mask_BxLxS: jax.Array, window: int | None) -> jax.Array:
    """A decoding mask (which cache slots each new query sees, `decode_step`) kept to
    the last `window` slots each query sees: its own and the window - 1 before it in its
    history. Counted over the visible slots, not slot numbers: left padding and the other
    branches of a tree (`flaxlm.scoring`) lie between slots and are no places of the
    query's, so a query sees what it would see with the row uncached and unpadded."""
    if window is None:
        return mask_BxLxS
    # How many visible slots lie at or after each slot: 1 at the query's own.
    from_end_BxLxS = jnp.cumsum(mask_BxLxS[..., ::-1].astype(jnp.int32), axis=-1)[..., ::-1]
    return mask_BxLxS & (from_end_BxLxS <= window)


def cached_attention(q_BxLxNxH, k_BxLxGxH, v_BxLxGxH, keys_BxSxGxH, values_BxSxGxH,
                     index: jax.Array, mask_BxLxS: jax.Array,
                     backend: AttentionBackend | str = AttentionBackend.xla,
                     window: int | None = None):
    """Attention of L new positions, their keys and values first written into the cache at
    slot `index`, over every slot `mask_BxLxS` allows (within a sliding `window`: `windowed`).
    Returns (B, L, N, H) and the cache.

    A few new queries over a mask of filled slots is not what the flash kernels are for (and
    splash cannot take that mask): every backend but the reference decodes with XLA's."""
    keys_BxSxGxH = lax.dynamic_update_slice_in_dim(
        keys_BxSxGxH, k_BxLxGxH.astype(keys_BxSxGxH.dtype), index, axis=1
    )
    values_BxSxGxH = lax.dynamic_update_slice_in_dim(
        values_BxSxGxH, v_BxLxGxH.astype(values_BxSxGxH.dtype), index, axis=1
    )
    if AttentionBackend(backend) is not AttentionBackend.reference:
        backend = AttentionBackend.xla
    mask_BxLxS = windowed(mask_BxLxS, window)
    out_BxLxNxH = attention(q_BxLxNxH, keys_BxSxGxH, values_BxSxGxH, mask=mask_BxLxS[:, None],
                            dropout_rate=0.0, rngs=None, backend=backend)
    return out_BxLxNxH, keys_BxSxGxH, values_BxSxGxH


def count_params(model: nnx.Module) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def training_flops_per_token(model: ModelConfig, matmul_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (each family's `lookup_params`,
    tables that are only looked up, are not among them) plus attention's
    12·layers·width·length (PaLM, appendix B), its width the heads' (num_heads × head_dim,
    wider than the model for Qwen3-30B-A3B's 32 heads of 128 on 2048); a layer with a sliding
    window counts `attended_length`'s length instead."""
    head_width = model.head_dim or model.hidden_size // model.num_heads
    windowed = 0 if model.sliding_window is None else (model.num_layers
                                                       - model.full_attention_layers)
    lengths = ((model.num_layers - windowed) * seq_len
               + windowed * attended_length(seq_len, model.sliding_window))
    return 6 * matmul_params + 12 * model.num_heads * head_width * lengths


def attended_length(seq_len: int, window: int | None) -> float:
    """The length PaLM's formula counts for a layer whose queries see a sliding `window` of
    keys: the formula counts every query against all L keys, twice the causal triangle's
    L²/2 pairs, so a window's pairs, L·W - W²/2 for W ≤ L (each query its last W keys, the
    first W - 1 fewer), count twice as well: 2W - W²/L, which is L at W = L."""
    if window is None or window >= seq_len:
        return float(seq_len)
    return 2 * window - window * window / seq_len


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How transformers names one family's configs and checkpoints. Our modules carry HF's
    parameter names, so what is left to say is which fields, prefixes and layouts differ.

    Config fields map HF's name to ModelConfig's: `shape_fields` both ways (export writes them,
    `model.init_from` reads them), `dropout_fields` on export only (dropout is a fine-tuning
    choice, not part of a pretrained network).
    """

    model_type: str  # config.json's `model_type`
    config_class_name: str  # the transformers config class: `config_class`
    shape_fields: dict[str, str]
    dropout_fields: dict[str, str]
    special_tokens: tuple[str, ...]  # which of bos/eos/pad_token_id the HF config carries
    body_prefix: str  # the HF base model's prefix in a task model's keys ("bert.")
    body_modules: tuple[str, ...]  # the base model's top-level modules, as a bare one names them
    layers_module: str  # the module holding the blocks, one per layer ("h"), or stacked
    linear_modules: tuple[str, ...]  # top-level modules whose kernels HF stores (out, in)
    config_extras: dict = dataclasses.field(default_factory=dict)  # fixed HF config values
    mlp_width_required: bool = False  # the HF config has no "None: 4 × width" for the MLP
    optional_modules: tuple[str, ...] = ()  # body modules a base checkpoint may lack (fresh)
    tied_keys: tuple[str, ...] = ()  # checkpoint keys that repeat a tied tensor
    buffer_suffixes: tuple[str, ...] = ()  # checkpoint keys that are buffers, not parameters
    # (key fragment, the ModelConfig setting that sizes it), first match wins; else hidden_size.
    shape_settings: tuple[tuple[str, str], ...] = ()
    # The module of a sparse layer's experts, whose matrices we hold stacked on an expert axis
    # (`moe.Experts`) and HF names one nn.Linear per expert (`experts.<e>.gate_proj.weight`).
    experts_module: str | None = None
    # (our key's fragment, HF's) where a family's checkpoints name a module otherwise than
    # our modules do (Mixtral's `block_sparse_moe`, `w1`), applied to whole HF keys.
    renames: tuple[tuple[str, str], ...] = ()
    # A checkpoint variant our module does not implement: config.json → what it uses, or None.
    unsupported: Callable[[dict], str | None] = lambda raw: None
    # HF config values that are not one field each way (Llama's `rope_parameters` dict): from
    # our ModelConfig (export), and ModelConfig fields from an HF config object (import).
    config_to_hf: Callable[[ModelConfig], dict] = lambda model: {}
    config_from_hf: Callable[[object], dict] = lambda config: {}

    @property
    def config_class(self) -> type:
        # Looked up when a config is read or written, not when the family's module is
        # imported: transformers' config classes import PyTorch where it is installed, seconds
        # at the start of every process that never needs them.
        import transformers

        return getattr(transformers, self.config_class_name)
