"""A bucket run's final model/ in the bucket, and flaxlm-export --out gs://: what transformers
loads back from the bucket (an fsspec download) gives the local export's logits (issue 45).
Against the GCS emulator of tests/buckets.py."""

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
        bucket_run, gcs, tmp_path):
    import numpy as np
    import torch
    import transformers

    from flaxlm.cli import export as export_cli

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
