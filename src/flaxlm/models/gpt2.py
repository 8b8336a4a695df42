"""GPT-2 in Flax NNX, with the parameter layout of transformers' `GPT2LMHeadModel`.

The module tree mirrors HF's names (`wte`, `wpe`, `h.<i>.ln_1`, `h.<i>.attn.c_attn`, ...), so a
checkpoint maps one to one (see `flaxlm.models.hf`): HF's `Conv1D.weight` is stored (in, out),
exactly like our `Linear.kernel`; LayerNorm `weight` is our `scale`; embedding `weight` is our
`embedding`. The LM head is tied to `wte`, as in HF, so it has no parameters of its own.

Generation runs the same modules through `decode`, against a `layers.KVCache`: the keys and
values of every position so far, preallocated to the full length and passed in and returned
(never stored on a module), so a jitted decode loop keeps one shape.

Shapes are in the names: B batch, L sequence length, D model width, N heads, H head width,
F MLP width, V vocabulary, S cache slots (prompt + new tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlm.config import ModelConfig, Remat
from flaxlm.models.attention import attention
from flaxlm.models.context_parallel import balanced_rows, contiguous_rows, row_order
from flaxlm.models.dropout import Dropout
from flaxlm.models.layers import (
    ACTIVATIONS,
    HFNames,
    KVCache,
    TransformerSpec,
    cached_attention,
    check_shape,
    decode_layers,
    decode_step,
    dense,
    embedding,
    empty_cache,
    last_token_states,
    layer_norm,
    run_block,
    run_layers,
    stack_blocks,
)


class Attention(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.num_heads = cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention
        self.balance_context = spec.balanced_rows
        self.context_attention = cfg.context_attention
        # GPT-2 scales the init of every projection into the residual stream by 1/sqrt(2 layers).
        residual_std = cfg.initializer_range / (2 * cfg.num_layers) ** 0.5
        # c_attn's columns are q | k | v, each head by head: "heads" splits them in whole
        # blocks only where 3 × hidden_size divides evenly; any split computes the same result.
        self.c_attn = dense(cfg.hidden_size, 3 * cfg.hidden_size, spec, rngs, cfg.initializer_range,
                            logical_axes=("embed", "heads"), name="c_attn")
        self.c_proj = dense(cfg.hidden_size, cfg.hidden_size, spec, rngs, residual_std,
                            logical_axes=("heads", "embed"), name="c_proj")
        self.resid_dropout = Dropout(cfg.hidden_dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None,
                 segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = self._heads(x_BxLxD, rngs)
        out_BxLxNxH = attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, is_causal=True,
                                segment_ids_BxL=segment_ids_BxL,
                                dropout_rate=self.attention_dropout, rngs=rngs,
                                backend=self.attention_backend,
                                context=self.context_attention,
                                row_order=row_order(L, self.balance_context))
        out_BxLxD = self.c_proj(out_BxLxNxH.reshape(B, L, D), rngs)
        return self.resid_dropout(out_BxLxD, deterministic=rngs is None, rngs=rngs)

    def decode(self, x_BxLxD: jax.Array, keys_BxSxNxH: jax.Array, values_BxSxNxH: jax.Array,
               index: jax.Array, mask_BxLxS: jax.Array):
        """Attention of L new positions over the cache (`layers.cached_attention`). Returns
        the output and the updated keys and values."""
        B, L, D = x_BxLxD.shape
        out_BxLxNxH, keys_BxSxNxH, values_BxSxNxH = cached_attention(
            *self._heads(x_BxLxD), keys_BxSxNxH, values_BxSxNxH, index, mask_BxLxS,
            self.attention_backend)
        return self.c_proj(out_BxLxNxH.reshape(B, L, D)), keys_BxSxNxH, values_BxSxNxH

    def _heads(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None = None):
        B, L, D = x_BxLxD.shape
        qkv_BxLx3D = self.c_attn(x_BxLxD, rngs)
        return (
            part.reshape(B, L, self.num_heads, D // self.num_heads)
            for part in jnp.split(qkv_BxLx3D, 3, axis=-1)
        )


class MLP(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        residual_std = cfg.initializer_range / (2 * cfg.num_layers) ** 0.5
        self.c_fc = dense(cfg.hidden_size, spec.mlp_width, spec, rngs, cfg.initializer_range,
                          logical_axes=("embed", "mlp"), name="c_fc")
        self.c_proj = dense(spec.mlp_width, cfg.hidden_size, spec, rngs, residual_std,
                            logical_axes=("mlp", "embed"), name="c_proj")
        self.activation = ACTIVATIONS[cfg.activation]
        self.dropout = Dropout(cfg.hidden_dropout)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        h_BxLxF = self.activation(self.c_fc(x_BxLxD, rngs))
        return self.dropout(self.c_proj(h_BxLxF, rngs), deterministic=rngs is None, rngs=rngs)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        self.ln_1 = layer_norm(spec, rngs)
        self.attn = Attention(spec, rngs)
        self.ln_2 = layer_norm(spec, rngs)
        self.mlp = MLP(spec, rngs)

    def __call__(self, x_BxLxD: jax.Array, rngs: nnx.Rngs | None,
                 segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.ln_1(x_BxLxD), rngs, segment_ids_BxL)
        return x_BxLxD + self.mlp(self.ln_2(x_BxLxD), rngs)

    def decode(self, x_BxLxD, keys_BxSxNxH, values_BxSxNxH, index, mask_BxLxS):
        """`__call__` without dropout, attending over the cache (see `Attention.decode`)."""
        attn_BxLxD, keys_BxSxNxH, values_BxSxNxH = self.attn.decode(
            self.ln_1(x_BxLxD), keys_BxSxNxH, values_BxSxNxH, index, mask_BxLxS
        )
        x_BxLxD = x_BxLxD + attn_BxLxD
        return x_BxLxD + self.mlp(self.ln_2(x_BxLxD), None), keys_BxSxNxH, values_BxSxNxH


class GPT2LMHeadModel(nnx.Module):
    """Token ids in, next-token logits out. Pass `rngs` to train (dropout on), None to evaluate."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        check_shape(spec)
        cfg = spec.model
        self.wte = embedding(cfg.vocab_size, spec, rngs, rows="vocab")
        self.wpe = embedding(cfg.max_positions, spec, rngs)
        self.drop = Dropout(cfg.embedding_dropout)
        blocks = [Block(spec, rngs) for _ in range(cfg.num_layers)]
        # model.scan_layers: one Block whose parameters are every layer's, stacked.
        self.h = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.ln_f = layer_norm(spec, rngs)
        self.remat = Remat(cfg.remat)
        self.scan_layers, self.num_layers, self.num_heads = (cfg.scan_layers, cfg.num_layers,
                                                             cfg.num_heads)
        self.balance_context = spec.balanced_rows

    @staticmethod
    def lookup_params(cfg: ModelConfig) -> int:
        """Parameters only looked up, never multiplied: the position table. The token table
        multiplies, as the tied LM head, and counts once."""
        return cfg.max_positions * cfg.hidden_size

    def __call__(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None = None, *,
                 segment_ids_BxL: jax.Array | None = None,
                 positions_BxL: jax.Array | None = None) -> jax.Array:
        return self.lm_head_logits(self.hidden_states(
            input_ids_BxL, rngs, segment_ids_BxL=segment_ids_BxL, positions_BxL=positions_BxL))

    def lm_head_logits(self, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (B, L, V) of final hidden states (`hidden_states`, or any slice of their
        positions): the tied head, against the token embeddings, in the compute dtype."""
        return self.wte.attend(x_BxLxD)

    def hidden_states(self, input_ids_BxL: jax.Array, rngs: nnx.Rngs | None = None, *,
                      segment_ids_BxL: jax.Array | None = None,
                      positions_BxL: jax.Array | None = None) -> jax.Array:
        """The final (ln_f-normalised) hidden state of every position: (B, L, D). With
        `segment_ids_BxL` each token attends within its segment only, and `positions_BxL`
        (each token's position within its document) picks its position embedding; without,
        the row is one sequence at positions 0..L-1."""
        if positions_BxL is None:
            positions_BxL = jnp.arange(input_ids_BxL.shape[1])[None]
        # Over a context axis, the rows in its balanced order until the last norm's output.
        order = row_order(input_ids_BxL.shape[1], self.balance_context)
        input_ids_BxL, segment_ids_BxL = (balanced_rows(input_ids_BxL, order),
                                          balanced_rows(segment_ids_BxL, order))
        positions_BxL = balanced_rows(positions_BxL, order)
        x_BxLxD = self.wte(input_ids_BxL) + self.wpe(positions_BxL)
        x_BxLxD = self.drop(x_BxLxD, deterministic=rngs is None, rngs=rngs)
        x_BxLxD = run_layers(
            self.h, self.scan_layers,
            lambda block, x_BxLxD, rngs: run_block(block, self.remat, x_BxLxD, rngs,
                                                   segment_ids_BxL),
            x_BxLxD, rngs)
        return contiguous_rows(self.ln_f(x_BxLxD), order)

    @property
    def context_length(self) -> int:
        """The most positions a sequence may have (model.max_positions)."""
        return self.wpe.num_embeddings

    def init_cache(self, batch_size: int, num_slots: int) -> KVCache:
        """An empty cache for `batch_size` rows of up to `num_slots` tokens, prompt included."""
        return empty_cache(batch_size, num_slots, self.num_layers, self.num_heads,
                           self.wte.features // self.num_heads, self.wte.dtype,
                           stacked=self.scan_layers)

    def decode(self, input_ids_BxL: jax.Array, cache: KVCache,
               input_mask_BxL: jax.Array | None = None,
               branches_BxL: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Logits of L new tokens given everything in `cache`, and the cache with them in it.

        The prompt goes in once (L = prompt length, `input_mask_BxL` False on left padding),
        then one token per step (L = 1). Evaluation mode: no dropout. `branches_BxL`: see
        `layers.decode_step`.
        """
        x_BxLxD, cache = self.decode_hidden_states(input_ids_BxL, cache, input_mask_BxL,
                                                   branches_BxL)
        return self.lm_head_logits(x_BxLxD), cache

    def decode_hidden_states(self, input_ids_BxL: jax.Array, cache: KVCache,
                             input_mask_BxL: jax.Array | None = None,
                             branches_BxL: jax.Array | None = None
                             ) -> tuple[jax.Array, KVCache]:
        """`decode` up to the final hidden states (B, L, D), for a caller that needs the
        vocabulary-wide head at a few positions only."""
        L = input_ids_BxL.shape[1]
        positions_BxL, filled_BxS, mask_BxLxS = decode_step(cache, input_mask_BxL, L,
                                                            branches_BxL)
        x_BxLxD = self.wte(input_ids_BxL) + self.wpe(positions_BxL)
        x_BxLxD, keys, values = decode_layers(
            self.h, self.scan_layers,
            lambda block, x_BxLxD, keys_BxSxNxH, values_BxSxNxH: block.decode(
                x_BxLxD, keys_BxSxNxH, values_BxSxNxH, cache.index, mask_BxLxS),
            x_BxLxD, cache)
        return self.ln_f(x_BxLxD), KVCache(keys, values, filled_BxS, cache.index + L)


class GPT2ForSequenceClassification(nnx.Module):
    """GPT-2 as a classifier, as HF's class of that name: the hidden state of each row's last
    non-padding token through `score` (no bias) gives the logits (B, C); C = 1 is regression.

    `transformer` is a whole GPT2LMHeadModel so an LM checkpoint (ours or HF's) maps one to one;
    its tied head is simply unused. The last real token is the rightmost one the attention
    mask keeps (`layers.last_token_states`); rows are right-padded, so causal attention means
    it never saw the padding after it.
    `token_type_ids_BxL` is accepted for a common signature with BERT and ignored.
    """

    def __init__(self, spec: TransformerSpec, num_labels: int, rngs: nnx.Rngs):
        cfg = spec.model
        self.transformer = GPT2LMHeadModel(spec, rngs)
        self.score = dense(cfg.hidden_size, num_labels, spec, rngs, cfg.initializer_range,
                           use_bias=False, logical_axes=("embed", "classes"))

    @staticmethod
    def lookup_params(cfg: ModelConfig) -> int:
        """Parameters only looked up, never multiplied: the token and position tables (the
        tied LM head that would multiply the token table is unused)."""
        return (cfg.vocab_size + cfg.max_positions) * cfg.hidden_size

    def __call__(self, input_ids_BxL, attention_mask_BxL, token_type_ids_BxL=None,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        x_BxLxD = self.transformer.hidden_states(input_ids_BxL, rngs=rngs)
        return self.score(last_token_states(x_BxLxD, attention_mask_BxL))


# ---------------------------------------------------------------- Hugging Face names


def _unsupported_variant(raw: dict) -> str | None:
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("add_cross_attention"):
        return "scale_attn_by_inverse_layer_idx or cross-attention"
    return None


HF_NAMES = HFNames(
    model_type="gpt2",
    config_class_name="GPT2Config",
    shape_fields={
        "vocab_size": "vocab_size",
        "n_positions": "max_positions",
        "n_embd": "hidden_size",
        "n_layer": "num_layers",
        "n_head": "num_heads",
        "n_inner": "mlp_size",  # both: None → 4 × width
        "activation_function": "activation",
        "layer_norm_epsilon": "layer_norm_eps",
        "initializer_range": "initializer_range",
    },
    dropout_fields={
        "resid_pdrop": "hidden_dropout",
        "embd_pdrop": "embedding_dropout",
        "attn_pdrop": "attention_dropout",
    },
    special_tokens=("bos_token_id", "eos_token_id", "pad_token_id"),
    config_extras={"tie_word_embeddings": True},
    body_prefix="transformer.",
    body_modules=("wte", "wpe", "h", "ln_f"),
    layers_module="h",
    linear_modules=("score",),  # the body is Conv1D, stored (in, out) like our kernels
    tied_keys=("lm_head.weight",),
    buffer_suffixes=(".attn.bias", ".attn.masked_bias"),
    shape_settings=(("wte", "model.vocab_size"), ("wpe", "model.max_positions"),
                    ("c_fc", "model.mlp_size"), ("mlp.c_proj", "model.mlp_size")),
    unsupported=_unsupported_variant,
)
