"""The one reader of metrics.jsonl (a cut-off last line skipped with a warning, a damaged line
anywhere else an error naming it) and the run's own status record, read back."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flaxlm.errors import FlaxlmError
from flaxlm.run_records import read_metrics, read_status, write_status

values = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                   st.text(max_size=12), st.booleans(), st.none(),
                   st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                            max_size=2), max_size=2))
records = st.lists(st.dictionaries(st.text(max_size=10), values, max_size=4)
                   .map(lambda metrics: {"step": 1, "time": 0.5, **metrics}), min_size=1,
                   max_size=6)


def read_with_warnings(path) -> tuple[list[dict], str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        log = read_metrics(str(path))
    return log.records, err.getvalue()


def same(a, b) -> bool:
    """Equal records, NaN equal to NaN (json.dumps writes it, as the tracker logs it)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logged=records, data=st.data())
def test_a_cut_off_last_line_is_skipped_with_a_warning_and_only_then(tmp_path, logged, data):
    text = "".join(json.dumps(record) + "\n" for record in logged)
    last_starts = len(text) - len(json.dumps(logged[-1])) - 1
    kept = data.draw(st.integers(last_starts, len(text)), label="characters kept")
    path = tmp_path / "metrics.jsonl"
    path.write_text(text[:kept], encoding="utf-8")
    read, warnings = read_with_warnings(path)
    # Only the newline gone: the record is whole. Nothing of it left: the file ends whole.
    torn = last_starts < kept < len(text) - 1
    assert same(read, logged[:-1] if kept < len(text) - 1 else logged)
    assert bool(warnings) == torn
    if torn:
        line = len(logged)
        assert warnings.count("\n") == 1 and f"{path}, line {line} (the last)" in warnings


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logged=records.filter(lambda logged: len(logged) >= 2), data=st.data())
def test_a_damaged_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, logged, data):
    lines = [json.dumps(record) + "\n" for record in logged]
    damaged = data.draw(st.integers(0, len(lines) - 2), label="damaged line")
    cut = data.draw(st.integers(0, len(lines[damaged]) - 2), label="characters kept")
    lines[damaged] = lines[damaged][:cut] + "\n"
    lines.insert(0, "\n")  # a blank line is no record, but it counts in the numbering
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    if not lines[damaged + 1].strip():  # cut to nothing: a blank line, skipped
        assert same(read_metrics(str(path)).records, logged[:damaged] + logged[damaged + 1:])
        return
    with pytest.raises(FlaxlmError) as error:
        read_metrics(str(path))
    assert f"{path}, line {damaged + 2}," in str(error.value)
    assert "\n" not in str(error.value)


def test_a_line_that_is_json_but_no_record_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(FlaxlmError, match="line 2, is not a JSON object"):
        read_metrics(str(path))


def test_a_missing_file_has_no_records(tmp_path):
    assert read_metrics(str(tmp_path / "metrics.jsonl")).records == []


def test_status_round_trip_and_a_run_whose_process_is_gone_reads_as_killed(tmp_path):
    write_status(str(tmp_path), "running")
    assert read_status(str(tmp_path))["status"] == "running"  # this process: alive
    write_status(str(tmp_path), "failed", "RuntimeError: boom\n  the rest of a traceback")
    record = read_status(str(tmp_path))
    assert (record["status"], record["reason"]) == ("failed", "RuntimeError: boom")
    assert math.isfinite(record["time"])

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    record = {**record, "status": "running", "pid": int(gone.stdout)}
    (tmp_path / "status.json").write_text(json.dumps(record), encoding="utf-8")
    assert read_status(str(tmp_path))["status"] == "killed"
    (tmp_path / "status.json").write_text(json.dumps({**record, "host": "elsewhere"}))
    assert read_status(str(tmp_path))["status"] == "running"  # cannot be checked from here
    (tmp_path / "status.json").write_text('{"status": "fin', encoding="utf-8")
    assert read_status(str(tmp_path)) is None


def test_a_status_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    write_status(str(tmp_path / "no-such-dir"), "failed", "disk full")
    assert "could not record the run's status (failed)" in capsys.readouterr().err


# --- every reader of metrics.jsonl follows that policy -------------------------------------------

LOGGED = [{"step": 2, "time": 1.0, "train/loss": 3.0},
          {"step": 2, "time": 2.0, "eval/loss": 2.5},
          {"step": 4, "time": 3.0, "train/loss": 2.0},
          {"step": 4, "time": 4.0, "eval/loss": 2.25}]


def _objective(run_dir: str) -> float:
    from flaxlm.config import ObjectiveMode, ObjectiveValue
    from flaxlm.tasks.objective import Objective, objective_result

    objective = Objective("eval/loss", ObjectiveMode.min, ObjectiveValue.best)
    return objective_result(objective, run_dir, {"eval/loss": float("nan")})


def _report_figures(run_dir: str) -> tuple:
    from flaxlm.report import read_run

    run = read_run(run_dir, "run")
    if run.status == "damaged":
        raise FlaxlmError(run.reason)
    return run.steps, run.best("eval/loss", maximize=False)


def _export_figures(run_dir: str) -> dict:
    from flaxlm.export import eval_metrics_at

    return eval_metrics_at(run_dir, 2)


def _rewound(run_dir: str) -> list[dict]:
    from flaxlm.tracking import Tracker

    tracker = Tracker(run_dir)
    tracker.rewind(4)
    tracker.finish()
    return read_metrics(f"{run_dir}/metrics.jsonl").records


READERS = {
    # reader: its answer from the first three records, which a cut-off fourth leaves
    "job.objective_result": (_objective, 2.5),
    "report.read_run": (_report_figures, (4, 2.5)),
    "export.eval_metrics_at": (_export_figures, {"steps": 2, "eval/loss": 2.5}),
    "tracking.Tracker.rewind": (_rewound, LOGGED[:3]),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_skips_a_cut_off_last_line_and_refuses_a_damaged_one(tmp_path, reader,
                                                                          capsys):
    read, answer = READERS[reader]
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(record) + "\n" for record in LOGGED)
    path.write_text(text[:-12], encoding="utf-8")  # killed mid-line
    assert read(str(tmp_path)) == answer
    assert "line 4 (the last), was cut off" in capsys.readouterr().err

    lines = text.splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:15] + "\n" + "".join(lines[2:]), encoding="utf-8")
    with pytest.raises(FlaxlmError, match=f"{path}, line 2, is not a JSON object"):
        read(str(tmp_path))


def test_rewind_keeps_a_last_record_that_lost_only_its_newline(tmp_path):
    from flaxlm.tracking import Tracker

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in LOGGED)[:-1])
    tracker = Tracker(str(tmp_path))
    assert tracker.rewind(4) == 0
    tracker.log({"train/loss": 1.5}, step=6)
    tracker.finish()
    assert [r["step"] for r in read_metrics(str(path)).records] == [2, 2, 4, 4, 6]
