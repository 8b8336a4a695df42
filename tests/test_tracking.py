"""Tests of `flaxlm.tracking`: metrics.jsonl, the W&B mode, a real offline W&B run read back
from its transaction log, and TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compose, config_node
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams.api_pb2 import Status
from wandb_records import items, of_type, offline_wandb_env, read_wandb_records

from flaxlm.config import LoggerConfig, TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.tracking import Tracker, resolve_mode, start_tracker

# --- metrics.jsonl --------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_tracker_without_wandb_appends_one_json_line_per_log(tmp_path):
    tracker = start_tracker(config_node("logger", ["logger=none"]), str(tmp_path), {}, name=None,
                            group=None)
    assert tracker.wandb_run is None and tracker.tensorboard is None
    tracker.log({"train/loss": np.float32(2.5), "lr": jnp.asarray(1e-3)}, step=1)
    tracker.log({"eval/loss": jnp.float32(1.25), "tokens": np.int64(4096), "note": "x"}, step=7)
    tracker.summary({"ignored": 1.0})
    tracker.finish()

    first, second = read_jsonl(tmp_path / "metrics.jsonl")
    assert {k: first[k] for k in ("step", "train/loss")} == {"step": 1, "train/loss": 2.5}
    assert first["lr"] == pytest.approx(1e-3)
    assert second == {"step": 7, "time": second["time"], "eval/loss": 1.25, "tokens": 4096,
                      "note": "x"}
    assert type(second["tokens"]) is int and type(second["eval/loss"]) is float
    assert first["time"] <= second["time"]
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "tensorboard").exists()


def test_tracker_appends_to_an_existing_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "time": 0.0}\n', encoding="utf-8")
    tracker = Tracker(str(tmp_path))
    for step in (1, 2, 3):
        tracker.log({"loss": np.float64(step / 2)}, step=step)
    tracker.finish()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(row["step"], row.get("loss")) for row in rows] == [(0, None), (1, 0.5), (2, 1.0),
                                                                 (3, 1.5)]


# --- W&B mode -------------------------------------------------------------------------------------


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """No W&B login anywhere: no env settings, an empty NETRC and HOME."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return monkeypatch


def write_netrc(path: Path, host: str) -> None:
    path.write_text(f"machine {host}\n  login user\n  password secret-key\n", encoding="utf-8")


@pytest.mark.parametrize("mode", ["online", "offline", "disabled"])
def test_explicit_mode_is_kept(wandb_env, mode):
    wandb_env.setenv("WANDB_MODE", "offline" if mode != "offline" else "online")
    wandb_env.setenv("WANDB_API_KEY", "key")
    assert resolve_mode(mode) == mode


@pytest.mark.parametrize("env_mode", ["offline", "online", "disabled"])
def test_auto_follows_wandb_mode_when_set(wandb_env, env_mode):
    wandb_env.setenv("WANDB_MODE", env_mode)
    wandb_env.setenv("WANDB_API_KEY", "key")  # would mean online if WANDB_MODE were not set
    assert resolve_mode("auto") == env_mode


def test_auto_is_offline_when_not_logged_in(wandb_env):
    assert resolve_mode("auto") == "offline"


def test_auto_is_online_with_an_api_key(wandb_env):
    wandb_env.setenv("WANDB_API_KEY", "key")
    assert resolve_mode("auto") == "online"


@pytest.mark.parametrize(
    ("base_url", "netrc_host", "expected"),
    [
        (None, "api.wandb.ai", "online"),
        (None, "example.com", "offline"),
        ("https://wandb.mycompany.net", "wandb.mycompany.net", "online"),
        ("https://wandb.mycompany.net", "api.wandb.ai", "offline"),
    ],
)
def test_auto_is_online_iff_netrc_has_the_wandb_host(wandb_env, tmp_path, base_url, netrc_host,
                                                     expected):
    if base_url:
        wandb_env.setenv("WANDB_BASE_URL", base_url)
    write_netrc(tmp_path / "netrc", netrc_host)
    assert resolve_mode("auto") == expected


def test_unparseable_netrc_counts_as_not_logged_in(wandb_env, tmp_path):
    (tmp_path / "netrc").write_text("this is not a netrc file api.wandb.ai\n", encoding="utf-8")
    assert resolve_mode("auto") == "offline"


def test_unknown_mode_names_the_setting():
    with pytest.raises(FlaxlmError, match=r"logger\.mode='onlin'"):
        resolve_mode("onlin")


# --- a real offline W&B run -----------------------------------------------------------------------

CONFIG = {"model": {"name": "gpt2-tiny", "num_layers": 2, "hidden_size": 64},
          "optimizer": {"lr": 3e-4, "schedule": "linear"}, "seed": 7, "task": {"name": "clm"},
          "choices": {"model": "gpt2-tiny", "optimizer": "adamw", "experiment": None}}
LOGGED = [(0, {"train/loss": np.float32(4.5), "train/lr": 0.0}),
          (10, {"train/loss": jnp.float32(3.25), "train/lr": 1e-4, "eval/loss": 2.25}),
          (20, {"train/loss": 2.0, "train/lr": 2e-4, "eval/loss": np.float64(2.5)})]


def offline_run(run_dir: Path, monkeypatch, exit_code: int | None) -> list:
    offline_wandb_env(run_dir, monkeypatch)
    run_dir.mkdir()
    logger = config_node("logger", ["logger=wandb"], mode="offline", tags=["test"])
    tracker = start_tracker(logger, str(run_dir), CONFIG, name="tiny-run", group="sweep-1",
                            objective="eval/loss", maximize=False)
    for step, metrics in LOGGED:
        tracker.log(metrics, step=step)
    tracker.summary({"final/loss": np.float32(1.5), "eval/loss": 2.5})
    if exit_code is None:
        tracker.finish()
    else:
        tracker.finish(exit_code=exit_code)
    assert tracker.wandb_run is None
    [log] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return read_wandb_records(log)


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> tuple[Path, list]:
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_dir, offline_run(run_dir, monkeypatch, exit_code=1)


def test_offline_run_history_holds_the_logged_values_at_their_steps(failed_run):
    _, records = failed_run
    history = of_type(records, "history")
    rows = [items(h.item) for h in history]
    assert [h.step.num for h in history] == [step for step, _ in LOGGED]
    assert [row["_step"] for row in rows] == [step for step, _ in LOGGED]
    for row, (_, metrics) in zip(rows, LOGGED):
        expected = {k: pytest.approx(float(v)) for k, v in metrics.items()}
        assert {k: row[k] for k in metrics} == expected


def test_offline_run_records_config_name_group_and_tags(failed_run):
    _, records = failed_run
    [run] = of_type(records, "run")
    config = items(run.config.update)
    for update in of_type(records, "config"):  # later config changes, if any
        config.update(items(update.update))
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert config["model"]["num_layers"] == 2  # nested, not flattened
    assert (run.display_name, run.run_group, run.project) == ("tiny-run", "sweep-1", "flaxlm")
    assert run.job_type == "clm"
    assert list(run.tags) == ["test", "model=gpt2-tiny", "optimizer=adamw"]


def test_offline_run_plots_every_metric_against_the_training_step(failed_run):
    _, records = failed_run
    metrics = {(m.name or m.glob_name): m.step_metric for m in of_type(records, "metric")}
    assert {k: metrics[k] for k in ("train/*", "eval/*")} == {"train/*": "step",
                                                               "eval/*": "step"}
    assert "step" in metrics and "tokens_seen" in metrics
    rows = [items(h.item) for h in of_type(records, "history")]
    assert [row["step"] for row in rows] == [step for step, _ in LOGGED]


def test_offline_run_summary_holds_the_final_values_and_the_best_objective(failed_run):
    _, records = failed_run
    summary = {}
    for update in of_type(records, "summary"):
        summary.update(items(update.update))
    assert summary["final/loss"] == 1.5
    # The objective's summary is its best (lowest) value, 2.25 at step 10, not the last 2.5.
    [objective] = [m for m in of_type(records, "metric") if m.name == "eval/loss"]
    assert objective.step_metric == "step" and objective.summary.min
    assert summary["eval/loss"] == {"min": 2.25}


def test_offline_run_also_writes_metrics_jsonl(failed_run):
    run_dir, _ = failed_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [step for step, _ in LOGGED]
    assert rows[1]["train/loss"] == 3.25


@pytest.mark.parametrize("exit_code", [None, 1])
def test_finish_records_the_exit_code(tmp_path, monkeypatch, failed_run, exit_code):
    records = failed_run[1] if exit_code == 1 else offline_run(tmp_path / "run", monkeypatch, None)
    [exit_record] = of_type(records, "exit")
    assert exit_record.exit_code == (exit_code or 0)


# --- TensorBoard ----------------------------------------------------------------------------------

SAMPLES = [("Once upon", "a time | there"), ("", "The end.")]


def tensorboard_run(run_dir: Path, logger: LoggerConfig, exit_code: int = 0):
    tracker = start_tracker(logger, str(run_dir), CONFIG, name="tiny-run", group="sweep-1")
    for step, metrics in LOGGED:
        tracker.log({**metrics, "note": "not a scalar"}, step=step)
    tracker.log_table("samples", ["prompt", "completion"], SAMPLES, step=20)
    tracker.finish(exit_code=exit_code)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    return tracker, events.Reload()




def test_tensorboard_holds_the_scalars_at_their_steps(tmp_path):
    _, events = tensorboard_run(tmp_path, config_node("logger", ["logger=tensorboard"]))
    assert sorted(events.Tags()["scalars"]) == ["eval/loss", "train/loss", "train/lr"]
    for key in ("train/loss", "train/lr", "eval/loss"):
        logged = [(step, pytest.approx(float(m[key]))) for step, m in LOGGED if key in m]
        assert [(e.step, e.value) for e in events.Scalars(key)] == logged
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["note"] == "not a scalar"


def test_tensorboard_holds_the_config_and_samples_as_text(tmp_path):
    _, events = tensorboard_run(tmp_path, config_node("logger", ["logger=tensorboard"]))

    def text(tag: str) -> tuple[int, str]:
        [event] = events.Tensors(f"{tag}/text_summary")
        return event.step, event.tensor_proto.string_val[0].decode()

    step, config = text("config")
    assert step == 0
    assert OmegaConf.create("\n".join(line[4:] for line in config.splitlines())) == CONFIG
    step, samples = text("samples")
    assert step == 20
    assert samples.splitlines() == ["| prompt | completion |", "| --- | --- |",
                                    "| Once upon | a time \\| there |", "|  | The end. |"]


@pytest.mark.parametrize(("exit_code", "status"), [(0, Status.STATUS_SUCCESS),
                                                   (1, Status.STATUS_FAILURE)])
def test_tensorboard_records_the_hyperparameters_and_how_the_run_ended(tmp_path, exit_code,
                                                                       status):
    _, events = tensorboard_run(tmp_path, config_node("logger", ["logger=tensorboard"]),
                                exit_code)
    content = events.PluginTagToContent("hparams")
    start = hparams_metadata.parse_session_start_info_plugin_data(
        content[hparams_metadata.SESSION_START_INFO_TAG])
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
              for k, v in start.hparams.items()}
    assert values["optimizer.lr"] == pytest.approx(3e-4)
    assert values["model.num_layers"] == 2 and values["seed"] == 7
    assert values["model.name"] == "gpt2-tiny" and values["choices.optimizer"] == "adamw"
    assert "choices.experiment" not in values  # unset
    end = hparams_metadata.parse_session_end_info_plugin_data(
        content[hparams_metadata.SESSION_END_INFO_TAG])
    assert end.status == status


def test_tensorboard_rewind_hides_what_came_after_the_checkpoint(tmp_path):
    tracker = start_tracker(config_node("logger", ["logger=tensorboard"]), str(tmp_path),
                            CONFIG, name=None, group=None)
    for step in (1, 2, 3):
        tracker.log({"train/loss": float(step)}, step=step)
    tracker.rewind(1)
    tracker.log({"train/loss": 20.0}, step=2)
    tracker.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]


def test_wandb_and_tensorboard_together_from_the_composed_logger_list(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    offline_wandb_env(run_dir, monkeypatch)
    run_dir.mkdir()
    logger = OmegaConf.to_object(compose(["logger=[wandb,tensorboard]"])).logger
    assert (logger.wandb, logger.tensorboard) == (True, True)
    tracker, events = tensorboard_run(run_dir, logger)
    assert tracker.wandb_run is None  # finished
    assert [e.step for e in events.Scalars("train/loss")] == [step for step, _ in LOGGED]
    [log] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = of_type(read_wandb_records(log), "history")
    assert [h.step.num for h in history] == [step for step, _ in LOGGED]
    # the table joins step 20's row
    assert any(key.startswith("samples") for key in items(history[-1].item))


@pytest.mark.parametrize(("option", "wandb", "tensorboard"), [
    ("logger=none", False, False), ("logger=tensorboard", False, True),
    ("logger=wandb", True, False), ("logger=[tensorboard,wandb]", True, True)])
def test_logger_options_compose_into_flags(option, wandb, tensorboard):
    config = OmegaConf.to_object(compose([option]))
    assert isinstance(config, TrainConfig)
    assert (config.logger.wandb, config.logger.tensorboard) == (wandb, tensorboard)


def test_a_transaction_log_read_while_its_tail_is_written_is_read_again(tmp_path):
    """`run.finish()` can return while wandb's service still writes the log's tail: a read
    that meets a chunk cut short (or not yet matching its checksum) is taken again, not
    failed, and only a log still torn after the wait is an error (a suite run under load
    once read such a tail and failed on its checksum)."""
    import struct
    import threading
    import zlib

    from wandb.proto import wandb_internal_pb2

    def chunk(record) -> bytes:
        data = record.SerializeToString()
        return struct.pack("<IHB", zlib.crc32(data, zlib.crc32(bytes([1]))), len(data), 1) + data

    history, finished = wandb_internal_pb2.Record(), wandb_internal_pb2.Record()
    history.history.item.add(key="train/loss", value_json="1.5")
    finished.exit.exit_code = 0
    whole = struct.pack("<4sHB", b":W&B", 0xBEE1, 0) + chunk(history) + chunk(finished)
    log = tmp_path / "run-x.wandb"
    log.write_bytes(whole[:-3])  # the exit record's last bytes not written yet
    with pytest.raises(AssertionError, match="fails its length or checksum"):
        read_wandb_records(log, wait_s=0)
    threading.Timer(0.5, log.write_bytes, [whole]).start()  # the service finishes writing
    records = read_wandb_records(log, wait_s=30)
    assert [r.WhichOneof("record_type") for r in records] == ["history", "exit"]
