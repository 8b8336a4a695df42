"""`train(cfg)`: one job, from a composed config to a trained model, for any task.

The job owns what every run needs whatever it trains: the platform and the device mesh, the
compilation cache, the run directory (fresh, or a stopped run resumed), the tracker (W&B and
metrics.jsonl), the checkpointer, and the SIGTERM / SIGINT handler. It hands these, as a
`JobContext`, to the one pipeline (`flaxlm.tasks.pipeline`), which runs the task named by
`task.name` (`flaxlm.tasks.registry`). This is the config edge: the composed config becomes
typed objects here. The job wires pieces that live elsewhere: the objective
(`flaxlm.tasks.objective`), the run directory (`flaxlm.runs`), checkpoints
(`flaxlm.training.checkpoint`) and stopping (`flaxlm.training.stop`).

On several hosts (hardware.distributed) every process runs this same job: process 0 decides
the run directory and whether it resumes and tells the others, writes the run's files and
its W&B run alone; a stop signal is acted on at one agreed step by every process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import jax
from omegaconf import DictConfig, OmegaConf

from flaxlm import distributed, storage_retry
from flaxlm.config import ObjectiveMode, TrainConfig
from flaxlm.errors import FlaxlmError, writable_dir
from flaxlm.lazy_imports import import_in_background
from flaxlm.models.attention import kernel_compile_error
from flaxlm.parallel import (
    check_context_axis,
    check_expert_axis,
    configure_platform,
    make_mesh,
)
from flaxlm.run_mirror import RunMirror, upload_exports
from flaxlm.run_records import FAILED, FINISHED, PREEMPTED, RUNNING, write_status
from flaxlm.runs import open_shared_run_dir, output_url_of
from flaxlm.storage import probe_write
from flaxlm.tasks import pipeline
from flaxlm.tasks.base import JobContext, attention_choice
from flaxlm.tasks.objective import choose_objective, objective_result
from flaxlm.tasks.registry import task_named
from flaxlm.tracking import start_tracker
from flaxlm.training.checkpoint.manager import close_quietly, disk_full_error, make_checkpointer
from flaxlm.training.evaluation import describe
from flaxlm.training.memory import out_of_memory_error
from flaxlm.training.optimizer import check_optimizer_settings
from flaxlm.training.plan import global_batch_size
from flaxlm.training.stop import PREEMPTED_EXIT_CODE, AgreedStopRequest, Preempted

OBJECTIVE_SUMMARY = "objective"  # the W&B summary key of the value a sweeper is handed


def train(cfg: DictConfig, *, choices: dict[str, str] | None = None,
          run_name: str | None = None, run_group: str | None = None) -> float:
    """Run one training job; return its objective (trainer.objective: what a sweeper
    optimises), the best or the last of the run's evaluations.

    `choices` (the option picked in each config group), `run_name` and `run_group` label the
    W&B run; the Hydra entrypoint fills them in. A run directory with a checkpoint is resumed
    (trainer.resume). SIGTERM / SIGINT save a checkpoint and raise `Preempted`, whose exit code
    is `PREEMPTED_EXIT_CODE`.
    """
    config: TrainConfig = OmegaConf.to_object(cfg)
    started = time.perf_counter()
    # Every bucket call of this process from here on (checked first: a bad value is exit 2).
    storage_retry.use(storage_retry.RetryPolicy(**dataclasses.asdict(config.storage_retries)))
    task = task_named(config.task.name)
    # Joins the other hosts (hardware.distributed); on a CPU, remat needs its own scheduler.
    # It may fork (`distributed.supervise`): no thread of ours may run before it.
    configure_platform(config.hardware, config.model.remat)
    # Seconds of imports (more on a TPU VM) that overlap the runtime's start (the mesh's
    # devices), and end with it: nothing after may fork while an import holds its lock.
    imports = import_in_background(task.libraries(config))
    writable_dir(config.cache_dir, "cache_dir", "Set cache_dir (or the FLAXLM_CACHE environment "
                 "variable) to a directory you can write to: tokenizers, packed data and "
                 "compiled steps are kept there.")
    enable_compilation_cache(config.cache_dir)
    mesh = make_mesh(config.hardware.num_devices, config.hardware.mesh)
    imports.join()
    seq_len = check_settings(config, mesh.size)  # before claiming run_dir: a retry can reuse it
    attention = attention_choice(config, config.model, task.pads_rows)
    objective = choose_objective(config)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # The saved config names the objective this run was judged by, default or not, for the
    # report and the dashboards to read back.
    resolved["trainer"].update(objective=objective.name, objective_mode=objective.mode.value)
    output_url = output_url_of(config)
    if output_url:  # every host writes its part of each checkpoint there: each one checks
        probe_write(output_url, "resume_from" if config.resume_from == output_url
                    else "output_url")
    run = open_shared_run_dir(config, resolved)
    tracker_config = {**resolved, "choices": choices or {}}
    mirror = _mirror(run.path, output_url)
    checkpointer = tracker = None
    try:
        _record_status(run.path, RUNNING, mirror=mirror)
        tracker = start_tracker(config.logger, run.path, tracker_config, name=run_name,
                                group=run_group, run_id=run.wandb_run_id,
                                objective=objective.name,
                                maximize=objective.mode == ObjectiveMode.max)
        tracker.after_evaluation = mirror and mirror.request
        checkpointer = make_checkpointer(run.path, config.checkpoint, output_url,
                                         after_save=mirror and (lambda step: mirror.request()),
                                         before_commit=mirror and mirror.request_and_wait)
        stop = AgreedStopRequest()
        job = JobContext(config, resolved, run, mesh, tracker, checkpointer, stop)
        with stop.catching_signals():
            try:
                final = pipeline.run(task, job, seq_len)
            except Preempted:  # under the handler, which ignores a repeated SIGTERM
                checkpointer.wait()  # the preemption checkpoint must be on disk before exit
                tracker.finish(exit_code=PREEMPTED_EXIT_CODE, preempted=True)
                raise
        checkpointer.close()
        if output_url and distributed.is_primary():
            upload_exports(run.path, output_url)
        final["wall_time_s"] = time.perf_counter() - started
        # What a sweeper is handed, also as W&B's `objective`: a W&B sweep's metric.
        result = objective_result(objective, run.path, final)
        tracker.summary({**final, OBJECTIVE_SUMMARY: result})
        _print_summary(final, run.path)
        _record_status(run.path, FINISHED, f"{objective.name} {result:.4f}", mirror)
    except Preempted as stopped:
        stopped.run_dir = run.path
        close_quietly(checkpointer)
        _record_status(run.path, PREEMPTED, str(stopped), mirror)
        how = (f"run the same command (output_url={output_url} continues it, on any host)"
               if output_url else f"run the same overrides plus resume_from={run.path} (or the "
               "same command, if it set run_dir or hydra.run.dir)")
        print(f"flaxlm: {stopped}; to continue, {how}; exit code {PREEMPTED_EXIT_CODE}",
              file=sys.stderr, flush=True)
        raise
    except BaseException as err:
        close_quietly(checkpointer)  # let good checkpoints already started finish writing
        if tracker is not None:
            tracker.finish(exit_code=1)
        # The step compiles at its first call (the train step's, or an evaluation's).
        known = (disk_full_error(err, run.path, output_url)
                 or distributed.lost_peer_error(err, run.path)
                 or kernel_compile_error(err, attention)
                 or out_of_memory_error(err, config))
        _record_status(run.path, FAILED, _failure_reason(known or err), mirror)
        if known is not None:
            raise known from err
        raise
    finally:
        run.release()
    tracker.finish()
    return result


def _record_status(run_dir: str, status: str, reason: str = "",
                   mirror: RunMirror | None = None) -> None:
    """The run's state in its own directory (for flaxlm-report), written by process 0, and
    with output_url the run's small files copied to the bucket: in the background at the
    start; at its end (a preempted run's last checkpoint is written by then) with everything
    still pending, waited for (bounded) before the run reports."""
    if distributed.is_primary():
        write_status(run_dir, status, reason)
        if mirror is not None:
            if status == RUNNING:
                mirror.request()
            else:
                mirror.finish()


def _mirror(run_dir: str, output_url: str | None) -> RunMirror | None:
    """Process 0's copies of the run's small files to the bucket, asked for after each
    evaluation is logged and as each checkpoint save starts, made in the background; a
    checkpoint is committed once they are up, so the bucket holds every metrics line up to the
    checkpoint a resume goes back to, and each evaluation as it comes."""
    if not (output_url and distributed.is_primary()):
        return None
    return RunMirror(run_dir, output_url)


def _failure_reason(err: BaseException) -> str:
    # A FlaxlmError's message says it all; anything else is named by its type.
    if isinstance(err, FlaxlmError):
        return str(err)
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def check_settings(config: TrainConfig, num_devices: int) -> int:
    """Settings that can be checked before any data is read, the task's own first; returns
    the task's sequence length."""
    seq_len = task_named(config.task.name).check_settings(config)
    for key, value in [
        ("hardware.per_device_batch_size", config.hardware.per_device_batch_size),
        ("trainer.num_epochs", config.trainer.num_epochs),
        ("trainer.log_every_steps", config.trainer.log_every_steps),
        ("trainer.grad_accum_steps", config.trainer.grad_accum_steps),
    ]:
        if value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1.")
    for key, value in [("trainer.max_steps", config.trainer.max_steps),
                       ("trainer.eval_every_steps", config.trainer.eval_every_steps),
                       ("trainer.loss_chunk_size", config.trainer.loss_chunk_size),
                       ("hardware.per_device_eval_batch_size",
                        config.hardware.per_device_eval_batch_size)]:
        if value is not None and value < 1:
            raise FlaxlmError(f"{key}={value} must be at least 1 (or null).")
    z_loss = config.trainer.z_loss
    if not (math.isfinite(z_loss) and z_loss >= 0):
        raise FlaxlmError(f"trainer.z_loss={z_loss} must be a finite number, 0 or more: the "
                          "coefficient of the z-loss (e.g. 1e-4), or 0 for none.")
    global_batch_size(config, num_devices)
    check_expert_axis(config.model, config.hardware.mesh, num_devices)
    pads_rows = task_named(config.task.name).pads_rows
    check_context_axis(config.hardware.mesh, num_devices, seq_len, pads_rows)
    attention_choice(config, config.model, pads_rows)
    check_optimizer_settings(config.optimizer)
    choose_objective(config)
    return seq_len


def enable_compilation_cache(cache_dir: str) -> None:
    """Keep compiled programs in `<cache_dir>/xla`, or in JAX's own JAX_COMPILATION_CACHE_DIR
    where that is set (a folder several jobs share): a second run of the same shapes skips XLA
    compilation, the largest part of its start-up. Every program is kept, however quickly it
    compiled: reading one back is a file read, while even a small program (a slice that
    checkpointing makes of each parameter, say) takes tens of milliseconds to compile for
    several devices, and a run makes dozens of them."""
    directory = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(os.path.expanduser(cache_dir), "xla"))
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _print_summary(final: dict, run_dir: str) -> None:
    tokens = f", {final['tokens_seen']:,} tokens" if "tokens_seen" in final else ""
    print(f"flaxlm: done in {final['wall_time_s']:.0f}s | {final['steps']} steps{tokens} | "
          f"final {describe(final)} | run dir {run_dir}")
