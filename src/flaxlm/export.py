"""Models leave flaxlm as Hugging Face directories.

`export_hf` writes what `transformers.AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` load (PyTorch, no missing or unused weights):

    config.json             the LM's config (`hf.lm_config_json`: what transformers' class holds,
                            its defaults left to it), or the HF config passed in
    model.safetensors       float32 weights under HF's PyTorch names (`hf.save_pretrained`)
    tokenizer files         tokenizer.json, tokenizer_config.json, ...
    generation_config.json  bos / eos / pad ids and the sampling defaults (LM only)
    README.md               a model card: the run's eval figures and its resolved config
    flaxlm_export.json      what wrote the directory, from which run and step

The directory is written under a temporary name beside `out` and renamed into place, so a
killed export never leaves a directory that looks whole. An existing `out` is replaced only if
it is empty or an earlier flaxlm export (`is_flaxlm_export`), or, with `overwrite=True`, a
run's own model/ folder; a run, a folder above the run being exported, anything inside a run's
checkpoints/ and anything else of the user's is an error, never replaced.

A language model's tokenizer is exported with `with_document_start`: it reads a text as the
start of a document, as flaxlm-generate does, so transformers generates what flaxlm does. A
model that keeps its tokenizer's own conventions (`own_conventions`: one from someone else's
weights) exports that tokenizer unchanged, since flaxlm-generate then reads a prompt as it does.

A classifier export (BERT or GPT-2) differs only in the HF config (`hf.to_classifier_config`,
whose `architectures[0]` picks the row of `hf.ARCHITECTURES`, and so the parameter mapping) and
in having no generation config: pass `hf_config=` and `generation=None`.

`flaxlm.run_model` reads a run directory back as a model (its checkpoint, or this export).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile

import numpy as np
from omegaconf import OmegaConf

from flaxlm import layout
from flaxlm.config import ModelConfig
from flaxlm.data.chat_template import stop_token_ids
from flaxlm.data.tokenizer import document_prefix, prompt_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.generate import GenerationSettings
from flaxlm.layout import CHECKPOINT_SUBDIR, MODEL_SUBDIR, RUN_FILES, run_path
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import hf, peft
from flaxlm.run_records import plain, read_metrics

transformers = lazy_module("transformers")

MARKER = layout.EXPORT_MARKER

# The model card's evaluation table: metric key → label, format.
_CARD_FIGURES = [
    ("eval/loss", "eval loss (nats per token)", "{:.4f}"),
    ("eval/perplexity", "eval perplexity", "{:,.2f}"),
    ("eval/bits_per_byte", "eval bits per byte", "{:.3f}"),
    ("eval/accuracy", "eval accuracy", "{:.4f}"),
    ("eval/f1", "eval F1", "{:.4f}"),
    ("eval/matthews", "eval Matthews correlation", "{:.4f}"),
    ("eval/pearson", "eval Pearson correlation", "{:.4f}"),
    ("eval/spearman", "eval Spearman correlation", "{:.4f}"),
    ("steps", "optimizer steps", "{:,}"),
    ("tokens_seen", "training tokens seen", "{:,}"),
]


DEFAULT_GENERATION = GenerationSettings()  # frozen, so one instance serves every call


def export_hf(out_dir: str, params: dict, model_config: ModelConfig, tokenizer, *,
              run_config: dict | None = None, eval_metrics: dict | None = None,
              generation: GenerationSettings | None = DEFAULT_GENERATION,
              hf_config: transformers.PretrainedConfig | None = None,
              source: str | None = None, overwrite: bool = False,
              run_dir: str | None = None, own_conventions: bool = False) -> str:
    """Write `params` (a nested dict, as `nnx.to_pure_dict` gives) as an HF model directory at
    `out_dir`; returns its absolute path.

    `hf_config` defaults to the language-model config of `model_config` with the tokenizer's
    special ids. `run_config` (the resolved config) and `eval_metrics` (eval/loss,
    eval/perplexity, eval/bits_per_byte, steps, tokens_seen) go into the model card;
    `generation` becomes generation_config.json (None: none written); `source` says where the
    weights came from (e.g. "run_dir, step 230"); `run_dir`, the run they came from, is never
    replaced (`check_destination`). `own_conventions`: the model keeps its tokenizer's own
    special tokens (`keeps_own_conventions`), so the tokenizer is exported as it is.
    """
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_destination(out_dir, overwrite, run_dir)
    if hf_config is None:  # its values: transformers' config classes import PyTorch
        hf_config = hf.lm_config_json(
            model_config,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    architecture = hf.architecture_name(hf_config)
    if hf.architecture(architecture).is_lm:
        tokenizer = prompt_tokenizer(tokenizer, own_conventions)
    staging = _staging_dir(out_dir)
    try:
        hf.save_pretrained(staging, params, hf_config)
        tokenizer.save_pretrained(staging)
        if generation is not None:
            generation_config(generation, tokenizer).save_pretrained(staging)
        card = model_card(model_config, architecture, run_config, eval_metrics, source,
                          _count(params), tokenizer, own_conventions)
        _write_text(os.path.join(staging, "README.md"), card)
        _write_marker(staging, architecture=architecture, source=source,
                      eval_metrics=plain(eval_metrics or {}))
        _give_default_modes(staging)
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _write_marker(staging: str, **fields) -> None:
    """The file that says flaxlm wrote this directory, from what, and when."""
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _write_text(os.path.join(staging, MARKER), json.dumps(
        {"exported_by": "flaxlm", **fields, "created": created}, indent=2) + "\n")


def export_adapter(out_dir: str, params: dict, model_config: ModelConfig, *,
                   base_model: str | None = None, source: str | None = None) -> str:
    """Write the adapters in `params` (model.lora's, see `flaxlm.models.peft`) as a PEFT
    adapter directory at `out_dir`, safely as `export_hf` writes a model: what
    `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model
    (`base_model`, its model.init_from, recorded in adapter_config.json). Returns its path."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_destination(out_dir)
    architecture = hf.lm_architecture(model_config.family).name
    staging = _staging_dir(out_dir)
    try:
        peft.save_adapter(staging, params, model_config, architecture, base_model)
        _write_marker(staging, architecture=architecture, adapter="peft-lora", source=source)
        _give_default_modes(staging)
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _staging_dir(out_dir: str) -> str:
    """A new folder beside `out_dir` (its parent made if missing) to write the export into;
    a destination on a read-only disk, or in a folder of someone else's, is the user's to
    change."""
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_leftovers(out_dir)
        return tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.export-", dir=parent)
    except OSError as err:
        raise FlaxlmError(
            f"Cannot export to {out_dir}: flaxlm cannot write in {parent} "
            f"({err.strerror or err}). Choose an --out in a directory you can write to."
        ) from None


def check_destination(out_dir: str, overwrite: bool = False, run_dir: str | None = None) -> None:
    """`out_dir` may be written: absent, empty, an earlier flaxlm export, or, with `overwrite`,
    a run's own model/ folder (the tokenizer and config it wrote when it started). Never, even
    with `overwrite`: `run_dir` (the run being exported) or a folder above it, a folder that
    holds a run, anything inside a run's checkpoints/, or any other folder of the user's."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    real_out = os.path.realpath(out_dir)
    if run_dir is not None:
        source = os.path.realpath(os.path.expanduser(run_dir))
        if os.path.commonpath([source, real_out]) == real_out:
            raise FlaxlmError(
                f"--out {out_dir} is the run being exported ({run_dir}) or a folder "
                "that contains it, and the export would replace it, deleting the run. Choose "
                "an --out folder that does not contain the run, e.g. --out my-model."
            )
    for folder in _self_and_parents(real_out):
        run = os.path.dirname(folder)
        if os.path.basename(folder) == CHECKPOINT_SUBDIR and set(_run_files(run)) - {folder}:
            raise FlaxlmError(
                f"--out {out_dir} is inside {folder}, the checkpoints folder of a run, which "
                "holds only that run's checkpoints. Choose an --out folder outside it, e.g. "
                "--out my-model."
            )
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise FlaxlmError(
            f"--out {out_dir} exists and is not a directory. Choose another --out path."
        )
    if found := _run_files(out_dir):
        raise FlaxlmError(
            f"--out {out_dir} holds a flaxlm run (it has "
            f"{', '.join(os.path.basename(path) for path in found)}), and the export "
            "would replace it, deleting the run. Choose a new --out folder, e.g. --out my-model."
        )
    if not os.listdir(out_dir) or is_flaxlm_export(out_dir):
        return
    own_model_dir = _is_run_model_dir(out_dir)
    if overwrite and own_model_dir:
        return
    raise FlaxlmError(
        f"--out {out_dir} already exists and is not a flaxlm export (an export is a folder of "
        f"files only, with a {MARKER} that flaxlm wrote), so the export would replace files "
        "of yours; flaxlm-export replaces only its own earlier exports. Choose a new --out "
        "folder, or move this one away yourself"
        + (", or pass --overwrite to replace this run's model/ folder (its tokenizer and "
           "config)." if own_model_dir else ".")
    )


def check_bucket_destination(url: str) -> None:
    """The bucket folder `url` may be written by an export: the store can be written to, and
    the folder is empty or an earlier flaxlm export (its objects all directly in it, among them
    the marker); never a run's folder (an output_url) or anything else."""
    from flaxlm import storage

    storage.probe_write(url, "--out")
    names = storage.list_names(url, "--out")
    if not names:
        return
    if found := sorted(set(names) & {*RUN_FILES, CHECKPOINT_SUBDIR}):
        raise FlaxlmError(
            f"--out {url} holds a flaxlm run (it has {', '.join(found)}), and the export would "
            "replace its objects. Choose a new --out folder, e.g. --out <the run's url>/model."
        )
    if MARKER not in names:
        raise FlaxlmError(
            f"--out {url} already holds objects and is not a flaxlm export (no {MARKER} in it), "
            "so the export would replace objects of yours; flaxlm-export replaces only its own "
            "earlier exports. Choose a new --out folder, or delete this one yourself."
        )


def is_flaxlm_export(directory: str) -> bool:
    """An earlier export, safe to replace: plain files only (an export has no subfolders, so
    nothing else can hide in it), among them the marker an export writes, and no run's files."""
    marker = read_marker(directory)
    return (isinstance(marker, dict) and marker.get("exported_by") == "flaxlm"
            and _only_files(directory) and not _run_files(directory))


def _is_run_model_dir(directory: str) -> bool:
    """A run's model/ folder: where the run writes its tokenizer and config when it starts,
    and its export when it ends."""
    return (os.path.basename(directory) == MODEL_SUBDIR
            and bool(_run_files(os.path.dirname(directory))) and _only_files(directory))


def _run_files(directory: str) -> list[str]:
    """The files and folders of a run in `directory` (paths)."""
    names = (*RUN_FILES, CHECKPOINT_SUBDIR)
    return [path for path in (os.path.join(directory, name) for name in names)
            if os.path.lexists(path)]


def _only_files(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return all(entry.is_file(follow_symlinks=False) for entry in entries)
    except OSError:
        return False


def _self_and_parents(path: str):
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def generation_config(settings: GenerationSettings, tokenizer) -> transformers.GenerationConfig:
    """transformers' generation defaults for the export: our sampling settings and the
    tokenizer's special ids (generation stops at EOS; batches pad with the pad token). A chat
    model's stops at the end of its turn too (`stop_token_ids`), as flaxlm-generate --chat."""
    stops = list(stop_token_ids(tokenizer)) if tokenizer.chat_template else []
    eos = stops if len(stops) > 1 else tokenizer.eos_token_id
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
               pad_token_id=tokenizer.pad_token_id, max_new_tokens=settings.max_new_tokens)
    if settings.is_greedy:
        return transformers.GenerationConfig(do_sample=False, **ids)
    return transformers.GenerationConfig(
        do_sample=True, temperature=settings.temperature, top_k=settings.top_k,
        top_p=settings.top_p, **ids,
    )


def model_card(model_config: ModelConfig, architecture: str, run_config: dict | None,
               eval_metrics: dict | None, source: str | None, num_params: int, tokenizer,
               own_conventions: bool = False) -> str:
    """README.md: what the model is, how well it did, how to load it, how it was trained. The
    configuration's model section is the model trained (model.init_from's shape, not the
    preset's)."""
    language = ((run_config or {}).get("language") or {}).get("name")
    mixture = (run_config or {}).get("mixture") or {}
    if mixture.get("sources"):  # a mixture: its languages, not its option's name
        language = ", ".join(mixture["sources"])
    arch = hf.architecture(architecture)
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {'text-generation' if arch.is_lm else 'text-classification'}",
        f"tags: [flaxlm, jax, flax, {arch.family.value}]",
        "---",
        "",
        f"# {model_config.name}" + (f" on {language}" if language else ""),
        "",
        f"A `{architecture}` ({model_config.num_layers} layers, width {model_config.hidden_size}, "
        f"{model_config.num_heads} heads, context {model_config.max_positions}, vocabulary "
        f"{model_config.vocab_size:,}; {num_params / 1e6:.2f}M parameters) trained with flaxlm "
        "(JAX / Flax NNX) and exported to transformers' PyTorch layout."
        + (f" Weights from {source}." if source else ""),
        "",
        "## Evaluation",
        "",
    ]
    figures = [(label, fmt.format(plain(eval_metrics[key])))
               for key, label, fmt in _CARD_FIGURES if eval_metrics and key in eval_metrics]
    figures += [(f"eval bits per byte, {name}", f"{eval_metrics[key]:.3f}")
                for name in mixture.get("sources") or {}
                if eval_metrics and (key := f"eval/{name}/bits_per_byte") in eval_metrics]
    if mixture.get("sources") and isinstance(mixture.get("weights"), dict):
        total = sum(mixture["weights"].values())
        lines[-3:-3] = ["", "Trained on a mixture of languages, sampled by weight: " + ", ".join(
            f"{name} {weight / total:.1%}" for name, weight in mixture["weights"].items()) + "."]
    if figures:
        lines += ["| | |", "|---|---|", *(f"| {label} | {value} |" for label, value in figures)]
    else:
        lines.append("No evaluation was recorded for these weights.")
    auto_class = ("AutoModelForCausalLM" if arch.is_lm
                  else "AutoModelForSequenceClassification")
    lines += ["", "## Use", "", "```python",
              f"from transformers import {auto_class}, AutoTokenizer", "",
              f'model = {auto_class}.from_pretrained("<this directory>")',
              'tokenizer = AutoTokenizer.from_pretrained("<this directory>")',
              "```", ""]
    if arch.is_lm:
        lines += [_document_note(tokenizer, own_conventions), ""]
    if arch.is_lm and tokenizer.chat_template:
        lines += ["A chat model: `tokenizer.apply_chat_template(messages, "
                  "add_generation_prompt=True, return_dict=True, return_tensors=\"pt\")` "
                  "encodes a conversation as training rendered it, and `model.generate` stops "
                  "at the end of the reply (generation_config.json's `eos_token_id`).", ""]
    if run_config:
        trained = OmegaConf.to_container(OmegaConf.structured(model_config), enum_to_str=True)
        run_config = {**run_config, "model": {**(run_config.get("model") or {}), **trained}}
        lines += ["## Training configuration", "", "```yaml",
                  OmegaConf.to_yaml(OmegaConf.create(plain(run_config))).rstrip(), "```", ""]
    return "\n".join(lines)


def run_generation_settings(run_config: dict | None) -> GenerationSettings:
    """The sampling settings a run used for its end-of-run samples (`samples.*`), as the
    export's generation defaults; GenerationSettings' own where the run has none."""
    samples = (run_config or {}).get("samples") or {}
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
    return GenerationSettings(**{name: samples[name] for name in names if name in samples})


def _document_note(tokenizer, own_conventions: bool) -> str:
    """How training framed documents, and so how the tokenizer reads a prompt."""
    eos = tokenizer.eos_token
    if not own_conventions:
        return ("Training packed documents into one stream separated by the EOS token "
                f"`{eos}`, so the model reads a text as the start of a document after it: the "
                "tokenizer puts it in front of every text it encodes, as `flaxlm-generate` does "
                "(`add_special_tokens=False` leaves it out).")
    prefix = "".join(tokenizer.convert_ids_to_tokens(list(document_prefix(tokenizer))))
    framed = f"`{prefix}` in front of each, " if prefix else ""
    return ("Training kept the conventions of the tokenizer the weights came with: documents "
            f"packed into one stream as it encodes them, {framed}the EOS token `{eos}` after "
            "each. The tokenizer is exported unchanged, so `tokenizer(text)` reads a prompt as "
            "`flaxlm-generate` does.")


def _give_default_modes(directory: str) -> None:
    """The modes the user's umask gives new files and folders, for `directory` and its files:
    mkdtemp makes the folder 0700 and safetensors writes its file 0600. The umask is read off
    a probe folder, as os.umask would change it for the whole process, under other threads."""
    probe = os.path.join(directory, ".mode-probe")
    os.mkdir(probe)  # 0o777 less the umask
    folder_mode = os.stat(probe).st_mode & 0o777
    os.rmdir(probe)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), folder_mode & 0o666)
    os.chmod(directory, folder_mode)


def _remove_leftovers(out_dir: str) -> None:
    """Remove what an export of `out_dir` killed midway left beside it: the hidden staging
    and old-copy folders named below, never a finished export, each as large as the model."""
    parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
    for entry in os.listdir(parent):
        if entry.startswith((f".{name}.export-", f".{name}.old-")):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _move_into_place(staging: str, out_dir: str) -> None:
    """Rename `staging` to `out_dir`; an existing `out_dir` is moved aside first and removed
    only once the new one is in place."""
    if not os.path.lexists(out_dir):
        os.rename(staging, out_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-",
                           dir=os.path.dirname(out_dir))
    os.rmdir(old)  # only its unique name is wanted
    os.rename(out_dir, old)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _count(params: dict) -> int:
    return sum(int(np.size(leaf)) for _, leaf in hf.flatten_params(params))


def read_marker(model_dir: str) -> dict:
    """An export's flaxlm_export.json ({} if it has none that reads)."""
    try:
        with open(os.path.join(model_dir, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def eval_metrics_at(run_dir: str, step: int | None) -> dict:
    """The eval figures metrics.jsonl recorded at `step` (none if no eval ran then), plus
    `steps`; for the model card of an export from a checkpoint."""
    figures: dict = {} if step is None else {"steps": step}
    if step is None:
        return figures
    for record in read_metrics(run_path(run_dir, layout.METRICS_FILE)).records:
        if record.get("step") == step and "eval/loss" in record:
            figures.update({k: v for k, v in record.items() if k.startswith("eval/")})
    return figures

