"""Interop with Hugging Face: configs and the parameter-name mapping, both ways.

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

HF's GPT-2 body uses Conv1D, whose weight is stored (in, out) like our kernels; every other HF
projection here is `nn.Linear`, stored (out, in), so its kernel is transposed both ways.
Importing a checkpoint (`model.init_from`) is `flaxlm.models.pretrained`.
"""

from __future__ import annotations

import os

import numpy as np
import transformers
from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily

GPT2_LM = "GPT2LMHeadModel"
GPT2_CLASSIFIER = "GPT2ForSequenceClassification"
BERT_CLASSIFIER = "BertForSequenceClassification"
ARCHITECTURES = (GPT2_LM, GPT2_CLASSIFIER, BERT_CLASSIFIER)

_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


# ---------------------------------------------------------------- configs (export)


def to_gpt2_config(model: ModelConfig, *, bos_token_id: int, eos_token_id: int,
                   pad_token_id: int, num_labels: int | None = None,
                   label_names: list[str] | None = None):
    """GPT2Config for a `GPT2LMHeadModel`, or, with `num_labels`, a
    `GPT2ForSequenceClassification`."""
    config = transformers.GPT2Config(
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
        architectures=[GPT2_LM],
    )
    if num_labels is not None:
        _make_classifier_config(config, GPT2_CLASSIFIER, num_labels, label_names)
    return config


def to_bert_config(model: ModelConfig, *, num_labels: int, pad_token_id: int = 0,
                   label_names: list[str] | None = None):
    """BertConfig for a `BertForSequenceClassification` of `model`'s shape."""
    config = transformers.BertConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.n_embd,
        num_hidden_layers=model.n_layer,
        num_attention_heads=model.n_head,
        intermediate_size=model.n_inner or 4 * model.n_embd,
        hidden_act=model.activation_function,
        hidden_dropout_prob=model.resid_pdrop,
        attention_probs_dropout_prob=model.attn_pdrop,
        max_position_embeddings=model.n_positions,
        type_vocab_size=model.type_vocab_size,
        initializer_range=model.initializer_range,
        layer_norm_eps=model.layer_norm_epsilon,
        classifier_dropout=model.classifier_dropout,
        pad_token_id=pad_token_id,
    )
    return _make_classifier_config(config, BERT_CLASSIFIER, num_labels, label_names)


def to_classifier_config(model: ModelConfig, *, num_labels: int, pad_token_id: int,
                         bos_token_id: int | None = None, eos_token_id: int | None = None,
                         label_names: list[str] | None = None):
    """The HF config of the classifier `build_classifier` makes for `model.family`."""
    if ModelFamily(model.family) is ModelFamily.bert:
        return to_bert_config(model, num_labels=num_labels, pad_token_id=pad_token_id,
                              label_names=label_names)
    return to_gpt2_config(model, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, num_labels=num_labels,
                          label_names=label_names)


def _make_classifier_config(config, architecture: str, num_labels: int,
                            label_names: list[str] | None):
    label_names = label_names or None  # regression has no label names
    if label_names is not None and len(label_names) != num_labels:
        raise ValueError(f"{len(label_names)} label names for num_labels={num_labels}")
    config.architectures = [architecture]
    config.num_labels = num_labels  # also sets the default id2label: LABEL_0, LABEL_1, ...
    if label_names is not None:
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: index for index, name in enumerate(label_names)}
    # HF reads problem_type to pick the loss; one output means a regression score (STS-B).
    config.problem_type = "regression" if num_labels == 1 else "single_label_classification"
    return config


# ---------------------------------------------------------------- names and export


def architecture_of(model: nnx.Module) -> str:
    """The HF architecture our module mirrors (its class name)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"{name} has no HF counterpart; known: {', '.join(ARCHITECTURES)}")
    return name


def hf_name(path: tuple, architecture: str = GPT2_LM) -> str:
    """Our parameter path, e.g. ('h', 0, 'attn', 'c_attn', 'kernel'), as HF's key."""
    *modules, leaf = (str(part) for part in path)
    # Our GPT2LMHeadModel *is* the body that HF nests under `transformer`.
    prefix = ["transformer"] if architecture == GPT2_LM else []
    return ".".join([*prefix, *modules, _LEAF_NAMES[leaf]])


def is_transposed(path: tuple, architecture: str = GPT2_LM) -> bool:
    """True where HF stores the weight as nn.Linear (out, in) rather than our (in, out)."""
    if str(path[-1]) != "kernel":
        return False
    if architecture == BERT_CLASSIFIER:
        return True
    return str(path[0]) == "score"  # the GPT-2 body is Conv1D, already (in, out)


def flatten_params(params: dict, path: tuple = ()):
    """(path, leaf) for every leaf of a nested parameter dict."""
    for key, child in params.items():
        if isinstance(child, dict):
            yield from flatten_params(child, (*path, key))
        else:
            yield (*path, key), child


def to_hf_state_dict(params: dict, architecture: str = GPT2_LM) -> dict[str, np.ndarray]:
    """Flat {HF key: float32 array} from our nested parameter dict (nnx.State.to_pure_dict())."""
    flat: dict[str, np.ndarray] = {}
    for path, leaf in flatten_params(params):
        array = np.asarray(leaf, dtype=np.float32)
        flat[hf_name(path, architecture)] = array.T if is_transposed(path, architecture) else array
    return flat


def save_pretrained(directory: str, params: dict, config: transformers.PretrainedConfig,
                    architecture: str | None = None) -> None:
    """Write an HF model directory (config.json + model.safetensors) that
    `AutoModelFor...from_pretrained(directory)` loads. The architecture defaults to the
    config's (`config.architectures[0]`), so `to_gpt2_config` alone means GPT2LMHeadModel."""
    from safetensors.numpy import save_file

    architecture = architecture or (config.architectures or [GPT2_LM])[0]
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    tmp = os.path.join(directory, "model.safetensors.tmp")
    # np.ascontiguousarray: a transposed kernel is a strided view, which safetensors rejects.
    tensors = {key: np.ascontiguousarray(value)
               for key, value in to_hf_state_dict(params, architecture).items()}
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # an ordinary, shareable file, like config.json beside it
    os.replace(tmp, os.path.join(directory, "model.safetensors"))


def save_classifier(directory: str, params: dict, model: ModelConfig, tokenizer, *,
                    num_labels: int, label_names: list[str] | None = None) -> None:
    """A fine-tuned classifier as an HF directory: config (architecture, labels, problem type,
    the tokenizer's special ids), weights and tokenizer, loadable by
    `AutoModelForSequenceClassification` and by `model.init_from`."""
    config = to_classifier_config(
        model, num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        label_names=label_names,
    )
    save_pretrained(directory, params, config)
    tokenizer.save_pretrained(directory)
