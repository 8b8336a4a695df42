"""Sliding-window attention on the TPU at hand: what a window saves the splash kernel, and that
the compiled kernel computes the windowed reference there.

    PYTHONPATH=src python benchmarks/sliding_window.py --out window.json
    PYTHONPATH=src python benchmarks/sliding_window.py --tiny     # a CPU: interpret mode, 256

flaxlm's own entry (`flaxlm.models.attention.attention`, backend splash) with
`model.sliding_window` None (causal) and a few windows, smollm-135m's heads (9 on 3, 64 wide),
bfloat16, one row: the median of `--iters` jitted forward + backward passes after a warm-up,
at each sequence length. Then, in float32 at the shortest length with packed documents, the
kernel's output against the reference path's with the same window: the largest difference
over the largest |value|. Nothing is asserted; the tests check the function on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models.attention import attention

HEADS = (9, 3, 64)  # smollm-135m's query heads, key/value heads, head width


def inputs(length: int, dtype, seed: int = 0):
    N, G, H = HEADS
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (1, length, N, H), dtype),
            jax.random.normal(keys[1], (1, length, G, H), dtype),
            jax.random.normal(keys[2], (1, length, G, H), dtype))


def forward_backward(backend: str, window: int | None):
    def loss(q, k, v, segments):
        out = attention(q, k, v, dropout_rate=0.0, rngs=None, is_causal=True,
                        segment_ids_BxL=segments, backend=backend, window=window)
        return jnp.sum(out.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 1024, 256])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a CPU: 256 tokens, interpret")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.tiny:
        args.lengths, args.windows, args.iters = [256], [64], 1
    rows = []
    for length in args.lengths:
        q, k, v = inputs(length, jnp.bfloat16)
        for window in [None, *[w for w in args.windows if w < length]]:
            took = seconds(forward_backward("splash", window), (q, k, v, None), args.iters)
            rows.append({"length": length, "window": window, "ms": round(took * 1e3, 3)})
            print(json.dumps(rows[-1]), flush=True)
    length = min(args.lengths)
    q, k, v = inputs(length, jnp.float32, seed=1)
    # Documents of a quarter of the row, each longer than the smallest window.
    segments = jnp.asarray(np.arange(length)[None] // (length // 4), jnp.int32)
    checks = []
    # At the TPU's default precision a float32 product is bfloat16 passes: compare at full.
    jax.config.update("jax_default_matmul_precision", "highest")
    for window in args.windows:
        run = functools.partial(attention, dropout_rate=0.0, rngs=None, is_causal=True,
                                segment_ids_BxL=segments, window=min(window, length))
        kernel = jax.jit(functools.partial(run, backend="splash"))(q, k, v)
        reference = jax.jit(functools.partial(run, backend="reference"))(q, k, v)
        difference = float(jnp.abs(kernel - reference).max() / jnp.abs(reference).max())
        checks.append({"length": length, "window": window, "relative_difference": difference})
        print(json.dumps(checks[-1]), flush=True)
    result = {"device": jax.devices()[0].device_kind, "heads": HEADS, "times": rows,
              "checks": checks}
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
