"""The Mixture-of-Experts decoders of the llama family, under transformers' class names:
Llama's attention and blocks (`flaxlm.models.llama`) with each sparse layer's MLP a router and
experts (`flaxlm.models.moe`, set by `model.moe`). What tells the families apart is their
attention's details (Qwen3-MoE's per-head q/k norm, OLMoE's over the whole projection, Qwen2-MoE's
q/k/v biases) and how transformers names their configs and weights (`HF_NAMES` of each).
"""

from __future__ import annotations

import dataclasses

from flaxlm.models import llama


class Qwen3MoeForCausalLM(llama.LlamaForCausalLM):
    """Qwen3's MoE: q/k RMSNorm per head, top-k renormalised (Qwen3-30B-A3B: 128 experts, 8)."""


class Qwen2MoeForCausalLM(llama.LlamaForCausalLM):
    """Qwen1.5/Qwen2's MoE: q/k/v biases, top-k not renormalised, a gated shared expert."""


class MixtralForCausalLM(llama.LlamaForCausalLM):
    """Mixtral: Mistral's attention, 8 experts, top-2 renormalised."""


class OlmoeForCausalLM(llama.LlamaForCausalLM):
    """OLMoE: q/k RMSNorm over the whole projection, 64 experts, top-8 not renormalised."""


QWEN3_MOE_HF_NAMES = dataclasses.replace(llama.HF_NAMES, model_type="qwen3_moe",
                                         config_class_name="Qwen3MoeConfig")
QWEN2_MOE_HF_NAMES = dataclasses.replace(llama.QWEN2_HF_NAMES, model_type="qwen2_moe",
                                         config_class_name="Qwen2MoeConfig")
MIXTRAL_HF_NAMES = dataclasses.replace(llama.HF_NAMES, model_type="mixtral",
                                       config_class_name="MixtralConfig")
OLMOE_HF_NAMES = dataclasses.replace(llama.HF_NAMES, model_type="olmoe",
                                     config_class_name="OlmoeConfig")
