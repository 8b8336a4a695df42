"""`flaxlm-train`: the Hydra entrypoint. It only composes the config and hands it to
`flaxlm.job.train`; a user's mistake is printed as one paragraph, without a traceback.

Exit codes: 0 done; 1 failed (a multirun: one of its jobs failed, the others still ran); 2 a
configuration or input error (FlaxlmError, or a config Hydra cannot compose); 69 the processes
of a multi-host run could not join or lost one another (PeerError, or JAX's native abort turned
into one by `flaxlm.distributed`); 75 stopped by SIGTERM / SIGINT after saving a checkpoint —
the same overrides plus resume_from=<run dir> (or the same command, if it named run_dir /
hydra.run.dir) continue the run."""

from __future__ import annotations

import importlib.resources
import os
import re
import sys
import traceback

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flaxlm.cli.common import collector_paused_while_importing, end_without_final_collection
from flaxlm.cli.hydra_copies import share_the_config_store
from flaxlm.cli.language_list import expand_language_list, folded
from flaxlm.cli.sweep import SweepJob
from flaxlm.config import register_configs, renamed_keys
from flaxlm.errors import FlaxlmError, yaml_error_text


def config_dir() -> str:
    """The config groups `flaxlm-train` composes: the copy a wheel ships as `flaxlm/conf`, or,
    in a source checkout (an editable install), the repository's top-level `conf/` itself."""
    packaged = importlib.resources.files("flaxlm") / "conf"
    if packaged.is_dir():
        return os.fspath(packaged)
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf"))


CONFIG_DIR = config_dir()

register_configs()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def train_job(cfg: DictConfig) -> float | None:
    # After Hydra: JAX starts only once the config is known.
    with collector_paused_while_importing():
        from flaxlm import distributed
        from flaxlm.job import train
        from flaxlm.tasks.objective import choose_objective
        from flaxlm.training.stop import PREEMPTED_EXIT_CODE, Preempted

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("hparams_search")]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    # In a multirun a failed job is recorded and the sweep goes on (see flaxlm.cli.sweep).
    job = (SweepJob(os.path.abspath(hydra_cfg.sweep.dir), hydra_cfg.job.num, overrides,
                    hydra_cfg.runtime.output_dir) if multirun else None)
    if multirun:
        try:  # every job would fail alike: the sweep stops at its first
            check_sweep_direction(OmegaConf.select(hydra_cfg, "sweeper.direction"), cfg)
        except FlaxlmError as err:
            print(f"flaxlm: error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)
        job.started()
    distributed.supervise_joins()  # a lost peer ends in flaxlm's message and exit code
    try:
        value = train(
            cfg,
            choices={k: v for k, v in hydra_cfg.runtime.choices.items()
                     if not k.startswith("hydra")},
            run_name=",".join(folded(overrides)) or None,
            run_group=os.path.basename(hydra_cfg.sweep.dir) if multirun else None,
        )
    except FlaxlmError as err:
        print(f"flaxlm: error: {err}", file=sys.stderr, flush=True)
        if job is None:
            sys.exit(err.exit_code)
        return job.failed(str(err))
    except Preempted as stopped:
        if job is not None:
            job.preempted(str(stopped))
        # SIGTERM / SIGINT: the checkpoint is saved; 75 (EX_TEMPFAIL) tells a scheduler that
        # the run can be resumed.
        sys.exit(PREEMPTED_EXIT_CODE)
    except Exception as err:
        if job is None:
            raise
        traceback.print_exc()  # not the user's mistake: the details are needed
        return job.failed(f"{type(err).__name__}: {err}")
    if job is None:
        return value
    return job.done(choose_objective(OmegaConf.to_object(cfg)).name, value)


def check_sweep_direction(direction, cfg: DictConfig) -> None:
    """A sweeper that optimises (Optuna's `direction`) must go the objective's way: minimising
    an F1 would search for the worst model without a word."""
    from flaxlm.config import ObjectiveMode
    from flaxlm.tasks.objective import choose_objective

    if not isinstance(direction, str):  # no such setting (grid), or several objectives
        return
    objective = choose_objective(OmegaConf.to_object(cfg))
    wanted = "maximize" if objective.mode == ObjectiveMode.max else "minimize"
    if direction.lower() != wanted:
        raise FlaxlmError(
            f"hydra.sweeper.direction={direction}, but trainer.objective={objective.name} is "
            f"better {'higher' if wanted == 'maximize' else 'lower'} (objective mode "
            f"{objective.mode.value}). Add hydra.sweeper.direction={wanted}, or choose another "
            "trainer.objective / trainer.objective_mode."
        )


def main() -> None:
    # Hydra would print a composition error itself and exit 1; raising it instead lets it be
    # reported as flaxlm reports every configuration error: one line, exit 2. A user who set
    # HYDRA_FULL_ERROR asked for Hydra's full report and gets it.
    full_error_asked = bool(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    end_without_final_collection()
    share_the_config_store()  # --help: a second less
    try:
        sys.argv[1:] = expand_language_list(sys.argv[1:])  # a list of languages: a mixture
    except FlaxlmError as err:
        print(f"flaxlm: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    try:
        train_job()
    except (CompactHydraException, OmegaConfBaseException) as err:
        if full_error_asked:
            raise
        print(f"flaxlm: error: {composition_error(err)}", file=sys.stderr)
        sys.exit(2)
    except (yaml.YAMLError, UnicodeDecodeError) as err:  # a file of the user's (--config-dir)
        if full_error_asked or raised_by_the_job(err):
            raise
        exit_with_config_error(f"{config_file_problem(err)}. Fix the file, or choose another "
                               "option of its config group")


def composition_error(err: CompactHydraException | OmegaConfBaseException) -> str:
    """One paragraph for a config that cannot be composed: what is wrong, and where to look."""
    # The first line of each says what is wrong; the rest (Hydra's search path,
    # OmegaConf's key bookkeeping) is noise to a user.
    message = str(err).split("\nConfig search path")[0]
    if isinstance(err.__cause__, OmegaConfBaseException):
        message += f" ({str(err.__cause__).splitlines()[0]})"
    message = " ".join(message.split())
    # A key an earlier release spelt otherwise: Hydra only says it is unknown.
    renamed = renamed_keys(f"{err}\n{err.__cause__ or ''}")
    if renamed:
        source = re.match(r"In '([^']+)'", message)
        where = f"config {source.group(1)}" if source else "the command line"
        return (f"{'; '.join(renamed)} ({where}): use the new name; docs/configuration.md "
                "lists the renamed keys.")
    return config_error_text(message)


def config_file_problem(err: yaml.YAMLError | UnicodeDecodeError) -> str:
    if isinstance(err, yaml.YAMLError):  # its text names the file
        return f"A config file is not valid YAML: {yaml_error_text(err)}"
    # Hydra's file source holds the file's path as `full_path` while it reads it.
    paths = [frame.f_locals.get("full_path") for frame, _ in traceback.walk_tb(err.__traceback__)]
    path = next((p for p in reversed(paths) if isinstance(p, str)), "(its name unknown)")
    return (f"A config file is not UTF-8 text: {path}, byte {err.object[err.start]:#04x} at "
            f"offset {err.start}")


def raised_by_the_job(err: BaseException) -> bool:
    """Whether `err` came from the job Hydra ran, not from composing its config."""
    job = train_job.__wrapped__.__code__
    return any(frame.f_code is job for frame, _ in traceback.walk_tb(err.__traceback__))


def config_error_text(message: str) -> str:
    return (f"{message}. Run `flaxlm-train --help` for the config groups and `flaxlm-train "
            "--cfg job` for the composed config.")


def exit_with_config_error(message: str) -> None:
    print(f"flaxlm: error: {config_error_text(message)}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
