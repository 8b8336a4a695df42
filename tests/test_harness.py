"""lm-evaluation-harness on flaxlm models (`flaxlm.harness`, flaxlm-eval, eval.harness): the
same per-request scores, accuracies and generations as the harness's own `hf` backend on the
run's export (torch), the harness's token boundaries, results written and logged, bad input."""

import functools
import json
import math
import os

import lm_eval
import numpy as np
import pytest
from conftest import TINY, assert_names, metrics_of, trained_run, write
from lm_eval.api.instance import Instance
from numerics import approx, transformer

from flaxlm.errors import FlaxlmError
from flaxlm.harness import FlaxlmLM, evaluate, flat_metrics, task_index

pytestmark = [pytest.mark.harness]

# TINY's GPT-2 against transformers' (float32 both): 2 layers, a vocabulary of 512 the widest.
LOGITS = transformer(2, 512)


def log_likelihood(expected: float):
    """A sum of log-softmaxes, each a difference of numbers of about log 512 (or more)."""
    return approx(expected, **LOGITS, scale=max(abs(expected), math.log(512)))


def aggregate(expected: float):
    """A task's score: a mean of counts, or e to the power of a mean log-likelihood (whose
    absolute error becomes the perplexity's relative error, × its logarithm)."""
    return approx(expected, terms=2**12, depth=LOGITS["depth"],
                  amplification=max(1.0, abs(math.log(expected))) if expected > 0 else 1.0)


RUN = [*TINY, "trainer.max_steps=30", "trainer.eval_before_training=false",
       "language.max_eval_docs=6", "checkpoint.every_steps=null"]
WORDS = ("the marsh the baker the school a village bread winter boats road cart children "
         "railway trains cows smoke fields water sea morning shop").split()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return str(trained_run(tmp_path_factory, "harness-run", RUN))


@pytest.fixture(scope="module")
def flaxlm_lm(run_dir):
    return FlaxlmLM(run_dir=run_dir, batch_size=8)


@pytest.fixture(scope="module")
def hf_lm(run_dir):
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=os.path.join(run_dir, "model"), dtype="float32", batch_size=8,
              device="cpu")
    # The export's generation_config.json carries the run's samples.max_new_tokens, which
    # transformers puts before the max_length the harness asks for: without it, the hf
    # backend generates at most the task's max_gen_toks, as ours does.
    lm.model.generation_config.max_new_tokens = None
    return lm


def sentence(rng, n) -> str:
    return " ".join(rng.choice(WORDS, n))


def write_tasks(folder, seed: int = 0):
    """Three local tasks, one of each request type, their data written here."""
    rng = np.random.default_rng(seed)
    mc = [{"context": sentence(rng, rng.integers(3, 12)),
           "choices": [" " + sentence(rng, rng.integers(1, 5)) for _ in range(4)],
           "label": int(rng.integers(4))} for _ in range(12)]
    texts = [{"text": sentence(rng, rng.integers(20, 90))} for _ in range(5)]
    gen = [{"question": sentence(rng, rng.integers(3, 10)), "answer": "the"} for _ in range(6)]
    for name, rows in (("mc", mc), ("texts", texts), ("gen", gen)):
        write(folder / f"{name}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\nvalidation_split: validation\n"
    write(folder / "tiny_mc.yaml",
          f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n"
          f"    validation: {folder / 'mc.jsonl'}\noutput_type: multiple_choice\n"
          "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    write(folder / "tiny_rolling.yaml",
          f"task: tiny_rolling\n{common}dataset_kwargs:\n  data_files:\n"
          f"    validation: {folder / 'texts.jsonl'}\noutput_type: loglikelihood_rolling\n"
          "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
          "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    write(folder / "tiny_gen.yaml",
          f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n"
          f"    validation: {folder / 'gen.jsonl'}\noutput_type: generate_until\n"
          "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
          "generation_kwargs:\n  until: ['.', 'cows']\n  max_gen_toks: 12\n  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\n")
    return folder


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def requests(kind, *args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i)
            for i, args in enumerate(args_list)]


@pytest.mark.torch
@pytest.mark.slow
def test_every_task_type_scores_as_the_hf_backend_on_the_export(flaxlm_lm, hf_lm, task_dir):
    tasks = ["tiny_mc", "tiny_rolling", "tiny_gen"]
    outcomes = [lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True,
                                        task_manager=task_index(str(task_dir)),
                                        bootstrap_iters=0)
                for lm in (flaxlm_lm, hf_lm)]
    ours, theirs = outcomes
    for task in tasks:
        for mine, reference in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            for got, expected in zip(mine["resps"], reference["resps"], strict=True):
                got, expected = got[0], expected[0]
                if task == "tiny_gen":
                    assert got == expected
                elif task == "tiny_mc":
                    assert got[0] == log_likelihood(expected[0])
                    assert got[1] == expected[1]
                else:
                    assert got == log_likelihood(expected)
    for task in tasks:
        for key, value in theirs["results"][task].items():
            if key.endswith(",none") and "stderr" not in key:
                assert ours["results"][task][key] == aggregate(value), (task, key)


@pytest.mark.torch
def test_token_boundaries_are_the_harness_own(flaxlm_lm, hf_lm):
    long_context = " ".join(["the marsh and the baker"] * 40)  # far beyond 64 positions
    cases = requests(
        "loglikelihood",
        ("", "the marsh"),  # empty context: the document-start token
        ("the baker ", "sold bread"),  # the context's trailing space moves to the continuation
        ("the baker", " sold bread"),
        (long_context, " the school"),  # cut from the left
        ("the", " the the the"),
    )
    for mine, reference in zip(flaxlm_lm.loglikelihood(cases), hf_lm.loglikelihood(cases)):
        assert mine[0] == log_likelihood(reference[0])
        assert mine[1] == reference[1]
    text = requests("loglikelihood_rolling", (long_context,), ("a",))
    assert flaxlm_lm.loglikelihood_rolling(text) == [
        log_likelihood(value) for value in hf_lm.loglikelihood_rolling(text)]


def test_an_empty_context_reads_the_document_start(flaxlm_lm):
    eos = flaxlm_lm.tokenizer.eos_token_id
    [(context, continuation)] = [
        (c, t) for _, c, t in _encoded(flaxlm_lm, [("", "the marsh")])]
    assert context == [flaxlm_lm.prefix_token_id]
    assert eos not in continuation
    # a flaxlm run read a document after EOS: a context starts with it
    [(context, _)] = [(c, t) for _, c, t in _encoded(flaxlm_lm, [("the", " marsh")])]
    assert context[0] == eos


def _encoded(lm, pairs):
    captured = []
    original = lm._loglikelihood_tokens
    lm._loglikelihood_tokens = lambda reqs, **_: captured.extend(reqs) or [(0.0, False)] * len(reqs)
    try:
        lm.loglikelihood(requests("loglikelihood", *pairs))
    finally:
        lm._loglikelihood_tokens = original
    return captured


def test_flat_metrics_name_each_task_and_metric():
    results = {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.01,
                             "acc_norm,none": 0.3, "exact_match,strict": 0.5,
                             "x_stderr,none": "N/A"}}
    assert flat_metrics(results) == {
        "eval/hellaswag/acc": 0.25, "eval/hellaswag/acc_stderr": 0.01,
        "eval/hellaswag/acc_norm": 0.3, "eval/hellaswag/exact_match_strict": 0.5}


@pytest.mark.slow
def test_flaxlm_eval_writes_the_results_and_logs_them_to_the_run(run_dir, task_dir, capsys):
    from flaxlm.cli.eval import run

    metrics = run([run_dir, "--tasks", "tiny_mc,tiny_rolling", "--include-path", str(task_dir),
                   "--limit", "6", "--batch-size", "4"])
    assert 0.0 <= metrics["eval/tiny_mc/acc"] <= 1.0
    assert metrics["eval/tiny_rolling/word_perplexity"] > 1.0
    out = capsys.readouterr().out
    assert "tiny_mc" in out and "acc" in out  # the harness's table
    results = json.loads(open(os.path.join(run_dir, "eval", "harness-30.json")).read())
    assert results["step"] == 30
    assert results["results"]["tiny_mc"]["acc,none"] == metrics["eval/tiny_mc/acc"]
    logged = [r for r in metrics_of(run_dir) if "eval/tiny_mc/acc" in r]
    assert logged[-1]["step"] == 30
    assert logged[-1]["eval/tiny_mc/acc"] == metrics["eval/tiny_mc/acc"]
    # a second evaluation of the step keeps the first's file
    run([run_dir, "--tasks", "tiny_mc", "--include-path", str(task_dir), "--limit", "2"])
    assert os.path.exists(os.path.join(run_dir, "eval", "harness-30.2.json"))
    assert json.loads(open(os.path.join(run_dir, "eval", "harness-30.json")).read()) == results


def test_unknown_tasks_and_missing_runs_are_one_paragraph(flaxlm_lm, task_dir, tmp_path):
    with pytest.raises(FlaxlmError) as error:  # neither the harness's nor a local task
        evaluate(flaxlm_lm, ["no_such_task_anywhere"], include_path=str(task_dir))
    assert_names(error.value, "no_such_task_anywhere", "--include-path")
    with pytest.raises(FlaxlmError) as error:
        FlaxlmLM(run_dir=str(tmp_path / "absent"))
    assert_names(error.value, "does not exist")


def test_the_task_index_is_built_once_per_folder(flaxlm_lm, task_dir, monkeypatch):
    """Evaluating every N steps reuses the harness's index of its task files."""
    from lm_eval import tasks

    from flaxlm import harness

    built = []
    monkeypatch.setattr(tasks, "TaskManager", lambda **kwargs: built.append(kwargs) or
                        type("Index", (), {"all_tasks": []})())
    # An empty cache of its own: the module's other tests keep the real indexes built so far.
    monkeypatch.setattr(harness, "task_index", functools.cache(harness.task_index.__wrapped__))
    for include_path in (str(task_dir), str(task_dir), None):
        with pytest.raises(FlaxlmError):
            evaluate(flaxlm_lm, ["tiny_mc"], include_path=include_path)
    assert built == [{"include_path": str(task_dir)}, {"include_path": None}]


@pytest.mark.slow  # several seconds: make test runs it
def test_a_task_whose_data_is_unreachable_says_how_to_use_local_data(flaxlm_lm, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write(tmp_path / "remote.yaml",
          "task: remote_task\ndataset_path: someone/no-such-dataset-xyz\n"
          "validation_split: validation\noutput_type: multiple_choice\n"
          "doc_to_text: '{{q}}'\ndoc_to_choice: '{{c}}'\ndoc_to_target: 0\n"
          "metric_list:\n  - metric: acc\n")
    with pytest.raises(FlaxlmError) as error:
        evaluate(flaxlm_lm, ["remote_task"], include_path=str(tmp_path))
    assert_names(error.value, "remote_task", "local copy")


@pytest.mark.slow
def test_eval_harness_runs_during_training_and_can_be_the_objective(tmp_path_factory, task_dir):
    from flaxlm.config import ObjectiveMode
    from flaxlm.tasks.objective import choose_objective

    # The module's run (the same training steps, compiled once) with the harness every 15.
    overrides = [*RUN, "eval.harness.tasks=[tiny_mc]", f"eval.harness.include_path={task_dir}",
                 "eval.harness.limit=4", "eval.harness.every_steps=15",
                 "trainer.objective=eval/tiny_mc/acc_norm"]
    run_dir = trained_run(tmp_path_factory, "harness-in-training", overrides)
    logged = [(r["step"], r["eval/tiny_mc/acc_norm"]) for r in metrics_of(run_dir)
              if "eval/tiny_mc/acc_norm" in r]
    assert [step for step, _ in logged] == [15, 30]
    assert all(0.0 <= value <= 1.0 for _, value in logged)
    assert os.path.exists(os.path.join(run_dir, "eval", "harness-15.json"))
    from conftest import compose
    from omegaconf import OmegaConf

    config = OmegaConf.to_object(compose(overrides))
    assert choose_objective(config).mode == ObjectiveMode.max


def test_bad_eval_harness_settings_are_refused_before_training():
    from conftest import SHORT, compose
    from omegaconf import OmegaConf

    from flaxlm.job import check_settings
    from flaxlm.tasks.objective import choose_objective

    config = OmegaConf.to_object(compose([*SHORT, "eval.harness.tasks=[x]",
                                          "eval.harness.every_steps=0"]))
    with pytest.raises(FlaxlmError) as error:
        check_settings(config, 8)
    assert_names(error.value, "eval.harness.every_steps=0")
    config = OmegaConf.to_object(compose([*SHORT, "trainer.objective=eval/hellaswag/acc"]))
    with pytest.raises(FlaxlmError) as error:
        choose_objective(config)
    assert_names(error.value, "trainer.objective=eval/hellaswag/acc", "eval.harness.tasks")


def test_results_logged_after_the_run_reach_metrics_tensorboard_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_records import items, of_type, offline_wandb_env, read_wandb_records

    from flaxlm.downstream import record_results
    from flaxlm.harness import HarnessResults
    from flaxlm.runs import _lock

    run_dir = tmp_path / "run"
    offline_wandb_env(run_dir, monkeypatch)
    run_dir.mkdir()
    write(run_dir / "config.yaml", "logger:\n  name: wandb\n  wandb: true\n  tensorboard: true\n"
                                   "  mode: offline\n  project: p\n  tags: []\n")
    results = HarnessResults({"results": {"t": {"acc,none": 0.5}}}, {"eval/t/acc": 0.5}, "")
    held = _lock(str(run_dir))  # a run training there: its files are left alone
    record_results(str(run_dir), 30, results)
    assert not (run_dir / "metrics.jsonl").exists()
    os.close(held)
    record_results(str(run_dir), 30, results)
    assert [r["step"] for r in metrics_of(run_dir)] == [30]
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/t/acc")] == [(30, 0.5)]
    [log] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    [row] = [items(h.item) for h in of_type(read_wandb_records(log), "history")]
    assert row["eval/t/acc"] == 0.5 and row["step"] == 30
    assert sorted(os.listdir(run_dir / "eval")) == ["harness-30.2.json", "harness-30.json"]
