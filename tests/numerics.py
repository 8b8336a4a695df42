"""How close two floating-point results must be: one tolerance, derived from the dtype's epsilon
and the depth of the computation, for every numeric comparison in the tests.

XLA's CPU code differs between CPU models (vector width, reduction order, FMA contraction), and
torch's kernels differ from XLA's: the same float32 program gives results that differ in their
last bits from one machine to another. A tolerance fitted to one CPU's differences is a coin
toss on another; this one bounds them instead.

The bound. One rounding changes a value by at most u = eps/2 of it. A sum (or dot product) of
n terms accumulates one rounding per addition, each of the partial sum so far; summed in two
different orders the results differ by at most n·eps of Σ|terms| (Higham, "Accuracy and
Stability of Numerical Algorithms", §4.2), a bound never approached: the roundings are
independent and of either sign, and with probability at least 1 − 2n·exp(−λ²/2) they stay
within λ·√n·u of each (Higham & Mary 2019, "A new approach to probabilistic rounding error
analysis"), so two orders differ by λ·√n·eps. Measured against the largest magnitude of the
results (not the terms: for terms of random sign the result is √n times smaller than Σ|terms|,
and its own error is √n times smaller too), this is λ·√n·eps of that magnitude. With λ = 6
the chance that one element of one reduction exceeds it is below 1e-7 · n. A computation of
`depth` such stages in sequence (layers, optimizer steps, the matmuls of an iteration) passes
each result through n·depth roundings, as independent as the first n: λ·√(n·depth)·eps. A
stage that magnifies its inputs' errors (a Newton iteration's slope, a division by a small
epsilon, a difference of nearly equal numbers) multiplies everything before it by its
`amplification`.

So, with n = `terms` (the longest reduction in the computation), d = `depth` and A =
`amplification`:

    tolerance = λ · eps(dtype) · √(n · d) · A,        λ = 6

used as the relative tolerance and, times `scale` (by default the largest |value| the
compared arrays hold, per array), as the absolute one: elements near zero carry the absolute
error of the large ones they were computed from, never a fixed 1e-7.

What it still catches: a wrong sign, a missed term, a factor or an off-by-one in a scale
change the result by a fraction of its magnitude (a missed term among n of similar size: 1/n
of it; one of random sign: about 1/√n), while the tolerance is λ·√(n·d)·A·eps ≈ 7e-7·√(n·d)·A
in float32 — for n = 4096 and d = 16, 1.8e-4, below 1/4096 — and tests/test_numerics.py checks
that it accepts a reordered sum and rejects one with a term left out or of the wrong sign. An
`amplification` is a derived bound too (a slope, 1/(1 − β), a position): never a fudge factor.

Comparisons exact by construction (integer counts, the same program run twice on the same
device, powers of two) stay exact: `np.testing.assert_array_equal` or `==`.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

# Standard deviations of the sum of independent roundings that a comparison allows (λ above).
SIGMAS = 6.0

# Muon's quintic Newton–Schulz step aX + b(XXᵀ)X + c(XXᵀ)²X has slope a at a singular value
# near 0: each of its 5 steps may magnify an error along such a direction by this much.
NEWTON_SCHULZ_SLOPE = 3.4445


def epsilon(dtype) -> float:
    """The gap between 1 and the next larger number of dtype: 2^-23 for float32, 2^-7 for
    bfloat16, 2^-52 for float64."""
    import jax.numpy as jnp

    return float(jnp.finfo(dtype).eps)


def tolerance(dtype=np.float32, *, terms: int = 1, depth: int = 1,
              amplification: float = 1.0) -> float:
    """λ·eps·√(terms·depth)·amplification: how far apart two evaluations of one computation in
    dtype may land, as a fraction of the results' magnitude (see the module's docstring)."""
    if terms < 1 or depth < 1 or amplification < 1:
        raise ValueError("terms, depth and amplification are at least 1")
    return SIGMAS * epsilon(dtype) * math.sqrt(terms * depth) * amplification


def transformer_depth(num_layers: int, *, backward: bool = False) -> int:
    """The reductions a transformer's output passes through in sequence: per block a norm, the
    query/key/value projection, the scores, the softmax, the weighted values, the output
    projection, a norm and the MLP's two matmuls (9); then the embeddings' sum and the final
    norm and head (2). A gradient goes back through all of them again."""
    forward = 9 * num_layers + 2
    return 2 * forward if backward else forward


def transformer(num_layers: int, widest: int, *, backward: bool = False) -> dict:
    """The settings of a transformer's outputs (or, `backward`, its gradients): its depth, and
    its widest reduction (the MLP's width, the sequence, the vocabulary or the tokens summed)."""
    return dict(terms=widest, depth=transformer_depth(num_layers, backward=backward))


def magnitude(*arrays) -> float:
    """The largest |value| among arrays (and pytrees of them): the scale of the absolute floor."""
    leaves = [np.asarray(leaf, np.float64) for a in arrays for leaf in jax.tree.leaves(a)]
    return max((float(np.max(np.abs(leaf))) for leaf in leaves if leaf.size), default=0.0)


def assert_close(actual, expected, *, dtype=np.float32, terms: int = 1, depth: int = 1,
                 amplification: float = 1.0, scale: float | None = None, err_msg: str = "",
                 equal_nan: bool = True) -> None:
    """np.testing.assert_allclose with rtol = tolerance(...) and atol = rtol × scale, scale being
    by default the largest |value| of `expected` (pass the magnitude of the inputs, or of what
    the values are a difference of, where that is larger)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    rtol = tolerance(dtype, terms=terms, depth=depth, amplification=amplification)
    atol = rtol * (magnitude(expected) if scale is None else scale)
    _record(actual, expected, rtol, atol)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg,
                               equal_nan=equal_nan)


def assert_trees_close(actual, expected, **settings) -> None:
    """assert_close on each pair of leaves of two pytrees of the same structure, each leaf
    with its own scale (unless `scale` is given); the failure names the leaf's path."""
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(expected)
    actual_leaves = jax.tree.leaves(actual)
    assert len(actual_leaves) == len(paths_and_leaves), "the trees differ in structure"
    for (path, leaf), other in zip(paths_and_leaves, actual_leaves):
        assert_close(other, leaf, err_msg=jax.tree_util.keystr(path), **settings)


def approx(expected, *, dtype=np.float32, terms: int = 1, depth: int = 1,
           amplification: float = 1.0, scale: float | None = None):
    """pytest.approx with the same derived tolerance, for scalars, sequences and dicts."""
    rel = tolerance(dtype, terms=terms, depth=depth, amplification=amplification)
    values = list(expected.values()) if isinstance(expected, dict) else expected
    return pytest.approx(expected, rel=rel, abs=rel * (magnitude(values) if scale is None
                                                       else scale))


def _record(actual, expected, rtol, atol) -> None:
    """With FLAXLM_NUMERICS_LOG=path, append how much of its tolerance each comparison used
    (max |a − b| / (atol + rtol·|b|)): the margin a tolerance has on this machine."""
    path = os.environ.get("FLAXLM_NUMERICS_LOG")
    if not path or not expected.size:
        return
    import traceback

    allowed = atol + rtol * np.abs(expected)
    with np.errstate(divide="ignore", invalid="ignore"):
        same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
        used = np.where(same, 0.0, np.where(allowed > 0, np.abs(actual - expected) / allowed,
                                            np.inf))
    used = float(np.nanmax(used)) if used.size else 0.0
    caller = next((f for f in reversed(traceback.extract_stack()[:-2])
                   if os.path.basename(f.filename) != "numerics.py"), None)
    where = f"{os.path.basename(caller.filename)}:{caller.lineno}" if caller else "?"
    with open(path, "a") as log:
        log.write(f"{where} {used:.4f} rtol={rtol:.2e} atol={atol:.2e}\n")
