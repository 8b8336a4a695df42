"""flaxlm-report on a multirun directory made by hand: three runs with different learning rates,
one of them failed, as flaxlm-train and its sweep callbacks lay them out."""

from __future__ import annotations

import itertools
import json
import os
import struct

import pytest
import yaml

from flaxlm.cli.report import main
from flaxlm.layout import CONFIG_FILE, JOB_STATUS_SUBDIR, METRICS_FILE

MAX_STEPS = 20


def _write_run(run_dir, lr: float, eval_losses: list[float], last_step: int = MAX_STEPS,
               accuracies: list[float] = (), trainer: dict | None = None):
    os.makedirs(run_dir)
    config = {"run_dir": str(run_dir), "seed": 0,
              "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.01},
              "trainer": {"max_steps": MAX_STEPS, "eval_every_steps": 10, **(trainer or {})}}
    with open(os.path.join(run_dir, CONFIG_FILE), "w") as f:
        yaml.safe_dump(config, f)
    eval_steps = [0, 10, 20][: len(eval_losses)]
    records = []
    for step in range(5, last_step + 1, 5):
        records.append({"step": step, "time": 1000.0 + step, "train/loss": 5.0 - step * lr * 10,
                        "tokens_seen": step * 512})
    for step, loss, accuracy in itertools.zip_longest(eval_steps, eval_losses, accuracies):
        record = {"step": step, "time": 1000.0 + step, "tokens_seen": step * 512,
                  "eval/loss": loss, "eval/perplexity": 2.0 ** loss}
        records.append(record if accuracy is None else {**record, "eval/accuracy": accuracy})
    records.sort(key=lambda r: r["step"])
    records.append({"step": last_step, "time": 1000.0 + last_step,
                    "samples": [{"prompt": "a", "text": "b"}]})  # a logged table, not a metric
    with open(os.path.join(run_dir, METRICS_FILE), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _write_status(sweep_dir, job: int, status: str):
    os.makedirs(sweep_dir / JOB_STATUS_SUBDIR, exist_ok=True)
    record = {"job": job, "status": status, "reason": "x", "overrides": [],
              "run_dir": str(sweep_dir / str(job))}
    (sweep_dir / JOB_STATUS_SUBDIR / f"{job}.json").write_text(json.dumps(record))


@pytest.fixture
def sweep_dir(tmp_path):
    sweep = tmp_path / "multirun"
    _write_run(sweep / "0", 1e-4, [4.0, 3.5, 3.2])  # middle
    _write_run(sweep / "1", 1e-3, [4.0, 3.0, 2.5])  # best
    _write_run(sweep / "2", 1e-2, [4.0, 4.5], last_step=12)  # diverged and failed
    _write_status(sweep, 0, "ok")
    _write_status(sweep, 1, "ok")
    _write_status(sweep, 2, "failed")
    return sweep


def test_report_table_plots_and_markdown(sweep_dir, tmp_path, capsys):
    out = tmp_path / "report"
    main([str(sweep_dir), "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0].split(), [line.split() for line in lines[2:5]]
    # Only the setting that differs is a column; the run's own directory is not.
    assert header[:2] == ["run", "optimizer.lr"]
    assert "optimizer.weight_decay" not in lines[0] and "run_dir" not in lines[0]
    assert "eval/perplexity" not in lines[0]  # the loss again, in other units
    # Sorted by the best eval loss; the failed job from its status file.
    assert [row[0] for row in rows] == ["multirun/1", "multirun/0", "multirun/2"]
    assert [row[1] for row in rows] == ["0.001", "0.0001", "0.01"]
    assert [row[-1] for row in rows] == ["finished", "finished", "failed"]
    assert header[2:6] == ["final", "eval/loss", "best", "eval/loss"]
    by_name = {row[0]: row for row in rows}
    assert by_name["multirun/2"][2:4] == ["4.5", "4"]  # final 4.5, best 4.0
    assert by_name["multirun/1"][2:4] == ["2.5", "2.5"]
    assert by_name["multirun/1"][4:6] == ["20", "10,240"]  # steps, tokens seen
    assert by_name["multirun/2"][4] == "12"
    assert by_name["multirun/1"][6] == "0m20s"  # first to last logged record
    assert lines[5] == "  multirun/2: failed: x"  # the reason its status file gives
    assert lines[6].startswith(f"flaxlm: wrote {out / 'report.md'}")

    plots = ["curves.png", "eval_loss_vs_optimizer_lr.png"]
    for name in [*plots, "report.md"]:
        assert (out / name).stat().st_size > 0
    assert _png_height(out / "curves.png") == 640  # losses against steps, and against tokens
    assert sorted(p.name for p in out.glob("*.png")) == plots
    markdown = (out / "report.md").read_text()
    assert "| run | optimizer.lr |" in markdown
    assert "| multirun/1 | 0.001 |" in markdown
    assert all(f"]({name})" in markdown for name in plots)


def test_run_dirs_maximized_objective_and_default_out(tmp_path, capsys):
    # Runs given one by one, without status files: finished when they reached max_steps.
    _write_run(tmp_path / "a", 1e-4, [4.0, 3.5, 3.2])
    _write_run(tmp_path / "b", 1e-3, [4.0, 3.0], last_step=10)
    main([str(tmp_path / "a"), str(tmp_path / "b"), "--objective", "eval/loss", "--maximize"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert [row[0] for row in rows] == ["a", "b"]  # highest best loss (4.0 ties) → given order
    assert [row[-1] for row in rows] == ["finished", "unknown"]
    assert (tmp_path / "a" / "report.md").stat().st_size > 0


@pytest.mark.parametrize("case", ["missing", "not_a_run", "empty_metrics", "no_objective"])
def test_bad_input_is_one_error_line(tmp_path, capsys, case):
    path = tmp_path / "run"
    argv = [str(path)]
    if case == "not_a_run":
        path.mkdir()
        (path / "notes.txt").write_text("hi")
    elif case == "empty_metrics":
        _write_run(path, 1e-3, [3.0])
        (path / METRICS_FILE).write_text("")
    elif case == "no_objective":
        _write_run(path, 1e-3, [3.0])
        argv += ["--objective", "eval/f1", "--maximize"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flaxlm: error: ") and "\n" not in err
    expected = {"missing": "does not exist", "not_a_run": "neither a run directory",
                "empty_metrics": "holds no metrics", "no_objective": "No run logged eval/f1"}
    assert expected[case] in err


def test_an_unwritable_report_folder_is_one_error_line(tmp_path, capsys, unwritable):
    """Issue 20's class of defect: a read-only --out ended flaxlm-report in an OSError
    traceback."""
    _write_run(tmp_path / "run", 1e-3, [3.0])
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "run"), "--out", str(unwritable / "report")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flaxlm: error: --out={unwritable / 'report'} is not a directory "
                          "flaxlm can write to") and "\n" not in err


def test_a_continued_optuna_study_reports_every_trial_with_its_own_status(tmp_path, capsys):
    """The Optuna preset names job folders `<job>_<time>`, and a continued study numbers its
    new trials from 0 again: each status is matched by its run directory."""
    sweep = tmp_path / "study"
    _write_run(sweep / "0_09-00-00_000001", 1e-4, [4.0, 3.5, 3.2])
    _write_run(sweep / "0_09-30-00_000001", 1e-2, [4.0, 4.5], last_step=12)
    for name, status in (("0_09-00-00_000001", "ok"), ("0_09-30-00_000001", "failed")):
        record = {"job": 0, "status": status, "reason": "x", "overrides": [],
                  "run_dir": str(sweep / name)}
        os.makedirs(sweep / JOB_STATUS_SUBDIR, exist_ok=True)
        (sweep / JOB_STATUS_SUBDIR / f"{name}.json").write_text(json.dumps(record))
    main([str(sweep), "--out", str(tmp_path / "report")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert [(row[0], row[-1]) for row in rows] == [("study/0_09-00-00_000001", "finished"),
                                                   ("study/0_09-30-00_000001", "failed")]


def _png_height(path) -> int:
    """A PNG's height in pixels, from its IHDR chunk."""
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


@pytest.mark.slow
def test_runs_are_sorted_by_the_objective_they_were_trained_for(tmp_path, capsys):
    """A classifier sweep saved trainer.objective=eval/accuracy (max): the report sorts by it
    without being told, and a flag still overrides it."""
    sweep = tmp_path / "sweep"
    trained_for = {"objective": "eval/accuracy", "objective_mode": "max"}
    _write_run(sweep / "0", 1e-4, [0.6, 0.5, 0.4], accuracies=[0.5, 0.6, 0.7], trainer=trained_for)
    _write_run(sweep / "1", 1e-3, [0.6, 0.55, 0.5], accuracies=[0.55, 0.8, 0.75],
               trainer=trained_for)
    main([str(sweep)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2:4] == ["final", "eval/accuracy"]
    assert [line.split()[0] for line in lines[2:4]] == ["sweep/1", "sweep/0"]  # best 0.8, 0.7
    main([str(sweep), "--objective", "eval/loss", "--out", str(tmp_path / "by-loss")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["sweep/0", "sweep/1"]  # 0.4, 0.5
    main([str(sweep), "--minimize", "--out", str(tmp_path / "worst-first")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["sweep/0", "sweep/1"]  # 0.5, 0.55


def _cut(path, n_bytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-n_bytes])


def test_a_cut_off_metrics_file_in_a_sweep_of_five_loses_only_its_last_line(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    for job in range(5):
        _write_run(sweep / str(job), 10.0 ** -(job + 1), [4.0, 3.5 - job / 10, 3.2 - job / 10])
        _write_status(sweep, job, "ok")
    _cut(sweep / "2" / METRICS_FILE, 40)  # the last line (the samples table) is cut off
    main([str(sweep), "--out", str(tmp_path / "report")])
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.splitlines()[2:7]]
    assert [row[0] for row in rows] == [f"multirun/{job}" for job in (4, 3, 2, 1, 0)]
    assert all(row[-1] == "finished" for row in rows)
    assert rows[2][2:4] == ["3", "3"]  # its evaluations are all there
    assert captured.err.count("warning") == 1
    assert f"{sweep / '2' / METRICS_FILE}, line 8 (the last), was cut off" in captured.err


def test_a_damaged_run_is_a_row_with_the_reason_and_the_others_are_reported(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    for job in range(3):
        _write_run(sweep / str(job), 10.0 ** -(job + 1), [4.0, 3.5, 3.0 + job / 10])
    metrics = sweep / "1" / METRICS_FILE
    lines = metrics.read_text().splitlines(keepends=True)
    lines[3] = lines[3][:20] + "\n"  # damaged in the middle: no stopped run does that
    metrics.write_text("".join(lines))
    (sweep / "2" / CONFIG_FILE).write_text("optimizer: {lr: [1\n")
    main([str(sweep), "--out", str(tmp_path / "report")])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:5]]
    assert [(row[0], row[-1]) for row in rows] == [
        ("multirun/0", "finished"), ("multirun/1", "damaged"), ("multirun/2", "damaged")]
    assert rows[1][1:-1] == ["-"] * (len(rows[1]) - 2)
    assert out[5].startswith(f"  multirun/1: damaged: {metrics}, line 4, is not a JSON object")
    assert out[6].startswith(f"  multirun/2: damaged: {sweep / '2' / CONFIG_FILE} is not a YAML")
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Runs that did not finish" in markdown and "- multirun/1: damaged: " in markdown


def test_a_cut_off_job_status_file_leaves_each_run_its_own_status(sweep_dir, tmp_path, capsys):
    from flaxlm.run_records import write_status

    write_status(str(sweep_dir / "2"), "failed", "FlaxlmError: the loss diverged at step 12")
    _cut(sweep_dir / JOB_STATUS_SUBDIR / "1.json", 10)
    main([str(sweep_dir), "--out", str(tmp_path / "report")])
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.splitlines()[2:5]]
    assert [(row[0], row[-1]) for row in rows] == [
        ("multirun/1", "finished"), ("multirun/0", "finished"), ("multirun/2", "failed")]
    assert "the job statuses in" in captured.err and "cannot be read" in captured.err
    assert "  multirun/2: failed: FlaxlmError: the loss diverged at step 12" in captured.out


def test_runs_of_which_none_can_be_read_are_one_error(tmp_path, capsys):
    _write_run(tmp_path / "a", 1e-3, [3.0])
    (tmp_path / "a" / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "a")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flaxlm: error: a is damaged: ") and "line 2" in err
    assert "\n" not in err


RUN = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.max_positions=64",
       "model.vocab_size=512", "hardware.per_device_batch_size=2", "logger=none",
       "hardware=cpu-8", "language.max_train_docs=12", "language.max_eval_docs=2",
       "trainer.max_steps=4", "trainer.log_every_steps=2", "checkpoint.every_steps=2",
       "trainer.eval_before_training=false", "samples.prompts=[]"]


@pytest.mark.slow
def test_preempted_failed_and_killed_runs_copied_out_of_their_sweep_keep_their_status(
        tmp_path, monkeypatch, capsys):
    """What each run recorded in its own directory: no sweep status files are needed."""
    import shutil

    from conftest import compose, stop_at

    from flaxlm.job import train
    from flaxlm.tracking import Tracker
    from flaxlm.training.stop import Preempted

    sweep, copies = tmp_path / "multirun", tmp_path / "copied"
    with monkeypatch.context() as patch:
        stop_at(patch, 2)
        with pytest.raises(Preempted):
            train(compose(RUN, run_dir=sweep / "0"))
    shutil.copytree(sweep / "0", copies / "preempted")
    train(compose(RUN, run_dir=sweep / "0"))  # resumed to its end
    shutil.copytree(sweep / "0", copies / "finished")
    log = Tracker.log

    def log_then_fail(self, metrics, step):
        log(self, metrics, step=step)
        if step == 2:
            raise RuntimeError("the host lost its disk")

    with monkeypatch.context() as patch:
        patch.setattr(Tracker, "log", log_then_fail)
        with pytest.raises(RuntimeError):
            train(compose(RUN, run_dir=sweep / "1"))
    shutil.copytree(sweep / "1", copies / "failed")
    # Killed outright while it ran (kill -9 records nothing): what its start recorded is left.
    shutil.copytree(sweep / "0", copies / "killed")
    status = json.loads((copies / "killed" / "status.json").read_text())
    (copies / "killed" / "status.json").write_text(json.dumps(
        {**status, "status": "running", "pid": _a_pid_that_is_gone()}))

    names = ["preempted", "finished", "failed", "killed"]
    capsys.readouterr()
    main([str(copies / name) for name in names] + ["--out", str(tmp_path / "report")])
    out = capsys.readouterr().out.splitlines()
    statuses = dict(line.split()[::len(line.split()) - 1] for line in out[2:6])
    assert statuses == {name: name for name in names}
    notes = {line.split(":")[0].strip(): line for line in out[6:9]}
    assert notes["preempted"] == ("  preempted: preempted: stopped by SIGTERM after step 2; "
                                  "checkpoint saved")
    assert notes["failed"] == "  failed: failed: RuntimeError: the host lost its disk"
    assert notes["killed"].startswith("  killed: killed: it stopped without recording how")
    assert out[9].startswith("flaxlm: wrote ")


def _a_pid_that_is_gone() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_run_with_losses_by_position_gets_their_plot_and_a_run_without_keeps_its_own(
        tmp_path, capsys):
    """positions.png plots a run's held-out loss by position bucket, read from its last
    evaluation that logged them; a run that logged none is reported beside it unharmed."""
    from flaxlm.report import POSITIONS_FILE, last_position_losses, read_run

    _write_run(tmp_path / "long", 1e-4, [4.0, 3.5, 3.2])
    _write_run(tmp_path / "short", 1e-3, [4.0, 3.0, 2.5])
    metrics = tmp_path / "long" / METRICS_FILE
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in records:
        if "eval/loss" in record:  # later positions predicted better, more so as it trains
            for start, stop, drop in ((0, 256, 0.0), (256, 512, 0.1), (512, 1024, 0.2)):
                key = f"eval/position/{start}-{stop}/loss"
                record[key] = record["eval/loss"] - drop * record["step"] / 10
                record[key.replace("/loss", "/perplexity")] = 2.0 ** record[key]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))

    out = tmp_path / "report"
    main([str(tmp_path / "long"), str(tmp_path / "short"), "--out", str(out)])
    assert last_position_losses(read_run(str(tmp_path / "long"), "long")) == [
        (0, 256, 3.2), (256, 512, pytest.approx(3.0)), (512, 1024, pytest.approx(2.8))]
    assert last_position_losses(read_run(str(tmp_path / "short"), "short")) == []
    assert (out / POSITIONS_FILE).stat().st_size > 0
    markdown = (out / "report.md").read_text()
    assert f"]({POSITIONS_FILE})" in markdown
    assert "- long: 0-256: 3.2, 256-512: 3, 512-1024: 2.8\n" in markdown
    assert "- short:" not in markdown
    # The positions' metrics are the loss again, by position: no table column of their own.
    assert "position" not in capsys.readouterr().out
