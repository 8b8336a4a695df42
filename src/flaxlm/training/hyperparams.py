"""The optimizer's numbers as arguments of the compiled train step, not constants in it.

A sweep over optimizer.lr, weight_decay, warmup_steps, b2, ... then lowers every job whose
shapes are equal to one program, which JAX's persistent compilation cache compiles for the
first job only. What is structure stays static: the optimizer's name, the schedule's kind,
whether gradients are clipped, moment dtypes, nesterov, whether adafactor decays weights.

Bit for bit the step computes what it computed with the numbers as Python constants: each is
passed as a weakly typed 0-d array (float32 or int32), which promotes as a Python scalar does;
a number Python derived from the settings before it reached JAX (lr − end_lr, 1 − b2, ...) is
derived here on the host the same way and passed beside them; and where XLA folded constants
together (x / c as x × (1 / c), the cosine's π / steps), the schedule multiplies by the folded
number, made on the host as XLA made it. Checked against the constant optimizers with the
compiler settings of a user's run (tests/constant_optimizers.py); the test suite's cheaper
settings (LLVM at -O0) fuse a multiply and an add for a constant operand where they do not for
an argument, so under them a learning rate can differ in its last bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.config import Schedule


def as_arguments(numbers: Mapping[str, float | int]) -> dict[str, jax.Array]:
    """Host numbers as the step's arguments: weakly typed 0-d arrays, so that `x * lr` has
    x's dtype as it had with the Python float, and every job passes the same types. Put on
    the device as they are: `jnp.asarray` would compile a program for each dtype first."""
    return {name: jax.device_put(value) for name, value in numbers.items()}


@jax.tree_util.register_pytree_node_class
class Rate:
    """A decay or interpolation rate r handed to optax in place of a Python float.

    optax writes `(1 - r) * g + r * m`. With r a Python float, `1 - r` is float64 arithmetic
    rounded once to float32; with r an array it would be float32 arithmetic on r already
    rounded, which differs in the last bit (1 − f32(0.9) ≠ f32(0.1)). A Rate answers `1 - r`
    with its complement computed on the host as Python did; anything else it is r. An
    expression optax does not use today (`2 - r`) raises, rather than differ silently. A pytree,
    so that it passes through optax's own jitted helpers (bias correction)."""

    def __init__(self, value, complement):
        self.value = value
        self.complement = complement

    def tree_flatten(self):
        return (self.value, self.complement), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __rsub__(self, other):
        if other != 1:
            raise TypeError(f"{other} - Rate: only 1 - rate has a host-computed value")
        return self.complement

    def __mul__(self, other):
        return self.value * other

    def __rmul__(self, other):
        return other * self.value

    def __pow__(self, exponent):
        return self.value**exponent

    def __jax_array__(self):
        return self.value


def rate_numbers(name: str, value: float) -> dict[str, float]:
    """A rate's value and its complement, the host's `1 - value` (`rate`)."""
    return {name: float(value), complement_name(name): 1 - float(value)}


def complement_name(name: str) -> str:
    return f"one_minus_{name}"


def rate(numbers: Mapping, name: str) -> Rate:
    return Rate(numbers[name], numbers[complement_name(name)])


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
    """Linear warmup from 0 to lr over warmup_steps, then `kind`'s shape down to end_lr; its
    numbers (`numbers`: lr, the step counts, what the shape derives from them) are arguments.

    `at(step, numbers)` is optax's schedules written out (`linear_schedule`,
    `cosine_decay_schedule`, `constant_schedule`, `join_schedules`) as XLA compiled them with
    constant numbers, the same operations in the same order: that keeps the losses equal to the
    bit. Calling the schedule evaluates it at its own numbers, as an optax schedule."""

    kind: Schedule
    numbers: dict

    def __call__(self, step):
        return self.at(step, as_arguments(self.numbers))

    def at(self, step, numbers: Mapping):
        # The warmup from 0 to lr: with no warmup steps it is never selected.
        warmup_steps = numbers["warmup_steps"]
        output = _linear(step, numbers["minus_lr"], numbers["lr"], warmup_steps,
                         numbers["warmup_reciprocal"])
        if self.kind == Schedule.constant:
            return jnp.where(step < warmup_steps, output, numbers["lr"])
        if self.kind == Schedule.cosine:
            return jnp.where(step < warmup_steps, output,
                             _cosine(step - warmup_steps, numbers))
        decay = lambda count: _linear(count, numbers["lr_drop"], numbers["end_lr"],  # noqa: E731
                                      numbers["decay_steps"], numbers["decay_reciprocal"])
        if self.kind == Schedule.linear:
            return jnp.where(step < warmup_steps, output, decay(step - warmup_steps))
        # wsd: warmup, flat at lr, then the linear decay over the last decay_steps
        output = jnp.where(step < warmup_steps, output, numbers["lr"])
        return jnp.where(step < numbers["decay_start"], output,
                         decay(step - numbers["decay_start"]))


def reciprocal(steps: int | float) -> float:
    """1 / steps in float32, as XLA computes it for a constant divisor: it compiles `x / c` as
    `x * (1 / c)` (not always x / c rounded: 12 × f32(1/12) is not 1)."""
    return float(np.float32(1) / np.float32(steps)) if steps else 0.0


def _linear(count, drop, end, steps, steps_reciprocal):
    """optax.linear_schedule's `(init - end) * frac**1 + end`, with `drop` = init − end, as
    XLA compiles it for constant numbers: `frac` = 1 − count × (1 / steps)."""
    count = jnp.clip(count, 0, steps)
    frac = 1 - count * steps_reciprocal
    return drop * (frac**1) + end


def cosine_numbers(lr: float, end_lr: float, decay_steps: int) -> dict[str, float]:
    """optax.cosine_decay_schedule(lr, decay_steps, alpha=end_lr / lr) computes
    `lr * ((1 - alpha) * 0.5 * (1 + cos(pi * count / decay_steps)) + alpha)`; XLA folds its
    constants pairwise in float32, to `count * (pi * (1 / decay_steps))` and
    `(1 + cos) * (0.5 * (1 - alpha))`. These are those folded constants, made the same way."""
    alpha = end_lr / lr
    f32 = np.float32
    return {"decay_steps": float(decay_steps), "alpha": alpha,
            "pi_over_steps": float(f32(np.pi) * (f32(1) / f32(decay_steps))),
            "half_one_minus_alpha": float(f32(0.5) * f32(1 - alpha))}


def _cosine(count, numbers: Mapping):
    """optax.cosine_decay_schedule at `count` as XLA compiles it for constant numbers
    (`cosine_numbers`)."""
    count = jnp.minimum(count, numbers["decay_steps"])
    decayed = ((1 + jnp.cos(count * numbers["pi_over_steps"])) * numbers["half_one_minus_alpha"]
               + numbers["alpha"])
    return decayed * numbers["lr"]
