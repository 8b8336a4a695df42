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
from flaxlm.cli.sweep import STATUS_SUBDIR
from flaxlm.layout import CONFIG_FILE, METRICS_FILE

MAX_STEPS = 20


def _write_run(run_dir, lr: float, eval_losses: list[float], last_step: int = MAX_STEPS,
               accuracies: list[float] = (), trainer: dict | None = None):
    os.makedirs(run_dir)
    config = {"run_dir": str(run_dir), "seed": 0,
              "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.01},
              "trainer": {"max_steps": MAX_STEPS, "eval_every": 10, **(trainer or {})}}
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
    os.makedirs(sweep_dir / STATUS_SUBDIR, exist_ok=True)
    record = {"job": job, "status": status, "reason": "x", "overrides": [],
              "run_dir": str(sweep_dir / str(job))}
    (sweep_dir / STATUS_SUBDIR / f"{job}.json").write_text(json.dumps(record))


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
    assert lines[5].startswith(f"flaxlm: wrote {out / 'report.md'}")

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
        os.makedirs(sweep / STATUS_SUBDIR, exist_ok=True)
        (sweep / STATUS_SUBDIR / f"{name}.json").write_text(json.dumps(record))
    main([str(sweep), "--out", str(tmp_path / "report")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert [(row[0], row[-1]) for row in rows] == [("study/0_09-00-00_000001", "finished"),
                                                   ("study/0_09-30-00_000001", "failed")]


def _png_height(path) -> int:
    """A PNG's height in pixels, from its IHDR chunk."""
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


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
