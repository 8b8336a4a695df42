"""`flaxlm-train`: the Hydra entrypoint. It only composes the config and hands it to
`flaxlm.train.train`; a user's mistake is printed as one paragraph, without a traceback.

Exit codes: 0 done; 1 failed; 2 a configuration or input error (FlaxlmError); 75 stopped by
SIGTERM / SIGINT after saving a checkpoint — the same overrides plus resume_from=<run dir>
(or the same command, if it named run_dir / hydra.run.dir) continue the run."""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from flaxlm.config import register_configs
from flaxlm.errors import FlaxlmError

CONFIG_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf"))

register_configs()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float:
    from flaxlm.train import train  # after Hydra: JAX starts only once the config is known
    from flaxlm.training.checkpoint import PREEMPTED_EXIT_CODE, Preempted

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("hparams_search")]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        return train(
            cfg,
            choices={k: v for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra")},
            run_name=",".join(overrides) or None,
            run_group=os.path.basename(hydra_cfg.sweep.dir) if multirun else None,
        )
    except FlaxlmError as err:
        print(f"flaxlm: error: {err}", file=sys.stderr)
        sys.exit(2)
    except Preempted:
        # SIGTERM / SIGINT: the checkpoint is saved; 75 (EX_TEMPFAIL) tells a scheduler that
        # the run can be resumed.
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
