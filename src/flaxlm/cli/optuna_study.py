"""An Optuna study continued by running the same sweep again (`hparams_search=optuna-lr-wd`
with the same `hydra.sweep.dir`): the new invocation goes on where the study stands.

Hydra builds the sampler from `hydra.sweeper.sampler.seed` on every invocation, so a fixed
seed would replay the start-up trials of the first invocation: the same configurations trained
again. The seed an invocation uses is therefore the configured one plus the number of trials
the study already holds: a fresh study samples exactly as configured, each continuation draws
from its own stream, and a continued study is as reproducible as a fresh one.

A sweep killed while a trial ran leaves that trial RUNNING in the storage forever (the sweeper
that would have told its result is gone). When no other invocation is running on the study
(the caller knows: `flaxlm.cli.sweep` holds a lock on the sweep directory), such trials are
marked failed before the new trials start.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def is_optuna(sweeper: DictConfig) -> bool:
    return sweeper.get("_target_") == OPTUNA_SWEEPER


def continue_study(sweeper: DictConfig, alone: bool) -> None:
    """Prepare `sweeper` (the `hydra.sweeper` node, before Hydra builds the sweeper from it) to
    continue its stored study: fail the trials a stopped invocation left running (only when
    `alone`: no other invocation runs trials of this study) and move the sampler's seed past
    the streams earlier invocations used."""
    study = _stored_study(sweeper)
    if study is None:
        return
    if alone:
        _fail_interrupted_trials(study)
    seed = sweeper.get("sampler", {}).get("seed")
    done = len(study.trials)
    if isinstance(seed, int) and done:
        sweeper.sampler.seed = seed + done
        print(f"flaxlm: continuing Optuna study {study.study_name}, which holds {done} "
              f"trial(s): sampler seed {seed} + {done}, so the new trials are not the earlier "
              "ones again", flush=True)


def _stored_study(sweeper: DictConfig) -> Any:
    """The study the sweeper will load, or None: none stored yet, or storage in memory."""
    storage, name = sweeper.get("storage"), sweeper.get("study_name")
    if not (isinstance(storage, str) and name):
        return None
    import optuna  # the `optuna` extra: only an Optuna sweep gets here

    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:  # optuna's answer for a study not in the storage
        return None


def _fail_interrupted_trials(study: Any) -> None:
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL)
        print(f"flaxlm: Optuna trial {trial.number} {trial.params} was left running by a sweep "
              "that stopped: marked failed", flush=True)
