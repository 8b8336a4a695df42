"""Sweeps: the objective a job returns to a sweeper (trainer.objective), and Optuna searches
through `hparams_search=optuna-lr-wd`: trials with their own run dirs, a study continued by
the same command, and a failed trial recorded while the others run."""

from __future__ import annotations

import fcntl
import glob
import json
import math
import os
from pathlib import Path

import pytest
import yaml
from conftest import TINY, compose
from omegaconf import OmegaConf
from wandb_records import items, of_type, read_wandb_records

from flaxlm.cli.report import main as report_main
from flaxlm.cli.sweep import SweepJob
from flaxlm.cli.train import check_sweep_direction
from flaxlm.config import ObjectiveMode, ObjectiveValue
from flaxlm.errors import FlaxlmError
from flaxlm.job import OBJECTIVE_SUMMARY, check_settings
from flaxlm.runs import open_run_dir
from flaxlm.tasks.objective import Objective, choose_objective, objective_result


def objective_of(*overrides: str) -> Objective:
    return choose_objective(OmegaConf.to_object(compose([*TINY, *overrides])))


# --- the objective ---------------------------------------------------------------------------


def test_clm_minimises_the_best_eval_loss_by_default():
    assert objective_of() == Objective("eval/loss", ObjectiveMode.min, ObjectiveValue.best)
    assert objective_of("trainer.objective=eval/bits_per_byte",
                        "trainer.objective_value=last") == Objective(
        "eval/bits_per_byte", ObjectiveMode.min, ObjectiveValue.last)


@pytest.mark.parametrize("overrides, name", [
    (["experiment=glue-mrpc"], "eval/f1"),  # metrics [accuracy, f1]: f1 is GLUE's headline
    (["experiment=glue-cola"], "eval/matthews"),
    (["task=classify", "task.num_labels=2"], "eval/f1"),  # the defaults: accuracy and f1
    (["task=classify", "task.num_labels=3"], "eval/accuracy"),
    (["task=classify", "task.num_labels=1"], "eval/pearson"),  # regression
    (["task=classify"], "eval/loss"),  # the labels, and so the metrics, come from the data
])
def test_classify_maximises_its_main_metric(overrides, name):
    objective = objective_of(*overrides)
    assert objective.name == name
    assert objective.mode == (ObjectiveMode.min if name == "eval/loss" else ObjectiveMode.max)


def test_an_explicit_mode_wins():
    assert objective_of("trainer.objective=eval/loss",
                        "trainer.objective_mode=max").mode == ObjectiveMode.max


@pytest.mark.parametrize("overrides, logged", [
    (["trainer.objective=eval/f1"], "['eval/loss', 'eval/perplexity', 'eval/bits_per_byte']"),
    (["trainer.objective=loss"], "['eval/loss', 'eval/perplexity', 'eval/bits_per_byte']"),
    (["experiment=glue-mrpc", "trainer.objective=eval/matthews"],
     "['eval/loss', 'eval/accuracy', 'eval/f1']"),
    (["experiment=glue-mrpc", "task.metrics=[]", "trainer.objective=eval/accuracy"],
     "['eval/loss']"),  # the labels, and so the default metrics, come from the data
])
def test_a_metric_the_run_never_logs_fails_before_any_data_is_read(overrides, logged):
    config = OmegaConf.to_object(compose([*TINY, *overrides]))
    with pytest.raises(FlaxlmError) as error:
        check_settings(config, 8)
    message = str(error.value)
    assert f"trainer.objective={config.trainer.objective} is not a metric" in message
    assert f"evaluates {logged}" in message


def test_the_objective_value_is_read_back_from_the_runs_metrics(tmp_path):
    records = [{"step": 0, "eval/loss": 3.0, "eval/f1": 0.5}, {"step": 5, "train/loss": 2.0},
               {"step": 10, "eval/loss": 2.0, "eval/f1": 0.8},
               {"step": 20, "eval/loss": 2.5, "eval/f1": 0.7}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"step": 30, "eval/lo')  # cut short
    best, last = ObjectiveValue.best, ObjectiveValue.last
    assert objective_result(Objective("eval/loss", ObjectiveMode.min, best), tmp_path, {}) == 2.0
    assert objective_result(Objective("eval/f1", ObjectiveMode.max, best), tmp_path, {}) == 0.8
    assert objective_result(Objective("eval/loss", ObjectiveMode.min, last), tmp_path, {}) == 2.5
    # A process without the file (not process 0) returns the final evaluation's value.
    elsewhere = tmp_path / "elsewhere"
    final = {"eval/loss": 2.5}
    assert objective_result(Objective("eval/loss", ObjectiveMode.min, best), elsewhere,
                            final) == 2.5
    assert math.isnan(objective_result(Objective("eval/f1", ObjectiveMode.max, best), elsewhere,
                                       final))


# --- Optuna ----------------------------------------------------------------------------------

SMALL = [*TINY, "trainer.max_steps=2", "trainer.eval_before_training=false",
         "language.max_train_docs=40", "language.max_eval_docs=10", "samples.prompts=[]"]


def optuna_sweep(train_cli, sweep_dir: Path, *overrides: str):
    """`flaxlm-train -m hparams_search=optuna-lr-wd ...` in this process: the sweeper runs
    its trials in the process it starts in, as Hydra's basic launcher does."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")  # the `optuna` extra
    return train_cli("-m", "hparams_search=optuna-lr-wd", *SMALL, *overrides,
                     f"hydra.sweep.dir={sweep_dir}", cwd=sweep_dir.parent)


def assert_one_wandb_run_per_trial(job: dict, sweep_dir) -> None:
    """The trial's own W&B run, in the sweep's group, named and configured by its settings,
    with the objective's best value and the value handed to the sweeper in its summary."""
    [log] = glob.glob(os.path.join(job["run_dir"], "wandb", "offline-run-*", "*.wandb"))
    records = read_wandb_records(Path(log))
    [run] = of_type(records, "run")
    config = items(run.config.update)
    lr = next(o for o in job["overrides"] if o.startswith("optimizer.lr="))
    assert config["choices"]["model"] == "gpt2-tiny"
    assert config["optimizer"]["lr"] == float(lr.split("=")[1])
    assert run.run_group == sweep_dir.name and lr in run.display_name
    assert [e.exit_code for e in of_type(records, "exit")] == [0]
    summary = {}
    for update in of_type(records, "summary"):
        summary.update(items(update.update))
    assert summary["eval/loss"] == {"min": pytest.approx(job["objective_value"])}
    assert summary["objective"] == pytest.approx(job["objective_value"])


def trial_states(sweep_dir) -> list[str]:
    import optuna

    study = optuna.load_study(study_name="flaxlm-lr-wd",
                              storage=f"sqlite:///{sweep_dir}/optuna.db")
    return [trial.state.name for trial in study.trials]


def statuses(sweep_dir) -> list[dict]:
    paths = glob.glob(os.path.join(sweep_dir, "job-status", "*.json"))
    records = [json.loads(Path(path).read_text()) for path in paths]
    return sorted(records, key=lambda r: r["job"])


@pytest.mark.slow
def test_an_optuna_search_names_its_best_trial_and_the_same_command_continues_it(tmp_path,
                                                                                   capsys,
                                                                                   train_cli):
    sweep_dir = tmp_path / "sweep"
    result = optuna_sweep(train_cli, sweep_dir, "hydra.sweeper.n_trials=2",
                          "logger=[wandb,tensorboard]")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = statuses(sweep_dir)
    assert [job["status"] for job in jobs] == ["ok"] * 2
    # Each trial trained in its own run dir, with the learning rate Optuna chose for it.
    run_dirs = {job["run_dir"] for job in jobs}
    assert len(run_dirs) == 2 and all(d.startswith(str(sweep_dir)) for d in run_dirs)
    for job in jobs:
        config = OmegaConf.load(os.path.join(job["run_dir"], "config.yaml"))
        lr = next(o for o in job["overrides"] if o.startswith("optimizer.lr="))
        assert config.optimizer.lr == float(lr.split("=")[1])
        assert job["objective"] == "eval/loss"
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    best = min(jobs, key=lambda job: job["objective_value"])
    assert results.best_value == pytest.approx(best["objective_value"])
    assert f"optimizer.lr={results.best_params['optimizer.lr']}" in best["overrides"]
    assert trial_states(sweep_dir) == ["COMPLETE"] * 2
    for job in jobs:  # a TensorBoard run and a W&B run of its own
        assert glob.glob(os.path.join(job["run_dir"], "tensorboard", "events.out.tfevents.*"))
        assert_one_wandb_run_per_trial(job, sweep_dir)

    # flaxlm-report on the real sweep: every trial, best first, the swept settings as columns.
    report_main([str(sweep_dir), "--out", str(tmp_path / "report")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "optimizer.lr", "optimizer.weight_decay"]
    rows = [line.split() for line in lines[2:4]]
    ranked = sorted(jobs, key=lambda job: job["objective_value"])
    assert [row[0] for row in rows] == [f"sweep/{os.path.basename(job['run_dir'])}"
                                        for job in ranked]
    assert [row[-1] for row in rows] == ["finished"] * 2
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == [
        "curves.png", "eval_loss_vs_optimizer_lr.png", "eval_loss_vs_optimizer_weight_decay.png"]

    leave_a_trial_running(sweep_dir)  # as a sweep killed during a trial does
    result = optuna_sweep(train_cli, sweep_dir, "hydra.sweeper.n_trials=1")  # one more trial
    assert result.returncode == 0, result.stderr[-3000:]
    assert trial_states(sweep_dir) == ["COMPLETE"] * 2 + ["FAIL", "COMPLETE"]
    # The continued study went on sampling: the new trial is none of the earlier ones.
    tried = trial_params(sweep_dir)
    assert len(set(tried)) == len(tried) == 4
    # The first invocation's statuses are kept; the summary is about the new job.
    assert {job["run_dir"] for job in statuses(sweep_dir)} >= run_dirs
    assert len(statuses(sweep_dir)) == 3
    assert f"multirun in {sweep_dir}: 1 ok\n" in result.stdout
    assert "not shown: 2 job(s) of earlier invocations" in result.stdout
    run_dirs |= {job["run_dir"] for job in statuses(sweep_dir)}
    assert len(run_dirs) == 3  # the new trial did not land in (and resume) an old one's


@pytest.mark.slow
def test_a_continued_study_fails_what_a_killed_sweep_left_running_and_samples_anew(tmp_path):
    """A sweep killed during a trial leaves the trial RUNNING and its job "running"; the next
    invocation in the directory marks both failed, unless another invocation still runs there,
    and moves the sampler's seed past the trials already tried."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from optuna.trial import TrialState

    from flaxlm.cli.sweep import HydraCallbacks
    from flaxlm.layout import SWEEP_LOCK_FILE

    study = stored_study(tmp_path)
    done = study.ask(search_space())
    study.tell(done, 1.0)
    leave_a_trial_running(tmp_path)
    finished = SweepJob(str(tmp_path), 0, ["optimizer.lr=0.1"], str(tmp_path / "0_a"))
    finished.done("eval/loss", 1.0)
    killed = SweepJob(str(tmp_path), 1, ["optimizer.lr=0.2", "samples.prompts=[]"],
                      str(tmp_path / "1_a"))
    killed.started()
    os.makedirs(tmp_path / "1_a" / "checkpoints" / "4")  # the run it trained is resumable
    config = compose(["hparams_search=optuna-lr-wd", f"hydra.sweep.dir={tmp_path}"],
                     return_hydra_config=True)

    def continue_sweep() -> int:
        callbacks = HydraCallbacks()
        callbacks.on_multirun_start(config)
        os.close(callbacks.lock)
        return config.hydra.sweeper.sampler.seed

    # Another invocation still runs in the directory: its trial and job are alive.
    other = os.open(tmp_path / SWEEP_LOCK_FILE, os.O_CREAT | os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_SH)
    continue_sweep()
    assert trial_states(tmp_path) == ["COMPLETE", "RUNNING"]
    assert [job["status"] for job in statuses(tmp_path)] == ["ok", "running"]
    os.close(other)

    config.hydra.sweeper.sampler.seed = 0
    assert continue_sweep() == 2  # the configured seed plus the trials already tried
    assert trial_states(tmp_path) == ["COMPLETE", "FAIL"]
    ok, interrupted = statuses(tmp_path)
    assert ok["status"] == "ok"
    assert interrupted["status"] == "failed"
    assert interrupted["reason"] == (
        "the sweep was stopped while this job ran; its checkpoint continues with: flaxlm-train "
        f"optimizer.lr=0.2 'samples.prompts=[]' resume_from={tmp_path / '1_a'}")
    assert study.get_trials(states=(TrialState.RUNNING,)) == []


def search_space() -> dict:
    """conf/hparams_search/optuna-lr-wd.yaml's, as Optuna's distributions."""
    from optuna.distributions import LogUniformDistribution

    return {"optimizer.lr": LogUniformDistribution(1e-5, 1e-2),
            "optimizer.weight_decay": LogUniformDistribution(1e-4, 0.3)}


def stored_study(sweep_dir):
    import optuna

    return optuna.create_study(study_name="flaxlm-lr-wd", direction="minimize",
                               storage=f"sqlite:///{sweep_dir}/optuna.db", load_if_exists=True)


def leave_a_trial_running(sweep_dir) -> None:
    stored_study(sweep_dir).ask(search_space())


def trial_params(sweep_dir) -> list[tuple]:
    return [tuple(sorted(trial.params.items())) for trial in stored_study(sweep_dir).trials]


@pytest.mark.slow
def test_a_failed_trial_is_recorded_and_the_search_goes_on(tmp_path, train_cli):
    sweep_dir = tmp_path / "sweep"
    result = optuna_sweep(train_cli, sweep_dir, "hydra.sweeper.n_trials=3",
                          "optimizer.weight_decay=0.01", "optimizer.lr=choice(nan,0.001)")
    assert result.returncode == 1, result.stderr[-3000:]
    states = trial_states(sweep_dir)
    assert sorted(states) == ["COMPLETE", "COMPLETE", "FAIL"]
    jobs = statuses(sweep_dir)
    failed = jobs[states.index("FAIL")]
    assert failed["status"] == "failed" and "optimizer.lr=nan" in failed["reason"]
    assert f"flaxlm: multirun in {sweep_dir}: 2 ok, 1 failed" in result.stdout
    assert OmegaConf.load(sweep_dir / "optimization_results.yaml").best_params == {
        "optimizer.lr": 0.001}


def test_a_job_hands_optuna_a_number_or_none_and_records_its_objective(tmp_path):
    """None, not NaN, is what makes Optuna's sweeper record a failed trial and go on."""
    job = SweepJob(str(tmp_path), 0, ["optimizer.lr=1"], str(tmp_path / "0"))
    assert job.done("eval/f1", 0.75) == 0.75
    assert statuses(tmp_path)[0] == {
        "job": 0, "status": "ok", "reason": "eval/f1 0.7500", "overrides": ["optimizer.lr=1"],
        "run_dir": str(tmp_path / "0"), "objective": "eval/f1", "objective_value": 0.75}
    assert job.done("eval/pearson", math.nan) is None
    assert job.failed("optimizer.lr=nan is not a finite number") is None
    assert statuses(tmp_path)[0]["status"] == "failed"


# --- W&B sweeps -----------------------------------------------------------------------------

WANDB_SWEEP = Path(__file__).parent.parent / "examples" / "wandb-sweep.yaml"


def _agent_commands(sweep: dict):
    """The commands a W&B agent runs for the sweep's extreme values (every listed value, each
    distribution's bounds), its arguments formatted by wandb's own code."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    choices = {}
    for name, spec in sweep["parameters"].items():
        choices[name] = (spec["values"] if "values" in spec else
                         [spec["value"]] if "value" in spec else [spec["min"], spec["max"]])
    longest = max(len(values) for values in choices.values())
    for index in range(longest):
        values = {name: options[index % len(options)] for name, options in choices.items()}
        macros = create_sweep_command_args({"args": {k: {"value": v} for k, v in
                                                     values.items()}})
        macros["program"] = [sweep["program"]]
        command = []
        for part in sweep["command"]:
            command += macros[part[2:-1]] if part.startswith("${") else [part]
        yield values, command


@pytest.mark.slow
def test_the_wandb_sweep_example_runs_flaxlm_train_with_arguments_that_compose():
    text = WANDB_SWEEP.read_text()
    sweep = yaml.safe_load(text)
    assert sweep["metric"]["name"] == OBJECTIVE_SUMMARY
    commands = list(_agent_commands(sweep))
    assert len(commands) == 3
    for values, command in commands:
        assert command[0] == "flaxlm-train" and len(command) == 1 + len(values)
        cfg = compose([*TINY, *command[1:]])
        for name, value in values.items():
            assert OmegaConf.select(cfg, name) == value, name
        check_settings(OmegaConf.to_object(cfg), 8)  # a trial would start


def test_a_run_started_by_a_wandb_agent_belongs_to_its_sweep(tmp_path, monkeypatch):
    """The agent assigns the W&B run id; a run under another id would not be in the sweep."""
    config = OmegaConf.to_object(compose(TINY, run_dir=tmp_path / "alone"))
    run = open_run_dir(config, {})
    run.release()
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep123")
    monkeypatch.setenv("WANDB_RUN_ID", "agentrun")
    config = OmegaConf.to_object(compose(TINY, run_dir=tmp_path / "trial"))
    trial = open_run_dir(config, {})
    trial.release()
    assert trial.wandb_run_id == "agentrun" and run.wandb_run_id != "agentrun"


@pytest.mark.parametrize("overrides, direction, ok", [
    ([], "minimize", True),
    ([], "maximize", False),
    (["task=classify", "task.num_labels=2"], "minimize", False),  # eval/f1: higher is better
    (["task=classify", "task.num_labels=2"], "maximize", True),
    (["trainer.objective=eval/perplexity"], None, True),  # a grid sweep has no direction
])
def test_an_optuna_direction_against_the_objective_stops_the_sweep(overrides, direction, ok):
    cfg = compose([*TINY, *overrides])
    if ok:
        check_sweep_direction(direction, cfg)
    else:
        with pytest.raises(FlaxlmError, match=r"hydra\.sweeper\.direction=.*Add hydra\.sweeper"):
            check_sweep_direction(direction, cfg)
