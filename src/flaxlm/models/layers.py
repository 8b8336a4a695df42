"""What every model family is built from: the spec (model config plus dtypes), the Flax layers
with their initialisers and logical axis names, attention (fused, or spelled out when it trains
with dropout), rematerialisation of a block, and the record of how Hugging Face names a family
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
from flax import nnx

from flaxlm.config import ModelConfig, Remat

ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's tanh approximation
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """Everything a network needs to know: the model config plus the dtypes it runs in."""

    model: ModelConfig
    compute_dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @property
    def mlp_width(self) -> int:
        return self.model.n_inner or 4 * self.model.n_embd


def check_shape(spec: TransformerSpec) -> None:
    """The settings every family needs to make sense: whole heads and a known activation."""
    cfg = spec.model
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    if cfg.activation_function not in ACTIVATIONS:
        raise ValueError(
            f"model.activation_function={cfg.activation_function!r} is not one of "
            f"{sorted(ACTIVATIONS)}"
        )


def axes(*names: str | None) -> dict:
    """A parameter's metadata naming its dimensions' logical axes (None: never split)."""
    return {"logical_axes": names}


def dense(in_features: int, out_features: int, spec: TransformerSpec, rngs: nnx.Rngs,
          std: float, use_bias: bool = True, *,
          logical_axes: tuple[str | None, str | None]) -> nnx.Linear:
    """A Linear layer; `logical_axes` names its (input, output) dimensions."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        kernel_metadata=axes(*logical_axes),
        bias_metadata=axes(logical_axes[1]),
        rngs=rngs,
    )


def embedding(num_embeddings: int, spec: TransformerSpec, rngs: nnx.Rngs,
              rows: str = "positions") -> nnx.Embed:
    """A table of `num_embeddings` rows of the model width; `rows` names the row axis
    ("vocab" for token tables)."""
    return nnx.Embed(
        num_embeddings,
        spec.model.n_embd,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        embedding_init=nnx.initializers.normal(spec.model.initializer_range),
        embedding_metadata=axes(rows, "embed"),
        rngs=rngs,
    )


def layer_norm(spec: TransformerSpec, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        spec.model.n_embd,
        epsilon=spec.model.layer_norm_epsilon,
        dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        scale_metadata=axes("embed"),
        bias_metadata=axes("embed"),
        rngs=rngs,
    )


# What the backward pass may keep from a block's forward pass, by model.remat: `block` keeps
# the matmul outputs (recomputing norms, activations and attention scores, which are cheap
# per byte), `full` keeps nothing but the block's input.
_REMAT_POLICIES = {
    Remat.block: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    Remat.full: jax.checkpoint_policies.nothing_saveable,
}


def run_block(block: nnx.Module, remat: Remat, *args):
    """`block(*args)`, rematerialised in the backward pass as `remat` says."""
    if Remat(remat) is Remat.none:
        return block(*args)
    return nnx.remat(lambda block, *args: block(*args), policy=_REMAT_POLICIES[Remat(remat)])(
        block, *args)


def attention(q_BxLxNxH: jax.Array, k_BxKxNxH: jax.Array, v_BxKxNxH: jax.Array, *,
              dropout_rate: float, rngs: nnx.Rngs | None, mask=None,
              is_causal: bool = False) -> jax.Array:
    """Multi-head attention, (B, L, N, H). `mask` (broadcastable to B×N×L×K) says which keys
    each query sees; `is_causal` adds the causal mask. Training (`rngs` given, rate > 0) drops
    attention probabilities out; otherwise this is the fused `jax.nn.dot_product_attention`."""
    if rngs is None or dropout_rate <= 0:
        return jax.nn.dot_product_attention(q_BxLxNxH, k_BxKxNxH, v_BxKxNxH, mask=mask,
                                            is_causal=is_causal)
    if is_causal:
        L = q_BxLxNxH.shape[1]
        causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
        mask = causal_LxL if mask is None else mask & causal_LxL
    return attention_with_dropout(q_BxLxNxH, k_BxKxNxH, v_BxKxNxH, mask, dropout_rate,
                                  rngs.dropout())


def attention_with_dropout(q_BxLxNxH, k_BxKxNxH, v_BxKxNxH, mask, rate: float,
                           key: jax.Array):
    """Attention with dropout on the attention probabilities, as HF's models train.

    The fused `jax.nn.dot_product_attention` has no dropout, so training with a dropout rate
    spells the same computation out; evaluation always takes the fused path. A large finite
    negative (not -inf) keeps a row that sees no key at all (a filler row of the last eval
    batch) finite, as the fused path does.
    """
    H = q_BxLxNxH.shape[-1]
    scores_BxNxLxK = jnp.einsum("bqnh,bknh->bnqk", q_BxLxNxH, k_BxKxNxH) / jnp.sqrt(H)
    scores_BxNxLxK = jnp.where(mask, scores_BxNxLxK.astype(jnp.float32),
                               jnp.finfo(jnp.float32).min)
    probs_BxNxLxK = jax.nn.softmax(scores_BxNxLxK, axis=-1)
    keep_BxNxLxK = jax.random.bernoulli(key, 1.0 - rate, probs_BxNxLxK.shape)
    probs_BxNxLxK = jnp.where(keep_BxNxLxK, probs_BxNxLxK / (1.0 - rate), 0.0)
    return jnp.einsum("bnqk,bknh->bqnh", probs_BxNxLxK.astype(v_BxKxNxH.dtype), v_BxKxNxH)


def count_params(model: nnx.Module) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How transformers names one family's configs and checkpoints. Our modules carry HF's
    parameter names, so what is left to say is which fields, prefixes and layouts differ.

    Config fields map HF's name to ModelConfig's: `shape_fields` both ways (export writes them,
    `model.init_from` reads them), `dropout_fields` on export only (dropout is a fine-tuning
    choice, not part of a pretrained network).
    """

    model_type: str  # config.json's `model_type`
    config_class: type  # the transformers config class
    shape_fields: dict[str, str]
    dropout_fields: dict[str, str]
    special_tokens: tuple[str, ...]  # which of bos/eos/pad_token_id the HF config carries
    body_prefix: str  # the HF base model's prefix in a task model's keys ("bert.")
    body_modules: tuple[str, ...]  # the base model's top-level modules, as a bare one names them
    linear_modules: tuple[str, ...]  # top-level modules whose kernels HF stores (out, in)
    config_extras: dict = dataclasses.field(default_factory=dict)  # fixed HF config values
    mlp_width_required: bool = False  # the HF config has no "None: 4 × width" for the MLP
    optional_modules: tuple[str, ...] = ()  # body modules a base checkpoint may lack (fresh)
    tied_keys: tuple[str, ...] = ()  # checkpoint keys that repeat a tied tensor
    buffer_suffixes: tuple[str, ...] = ()  # checkpoint keys that are buffers, not parameters
    # (key fragment, the ModelConfig setting that sizes it), first match wins; else n_embd.
    shape_settings: tuple[tuple[str, str], ...] = ()
    # A checkpoint variant our module does not implement: config.json → what it uses, or None.
    unsupported: Callable[[dict], str | None] = lambda raw: None
