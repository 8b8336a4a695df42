"""flaxlm-report on runs in a bucket (issue 45): a run's output_url, or the folder above
several, read through fsspec from the GCS emulator of tests/buckets.py."""

from __future__ import annotations

import json
import os

import pytest
from conftest import assert_names
from test_report import _write_run

from flaxlm.cli.report import main


def put_run(bucket, tmp_path, key: str, lr: float, losses: list[float], status: str | None):
    """A run written locally by test_report's helper, copied to `<bucket>/<key>/` as a bucket
    run's output_url holds it (its small files, and checkpoints beside them)."""
    local = tmp_path / key.replace("/", "-")
    _write_run(local, lr, losses)
    if status:
        (local / "status.json").write_text(json.dumps({"status": status, "reason": "why"}))
    for name in os.listdir(local):
        bucket.put(f"{key}/{name}", (local / name).read_bytes())
    bucket.put(f"{key}/checkpoints/20/commit_success.txt", "ok")


def test_the_report_reads_a_folder_of_runs_and_one_run_from_the_bucket(gcs, tmp_path, capsys,
                                                                      monkeypatch):
    put_run(gcs, tmp_path, "runs/a", 1e-4, [4.0, 3.5, 3.2], "finished")
    put_run(gcs, tmp_path, "runs/b", 1e-3, [4.0, 3.0, 2.5], "preempted")
    gcs.put("runs/notes.txt", "not a run")
    monkeypatch.chdir(tmp_path)

    main([f"{gcs.url}/runs"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:4]]
    assert [row[:2] for row in rows] == [["runs/b", "0.001"], ["runs/a", "0.0001"]]
    assert [row[-1] for row in rows] == ["preempted", "finished"]
    assert lines[4] == "  runs/b: preempted: why"
    report = tmp_path / "report-runs" / "report.md"  # here, named after the bucket folder
    assert "| runs/b | 0.001 |" in report.read_text()

    main([f"{gcs.url}/runs/a/", "--out", str(tmp_path / "one")])  # one run's output_url
    [row] = [line.split() for line in capsys.readouterr().out.splitlines()[2:3]]
    assert row[0] == "a" and row[-1] == "finished"


@pytest.mark.parametrize(("where", "fragments"), [
    ("gs://no-such-bucket/runs", ("'gs://no-such-bucket/runs'", "does not exist")),
    ("{bucket}/empty", ("holds no run", "output_url")),
])
def test_a_bucket_url_without_runs_is_one_paragraph(gcs, tmp_path, capsys, monkeypatch, where,
                                                    fragments):
    monkeypatch.chdir(tmp_path)
    gcs.put("empty/x.txt", "x")
    with pytest.raises(SystemExit) as stop:
        main([where.format(bucket=gcs.url)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert_names(err, *fragments)
