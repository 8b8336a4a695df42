"""The memory recipes: the settings that make a training step need less memory per device,
cheapest in quality first, each with what it costs and how to tell that a run already uses
it. `flaxlm-plan` walks them as a ladder (`flaxlm.aot.recipe_ladder`, `--fit`); a run whose
step does not fit its devices' memory names those it does not use yet
(`out_of_memory_error`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from flaxlm.config import OptimizerName, Remat, TrainConfig
from flaxlm.errors import FlaxlmError, causes


@dataclasses.dataclass(frozen=True)
class MemoryRecipe:
    """One way to need less memory per chip, and what it costs."""

    overrides: tuple[str, ...]
    cost: str
    in_effect: Callable[[TrainConfig], bool]  # the run already does it (or more)


_REMAT_BLOCK_OR_MORE = {Remat.block, Remat.dots_with_no_batch_dims_saveable, Remat.full,
                        Remat.nothing_saveable}
_REMAT_FULL = {Remat.full, Remat.nothing_saveable}

# Cheapest in quality first (docs/planning.md#memory-recipes has their measured costs): the
# chunked loss and remat cost time, not loss; bfloat16 moments round what AdamW keeps;
# adafactor is another optimizer; bfloat16 parameters round every update.
MEMORY_RECIPES = (
    MemoryRecipe(("trainer.loss_chunk_size=512",), "the loss 512 positions at a time, the "
                 "whole logits never held: a slower LM head, the same loss",
                 lambda c: c.trainer.loss_chunk_size is not None),
    MemoryRecipe(("model.remat=block",), "recomputes each block's elementwise work: slower, "
                 "the same loss", lambda c: Remat(c.model.remat) in _REMAT_BLOCK_OR_MORE),
    MemoryRecipe(("optimizer.moment_dtype=bfloat16",), "the optimizer's moments rounded to "
                 "bfloat16", lambda c: c.optimizer.name == OptimizerName.adafactor
                 or (c.optimizer.moment_dtype or c.hardware.param_dtype) == "bfloat16"),
    MemoryRecipe(("optimizer=adafactor",), "another optimizer: factored second moments, no "
                 "first", lambda c: c.optimizer.name == OptimizerName.adafactor),
    MemoryRecipe(("model.remat=full",), "recomputes every matmul too: about one more forward "
                 "pass", lambda c: Remat(c.model.remat) in _REMAT_FULL),
    MemoryRecipe(("hardware.param_dtype=bfloat16",), "every update rounded to bfloat16 "
                 "parameters", lambda c: c.hardware.param_dtype == "bfloat16"),
)

# The settings of the recipes that cost time, not loss: once a later recipe makes the step fit,
# `flaxlm-plan --fit` drops those the step no longer needs (llama-1b on one v5e chip: remat
# does not fit float32 AdamW, and bfloat16 moments fit without it, which is faster).
TIME_ONLY_SETTINGS = ("model.remat", "trainer.loss_chunk_size")


def out_of_memory_error(err: BaseException, config: TrainConfig) -> FlaxlmError | None:
    """A step that XLA could not fit in the devices' memory (at compile time on a TPU, when
    allocating elsewhere), as one paragraph: what XLA said, and the recipes this run does not
    use yet; None for any other error."""
    said = next((str(cause) for cause in causes(err) if _out_of_memory(str(cause))), None)
    if said is None:
        return None
    reason = said.split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0].rstrip(".")
    device_kind = jax.devices()[0].device_kind  # the step compiled: the backend is up
    recipes = [" ".join(r.overrides) for r in MEMORY_RECIPES if not r.in_effect(config)]
    rows = config.hardware.per_device_batch_size
    smaller = (f"hardware.per_device_batch_size={rows // 2} "
               f"trainer.grad_accum_steps={2 * config.trainer.grad_accum_steps} (the same "
               "global batch in smaller micro-batches)") if rows > 1 else None
    tries = "; ".join(filter(None, [*recipes, smaller]))
    return FlaxlmError(
        f"The training step does not fit the memory of a {device_kind} with "
        f"model={config.model.name} at hardware.per_device_batch_size={rows} "
        f"(XLA: {reason[:300]}). `flaxlm-plan` with this command's overrides plus --fit "
        "compiles the memory recipes in order and names the first that fits"
        + (f"; the recipes this run does not use yet, cheapest in quality first: {tries}"
           if tries else "")
        + " (docs/planning.md, memory recipes)."
    )


def _out_of_memory(text: str) -> bool:
    """XLA's words for a program or buffer that does not fit ("Ran out of memory in memory
    space hbm", "Out of memory while trying to allocate"), not any RESOURCE_EXHAUSTED (a full
    disk, a service's quota)."""
    return "RESOURCE_EXHAUSTED" in text and any(
        word in text.lower() for word in ("out of memory", "hbm"))
