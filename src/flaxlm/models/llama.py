"""The Llama decoder in Flax NNX, with the parameter layout of transformers' `LlamaForCausalLM`:
pre-norm blocks with RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query
attention (G key/value heads, each serving N / G query heads). Mistral, SmolLM and OLMo share
this design; Qwen2 adds biases to the q/k/v projections (`model.qkv_bias`), and its classes here
are these under Qwen2's names; Mistral's are these under Mistral's names, without biases. Both
may slide a window over the row (`model.sliding_window`; Qwen2's only past its first
`model.full_attention_layers` layers).

The module tree mirrors HF's names (`model.embed_tokens`, `model.layers.<i>.self_attn.q_proj`,
`model.layers.<i>.mlp.gate_proj`, `model.norm`, `lm_head`), so a checkpoint maps one to one
(see `flaxlm.models.hf`); every projection is an nn.Linear in HF, stored (out, in), so its
kernel is transposed both ways. With tied embeddings (`model.tie_word_embeddings`) the head is
the token table and `lm_head` does not exist.

Numerics follow HF's: RMSNorm and the attention softmax in float32 whatever the compute dtype,
RoPE with `rotate_half` (the two halves of each head, not interleaved pairs) and inverse
frequencies in float32, stretched as HF's rope types `linear` and `llama3` stretch them.
Generation is GPT-2's (`layers.KVCache`, `layers.decode_step`); the cache holds only the G
key/value heads.

Shapes are in the names: B batch, L sequence length, D model width, N query heads, G key/value
heads, H head width, F MLP width, V vocabulary, S cache slots, C classes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily, QKNorm, Remat, RopeScaling
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import moe
from flaxlm.models.attention import attention
from flaxlm.models.context_parallel import balanced_rows, contiguous_rows, row_order
from flaxlm.models.layers import (
    ACTIVATIONS,
    HFNames,
    KVCache,
    RMSNorm,
    TransformerSpec,
    cached_attention,
    check_shape,
    decode_layers,
    decode_step,
    dense,
    embedding,
    empty_cache,
    last_token_states,
    run_block,
    run_layers_collecting,
    stack_blocks,
)
from flaxlm.parallel import constrain_batch

transformers = lazy_module("transformers")

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # HF's rope_type names


def check_llama(spec: TransformerSpec) -> None:
    """The Llama settings that must make sense before anything is built."""
    check_shape(spec)
    cfg = spec.model
    if cfg.num_kv_heads is not None and (cfg.num_kv_heads < 1 or cfg.num_heads % cfg.num_kv_heads):
        raise FlaxlmError(
            f"model.num_kv_heads={cfg.num_kv_heads} must divide model.num_heads={cfg.num_heads}: "
            "each key/value head serves a whole group of query heads. Pick a divisor of num_heads "
            "(null: one key/value head per query head)."
        )
    check_rope_scaling(cfg.rope_scaling)
    check_biases(cfg)
    moe.check_moe(cfg)


def check_biases(cfg: ModelConfig) -> None:
    """Only biases the family's HF config can state: LlamaConfig's `attention_bias` puts them on
    all four attention projections, Qwen2Config fixes them on q/k/v and nowhere else."""
    biases = (f"model.qkv_bias={cfg.qkv_bias}, model.attention_bias={cfg.attention_bias}, "
              f"model.mlp_bias={cfg.mlp_bias}")
    family = ModelFamily(cfg.family)
    if family is ModelFamily.mistral:
        if cfg.qkv_bias or cfg.attention_bias or cfg.mlp_bias:
            raise FlaxlmError(
                f"model.family=mistral with {biases}: a Mistral checkpoint (MistralConfig) has "
                "no biases. Set all three false, or model.family=llama (attention_bias, "
                "mlp_bias) or qwen2 (qkv_bias) for biases."
            )
    elif family in (ModelFamily.qwen2, ModelFamily.qwen2_moe):
        if not cfg.qkv_bias or cfg.attention_bias or cfg.mlp_bias:
            raise FlaxlmError(
                f"model.family={family.value} with {biases}: a Qwen2 checkpoint has biases "
                "on q/k/v and none on o or the MLP. Set model.qkv_bias=true "
                "model.attention_bias=false model.mlp_bias=false, or model.family=llama for "
                "Llama's choice of biases."
            )
    elif cfg.qkv_bias and not cfg.attention_bias:
        raise FlaxlmError(
            f"model.family={family.value} with {biases}: biases on q/k/v and "
            "none on o are Qwen2's layout, which a Llama checkpoint (LlamaConfig) cannot hold. "
            "Set model.family=qwen2 (as model=qwen2.5-0.5b does), or model.attention_bias=true "
            "for Llama's biases on all four projections."
        )


def check_rope_scaling(scaling: RopeScaling) -> None:
    """The rope scaling settings `inverse_frequencies` can compute."""
    if scaling.type not in ROPE_TYPES or scaling.factor <= 0:
        raise FlaxlmError(
            f"model.rope_scaling={{type: {scaling.type}, factor: {scaling.factor}}} is not "
            "supported: flaxlm's Llama implements model.rope_scaling.type default (no scaling), "
            "linear (positions divided by model.rope_scaling.factor), llama3 (Llama 3.1's) "
            "and yarn (YaRN: Qwen's, DeepSeek's), with a factor > 0."
        )
    if scaling.type in ("llama3", "yarn") and scaling.original_max_positions < 1:
        raise FlaxlmError(
            f"model.rope_scaling.original_max_positions={scaling.original_max_positions} must be "
            "the context the model was first trained at, a positive number of tokens (Llama "
            "3.1's: 8192; Qwen2.5's with yarn: 32768)."
        )
    if scaling.type == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        if not 0 < low < high:
            raise FlaxlmError(
                f"model.rope_scaling.low_freq_factor={low} and model.rope_scaling."
                f"high_freq_factor={high}: llama3 scaling needs 0 < low_freq_factor < "
                "high_freq_factor (Llama 3.1's are 1 and 4), as it interpolates between the "
                "wavelengths original_max_positions / high_freq_factor and "
                "original_max_positions / low_freq_factor."
            )
    if scaling.type == "yarn":
        if not 0 < scaling.beta_slow < scaling.beta_fast:
            raise FlaxlmError(
                f"model.rope_scaling.beta_slow={scaling.beta_slow} and model.rope_scaling."
                f"beta_fast={scaling.beta_fast}: yarn scaling needs 0 < beta_slow < beta_fast "
                "(YaRN's are 1 and 32): they are the rotations over the original context below "
                "which a frequency is stretched and above which it is kept.")
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(scaling, name)
            if value is not None and not value > 0:
                raise FlaxlmError(
                    f"model.rope_scaling.{name}={value} must be positive, or null for YaRN's "
                    "default attention factor (0.1·ln(factor) + 1).")


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads or cfg.num_heads


def head_width(cfg: ModelConfig) -> int:
    """H: model.head_dim, or the width divided among the heads."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_heads


def inverse_frequencies(head_width: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """The R = H / 2 rotation frequencies of a head, in float32, as HF's rope init functions
    compute them: theta^(-2i/H), divided by `scaling.factor` for linear scaling, or stretched
    by wavelength for llama3 (`llama3_frequencies`)."""
    exponents_R = np.arange(0, head_width, 2, dtype=np.float32) / head_width
    base_R = (np.float32(theta) ** exponents_R).astype(np.float32)
    inv_freq_R = (1.0 / base_R).astype(np.float32)
    if scaling.type == "linear":
        return (inv_freq_R / np.float32(scaling.factor)).astype(np.float32)
    if scaling.type == "llama3":
        return llama3_frequencies(inv_freq_R, scaling)
    if scaling.type == "yarn":
        return yarn_frequencies(base_R, theta, scaling)
    return inv_freq_R


def llama3_frequencies(inv_freq_R: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1's stretch of a longer context: a frequency whose wavelength (2π / frequency,
    in tokens) exceeds original_max_positions / low_freq_factor is divided by `factor`, as
    linear scaling does, so that positions up to factor × original_max_positions turn it no
    further than training did; one shorter than original_max_positions / high_freq_factor,
    which tells nearby tokens apart, is kept as trained; those between are interpolated,
    linearly in original_max_positions / wavelength. Float32 throughout, as HF's."""
    original, low, high = (scaling.original_max_positions, scaling.low_freq_factor,
                           scaling.high_freq_factor)
    wavelength_R = (2 * math.pi / inv_freq_R).astype(np.float32)
    stretched_R = np.where(wavelength_R > original / low, inv_freq_R / scaling.factor, inv_freq_R)
    smooth_R = (original / wavelength_R - low) / (high - low)
    smoothed_R = (1 - smooth_R) * stretched_R / scaling.factor + smooth_R * stretched_R
    between_R = (wavelength_R >= original / high) & (wavelength_R <= original / low)
    return np.where(between_R, smoothed_R, stretched_R).astype(np.float32)


def yarn_frequencies(base_R: np.ndarray, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies (Peng et al. 2023), as transformers computes them: dimension pair i
    turns 1 / base_i = theta^(-2i/H) radians a token; the pairs that turn fewer than beta_slow
    times over original_max_positions are interpolated (divided by `factor`, as linear
    scaling), those that turn more than beta_fast times extrapolated (kept), with a linear ramp
    between the dimensions where the two counts fall (`yarn_ramp_ends`). Float32, as
    transformers."""
    R = base_R.shape[0]
    kept_R = (np.float32(1.0) / base_R).astype(np.float32)
    stretched_R = (np.float32(1.0) / (np.float32(scaling.factor) * base_R)).astype(np.float32)
    low, high = yarn_ramp_ends(2 * R, theta, scaling)
    if low == high:
        high += 0.001  # transformers' guard against a ramp of no width
    ramp_R = np.clip((np.arange(R, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
                     0, 1).astype(np.float32)
    keep_R = np.float32(1.0) - ramp_R
    return (stretched_R * (np.float32(1.0) - keep_R) + kept_R * keep_R).astype(np.float32)


def yarn_ramp_ends(head_width: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """The dimensions (of H) where a frequency turns beta_fast and beta_slow times over the
    original context, rounded outwards unless `truncate` is off, within [0, H - 1]."""

    def dimension(rotations: float) -> float:
        turns = scaling.original_max_positions / (rotations * 2 * math.pi)
        return head_width * math.log(turns) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_width - 1)


def rope_attention_scale(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's attention factor (given, or
    0.1·m·ln(factor) + 1 at m = mscale over the same at m = mscale_all_dim, where a
    DeepSeek checkpoint gives both, else at m = 1; 1 at a factor ≤ 1)."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(m: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.mscale) / mscale(scaling.mscale_all_dim))
    return mscale(1.0)


def rotary(positions_BxL: jax.Array, inv_freq_R: np.ndarray,
           scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every position's rotation angles, (B, L, 1, H), in float32: position ×
    each inverse frequency (`inverse_frequencies`), each used for both halves of the head;
    both × `scale` (`rope_attention_scale`: YaRN's sharper attention)."""
    angles_BxLxR = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_R
    angles_BxLx1xH = jnp.concatenate([angles_BxLxR, angles_BxLxR], axis=-1)[:, :, None, :]
    if scale == 1.0:
        return jnp.cos(angles_BxLx1xH), jnp.sin(angles_BxLx1xH)
    return jnp.cos(angles_BxLx1xH) * scale, jnp.sin(angles_BxLx1xH) * scale


def apply_rotary(x_BxLxNxH: jax.Array, cos_BxLx1xH: jax.Array, sin_BxLx1xH: jax.Array):
    """x rotated by the angles, in x's dtype: x·cos + rotate_half(x)·sin, as HF."""
    x1, x2 = jnp.split(x_BxLxNxH, 2, axis=-1)
    rotated_BxLxNxH = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxLx1xH.astype(x_BxLxNxH.dtype), sin_BxLx1xH.astype(x_BxLxNxH.dtype)
    return x_BxLxNxH * cos + rotated_BxLxNxH * sin


class LlamaAttention(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs, index: int = 0):
        """Layer `index`'s attention: windowed (model.sliding_window) unless it is one of the
        first model.full_attention_layers."""
        cfg = spec.model
        self.num_heads, self.num_kv_heads = cfg.num_heads, kv_heads(cfg)
        self.head_width = head_width(cfg)
        # A tuple: a module's static attributes must hash (jit keys on them); float32 values
        # survive the round trip through Python floats exactly.
        self.inv_freq_R = tuple(inverse_frequencies(self.head_width, cfg.rope_theta,
                                                    cfg.rope_scaling).tolist())
        self.rope_scale = rope_attention_scale(cfg.rope_scaling)
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention
        self.window = cfg.sliding_window if index >= cfg.full_attention_layers else None
        self.balance_context = spec.balanced_rows
        self.context_attention = cfg.context_attention
        q_width, kv_width = self.num_heads * self.head_width, self.num_kv_heads * self.head_width

        def projection(name, width_in, width_out, logical_axes, use_bias):
            return dense(width_in, width_out, spec, rngs, cfg.initializer_range,
                         use_bias=use_bias, logical_axes=logical_axes, name=name)

        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = projection("q_proj", cfg.hidden_size, q_width, ("embed", "heads"), qkv_bias)
        self.k_proj = projection("k_proj", cfg.hidden_size, kv_width, ("embed", "kv_heads"),
                                 qkv_bias)
        self.v_proj = projection("v_proj", cfg.hidden_size, kv_width, ("embed", "kv_heads"),
                                 qkv_bias)
        self.o_proj = projection("o_proj", q_width, cfg.hidden_size, ("heads", "embed"),
                                 cfg.attention_bias)
        self.qk_norm = QKNorm(cfg.qk_norm)
        if self.qk_norm is QKNorm.head:  # one scale of a head's width, shared by the heads
            self.q_norm = RMSNorm(spec, self.head_width, logical_axis=None)
            self.k_norm = RMSNorm(spec, self.head_width, logical_axis=None)
        elif self.qk_norm is QKNorm.width:  # over the whole projection at once
            self.q_norm = RMSNorm(spec, q_width, logical_axis="heads")
            self.k_norm = RMSNorm(spec, kv_width, logical_axis="kv_heads")

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 rngs: nnx.Rngs | None, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        B, L, _ = x_BxLxD.shape
        out_BxLxNxH = attention(*self._heads(x_BxLxD, positions_BxL, rngs), is_causal=True,
                                segment_ids_BxL=segment_ids_BxL,
                                dropout_rate=self.attention_dropout, rngs=rngs,
                                backend=self.attention_backend, window=self.window,
                                context=self.context_attention,
                                row_order=row_order(L, self.balance_context))
        return self.o_proj(out_BxLxNxH.reshape(B, L, -1), rngs)

    def decode(self, x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, index, mask_BxLxS):
        """Attention of L new positions over the cache (`layers.cached_attention`)."""
        B, L, _ = x_BxLxD.shape
        out_BxLxNxH, keys_BxSxGxH, values_BxSxGxH = cached_attention(
            *self._heads(x_BxLxD, positions_BxL), keys_BxSxGxH, values_BxSxGxH, index,
            mask_BxLxS, self.attention_backend, self.window)
        return self.o_proj(out_BxLxNxH.reshape(B, L, -1)), keys_BxSxGxH, values_BxSxGxH

    def _heads(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
               rngs: nnx.Rngs | None = None):
        B, L, _ = x_BxLxD.shape
        H = self.head_width
        q_BxLxQ, k_BxLxV = self.q_proj(x_BxLxD, rngs), self.k_proj(x_BxLxD, rngs)
        if self.qk_norm is QKNorm.width:
            q_BxLxQ, k_BxLxV = self.q_norm(q_BxLxQ), self.k_norm(k_BxLxV)
        q_BxLxNxH = q_BxLxQ.reshape(B, L, self.num_heads, H)
        k_BxLxGxH = k_BxLxV.reshape(B, L, self.num_kv_heads, H)
        v_BxLxGxH = self.v_proj(x_BxLxD, rngs).reshape(B, L, self.num_kv_heads, H)
        if self.qk_norm is QKNorm.head:
            q_BxLxNxH, k_BxLxGxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxGxH)
        cos_BxLx1xH, sin_BxLx1xH = rotary(positions_BxL, np.asarray(self.inv_freq_R, np.float32),
                                          self.rope_scale)
        return (apply_rotary(q_BxLxNxH, cos_BxLx1xH, sin_BxLx1xH),
                apply_rotary(k_BxLxGxH, cos_BxLx1xH, sin_BxLx1xH), v_BxLxGxH)


class LlamaMLP(nnx.Module):
    """SwiGLU: down(act(gate(x)) × up(x)), of `width` (model.mlp_size unless given: an MoE's
    shared expert has its own)."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs, width: int | None = None):
        cfg = spec.model
        F = width or spec.mlp_width

        def projection(name, width_in, width_out, logical_axes):
            return dense(width_in, width_out, spec, rngs, cfg.initializer_range,
                         use_bias=cfg.mlp_bias, logical_axes=logical_axes, name=name)

        self.gate_proj = projection("gate_proj", cfg.hidden_size, F, ("embed", "mlp"))
        self.up_proj = projection("up_proj", cfg.hidden_size, F, ("embed", "mlp"))
        self.down_proj = projection("down_proj", F, cfg.hidden_size, ("mlp", "embed"))
        self.activation = ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """`rngs` (training) draws the adapters' dropout, if they have any."""
        h_BxLxF = self.activation(self.gate_proj(x_BxLxD, rngs)) * self.up_proj(x_BxLxD, rngs)
        # Each device its rows' hidden units: left free, the compiler may split them as the
        # weights are (over fsdp) and gather every row of the batch onto each device instead.
        return self.down_proj(constrain_batch(h_BxLxF, last_over_tensor=True), rngs)


class LlamaDecoderLayer(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). Llama's only dropout is on attention weights.
    Layer `index` of a Mixture-of-Experts model (model.moe) has experts for its MLP
    (`moe.MoeMLP`), unless it is one of the first dense ones."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs, index: int = 0):
        self.input_layernorm = RMSNorm(spec)
        self.self_attn = LlamaAttention(spec, rngs, index)
        self.post_attention_layernorm = RMSNorm(spec)
        self.sparse = moe.is_sparse_layer(spec.model, index)
        self.mlp = moe.MoeMLP(spec, rngs, LlamaMLP) if self.sparse else LlamaMLP(spec, rngs)

    def __call__(self, x_BxLxD, positions_BxL, rngs: nnx.Rngs | None,
                 segment_ids_BxL: jax.Array | None = None
                 ) -> tuple[jax.Array, moe.RouterStats | None]:
        """The new hidden states, and the router's statistics (None in a dense layer)."""
        x_BxLxD = x_BxLxD + self.self_attn(self.input_layernorm(x_BxLxD), positions_BxL, rngs,
                                           segment_ids_BxL)
        mlp_BxLxD, stats = self._mlp(self.post_attention_layernorm(x_BxLxD), rngs)
        return x_BxLxD + mlp_BxLxD, stats

    def _mlp(self, x_BxLxD, rngs: nnx.Rngs | None = None):
        if self.sparse:
            return self.mlp(x_BxLxD, rngs)
        return self.mlp(x_BxLxD, rngs), None

    def decode(self, x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, index, mask_BxLxS):
        """`__call__` attending over the cache (see `LlamaAttention.decode`)."""
        attn_BxLxD, keys_BxSxGxH, values_BxSxGxH = self.self_attn.decode(
            self.input_layernorm(x_BxLxD), positions_BxL, keys_BxSxGxH, values_BxSxGxH, index,
            mask_BxLxS,
        )
        x_BxLxD = x_BxLxD + attn_BxLxD
        return (x_BxLxD + self._mlp(self.post_attention_layernorm(x_BxLxD))[0], keys_BxSxGxH,
                values_BxSxGxH)


class LlamaModel(nnx.Module):
    """The body: token embeddings, the decoder layers and the final norm."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.embed_tokens = embedding(cfg.vocab_size, spec, rngs, rows="vocab")
        layers = [LlamaDecoderLayer(spec, rngs, index) for index in range(cfg.num_layers)]
        # model.scan_layers: one layer whose parameters are every layer's, stacked.
        self.layers = stack_blocks(layers) if cfg.scan_layers else nnx.List(layers)
        self.norm = RMSNorm(spec)
        self.remat = Remat(cfg.remat)
        self.scan_layers, self.num_layers = cfg.scan_layers, cfg.num_layers
        self.moe = cfg.moe
        self.balance_context = spec.balanced_rows

    def __call__(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None, *,
                 segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        """Hidden states (B, L, D). With `segment_ids_BxL` each token attends within its
        segment only; `positions_BxL` (each token's position within its document) sets its
        rotary angles; without, the row is one sequence at positions 0..L-1."""
        return self.run(input_ids_BxL, rngs, segment_ids_BxL=segment_ids_BxL,
                        positions_BxL=positions_BxL)[0]

    def run(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None, *,
            segment_ids_BxL: jax.Array | None = None,
            positions_BxL: jax.Array | None = None
            ) -> tuple[jax.Array, moe.RouterStats | None]:
        """`__call__`'s hidden states, and the sparse layers' router statistics stacked in
        layer order (None for a dense model)."""
        if positions_BxL is None:
            positions_BxL = jnp.arange(input_ids_BxL.shape[1])[None]
        # Over a context axis, the rows in its balanced order until the last norm's output.
        order = row_order(input_ids_BxL.shape[1], self.balance_context)
        input_ids_BxL, segment_ids_BxL = (balanced_rows(input_ids_BxL, order),
                                          balanced_rows(segment_ids_BxL, order))
        positions_BxL = balanced_rows(positions_BxL, order)
        x_BxLxD = self.embed_tokens(input_ids_BxL)
        x_BxLxD, stats = run_layers_collecting(
            self.layers, self.scan_layers,
            lambda layer, x_BxLxD, rngs: run_block(layer, self.remat, x_BxLxD, positions_BxL,
                                                   rngs, segment_ids_BxL),
            x_BxLxD, rngs)
        return contiguous_rows(self.norm(x_BxLxD), order), stats


class LlamaForCausalLM(nnx.Module):
    """Token ids in, next-token logits out. Pass `rngs` to train (dropout on), None to evaluate.
    The same interface as GPT-2's LM (`hidden_states`, `lm_head_logits`, `init_cache`,
    `decode`, `context_length`), so training, evaluation and generation need no per-family code."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        check_llama(spec)
        cfg = spec.model
        self.model = LlamaModel(spec, rngs)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = dense(cfg.hidden_size, cfg.vocab_size, spec, rngs, cfg.initializer_range,
                                 use_bias=False, logical_axes=("embed", "vocab"))
        self.context_length = cfg.max_positions
        self.num_kv_heads, self.head_width = kv_heads(cfg), head_width(cfg)

    @staticmethod
    def lookup_params(cfg: ModelConfig) -> int:
        """Parameters only looked up, never multiplied: an untied token table (its LM head is a
        matrix of its own); a tied one multiplies, as the LM head, and counts once. Rotary
        positions have no table."""
        return 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size

    def __call__(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None = None, *,
                 segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        return self.lm_head_logits(self.hidden_states(
            input_ids_BxL, rngs, segment_ids_BxL=segment_ids_BxL, positions_BxL=positions_BxL))

    def hidden_states(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None = None, *,
                      segment_ids_BxL: jax.Array | None = None,
                      positions_BxL: jax.Array | None = None) -> jax.Array:
        """The final (normalised) hidden state of every position: (B, L, D); documents as
        `LlamaModel` says."""
        return self.model(input_ids_BxL, rngs, segment_ids_BxL=segment_ids_BxL,
                          positions_BxL=positions_BxL)

    def hidden_states_and_aux(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None = None, *,
                              segment_ids_BxL: jax.Array | None = None,
                              positions_BxL: jax.Array | None = None
                              ) -> tuple[jax.Array, moe.AuxLosses | None]:
        """`hidden_states`, and what a Mixture-of-Experts model adds to its training loss with
        the metrics beside it (`moe.aux_losses`); None for a dense model."""
        x_BxLxD, stats = self.model.run(input_ids_BxL, rngs, segment_ids_BxL=segment_ids_BxL,
                                        positions_BxL=positions_BxL)
        return x_BxLxD, None if stats is None else moe.aux_losses(stats, self.model.moe)

    def lm_head_logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (B, L, V) of final hidden states (`hidden_states`, or any slice of their
        positions): the LM head, or the token embeddings when tied."""
        if self.tie_word_embeddings:
            return self.model.embed_tokens.attend(x_BxLxD)
        return self.lm_head(x_BxLxD)

    def init_cache(self, batch_size: int, num_slots: int) -> KVCache:
        """An empty cache for `batch_size` rows of up to `num_slots` tokens, prompt included:
        the key/value heads only."""
        return empty_cache(batch_size, num_slots, self.model.num_layers, self.num_kv_heads,
                           self.head_width, self.model.embed_tokens.dtype,
                           stacked=self.model.scan_layers)

    def decode(self, input_ids_BxL: jax.Array, cache: KVCache,
               input_mask_BxL: jax.Array | None = None,
               branches_BxL: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Logits of L new tokens given everything in `cache`, and the cache with them in it
        (as `GPT2LMHeadModel.decode`: the prompt once, left-padded, then a token a step)."""
        x_BxLxD, cache = self.decode_hidden_states(input_ids_BxL, cache, input_mask_BxL,
                                                   branches_BxL)
        return self.lm_head_logits(x_BxLxD), cache

    def decode_hidden_states(self, input_ids_BxL: jax.Array, cache: KVCache,
                             input_mask_BxL: jax.Array | None = None,
                             branches_BxL: jax.Array | None = None
                             ) -> tuple[jax.Array, KVCache]:
        """`decode` up to the final (normalised) hidden states (B, L, D)."""
        L = input_ids_BxL.shape[1]
        positions_BxL, filled_BxS, mask_BxLxS = decode_step(cache, input_mask_BxL, L,
                                                            branches_BxL)
        x_BxLxD = self.model.embed_tokens(input_ids_BxL)
        x_BxLxD, keys, values = decode_layers(
            self.model.layers, self.model.scan_layers,
            lambda layer, x_BxLxD, keys_BxSxGxH, values_BxSxGxH: layer.decode(
                x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, cache.index, mask_BxLxS),
            x_BxLxD, cache)
        return self.model.norm(x_BxLxD), KVCache(keys, values, filled_BxS, cache.index + L)


class LlamaForSequenceClassification(nnx.Module):
    """Llama as a classifier, as HF's class of that name: the hidden state of each row's last
    non-padding token through `score` (no bias) gives the logits (B, C); C = 1 is regression.

    The last non-padding token is the rightmost position the attention mask keeps
    (`layers.last_token_states`); causal attention means it never saw padding after it.
    `token_type_ids_BxL` is accepted for a common signature with BERT and ignored.
    """

    def __init__(self, spec: TransformerSpec, num_labels: int, rngs: nnx.Rngs):
        check_llama(spec)
        cfg = spec.model
        self.model = LlamaModel(spec, rngs)
        self.score = dense(cfg.hidden_size, num_labels, spec, rngs, cfg.initializer_range,
                           use_bias=False, logical_axes=("embed", "classes"))

    @staticmethod
    def lookup_params(cfg: ModelConfig) -> int:
        """Parameters only looked up, never multiplied: the token table (a classifier has no LM
        head). Rotary positions have no table."""
        return cfg.vocab_size * cfg.hidden_size

    def __call__(self, input_ids_BxL, attention_mask_BxL, token_type_ids_BxL=None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        x_BxLxD = self.model(input_ids_BxL, rngs)
        return self.score(last_token_states(x_BxLxD, attention_mask_BxL))


# ---------------------------------------------------------------- Qwen2


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2's language model: Llama's with biases on the q/k/v projections (`model.qkv_bias`),
    under HF's class name, so that import and export read and write Qwen2's config.json."""


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    """Qwen2's classifier: `LlamaForSequenceClassification` with Qwen2's biases, as its LM."""


# ---------------------------------------------------------------- Mistral


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's language model: Llama's without biases, under HF's class name, so that
    import and export read and write MistralConfig's config.json (its `sliding_window`)."""


class MistralForSequenceClassification(LlamaForSequenceClassification):
    """Mistral's classifier: `LlamaForSequenceClassification` under Mistral's name."""


# ---------------------------------------------------------------- Hugging Face names

# HF's llama3 rope parameters by our RopeScaling field, and its type (factor is every scaled
# type's).
_LLAMA3_FIELDS = {"low_freq_factor": ("low_freq_factor", float),
                  "high_freq_factor": ("high_freq_factor", float),
                  "original_max_positions": ("original_max_position_embeddings", int)}


def llama_to_hf(model: ModelConfig) -> dict:
    """The HF config's values that are not one field of ours each: `rope_parameters`, the
    head width (transformers' attention reads `head_dim` where a config has it, else divides)
    and the key/value heads (null is one per query head, which not every config reads so)."""
    return {**_rope_to_hf(model), "head_dim": head_width(model),
            "num_key_value_heads": kv_heads(model)}


def attention_from_hf(config) -> dict:
    """Our rope settings and head width from an HF config of the llama family, and no
    sliding window (the families that can have one read theirs: `_window_from_hf`)."""
    head_dim = getattr(config, "head_dim", None)
    own_width = head_dim and head_dim != config.hidden_size // config.num_attention_heads
    return {**_rope_from_hf(config), "head_dim": head_dim if own_width else None,
            "sliding_window": None, "full_attention_layers": 0}


def _window_from_hf(config) -> dict:
    """model.sliding_window and full_attention_layers from a Mistral or Qwen2 config: Mistral
    slides its window in every layer, Qwen2 in the layers `layer_types` calls
    "sliding_attention" (transformers: those from max_window_layers on, when
    use_sliding_window), which `windowed_layers_problem` has found to be the last ones."""
    window = config.sliding_window
    kinds = _layer_kinds(config)
    if window is None or (kinds is not None and "sliding_attention" not in kinds):
        return {"sliding_window": None, "full_attention_layers": 0}
    full = kinds.index("sliding_attention") if kinds is not None else 0
    return {"sliding_window": int(window), "full_attention_layers": full}


def _layer_kinds(config) -> list[str] | None:
    """Each layer's attention as Qwen2's `layer_types` names it; None where a window slides in
    every layer (MistralModel reads no layer_types, whatever its config.json holds)."""
    return getattr(config, "layer_types", None) if config.model_type == "qwen2" else None


def windowed_layers_problem(config) -> str | None:
    """Why our model cannot hold the sliding-window layers of `config` (None if it can): a
    window slides in the layers after the first full_attention_layers, in all of them."""
    kinds = _layer_kinds(config)
    if config.sliding_window is None or not kinds or "sliding_attention" not in kinds:
        return None
    first = kinds.index("sliding_attention")
    if any(kind != "sliding_attention" for kind in kinds[first:]):
        windowed = [layer for layer, kind in enumerate(kinds) if kind == "sliding_attention"]
        return (f"sliding-window attention in layers {windowed} only (layer_types): flaxlm "
                "slides the window in every layer after a leading run of full-attention ones "
                "(model.full_attention_layers)")
    return None


def window_to_hf(model: ModelConfig, family: ModelFamily) -> dict:
    """The HF config's sliding window for ours: Mistral's `sliding_window` always (null for
    none: MistralConfig's default is 4096); Qwen2's `use_sliding_window`, `sliding_window`
    and `max_window_layers` when there is one (Qwen2Config's defaults have none)."""
    if family is ModelFamily.mistral:
        return {"sliding_window": model.sliding_window}
    if model.sliding_window is None:
        return {}
    return {"use_sliding_window": True, "sliding_window": model.sliding_window,
            "max_window_layers": model.full_attention_layers}


# HF's yarn rope parameters by our RopeScaling field (an optional one only when set).
_YARN_FIELDS = {"original_max_positions": ("original_max_position_embeddings", int),
                "beta_fast": ("beta_fast", float), "beta_slow": ("beta_slow", float),
                "attention_factor": ("attention_factor", float), "mscale": ("mscale", float),
                "mscale_all_dim": ("mscale_all_dim", float), "truncate": ("truncate", bool)}


def _rope_to_hf(model: ModelConfig) -> dict:
    """The HF config's `rope_parameters` for our rope settings."""
    scaling = model.rope_scaling
    rope = {"rope_type": scaling.type, "rope_theta": model.rope_theta}
    if scaling.type != "default":
        rope["factor"] = scaling.factor
    fields = {"llama3": _LLAMA3_FIELDS, "yarn": _YARN_FIELDS}.get(scaling.type, {})
    rope.update({theirs: getattr(scaling, ours) for ours, (theirs, _) in fields.items()
                 if getattr(scaling, ours) is not None})
    return {"rope_parameters": rope}


def _rope_from_hf(config) -> dict:
    """Our rope settings from an HF config (which reads old `rope_theta`/`rope_scaling` too);
    what a llama3 checkpoint leaves out is RopeScaling's default."""
    rope = config.rope_parameters or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields = {"llama3": _LLAMA3_FIELDS, "yarn": _YARN_FIELDS}.get(kind, {})
    given = {ours: convert(rope[theirs]) for ours, (theirs, convert) in fields.items()
             if rope.get(theirs) is not None}
    factor = rope.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek's: the context's growth is the factor
        factor = config.max_position_embeddings / rope["original_max_position_embeddings"]
    return {"rope_theta": float(rope.get("rope_theta", 10000.0)),
            "rope_scaling": RopeScaling(type=kind, factor=float(factor or 1.0), **given)}


# What a dense checkpoint says of the settings only other families have: no experts and no
# query/key norms, whatever the preset it is loaded into had.
DENSE = {"moe": {"num_experts": None}, "qk_norm": QKNorm.none}


def _llama_from_hf(config) -> dict:
    """LlamaConfig's biases are `attention_bias` (q/k/v/o) and `mlp_bias`: none on q/k/v only."""
    return {**attention_from_hf(config), "qkv_bias": False, **DENSE}


def _qwen2_from_hf(config) -> dict:
    """Qwen2Config has no bias settings: Qwen2's are on q/k/v, and nowhere else."""
    return {**attention_from_hf(config), "qkv_bias": True, "attention_bias": False,
            "mlp_bias": False, **DENSE, **_window_from_hf(config)}


def _mistral_from_hf(config) -> dict:
    """MistralConfig has no bias settings: Mistral has none."""
    return {**attention_from_hf(config), "qkv_bias": False, "attention_bias": False,
            "mlp_bias": False, **DENSE, **_window_from_hf(config)}


def unsupported_in(config_class_name: str, windows: bool = False):
    """What a checkpoint of this config class uses that our module does not implement;
    `windows`: the family holds a sliding window (`windowed_layers_problem` says which
    layouts of it)."""

    def unsupported(raw: dict) -> str | None:
        config = getattr(transformers, config_class_name).from_dict(raw)
        kind = (config.rope_parameters or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            return f"rope_type={kind!r} (flaxlm implements {', '.join(ROPE_TYPES)} RoPE)"
        if windows:
            return windowed_layers_problem(config)
        if getattr(config, "use_sliding_window", False):
            return "sliding-window attention (use_sliding_window=true)"
        return None

    return unsupported


_SHAPE_FIELDS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_positions",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "mlp_size",
    "hidden_act": "activation",
    "rms_norm_eps": "layer_norm_eps",
    "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_word_embeddings",
}

HF_NAMES = HFNames(
    model_type="llama",
    config_class_name="LlamaConfig",
    shape_fields={**_SHAPE_FIELDS, "attention_bias": "attention_bias", "mlp_bias": "mlp_bias"},
    dropout_fields={"attention_dropout": "attention_dropout"},
    special_tokens=("bos_token_id", "eos_token_id", "pad_token_id"),
    body_prefix="model.",
    body_modules=("embed_tokens", "layers", "norm"),
    layers_module="layers",
    linear_modules=("model", "lm_head", "score"),  # every projection is an nn.Linear
    mlp_width_required=True,
    shape_settings=(("embed_tokens", "model.vocab_size"), ("lm_head", "model.vocab_size"),
                    ("k_proj", "model.num_kv_heads"), ("v_proj", "model.num_kv_heads"),
                    ("mlp.", "model.mlp_size")),
    unsupported=unsupported_in("LlamaConfig"),
    config_to_hf=llama_to_hf,
    config_from_hf=_llama_from_hf,
)

# Qwen2's checkpoints have Llama's names and layout, plus the q/k/v biases; its config has the
# same fields less the bias settings, and a sliding window.
QWEN2_HF_NAMES = dataclasses.replace(
    HF_NAMES,
    model_type="qwen2",
    config_class_name="Qwen2Config",
    shape_fields=_SHAPE_FIELDS,
    unsupported=unsupported_in("Qwen2Config", windows=True),
    config_to_hf=lambda model: {**llama_to_hf(model), **window_to_hf(model, ModelFamily.qwen2)},
    config_from_hf=_qwen2_from_hf,
)

# Mistral's checkpoints have Llama's names and layout without biases; its config has the same
# fields less the bias settings, and a sliding window in every layer.
MISTRAL_HF_NAMES = dataclasses.replace(
    HF_NAMES,
    model_type="mistral",
    config_class_name="MistralConfig",
    shape_fields=_SHAPE_FIELDS,
    unsupported=unsupported_in("MistralConfig", windows=True),
    config_to_hf=lambda model: {**llama_to_hf(model),
                                **window_to_hf(model, ModelFamily.mistral)},
    config_from_hf=_mistral_from_hf,
)
