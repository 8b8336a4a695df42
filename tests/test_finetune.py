"""task=classify end to end: data files → fine-tuned classifier → metrics, predictions, export."""

import csv
import json
import os

import numpy as np
import pytest
from conftest import TINY_CLASSIFY, compose, files_overrides, trained_run, write_pairs
from numerics import approx, assert_close, transformer, transformer_depth
from omegaconf import OmegaConf

from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.run_model import load_run_model


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pairs")
    return (write_pairs(directory / "train.tsv", 512, 0),
            write_pairs(directory / "validation.tsv", 99, 1))


@pytest.fixture(scope="module")
def finetuned(pair_files, tmp_path_factory):
    """A classifier fine-tuned for 3 epochs: its run dir (the accuracy test reads it, the
    export test exports it)."""
    return trained_run(tmp_path_factory, "finetuned",
                       [*TINY_CLASSIFY, *files_overrides(pair_files), "trainer.num_epochs=3"])


@pytest.mark.slow
def test_finetuning_raises_accuracy_above_chance(pair_files, finetuned):
    run_dir = finetuned
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] > 0
    assert evals[0]["eval/accuracy"] < 0.7  # an untrained head is near chance
    assert evals[-1]["eval/accuracy"] > 0.85
    assert {"eval/f1", "eval/loss"} <= set(evals[-1])

    predictions = [json.loads(line) for line in open(run_dir / "predictions.jsonl")]
    assert [p["index"] for p in predictions] == list(range(99))  # every example, in order
    labels = [int(row["label"]) for row in csv.DictReader(open(pair_files[1]), delimiter="\t")]
    assert [p["label"] for p in predictions] == labels
    accuracy = np.mean([p["prediction"] == p["label"] for p in predictions])
    assert accuracy == approx(evals[-1]["eval/accuracy"])  # a count / 99, rounded to float32
    assert os.path.exists(run_dir / "model" / "model.safetensors")


def test_classify_without_data_fails_clearly(tmp_path):

    cfg = compose([*TINY_CLASSIFY], run_dir=tmp_path / "run")
    with pytest.raises(FlaxlmError, match="task.files"):
        train(cfg)


def test_label_outside_num_labels_fails_clearly(pair_files, tmp_path):

    cfg = compose([*TINY_CLASSIFY, *files_overrides(pair_files), "task.num_labels=1"],
                  run_dir=tmp_path / "run")
    with pytest.raises(FlaxlmError, match="num_labels"):
        train(cfg)


@pytest.mark.slow
def test_cli_finetunes_gpt2_pretrained_here(pair_files, tmp_path, train_cli):
    """task=clm here, then task=classify from its model/ directory, both through the CLI."""
    clm_dir = tmp_path / "clm"
    tiny_gpt2 = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                 "model.max_positions=32", "model.vocab_size=512", "hardware=cpu-8",
                 "hardware.per_device_batch_size=2", "logger=none"]
    done = train_cli(*tiny_gpt2, "trainer.max_steps=2", f"hydra.run.dir={clm_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "classify"
    done = train_cli(
        "task=classify", "model=gpt2-tiny", f"model.init_from={clm_dir}/model",
        *tiny_gpt2, "task.max_seq_length=24", "task.text_pair_column=sentence2",
        *files_overrides(pair_files), "trainer.max_steps=4", f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "score" in done.stdout  # the fresh head is reported
    assert "eval/accuracy" in open(run_dir / "metrics.jsonl").read()


@pytest.mark.slow
@pytest.mark.torch
def test_a_classify_run_exports_to_transformers_with_our_logits(finetuned, tmp_path):
    """flaxlm-export on a task=classify run → AutoModelForSequenceClassification loads it with
    nothing missing or unused, and its logits are ours; flaxlm-generate refuses it."""
    import torch
    import transformers
    from flax import nnx

    from flaxlm.cli.export import run as export
    from flaxlm.cli.generate import run as generate
    from flaxlm.models.build import build_classifier
    from flaxlm.models.layers import TransformerSpec

    run_dir = finetuned
    out = export([str(run_dir), "--out", str(tmp_path / "hf")])
    torch_model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, output_loading_info=True)
    assert not any(info.values()), info
    card = open(os.path.join(out, "README.md")).read()
    assert "eval accuracy" in card
    # A classifier trains on its examples, not a corpus: neither the run's config (which W&B
    # gets too) nor the model card's title names one.
    assert OmegaConf.load(run_dir / "config.yaml").language is None
    title = next(line for line in card.splitlines() if line.startswith("# "))
    assert " on " not in title, title

    run_model = load_run_model(str(run_dir))
    ours = nnx.eval_shape(lambda: build_classifier(
        TransformerSpec(run_model.model_config), 2, nnx.Rngs(0)))
    state = nnx.state(ours, nnx.Param)
    nnx.replace_by_pure_dict(state, run_model.params)
    nnx.update(ours, state)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["alpha the kilo", "of it"], ["bravo delta", "lima mike papa india"],
                      padding=True, return_tensors="np", return_token_type_ids=True)
    logits = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    torch_model.eval()
    with torch.no_grad():
        expected = torch_model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    config = run_model.model_config  # against transformers' logits, float32 both
    assert_close(np.asarray(logits), expected,
                 **transformer(config.num_layers, 4 * config.hidden_size))

    with pytest.raises(FlaxlmError, match="classifier"):
        generate([str(run_dir), "--prompt", "hello"])


@pytest.mark.slow
def test_clm_continues_pre_training_from_a_runs_exported_model(tmp_path):
    """model.init_from with task=clm: the continued run starts where the first one ended — its
    eval before training is the first run's final eval, on the same tokenizer and blocks."""
    tiny_gpt2 = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                 "model.max_positions=32", "model.vocab_size=512", "hardware=cpu-8",
                 "hardware.per_device_batch_size=2", "logger=none", "language.max_train_docs=40",
                 "samples.prompts=[]"]
    first = train(compose([*tiny_gpt2, "trainer.max_steps=3"], run_dir=tmp_path / "first"))
    second_dir = tmp_path / "second"
    train(compose(["model=gpt2-tiny", f"model.init_from={tmp_path / 'first' / 'model'}",
                   *tiny_gpt2[5:], "trainer.max_steps=1"], run_dir=second_dir))
    records = [json.loads(line) for line in open(second_dir / "metrics.jsonl")]
    assert records[0]["step"] == 0
    # The same weights and blocks, evaluated by another run: a mean over up to 2^14 tokens.
    assert records[0]["eval/loss"] == approx(first, terms=2**14, depth=transformer_depth(1))
    # The run records the shape it trained (the checkpoint's, not model=gpt2-tiny's), named
    # after the checkpoint, and reading it back builds that shape.
    recorded = OmegaConf.load(second_dir / "model_config.yaml")
    assert (recorded.num_layers, recorded.hidden_size, recorded.name) == (
        1, 32, str(tmp_path / "first" / "model"))
    run_model = load_run_model(str(second_dir))
    assert run_model.model_config.hidden_size == 32
    logits = run_model.model()(np.zeros((1, 4), np.int32))
    assert logits.shape == (1, 4, 512)
