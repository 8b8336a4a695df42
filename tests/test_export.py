"""Export to a Hugging Face directory that transformers loads cleanly, the flaxlm-export and
flaxlm-generate command lines on a real (two-step) run, and the samples a run writes at its end."""

import errno
import glob
import io
import json
import logging
import os
import warnings

import numpy as np
import pytest
import tokenizers
import transformers
from conftest import TINY, compose, config_node, make_tokenizer, model_config
from conftest import TOKENIZER_TEXT as TEXT
from flax import nnx
from numerics import assert_close, transformer

from flaxlm.data.tables import text_dataset
from flaxlm.errors import FlaxlmError
from flaxlm.export import MARKER, export_hf
from flaxlm.models import hf
from flaxlm.models.gpt2 import GPT2LMHeadModel
from flaxlm.models.layers import TransformerSpec

CONFIG = model_config(name="t", vocab_size=97, max_positions=32, hidden_size=64, num_layers=2,
                      num_heads=4)
FIGURES = {"eval/loss": 6.398, "eval/perplexity": 600.4, "eval/bits_per_byte": 2.56,
           "steps": 230, "tokens_seen": 471040}


def make_params(config=CONFIG):
    model = GPT2LMHeadModel(TransformerSpec(config), nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def export(out, **kwargs):
    return export_hf(str(out), make_params(), CONFIG, make_tokenizer(),
                     run_config={"language": {"name": "en-builtin"}, "seed": 0},
                     eval_metrics=FIGURES, **kwargs)


@pytest.mark.slow
@pytest.mark.torch
def test_transformers_loads_the_export_cleanly_and_its_logits_match_ours(tmp_path):
    torch = pytest.importorskip("torch")
    out = export(tmp_path / "hf")

    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setLevel(logging.WARNING)
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_model, info = transformers.AutoModelForCausalLM.from_pretrained(
                out, output_loading_info=True
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    finally:
        hf_logger.removeHandler(handler)
    assert type(torch_model).__name__ == "GPT2LMHeadModel"
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    assert logs.getvalue() == ""
    assert [str(w.message) for w in caught if "weight" in str(w.message).lower()] == []

    ids = np.random.default_rng(0).integers(0, 97, (2, 32))
    model = GPT2LMHeadModel(TransformerSpec(CONFIG), nnx.Rngs(0))
    with torch.no_grad():
        theirs = torch_model.eval()(torch.from_numpy(ids)).logits.numpy()
    assert_close(np.asarray(model(ids)), theirs,  # float32 reorderings
                 **transformer(CONFIG.num_layers, 4 * CONFIG.hidden_size))

    ours = make_tokenizer()
    plain = ours("the cat")["input_ids"]
    assert tokenizer("the cat", add_special_tokens=False)["input_ids"] == plain
    assert tokenizer("the cat")["input_ids"] == [ours.eos_token_id, *plain]  # a document's start
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("</s>", "<pad>")


def test_export_writes_generation_config_and_model_card(tmp_path):
    out = export(tmp_path / "hf")
    tokenizer = make_tokenizer()
    generation = json.loads(open(os.path.join(out, "generation_config.json")).read())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (
        tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    assert generation["do_sample"] is True and generation["top_k"] == 50
    card = open(os.path.join(out, "README.md")).read()
    for figure in ("6.3980", "600.40", "2.560", "| optimizer steps | 230 |", "471,040",
                   "library_name: transformers", "en-builtin", "seed: 0"):
        assert figure in card, figure
    assert json.loads(open(os.path.join(out, MARKER)).read())["architecture"] == "GPT2LMHeadModel"
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 2


def test_export_never_overwrites_a_users_directory_but_replaces_an_earlier_export(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(FlaxlmError, match="not a flaxlm export"):
            export(users, overwrite=overwrite)
    assert (users / "notes.txt").read_text() == "keep me"

    out = tmp_path / "hf"
    export(out)
    (out / "stale.txt").write_text("from the first export")
    export(out)  # an earlier flaxlm export: replaced as a whole
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    # A marker alone does not make an export: not with a folder inside, nor a run's files.
    (out / "mine").mkdir()
    with pytest.raises(FlaxlmError, match="not a flaxlm export"):
        export(out, overwrite=True)
    (out / "mine").rmdir()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(FlaxlmError, match="holds a flaxlm run"):
        export(out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["hf", "mine"]  # no staging folders left


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        export(tmp_path / "hf")
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- a real run and the CLIs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A two-step run with W&B offline: checkpoint, model/ export and end-of-run samples."""
    from flaxlm.job import train

    directory = tmp_path_factory.mktemp("run") / "run"
    overrides = [o for o in TINY if not o.startswith("logger")]
    train(compose([*overrides, "logger=wandb", "trainer.max_steps=2",
                   "language.max_train_docs=40", "language.max_eval_docs=10",
                   "samples.prompts=['','Return the']", "samples.max_new_tokens=8"],
                  run_dir=directory))
    return str(directory)


@pytest.mark.slow
def test_a_run_ends_with_samples_in_metrics_jsonl_and_wandb(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    [samples] = [r for r in records if "samples" in r]
    assert samples["step"] == 2
    assert [row["prompt"] for row in samples["samples"]] == ["", "Return the"]
    assert all(isinstance(row["completion"], str) for row in samples["samples"])
    [table] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "files", "media",
                                     "table", "samples_*.table.json"))
    logged = json.loads(open(table).read())
    assert logged["columns"] == ["prompt", "completion"]
    assert [row[1] for row in logged["data"]] == [row["completion"] for row in samples["samples"]]
    card = open(os.path.join(run_dir, "model", "README.md")).read()
    assert "| optimizer steps | 2 |" in card and "eval perplexity" in card


@pytest.mark.slow
@pytest.mark.torch
def test_flaxlm_export_and_generate_on_a_run(run_dir, tmp_path, capsys):
    from flaxlm.cli import export as export_cli
    from flaxlm.cli import generate as generate_cli

    out = export_cli.run([str(run_dir), "--out", str(tmp_path / "hf")])
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch_model.config.n_layer == 2
    assert "| optimizer steps | 2 |" in open(os.path.join(out, "README.md")).read()

    args = [str(run_dir), "--prompt", "Return the", "--prompt", "a", "--prompt", "b",
            "--greedy", "--max-new-tokens", "6"]
    completions = generate_cli.run(args)
    assert len(completions) == 3 and completions == generate_cli.run(args)
    printed = capsys.readouterr().out
    assert printed.count("\n---\n") == 4 and "Return the" + completions[0] in printed


@pytest.mark.slow
def test_cli_errors_are_one_paragraph_with_exit_status_2(run_dir, tmp_path, capsys,
                                                          unwritable):
    from flaxlm.cli import export as export_cli
    from flaxlm.cli import generate as generate_cli

    cases = [
        (export_cli.main, [str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
         "does not exist"),
        (export_cli.main, [str(run_dir), "--out", str(tmp_path / "o"), "--step", "7"],
         "no checkpoint for step 7; it has steps [2]"),
        (export_cli.main, [str(run_dir), "--out", str(run_dir)], "is the run being exported"),
        (export_cli.main, [str(run_dir)], "the following arguments are required: --out"),
        # Issue 20: a destination on a read-only disk was an OSError traceback, exit 1.
        (export_cli.main, [str(run_dir), "--out", str(unwritable / "hf")],
         f"Cannot export to {unwritable / 'hf'}: flaxlm cannot write in {unwritable}"),
        (export_cli.main, [str(run_dir), "--out", str(unwritable / "new" / "hf")],
         f"flaxlm cannot write in {unwritable / 'new'}"),
        (generate_cli.main, [str(run_dir), "--temperature", "hot"],
         "argument --temperature: invalid float value: 'hot'"),
        (generate_cli.main, [str(run_dir), "--prompt", "x", "--max-new-token", "3"],
         "unrecognized arguments: --max-new-token 3"),
    ]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


@pytest.mark.slow
def test_a_full_disk_during_flaxlm_export_is_one_paragraph(run_dir, tmp_path, monkeypatch,
                                                           capsys):
    """Issue 20's class of defect: a destination that fills up ended flaxlm-export in a
    traceback; nothing is left half-written."""
    from flaxlm.cli import export as export_cli

    def out_of_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))

    monkeypatch.setattr(hf, "save_pretrained", out_of_space)
    with pytest.raises(SystemExit) as exit_info:
        export_cli.main([str(run_dir), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [error] = err.strip().splitlines()
    assert error.startswith("flaxlm: error: A disk is full") and "No space left" in error
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_generate_falls_back_to_the_runs_export_without_checkpoints(run_dir, tmp_path):
    import shutil

    from flaxlm.cli import generate as generate_cli

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    args = ["--prompt", "Return the", "--greedy", "--max-new-tokens", "6"]
    assert generate_cli.run([str(copy), *args]) == generate_cli.run([str(run_dir), *args])


@pytest.mark.slow
def test_a_run_read_back_onto_the_devices_is_split_over_them(run_dir, tmp_path):
    """What flaxlm-export and flaxlm-generate read (the checkpoint, or the export of a run
    without one) goes straight onto all 8 devices, each holding an eighth of every matrix:
    the same values as read to the host."""
    import shutil

    import jax

    from flaxlm.run_model import load_run_model, local_mesh

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    for source in (run_dir, str(copy)):
        on_host = load_run_model(source).params
        on_mesh = load_run_model(source, mesh=local_mesh()).params
        for host, split in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_mesh)):
            assert isinstance(split, jax.Array) and np.array_equal(np.asarray(split), host)
            if host.ndim == 2:
                assert {shard.data.size for shard in split.addressable_shards} == {host.size // 8}


def test_exported_files_get_the_modes_the_umask_gives(tmp_path):
    previous = os.umask(0o027)
    try:
        out = export(tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777)
             for name in os.listdir(out)}
    assert "model.safetensors" in modes and modes == {name: oct(0o640) for name in modes}
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o750)


def test_the_exported_tokenizer_reads_a_prompt_as_flaxlm_generate_does(tmp_path):
    from flaxlm.generate import encode_prompts

    out = export(tmp_path / "hf")
    exported = transformers.AutoTokenizer.from_pretrained(out)
    ours = make_tokenizer()
    prompts = ["the cat", "", "a much longer prompt on the mat"]
    fed = encode_prompts(ours, prompts)
    assert fed[:2] == [[ours.eos_token_id, *ours("the cat")["input_ids"]], [ours.eos_token_id]]
    assert [exported(prompt)["input_ids"] for prompt in prompts] == fed
    assert encode_prompts(exported, prompts) == fed  # no second EOS
    assert exported("the cat", add_special_tokens=False)["input_ids"] == fed[0][1:]


def test_a_document_start_tokenizer_packs_and_classifies_as_before(tmp_path):
    """The exported tokenizer, fed back (model.init_from, tokenizer.path), packs the same
    stream (one EOS between documents) and gets the same classification template."""

    from flaxlm.data.packing import tokenize_and_pack
    from flaxlm.data.tokenizer import with_document_start
    from flaxlm.tasks.classify import with_pair_template

    texts = text_dataset(TEXT)
    for offsets in (None, tokenizers.processors.ByteLevel(trim_offsets=False)):
        plain = make_tokenizer()
        plain.backend_tokenizer.post_processor = offsets
        exported = with_document_start(plain)
        assert plain("the cat")["input_ids"] == make_tokenizer()("the cat")["input_ids"]  # a copy
        assert with_document_start(exported) is exported
        np.testing.assert_array_equal(tokenize_and_pack(texts, exported, 8, str(tmp_path)),
                                      tokenize_and_pack(texts, plain, 8, str(tmp_path)))
        paired, paired_before = with_pair_template(exported), with_pair_template(plain)
        assert (paired.backend_tokenizer.post_processor.__getstate__()
                == paired_before.backend_tokenizer.post_processor.__getstate__())
        assert paired("the cat", "the mat")["input_ids"] == paired_before("the cat", "the mat")[
            "input_ids"]


@pytest.mark.slow
def test_flaxlm_export_never_replaces_a_run_or_its_checkpoints(run_dir, tmp_path, capsys):
    import shutil

    from flaxlm.cli import export as export_cli

    runs = tmp_path / "runs"
    copy = runs / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("wandb"))
    files = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    cases = [
        (copy, copy, "is the run being exported"),
        (copy, runs, f"is the run being exported ({copy})"),  # a folder above it
        (copy, copy / "checkpoints", "the checkpoints folder of a run"),
        (copy, copy / "checkpoints" / "hf", "the checkpoints folder of a run"),
        (run_dir, copy, "holds a flaxlm run (it has metrics.jsonl, config.yaml, .lock, "
                        "checkpoints)"),
        (run_dir, runs, "not a flaxlm export"),  # another run inside
    ]
    for source, out, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            export_cli.main([str(source), "--out", str(out), "--overwrite"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and f"--out {out}" in err and "Traceback" not in err, (out, err)
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == files

    # The run's own model/: replaced as an earlier export, or with overwrite=true while it
    # holds only what the run wrote at its start.
    export_cli.run([str(copy), "--out", str(copy / "model")])
    (copy / "model" / MARKER).unlink()
    with pytest.raises(SystemExit):
        export_cli.main([str(copy), "--out", str(copy / "model")])
    assert "pass --overwrite to replace this run's model/" in capsys.readouterr().err
    export_cli.run([str(copy), "--out", str(copy / "model"), "--overwrite"])
    assert (copy / "model" / MARKER).exists()


@pytest.mark.slow
def test_reading_a_run_back_logs_no_warnings(run_dir, caplog):
    from flaxlm.run_model import load_run_model

    with caplog.at_level(logging.WARNING):
        load_run_model(run_dir)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.slow
@pytest.mark.torch
def test_transformers_generates_what_flaxlm_generate_does_from_the_plain_prompt(run_dir, tmp_path):
    torch = pytest.importorskip("torch")
    from flaxlm.cli import export as export_cli
    from flaxlm.cli import generate as generate_cli
    from flaxlm.generate import encode_prompts
    from flaxlm.run_model import load_run_model

    out = export_cli.run([str(run_dir), "--out", str(tmp_path / "hf")])
    prompts = ["Return the", "The", "A list is", ""]
    ours = generate_cli.run([str(run_dir), *(f"--prompt={p}" for p in prompts), "--greedy",
                             "--max-new-tokens", "8"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert [tokenizer(p)["input_ids"] for p in prompts] == encode_prompts(
        load_run_model(run_dir).tokenizer, prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=8)
        theirs.append(tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:],
                                       skip_special_tokens=True))
    assert theirs == ours
    pipe = transformers.pipeline("text-generation", model=out)
    assert [pipe(p, do_sample=False, max_new_tokens=8, return_full_text=False)[0]
            ["generated_text"] for p in prompts] == ours


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2.5-0.5b", "smollm-135m",
                                    "moe-tiny", "qwen1.5-moe-a2.7b", "mixtral-8x7b",
                                    "olmoe-1b-7b"])
def test_the_config_json_written_without_transformers_is_its_config(preset):
    """A run writes config.json from the values of its transformers config (its class would
    import PyTorch): transformers reads it back as the config its class makes, field for field
    (its defaults filled in for what the file leaves out)."""
    from transformers import AutoConfig

    model = config_node("model", [f"model={preset}"], init_from=None)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    values = hf.lm_config_json(model, **ids)
    read = AutoConfig.for_model(**values).to_dict()
    made = hf.to_lm_config(model, **ids).to_dict()
    assert read == made
