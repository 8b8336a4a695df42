"""A run directory read back as a model: its latest or a given checkpoint, or, for a run without
checkpoints, the Hugging Face model it exported at its end (`model/`), with the run's tokenizer
and config. flaxlm-export writes it out; flaxlm-generate samples from it.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh
from omegaconf import OmegaConf

from flaxlm import layout
from flaxlm.config import MeshConfig, ModelConfig, Remat, upgrade_saved_config
from flaxlm.data.tokenizer import keeps_own_conventions
from flaxlm.errors import FlaxlmError
from flaxlm.export import read_marker
from flaxlm.layout import CHECKPOINT_SUBDIR, MODEL_SUBDIR, run_path
from flaxlm.lazy_imports import lazy_module
from flaxlm.models import hf, lora, pretrained
from flaxlm.models.build import abstract_network, build_classifier, build_lm, lm_from_params
from flaxlm.models.layers import TransformerSpec
from flaxlm.parallel import make_mesh, place_state, state_shardings
from flaxlm.platforms import skip_absent_tpu
from flaxlm.storage import is_url
from flaxlm.training.checkpoint.manager import finalised_steps, restore_params
from flaxlm.training.keys import run_keys

transformers = lazy_module("transformers")


class RunModel(NamedTuple):
    """A run's trained model, ready to export or generate with."""

    params: dict  # nested, as nnx.to_pure_dict gives
    model_config: ModelConfig
    tokenizer: Any
    run_config: dict  # the run's resolved config ({} if unknown)
    step: int | None
    source: str  # e.g. "/runs/x checkpoint step 200", for messages and the model card
    hf_config: Any = None  # a classifier's HF config (task=classify, task=reward); None: an LM

    @property
    def own_conventions(self) -> bool:
        """Whether the run kept its tokenizer's own special tokens (`keeps_own_conventions`):
        how generation and export read a prompt."""
        tokenizer = self.run_config.get("tokenizer") or {}
        model = self.run_config.get("model") or {}
        return keeps_own_conventions(tokenizer.get("convention", "auto"), model.get("init_from"))

    def model(self) -> nnx.Module:
        if self.hf_config is not None:
            raise FlaxlmError(
                f"{self.source} is a classifier ({self.hf_config.architectures[0]}, from a "
                "task=classify or task=reward run), not a language model, so it cannot "
                "generate text. Give flaxlm-generate the directory of a task=clm run."
            )
        return lm_from_params(self.model_config, self.params)


def load_run_model(run_dir: str, step: int | None = None, mesh: Mesh | None = None
                   ) -> RunModel:
    """The parameters of `run_dir`'s latest complete checkpoint (or of `step`), with the run's
    config and its tokenizer (from `run_dir/model/`). A run without checkpoints falls back to
    the HF model it exported at its end, `run_dir/model/` (then `step` must be unset).

    With a `mesh`, each parameter is read straight onto it, laid out by its logical axes
    (`flaxlm.parallel`), each device reading its part: the model is never whole on one device
    nor on the host (`local_mesh` spreads it over this machine's devices); without one, the
    parameters are numpy arrays on the host."""
    checkpoints, name = None, run_dir
    if is_url(run_dir):  # a bucket run: its output_url
        name = run_dir.rstrip("/")
        checkpoints = f"{name}/{CHECKPOINT_SUBDIR}"
        run_dir = bucket_run_copy(name)
    run_dir = os.path.abspath(os.path.expanduser(run_dir))
    if not os.path.isdir(run_dir):
        raise FlaxlmError(
            f"The run directory {run_dir} does not exist. Give the directory of a flaxlm-train "
            "run, e.g. outputs/clm/runs/<timestamp>."
        )
    model_dir = run_path(run_dir, MODEL_SUBDIR)
    tokenizer = _load_tokenizer(model_dir, run_dir)
    if (finalised_steps(checkpoints) if checkpoints
            else os.path.isdir(run_path(run_dir, CHECKPOINT_SUBDIR))):
        def layout(saved_config: dict) -> dict:
            run_config = upgrade_saved_config(saved_config)
            model = _abstract_model(_trained_model_config(run_dir, run_config),
                                    _hf_config(run_config, model_dir))
            return nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh))

        params, run_config, step = restore_params(run_dir, step,
                                                  layout if mesh is not None else None,
                                                  directory=checkpoints)
        run_config = upgrade_saved_config(run_config)  # an earlier release's keys too
        model_config = _trained_model_config(run_dir, run_config)
        hf_config = _hf_config(run_config, model_dir)
        if lora.enabled(model_config):  # the checkpoint holds what trained only
            params, model_config = _merged_onto_base(params, model_config, run_config, mesh,
                                                     hf_config)
        return RunModel(params, model_config, tokenizer, run_config, step,
                        f"{name if checkpoints else run_dir} checkpoint step {step}", hf_config)
    if step is not None:
        raise FlaxlmError(
            f"The run directory {run_dir} has no checkpoints/ folder, so there is no checkpoint "
            f"at step {step}. Leave --step out to use the model the run exported at its end "
            f"({model_dir})."
        )
    return _from_export(model_dir, run_dir, tokenizer, mesh)


@functools.cache
def bucket_run_copy(url: str) -> str:
    """A local folder holding what a bucket run (`url`, its output_url) keeps beside its
    checkpoints: config.yaml, metrics.jsonl, status.json and model/ (the tokenizer and config
    it started with, or its final export), downloaded once per process and removed at exit.
    The checkpoints are read from the bucket where they are."""
    from flaxlm import storage

    setting = "RUN_DIR"
    names = storage.list_names(url, setting)
    if layout.CONFIG_FILE not in names or MODEL_SUBDIR not in names:
        storage.check_bucket(url, setting)
        raise FlaxlmError(
            f"{url} holds no flaxlm run: {_found_instead(names)}. Give a run's output_url, "
            f"e.g. {url.partition('://')[0]}://<bucket>/runs/<name>; a run copies its "
            f"{layout.CONFIG_FILE} there at its start and its {MODEL_SUBDIR}/ (with the "
            "tokenizer) by its first evaluation or checkpoint."
        )
    local = tempfile.mkdtemp(prefix="flaxlm-bucket-run-")
    atexit.register(shutil.rmtree, local, True)
    for name in (layout.CONFIG_FILE, layout.METRICS_FILE, layout.STATUS_FILE,
                 layout.MODEL_CONFIG_FILE):
        if name in names:
            storage.download(f"{url}/{name}", run_path(local, name), setting)
    storage.download_folder(f"{url}/{MODEL_SUBDIR}", run_path(local, MODEL_SUBDIR), setting)
    return local


def _found_instead(names: list[str]) -> str:
    """What a bucket folder that is not a run holds, for the message: its names (the first
    few) and which of a run's it lacks."""
    if not names:
        return "no object is stored under it"
    missing = [f"no {name}" for name in (layout.CONFIG_FILE, f"{MODEL_SUBDIR}/")
               if name.rstrip("/") not in names]
    shown = ", ".join(sorted(names)[:6]) + (f" and {len(names) - 6} more" if len(names) > 6
                                            else "")
    return f"it holds {shown}, but {' and '.join(missing)}"


def _merged_onto_base(trained: dict, model_config: ModelConfig, run_config: dict,
                      mesh: Mesh | None, hf_config=None) -> tuple[dict, ModelConfig]:
    """A LoRA run's checkpointed `trained` parameters (its adapters, and a classifier's fresh
    head beside them) on its frozen base, merged: the parameters and config of the plain
    model the run's export holds. The base comes from model.init_from, or, for a random base,
    from the run's seed as training made it. The base is read to the host whole, then laid
    out on `mesh` if one is given. `hf_config`: a classifier's (None: an LM)."""
    spec = TransformerSpec(model_config)
    if model_config.init_from:
        model = abstract_network(lambda rngs: _network(spec, hf_config, rngs))
        pretrained.load_pretrained_weights(
            model, pretrained.resolve_checkpoint(model_config.init_from,
                                                 run_config.get("cache_dir")),
            source=model_config.init_from, shape_from_checkpoint=True)
    else:
        init_key, _ = run_keys(run_config.get("seed", 0))
        model = _network(spec, hf_config, nnx.Rngs(params=init_key))
    state = nnx.state(model, nnx.Param)  # the adapters are Params too
    nnx.replace_by_pure_dict(state, jax.device_get(trained))
    nnx.update(model, state)
    params = lora.merged_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                                lora.adapter_scale(model_config.lora))
    model_config = lora.without_adapters(model_config)
    if mesh is not None:
        state = nnx.state(_abstract_model(model_config, hf_config), nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        params = nnx.to_pure_dict(place_state(state, mesh))
    return params, model_config


def _load_tokenizer(model_dir: str, run_dir: str):
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise FlaxlmError(
            f"{model_dir} has no tokenizer.json, so the run's tokenizer is unknown. Pass the "
            "directory of a flaxlm-train run (it saves its tokenizer to model/ before training "
            f"starts); is {run_dir} one?"
        )
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _trained_model_config(run_dir: str, run_config: dict) -> ModelConfig:
    """The shape the run trained, as it recorded it when it started. A run that predates that
    record has it in its config, or (model.init_from's shape) in its model/config.json."""
    recorded = run_path(run_dir, layout.MODEL_CONFIG_FILE)
    if os.path.isfile(recorded):
        return _as_model_config(OmegaConf.load(recorded))
    model_config = _model_config(run_config, run_dir)
    if model_config.init_from:
        model_config = pretrained.pretrained_model_config(run_path(run_dir, MODEL_SUBDIR),
                                                          model_config)
    return model_config


def _as_model_config(values) -> ModelConfig:
    """A saved model config (a run's model_config.yaml, or its config's model node)."""
    if not isinstance(values, dict):
        values = OmegaConf.to_container(values, resolve=True)
    values = upgrade_saved_config({"model": values})["model"]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


def _model_config(run_config: dict, run_dir: str) -> ModelConfig:
    if "model" not in run_config:
        raise FlaxlmError(
            f"The checkpoint of {run_dir} has no model config in its metadata, so it was not "
            "written by flaxlm-train. Give the directory of a flaxlm-train run."
        )
    return _as_model_config(run_config["model"])


def _from_export(model_dir: str, run_dir: str, tokenizer, mesh: Mesh | None) -> RunModel:
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        raise FlaxlmError(
            f"The run directory {run_dir} has no checkpoint (no checkpoints/ folder) and no "
            f"exported model ({model_dir}/model.safetensors): the run stopped before saving its "
            "weights. "
            "Give the directory of a run that finished or saved a checkpoint."
        )
    run_config = saved_run_config(run_dir)
    if os.path.isfile(run_path(run_dir, layout.MODEL_CONFIG_FILE)):
        model_config = _trained_model_config(run_dir, run_config)
    else:  # the export's own config.json gives the shape
        # Without a saved config, what config.json leaves out is what generation needs:
        # no dropout, no recomputation.
        base = _model_config(run_config, run_dir) if "model" in run_config else ModelConfig(
            name=os.path.basename(run_dir), hidden_dropout=0.0, embedding_dropout=0.0,
            attention_dropout=0.0, remat=Remat.none)
        model_config = pretrained.pretrained_model_config(model_dir, base)
    hf_config = _hf_config(run_config, model_dir)
    model = _abstract_model(model_config, hf_config)
    if mesh is not None:  # each tensor is read onto its shards
        nnx.update(model, place_state(nnx.state(model, nnx.Param), mesh))
    # Raises if any weight is missing.
    pretrained.load_pretrained_weights(model, model_dir, source=model_dir)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    marker = read_marker(model_dir)
    step = (marker.get("eval_metrics") or {}).get("steps")
    return RunModel(params, model_config, tokenizer, run_config, step,
                    f"{model_dir} (final export)", hf_config)


def _hf_config(run_config: dict, model_dir: str):
    """The HF config of a run that trains a classifier (its labels); None for an LM."""
    if _is_classifier_run(run_config, model_dir):
        return transformers.AutoConfig.from_pretrained(model_dir)
    return None


def _abstract_model(model_config: ModelConfig, hf_config) -> nnx.Module:
    """The run's network, shapes only (`nnx.eval_shape`): a classifier of `hf_config`'s
    labels, or (None) a language model."""
    return abstract_network(lambda rngs: _network(TransformerSpec(model_config), hf_config, rngs))


def _network(spec: TransformerSpec, hf_config, rngs: nnx.Rngs) -> nnx.Module:
    """A classifier of `hf_config`'s labels, or (None) a language model."""
    if hf_config is not None:
        return build_classifier(spec, hf_config.num_labels, rngs)
    return build_lm(spec, rngs)


def local_mesh() -> Mesh:
    """Every device of this machine on the `fsdp` axis: a run's model read back onto it is
    split over all of them. JAX starts here, on the platform it finds (never probing for a
    TPU that is not attached: `skip_absent_tpu`)."""
    skip_absent_tpu()
    return make_mesh(None, MeshConfig(data=1, fsdp=-1, tensor=1, expert=1, context=1))


def _is_classifier_run(run_config: dict, model_dir: str) -> bool:
    """Whether the run trains a sequence classifier (task=classify, task=reward), as the HF
    config the task wrote into model/ when the run started says: no list of tasks to keep
    here. A run without that file is a classifier if it was a task=classify run."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return ((run_config or {}).get("task") or {}).get("name") == "classify"
    with open(path, encoding="utf-8") as file:
        architectures = json.load(file).get("architectures") or []
    return any(name in hf.ARCHITECTURES and not hf.architecture(name).is_lm
               for name in architectures)


def saved_run_config(run_dir: str) -> dict:
    """The config a run saved when it started ({} if none), upgraded to today's keys."""
    path = run_path(run_dir, layout.CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    return upgrade_saved_config(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
