"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen model: the projection layer that may
carry one, which projections of each family can, the model with its adapters switched off,
and the adapters folded into the weights they adapt.

A projection with an adapter computes x·W + b + (alpha / rank)·dropout(x)·A·B, as PEFT's
`lora.Linear` does; A and B are `nnx.LoRAParam`s, a subclass of `nnx.Param`, so a filter on
that type tells what trains (the train step differentiates only them) from the frozen base.
The adapter lives beside the kernel it adapts (`q_proj.lora.lora_a`), so the base weights keep
HF's names and `model.init_from` loads them as it loads any model.

Shapes are in the names: B batch, L sequence length, I and O a projection's input and output
widths, R the adapter's rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlm.config import MOE_FAMILIES, LoraConfig, ModelConfig, ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.models.dropout import Dropout

# The projections an adapter may go on, by family, as HF names the modules (and PEFT's
# `target_modules` names them). GPT-2's c_attn is q, k and v fused, c_proj both the
# attention's output and the MLP's, as in HF's GPT2 modules.
TARGETS = {
    ModelFamily.llama: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"),
    ModelFamily.qwen2: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"),
    ModelFamily.mistral: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"),
    ModelFamily.gpt2: ("c_attn", "c_proj", "c_fc"),
    # Mixture-of-Experts: the attention's projections only. The experts are stacked matrices
    # (`moe.Experts`), not projections, and stay frozen with the router; so do a shared
    # expert's and a first dense layer's MLP, which would share the experts' HF names
    # (gate_proj, up_proj, down_proj) in PEFT's target_modules.
    **{family: ("q_proj", "k_proj", "v_proj", "o_proj") for family in MOE_FAMILIES},
}

# Drawn into each adapter's init key, so that adding adapters leaves the random init of every
# base weight as it is without them (the same seed gives the same base either way).
_ADAPTER_KEY_SALT = 0x10A


def enabled(model: ModelConfig) -> bool:
    """Whether `model` trains adapters (model.lora.rank is set)."""
    return model.lora.rank is not None


def trainable(model: ModelConfig) -> type[nnx.Variable] | None:
    """The nnx filter of what trains: the adapters with model.lora, else (None) everything."""
    return nnx.LoRAParam if enabled(model) else None


def without_adapters(model: ModelConfig) -> ModelConfig:
    """`model` with model.lora off: the plain model that the merged weights make."""
    return dataclasses.replace(model, lora=LoraConfig())


def targets(model: ModelConfig) -> tuple[str, ...]:
    """The projections that get an adapter: model.lora.targets, or all the family's."""
    family = ModelFamily(model.family)
    return tuple(model.lora.targets) if model.lora.targets else TARGETS.get(family, ())


def check_lora(model: ModelConfig) -> None:
    """model.lora's settings for `model`'s family, before anything is built."""
    if not enabled(model):
        return
    lora = model.lora
    family = ModelFamily(model.family)
    if family not in TARGETS:
        raise FlaxlmError(
            f"model.lora.rank={lora.rank} with model={model.name} (model.family={family.value}): "
            f"flaxlm puts adapters on {', '.join(f.value for f in TARGETS)} models only. Use "
            "one of those, or model.lora.rank=null to train every parameter."
        )
    if lora.rank < 1:
        raise FlaxlmError(
            f"model.lora.rank={lora.rank} must be at least 1: it is the inner width of each "
            "adapter (8 to 64 is usual, e.g. model.lora.rank=16), or null for no adapters."
        )
    if not lora.alpha > 0:
        raise FlaxlmError(
            f"model.lora.alpha={lora.alpha} must be positive: the adapter's output is scaled by "
            "alpha / rank (twice the rank is usual, e.g. model.lora.alpha=32 for rank 16)."
        )
    if not 0 <= lora.dropout < 1:
        raise FlaxlmError(
            f"model.lora.dropout={lora.dropout} must be in [0, 1): the probability of dropping "
            "each input of an adapter while training (e.g. 0.05, or 0 for none)."
        )
    valid = TARGETS[family]
    unknown = [name for name in lora.targets or () if name not in valid]
    if unknown or lora.targets == []:
        named = f"names {', '.join(unknown)}, which" if unknown else "is empty, and"
        raise FlaxlmError(
            f"model.lora.targets {named} no projection of model.family={family.value} "
            f"(model={model.name}) is called. Its projections are {', '.join(valid)}: list "
            f"some of them, e.g. model.lora.targets=[{','.join(valid[:2])}], or null for all."
        )


class Projection(nnx.Linear):
    """nnx.Linear with an optional adapter: x·W + b, plus (alpha / rank)·dropout(x)·A·B when
    it has one. `logical_axes` names the (input, output) dimensions of W; A's output and B's
    input, the rank, are never split over the mesh."""

    def __init__(self, in_features: int, out_features: int, *, lora: LoraConfig | None,
                 logical_axes: tuple[str | None, str | None], rngs: nnx.Rngs, **linear):
        super().__init__(in_features, out_features, rngs=rngs, **linear)
        self.adapter_on = True
        if lora is None:
            self.lora = None
            return
        stream = rngs.params
        key = jax.random.fold_in(jax.random.fold_in(stream.key[...], stream.count[...]),
                                 _ADAPTER_KEY_SALT)
        self.lora = nnx.data(nnx.LoRA(
            in_features, lora.rank, out_features, dtype=linear.get("dtype"),
            param_dtype=linear.get("param_dtype", jnp.float32),
            a_metadata={"logical_axes": (logical_axes[0], None)},
            b_metadata={"logical_axes": (None, logical_axes[1])}, rngs=nnx.Rngs(params=key)))
        self.scale = adapter_scale(lora)
        self.lora_dropout = Dropout(lora.dropout)

    def __call__(self, x_BxLxI: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """`rngs` (training) draws the adapter's dropout; the base projection has none."""
        y_BxLxO = super().__call__(x_BxLxI)
        if self.lora is None or not self.adapter_on:
            return y_BxLxO
        dropped_BxLxI = self.lora_dropout(x_BxLxI, deterministic=rngs is None, rngs=rngs)
        return y_BxLxO + (self.scale * self.lora(dropped_BxLxI)).astype(y_BxLxO.dtype)


def adapters(model: nnx.Module) -> Iterator[Projection]:
    """Every projection of `model` that carries an adapter."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Projection) and node.lora is not None:
            yield node


@contextlib.contextmanager
def adapters_disabled(model: nnx.Module):
    """`model` as its base, without its adapters, for the duration: the same module and the
    same weights (no copy), the adapters' branch skipped rather than zeroed, so the logits are
    the base model's exactly. A reference model for objectives that compare the tuned model
    with the one it started from (DPO): `with adapters_disabled(model): reference(model)`."""
    switched = [projection for projection in adapters(model) if projection.adapter_on]
    for projection in switched:
        projection.adapter_on = False
    try:
        yield model
    finally:
        for projection in switched:
            projection.adapter_on = True


# ---------------------------------------------------------------- parameter dicts
# Nested parameter dicts as `nnx.to_pure_dict` gives them, either layout (a scanned model's
# adapters are stacked on a leading layer axis, as its kernels are).

ADAPTER = "lora"  # the projection's attribute holding its adapter
A, B = "lora_a", "lora_b"


def has_adapters(params: dict) -> bool:
    return any(key == ADAPTER or (isinstance(child, dict) and has_adapters(child))
               for key, child in params.items())


def merged_params(params: dict, scale: float) -> dict:
    """`params` with every adapter folded into the kernel it adapts, W + scale·A·B (in float32,
    cast back to W's dtype), and the adapters gone: a plain model's parameters, which export
    as any model's do. Computed where the arrays lie (a sharded kernel stays sharded)."""
    merged = {}
    for key, child in params.items():
        if not isinstance(child, dict):
            merged[key] = child
        elif ADAPTER in child:
            merged[key] = {k: v for k, v in child.items() if k != ADAPTER}
            kernel = child["kernel"]
            delta = scale * jnp.matmul(jnp.asarray(child[ADAPTER][A], jnp.float32),
                                       jnp.asarray(child[ADAPTER][B], jnp.float32))
            merged[key]["kernel"] = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
        else:
            merged[key] = merged_params(child, scale)
    return merged


def adapter_scale(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank
