"""The Llama decoder in Flax NNX, with the parameter layout of transformers' `LlamaForCausalLM`:
pre-norm blocks with RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query
attention (G key/value heads, each serving N / G query heads). Mistral, Qwen2, SmolLM and OLMo
share this design.

The module tree mirrors HF's names (`model.embed_tokens`, `model.layers.<i>.self_attn.q_proj`,
`model.layers.<i>.mlp.gate_proj`, `model.norm`, `lm_head`), so a checkpoint maps one to one
(see `flaxlm.models.hf`); every projection is an nn.Linear in HF, stored (out, in), so its
kernel is transposed both ways. With tied embeddings (`model.tie_word_embeddings`) the head is
the token table and `lm_head` does not exist.

Numerics follow HF's: RMSNorm and the attention softmax in float32 whatever the compute dtype,
RoPE with `rotate_half` (the two halves of each head, not interleaved pairs) and inverse
frequencies in float32. Generation is GPT-2's (`layers.KVCache`, `layers.decode_step`); the
cache holds only the G key/value heads.

Shapes are in the names: B batch, L sequence length, D model width, N query heads, G key/value
heads, H head width, F MLP width, V vocabulary, S cache slots, C classes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx

from flaxlm.config import ModelConfig, Remat, RopeScaling
from flaxlm.errors import FlaxlmError
from flaxlm.models.attention import attention
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
    run_layers,
    stack_blocks,
)

ROPE_TYPES = ("default", "linear")  # HF's rope_type names


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
    scaling = cfg.rope_scaling
    if scaling.type not in ROPE_TYPES or scaling.factor <= 0:
        raise FlaxlmError(
            f"model.rope_scaling={{type: {scaling.type}, factor: {scaling.factor}}} is not "
            "supported: flaxlm's Llama implements model.rope_scaling.type default (no scaling) "
            "and linear (positions divided by model.rope_scaling.factor), with a factor > 0."
        )


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads or cfg.num_heads


def rotary(positions_BxL: jax.Array, head_width: int, theta: float,
           factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every position's rotation angles, (B, L, 1, H), in float32: HF's
    inverse frequencies theta^(-2i/H), divided by the linear scaling factor, each used for
    both halves of the head. R = H / 2 frequencies."""
    exponents_R = np.arange(0, head_width, 2, dtype=np.float32) / head_width
    inv_freq_R = (1.0 / np.float32(theta) ** exponents_R / np.float32(factor)).astype(np.float32)
    angles_BxLxR = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_R
    angles_BxLx1xH = jnp.concatenate([angles_BxLxR, angles_BxLxR], axis=-1)[:, :, None, :]
    return jnp.cos(angles_BxLx1xH), jnp.sin(angles_BxLx1xH)


def apply_rotary(x_BxLxNxH: jax.Array, cos_BxLx1xH: jax.Array, sin_BxLx1xH: jax.Array):
    """x rotated by the angles, in x's dtype: x·cos + rotate_half(x)·sin, as HF."""
    x1, x2 = jnp.split(x_BxLxNxH, 2, axis=-1)
    rotated_BxLxNxH = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxLx1xH.astype(x_BxLxNxH.dtype), sin_BxLx1xH.astype(x_BxLxNxH.dtype)
    return x_BxLxNxH * cos + rotated_BxLxNxH * sin


class LlamaAttention(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.num_heads, self.num_kv_heads = cfg.num_heads, kv_heads(cfg)
        self.head_width = cfg.hidden_size // cfg.num_heads
        self.rope_theta = cfg.rope_theta
        linear = cfg.rope_scaling.type == "linear"
        self.rope_factor = cfg.rope_scaling.factor if linear else 1.0
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention
        kv_width = self.num_kv_heads * self.head_width

        def projection(width_in, width_out, logical_axes):
            return dense(width_in, width_out, spec, rngs, cfg.initializer_range,
                         use_bias=cfg.attention_bias, logical_axes=logical_axes)

        self.q_proj = projection(cfg.hidden_size, cfg.hidden_size, ("embed", "heads"))
        self.k_proj = projection(cfg.hidden_size, kv_width, ("embed", "kv_heads"))
        self.v_proj = projection(cfg.hidden_size, kv_width, ("embed", "kv_heads"))
        self.o_proj = projection(cfg.hidden_size, cfg.hidden_size, ("heads", "embed"))

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
                 rngs: nnx.Rngs | None, segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        out_BxLxNxH = attention(*self._heads(x_BxLxD, positions_BxL), is_causal=True,
                                segment_ids_BxL=segment_ids_BxL,
                                dropout_rate=self.attention_dropout, rngs=rngs,
                                backend=self.attention_backend)
        return self.o_proj(out_BxLxNxH.reshape(B, L, D))

    def decode(self, x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, index, mask_BxLxS):
        """Attention of L new positions over the cache (`layers.cached_attention`)."""
        B, L, D = x_BxLxD.shape
        out_BxLxNxH, keys_BxSxGxH, values_BxSxGxH = cached_attention(
            *self._heads(x_BxLxD, positions_BxL), keys_BxSxGxH, values_BxSxGxH, index,
            mask_BxLxS, self.attention_backend)
        return self.o_proj(out_BxLxNxH.reshape(B, L, D)), keys_BxSxGxH, values_BxSxGxH

    def _heads(self, x_BxLxD: jax.Array, positions_BxL: jax.Array):
        B, L, _ = x_BxLxD.shape
        H = self.head_width
        q_BxLxNxH = self.q_proj(x_BxLxD).reshape(B, L, self.num_heads, H)
        k_BxLxGxH = self.k_proj(x_BxLxD).reshape(B, L, self.num_kv_heads, H)
        v_BxLxGxH = self.v_proj(x_BxLxD).reshape(B, L, self.num_kv_heads, H)
        cos_BxLx1xH, sin_BxLx1xH = rotary(positions_BxL, H, self.rope_theta, self.rope_factor)
        return (apply_rotary(q_BxLxNxH, cos_BxLx1xH, sin_BxLx1xH),
                apply_rotary(k_BxLxGxH, cos_BxLx1xH, sin_BxLx1xH), v_BxLxGxH)


class LlamaMLP(nnx.Module):
    """SwiGLU: down(act(gate(x)) × up(x))."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        F = spec.mlp_width

        def projection(width_in, width_out, logical_axes):
            return dense(width_in, width_out, spec, rngs, cfg.initializer_range,
                         use_bias=cfg.mlp_bias, logical_axes=logical_axes)

        self.gate_proj = projection(cfg.hidden_size, F, ("embed", "mlp"))
        self.up_proj = projection(cfg.hidden_size, F, ("embed", "mlp"))
        self.down_proj = projection(F, cfg.hidden_size, ("mlp", "embed"))
        self.activation = ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down_proj(self.activation(self.gate_proj(x_BxLxD)) * self.up_proj(x_BxLxD))


class LlamaDecoderLayer(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). Llama's only dropout is on attention weights."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(spec)
        self.self_attn = LlamaAttention(spec, rngs)
        self.post_attention_layernorm = RMSNorm(spec)
        self.mlp = LlamaMLP(spec, rngs)

    def __call__(self, x_BxLxD, positions_BxL, rngs: nnx.Rngs | None,
                 segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        x_BxLxD = x_BxLxD + self.self_attn(self.input_layernorm(x_BxLxD), positions_BxL, rngs,
                                           segment_ids_BxL)
        return x_BxLxD + self.mlp(self.post_attention_layernorm(x_BxLxD))

    def decode(self, x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, index, mask_BxLxS):
        """`__call__` attending over the cache (see `LlamaAttention.decode`)."""
        attn_BxLxD, keys_BxSxGxH, values_BxSxGxH = self.self_attn.decode(
            self.input_layernorm(x_BxLxD), positions_BxL, keys_BxSxGxH, values_BxSxGxH, index,
            mask_BxLxS,
        )
        x_BxLxD = x_BxLxD + attn_BxLxD
        return (x_BxLxD + self.mlp(self.post_attention_layernorm(x_BxLxD)), keys_BxSxGxH,
                values_BxSxGxH)


class LlamaModel(nnx.Module):
    """The body: token embeddings, the decoder layers and the final norm."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.embed_tokens = embedding(cfg.vocab_size, spec, rngs, rows="vocab")
        layers = [LlamaDecoderLayer(spec, rngs) for _ in range(cfg.num_layers)]
        # model.scan_layers: one layer whose parameters are every layer's, stacked.
        self.layers = stack_blocks(layers) if cfg.scan_layers else nnx.List(layers)
        self.norm = RMSNorm(spec)
        self.remat = Remat(cfg.remat)
        self.scan_layers, self.num_layers = cfg.scan_layers, cfg.num_layers

    def __call__(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None, *,
                 segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        """Hidden states (B, L, D). With `segment_ids_BxL` each token attends within its
        segment only; `positions_BxL` (each token's position within its document) sets its
        rotary angles; without, the row is one sequence at positions 0..L-1."""
        if positions_BxL is None:
            positions_BxL = jnp.arange(input_ids_BxL.shape[1])[None]
        x_BxLxD = self.embed_tokens(input_ids_BxL)
        x_BxLxD = run_layers(
            self.layers, self.scan_layers,
            lambda layer, x_BxLxD, rngs: run_block(layer, self.remat, x_BxLxD, positions_BxL,
                                                   rngs, segment_ids_BxL),
            x_BxLxD, rngs)
        return self.norm(x_BxLxD)


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
        self.num_kv_heads, self.head_width = kv_heads(cfg), cfg.hidden_size // cfg.num_heads

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
               input_mask_BxL: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Logits of L new tokens given everything in `cache`, and the cache with them in it
        (as `GPT2LMHeadModel.decode`: the prompt once, left-padded, then a token a step)."""
        L = input_ids_BxL.shape[1]
        positions_BxL, filled_BxS, mask_BxLxS = decode_step(cache, input_mask_BxL, L)
        x_BxLxD = self.model.embed_tokens(input_ids_BxL)
        x_BxLxD, keys, values = decode_layers(
            self.model.layers, self.model.scan_layers,
            lambda layer, x_BxLxD, keys_BxSxGxH, values_BxSxGxH: layer.decode(
                x_BxLxD, positions_BxL, keys_BxSxGxH, values_BxSxGxH, cache.index, mask_BxLxS),
            x_BxLxD, cache)
        logits_BxLxV = self.lm_head_logits(self.model.norm(x_BxLxD))
        return logits_BxLxV, KVCache(keys, values, filled_BxS, cache.index + L)


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


# ---------------------------------------------------------------- Hugging Face names


def _rope_to_hf(model: ModelConfig) -> dict:
    """LlamaConfig's `rope_parameters` for our rope settings."""
    rope = {"rope_type": model.rope_scaling.type, "rope_theta": model.rope_theta}
    if model.rope_scaling.type == "linear":
        rope["factor"] = model.rope_scaling.factor
    return {"rope_parameters": rope}


def _rope_from_hf(config) -> dict:
    """Our rope settings from a LlamaConfig (which reads old `rope_theta`/`rope_scaling` too)."""
    rope = config.rope_parameters or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    return {"rope_theta": float(rope.get("rope_theta", 10000.0)),
            "rope_scaling": RopeScaling(type=kind, factor=float(rope.get("factor", 1.0)))}


def _unsupported_variant(raw: dict) -> str | None:
    config = transformers.LlamaConfig.from_dict(raw)
    kind = (config.rope_parameters or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        return f"rope_type={kind!r} (flaxlm implements default and linear RoPE)"
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        return f"head_dim={config.head_dim} other than hidden_size / num_attention_heads"
    return None


HF_NAMES = HFNames(
    model_type="llama",
    config_class_name="LlamaConfig",
    shape_fields={
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
        "attention_bias": "attention_bias",
        "mlp_bias": "mlp_bias",
    },
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
    unsupported=_unsupported_variant,
    config_to_hf=_rope_to_hf,
    config_from_hf=_rope_from_hf,
)
