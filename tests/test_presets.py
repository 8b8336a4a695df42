"""Tests of the experiment presets and the per-language corpora: each preset is the recipe it names
(the seed notebook, its uncapped variant, the reference Flax CLM script's Norwegian GPT-2, the
quickstart), every hub language names its corpus, config and licence, and loads and trains on a
local stand-in laid out like the Hub dataset. The Hub itself is unreachable here: a language whose
corpus cannot be reached fails with a FlaxlmError naming the dataset and config."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose
from flaxlm.config import CorpusSource, Schedule
from flaxlm.data.corpus import load_corpus
from flaxlm.errors import FlaxlmError
from flaxlm.train import train

LANGUAGE_DIR = Path(CONF_DIR) / "language"

FINEWEB_2 = {
    "is": "isl_Latn",
    "no": "nob_Latn",
    "da": "dan_Latn",
    "sv": "swe_Latn",
    "de": "deu_Latn",
    "fr": "fra_Latn",
    "es": "spa_Latn",
    "fi": "fin_Latn",
}
# language option -> (hub_path, hub_config, a fragment of the licence)
HUB_CORPORA = {
    **{code: ("HuggingFaceFW/fineweb-2", cfg, "ODC-By 1.0") for code, cfg in FINEWEB_2.items()},
    "en": ("HuggingFaceFW/fineweb", "sample-10BT", "ODC-By 1.0"),
    "is-wikipedia": ("wikimedia/wikipedia", "20231101.is", "CC-BY-SA-3.0"),
}
HUB_LANGUAGES = sorted(HUB_CORPORA)


def config_of(overrides):
    return OmegaConf.to_object(compose(overrides))


@pytest.fixture(autouse=True)
def isolated_hub_caches(tmp_path, monkeypatch):
    """`datasets` prepares local files in its cache: keep that out of the user's ~/.cache, and keep
    the Hub offline (conftest sets HF_HUB_OFFLINE before `datasets` is imported)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# --- local stand-ins for the Hub datasets ---------------------------------------------------------

_WORDS = (
    "og í að er sem á það var til með fyrir en um af hann hún við þetta eru ekki sér eftir "
    "landið fólk veður fjall sjór hús bók saga dagur nótt vatn eldur jökull fjörður bátur "
    "skrifa lesa tala ganga sigla búa vinna hugsa segja sjá koma fara gera vita eiga "
    "stór lítill gamall nýr góður fallegur kaldur heitur langur stuttur"
).split()


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents of pseudo-Icelandic: a few sentences of 6-14 words each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
            for _ in range(rng.randint(2, 5))
        ]
        docs.append(" ".join(sentences))
    return docs


def write_hub_stand_in(
    root: Path, config: str, train_docs: list[str], test_docs: list[str]
) -> Path:
    """A directory laid out like a Hub dataset repo: a README whose YAML declares `config` with a
    train and a test split, parquet shards under data/<config>/<split>/, and the extra columns
    FineWeb-2 and Wikipedia carry next to `text`."""
    for split, docs in (("train", train_docs), ("test", test_docs)):
        folder = root / "data" / config / split
        folder.mkdir(parents=True)
        half = (len(docs) + 1) // 2
        for shard, part in enumerate((docs[:half], docs[half:])):
            table = pa.table(
                {
                    "id": [f"{split}-{shard}-{i}" for i in range(len(part))],
                    "url": [f"https://example.is/{split}/{shard}/{i}" for i in range(len(part))],
                    "text": part,
                    "language_score": [0.99] * len(part),
                }
            )
            pq.write_table(table, folder / f"{shard:03d}_00000.parquet")
    (root / "README.md").write_text(
        "---\nlicense: odc-by\nconfigs:\n"
        f"- config_name: {config}\n  data_files:\n"
        f"  - split: train\n    path: data/{config}/train/*\n"
        f"  - split: test\n    path: data/{config}/test/*\n---\n# A local stand-in\n",
        encoding="utf-8",
    )
    return root


# --- the languages --------------------------------------------------------------------------------


def test_the_shipped_languages_are_the_hub_corpora_plus_the_offline_ones():
    shipped = {p.stem for p in LANGUAGE_DIR.glob("*.yaml")}
    assert shipped == {*HUB_CORPORA, "en-builtin", "files"}
    assert config_of(["language=en-builtin"]).language.source == CorpusSource.builtin
    assert config_of(["language=files"]).language.source == CorpusSource.files


@pytest.mark.parametrize("option", HUB_LANGUAGES)
def test_every_hub_language_names_its_corpus_config_split_column_and_licence(option):
    language = config_of([f"language={option}"]).language
    hub_path, hub_config, licence = HUB_CORPORA[option]
    assert language.name == option
    assert language.source == CorpusSource.hub
    assert re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", language.hub_path)
    assert (language.hub_path, language.hub_config) == (hub_path, hub_config)
    assert (language.hub_split, language.text_column) == ("train", "text")
    assert language.hub_revision is None
    assert licence in language.licence
    assert language.validation_fraction == 0.05
    assert (language.max_train_docs, language.max_eval_docs) == (None, None)
    # The comment says how big it is and that it needs the network; the large ones warn that,
    # without streaming, the whole config is downloaded.
    comment = (LANGUAGE_DIR / f"{option}.yaml").read_text(encoding="utf-8").lower()
    assert "network" in comment
    assert re.search(r"\b(mb|gb)\b", comment)
    if hub_path.startswith("HuggingFaceFW/"):
        assert "streaming" in comment and "whole" in comment


@pytest.mark.parametrize("option", HUB_LANGUAGES)
def test_every_hub_language_loads_a_local_stand_in_laid_out_like_its_corpus(option, tmp_path):
    _, hub_config, _ = HUB_CORPORA[option]
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
    hub_path, hub_config, _ = HUB_CORPORA[option]
    language = config_of([f"language={option}"]).language
    with pytest.raises(FlaxlmError) as info:
        load_corpus(language)
    message = str(info.value)
    assert f"language.hub_path={hub_path!r}" in message
    assert f"language.hub_config={hub_config!r}" in message
    assert "network" in message and "HF_TOKEN" in message


# --- the presets ----------------------------------------------------------------------------------


def assert_seed_notebook_recipe(config):
    """Everything of the seed notebook except the document caps."""
    assert (config.language.name, config.language.hub_path, config.language.hub_config) == (
        "is", "HuggingFaceFW/fineweb-2", "isl_Latn"
    )
    assert config.language.validation_fraction == 0.05
    model = config.model
    assert model.name == "distilgpt2"
    assert (model.n_layer, model.n_embd, model.n_head) == (6, 768, 12)
    assert (model.vocab_size, model.n_positions) == (50257, 1024)
    tokenizer = config.tokenizer
    assert tokenizer.path is None and tokenizer.vocab_size is None  # a fresh BPE of 50257
    assert tokenizer.min_frequency == 2
    assert tokenizer.special_tokens == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    assert config.task.max_seq_length == 512
    assert config.hardware.per_device_batch_size == 16
    assert config.trainer.num_epochs == 10 and config.trainer.max_steps is None
    optimizer = config.optimizer
    assert optimizer.name == "adamw"
    assert (optimizer.lr, optimizer.b1, optimizer.b2, optimizer.eps) == (3e-4, 0.9, 0.98, 1e-8)
    assert optimizer.weight_decay == 0.01
    assert (optimizer.schedule, optimizer.warmup_steps, optimizer.end_lr) == (
        Schedule.linear, 0, 0.0
    )
    assert config.seed == 0


def test_oscar_is_distilgpt2_is_the_seed_notebook():
    config = config_of(["experiment=oscar-is-distilgpt2"])
    assert_seed_notebook_recipe(config)
    assert (config.language.max_train_docs, config.language.max_eval_docs) == (20000, 2000)
    header = (Path(CONF_DIR) / "experiment" / "oscar-is-distilgpt2.yaml").read_text("utf-8")
    for figure in ("5.66", "305.6", "3.67", "39.1", "2.42", "v2-8", "v3-8"):
        assert figure in header


def test_oscar_is_distilgpt2_full_is_the_same_without_the_caps():
    full = compose(["experiment=oscar-is-distilgpt2-full"])
    assert_seed_notebook_recipe(OmegaConf.to_object(full))
    assert (full.language.max_train_docs, full.language.max_eval_docs) == (None, None)
    capped = OmegaConf.to_container(compose(["experiment=oscar-is-distilgpt2"]), resolve=True)
    capped["language"].update(max_train_docs=None, max_eval_docs=None)
    assert OmegaConf.to_container(full, resolve=True) == capped


def test_gpt2_no_is_the_reference_flax_clm_scripts_norwegian_run():
    config = config_of(["experiment=gpt2-no"])
    assert (config.language.name, config.language.hub_path, config.language.hub_config) == (
        "no", "HuggingFaceFW/fineweb-2", "nob_Latn"
    )
    model = config.model
    assert model.name == "gpt2"
    assert (model.n_layer, model.n_embd, model.n_head, model.vocab_size) == (12, 768, 12, 50257)
    assert config.task.max_seq_length == 512
    assert config.hardware.per_device_batch_size == 64
    assert config.trainer.num_epochs == 20
    optimizer = config.optimizer
    assert (optimizer.lr, optimizer.warmup_steps) == (5e-3, 1000)
    assert optimizer.schedule == Schedule.linear
    assert (optimizer.b1, optimizer.b2, optimizer.weight_decay) == (0.9, 0.98, 0.01)
    header = (Path(CONF_DIR) / "experiment" / "gpt2-no.yaml").read_text("utf-8")
    assert "3.24" in header and "25.7" in header


def test_quickstart_preset_is_exactly_the_default_run():
    named = OmegaConf.to_container(compose(["experiment=quickstart"]), resolve=True)
    assert named == OmegaConf.to_container(compose(), resolve=True)
    config = config_of(["experiment=quickstart"])
    assert (config.language.name, config.model.name, config.hardware.name) == (
        "en-builtin", "gpt2-tiny", "cpu"
    )
    assert (config.optimizer.name, config.trainer.num_epochs) == ("adamw", 1)
    assert config.task.max_seq_length is None


@pytest.mark.parametrize(
    ("experiment", "batch"), [("oscar-is-distilgpt2", 16), ("gpt2-no", 64)]
)
@pytest.mark.parametrize("hardware", ["cpu", "gpu", "tpu"])
def test_a_presets_batch_holds_on_any_hardware(experiment, batch, hardware):
    # experiment comes after the hardware group in train.yaml's defaults list: its values win.
    for overrides in ([f"hardware={hardware}", f"experiment={experiment}"],
                      [f"experiment={experiment}", f"hardware={hardware}"]):
        config = config_of(overrides)
        assert (config.hardware.name, config.hardware.per_device_batch_size) == (hardware, batch)


SHRUNK = [  # after the experiment, so they win: the preset's recipe at a size that runs in seconds
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=4",
    "model.n_positions=64",
    "model.vocab_size=512",
    "task.max_seq_length=64",
    "hardware=cpu-8",
    "hardware.per_device_batch_size=2",
    "optimizer.warmup_steps=0",
    "trainer.max_steps=3",
    "logger=none",
]
EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
CLM_EXPERIMENTS = [e for e in EXPERIMENTS if compose([f"experiment={e}"]).task.name == "clm"]
GLUE_EXPERIMENTS = [e for e in EXPERIMENTS if e.startswith("glue-")]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", CLM_EXPERIMENTS)
def test_every_preset_trains_a_few_steps_on_local_stand_in_data(experiment, tmp_path):
    """Each preset end to end, shrunk; a hub corpus is replaced by a local copy laid out like it
    (same config name), so the preset's own language settings are the ones exercised."""
    language = OmegaConf.to_object(compose([f"experiment={experiment}"])).language
    overrides = [f"experiment={experiment}", *SHRUNK]
    if language.source == CorpusSource.hub:
        root = write_hub_stand_in(
            tmp_path / "hub", language.hub_config, documents(300), documents(10, seed=3)
        )
        overrides.append(f"language.hub_path={root}")
    else:
        overrides.append("language.max_train_docs=60")
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


def test_glue_mrpc_is_the_accelerate_notebook():
    config = config_of(["experiment=glue-mrpc"])
    assert (config.task.name, config.model.name, config.model.init_from) == (
        "classify", "bert-base-cased", "google-bert/bert-base-cased")
    assert (config.task.dataset, config.task.dataset_config) == ("nyu-mll/glue", "mrpc")
    assert (config.task.text_column, config.task.text_pair_column) == ("sentence1", "sentence2")
    assert config.task.max_seq_length == 128 and config.task.metrics == ["accuracy", "f1"]
    assert (config.optimizer.lr, config.optimizer.schedule) == (2e-5, Schedule.linear)
    assert (config.trainer.num_epochs, config.seed) == (3, 42)
    assert (config.hardware.per_device_batch_size,
            config.hardware.per_device_eval_batch_size) == (8, 32)


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
        datasets.Dataset.from_dict(table, features=features).to_parquet(
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

    from flaxlm.config import ModelConfig, ModelFamily
    from flaxlm.models import hf
    from flaxlm.models.bert import BertForSequenceClassification
    from flaxlm.models.gpt2 import GPT2Spec

    directory = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
             *"cat dog sat on the mat ran far away home big small red blue".split()]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt"))
    model_config = ModelConfig(name="tiny-bert", family=ModelFamily.bert, vocab_size=len(vocab),
                               n_positions=64, n_embd=32, n_layer=1, n_head=2, n_inner=64,
                               activation_function="gelu", layer_norm_epsilon=1e-12)
    model = BertForSequenceClassification(GPT2Spec(model_config), 2, nnx.Rngs(0))
    hf.save_classifier(str(directory), nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                       model_config, tokenizer, num_labels=2)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("experiment", GLUE_EXPERIMENTS)
def test_every_glue_preset_fine_tunes_a_few_steps_on_a_local_stand_in(
        experiment, tiny_bert_checkpoint, tmp_path):
    """Each GLUE preset's own columns, splits, label kind and metrics, end to end; the Hub
    dataset is a local copy laid out like it, bert-base-cased a tiny random BERT."""
    name = experiment.removeprefix("glue-")
    root = write_glue_stand_in(tmp_path / "glue", name)
    run_dir = tmp_path / "run"
    overrides = [f"experiment={experiment}", f"task.dataset={root}",
                 f"model.init_from={tiny_bert_checkpoint}", "task.max_seq_length=32",
                 "hardware=cpu-8", "hardware.per_device_batch_size=2",
                 "hardware.per_device_eval_batch_size=2", "optimizer.warmup_steps=0",
                 "trainer.max_steps=3", "logger=none"]
    loss = train(compose(overrides, run_dir=run_dir))
    assert math.isfinite(loss)
    preset = config_of([f"experiment={experiment}"]).task
    last_eval = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "eval/loss" in r][-1]
    assert {f"eval/{m}" for m in preset.metrics} <= set(last_eval)
    assert len(open(run_dir / "predictions.jsonl").readlines()) == 13  # every eval example
