"""A model from someone else's weights keeps its tokenizer's conventions (its BOS, if it adds
one) in training samples, generation and export, against transformers on the original
checkpoint; flaxlm's document start stays for the models it trains; what an imported model is
(banner, notices, model card, error messages) is said plainly; sentence pairs get a boundary."""

import json
import os

import numpy as np
import pytest
import tokenizers
import transformers
from conftest import compose, model_config
from numerics import assert_close, tolerance, transformer_depth

from flaxlm.data.tables import text_dataset
from flaxlm.errors import FlaxlmError

PROMPTS = ["The module", "A list is", "def main():"]
# (bos, eos, whether the tokenizer adds BOS): a Llama-2-like tokenizer, and a SmolLM-like one
# (a chat model's tokenizer: it adds nothing, its EOS is not flaxlm's `</s>`).
TOKENIZERS = {"adds-bos": ("<s>", "</s>", True),
              "adds-nothing": ("<|im_start|>", "<|im_end|>", False)}
N_POSITIONS, ROPE_THETA = 64, 5000.0  # unlike model=llama-tiny's 256 and 10000


def make_tokenizer(bos: str, eos: str, adds_bos: bool):
    """A byte-level BPE over the built-in corpus, as Llama-family tokenizers are saved: a
    template from add_bos_token (transformers' own), `$A` / `$A $B` when it adds nothing."""
    from flaxlm.data.corpus import builtin_documents

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(builtin_documents()[:40], tokenizers.trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", bos, eos],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token=eos, unk_token="<unk>",
        add_bos_token=adds_bos, add_eos_token=False)


def write_checkpoint(directory, kind: str) -> str:
    """A tiny random LlamaForCausalLM (PyTorch) and its tokenizer, as a Hub checkpoint is laid
    out: tokenizer_config.json states add_bos_token, which transformers reads on loading."""
    torch = pytest.importorskip("torch")
    tokenizer = make_tokenizer(*TOKENIZERS[kind])
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "add_bos_token": TOKENIZERS[kind][2], "add_eos_token": False}, f)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=N_POSITIONS,
        rope_theta=ROPE_THETA, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def torch_greedy(checkpoint_dir, prompts, new_tokens):
    """transformers' greedy completions on the original checkpoint, from `tokenizer(prompt)`."""
    torch = pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir).eval()
    completions = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=tokenizer.eos_token_id)
        completions.append(tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:],
                                            skip_special_tokens=True))
    return completions


def torch_eval_loss(checkpoint_dir, texts, block):
    """Mean next-token loss of the original checkpoint over `texts` packed as the checkpoint's
    tokenizer encodes each (its BOS, if it adds one), EOS after each, cut into blocks; the
    number of targets it is a mean of, and the vocabulary's size."""
    torch = pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir).eval()
    stream = [i for text in texts for i in [*tokenizer(text)["input_ids"],
                                            tokenizer.eos_token_id]]
    blocks = torch.tensor(stream[: len(stream) // block * block]).reshape(-1, block)
    with torch.no_grad():
        logits = model(blocks).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             blocks[:, 1:].reshape(-1))
    return float(loss), blocks[:, 1:].numel(), logits.shape[-1]


RUN = ["model=llama-tiny", "logger=none", "hardware=cpu-8", "hardware.per_device_batch_size=2",
       "trainer.max_steps=1", "optimizer.warmup_steps=1", "language.max_train_docs=60",
       "samples.prompts=[]"]


@pytest.fixture(scope="module")
def imported_run(checkpoint, tmp_path_factory):
    """Continued pre-training from `checkpoint` whose one step has lr 0 (warmup): the run's
    weights stay the original's. Its directory and what it printed."""
    import contextlib
    import io

    from flaxlm.job import train
    from flaxlm.tasks import clm

    run_dir = tmp_path_factory.mktemp("run") / "run"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        patch.setattr(clm, "LONG_BLOCK", N_POSITIONS // 2, raising=False)
        train(compose([*RUN, f"model.init_from={checkpoint}"], run_dir=run_dir))
    return run_dir, printed.getvalue()


@pytest.mark.slow
@pytest.mark.torch
def test_an_imported_llama_keeps_its_tokenizers_conventions(checkpoint, imported_run):
    """The first evaluation packs documents as the tokenizer encodes them (its BOS in front,
    EOS after); flaxlm-generate on the run gives transformers' greedy completions on the
    original checkpoint; the exported tokenizer encodes a prompt as the original does."""
    from flaxlm.cli import generate as generate_cli
    from flaxlm.data.corpus import load_corpus

    run_dir, _ = imported_run
    with open(run_dir / "metrics.jsonl") as f:
        first_eval = next(r for r in map(json.loads, f) if "eval/loss" in r)
    validation = load_corpus(compose(RUN).language).validation["text"]
    assert first_eval["step"] == 0
    expected, targets, vocab = torch_eval_loss(checkpoint, validation, N_POSITIONS)
    # Against transformers' (float32 both): a mean of `targets` losses, a sum as long as that.
    # Each loss carries its logits' error (2 layers; rotary angles, position × frequency, that
    # bring a frequency's rounding back × the position: 6·eps·√(vocab·depth)·N_POSITIONS, about
    # 4e-3), of either sign from one target to the next: in the mean, √targets (230) times
    # smaller, below the sum's own. No absolute floor (a scalar, far from 0): the tolerance,
    # 1.6e-4 of the loss, must tell the tokenizer's BOS from none, 3e-4 apart here.
    assert_close(first_eval["eval/loss"], expected, terms=targets, scale=0.0)
    logits = tolerance(terms=vocab, depth=transformer_depth(2), amplification=N_POSITIONS)
    assert logits / np.sqrt(targets) < tolerance(terms=targets)

    ours = generate_cli.run([str(run_dir), *(f"--prompt={p}" for p in PROMPTS), "--greedy",
                             "--max-new-tokens", "8"])
    assert ours == torch_greedy(checkpoint, PROMPTS, 8)
    assert len(set(ours)) > 1  # the prompts lead to different paths

    original = transformers.AutoTokenizer.from_pretrained(checkpoint)
    exported = transformers.AutoTokenizer.from_pretrained(run_dir / "model")
    assert [exported(p)["input_ids"] for p in PROMPTS] == [original(p)["input_ids"]
                                                             for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.torch
def test_an_imported_model_is_described_as_the_checkpoints(checkpoint, imported_run):
    """The banner names the checkpoint, a line lists the settings its config.json replaced,
    a long default block length is announced, and the model card gives the tokenizer's EOS
    and the trained model's shape."""
    run_dir, out = imported_run
    assert (f"flaxlm: model.init_from={checkpoint}: family and shape from its config.json, in "
            "place of model=llama-tiny's: ") in out
    assert f"model.max_positions=256 → {N_POSITIONS}" in out and "model.num_kv_heads=4 → 2" in out
    assert f"flaxlm: {checkpoint} (" in out  # the banner names the checkpoint, not the preset
    assert f"blocks of {N_POSITIONS} tokens, model.max_positions (from model.init_from's" in out

    card = (run_dir / "model" / "README.md").read_text()
    eos = transformers.AutoTokenizer.from_pretrained(checkpoint).eos_token
    assert f"# {checkpoint} on en-builtin" in card
    assert f"the EOS token `{eos}` after each" in card
    assert f"max_positions: {N_POSITIONS}\n" in card and f"rope_theta: {ROPE_THETA}\n" in card
    assert "max_positions: 256" not in card


@pytest.mark.slow
@pytest.mark.torch
def test_generation_and_export_follow_the_convention(checkpoint, tmp_path):
    """The imported model generates what transformers generates on the original checkpoint
    when it keeps the tokenizer's conventions, and its export encodes prompts the same way;
    flaxlm's convention (tokenizer.convention=flaxlm) reads a prompt after EOS instead."""
    from flax import nnx

    from flaxlm.export import export_hf
    from flaxlm.generate import GenerationSettings, encode_prompts, generate
    from flaxlm.models import pretrained
    from flaxlm.models.build import build_lm
    from flaxlm.models.layers import TransformerSpec

    config = pretrained.pretrained_model_config(checkpoint, model_config(name="x"))
    model = build_lm(TransformerSpec(config), nnx.Rngs(0))
    pretrained.load_pretrained_weights(model, checkpoint)
    tokenizer = pretrained.load_pretrained_tokenizer(checkpoint)
    settings = GenerationSettings(max_new_tokens=8, greedy=True)
    assert generate(model, tokenizer, PROMPTS, settings,
                    own_conventions=True) == torch_greedy(checkpoint, PROMPTS, 8)

    ids = encode_prompts(tokenizer, PROMPTS, own_conventions=True)
    assert ids == [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert encode_prompts(tokenizer, PROMPTS) == [
        [tokenizer.eos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]]
        for p in PROMPTS]
    empty = encode_prompts(tokenizer, [""], own_conventions=True)
    assert empty == [[tokenizer.bos_token_id]]  # transformers' generate starts from BOS too

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = export_hf(str(tmp_path / "hf"), params, config, tokenizer, own_conventions=True)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert [exported(p)["input_ids"] for p in PROMPTS] == ids


def test_the_convention_setting():
    from flaxlm.config import TokenConvention
    from flaxlm.data.tokenizer import keeps_own_conventions

    assert keeps_own_conventions(TokenConvention.auto, "some/checkpoint")
    assert not keeps_own_conventions("auto", None)
    assert not keeps_own_conventions("flaxlm", "some/checkpoint")
    assert keeps_own_conventions("tokenizer", None)


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_packing_puts_the_tokenizers_bos_in_front_of_each_document(kind, tmp_path):

    from flaxlm.data.packing import tokenize_and_pack
    from flaxlm.data.tokenizer import document_prefix, prompt_tokenizer

    bos, eos, adds_bos = TOKENIZERS[kind]
    tokenizer = make_tokenizer(bos, eos, adds_bos)
    texts = ["the cat sat on the mat", "a dog", "def f(): return 1"] * 4
    prefix = document_prefix(tokenizer)
    assert prefix == ((tokenizer.bos_token_id,) if adds_bos else ())
    stream = [i for text in texts for i in [*tokenizer(text)["input_ids"],
                                            tokenizer.eos_token_id]]
    blocks = tokenize_and_pack(text_dataset(texts), tokenizer, 8,
                               str(tmp_path), prefix=prefix)
    np.testing.assert_array_equal(blocks, np.reshape(stream[: len(stream) // 8 * 8], (-1, 8)))
    # flaxlm's document start is its EOS after the previous document: no prefix.
    assert document_prefix(prompt_tokenizer(tokenizer, own_conventions=False)) == ()


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_pairs_get_a_separator_that_the_export_keeps(kind, tmp_path):
    """A Llama tokenizer's pair template with nothing between the halves (`$A $B`, or
    `<s> $A $B`) gets EOS after each half, its BOS kept; transformers loads the same template
    from the saved tokenizer."""
    from flaxlm.tasks.classify import with_pair_template

    bos, eos, adds_bos = TOKENIZERS[kind]
    make_tokenizer(bos, eos, adds_bos).save_pretrained(tmp_path / "original")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "original")
    if adds_bos:  # `<s> $A $B`: a BOS in front, none between
        tokenizer.backend_tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1",
            special_tokens=[(bos, tokenizer.bos_token_id)])
    first = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    second = tokenizer("a dog", add_special_tokens=False)["input_ids"]
    paired = with_pair_template(tokenizer)
    lead = [tokenizer.bos_token_id] if adds_bos else []
    eos_id = tokenizer.eos_token_id
    encoding = paired("the cat", "a dog")
    assert encoding["input_ids"] == [*lead, *first, eos_id, *second, eos_id]
    assert paired("the cat")["input_ids"] == [*lead, *first, eos_id]
    paired.save_pretrained(tmp_path / "exported")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert exported("the cat", "a dog")["input_ids"] == encoding["input_ids"]


@pytest.mark.torch
def test_a_checkpoint_whose_config_does_not_fit_its_weights_names_its_config(tmp_path):
    """init_from builds the model from the checkpoint's config.json, so a shape mismatch is
    the checkpoint's own inconsistency: the message names its config.json field, not the
    setting that init_from replaces."""
    from flaxlm.job import train

    checkpoint = write_checkpoint(tmp_path / "ckpt", "adds-bos")
    path = os.path.join(checkpoint, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "num_key_value_heads": 4}, f)
    with pytest.raises(FlaxlmError) as error:
        train(compose(["model=llama-tiny", f"model.init_from={checkpoint}", "logger=none",
                       "hardware=cpu-8", "hardware.per_device_batch_size=2",
                       "trainer.max_steps=1", "language.max_train_docs=60"],
                      run_dir=tmp_path / "run"))
    message = str(error.value)
    assert "k_proj.weight" in message and "num_key_value_heads" in message
    assert "config.json does not describe its weights" in message
    assert "fix that setting" not in message


def test_streaming_packs_the_same_blocks_and_resumes_inside_a_prefixed_document(tmp_path):

    from flaxlm.data.packing import tokenize_and_pack
    from flaxlm.data.streaming import pack_stream
    from flaxlm.data.tokenizer import document_prefix

    tokenizer = make_tokenizer(*TOKENIZERS["adds-bos"])
    texts = ["the cat sat on the mat", "a dog", "def f(): return 1", "x"] * 5
    prefix = document_prefix(tokenizer)
    packed = tokenize_and_pack(text_dataset(texts), tokenizer, 7,
                               str(tmp_path), prefix=prefix)
    streamed = list(pack_stream(texts, tokenizer, 7, prefix=prefix))
    np.testing.assert_array_equal(np.stack([block for block, _, _, _ in streamed]), packed)
    for index, (_, _, document, offset) in enumerate(streamed[:-1]):  # each position resumes
        rest = pack_stream(texts[document:], tokenizer, 7, document, offset, prefix=prefix)
        np.testing.assert_array_equal(next(rest)[0], packed[index + 1])
