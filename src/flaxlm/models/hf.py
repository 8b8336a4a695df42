"""Interop with Hugging Face: the table of HF architectures we mirror, their configs and the
parameter-name mapping, both ways, and the one writer of HF weights.

Our modules carry HF's PyTorch names, so an NNX parameter path becomes a `state_dict()` key by
joining it with dots and renaming the leaf (`kernel`/`scale`/`embedding` → `weight`):

    GPT2LMHeadModel (our paths lack HF's `transformer.` prefix: the model *is* that body)
        wte.embedding                       ↔ transformer.wte.weight  (lm_head.weight: tied)
        h.<i>.attn.c_attn.kernel            ↔ transformer.h.<i>.attn.c_attn.weight
    GPT2ForSequenceClassification
        transformer.h.<i>.ln_1.scale        ↔ transformer.h.<i>.ln_1.weight
        score.kernel                        ↔ score.weight                      (transposed)
    BertForSequenceClassification
        bert.encoder.layer.<i>.attention.self.query.kernel
                                            ↔ bert.encoder.layer.<i>.attention.self.query.weight
        classifier.kernel                   ↔ classifier.weight                 (transposed)
    LlamaForCausalLM, LlamaForSequenceClassification, and Qwen2's and Mistral's (the same
    paths as HF's)
        model.layers.<i>.self_attn.q_proj.kernel
                                            ↔ model.layers.<i>.self_attn.q_proj.weight (transposed)
        model.norm.scale                    ↔ model.norm.weight
        lm_head.kernel                      ↔ lm_head.weight  (absent when tied) (transposed)
    Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral (`llama_moe`): Llama's, and in a sparse layer
        model.layers.<i>.mlp.gate.kernel    ↔ model.layers.<i>.mlp.gate.weight   (transposed)
        model.layers.<i>.mlp.experts.gate_proj (E, D, F), one stack of E experts
                                            ↔ model.layers.<i>.mlp.experts.<e>.gate_proj.weight
                                              (F, D) for each expert e    (`hf_pieces`)
        Mixtral's: model.layers.<i>.block_sparse_moe.gate / experts.<e>.w1 (gate), w3 (up),
                   w2 (down)                (`HFNames.renames`)

A scanned model (`model.scan_layers`) holds each block parameter once for all layers, stacked
(`h.attn.c_attn.kernel`, layers first): `hf_pieces` cuts it into the per-layer tensors above
(and an experts' stack into its experts) before any name is made, `unrolled_params` splits the
layers of a whole dict, and `params_in_layout` converts either way.

HF's `nn.Linear` stores its weight (out, in), so such a kernel is transposed both ways; GPT-2's
Conv1D is (in, out) already. What differs between families (config field names, prefixes, which
modules are nn.Linear) is each family module's `HF_NAMES`; a family's classes are rows of
`ARCHITECTURES`. Importing a checkpoint (`model.init_from`) is `flaxlm.models.pretrained`;
exporting a run is `flaxlm.export`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable

import numpy as np
from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import bert, gpt2, llama, llama_moe
from flaxlm.models.layers import (
    HFNames,
    TransformerSpec,
    per_layer_paths,
    stack_layers,
    unstack_layers,
)
from flaxlm.parallel import host_copy

transformers = lazy_module("transformers")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF model class that one of our modules mirrors, under the same class name."""

    model_class: type[nnx.Module]
    family: ModelFamily
    names: HFNames
    is_lm: bool = False  # a causal language model (task=clm); else a sequence classifier
    path_prefix: str = ""  # what HF's keys have in front of our parameter paths

    @property
    def name(self) -> str:
        """HF's class name: config.json's `architectures[0]`."""
        return self.model_class.__name__


ARCHITECTURES = {arch.name: arch for arch in (
    Architecture(gpt2.GPT2LMHeadModel, ModelFamily.gpt2, gpt2.HF_NAMES, is_lm=True,
                 path_prefix="transformer."),  # our LM is the body HF nests under it
    Architecture(gpt2.GPT2ForSequenceClassification, ModelFamily.gpt2, gpt2.HF_NAMES),
    Architecture(bert.BertForSequenceClassification, ModelFamily.bert, bert.HF_NAMES),
    Architecture(llama.LlamaForCausalLM, ModelFamily.llama, llama.HF_NAMES, is_lm=True),
    Architecture(llama.LlamaForSequenceClassification, ModelFamily.llama, llama.HF_NAMES),
    Architecture(llama.Qwen2ForCausalLM, ModelFamily.qwen2, llama.QWEN2_HF_NAMES, is_lm=True),
    Architecture(llama.Qwen2ForSequenceClassification, ModelFamily.qwen2, llama.QWEN2_HF_NAMES),
    Architecture(llama.MistralForCausalLM, ModelFamily.mistral, llama.MISTRAL_HF_NAMES,
                 is_lm=True),
    Architecture(llama.MistralForSequenceClassification, ModelFamily.mistral,
                 llama.MISTRAL_HF_NAMES),
    Architecture(llama_moe.Qwen3MoeForCausalLM, ModelFamily.qwen3_moe,
                 llama_moe.QWEN3_MOE_HF_NAMES, is_lm=True),
    Architecture(llama_moe.Qwen2MoeForCausalLM, ModelFamily.qwen2_moe,
                 llama_moe.QWEN2_MOE_HF_NAMES, is_lm=True),
    Architecture(llama_moe.MixtralForCausalLM, ModelFamily.mixtral, llama_moe.MIXTRAL_HF_NAMES,
                 is_lm=True),
    Architecture(llama_moe.OlmoeForCausalLM, ModelFamily.olmoe, llama_moe.OLMOE_HF_NAMES,
                 is_lm=True),
)}
GPT2_LM = gpt2.GPT2LMHeadModel.__name__
FAMILY_NAMES = {arch.family: arch.names for arch in ARCHITECTURES.values()}

_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def architecture(name: str) -> Architecture:
    """The row of HF class `name`."""
    if name not in ARCHITECTURES:
        raise ValueError(f"{name} has no flaxlm counterpart; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_of(model: nnx.Module) -> Architecture:
    """The HF architecture our module mirrors (by its class)."""
    return architecture(type(model).__name__)


def lm_architecture(family: ModelFamily | str) -> Architecture | None:
    """The language model of `family`; None for an encoder, which has no next-token head."""
    family = ModelFamily(family)
    return next((a for a in ARCHITECTURES.values() if a.family is family and a.is_lm), None)


def classifier_architecture(family: ModelFamily | str) -> Architecture | None:
    """The sequence classifier of `family`; None for a family without (the MoE decoders)."""
    family = ModelFamily(family)
    return next((a for a in ARCHITECTURES.values() if a.family is family and not a.is_lm),
                None)


def family_of_model_type(model_type: str | None) -> ModelFamily | None:
    """The family of a config.json `model_type`; None if no family reads it."""
    return next((family for family, names in FAMILY_NAMES.items()
                 if names.model_type == model_type), None)


# ---------------------------------------------------------------- configs


def to_hf_config(arch: Architecture, model: ModelConfig, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 num_labels: int | None = None, label_names: list[str] | None = None):
    """The HF config of `arch` with `model`'s shape and dropout, the special token ids its
    family carries and, for a classifier, the labels."""
    names = arch.names
    values = _config_values(names, model, bos_token_id, eos_token_id, pad_token_id)
    config = names.config_class(**values, **names.config_extras)
    config.architectures = [arch.name]
    if not arch.is_lm:
        _make_classifier_config(config, num_labels, label_names)
    return config


def lm_config_json(model: ModelConfig, *, bos_token_id: int, eos_token_id: int,
                   pad_token_id: int) -> dict:
    """What `to_lm_config` holds, as the values of a config.json, made without transformers:
    its config classes import PyTorch where it is installed (seconds), and a run writes its
    config.json before the first step (`start_model_dir`). transformers reads it with its
    class's defaults for what it leaves out, the defaults `to_lm_config` gets too."""
    arch = lm_architecture(model.family)
    if arch is None:
        raise ValueError(f"model.family={ModelFamily(model.family).value} has no language model")
    names = arch.names
    values = _config_values(names, model, bos_token_id, eos_token_id, pad_token_id)
    return {"architectures": [arch.name], "model_type": names.model_type, **values,
            **names.config_extras}


def _config_values(names: HFNames, model: ModelConfig, bos_token_id: int | None,
                   eos_token_id: int | None, pad_token_id: int | None) -> dict:
    values = {hf: getattr(model, ours)
              for hf, ours in {**names.shape_fields, **names.dropout_fields}.items()}
    if names.mlp_width_required:
        mlp_field = next(hf for hf, ours in names.shape_fields.items() if ours == "mlp_size")
        values[mlp_field] = TransformerSpec(model).mlp_width
    ids = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    values.update({key: ids[key] for key in names.special_tokens})
    values.update(names.config_to_hf(model))
    return values


def to_lm_config(model: ModelConfig, *, bos_token_id: int, eos_token_id: int,
                 pad_token_id: int):
    """The HF config of the language model `build_lm` makes for `model.family`."""
    arch = lm_architecture(model.family)
    if arch is None:
        raise ValueError(f"model.family={ModelFamily(model.family).value} has no language model")
    return to_hf_config(arch, model, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                        pad_token_id=pad_token_id)


def to_classifier_config(model: ModelConfig, *, num_labels: int, pad_token_id: int,
                         bos_token_id: int | None = None, eos_token_id: int | None = None,
                         label_names: list[str] | None = None):
    """The HF config of the classifier `build_classifier` makes for `model.family`."""
    return to_hf_config(classifier_architecture(model.family), model, bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        num_labels=num_labels, label_names=label_names)


def model_shape(names: HFNames, raw: dict) -> dict:
    """ModelConfig's shape fields from a config.json of `names`' family (HF's defaults filled
    in for what it leaves out)."""
    config = names.config_class.from_dict(raw)
    shape = {ours: getattr(config, hf) for hf, ours in names.shape_fields.items()}
    return {**shape, **names.config_from_hf(config)}


def _make_classifier_config(config, num_labels: int | None, label_names: list[str] | None):
    if num_labels is None:
        raise ValueError(f"{config.architectures[0]} needs num_labels")
    label_names = label_names or None  # regression has no label names
    if label_names is not None and len(label_names) != num_labels:
        raise ValueError(f"{len(label_names)} label names for num_labels={num_labels}")
    config.num_labels = num_labels  # also sets the default id2label: LABEL_0, LABEL_1, ...
    if label_names is not None:
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: index for index, name in enumerate(label_names)}
    # HF reads problem_type to pick the loss; one output means a regression score (STS-B).
    config.problem_type = "regression" if num_labels == 1 else "single_label_classification"
    return config


# ---------------------------------------------------------------- parameter names


def hf_name(path: tuple, architecture_name: str = GPT2_LM) -> str:
    """Our parameter path, e.g. ('h', 0, 'attn', 'c_attn', 'kernel'), as HF's key (one layer's,
    one expert's: see `hf_pieces`)."""
    *modules, leaf = (str(part) for part in path)
    arch = architecture(architecture_name)
    if leaf not in _LEAF_NAMES:
        raise FlaxlmError(_no_hf_name(path, arch))
    return renamed(arch.path_prefix + ".".join([*modules, _LEAF_NAMES[leaf]]), arch.names)


def renamed(key: str, names: HFNames) -> str:
    """A key in our modules' names as the family's checkpoints name it (`HFNames.renames`);
    a key already in theirs stays as it is."""
    for ours, theirs in names.renames:
        key = key.replace(ours, theirs)
    return key


def _no_hf_name(path: tuple, arch: Architecture) -> str:
    where = ".".join(str(part) for part in path)
    if str(path[-1]) == "router_bias":
        return (
            f"{where} is the routing bias of model.moe.bias_update_rate (DeepSeek-V3's "
            f"loss-free balancing): it decides which experts each token goes to, and "
            f"transformers' {arch.name} has no such bias, so without it the exported model "
            "would route tokens otherwise than the one trained. A model trained with "
            "model.moe.bias_update_rate > 0 cannot be exported to transformers; use it in "
            "flaxlm (its run directory, flaxlm-generate), or train with "
            "model.moe.bias_update_rate=0 to export."
        )
    return f"{where} has no counterpart in transformers' {arch.name}."


def is_transposed(path: tuple, architecture_name: str = GPT2_LM) -> bool:
    """True where HF stores the weight as nn.Linear (out, in) rather than our (in, out)."""
    linear = architecture(architecture_name).names.linear_modules
    return str(path[-1]) == "kernel" and str(path[0]) in linear


def is_expert_matrix(path: tuple, names: HFNames) -> bool:
    """Whether our leaf at `path` is a stack of experts' matrices (`moe.Experts`)."""
    return (names.experts_module is not None and len(path) >= 2
            and str(path[-2]) == names.experts_module)


def hf_pieces(path: tuple, shape: tuple[int, ...], names: HFNames
              ) -> list[tuple[tuple[int, ...], tuple]]:
    """The tensors HF stores our leaf at `path` (of `shape`) as: (index, path) each, the
    leaf's part `leaf[index]` being the tensor HF names after that path. A leaf outside the
    stacks is one tensor (index ()); a scanned model's stacked leaf one per layer (the index
    its layer); an experts' matrix one per expert (the index then ends with the expert, and the
    path is that of the expert's own nn.Linear kernel, as HF holds one per expert)."""
    layer_paths = per_layer_paths(path, names.layers_module, shape[0]) if shape else None
    pieces = ([((layer,), layer_path) for layer, layer_path in enumerate(layer_paths)]
              if layer_paths else [((), path)])
    if not is_expert_matrix(path, names):
        return pieces
    num_experts = shape[len(pieces[0][0])]
    return [((*index, expert), (*piece[:-1], expert, piece[-1], "kernel"))
            for index, piece in pieces for expert in range(num_experts)]


def unrolled_params(params: dict, architecture_name: str = GPT2_LM) -> dict:
    """`params` in HF's layout, one entry per layer: a scanned model's stacked layers
    (`model.scan_layers`) split, an unrolled model's as they are."""
    return unstack_layers(params, architecture(architecture_name).names.layers_module)


def params_in_layout(params: dict, model: ModelConfig) -> dict:
    """`params` (either layout) in the layout of a model built from `model`: stacked when
    `model.scan_layers`, else one entry per layer."""
    layers_key = FAMILY_NAMES[ModelFamily(model.family)].layers_module
    convert = stack_layers if model.scan_layers else unstack_layers
    return convert(params, layers_key)


def flatten_params(params: dict, path: tuple = ()):
    """(path, leaf) for every leaf of a nested parameter dict."""
    for key, child in params.items():
        if isinstance(child, dict):
            yield from flatten_params(child, (*path, key))
        else:
            yield (*path, key), child


def to_hf_state_dict(params: dict, architecture_name: str = GPT2_LM) -> dict[str, np.ndarray]:
    """Flat {HF key: float32 array} from our nested parameter dict (nnx.State.to_pure_dict()),
    in either layout."""
    return {key: fetch() for key, (_, fetch) in hf_tensors(params, architecture_name).items()}


def hf_tensors(params: dict, architecture_name: str = GPT2_LM
               ) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """{HF key: (shape, fetch)} of our nested parameter dict (either layout), nothing read
    yet: `fetch()` is that one tensor as a float32 host array in HF's layout, gathered from its
    devices if it is a sharded `jax.Array`; a scanned model's layer, or one expert of a stack
    of them, is cut from its stack only then (`hf_pieces`)."""
    names = architecture(architecture_name).names
    tensors = {}
    for path, leaf in flatten_params(params):
        shape = tuple(np.shape(leaf))
        for index, piece in hf_pieces(path, shape, names):
            transposed = is_transposed(piece, architecture_name)
            piece_shape = shape[len(index):]
            tensors[hf_name(piece, architecture_name)] = (
                piece_shape[::-1] if transposed else piece_shape,
                functools.partial(_host_float32, leaf, transposed, index))
    return tensors


def _host_float32(leaf, transposed: bool, index: tuple[int, ...]) -> np.ndarray:
    array = host_copy(leaf[index] if index else leaf, np.float32)
    return array.T if transposed else array


def save_pretrained(directory: str, params: dict,
                    config: transformers.PretrainedConfig | dict) -> None:
    """Write config.json and model.safetensors (float32, under HF's names) into `directory`:
    what `AutoModelFor...from_pretrained(directory)` loads. `config`: a transformers config, or
    the values of a config.json (`lm_config_json`); its first architecture picks the mapping.
    The weights go to the file one tensor at a time (`write_safetensors`), so a sharded model
    is gathered to the host tensor by tensor. Writing a whole directory safely is the caller's
    (`flaxlm.export`)."""
    write_config(directory, config)
    write_safetensors(os.path.join(directory, "model.safetensors"),
                      hf_tensors(params, architecture_name(config)), metadata={"format": "pt"})


def architecture_name(config: transformers.PretrainedConfig | dict) -> str:
    """The (first) architecture a transformers config, or a config.json's values, names."""
    return (config["architectures"] if isinstance(config, dict) else config.architectures)[0]


def write_config(directory: str, config: transformers.PretrainedConfig | dict) -> None:
    """`directory`/config.json: a transformers config as it saves itself, or the values of
    one (`lm_config_json`) laid out as transformers writes them."""
    os.makedirs(directory, exist_ok=True)
    if not isinstance(config, dict):
        config.save_pretrained(directory)
        return
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as file:
        file.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_safetensors(path: str, tensors: dict[str, tuple[tuple[int, ...],
                                                         Callable[[], np.ndarray]]],
                      metadata: dict[str, str] | None = None) -> None:
    """A float32 safetensors file of `tensors` ({name: (shape, fetch)}), each fetched and
    written in turn: the host holds one tensor at a time, never the whole file. The bytes are
    those of `safetensors.numpy.save_file`: an 8-byte little-endian header length, the JSON
    header (compact, names sorted, `__metadata__` first, space-padded to 8 bytes), then the
    tensors' data in the header's order."""
    names = sorted(tensors)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        shape, _ = tensors[name]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(np.float32).itemsize
        header[name] = {"dtype": "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in names:
            shape, fetch = tensors[name]
            array = np.asarray(fetch(), dtype=np.float32)
            if not array.flags.c_contiguous:  # a transposed kernel is a strided view
                array = array.copy(order="C")
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: fetched shape {array.shape}, declared {shape}")
            f.write(array.data)
