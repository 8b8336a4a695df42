"""Adapters (model.lora) as a PEFT adapter directory: what
`peft.PeftModel.from_pretrained(base, directory)` loads onto the HF base model.

    adapter_config.json         PEFT's LoraConfig: rank, alpha, dropout, the target modules
    adapter_model.safetensors   float32 tensors under PEFT's names

PEFT names an adapter after the module it adapts, inside its wrapper `base_model.model.`:
our `model.layers.<i>.self_attn.q_proj.lora.lora_a` (I × R) is
`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`, stored (R, I) as an
nn.Linear weight, and `lora_b` (R × O) is `...lora_B.weight`, (O, R). GPT-2's projections are
HF Conv1D layers (weights stored (in, out)), which PEFT adapts with `fan_in_fan_out`; its
adapter tensors have the same (R, I) and (O, R) shapes.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from flaxlm.config import ModelConfig, ModelFamily
from flaxlm.models import hf, lora
from flaxlm.parallel import host_copy

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_PEFT_NAMES = {lora.A: "lora_A", lora.B: "lora_B"}


def adapter_tensors(params: dict, architecture_name: str) -> dict:
    """{PEFT key: (shape, fetch)} of the adapters in our nested parameter dict (either
    layout), nothing read yet, as `hf.write_safetensors` takes them."""
    tensors = {}
    for path, leaf in hf.flatten_params(hf.unrolled_params(params, architecture_name)):
        if len(path) < 3 or path[-2] != lora.ADAPTER:
            continue
        module = hf.hf_name((*path[:-2], "kernel"), architecture_name).removesuffix(".weight")
        key = f"{_PEFT_PREFIX}{module}.{_PEFT_NAMES[path[-1]]}.weight"
        tensors[key] = (tuple(np.shape(leaf))[::-1],
                        functools.partial(lambda leaf: host_copy(leaf, np.float32).T, leaf))
    return tensors


def adapter_config(model: ModelConfig, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for model.lora on `model` (`base_model`: the base's path or
    Hub id, which `AutoPeftModel` loads; None for a base that only the merged export holds)."""
    settings = model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(lora.targets(model)),
        "fan_in_fan_out": ModelFamily(model.family) is ModelFamily.gpt2,  # Conv1D weights
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(directory: str, params: dict, model: ModelConfig, architecture_name: str,
                 base_model: str | None) -> None:
    """Write adapter_config.json and adapter_model.safetensors into `directory` (made if
    missing); writing the directory safely is the caller's (`flaxlm.export`)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(adapter_config(model, base_model), f, indent=2)
        f.write("\n")
    hf.write_safetensors(os.path.join(directory, ADAPTER_WEIGHTS),
                         adapter_tensors(params, architecture_name), metadata={"format": "pt"})
