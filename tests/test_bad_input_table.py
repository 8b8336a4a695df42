"""Every kind of bad input, through the real command line: `flaxlm-train` exits 2, and the first
line of its stderr is the one `flaxlm: error:` line, naming the setting or file; no traceback.

Each row is a separate test. The command's `main()` runs in this process, as `flaxlm-train`
would run it; a row whose check happens as JAX starts (which it does once per process) runs
`flaxlm-train` in a process of its own. Most rows fail before any data is read, and none trains
beyond a setup step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ENGLISH, TINY, TINY_CORPUS, user_env

# If a check is missing, the run stays short.
BASE = [*TINY, "trainer.max_steps=1", "trainer.eval_before_training=false"]
CLASSIFY = ["task=classify", "task.text_column=text", "task.max_seq_length=24"]
FILES = ["language=files"]


def corpus(name: str) -> list[str]:
    return [*FILES, f"language.files=[{{data}}/{name}]"]


def classify(train: str, evaluation: str) -> list[str]:
    return [*CLASSIFY, f"task.files=[{{data}}/{train}]",
            f"task.eval_files=[{{data}}/{evaluation}]"]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def sft(train: str) -> list[str]:
    return ["task=sft", "task.max_seq_length=64", f"task.files=[{{data}}/{train}]"]


def dpo(train: str) -> list[str]:
    return ["task=dpo", "task.max_seq_length=64", f"task.files=[{{data}}/{train}]"]


def chats(*conversations: list[tuple[str, str]]) -> str:
    return jsonl([{"messages": [{"role": role, "content": text} for role, text in turns]}
                  for turns in conversations])


GOOD_CHAT = [("user", "What is 2 + 5?"), ("assistant", "7.")]


def labelled(labels: list) -> str:
    return jsonl([{"text": f"example {i}", "label": label} for i, label in enumerate(labels)])


# Every row's input files, written into each test's data folder.
DATA = {
    "english.txt": ENGLISH,
    "tiny.txt": TINY_CORPUS,
    "big.txt": "\n\n".join([ENGLISH] * 8),
    "empty.txt": b"",
    "latin1.txt": "Caf\xe9 au lait.".encode("latin-1"),
    "corpus.docx": "not a corpus",
    "broken.jsonl": '{"text": "fine"}\n{"text": broken\n',
    "body.jsonl": jsonl([{"body": "the text is here"}] * 3),
    "no-text.jsonl": jsonl([{"text": None}, {"id": 2}, {"text": None}]),
    # Label files with a global batch (8 devices × 2) of examples: without the label checks
    # these would train.
    "pairs.jsonl": labelled([0, 1] * 8),
    "one-class.jsonl": labelled([1] * 16),
    "stray-label.jsonl": labelled([0, 1] * 8 + [5]),
    "gap.jsonl": labelled([0, 2] * 8),
    "unseen-int.jsonl": labelled([0, 1, 2]),
    "names.jsonl": labelled(["neg", "pos"] * 8),
    "unseen-name.jsonl": labelled(["neg", "pos", "meh"]),
    "missing-label.csv": "text,label\na,1\nb,\nc,0\n",
    "human-role.jsonl": chats(GOOD_CHAT, [("human", "hi"), ("assistant", "hello")]),
    "no-reply.jsonl": chats(GOOD_CHAT, [("user", "hi")]),
    "long-chats.jsonl": chats(*[[("user", "a long question " * 20), ("assistant", "yes")]] * 4),
    "chats.jsonl": chats(*[GOOD_CHAT] * 4),
    "no-rejected.jsonl": jsonl([{"prompt": "2 + 5?", "chosen": "7", "rejected": "8"},
                                {"prompt": "2 + 2?", "chosen": "4"}]),
    "question-pairs.jsonl": jsonl([{"question": "2 + 5?", "chosen": "7", "rejected": "8"}] * 4),
    "long-pairs.jsonl": jsonl([{"prompt": "a long question " * 20, "chosen": "yes",
                                "rejected": "no"}] * 4),
}


@dataclasses.dataclass(frozen=True)
class Row:
    overrides: list[str]  # may hold {tmp} (the test's folder) and {data} (its DATA files)
    names: list[str]  # what the first stderr line must name
    setup: Callable[..., None] | None = None  # prepares {tmp} before the run (tmp, run)
    process: bool = False  # checked as JAX starts: in a fresh process


def arguments(tmp: Path, overrides: list[str]) -> list[str]:
    """flaxlm-train's arguments for a row: its run directory {tmp}/run unless the overrides
    name one."""
    filled = [o.format(tmp=tmp, data=tmp / "data") for o in overrides]
    if not any(o.startswith("hydra.run.dir=") for o in filled):
        filled.append(f"hydra.run.dir={tmp / 'run'}")
    return [*BASE, *filled]


@pytest.fixture
def run(train_cli, monkeypatch):
    """flaxlm-train as a user runs it, in cwd `tmp`, with its own flaxlm cache and progress
    bars off (they are not messages, and tokenizing and `datasets` draw them on stderr)."""
    import datasets
    from tqdm.auto import tqdm

    from flaxlm.data import packing

    monkeypatch.setattr(packing, "tqdm", functools.partial(tqdm, disable=True))

    def run_in(tmp: Path, overrides: list[str]):
        monkeypatch.setenv("FLAXLM_CACHE", str(tmp / "cache"))
        datasets.disable_progress_bars()
        try:
            return train_cli(*arguments(tmp, overrides), cwd=tmp)
        finally:
            datasets.enable_progress_bars()

    return run_in


def run_process(tmp: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """flaxlm-train in a process of its own: a user's environment (conftest's `user_env`),
    cwd `tmp`, its own caches."""
    env = user_env("HYDRA_FULL_ERROR", FLAXLM_CACHE=str(tmp / "cache"),
                   HF_DATASETS_CACHE=str(tmp / "hf"), HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
                   HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    return subprocess.run([sys.executable, "-m", "flaxlm.cli.train", *arguments(tmp, overrides)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def holds_a_run(tmp: Path, run) -> None:
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')


def a_file_at(name: str) -> Callable[..., None]:
    def setup(tmp: Path, run) -> None:
        # A file where a directory must go: unwritable even for root, unlike a chmod.
        (tmp / name).write_text("a file, not a directory\n")
    return setup


def failed_start(tmp: Path, run) -> None:
    """A first start into {tmp}/run that fails once it holds the run directory."""
    first = run(tmp, [*FILES, "language.files=[{tmp}/missing/*.txt]"])
    assert first.returncode == 2, first.stderr


def trained_one_step(tmp: Path, run) -> None:
    done = run(tmp, [*corpus("big.txt"), "samples.prompts=[]"])
    assert done.returncode == 0, done.stderr


ROWS = {
    # --- settings checked before any data is read
    "lr-nan": Row(["optimizer.lr=nan"], ["optimizer.lr=nan"]),
    "moment-dtype-float16": Row(["optimizer.moment_dtype=float16"],
                                ["optimizer.moment_dtype=float16"]),
    "negative-batch": Row(["hardware.per_device_batch_size=-2"],
                          ["hardware.per_device_batch_size=-2"]),
    "global-batch-not-a-multiple": Row(["trainer.global_batch_size=12"],
                                       ["trainer.global_batch_size=12"]),
    "context-not-dividing-the-rows": Row(
        ["hardware.mesh.data=1", "hardware.mesh.context=8", "task.max_seq_length=60"],
        ["hardware.mesh.context=8", "60 positions", "task.max_seq_length"]),
    "context-balanced-not-dividing-the-rows": Row(
        ["hardware.mesh.data=1", "hardware.mesh.context=8", "task.max_seq_length=56"],
        ["hardware.mesh.context=8", "16 equal chunks", "hardware.mesh.balance_context"]),
    "context-with-cudnn": Row(
        ["hardware.mesh.data=1", "hardware.mesh.context=8", "model.attention=cudnn"],
        ["model.attention=cudnn", "hardware.mesh.context=8"]),
    "context-attention-unknown": Row(
        ["hardware.mesh.data=1", "hardware.mesh.context=8", "model.context_attention=zigzag"],
        ["model.context_attention", "ring"]),
    "context-ring-with-a-window": Row(
        ["model=llama-tiny", "model.family=mistral", "model.sliding_window=16",
         "hardware.mesh.data=1",
         "hardware.mesh.context=8", "model.context_attention=ring"],
        ["model.sliding_window=16", "model.context_attention=all_gather"]),
    "context-on-a-classifier": Row(
        [*classify("pairs.jsonl", "pairs.jsonl"), "model=bert-tiny",
         "hardware.mesh.data=1", "hardware.mesh.context=8"],
        ["hardware.mesh.context=8", "padding"]),
    "block-longer-than-model": Row(["task.max_seq_length=65"],
                                   ["task.max_seq_length=65", "model.max_positions=64"]),
    "more-devices-than-exist": Row(["hardware.num_devices=16"], ["hardware.num_devices=16"]),
    "unknown-platform": Row(["hardware.platform=quantum"], ["hardware.platform='quantum'"]),
    "streaming-without-max-steps": Row([*corpus("english.txt"), "language.streaming=true",
                                        "trainer.max_steps=null"],
                                       ["language.streaming=true", "trainer.max_steps"]),
    "init-from-missing": Row(["model.init_from={tmp}/no-model"], ["model.init_from="]),
    "keep-last-zero": Row(["checkpoint.keep_last=0"], ["checkpoint.keep_last=0"]),
    "storage-retries-none": Row(["storage_retries.attempts=0"],
                                ["storage_retries.attempts=0"]),
    "storage-retries-negative-wait": Row(["storage_retries.first_wait_s=-1"],
                                         ["storage_retries.first_wait_s=-1.0"]),
    "classify-without-data": Row(["task=classify"], ["task.hub_path", "task.files"]),
    "attention-cudnn-on-cpu": Row(["model.attention=cudnn"], ["model.attention=cudnn", "auto"]),
    "attention-splash-on-cpu": Row(["model.attention=splash"], ["model.attention=splash"]),
    "attention-unknown": Row(["model.attention=flash"], ["model.attention"]),
    "dropout-rng-unknown": Row(["hardware.dropout_rng=philox"], ["hardware.dropout_rng"]),
    "clm-with-an-encoder": Row(["model=bert-tiny"], ["model=bert-tiny", "task=clm"]),
    "lora-rank-zero": Row(["model.lora.rank=0"], ["model.lora.rank=0"]),
    "moe-top-k-past-experts": Row(["model=moe-tiny", "model.moe.top_k=9"],
                                  ["model.moe.top_k=9", "model.moe.num_experts=8"]),
    "moe-capacity-zero": Row(["model=moe-tiny", "model.moe.capacity_factor=0"],
                             ["model.moe.capacity_factor=0"]),
    "head-dim-odd": Row(["model=llama-tiny", "model.head_dim=7"], ["model.head_dim=7"]),
    "sliding-window-not-positive": Row(
        ["model=llama-tiny", "model.family=mistral", "model.sliding_window=0"],
        ["model.sliding_window=0", "at least 1"]),
    "sliding-window-on-a-family-without": Row(
        ["model=gpt2-tiny", "model.sliding_window=16"],
        ["model.sliding_window=16", "model.family=gpt2"]),
    "sliding-window-with-cudnn": Row(
        ["model=llama-tiny", "model.family=mistral", "model.sliding_window=16",
         "model.attention=cudnn"], ["model.attention=cudnn", "model.sliding_window=16"]),
    "moe-classifier": Row([*classify("pairs.jsonl", "pairs.jsonl"), "model=moe-tiny"],
                          ["model=moe-tiny", "task=classify"]),
    "moe-on-a-dense-family": Row(["model=llama-tiny", "model.moe.num_experts=4"],
                                 ["model.moe.num_experts=4", "model.family=llama"]),
    "lora-unknown-target": Row(["model=gpt2-tiny", "model.lora.rank=4",
                                "model.lora.targets=[q_proj]"],
                               ["model.lora.targets", "q_proj", "c_attn, c_proj, c_fc"]),
    "lora-with-classify": Row([*classify("pairs.jsonl", "pairs.jsonl"), "model.lora.rank=4"],
                              ["model.lora.rank=4", "task=classify"]),
    "harness-every-zero": Row(["eval.harness.tasks=[next_line]", "eval.harness.every_steps=0"],
                              ["eval.harness.every_steps=0"]),
    "harness-objective-unknown": Row(["trainer.objective=eval/hellaswag/acc"],
                                     ["trainer.objective=eval/hellaswag/acc",
                                      "eval.harness.tasks"]),
    "harness-with-classify": Row([*classify("pairs.jsonl", "pairs.jsonl"),
                                  "eval.harness.tasks=[next_line]"],
                                 ["eval.harness.tasks", "task=classify"]),
    # --- the corpus
    "files-without-files": Row(FILES, ["language.files is empty"]),
    "missing-corpus-file": Row(corpus("nothing-*.txt"), ["language.files", "nothing-*.txt"]),
    "empty-corpus-file": Row(corpus("empty.txt"), ["empty.txt", "is empty"]),
    "invalid-utf8": Row(corpus("latin1.txt"), ["latin1.txt", "not valid UTF-8"]),
    "unsupported-extension": Row(corpus("corpus.docx"), ["corpus.docx", "unsupported extension"]),
    "unparseable-jsonl": Row(corpus("broken.jsonl"), ["broken.jsonl", "could not parse"]),
    "text-column-absent": Row(corpus("body.jsonl"), ["language.text_column='text'",
                                                     "body.jsonl"]),
    "text-null-in-every-row": Row(corpus("no-text.jsonl"), ["language.text_column='text'",
                                                            "no-text.jsonl"]),
    "validation-fraction-out-of-range": Row([*corpus("english.txt"),
                                             "language.validation_fraction=1.5"],
                                            ["language.validation_fraction=1.5"]),
    "hub-dataset-missing": Row(["language.source=hub", "language.hub_path={tmp}/no-dataset"],
                               ["language.hub_path="]),
    "corpus-shorter-than-a-block": Row(corpus("tiny.txt"),
                                       ["shorter than one block", "task.max_seq_length=64"]),
    "corpus-smaller-than-a-batch": Row([*corpus("english.txt"),
                                        "hardware.per_device_batch_size=64"],
                                       ["hardware.per_device_batch_size"]),
    # --- mixtures (language=[...]): each caught before any tokenizer is trained ({{ }}: a brace)
    "mixture-unknown-language": Row(["language=[files,klingon]"], ["language/klingon"]),
    "mixture-negative-weight": Row(["language=[files,en-builtin]",
                                    "mixture.weights={{files: -1, en-builtin: 1}}"],
                                   ["mixture.weights.files=-1"]),
    "mixture-all-zero-weights": Row(["language=[files,en-builtin]",
                                     "mixture.weights={{files: 0, en-builtin: 0}}"],
                                    ["mixture.weights", "all zero"]),
    "mixture-weight-for-another-language": Row(
        ["language=[files,en-builtin]", "mixture.weights={{files: 1, en-builtin: 1, is: 1}}"],
        ["mixture.weights.is", "not in the mixture"]),
    "mixture-source-without-text": Row(["language=[files,en-builtin]",
                                        "mixture.sources.files.files=[{data}/empty.txt]"],
                                       ["mixture.sources.files", "empty.txt"]),
    # --- the tokenizer
    "vocab-below-the-byte-alphabet": Row([*corpus("english.txt"), "tokenizer.vocab_size=100"],
                                         ["tokenizer.vocab_size=100", "261"]),
    "tokenizer-larger-than-model": Row([*corpus("english.txt"), "model.vocab_size=300",
                                        "tokenizer.vocab_size=512"],
                                       ["model.vocab_size=300", "tokenizer.vocab_size"]),
    "tokenizer-path-missing": Row([*corpus("english.txt"), "tokenizer.path={tmp}/no-tokenizer"],
                                  ["tokenizer.path="]),
    "warmup-longer-than-the-run": Row([*corpus("big.txt"), "optimizer.warmup_steps=50"],
                                      ["optimizer.warmup_steps=50"]),
    # --- classification labels
    "classify-one-class": Row(classify("one-class.jsonl", "pairs.jsonl"),
                              ["one-class.jsonl", "has the label 1"]),
    "classify-stray-label": Row(classify("stray-label.jsonl", "pairs.jsonl"),
                                ["task.num_labels=null", "stray-label.jsonl", "[2, 3, 4]"]),
    "classify-eval-id-unseen-in-train": Row(classify("gap.jsonl", "unseen-int.jsonl"),
                                            ["gap.jsonl", "classes [1] would never be trained"]),
    "classify-eval-name-unseen-in-train": Row(classify("names.jsonl", "unseen-name.jsonl"),
                                              ["unseen-name.jsonl", "'meh'"]),
    "classify-label-missing": Row(classify("missing-label.csv", "pairs.jsonl"),
                                  ["missing-label.csv", "no label"]),
    "classify-unknown-metric": Row([*classify("pairs.jsonl", "pairs.jsonl"),
                                    "task.metrics=[nope]"], ["task.metrics", "nope"]),
    # --- run directories and resuming
    "run-dir-holds-a-run": Row([], ["already holds a run"], setup=holds_a_run),
    "resume-from-missing": Row(["resume_from={tmp}/no-run"], ["resume_from="]),
    "resume-from-with-resume-never": Row(["resume_from={tmp}/run", "trainer.resume=never"],
                                         ["trainer.resume=never"]),
    "resume-changes-the-run": Row([*corpus("big.txt"), "samples.prompts=[]", "seed=1"],
                                  ["Cannot resume", "seed"], setup=trained_one_step),
    # --- fixes under way in other parts of issue 9 (Hydra composition, no GPU, unwritable
    # folders, a failed start blocking its retry)
    "misspelt-key": Row(["trainer.max_step=3"], ["trainer.max_step"]),
    "unknown-group-option": Row(["optimizer=nosuch"], ["optimizer", "nosuch"]),
    "unknown-schedule": Row(["optimizer.schedule=nosuch"], ["optimizer.schedule", "nosuch"]),
    "gpu-without-a-gpu": Row(["hardware=gpu"], ["hardware.platform='gpu'", "hardware=gpu",
                                                "no gpu device found"], process=True),
    "run-dir-unwritable": Row(["hydra.run.dir={tmp}/blocker/run"], ["blocker"],
                              setup=a_file_at("blocker")),
    "cache-dir-unwritable": Row([*corpus("english.txt"), "cache_dir={tmp}/blocker/cache"],
                                ["cache_dir", "blocker"], setup=a_file_at("blocker")),
    # --- task=sft's conversations and chat template
    "sft-without-data": Row(["task=sft", "task.max_seq_length=64"],
                            ["task.files", "task.hub_path", "task.drills"]),
    "sft-unknown-role": Row(sft("human-role.jsonl"), ["human-role.jsonl", "row 2", "'human'"]),
    "sft-no-assistant-turn": Row(sft("no-reply.jsonl"), ["no-reply.jsonl", "row 2",
                                                         "no assistant turn"]),
    "sft-every-conversation-too-long": Row([*sft("long-chats.jsonl"),
                                            "task.long_conversations=drop"],
                                           ["task.long_conversations=drop", "dropped"]),
    "sft-template-does-not-render": Row([*sft("chats.jsonl"),
                                         "task.chat_template='{{% for m in messages %}}'"],
                                        ["task.chat_template does not render"]),
    "sft-streaming-without-max-steps": Row([*sft("chats.jsonl"), "task.streaming=true",
                                            "trainer.max_steps=null"],
                                           ["task.streaming=true", "trainer.max_steps"]),
    "sft-streaming-without-held-out-data": Row([*sft("chats.jsonl"), "task.streaming=true"],
                                               ["task.eval_files", "task.hub_eval_split"]),
    # --- task=dpo's preference pairs
    "dpo-without-data": Row(["task=dpo", "task.max_seq_length=64"],
                            ["task.files", "task.hub_path", "task.drills"]),
    "dpo-a-pair-without-its-rejected-reply": Row(dpo("no-rejected.jsonl"),
                                                 ["no-rejected.jsonl", "row 2", "'rejected'"]),
    "dpo-no-prompt-column": Row(dpo("question-pairs.jsonl"),
                                ["question-pairs.jsonl", "task.prompt_column='prompt'"]),
    "dpo-every-pair-too-long": Row([*dpo("long-pairs.jsonl"), "task.long_conversations=drop"],
                                   ["task.long_conversations=drop", "dropped"]),
    "dpo-beta-not-positive": Row(["task=dpo", "task.drills=100", "task.beta=0"],
                                 ["task.beta=0.0"]),
    "retry-after-a-failed-start": Row([*FILES, "language.files=[{tmp}/missing/*.txt]"],
                                      ["language.files", "missing/*.txt"], setup=failed_start),
}


@pytest.mark.parametrize("name", [
    # A fresh process, or a training run to resume, take most of the table's time.
    pytest.param(name, marks=pytest.mark.slow)
    if row.process or row.setup is trained_one_step else name
    for name, row in ROWS.items()])
def test_bad_input_exits_2_with_one_error_line_naming_it(tmp_path, run, name):
    row = ROWS[name]
    (tmp_path / "data").mkdir()
    for filename, content in DATA.items():
        path = tmp_path / "data" / filename
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    if row.setup is not None:
        row.setup(tmp_path, run)

    result = (run_process if row.process else run)(tmp_path, row.overrides)

    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = result.stderr.splitlines()
    assert lines and lines[0].startswith("flaxlm: error: "), result.stderr
    assert result.stderr.count("flaxlm: error:") == 1, result.stderr
    for fragment in row.names:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]}"
    assert result.returncode == 2, result.stderr
