"""The optimizers as flaxlm compiled them before issue 52 (goal 6), every number a constant of
the step, rebuilt from optax directly; and, run as a script, the comparison with
`make_optimizer`'s, whose numbers are arguments: every schedule, each optimizer's steps on a
small network, and the compiled train step of a one-layer TINY model.

A script, because the comparison holds for the compiler settings a user's run has: the tests'
cheaper ones (conftest.COMPILER_FLAGS, LLVM at -O0) contract a multiply and an add into one
fused multiply-add for a constant operand where they do not for an argument, so there the
learning rate differs from the constant one in its last bit at some steps.
Prints a JSON list of what differed (empty: everything equal to the bit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax.numpy as jnp
import optax
import optax.contrib

from flaxlm.config import OptimizerName, Schedule
from flaxlm.training.optimizer import (
    MUON_RMS,
    _per_layer_matrices,
    decay_mask,
    moments_stored_in,
    muon_labels,
)


def constant_schedule(opt, total_steps: int) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, opt.lr, opt.warmup_steps)
    if opt.schedule == Schedule.wsd:
        decay_steps = max(round(opt.decay_fraction * total_steps), 1)
        return optax.join_schedules(
            [warmup, optax.constant_schedule(opt.lr),
             optax.linear_schedule(opt.lr, opt.end_lr, decay_steps)],
            [opt.warmup_steps, total_steps - decay_steps])
    decay_steps = max(total_steps - opt.warmup_steps, 1)
    if opt.schedule == Schedule.linear:
        decay = optax.linear_schedule(opt.lr, opt.end_lr, decay_steps)
    elif opt.schedule == Schedule.cosine:
        decay = optax.cosine_decay_schedule(opt.lr, decay_steps, alpha=opt.end_lr / opt.lr)
    else:
        decay = optax.constant_schedule(opt.lr)
    return optax.join_schedules([warmup, decay], [opt.warmup_steps])


def constant_transformation(opt, schedule) -> optax.GradientTransformation:
    def adamw():
        return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                           weight_decay=opt.weight_decay, mask=decay_mask)

    if opt.name == OptimizerName.adamw:
        tx = adamw()
    elif opt.name == OptimizerName.lion:
        tx = optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                        mask=decay_mask)
    elif opt.name == OptimizerName.sgd:
        tx = optax.chain(optax.add_decayed_weights(opt.weight_decay, mask=decay_mask),
                         optax.sgd(schedule, momentum=opt.momentum, nesterov=opt.nesterov))
    elif opt.name == OptimizerName.adafactor:
        tx = optax.adafactor(schedule, momentum=opt.momentum,
                             dtype_momentum=jnp.dtype(opt.moment_dtype or "float32"),
                             weight_decay_rate=opt.weight_decay or None,
                             weight_decay_mask=decay_mask)
    else:
        muon = optax.contrib.muon(schedule, beta=opt.momentum, nesterov=opt.nesterov,
                                  weight_decay=opt.weight_decay, consistent_rms=MUON_RMS,
                                  muon_weight_dimension_numbers=_per_layer_matrices)
        tx = optax.partition({"muon": muon, "adamw": adamw()}, muon_labels)
    if opt.moment_dtype is not None and opt.name != OptimizerName.adafactor:
        tx = moments_stored_in(jnp.dtype(opt.moment_dtype), tx)
    if opt.max_grad_norm is None:
        return tx
    return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), tx)


@dataclasses.dataclass(frozen=True, eq=False)
class ConstantOptimizer:
    """What `compile_train_step` asks of an optimizer, with no numbers of its own to pass:
    the step compiled as before, its numbers constants."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule

    def init(self, params):
        return self.tx.init(params)

    def transformation(self, numbers) -> optax.GradientTransformation:
        return self.tx

    def learning_rate(self, step, numbers):
        return self.schedule(step)

    def arguments(self) -> dict:
        return {}


# Each optimizer, and the structural choices beside them (each schedule: `compare_schedules`).
CASES = {
    "adamw": dict(),
    "adamw-clipped-bfloat16": dict(max_grad_norm=0.5, moment_dtype="bfloat16", warmup_steps=0),
    "lion": dict(weight_decay=0.0),
    "sgd": dict(weight_decay=0.01, nesterov=True, schedule=Schedule.linear),
    "adafactor": dict(weight_decay=0.01, schedule=Schedule.wsd),
    "muon": dict(schedule=Schedule.constant),
}
STEPS = 4


def optimizer_config(case: str):
    """The case's optimizer: a 6-step schedule (cosine unless the case says) with 2 warmup
    steps, and numbers whose float32 arithmetic rounds (end_lr / lr, 1 − b2)."""
    from conftest import config_node

    settings = dict(schedule=Schedule.cosine, warmup_steps=2, end_lr=1e-5, b2=0.95)
    settings.update(CASES[case])
    return config_node("optimizer", [f"optimizer={case.split('-')[0]}"], **settings)


def compare_schedules() -> list[str]:
    """Every schedule, with and without warmup, at each step of a 12-step run and past it."""
    import jax
    import numpy as np
    from conftest import config_node

    from flaxlm.training.optimizer import make_schedule

    differences = []
    for kind in Schedule:
        for warmup_steps in (0, 3):
            opt = config_node("optimizer", [], lr=3.7e-4, end_lr=1.3e-5, schedule=kind,
                              warmup_steps=warmup_steps, decay_fraction=0.3)
            ours, theirs = make_schedule(opt, total_steps=12), constant_schedule(opt, 12)
            at, expected = jax.jit(ours.at), jax.jit(theirs)
            differences += [f"{kind.value} schedule, {warmup_steps} warmup steps: step {step}"
                            for step in range(15)
                            if not np.array_equal(at(np.int32(step), ours.numbers),
                                                  expected(np.int32(step)))]
    return differences


def compare_updates(loss_and_grads, params) -> list[str]:
    """Each case's optimizer alone, `STEPS` steps on a fixed batch: the losses, parameters and
    optimizer state (its layout too: checkpoints of earlier runs resume)."""
    import jax
    import numpy as np

    from flaxlm.training.optimizer import make_optimizer, make_schedule

    def run(init, update):
        state, current, losses = init(params), params, []
        for _ in range(STEPS):
            loss, grads = loss_and_grads(current)
            updates, state = update(grads, state, current)
            current = optax.apply_updates(current, updates)
            losses.append(float(loss))
        return losses, jax.device_get((current, state))

    differences = []
    for case in CASES:
        opt = optimizer_config(case)
        ours = make_optimizer(opt, make_schedule(opt, total_steps=6))
        theirs = constant_transformation(opt, constant_schedule(opt, 6))
        numbers = ours.arguments()
        update = jax.jit(lambda g, s, p, n, ours=ours: ours.transformation(n).update(g, s, p))
        (losses, after), (expected_losses, expected_after) = (
            run(ours.init, lambda g, s, p: update(g, s, p, numbers)),  # noqa: B023
            run(theirs.init, jax.jit(theirs.update)))
        if losses != expected_losses:
            differences.append(f"{case}: losses {losses} != {expected_losses}")
        if jax.tree.structure(after) != jax.tree.structure(expected_after):
            differences.append(f"{case}: the optimizer state is laid out differently")
        elif not all(jax.tree.leaves(jax.tree.map(np.array_equal, after, expected_after))):
            differences.append(f"{case}: the parameters or optimizer state differ")
    return differences


def compare_train_steps(case: str) -> list[str]:
    """`STEPS` steps of the compiled train step (dropout on) with each optimizer: every
    metric, the parameters and the optimizer state."""
    import jax
    import numpy as np
    from conftest import TINY, config_node
    from flax import nnx

    from flaxlm.models.gpt2 import GPT2LMHeadModel
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.parallel import global_batch, make_mesh
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import compile_steps, create_state

    opt = optimizer_config(case)
    mesh = make_mesh(1)
    rows = np.random.default_rng(0).integers(0, 512, (STEPS, 4, 32)).astype(np.int32)
    runs = []
    for optimizer in (make_optimizer(opt, make_schedule(opt, total_steps=6)),
                      ConstantOptimizer(constant_transformation(opt, constant_schedule(opt, 6)),
                                        constant_schedule(opt, 6))):
        model = GPT2LMHeadModel(TransformerSpec(config_node("model", TINY, num_layers=1)),
                                nnx.Rngs(0))
        graphdef, state = create_state(model, optimizer, mesh)
        train, metrics = compile_steps(mesh, graphdef, optimizer).train, []
        for step in range(STEPS):
            state, step_metrics = train(state, global_batch(rows[step], mesh),
                                        jax.random.key(step))
            metrics.append(jax.device_get(step_metrics))
        runs.append((metrics, jax.device_get(state)))
    (ours, our_state), (theirs, their_state) = runs
    differences = [f"{case}: step {step} {name} {ours[step][name]!r} != {value!r}"
                   for step in range(STEPS) for name, value in theirs[step].items()
                   if not np.array_equal(ours[step][name], value)]
    if not all(jax.tree.leaves(jax.tree.map(np.array_equal, our_state, their_state))):
        differences.append(f"{case}: the parameters or optimizer state differ")
    return differences


def small_loss_and_grads():
    """A few parameters of each kind the optimizers treat apart (an embedding, a hidden
    matrix, a bias, a norm scale; `decay_mask`, `muon_labels`) and the loss and gradient of a
    small network of them, jitted: a model's worth of kinds at a fraction of its compile time."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    params = {"wte": {"embedding": rng.normal(0, 0.5, (16, 8))},
              "mlp": {"kernel": rng.normal(0, 0.5, (8, 8)), "bias": rng.normal(0, 0.1, 8)},
              "ln": {"scale": 1 + rng.normal(0, 0.1, 8)}}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    tokens = jnp.asarray(rng.integers(0, 16, 32))

    def loss(params):
        x = params["wte"]["embedding"][tokens]
        x = jnp.tanh(x @ params["mlp"]["kernel"] + params["mlp"]["bias"]) * params["ln"]["scale"]
        logits = x @ params["wte"]["embedding"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1)).mean()

    return jax.jit(jax.value_and_grad(loss)), params


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    import conftest  # noqa: F401  (which sets the tests' XLA_FLAGS: undone before JAX starts)

    os.environ["XLA_FLAGS"] = ""
    print(json.dumps(compare_schedules() + compare_updates(*small_loss_and_grads())
                     + compare_train_steps("adamw")))
