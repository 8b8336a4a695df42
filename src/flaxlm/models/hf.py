"""Interop with Hugging Face: GPT2Config for our ModelConfig, and the parameter-name mapping.

Mapping from our NNX parameter paths to `GPT2LMHeadModel.state_dict()` keys:

    wte.embedding                 ↔ transformer.wte.weight   (also lm_head.weight: tied)
    wpe.embedding                 ↔ transformer.wpe.weight
    h.<i>.ln_1.scale / .bias      ↔ transformer.h.<i>.ln_1.weight / .bias   (ln_2, ln_f alike)
    h.<i>.attn.c_attn.kernel      ↔ transformer.h.<i>.attn.c_attn.weight    (c_proj, mlp.c_fc,
    h.<i>.attn.c_attn.bias        ↔ transformer.h.<i>.attn.c_attn.bias       mlp.c_proj alike)

HF's Conv1D stores its weight as (in, out), the same layout as our kernels, so no array is
transposed: the mapping renames and nothing else.
"""

from __future__ import annotations

import os

import numpy as np
import transformers

from flaxlm.config import ModelConfig

_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def to_gpt2_config(model: ModelConfig, *, bos_token_id: int, eos_token_id: int, pad_token_id: int):
    return transformers.GPT2Config(
        vocab_size=model.vocab_size,
        n_positions=model.n_positions,
        n_embd=model.n_embd,
        n_layer=model.n_layer,
        n_head=model.n_head,
        n_inner=model.n_inner,
        activation_function=model.activation_function,
        resid_pdrop=model.resid_pdrop,
        embd_pdrop=model.embd_pdrop,
        attn_pdrop=model.attn_pdrop,
        layer_norm_epsilon=model.layer_norm_epsilon,
        initializer_range=model.initializer_range,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
    )


def hf_name(path: tuple) -> str:
    """Our parameter path, e.g. ('h', 0, 'attn', 'c_attn', 'kernel'), as HF's key."""
    *modules, leaf = (str(part) for part in path)
    return ".".join(["transformer", *modules, _LEAF_NAMES[leaf]])


def to_hf_state_dict(params: dict) -> dict[str, np.ndarray]:
    """Flat {HF key: float32 array} from our nested parameter dict (nnx.State.to_pure_dict())."""
    flat: dict[str, np.ndarray] = {}

    def visit(node, path):
        if isinstance(node, dict):
            for key, child in node.items():
                visit(child, (*path, key))
        else:
            flat[hf_name(path)] = np.asarray(node, dtype=np.float32)

    visit(params, ())
    return flat


def save_pretrained(directory: str, params: dict, config: transformers.GPT2Config) -> None:
    """Write an HF model directory (config.json + model.safetensors) that
    `GPT2LMHeadModel.from_pretrained(directory)` loads."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_file(to_hf_state_dict(params), tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # an ordinary, shareable file, like config.json beside it
    os.replace(tmp, os.path.join(directory, "model.safetensors"))

