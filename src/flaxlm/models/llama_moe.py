"""The Mixture-of-Experts decoders of the llama family, under transformers' class names:
Llama's attention and blocks (`flaxlm.models.llama`) with each sparse layer's MLP a router and
experts (`flaxlm.models.moe`, set by `model.moe`). What tells the families apart is their
attention's details (Qwen3-MoE's per-head q/k norm, OLMoE's over the whole projection, Qwen2-MoE's
q/k/v biases) and how transformers names their configs and weights (`HF_NAMES` of each).

Weights: a layer's experts are one stacked matrix each in our model (`mlp.experts.gate_proj`
(E, D, F)) and E nn.Linear weights in HF's checkpoints (`mlp.experts.<e>.gate_proj.weight`
(F, D)), split and stacked by `hf.hf_pieces`; Mixtral's checkpoints call the block
`block_sparse_moe` and the experts' gate, down and up projections `w1`, `w2`, `w3`
(`HFNames.renames`). transformers 5 holds the experts fused in memory (`experts.gate_up_proj`
(E, 2F, D), `experts.down_proj` (E, D, F)) and saves them per expert; a checkpoint saved fused
loads too (`pretrained._unfused_experts`).

Config: each family's `MoeLayout` says which of our settings its HF config can state and under
which names. A model its HF class cannot hold (a shared expert on Mixtral, OLMoE without its q/k
norm) is refused when its HF config is made, which a run does as it starts; a checkpoint we
cannot hold (experts every other layer, OLMoE's clip_qkv) when `model.init_from` reads it.
Mixtral's `router_jitter_noise` (multiplicative noise on the router's input while training) is
a training choice flaxlm does not offer, as dropout is one: not read, and 0 on export.
"""

from __future__ import annotations

import dataclasses
import functools

from flaxlm.config import ModelConfig, ModelFamily, QKNorm
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import llama, moe
from flaxlm.models.layers import HFNames

transformers = lazy_module("transformers")


class Qwen3MoeForCausalLM(llama.LlamaForCausalLM):
    """Qwen3's MoE: q/k RMSNorm per head, top-k renormalised (Qwen3-30B-A3B: 128 experts, 8)."""


class Qwen2MoeForCausalLM(llama.LlamaForCausalLM):
    """Qwen1.5/Qwen2's MoE: q/k/v biases, top-k not renormalised, a gated shared expert."""


class MixtralForCausalLM(llama.LlamaForCausalLM):
    """Mixtral: Mistral's attention, 8 experts, top-2 renormalised."""


class OlmoeForCausalLM(llama.LlamaForCausalLM):
    """OLMoE: q/k RMSNorm over the whole projection, 64 experts, top-8 not renormalised."""


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """What one family's HF config (and so its checkpoints) can say of the experts and the
    attention, and under which names."""

    class_name: str  # transformers' causal LM
    experts_field: str  # the expert count: num_experts, or Mixtral's num_local_experts
    expert_width_field: str  # an expert's width: moe_intermediate_size, or intermediate_size
    qk_norm: QKNorm  # fixed by the family's attention
    always_renormalised: bool = False  # Mixtral: no norm_topk_prob, the top-k always summed to 1
    shared_expert: bool = False  # Qwen2-MoE: every sparse layer has one (no setting turns it off)
    dense_layers: bool = False  # decoder_sparse_step / mlp_only_layers: dense layers first
    attention_bias: bool = False  # the config's attention_bias (biases on q/k/v/o)
    qkv_bias: bool = False  # Qwen2's biases on q/k/v, none on o
    z_loss_field: str | None = None  # the router z-loss coefficient's name, where it has one

    @property
    def dense_mlp_width(self) -> bool:
        """Whether intermediate_size is a dense MLP's width (else it is the experts')."""
        return self.expert_width_field != "intermediate_size"


LAYOUTS = {
    ModelFamily.qwen3_moe: MoeLayout("Qwen3MoeForCausalLM", "num_experts",
                                     "moe_intermediate_size", QKNorm.head, dense_layers=True,
                                     attention_bias=True),
    ModelFamily.qwen2_moe: MoeLayout("Qwen2MoeForCausalLM", "num_experts",
                                     "moe_intermediate_size", QKNorm.none, shared_expert=True,
                                     dense_layers=True, qkv_bias=True),
    ModelFamily.mixtral: MoeLayout("MixtralForCausalLM", "num_local_experts",
                                   "intermediate_size", QKNorm.none, always_renormalised=True),
    ModelFamily.olmoe: MoeLayout("OlmoeForCausalLM", "num_experts", "intermediate_size",
                                 QKNorm.width, attention_bias=True,
                                 z_loss_field="router_z_loss_coef"),
}

_QK_NORMS = {QKNorm.none: "no query/key norm", QKNorm.head: "an RMSNorm on each head's queries "
             "and keys", QKNorm.width: "an RMSNorm over the whole query and key projections"}


def layout_problems(family: ModelFamily, model: ModelConfig) -> list[str]:
    """What of `model` the family's HF class cannot hold (nothing: [])."""
    layout, settings = LAYOUTS[family], model.moe
    problems = []
    if QKNorm(model.qk_norm) is not layout.qk_norm:
        problems.append(f"model.qk_norm={QKNorm(model.qk_norm).value}: its attention has "
                        f"{_QK_NORMS[layout.qk_norm]} (model.qk_norm={layout.qk_norm.value})")
    if layout.shared_expert and not settings.shared_expert_size:
        problems.append("model.moe.shared_expert_size is not set: every sparse layer of it has a "
                        "gated shared expert (Qwen1.5-MoE-A2.7B's: 5632 wide)")
    if not layout.shared_expert and settings.shared_expert_size:
        problems.append(f"model.moe.shared_expert_size={settings.shared_expert_size}: it has no "
                        "shared expert (model.family=qwen2_moe has one; or set it to null)")
    if layout.always_renormalised and not settings.normalize_top_k:
        problems.append("model.moe.normalize_top_k=false: it always renormalises the top-k "
                        "probabilities (model.family=olmoe or qwen3_moe can do either)")
    if not layout.dense_layers and settings.first_dense_layers:
        problems.append(f"model.moe.first_dense_layers={settings.first_dense_layers}: every "
                        "layer of it has experts (model.family=qwen3_moe or qwen2_moe can "
                        "start with dense layers)")
    if model.mlp_bias:
        problems.append("model.mlp_bias=true: its MLPs have no biases")
    if model.attention_bias and not layout.attention_bias:
        problems.append("model.attention_bias=true: its attention has no biases")
    return problems


def _to_hf(family: ModelFamily, model: ModelConfig) -> dict:
    """The HF config's values for the experts, the attention and the layer layout."""
    layout, settings = LAYOUTS[family], model.moe
    problems = layout_problems(family, model)
    if problems:
        raise FlaxlmError(
            f"model.family={family.value} is transformers' {layout.class_name}, which cannot "
            f"hold this model: {'; '.join(problems)}. Change these settings, or choose the "
            "family whose design this is (model.family=qwen3_moe, qwen2_moe, mixtral or olmoe)."
        )
    values = {**llama.llama_to_hf(model), layout.experts_field: settings.num_experts,
              "num_experts_per_tok": settings.top_k,
              layout.expert_width_field: moe.expert_width(model),
              "router_aux_loss_coef": settings.aux_loss_coef}
    if not layout.always_renormalised:
        values["norm_topk_prob"] = settings.normalize_top_k
    if layout.shared_expert:
        values["shared_expert_intermediate_size"] = settings.shared_expert_size
    if layout.dense_layers:
        values.update(decoder_sparse_step=1,
                      mlp_only_layers=list(range(settings.first_dense_layers)))
    if layout.qkv_bias:
        values["qkv_bias"] = model.qkv_bias
    if layout.z_loss_field:
        values[layout.z_loss_field] = settings.z_loss_coef
    return values


def _from_hf(family: ModelFamily, config) -> dict:
    """ModelConfig's expert, attention and bias settings from an HF config of `family` (its
    `unsupported` has passed it). model.moe's other settings (dispatch, capacity, balancing
    bias) are how to train, and stay the run's."""
    layout = LAYOUTS[family]
    settings = {
        "num_experts": getattr(config, layout.experts_field),
        "top_k": config.num_experts_per_tok,
        # Mixtral's and OLMoE's intermediate_size is the experts' width, read as model.mlp_size
        "expert_mlp_size": (getattr(config, layout.expert_width_field)
                            if layout.dense_mlp_width else None),
        "normalize_top_k": layout.always_renormalised or bool(config.norm_topk_prob),
        "shared_expert_size": (config.shared_expert_intermediate_size if layout.shared_expert
                               else None),
        "first_dense_layers": _first_dense_layers(config) if layout.dense_layers else 0,
        "aux_loss_coef": float(config.router_aux_loss_coef),
    }
    z_loss = getattr(config, layout.z_loss_field, None) if layout.z_loss_field else None
    if z_loss is not None:
        settings["z_loss_coef"] = float(z_loss)
    biases = {"qkv_bias": layout.qkv_bias, "mlp_bias": False}
    if not layout.attention_bias:  # else a shape field, read as it is
        biases["attention_bias"] = False
    return {**llama.attention_from_hf(config), **biases, "qk_norm": layout.qk_norm,
            "moe": settings}


def _sparse_layers(config) -> list[bool]:
    """Which layers transformers' Qwen2-/Qwen3-MoE give experts: those not in mlp_only_layers
    whose number (from 1) decoder_sparse_step divides."""
    dense = set(config.mlp_only_layers or ())
    step = config.decoder_sparse_step
    return [layer not in dense and step > 0 and (layer + 1) % step == 0
            for layer in range(config.num_hidden_layers)]


def _first_dense_layers(config) -> int:
    sparse = _sparse_layers(config)
    return sparse.index(True) if True in sparse else len(sparse)


def _unsupported(family: ModelFamily, raw: dict) -> str | None:
    """What a checkpoint of `family` uses that our model does not implement, or None."""
    layout = LAYOUTS[family]
    config_class_name = NAMES_OF[family][1]
    problem = llama.unsupported_in(config_class_name)(raw)
    if problem:
        return problem
    config = getattr(transformers, config_class_name).from_dict(raw)
    if not getattr(config, layout.experts_field):
        return (f"{layout.experts_field}={getattr(config, layout.experts_field)} (no experts: "
                "a dense model, which a dense family holds)")
    if layout.dense_layers:
        sparse, first = _sparse_layers(config), _first_dense_layers(config)
        if sparse != [layer >= first for layer in range(len(sparse))] or first == len(sparse):
            return (f"decoder_sparse_step={config.decoder_sparse_step} with mlp_only_layers="
                    f"{sorted(config.mlp_only_layers or [])}, which put experts in layers "
                    f"{[layer for layer, has in enumerate(sparse) if has]}: flaxlm's "
                    "Mixture-of-Experts models have experts in every layer after a leading run "
                    "of dense ones (model.moe.first_dense_layers), so decoder_sparse_step must "
                    "be 1 and mlp_only_layers 0, 1, ..., n - 1 (or empty)")
    if layout.shared_expert and not config.shared_expert_intermediate_size:
        return "shared_expert_intermediate_size=0 (a sparse layer without its shared expert)"
    if layout.qkv_bias and not getattr(config, "qkv_bias", True):
        return "qkv_bias=false (Qwen2's attention without its q/k/v biases)"
    if getattr(config, "clip_qkv", None) is not None:
        return (f"clip_qkv={config.clip_qkv} (queries, keys and values clipped to ±clip_qkv; "
                "flaxlm's OLMoE does not clip)")
    window = getattr(config, "sliding_window", None)
    if family is ModelFamily.mixtral and window and window < config.max_position_embeddings:
        return (f"sliding-window attention (sliding_window={window} is shorter than "
                f"max_position_embeddings={config.max_position_embeddings})")
    return None


# A mismatched shape's setting, by a fragment of its key (first match wins), before Llama's.
_SHAPE_SETTINGS = (("shared_expert_gate", "model.hidden_size"),
                   ("shared_expert.", "model.moe.shared_expert_size"),
                   ("experts.", "model.moe.expert_mlp_size"),
                   (".gate.", "model.moe.num_experts"),
                   *llama.HF_NAMES.shape_settings)

# model_type, config class and the HF shape fields, by family: Qwen3-MoE's and OLMoE's configs
# state attention_bias; Qwen2-MoE's has q/k/v biases and Mixtral's none; no MoE config has
# Llama's mlp_bias.
NAMES_OF = {
    ModelFamily.qwen3_moe: ("qwen3_moe", "Qwen3MoeConfig", True),
    ModelFamily.qwen2_moe: ("qwen2_moe", "Qwen2MoeConfig", False),
    ModelFamily.mixtral: ("mixtral", "MixtralConfig", False),
    ModelFamily.olmoe: ("olmoe", "OlmoeConfig", True),
}

# Mixtral's checkpoints: `block_sparse_moe` for the MLP block, w1/w3/w2 for gate/up/down.
_MIXTRAL_RENAMES = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."),
                    (".up_proj.", ".w3."), (".down_proj.", ".w2."))


def _hf_names(family: ModelFamily) -> HFNames:
    model_type, config_class_name, attention_bias = NAMES_OF[family]
    shape_fields = dict(llama.QWEN2_HF_NAMES.shape_fields)  # Llama's, less the bias settings
    if attention_bias:
        shape_fields["attention_bias"] = "attention_bias"
    return dataclasses.replace(
        llama.HF_NAMES, model_type=model_type, config_class_name=config_class_name,
        shape_fields=shape_fields, experts_module="experts",
        renames=_MIXTRAL_RENAMES if family is ModelFamily.mixtral else (),
        shape_settings=_SHAPE_SETTINGS,
        unsupported=functools.partial(_unsupported, family),
        config_to_hf=functools.partial(_to_hf, family),
        config_from_hf=functools.partial(_from_hf, family))


QWEN3_MOE_HF_NAMES = _hf_names(ModelFamily.qwen3_moe)
QWEN2_MOE_HF_NAMES = _hf_names(ModelFamily.qwen2_moe)
MIXTRAL_HF_NAMES = _hf_names(ModelFamily.mixtral)
OLMOE_HF_NAMES = _hf_names(ModelFamily.olmoe)
