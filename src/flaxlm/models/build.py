"""Which network to build, chosen by `model.family` and the task.

task=clm builds a language model (GPT-2 only: an encoder has no next-token head); task=classify
builds a sequence classifier with the common signature
`model(input_ids_BxL, attention_mask_BxL, token_type_ids_BxL, rngs=None) -> logits_BxC`.
The HF architecture name of each is what `flaxlm.models.hf` maps parameters and configs for.
"""

from __future__ import annotations

from flax import nnx

from flaxlm.config import ModelConfig, ModelFamily
from flaxlm.errors import FlaxlmError
from flaxlm.models.bert import BertForSequenceClassification
from flaxlm.models.gpt2 import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Spec

LM_ARCHITECTURE = "GPT2LMHeadModel"
CLASSIFIER_ARCHITECTURES = {
    ModelFamily.gpt2: "GPT2ForSequenceClassification",
    ModelFamily.bert: "BertForSequenceClassification",
}


def check_lm_family(model: ModelConfig) -> None:
    """task=clm needs a network with a next-token head: GPT-2's family."""
    family = ModelFamily(model.family)
    if family is not ModelFamily.gpt2:
        raise FlaxlmError(
            f"task=clm trains a causal language model, but model={model.name} "
            f"(model.family={family.value}) is an encoder with no next-token head. Use a "
            "gpt2-family model for task=clm (model=gpt2-tiny, distilgpt2 or gpt2), or "
            "task=classify to fine-tune this encoder."
        )


def build_lm(spec: GPT2Spec, rngs: nnx.Rngs) -> GPT2LMHeadModel:
    check_lm_family(spec.model)
    return GPT2LMHeadModel(spec, rngs)


def build_classifier(
    spec: GPT2Spec, num_labels: int, pad_token_id: int, rngs: nnx.Rngs
) -> BertForSequenceClassification | GPT2ForSequenceClassification:
    """A classifier with `num_labels` outputs (1 → regression) for `spec.model.family`."""
    if ModelFamily(spec.model.family) is ModelFamily.bert:
        return BertForSequenceClassification(spec, num_labels, rngs)
    return GPT2ForSequenceClassification(spec, num_labels, pad_token_id, rngs)


def classifier_architecture(family: ModelFamily | str) -> str:
    """The HF class name of the classifier built for `family`."""
    return CLASSIFIER_ARCHITECTURES[ModelFamily(family)]
