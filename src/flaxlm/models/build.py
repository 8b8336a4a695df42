"""Which network to build, chosen by `model.family` and the task, from the architecture table of
`flaxlm.models.hf`.

task=clm builds a language model (a family with a next-token head); task=classify builds a
sequence classifier with the common signature
`model(input_ids_BxL, attention_mask_BxL, token_type_ids_BxL, rngs=None) -> logits_BxC`.
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.models import hf, moe
from flaxlm.models.layers import TransformerSpec, training_flops_per_token


def check_lm_family(model: ModelConfig,
                    purpose: str = "task=clm trains a causal language model") -> None:
    """A network with a next-token head, which `purpose` (what the task does with it) needs."""
    family = ModelFamily(model.family)
    if hf.lm_architecture(family) is None:
        lm_families = sorted({a.family.value for a in hf.ARCHITECTURES.values() if a.is_lm})
        raise FlaxlmError(
            f"{purpose}, but model={model.name} (model.family={family.value}) is an encoder "
            f"with no next-token head. Use a {' or '.join(lm_families)}-family model "
            "(model=gpt2-tiny, gpt2, llama-tiny or smollm-135m, or model.init_from=<a causal "
            "LM>), or task=classify to fine-tune this encoder."
        )


def check_classifier_family(model: ModelConfig, purpose: str) -> None:
    """A family with a sequence classifier, which `purpose` (what the task does) needs: the
    Mixture-of-Experts families have none (transformers has no such class of theirs)."""
    family = ModelFamily(model.family)
    if hf.classifier_architecture(family) is None:
        families = sorted({a.family.value for a in hf.ARCHITECTURES.values() if not a.is_lm})
        raise FlaxlmError(
            f"{purpose}, but model={model.name} (model.family={family.value}) has no sequence "
            f"classifier. Use a model of family {', '.join(families)} (e.g. model=llama-tiny "
            "or model=bert-tiny), or task=clm / task=sft to train this one.")


def build_lm(spec: TransformerSpec, rngs: nnx.Rngs) -> nnx.Module:
    """A freshly initialised language model of `spec`'s family and shape."""
    check_lm_family(spec.model)
    return hf.lm_architecture(spec.model.family).model_class(spec, rngs)


def model_rngs(**streams) -> nnx.Rngs:
    """`nnx.Rngs(**streams)` to build a model with, its counters kept in refs: the same draws,
    bit for bit. Flax checks each new value of a plain counter against the old one's sharding,
    and under a trace (`nnx.eval_shape`, the jitted init) that probe walks the whole trace so far
    to word an error no one reads: building was quadratic in the model's depth (gpt2-xl's
    eval_shape 4.6 s of CPU, 0.7 s with refs, and as much again for each trace of its init)."""
    with nnx.var_defaults(ref=True):
        return nnx.Rngs(**streams)


def abstract_network(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """The module `build(rngs)` makes, as shapes, dtypes and logical axes (`nnx.eval_shape`):
    nothing allocated."""
    return nnx.eval_shape(lambda: build(model_rngs(params=0)))


def build_classifier(spec: TransformerSpec, num_labels: int, rngs: nnx.Rngs) -> nnx.Module:
    """A classifier with `num_labels` outputs (1 → regression) for `spec.model.family`."""
    return hf.classifier_architecture(spec.model.family).model_class(spec, num_labels, rngs)


def lm_flops_per_token(model: ModelConfig, num_params: int, seq_len: int,
                       num_trained: int | None = None) -> float:
    """Training FLOPs per token of the language model of `model`'s family, with `num_params`
    parameters, on sequences of `seq_len` tokens. With `num_trained` (model.lora: the
    adapters) the other weights are frozen: 4 FLOPs each, as no gradient of theirs is made
    (the forward pass and the gradient of their inputs), where a trained weight costs 6.
    A Mixture-of-Experts model counts the weights a token meets (`moe.num_active_params`): its
    top-k experts of each sparse layer, not the idle ones."""
    lookups = hf.lm_architecture(model.family).model_class.lookup_params(model)
    active = moe.num_active_params(model, num_params)
    flops = training_flops_per_token(model, active - lookups, seq_len)
    if num_trained is None:
        return flops
    return flops - 2 * (active - num_trained - lookups)


def classifier_flops_per_token(model: ModelConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token of the classifier of `model`'s family (as `lm_flops_per_token`)."""
    lookups = hf.classifier_architecture(model.family).model_class.lookup_params(model)
    return training_flops_per_token(model, num_params - lookups, seq_len)


def lm_from_params(model_config: ModelConfig, params: dict) -> nnx.Module:
    """The language model of `model_config`'s shape holding `params` (no random init runs),
    in whichever layout they come (`model.scan_layers`): converted to the model's."""
    model = abstract_network(lambda rngs: build_lm(TransformerSpec(model_config), rngs))
    state = nnx.state(model, nnx.Param)
    params = hf.params_in_layout(_with_int_layer_keys(params), model_config)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _with_int_layer_keys(params):
    """nnx.List children are keyed by int; a dict read back from disk may hold '0', '1', ..."""
    if not isinstance(params, dict):
        return params
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _with_int_layer_keys(v)
            for k, v in params.items()}
