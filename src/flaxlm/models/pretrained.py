"""Pretrained checkpoints in (`model.init_from`), through the name mapping of `flaxlm.models.hf`.

`resolve_checkpoint` finds a local directory (a path, a checkpoint inside an installed package,
or a Hub snapshot), `pretrained_model_config` reads family and shape from its config.json,
`load_pretrained_weights` fills a built model and says what it loaded and what starts fresh (a
new classifier head), and `load_pretrained_tokenizer` loads its tokenizer. Weights come from
safetensors, or from `pytorch_model.bin` through torch's weights-only unpickler — never through
plain pickle, which can run code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable

import jax
import ml_dtypes  # noqa: F401 — registers bfloat16 with numpy, so safetensors reads it
import numpy as np
from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import hf, moe
from flaxlm.models.layers import (
    ACTIVATIONS,
    HFNames,
)
from flaxlm.storage import cached_copy, is_url

transformers = lazy_module("transformers")

# ---------------------------------------------------------------- finding a checkpoint

_HUB_MODEL_FILES = ["config.json", "model*.safetensors", "model.safetensors.index.json"]
_HUB_TORCH_FILES = ["config.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]
_HUB_TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")


def resolve_checkpoint(source: str, cache_dir: str | None = None) -> str:
    """A local directory holding the checkpoint `source` names (the `model.init_from` value):
    an existing directory; `pkg://<module>/<subdir>`, a directory inside an installed Python
    package; a folder in a bucket (gs://, s3://), copied into `cache_dir`; or a Hugging Face
    Hub id, downloaded (config, weights, tokenizer) or found in the Hub cache."""
    if is_url(source) and not source.startswith("pkg://"):
        return cached_copy(source, cache_dir, "model.init_from")
    local = os.path.expanduser(source)
    if os.path.isdir(local):
        return os.path.abspath(local)
    if source.startswith("pkg://"):
        return _package_dir(source)
    if local.startswith(("/", ".", "~")) or os.path.isfile(local):
        raise FlaxlmError(
            f"model.init_from={source}: no such directory. Point it at an HF model directory "
            "(config.json + model.safetensors), a Hub id such as "
            "sentence-transformers/all-MiniLM-L6-v2, or pkg://<module>/<dir>."
        )
    return _hub_snapshot(source)


def _package_dir(source: str) -> str:
    module, _, subdir = source[len("pkg://"):].partition("/")
    spec = importlib.util.find_spec(module) if module else None
    if spec is None or not spec.submodule_search_locations:
        raise FlaxlmError(
            f"model.init_from={source}: Python package {module!r} is not installed. Install it "
            f"(pip install {module.replace('_', '-')}) or point model.init_from at a model "
            "directory or Hub id."
        )
    directory = os.path.join(list(spec.submodule_search_locations)[0], subdir)
    if not os.path.isdir(directory):
        raise FlaxlmError(
            f"model.init_from={source}: package {module!r} has no directory {subdir!r} "
            f"(looked in {directory}). Check the part after the module name."
        )
    return directory


def _hub_snapshot(repo_id: str) -> str:
    import huggingface_hub
    from huggingface_hub import errors

    def download(patterns):
        return huggingface_hub.snapshot_download(
            repo_id, allow_patterns=patterns + _HUB_TOKENIZER_FILES
        )

    try:
        directory = download(_HUB_MODEL_FILES)
        if not _weight_files(directory):  # an older repo with PyTorch weights only
            directory = download(_HUB_TORCH_FILES)
    except (errors.LocalEntryNotFoundError, errors.RepositoryNotFoundError,
            errors.RevisionNotFoundError, errors.GatedRepoError, errors.HFValidationError,
            errors.HfHubHTTPError, OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = ("the Hub is offline (HF_HUB_OFFLINE=1) and it is not in the local Hub cache"
               if offline else f"{type(error).__name__}: {error}")
        raise FlaxlmError(
            f"model.init_from={repo_id}: could not fetch this Hugging Face Hub model: {why}. "
            "Check the id, go online once to cache it (or `huggingface-cli login` for a gated "
            "model), or point model.init_from at a local model directory."
        ) from error
    return directory


# ---------------------------------------------------------------- config.json → ModelConfig


def read_hf_config(local_dir: str) -> dict:
    path = os.path.join(local_dir, "config.json")
    if not os.path.isfile(path):
        raise FlaxlmError(
            f"model.init_from: {local_dir} has no config.json, so its architecture is unknown. "
            "Point model.init_from at a Hugging Face model directory (config.json + weights)."
        )
    with open(path) as f:
        return json.load(f)


def checkpoint_family(local_dir: str) -> ModelFamily:
    """The model family of the checkpoint, from config.json's `model_type`."""
    model_type = read_hf_config(local_dir).get("model_type")
    family = hf.family_of_model_type(model_type)
    if family is None:
        supported = ", ".join(names.model_type for names in hf.FAMILY_NAMES.values())
        raise FlaxlmError(
            f"model.init_from: the checkpoint in {local_dir} is architecture {model_type!r} "
            f"(config.json model_type), which is not supported; supported: {supported}. "
            "Choose a checkpoint of one of these types."
        )
    return family


def pretrained_model_config(local_dir: str, base: ModelConfig) -> ModelConfig:
    """`base` with family and shape (and activation, LayerNorm epsilon, init range) from the
    checkpoint's config.json, named after `base.init_from` (the checkpoint), as it is no longer
    the preset. Dropout rates stay `base`'s: they are fine-tuning choices, not part of the
    pretrained network."""
    family = checkpoint_family(local_dir)
    names = hf.FAMILY_NAMES[family]
    raw = read_hf_config(local_dir)
    variant = names.unsupported(raw)
    if variant is not None:
        raise FlaxlmError(
            f"model.init_from: the {names.model_type} checkpoint in {local_dir} uses "
            f"{variant}, which flaxlm's {names.model_type} model does not implement. Choose a "
            f"standard {names.model_type} checkpoint."
        )
    shape = hf.model_shape(names, raw)
    if shape["activation"] not in ACTIVATIONS:
        raise FlaxlmError(
            f"model.init_from: the checkpoint in {local_dir} uses activation "
            f"{shape['activation']!r}; supported: {', '.join(sorted(ACTIVATIONS))}."
        )
    if base.extend_context:
        shape.update(_extended_context(base, shape.get("max_positions", base.max_positions),
                                         local_dir))
    return _replaced(base, name=base.init_from or base.name, family=family, **shape)


# What model.extend_context keeps of the run's settings in place of the checkpoint's.
POSITION_SETTINGS = ("max_positions", "rope_theta", "rope_scaling")


def _extended_context(base: ModelConfig, checkpoint_positions: int, local_dir: str) -> dict:
    """The run's position settings, which a context extension trains the checkpoint at."""
    if base.max_positions < checkpoint_positions:
        raise FlaxlmError(
            f"model.extend_context=true keeps the run's model.max_positions="
            f"{base.max_positions}, but the checkpoint in {local_dir} was trained at "
            f"{checkpoint_positions} positions: an extension cannot shorten the context. Set "
            f"model.max_positions to at least {checkpoint_positions}, or drop "
            "model.extend_context to take the checkpoint's positions as they are."
        )
    return {name: getattr(base, name) for name in POSITION_SETTINGS}


def _replaced(config, **fields):
    """`dataclasses.replace`, a dict given for a nested config (model.moe) replacing only the
    fields it names: what the checkpoint does not say (dispatch, capacity) stays the run's."""
    return dataclasses.replace(config, **{
        name: _replaced(getattr(config, name), **value)
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(config, name))
        else value for name, value in fields.items()})


def replaced_settings(given, loaded, prefix: str = "model") -> list[str]:
    """"model.<field>=<given> → <loaded>" for each setting of `given` (the preset and the
    command line) that the checkpoint's config.json replaced in `loaded`, a nested config's
    (model.moe) field by field."""
    changes = []
    for field in dataclasses.fields(given):
        before, after = getattr(given, field.name), getattr(loaded, field.name)
        if field.name == "name" or before == after:
            continue
        if dataclasses.is_dataclass(before) and type(before) is type(after):
            changes += replaced_settings(before, after, f"{prefix}.{field.name}")
        else:
            changes.append(f"{prefix}.{field.name}={before} → {after}")
    return changes


# ---------------------------------------------------------------- weights


@dataclasses.dataclass
class LoadReport:
    """What `load_pretrained_weights` did, by HF key."""

    loaded: list[str]  # copied from the checkpoint
    missing: list[str]  # not in the checkpoint (or of another shape): a fresh head, initialised
    unexpected: list[str]  # in the checkpoint, unused (a pretraining head, or allowed extras)
    reshaped: dict[str, tuple] = dataclasses.field(default_factory=dict)  # head: (ckpt, ours)

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """One info line for the log."""
        line = f"loaded {len(self.loaded)} pretrained tensors"
        if self.missing:
            line += f"; fresh (randomly initialised): {', '.join(self.missing)}"
        if self.reshaped:
            line += "; replaced (checkpoint shape differs): " + ", ".join(
                f"{key} {ckpt}→{ours}" for key, (ckpt, ours) in self.reshaped.items()
            )
        if self.unexpected:
            line += f"; unused from the checkpoint: {_some(self.unexpected)}"
        return line


# Heads our model may lack: pretraining heads (BERT's MLM/NSP `cls`, GPT-2's `lm_head`) and the
# task head of another fine-tune; unused, reported, never an error.
_UNUSED_HEAD_PREFIXES = ("cls.", "lm_head.", "score.", "classifier.")
# Heads our model has that a checkpoint may lack: they start from their fresh initialisation.
_FRESH_HEAD_PREFIXES = ("classifier.", "score.")


def load_pretrained_weights(model: nnx.Module, local_dir: str, *, source: str | None = None,
                            allow_unexpected: bool = False,
                            shape_from_checkpoint: bool = False) -> LoadReport:
    """Copy the checkpoint in `local_dir` into `model` (in place, cast to its parameter dtype).

    Tensor by tensor: each goes straight to where the model's parameter lives, every device
    reading from the file only its own part of it (`place`), and the parameter it replaces is
    freed at once; so a model sharded over a mesh (`flaxlm.parallel.init_on_mesh`) is loaded
    with no device or host ever holding more than its parameters' share plus one tensor. An
    abstract model (`nnx.eval_shape`) gets host arrays. Everything about the checkpoint's keys
    and shapes is checked before any tensor is read.

    A fresh classifier head (and a fresh pooler, for a checkpoint without one) is expected and
    reported; any other parameter missing from the checkpoint, or of another shape, is a
    FlaxlmError. Checkpoint tensors the model has no place for are allowed when they are a
    (pretraining) head, and otherwise an error unless `allow_unexpected`. `source` is the
    `model.init_from` value, for messages; `shape_from_checkpoint`: `model` was built from the
    checkpoint's own config.json (`pretrained_model_config`), so a shape that differs is the
    checkpoint's config.json disagreeing with its weights, which no setting fixes.
    """
    setting = f"model.init_from={source or local_dir}"
    arch = hf.architecture_of(model)
    _check_family(local_dir, arch, setting)
    checkpoint = _canonical_keys(open_checkpoint(local_dir, setting), arch.names)

    # Adapters (model.lora) and the routing bias of loss-free balancing
    # (model.moe.bias_update_rate) are the run's own, never in an HF checkpoint: they keep
    # their init.
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam),
                                     nnx.Not(moe.RouterBias)))
    own = nnx.to_pure_dict(state)
    # Every parameter as the tensors HF stores it in (one per layer, one per expert: the
    # pieces of `hf.hf_pieces`), whatever the model's layout (model.scan_layers): a scanned
    # model's stacked parameters are not copied apart to be checked.
    pieces = {path: hf.hf_pieces(path, tuple(np.shape(leaf)), arch.names)
              for path, leaf in hf.flatten_params(own)}
    targets = {hf.hf_name(piece, arch.name): (piece, tuple(np.shape(leaf))[len(index):])
               for path, leaf in hf.flatten_params(own) for index, piece in pieces[path]}
    # A body module the checkpoint has none of at all (a BertModel saved without its pooler).
    absent = tuple(prefix for prefix in (f"{arch.names.body_prefix}{module}."
                                         for module in arch.names.optional_modules)
                   if not any(key.startswith(prefix) for key in checkpoint))

    def is_fresh_head(key: str) -> bool:
        return key.startswith(_FRESH_HEAD_PREFIXES + absent)

    loaded, missing, reshaped, wrong_shape = [], [], {}, []
    for key, (piece, shape) in targets.items():
        if key not in checkpoint:
            missing.append(key)
            continue
        stored = checkpoint[key].transposed() if hf.is_transposed(piece, arch.name) \
            else checkpoint[key]
        if stored.shape != shape:
            if is_fresh_head(key):  # e.g. an MNLI head (3 labels) fine-tuned again for 2
                reshaped[key] = (stored.shape, shape)
                continue
            wrong_shape.append((key, stored.shape, shape))
            continue
        loaded.append(key)

    if wrong_shape:
        raise FlaxlmError(_shape_message(setting, local_dir, wrong_shape, arch,
                                         shape_from_checkpoint))
    not_fresh = [key for key in missing if not is_fresh_head(key)]
    if not_fresh:
        raise FlaxlmError(
            f"{setting}: the checkpoint in {local_dir} lacks {len(not_fresh)} parameters of "
            f"{arch.name} that are not a task head: {_some(not_fresh)}. It is incomplete or "
            "another architecture; point model.init_from at a full checkpoint of this model."
        )
    unexpected = [key for key in checkpoint if key not in targets]
    surprising = [key for key in unexpected if not key.startswith(_UNUSED_HEAD_PREFIXES)]
    if surprising and not allow_unexpected:
        raise FlaxlmError(
            f"{setting}: the checkpoint in {local_dir} has {len(surprising)} tensors "
            f"{arch.name} has no place for: {_some(surprising)}. It is probably a different "
            "architecture or variant than its config.json says; point model.init_from at a "
            "standard checkpoint (or load with allow_unexpected=True to ignore them)."
        )
    stored_at = {piece: checkpoint[key].transposed() if hf.is_transposed(piece, arch.name)
                 else checkpoint[key] for key, (piece, _) in targets.items() if key in loaded}
    for path, target in hf.flatten_params(own):
        if not all(piece in stored_at for _, piece in pieces[path]):
            continue  # a fresh head: it keeps its initialisation
        stored = _assembled([(index, stored_at[piece]) for index, piece in pieces[path]])
        _set(own, path, place(stored, target))
        if isinstance(target, jax.Array):  # its memory back now, not when the model is
            target.delete()                # updated: one tensor's extra at a time
    nnx.replace_by_pure_dict(state, own)
    nnx.update(model, state)
    return LoadReport(loaded, missing + list(reshaped), unexpected, reshaped)


def place(stored: StoredTensor, target) -> jax.Array | np.ndarray:
    """`stored` as `target` (an array, or an abstract one) holds its parameter: an array
    laid out as `target` is, in its dtype, each device reading only the part it keeps; a host
    array for an abstract target without a layout."""
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return stored.read().astype(target.dtype)
    return jax.make_array_from_callback(
        tuple(target.shape), sharding, lambda index: stored.read(index).astype(target.dtype))


def _assembled(parts: list[tuple[tuple[int, ...], StoredTensor]]) -> StoredTensor:
    """The tensor of one parameter from its pieces (`hf.hf_pieces`: (index, tensor) in index
    order): stacked on a leading axis for each place of the index (layers, then experts)."""
    if parts[0][0] == ():
        return parts[0][1]
    groups: dict[int, list] = {}
    for index, tensor in parts:
        groups.setdefault(index[0], []).append((index[1:], tensor))
    return _stacked([_assembled(group) for group in groups.values()])


def _stacked(layers: list[StoredTensor]) -> StoredTensor:
    """Tensors as one stacked on a leading axis (the scanned layout's layers, or a layer's
    experts), each part read from the tensors it spans."""
    return StoredTensor(
        (len(layers), *layers[0].shape),
        lambda index: np.stack([layers[layer].read(index[1:])
                                for layer in range(len(layers))[index[0]]]))


def _check_family(local_dir: str, arch: hf.Architecture, setting: str) -> None:
    if not os.path.isfile(os.path.join(local_dir, "config.json")):
        return  # weights alone: the key mapping and shape checks still guard the load
    family = checkpoint_family(local_dir)
    if family is not arch.family:
        raise FlaxlmError(
            f"{setting}: the checkpoint in {local_dir} is a {family.value} model but the model "
            f"being built is {arch.name} (model.family={arch.family.value}). Set "
            f"model.family={family.value} (pretrained_model_config does so from config.json)."
        )


def _canonical_keys(checkpoint: dict, names: HFNames) -> dict:
    """The checkpoint under our model's HF names: buffers and tied copies dropped, old
    LayerNorm names (gamma/beta) renamed, a bare base model's keys (BertModel, GPT2Model)
    prefixed, and experts held fused (transformers 5's layout in memory) split one per expert,
    under the family's names (Mixtral's `block_sparse_moe.experts.<e>.w1`)."""
    renamed = {}
    for key, array in _unfused_experts(checkpoint, names).items():
        key = hf.renamed(key, names)
        if key.endswith(names.buffer_suffixes) or key in names.tied_keys:
            continue
        if key.endswith(".gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith(".beta"):
            key = key[: -len("beta")] + "bias"
        if key.split(".", 1)[0] in names.body_modules:
            key = names.body_prefix + key
        renamed[key] = array
    return renamed


def _unfused_experts(checkpoint: dict, names: HFNames) -> dict:
    """`checkpoint` with each layer's fused experts (`experts.gate_up_proj` (E, 2F, D), gate
    rows first, and `experts.down_proj` (E, D, F), as transformers 5 holds them and may save
    them) as the per-expert nn.Linear weights that HF's original checkpoints hold
    (`experts.<e>.gate_proj.weight` (F, D), ...): views, nothing read."""
    if names.experts_module is None:
        return checkpoint
    fused_gate_up, fused_down = (f".{names.experts_module}.gate_up_proj",
                                 f".{names.experts_module}.down_proj")
    unfused = {}
    for key, tensor in checkpoint.items():
        if key.endswith(fused_gate_up):
            stem, width = key.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                unfused[f"{stem}{expert}.gate_proj.weight"] = _expert_rows(tensor, expert, 0,
                                                                           width)
                unfused[f"{stem}{expert}.up_proj.weight"] = _expert_rows(tensor, expert, width,
                                                                         2 * width)
        elif key.endswith(fused_down):
            stem = key.removesuffix("down_proj")
            for expert in range(tensor.shape[0]):
                unfused[f"{stem}{expert}.down_proj.weight"] = _expert_rows(
                    tensor, expert, 0, tensor.shape[1])
        else:
            unfused[key] = tensor
    return unfused


def _expert_rows(fused: StoredTensor, expert: int, start: int, stop: int) -> StoredTensor:
    """Rows start:stop of expert `expert`'s matrix in a fused (E, R, C) tensor, as a tensor
    of its own, read from the file only when asked."""

    def read_part(index: tuple) -> np.ndarray:
        rows = range(start, stop)[index[0]]
        return fused.read_part((slice(expert, expert + 1),
                                slice(rows.start, rows.stop, rows.step), *index[1:]))[0]

    return StoredTensor((stop - start, *fused.shape[2:]), read_part)


def _shape_message(setting: str, local_dir: str, wrong_shape: list,
                   arch: hf.Architecture, shape_from_checkpoint: bool = False) -> str:
    key, ckpt_shape, our_shape = wrong_shape[0]  # both in our (in, out) layout
    more = f" (and {len(wrong_shape) - 1} more)" if len(wrong_shape) > 1 else ""
    size_setting = next((name for fragment, name in arch.names.shape_settings
                         if fragment in key), "model.hidden_size")
    if shape_from_checkpoint:
        field = size_setting.removeprefix("model.")
        hf_field = next((hf_name for hf_name, ours in arch.names.shape_fields.items()
                         if ours == field), field)
        return (
            f"{setting}: parameter {key} has shape {tuple(ckpt_shape)} in the checkpoint in "
            f"{local_dir}, but the checkpoint's own config.json (its {hf_field}, which "
            f"model.init_from uses in place of {size_setting}) makes it {tuple(our_shape)}"
            f"{more}. The checkpoint's config.json does not describe its weights: fix "
            f"{hf_field} in {local_dir}/config.json, or use a consistent checkpoint."
        )
    return (
        f"{setting}: parameter {key} has shape {tuple(ckpt_shape)} in the checkpoint in "
        f"{local_dir} but {tuple(our_shape)} in the {arch.name} being built{more}. The model "
        f"was built with a different {size_setting} than the checkpoint; build it from "
        "the checkpoint's config.json (pretrained_model_config) or fix that setting to match."
    )


def _some(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _set(params: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        params = params[key]
    params[path[-1]] = value


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint, read only when asked: `read(index)` is the part at `index`
    (a tuple of slices, one per dimension, as `jax.make_array_from_callback` asks for it; None:
    all of it) as a numpy array."""

    shape: tuple[int, ...]
    read_part: Callable[[tuple], np.ndarray]

    def read(self, index: tuple | None = None) -> np.ndarray:
        return self.read_part(tuple(slice(None) for _ in self.shape) if index is None
                              else tuple(index))

    def transposed(self) -> StoredTensor:
        """The tensor with its dimensions reversed (`.T`): a PyTorch Linear weight (out, in)
        as our kernel (in, out)."""
        return StoredTensor(self.shape[::-1],
                            lambda index: self.read_part(tuple(index)[::-1]).T)


def weights_sha256(local_dir: str) -> str:
    """SHA-256 of the checkpoint's weight files, in the order they are read: what a run that
    trains adapters on these weights records, to know them again when it resumes."""
    digest = hashlib.sha256()
    for path in _weight_files(local_dir):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def open_checkpoint(local_dir: str, setting: str = "model.init_from") -> dict[str, StoredTensor]:
    """{HF key: tensor} of model.safetensors (or its shards), read tensor by tensor and part by
    part; else of pytorch_model.bin (or its shards), which torch's weights-only unpickler
    reads whole."""
    files = _weight_files(local_dir)
    if not files:
        raise FlaxlmError(
            f"{setting}: {local_dir} holds no weights (model.safetensors or pytorch_model.bin, "
            "or a sharded index of either). Point model.init_from at a complete model directory."
        )
    tensors: dict[str, StoredTensor] = {}
    for path in files:
        if path.endswith(".safetensors"):
            tensors.update(_safetensors_tensors(path))
        else:
            tensors.update({key: _in_memory(array)
                            for key, array in _read_torch_bin(path, setting).items()})
    return tensors


def _weight_files(local_dir: str) -> list[str]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.isfile(os.path.join(local_dir, single)):
            return [os.path.join(local_dir, single)]
        if os.path.isfile(os.path.join(local_dir, index)):
            with open(os.path.join(local_dir, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(local_dir, shard) for shard in shards]
    return []


def _safetensors_tensors(path: str) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header alone; a part is read from the
    file (memory-mapped) when asked. bfloat16 reads as ml_dtypes' numpy bfloat16."""
    from safetensors import safe_open

    def read_part(key: str, index: tuple) -> np.ndarray:
        with safe_open(path, framework="numpy") as f:
            return f.get_slice(key)[index]

    with safe_open(path, framework="numpy") as f:
        return {key: StoredTensor(tuple(f.get_slice(key).get_shape()),
                                  functools.partial(read_part, key))
                for key in f.keys()}


def _in_memory(array: np.ndarray) -> StoredTensor:
    return StoredTensor(tuple(array.shape), lambda index: array[index])


def _read_torch_bin(path: str, setting: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as error:
        raise FlaxlmError(
            f"{setting}: {path} is a PyTorch checkpoint (no model.safetensors beside it), and "
            "reading it needs torch (pip install torch), or convert it to safetensors first."
        ) from error
    try:
        # weights_only: torch's restricted unpickler, which loads tensors and refuses code.
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise FlaxlmError(
            f"{setting}: {path} could not be read as plain PyTorch weights "
            f"({type(error).__name__}: {error}). flaxlm reads .bin files only with torch's "
            "weights-only loader; use a model.safetensors checkpoint instead."
        ) from error
    return {
        key: (value.to(torch.float32) if value.is_floating_point() else value).numpy()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


# ---------------------------------------------------------------- tokenizer


def load_pretrained_tokenizer(local_dir: str):
    """The checkpoint's own tokenizer (`transformers.AutoTokenizer`)."""
    if not any(os.path.isfile(os.path.join(local_dir, name)) for name in _TOKENIZER_FILES):
        raise FlaxlmError(
            f"model.init_from: {local_dir} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}). "
            "A pretrained model needs the tokenizer it was trained with: set tokenizer.path=… to "
            "that tokenizer's directory."
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(local_dir)
    except (OSError, ValueError) as error:
        raise FlaxlmError(
            f"model.init_from: the tokenizer in {local_dir} could not be loaded ({error}). "
            "Set tokenizer.path=… to a working tokenizer directory."
        ) from error
