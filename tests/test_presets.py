"""Tests of the experiment presets and the per-language corpora. Every preset composes and passes
the job's setting checks, and the job runs what the preset names: the sequence length, the global
batch and the learning-rate schedule of the public recipe it reproduces, on whichever hardware is
picked. Every hub language loads and trains on a local stand-in laid out like its Hub dataset.
The Hub itself is unreachable here: a language whose corpus cannot be reached fails with a
FlaxlmError naming the dataset and config."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (
    CONF_DIR,
    compose,
    documents,
    in_memory_dataset,
    model_config,
    write_hub_stand_in,
)
from omegaconf import OmegaConf

from flaxlm.config import CorpusSource
from flaxlm.data.corpus import load_corpus
from flaxlm.errors import FlaxlmError
from flaxlm.job import check_settings, train
from flaxlm.parallel import row_shards
from flaxlm.training.optimizer import make_schedule
from flaxlm.training.plan import global_batch_size

LANGUAGE_DIR = Path(CONF_DIR) / "language"

LANGUAGES = sorted(p.stem for p in LANGUAGE_DIR.glob("*.yaml"))


def config_of(overrides):
    return OmegaConf.to_object(compose(overrides))


# The options that name a corpus on the Hugging Face Hub, as they compose (most take `source`
# from a base they extend).
HUB_LANGUAGES = [option for option in LANGUAGES
                 if config_of([f"language={option}"]).language.source == CorpusSource.hub]
# The options that mix several languages' corpora (conf/language/mixture.yaml and presets).
MIXTURES = [option for option in LANGUAGES
            if config_of([f"language={option}"]).language.source == CorpusSource.mixture]


# --- the languages --------------------------------------------------------------------------------


@pytest.mark.parametrize("option", LANGUAGES)
def test_every_shipped_language_composes_to_an_offline_corpus_or_a_hub_corpus(option):
    language = config_of([f"language={option}"]).language
    assert language.source in set(CorpusSource)
    assert language.name == option


def test_the_offline_languages_need_no_network():
    assert config_of(["language=en-builtin"]).language.source == CorpusSource.builtin
    assert config_of(["language=files"]).language.source == CorpusSource.files
    assert HUB_LANGUAGES and set(LANGUAGES) - set(HUB_LANGUAGES) - set(MIXTURES) == {
        "en-builtin", "files"}


def test_a_mixture_preset_mixes_hub_languages_by_temperature():
    nordic = config_of(["language=nordic"])
    assert MIXTURES == ["mixture", "nordic"]
    assert list(nordic.mixture.sources) == ["is", "no", "da", "sv"]
    assert set(nordic.mixture.sources) <= set(HUB_LANGUAGES)
    assert (nordic.mixture.temperature, nordic.mixture.weights) == (0.3, None)
    assert config_of(["language=is"]).mixture is None


@pytest.mark.parametrize("option", HUB_LANGUAGES)
def test_every_hub_language_is_a_hub_repo_whose_terms_the_run_config_records(option):
    """The run's config.yaml is where a user finds the corpus's terms: no hub language without."""
    language = config_of([f"language={option}"]).language
    assert re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", language.hub_path)
    assert language.licence and language.licence.strip() == language.licence
    assert re.search(r"[A-Z]{2,}", language.licence)  # a licence's name (ODC-By, CC-BY-SA, ...)


@pytest.mark.parametrize("option", HUB_LANGUAGES)
def test_every_hub_language_loads_a_local_stand_in_laid_out_like_its_corpus(option, tmp_path):
    hub_config = config_of([f"language={option}"]).language.hub_config
    train_docs, test_docs = documents(40, seed=1), documents(5, seed=2)
    root = write_hub_stand_in(tmp_path / "hub", hub_config, train_docs, test_docs)

    # Only the location changes: the config name, split and text column are the YAML's own.
    language = config_of([f"language={option}", f"language.hub_path={root}"]).language
    splits = load_corpus(language)
    assert splits.train.column_names == ["text"] == splits.validation.column_names
    assert list(splits.validation["text"]) == train_docs[:2]  # the FIRST 5% (ceil of 2.0)
    assert list(splits.train["text"]) == train_docs[2:]


def test_a_hub_language_also_loads_a_single_config_repo_with_hub_config_null(tmp_path):
    docs = documents(20)
    (tmp_path / "data").mkdir()
    for shard, part in enumerate((docs[:10], docs[10:])):
        pq.write_table(
            pa.table({"text": part}), tmp_path / "data" / f"train-{shard:05d}-of-00002.parquet"
        )
    language = config_of(
        ["language=is", f"language.hub_path={tmp_path}", "language.hub_config=null"]
    ).language
    splits = load_corpus(language)
    assert list(splits.validation["text"]) + list(splits.train["text"]) == docs


@pytest.mark.parametrize("option", HUB_LANGUAGES)
def test_an_unreachable_corpus_fails_naming_the_dataset_and_config(option):
    language = config_of([f"language={option}"]).language
    hub_path, hub_config = language.hub_path, language.hub_config
    with pytest.raises(FlaxlmError) as info:
        load_corpus(language)
    message = str(info.value)
    assert f"language.hub_path={hub_path!r}" in message
    assert f"language.hub_config={hub_config!r}" in message
    assert "network" in message and "HF_TOKEN" in message


# --- the presets ----------------------------------------------------------------------------------

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
# What a preset leaves to the user: minilm-mrpc-offline fine-tunes on pair files you give.
USER_INPUT = {
    "minilm-mrpc-offline": ["task.files=[pairs/train.tsv]",
                            "task.eval_files=[pairs/validation.tsv]"],
}


def as_run(overrides, num_devices):
    """A composed config as the job sees it before reading data: the typed config, the sequence
    length its setting checks return, and the rows per optimizer step on `num_devices`."""
    config = config_of(overrides)
    return config, check_settings(config, num_devices), global_batch_size(config, num_devices)


def learning_rates(config, total_steps, steps):
    schedule = make_schedule(config.optimizer, total_steps)
    return [float(schedule(step)) for step in steps]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_preset_composes_and_passes_the_jobs_setting_checks(experiment):
    config, seq_len, batch = as_run([f"experiment={experiment}", *USER_INPUT.get(experiment, [])],
                                    num_devices=8)
    assert 2 <= seq_len <= config.model.max_positions
    # Rows split over the row shards (data × fsdp × expert); a context or tensor axis's devices
    # share theirs.
    assert batch == (config.hardware.per_device_batch_size * row_shards(config.hardware.mesh, 8)
                     * config.trainer.grad_accum_steps)


def test_a_preset_that_needs_your_files_says_so_before_reading_anything():
    with pytest.raises(FlaxlmError, match=r"task\.files"):
        as_run(["experiment=minilm-mrpc-offline"], num_devices=8)


def assert_notebook_recipe(overrides):
    """The Flax/TPU pre-training notebook's run, as the job will do it on its 8 TPU cores, except
    the document caps: distilgpt2 from scratch with a fresh BPE of the model's vocabulary, blocks
    of 512, 16 per core, AdamW 3e-4 decayed linearly to 0 without warmup over 10 epochs."""
    config, seq_len, batch = as_run(overrides, num_devices=8)
    assert (config.language.name, config.language.validation_fraction) == ("is", 0.05)
    model = config.model
    assert (model.name, model.num_layers, model.hidden_size, model.num_heads) == (
        "distilgpt2", 6, 768, 12)
    assert (model.vocab_size, model.init_from) == (50257, None)
    tokenizer = config.tokenizer
    assert tokenizer.path is None and tokenizer.vocab_size is None  # trained to model.vocab_size
    assert tokenizer.min_frequency == 2
    assert tokenizer.special_tokens == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    assert (seq_len, batch) == (512, 128)
    assert (config.trainer.num_epochs, config.trainer.max_steps, config.seed) == (10, None, 0)
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.b1, optimizer.b2, optimizer.eps) == ("adamw", 0.9, 0.98, 1e-8)
    assert optimizer.weight_decay == 0.01
    assert learning_rates(config, 1000, [0, 500, 1000]) == pytest.approx([3e-4, 1.5e-4, 0.0])


def test_oscar_is_distilgpt2_is_the_notebooks_recipe_on_its_document_caps():
    config = config_of(["experiment=oscar-is-distilgpt2"])
    assert (config.language.max_train_docs, config.language.max_eval_docs) == (20000, 2000)
    assert_notebook_recipe(["experiment=oscar-is-distilgpt2", "hardware=tpu-v3-8"])


def test_oscar_is_distilgpt2_full_is_the_same_without_the_caps():
    full = compose(["experiment=oscar-is-distilgpt2-full"])
    assert_notebook_recipe(["experiment=oscar-is-distilgpt2-full", "hardware=tpu-v3-8"])
    assert (full.language.max_train_docs, full.language.max_eval_docs) == (None, None)
    capped = OmegaConf.to_container(compose(["experiment=oscar-is-distilgpt2"]), resolve=True)
    capped["language"].update(max_train_docs=None, max_eval_docs=None)
    assert OmegaConf.to_container(full, resolve=True) == capped


def test_distilgpt2_en_builtin_is_the_notebooks_recipe_on_the_offline_corpus():
    """Everything but the corpus (and the caps that belong to the corpus) is the same run."""
    builtin = OmegaConf.to_container(compose(["experiment=distilgpt2-en-builtin"]), resolve=True)
    notebook = OmegaConf.to_container(compose(["experiment=oscar-is-distilgpt2"]), resolve=True)
    assert builtin.pop("language")["source"] == "builtin"
    notebook.pop("language")
    assert builtin == notebook


def test_gpt2_no_is_the_reference_flax_clm_scripts_norwegian_run():
    config, seq_len, batch = as_run(["experiment=gpt2-no", "hardware=tpu-v3-8"], num_devices=8)
    assert (config.language.name, config.language.hub_config) == ("no", "nob_Latn")
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_heads, model.vocab_size) == (
        12, 768, 12, 50257)
    assert (seq_len, batch) == (512, 512)
    assert config.trainer.num_epochs == 20
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.b2, optimizer.weight_decay) == ("adamw", 0.98, 0.01)
    # warmup from 0 to 5e-3 over 1000 steps, then linear to 0
    rates = learning_rates(config, 11000, [0, 500, 1000, 6000, 11000])
    assert rates == pytest.approx([0.0, 2.5e-3, 5e-3, 2.5e-3, 0.0])


def test_quickstart_preset_is_exactly_the_default_run():
    named = OmegaConf.to_container(compose(["experiment=quickstart"]), resolve=True)
    assert named == OmegaConf.to_container(compose(), resolve=True)
    config, seq_len, _ = as_run(["experiment=quickstart"], num_devices=2)
    assert (config.language.source, config.hardware.platform) == (CorpusSource.builtin, "cpu")
    assert seq_len == config.model.max_positions  # blocks as long as the model's context


@pytest.mark.parametrize(
    ("experiment", "batch"), [("oscar-is-distilgpt2", 16), ("gpt2-no", 64)]
)
@pytest.mark.parametrize("hardware", ["cpu", "gpu", "tpu"])
def test_a_presets_batch_holds_on_any_hardware(experiment, batch, hardware):
    # experiment comes after the hardware group in train.yaml's defaults list: its values win.
    for overrides in ([f"hardware={hardware}", f"experiment={experiment}"],
                      [f"experiment={experiment}", f"hardware={hardware}"]):
        config, _, rows = as_run(overrides, num_devices=4)
        assert (config.hardware.name, rows) == (hardware, batch * 4)


SHRUNK = [  # after the experiment, so they win: the preset's recipe at a size that runs in seconds
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",  # llama's (a divisor of the 4 heads); gpt2 has none
    "model.mlp_size=256",  # gpt2's own 4 × width; llama-1b's 8192 would dominate the run
    "model.max_positions=64",
    "model.vocab_size=512",
    "task.max_seq_length=64",
    "hardware=cpu-8",
    "hardware.per_device_batch_size=2",
    "optimizer.warmup_steps=0",
    # The schedule is compiled into the train step: with one rate, the presets that build the
    # same shrunk gpt2 (distilgpt2, gpt2, gpt2-tiny) share one compiled step.
    "optimizer.lr=3e-4",
    "trainer.max_steps=3",
    "logger=none",
]
CLM_EXPERIMENTS = [e for e in EXPERIMENTS if compose([f"experiment={e}"]).task.name == "clm"]
GLUE_EXPERIMENTS = [e for e in EXPERIMENTS if e.startswith("glue-")]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", CLM_EXPERIMENTS)
def test_every_preset_trains_a_few_steps_on_local_stand_in_data(experiment, tmp_path):
    """Each preset end to end, shrunk; a hub corpus is replaced by a local copy laid out like it
    (same config name), so the preset's own language settings are the ones exercised."""
    language = config_of([f"experiment={experiment}"]).language
    overrides = [f"experiment={experiment}", *SHRUNK]
    if language.source == CorpusSource.hub:
        root = write_hub_stand_in(
            tmp_path / "hub", language.hub_config, documents(300), documents(10, seed=3)
        )
        overrides.append(f"language.hub_path={root}")
        if (language.max_eval_docs or 0) >= 300:  # smollm-135m-16k's 2000: all of the stand-in
            overrides.append("language.max_eval_docs=10")
    else:  # the builtin corpus: a few of its long documents are blocks enough
        overrides += ["language.max_train_docs=60", "language.max_eval_docs=6"]
    if compose([f"experiment={experiment}"]).model.init_from:  # a Hub checkpoint: offline here
        overrides.append("model.init_from=null")
    run_dir = tmp_path / "run"
    loss = train(compose(overrides, run_dir=run_dir))
    assert math.isfinite(loss) and loss > 0
    assert os.path.exists(run_dir / "model" / "model.safetensors")
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert (saved.language.hub_config, saved.task.max_seq_length) == (language.hub_config, 64)


# --- the fine-tuning presets --------------------------------------------------------------------

# GLUE config -> (text columns, eval split, label kind), as nyu-mll/glue lays them out.
GLUE = {
    "cola": (["sentence"], "validation", 2),
    "sst2": (["sentence"], "validation", 2),
    "mrpc": (["sentence1", "sentence2"], "validation", 2),
    "qqp": (["question1", "question2"], "validation", 2),
    "stsb": (["sentence1", "sentence2"], "validation", "float"),
    "mnli": (["premise", "hypothesis"], "validation_matched", 3),
    "qnli": (["question", "sentence"], "validation", 2),
    "rte": (["sentence1", "sentence2"], "validation", 2),
    "wnli": (["sentence1", "sentence2"], "validation", 2),
}


def test_the_glue_presets_cover_every_glue_task():
    assert sorted(GLUE_EXPERIMENTS) == sorted(f"glue-{name}" for name in GLUE)


def test_glue_mrpc_is_the_accelerate_notebooks_recipe():
    """bert-base-cased from the Hub on MRPC's sentence pairs padded to 128 tokens, 8 per core to
    train (64 a step on 8 cores) and 32 to evaluate, lr 2e-5 after 100 warmup steps, 3 epochs."""
    config, seq_len, batch = as_run(["experiment=glue-mrpc"], num_devices=8)
    assert (config.task.name, config.model.init_from) == ("classify", "google-bert/bert-base-cased")
    assert (config.task.hub_path, config.task.hub_config) == ("nyu-mll/glue", "mrpc")
    assert (config.task.text_column, config.task.text_pair_column) == ("sentence1", "sentence2")
    assert config.task.metrics == ["accuracy", "f1"]
    assert (seq_len, batch, config.hardware.per_device_eval_batch_size) == (128, 64, 32)
    assert (config.trainer.num_epochs, config.seed) == (3, 42)
    rates = learning_rates(config, 1100, [0, 50, 100, 600, 1100])
    assert rates == pytest.approx([0.0, 1e-5, 2e-5, 1e-5, 0.0])


def write_glue_stand_in(root: Path, name: str) -> Path:
    """A local directory laid out like nyu-mll/glue's `name` config (parquet + README)."""
    columns, eval_split, labels = GLUE[name]
    rng = random.Random(0)
    words = "cat dog sat on the mat ran far away home big small red blue".split()
    if labels == "float":
        label_feature = datasets.Value("float32")
    else:
        label_feature = datasets.ClassLabel(names=[f"class{i}" for i in range(labels)])
    features = datasets.Features(
        {**{c: datasets.Value("string") for c in columns}, "label": label_feature,
         "idx": datasets.Value("int32")}
    )
    (root / name).mkdir(parents=True)
    splits = {"train": 48, eval_split: 13}
    for split, rows in splits.items():
        table = {c: [" ".join(rng.choices(words, k=6)) for _ in range(rows)] for c in columns}
        table["label"] = [rng.uniform(0, 5) if labels == "float" else rng.randrange(labels)
                          for _ in range(rows)]
        table["idx"] = list(range(rows))
        in_memory_dataset(table, features=features).to_parquet(
            str(root / name / f"{split}-00000-of-00001.parquet"))
    data_files = "".join(f"  - split: {split}\n    path: {name}/{split}-*\n" for split in splits)
    (root / "README.md").write_text(f"---\nconfigs:\n- config_name: {name}\n  data_files:\n"
                                    f"{data_files}---\n")
    return root


@pytest.fixture(scope="module")
def tiny_bert_checkpoint(tmp_path_factory):
    """A tiny random BERT written as an HF directory (config, safetensors, WordPiece
    tokenizer): what model.init_from reads in place of bert-base-cased from the Hub."""
    import transformers
    from flax import nnx

    from flaxlm.export import export_hf
    from flaxlm.models import hf
    from flaxlm.models.bert import BertForSequenceClassification
    from flaxlm.models.layers import TransformerSpec

    directory = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
             *"cat dog sat on the mat ran far away home big small red blue".split()]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt"))
    bert = model_config("bert", name="tiny-bert", vocab_size=len(vocab), max_positions=64,
                        hidden_size=32, num_layers=1, num_heads=2, mlp_size=64)
    model = BertForSequenceClassification(TransformerSpec(bert), 2, nnx.Rngs(0))
    hf_config = hf.to_classifier_config(bert, num_labels=2,
                                        pad_token_id=tokenizer.pad_token_id)
    # An export replaces only an empty folder or an earlier export: vocab.txt is here already.
    return export_hf(str(directory / "model"), nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                     bert, tokenizer, hf_config=hf_config, generation=None)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", GLUE_EXPERIMENTS)
def test_every_glue_preset_fine_tunes_a_few_steps_on_a_local_stand_in(
        experiment, tiny_bert_checkpoint, tmp_path):
    """Each GLUE preset's own columns, splits, label kind and metrics, end to end; the Hub
    dataset is a local copy laid out like it, bert-base-cased a tiny random BERT."""
    name = experiment.removeprefix("glue-")
    root = write_glue_stand_in(tmp_path / "glue", name)
    run_dir = tmp_path / "run"
    overrides = [f"experiment={experiment}", f"task.hub_path={root}",
                 f"model.init_from={tiny_bert_checkpoint}", "task.max_seq_length=32",
                 "hardware=cpu-8", "hardware.per_device_batch_size=2",
                 "hardware.per_device_eval_batch_size=2", "optimizer.warmup_steps=0",
                 "trainer.max_steps=3", "logger=none", "trainer.objective=eval/loss"]
    loss = train(compose(overrides, run_dir=run_dir))
    assert math.isfinite(loss)
    preset = config_of([f"experiment={experiment}"]).task
    rows = map(json.loads, open(run_dir / "metrics.jsonl"))
    last_eval = [row for row in rows if "eval/loss" in row][-1]
    assert {f"eval/{m}" for m in preset.metrics} <= set(last_eval)
    assert len(open(run_dir / "predictions.jsonl").readlines()) == 13  # every eval example
