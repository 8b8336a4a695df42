"""A bucket run's final model/ in the bucket, and flaxlm-export --out gs://: what transformers
loads back from the bucket (an fsspec download) gives the local export's logits (issue 45).
The tools on a run in an S3 bucket: flaxlm-export from it to s3://, flaxlm-report and
flaxlm-eval on it. Against the GCS and S3 emulators of tests/buckets.py."""

from __future__ import annotations

import os

import pytest
from conftest import SHORT, assert_names

from flaxlm.errors import FlaxlmError
from flaxlm.export import MARKER
from flaxlm.storage import download_folder, upload_folder


def files_of(directory) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}


def bucket_names(bucket, key: str) -> list[str]:
    bucket.fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[-1] for path in bucket.fs.find(f"{bucket.name}/{key}"))


@pytest.fixture
def bucket_run(gcs, tmp_path, train_cli):
    """A one-step run with output_url in the emulated bucket: its local folder and its URL."""
    url, run_dir = f"{gcs.url}/runs/m", tmp_path / "run"
    result = train_cli(*SHORT, f"output_url={url}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"copied model/ to {url}/model" in result.stdout
    return run_dir, url


@pytest.mark.slow
@pytest.mark.torch
def test_the_final_model_and_flaxlm_export_to_a_bucket_load_back_through_transformers(
        bucket_run, gcs, tmp_path, capsys):
    import numpy as np
    import torch
    import transformers

    from flaxlm.cli import export as export_cli
    from flaxlm.cli import generate as generate_cli

    run_dir, url = bucket_run
    # The run's own model/, copied whole to <output_url>/model/, marker included.
    download_folder(f"{url}/model", str(tmp_path / "final"), "test")
    assert files_of(tmp_path / "final") == files_of(run_dir / "model")
    assert MARKER in os.listdir(tmp_path / "final")

    local = export_cli.run([str(run_dir), "--out", str(tmp_path / "local")])
    assert export_cli.run([str(run_dir), "--out", f"{gcs.url}/models/a"]) == f"{gcs.url}/models/a"
    download_folder(f"{gcs.url}/models/a", str(tmp_path / "downloaded"), "test")
    tokens = torch.tensor([[5, 17, 3, 42, 8, 11]])
    logits = []
    for directory in (local, tmp_path / "downloaded"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits.numpy())
    np.testing.assert_array_equal(logits[0], logits[1])
    # The bucket run itself (its output_url: the checkpoint read from the bucket through orbax,
    # the tokenizer from its model/) exports and generates as the local run does.
    from_bucket = export_cli.run([url, "--out", str(tmp_path / "from-bucket")])
    assert files_of(from_bucket)["model.safetensors"] == files_of(local)["model.safetensors"]
    assert f"exported {url} checkpoint step 1" in capsys.readouterr().out
    prompt = [["--prompt", "Return the", "--greedy", "--max-new-tokens", "4"]]
    assert generate_cli.run([url, *prompt[0]]) == generate_cli.run([str(run_dir), *prompt[0]])
    # An export again over the earlier one replaces it; a run's folder is never replaced.
    export_cli.run([str(run_dir), "--out", f"{gcs.url}/models/a"])
    with pytest.raises(FlaxlmError) as error:
        export_cli.run([str(run_dir), "--out", url])
    assert_names(error.value, f"--out {url}", "holds a flaxlm run", "metrics.jsonl")


def test_a_folder_copied_to_a_bucket_counts_once_its_marker_is_there(gcs, tmp_path,
                                                                    monkeypatch):
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, names in ((old, ["a.json", "gone.bin", MARKER]), (new, ["a.json", MARKER])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(f"{folder.name} {name}")
    url = f"{gcs.url}/model"
    upload_folder(str(old), url, "test", MARKER)
    assert bucket_names(gcs, "model") == ["a.json", MARKER, "gone.bin"]

    # A copy cut short (here: at its first file) leaves no marker, so no folder that looks whole.
    import fsspec

    def cut_short(local, remote, **kwargs):
        raise OSError("connection reset")

    with monkeypatch.context() as patch:
        patch.setattr(fsspec.filesystem("gs"), "put_file", cut_short)  # the one flaxlm uses
        with pytest.raises(FlaxlmError) as error:
            upload_folder(str(new), url, "test", MARKER)
    assert_names(error.value, f"'{url}'", "could not write to")
    assert bucket_names(gcs, "model") == ["a.json", "gone.bin"]  # the old marker deleted first

    upload_folder(str(new), url, "test", MARKER)  # the next copy: the new folder, whole
    assert bucket_names(gcs, "model") == ["a.json", MARKER]
    download_folder(url, str(tmp_path / "back"), "test")
    assert files_of(tmp_path / "back") == files_of(new)


def test_flaxlm_export_refuses_a_bucket_folder_it_did_not_write(gcs, tmp_path, capsys):
    from flaxlm.cli import export as export_cli

    gcs.put("mine/notes.txt", "mine")
    for out, fragments in ((f"{gcs.url}/mine", ("is not a flaxlm export", MARKER)),
                           ("gs://no-such-bucket/m", ("'gs://no-such-bucket'", "does not exist"))):
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(tmp_path / "no-run"), "--out", out])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert_names(err, "--out", *fragments)
    assert bucket_names(gcs, "mine") == ["notes.txt"]


def test_the_model_folder_a_run_starts_with_is_copied_once_without_a_marker(gcs, tmp_path):
    from flaxlm.run_mirror import upload_run_files

    run_dir = tmp_path / "run"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "tokenizer.json").write_text("{}")
    (run_dir / "config.yaml").write_text("seed: 0\n")
    upload_run_files(str(run_dir), f"{gcs.url}/r")
    assert bucket_names(gcs, "r") == ["config.yaml", "tokenizer.json"]  # no marker: not final
    (run_dir / "model" / "tokenizer.json").write_text('{"changed": 1}')
    upload_run_files(str(run_dir), f"{gcs.url}/r")  # copied once: at the next evaluation or save
    assert gcs.fs.cat_file(f"{gcs.name}/r/model/tokenizer.json") == b"{}"


@pytest.mark.parametrize(("where", "fragments"), [
    ("gs://no-such-bucket/runs/a", ("'gs://no-such-bucket'", "does not exist")),
    ("{bucket}/runs/none", ("{bucket}/runs/none holds no flaxlm run", "output_url")),
])
def test_a_bucket_run_that_is_not_there_is_one_paragraph(gcs, capsys, where, fragments):
    from flaxlm.cli import generate as generate_cli

    with pytest.raises(SystemExit) as stop:
        generate_cli.main([where.format(bucket=gcs.url), "--prompt", "a"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert_names(err, *(fragment.format(bucket=gcs.url) for fragment in fragments))


@pytest.mark.parametrize(("objects", "found"), [
    ([], "no object is stored under it"),
    (["notes.txt", "metrics.jsonl"], "it holds metrics.jsonl, notes.txt, but no config.yaml "
                                     "and no model/"),
])
def test_an_s3_folder_without_a_run_says_what_it_holds_in_its_own_scheme(s3, capsys, objects,
                                                                         found):
    """Failed before: "holds no flaxlm run (nothing)", and a gs:// example for an s3:// URL."""
    from flaxlm.cli import generate as generate_cli

    for name in objects:
        s3.put(f"runs/none/{name}", "x")
    with pytest.raises(SystemExit) as stop:
        generate_cli.main([f"{s3.url}/runs/none", "--prompt", "a"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert_names(err, f"{s3.url}/runs/none holds no flaxlm run: {found}.",
                 "e.g. s3://<bucket>/runs/<name>", "output_url")
    assert "gs://" not in err


def test_flaxlm_eval_on_a_bucket_run_puts_its_results_beside_the_checkpoints(gcs, tmp_path):
    import json

    from flaxlm.downstream import record_bucket_results
    from flaxlm.harness import HarnessResults

    results = HarnessResults({"results": {"arc": {"acc": 0.5}}}, {"eval/arc/acc": 0.5}, "table")
    record_bucket_results(f"{gcs.url}/runs/a/", str(tmp_path), 8, results)
    written = json.loads(gcs.fs.cat_file(f"{gcs.name}/runs/a/eval/harness-8.json"))
    assert written == {"step": 8, "results": {"arc": {"acc": 0.5}}}


# --- the tools on a run whose output_url is in an S3 bucket (moto) -------------------------------


@pytest.fixture
def s3_run(s3, tmp_path, train_cli):
    """A one-step run with output_url in the emulated S3 bucket: its local folder and URL."""
    url, run_dir = f"{s3.url}/runs/m", tmp_path / "run"
    result = train_cli(*SHORT, f"output_url={url}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, url


@pytest.mark.slow  # several seconds: make test runs it
def test_an_s3_run_exports_to_s3_and_is_reported_from_the_bucket(s3_run, s3, tmp_path, capsys):
    from flaxlm.cli import export as export_cli
    from flaxlm.cli.report import main as report

    run_dir, url = s3_run
    local = export_cli.run([str(run_dir), "--out", str(tmp_path / "local")])
    # The checkpoint read from the bucket through orbax's s3 driver, the export uploaded there.
    out = f"{s3.url}/models/a"
    assert export_cli.run([url, "--out", out]) == out
    download_folder(out, str(tmp_path / "downloaded"), "test")
    downloaded = files_of(tmp_path / "downloaded")
    assert downloaded["model.safetensors"] == files_of(local)["model.safetensors"]
    assert MARKER in downloaded
    capsys.readouterr()
    report([url, "--out", str(tmp_path / "report")])
    [row] = [line.split() for line in capsys.readouterr().out.splitlines()[2:3]]
    assert row[0] == "m" and row[-1] == "finished"
    assert (tmp_path / "report" / "report.md").exists()


@pytest.mark.slow
@pytest.mark.harness
def test_flaxlm_eval_on_an_s3_run_puts_its_results_in_the_bucket(s3_run, s3, tmp_path):
    import json

    from test_harness import write_tasks

    from flaxlm.cli.eval import run

    run_dir, url = s3_run
    (tmp_path / "tasks").mkdir()
    tasks = write_tasks(tmp_path / "tasks")
    metrics = run([url, "--tasks", "tiny_mc", "--include-path", str(tasks), "--limit", "4",
                   "--batch-size", "4"])
    s3.fs.invalidate_cache()
    written = json.loads(s3.fs.cat_file(f"{s3.name}/runs/m/eval/harness-1.json"))
    assert written["step"] == 1
    assert written["results"]["tiny_mc"]["acc,none"] == metrics["eval/tiny_mc/acc"]
    # the run's own metrics.jsonl is left as the run wrote it
    assert s3.fs.cat_file(f"{s3.name}/runs/m/metrics.jsonl") == (
        run_dir / "metrics.jsonl").read_bytes()
