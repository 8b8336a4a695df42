"""BERT for sequence classification in Flax NNX, with the parameter layout of transformers'
`BertForSequenceClassification`.

The module tree mirrors HF's names (`bert.embeddings.word_embeddings`,
`bert.encoder.layer.<i>.attention.self.query`, ..., `bert.pooler.dense`, `classifier`), so a
checkpoint maps one to one (see `flaxlm.models.hf`). Unlike GPT-2's Conv1D, HF's BERT uses
`nn.Linear`, whose weight is stored (out, in): the mapping transposes it into our (in, out)
kernel.

The shape comes from `ModelConfig` (BertConfig's names for its fields: `HF_NAMES` below), and
the dtypes from the `TransformerSpec` every family uses.

Shapes are in the names: B batch, L sequence length, D model width, N heads, H head width,
F MLP width, I a projection's input width (D or F), C classes (1 for regression).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlm.config import ModelConfig, Remat
from flaxlm.models.attention import attention
from flaxlm.models.dropout import Dropout
from flaxlm.models.layers import (
    ACTIVATIONS,
    HFNames,
    TransformerSpec,
    check_shape,
    dense,
    embedding,
    layer_norm,
    run_block,
    run_layers,
    stack_blocks,
)


class BertEmbeddings(nnx.Module):
    """Word + position + segment embeddings, then LayerNorm and dropout."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.word_embeddings = embedding(cfg.vocab_size, spec, rngs, rows="vocab")
        self.position_embeddings = embedding(cfg.max_positions, spec, rngs)
        self.token_type_embeddings = embedding(cfg.type_vocab_size, spec, rngs)
        self.LayerNorm = layer_norm(spec, rngs)
        self.dropout = Dropout(cfg.hidden_dropout)

    def __call__(self, input_ids_BxL, token_type_ids_BxL, rngs: nnx.Rngs | None) -> jax.Array:
        positions_L = jnp.arange(input_ids_BxL.shape[1])
        x_BxLxD = (
            self.word_embeddings(input_ids_BxL)
            + self.position_embeddings(positions_L)[None]
            + self.token_type_embeddings(token_type_ids_BxL)
        )
        return self.dropout(self.LayerNorm(x_BxLxD), deterministic=rngs is None, rngs=rngs)


class BertSelfAttention(nnx.Module):
    """Bidirectional multi-head attention whose keys skip the padding (attention_mask == 0)."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.num_heads = cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.attention_backend = cfg.attention
        std = cfg.initializer_range
        self.query, self.key, self.value = (
            dense(cfg.hidden_size, cfg.hidden_size, spec, rngs, std,
                  logical_axes=("embed", "heads"))
            for _ in range(3)
        )

    def __call__(self, x_BxLxD, key_mask_BxL, rngs: nnx.Rngs | None) -> jax.Array:
        B, L, D = x_BxLxD.shape
        q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = (
            projection(x_BxLxD).reshape(B, L, self.num_heads, D // self.num_heads)
            for projection in (self.query, self.key, self.value)
        )
        out_BxLxNxH = attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH,
                                mask=key_mask_BxL[:, None, None, :],
                                dropout_rate=self.attention_dropout, rngs=rngs,
                                backend=self.attention_backend)
        return out_BxLxNxH.reshape(B, L, D)


class BertOutput(nnx.Module):
    """Project back to the model width, then Post-LayerNorm around the residual: HF's
    BertSelfOutput (after attention, from width D) and BertOutput (after the MLP, from F)."""

    def __init__(self, spec: TransformerSpec, in_features: int, in_axis: str, rngs: nnx.Rngs):
        cfg = spec.model
        self.dense = dense(in_features, cfg.hidden_size, spec, rngs, cfg.initializer_range,
                           logical_axes=(in_axis, "embed"))
        self.LayerNorm = layer_norm(spec, rngs)
        self.dropout = Dropout(cfg.hidden_dropout)

    def __call__(self, h_BxLxI, residual_BxLxD, rngs: nnx.Rngs | None) -> jax.Array:
        h_BxLxD = self.dropout(self.dense(h_BxLxI), deterministic=rngs is None, rngs=rngs)
        return self.LayerNorm(h_BxLxD + residual_BxLxD)


class BertAttention(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        self.self = BertSelfAttention(spec, rngs)  # HF's name, so the keys map one to one
        self.output = BertOutput(spec, spec.model.hidden_size, "heads", rngs)

    def __call__(self, x_BxLxD, key_mask_BxL, rngs: nnx.Rngs | None) -> jax.Array:
        return self.output(self.self(x_BxLxD, key_mask_BxL, rngs), x_BxLxD, rngs)


class BertIntermediate(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        self.dense = dense(cfg.hidden_size, spec.mlp_width, spec, rngs, cfg.initializer_range,
                           logical_axes=("embed", "mlp"))
        self.activation = ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxLxD) -> jax.Array:
        return self.activation(self.dense(x_BxLxD))


class BertLayer(nnx.Module):
    """Post-LayerNorm block: x = LN(x + attn(x)), then LN(x + mlp(x))."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        self.attention = BertAttention(spec, rngs)
        self.intermediate = BertIntermediate(spec, rngs)
        self.output = BertOutput(spec, spec.mlp_width, "mlp", rngs)

    def __call__(self, x_BxLxD, key_mask_BxL, rngs: nnx.Rngs | None) -> jax.Array:
        x_BxLxD = self.attention(x_BxLxD, key_mask_BxL, rngs)
        return self.output(self.intermediate(x_BxLxD), x_BxLxD, rngs)


class BertEncoder(nnx.Module):
    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        layers = [BertLayer(spec, rngs) for _ in range(spec.model.num_layers)]
        # model.scan_layers: one layer whose parameters are every layer's, stacked.
        self.layer = stack_blocks(layers) if spec.model.scan_layers else nnx.List(layers)
        self.remat = Remat(spec.model.remat)
        self.scan_layers = spec.model.scan_layers

    def __call__(self, x_BxLxD, key_mask_BxL, rngs: nnx.Rngs | None) -> jax.Array:
        return run_layers(
            self.layer, self.scan_layers,
            lambda layer, x_BxLxD, rngs: run_block(layer, self.remat, x_BxLxD, key_mask_BxL,
                                                   rngs),
            x_BxLxD, rngs)


class BertPooler(nnx.Module):
    """The first ([CLS]) position through a dense layer and tanh: the sentence vector."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        cfg = spec.model
        # Both sides are the model width; one rule may split only one of them.
        self.dense = dense(cfg.hidden_size, cfg.hidden_size, spec, rngs, cfg.initializer_range,
                           logical_axes=("embed", None))

    def __call__(self, x_BxLxD) -> jax.Array:
        return jnp.tanh(self.dense(x_BxLxD[:, 0]))


class BertModel(nnx.Module):
    """The encoder: embeddings, post-LN layers and the pooler, as HF's `BertModel`."""

    def __init__(self, spec: TransformerSpec, rngs: nnx.Rngs):
        check_shape(spec)
        self.embeddings = BertEmbeddings(spec, rngs)
        self.encoder = BertEncoder(spec, rngs)
        self.pooler = BertPooler(spec, rngs)

    def __call__(self, input_ids_BxL, attention_mask_BxL, token_type_ids_BxL,
                 rngs: nnx.Rngs | None = None) -> tuple[jax.Array, jax.Array]:
        """(last hidden states (B, L, D), pooled sentence vectors (B, D))."""
        key_mask_BxL = attention_mask_BxL.astype(bool)
        x_BxLxD = self.embeddings(input_ids_BxL, token_type_ids_BxL, rngs)
        x_BxLxD = self.encoder(x_BxLxD, key_mask_BxL, rngs)
        return x_BxLxD, self.pooler(x_BxLxD)


class BertForSequenceClassification(nnx.Module):
    """Token ids, attention mask and segment ids in; class logits (B, C) out.

    C = num_labels; 1 means regression (one score per example). Pass `rngs` to train
    (dropout on), None to evaluate.
    """

    def __init__(self, spec: TransformerSpec, num_labels: int, rngs: nnx.Rngs):
        cfg = spec.model
        self.bert = BertModel(spec, rngs)
        self.dropout = Dropout(cfg.hidden_dropout if cfg.classifier_dropout is None
                               else cfg.classifier_dropout)
        self.classifier = dense(cfg.hidden_size, num_labels, spec, rngs, cfg.initializer_range,
                                logical_axes=("embed", "classes"))

    @staticmethod
    def lookup_params(cfg: ModelConfig) -> int:
        """Parameters only looked up, never multiplied: the token, position and segment
        tables."""
        return (cfg.vocab_size + cfg.max_positions + cfg.type_vocab_size) * cfg.hidden_size

    def __call__(self, input_ids_BxL, attention_mask_BxL, token_type_ids_BxL,
                 rngs: nnx.Rngs | None = None) -> jax.Array:
        _, pooled_BxD = self.bert(input_ids_BxL, attention_mask_BxL, token_type_ids_BxL, rngs)
        pooled_BxD = self.dropout(pooled_BxD, deterministic=rngs is None, rngs=rngs)
        return self.classifier(pooled_BxD)


# ---------------------------------------------------------------- Hugging Face names


def _unsupported_variant(raw: dict) -> str | None:
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute" or raw.get("is_decoder", False):
        # flaxlm's BERT is the encoder with absolute positions.
        return f"position_embedding_type={position_type!r} / is_decoder={raw.get('is_decoder')}"
    return None


HF_NAMES = HFNames(
    model_type="bert",
    config_class_name="BertConfig",
    shape_fields={
        "vocab_size": "vocab_size",
        "max_position_embeddings": "max_positions",
        "hidden_size": "hidden_size",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "intermediate_size": "mlp_size",
        "hidden_act": "activation",
        "layer_norm_eps": "layer_norm_eps",
        "initializer_range": "initializer_range",
        "type_vocab_size": "type_vocab_size",
    },
    dropout_fields={
        "hidden_dropout_prob": "hidden_dropout",
        "attention_probs_dropout_prob": "attention_dropout",
        "classifier_dropout": "classifier_dropout",
    },
    special_tokens=("pad_token_id",),
    mlp_width_required=True,
    body_prefix="bert.",
    body_modules=("embeddings", "encoder", "pooler"),
    layers_module="layer",
    linear_modules=("bert", "classifier"),  # nn.Linear everywhere
    optional_modules=("pooler",),  # a BertModel saved without one (add_pooling_layer=False)
    buffer_suffixes=("position_ids", "token_type_ids"),
    shape_settings=(
        ("attention.", "model.hidden_size"),  # before output.dense: attention.output.dense is D×D
        ("word_embeddings", "model.vocab_size"),
        ("position_embeddings", "model.max_positions"),
        ("token_type_embeddings", "model.type_vocab_size"),
        ("intermediate", "model.mlp_size"),
        ("output.dense", "model.mlp_size"),
    ),
    unsupported=_unsupported_variant,
)
