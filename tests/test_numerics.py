"""The tests' one tolerance (tests/numerics.py): it accepts what reordering a float32
computation does, and rejects what a bug does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import approx, assert_close, assert_trees_close, tolerance, transformer_depth

N = 4096


def float32_sums(terms: np.ndarray) -> list[np.float32]:
    """One float32 sum in four orders: left to right, right to left, numpy's pairwise, and a
    shuffle."""
    shuffled = np.random.default_rng(1).permutation(terms)
    return [np.cumsum(terms, dtype=np.float32)[-1], np.cumsum(terms[::-1], dtype=np.float32)[-1],
            np.sum(terms, dtype=np.float32), np.cumsum(shuffled, dtype=np.float32)[-1]]


@pytest.mark.parametrize("low", [0.5, -1.0], ids=["positive", "either-sign"])
def test_a_sum_in_any_order_is_accepted(low):
    terms = np.random.default_rng(0).uniform(low, 1.0, N).astype(np.float32)
    exact = float(np.sum(terms.astype(np.float64)))
    sums = float32_sums(terms)
    assert len(set(sums)) > 1  # the orders do round differently
    for got in sums:
        assert_close(got, exact, terms=N)
        for other in sums:
            assert_close(got, other, terms=N)


def test_a_sum_missing_a_term_or_with_one_of_the_wrong_sign_is_rejected():
    terms = np.random.default_rng(0).uniform(0.5, 1.0, N).astype(np.float32)
    exact = float(np.sum(terms.astype(np.float64)))
    flipped = terms.copy()
    flipped[7] = -flipped[7]
    for wrong in (terms[1:], flipped):
        with pytest.raises(AssertionError):
            assert_close(np.sum(wrong, dtype=np.float32), exact, terms=N)


def test_a_product_reordered_is_accepted_and_a_scale_or_sign_error_rejected():
    """float32 matrix products (jnp's, on this CPU) against float64: accepted; one product
    term of the wrong sign, or the result off by 1 %, rejected, near zero included."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(64, 256)), rng.normal(size=(256, 32))
    exact = a @ b
    got = np.asarray(jnp.asarray(a, jnp.float32) @ jnp.asarray(b, jnp.float32))
    assert_close(got, exact, terms=256)
    wrong = a.copy()
    wrong[3, 5] = -wrong[3, 5]
    with pytest.raises(AssertionError):
        assert_close(np.asarray(jnp.asarray(wrong, jnp.float32) @ jnp.asarray(b, jnp.float32)),
                     exact, terms=256)
    with pytest.raises(AssertionError):
        assert_close(got * 1.01, exact, terms=256, depth=transformer_depth(2))


def test_elements_near_zero_get_the_absolute_error_of_the_large_ones():
    """A difference of large numbers that is nearly 0 carries their rounding: the floor is the
    tensor's largest magnitude times the tolerance, not a fixed 1e-7 (and not 0)."""
    expected = np.array([1000.0, 1e-6])
    assert_close(expected + [0.0, 1e-5], expected)  # 1e-5 ≪ 1000 × 7e-7
    with pytest.raises(AssertionError):
        assert_close(expected + [0.0, 1e-2], expected)


def test_the_tolerance_grows_with_the_terms_the_depth_and_the_dtype():
    base = tolerance(np.float32)
    assert base == pytest.approx(6 * 2.0**-23)
    assert tolerance(np.float32, terms=16, depth=4) == pytest.approx(8 * base)
    assert tolerance(np.float32, amplification=10) == pytest.approx(10 * base)
    assert tolerance(jnp.bfloat16) == pytest.approx(base * 2.0**16)
    with pytest.raises(ValueError):
        tolerance(np.float32, terms=0)


def test_trees_and_approx_use_the_same_tolerance():
    tree = {"a": np.ones(3, np.float32), "b": {"c": np.arange(4.0)}}
    assert_trees_close(jax.tree.map(lambda x: x * (1 + 1e-7), tree), tree)
    wrong = {"a": tree["a"], "b": {"c": tree["b"]["c"] * 1.001}}
    with pytest.raises(AssertionError, match="'c'"):
        assert_trees_close(wrong, tree)
    assert 1.0 + 1e-7 == approx(1.0)
    assert 1.001 != approx(1.0)
    assert [1.0, 1e-9] == approx([1.0, 0.0])  # the floor: the largest value's scale
