"""The attention backends on the accelerator at hand: does each compute the reference's
function, forward and backward, and how fast.

On a GPU or TPU host, from the repository root:

    PYTHONPATH=src python benchmarks/attention_backends.py --out attention.json
    PYTHONPATH=src JAX_PLATFORMS=cpu python benchmarks/attention_backends.py --tiny --out a.json

The backends are the platform's fused kernel (`cudnn` on a GPU, `splash` on a TPU) beside
`xla` and `reference`; on a CPU, `--tiny` runs both fused kernels to check the script (splash
in Pallas interpret mode, cudnn failing soft). For each case (batch, sequence of 2048 to 8192
tokens, 16 query heads over 4 key/value heads or over 16, head widths 64 and 128; causal, and
causal within packed documents) and each dtype (`--dtypes`: float32 and bfloat16), every
backend runs the forward and backward pass of `flaxlm.models.attention.attention`. Its output
and gradients (of a fixed random projection of the output, wrt q, k and v) are compared with
the reference computed in float32 from the same inputs: the largest absolute difference, and
that divided by the largest magnitude of the reference's (relative). Float32 runs, the
reference's included, use `jax.default_matmul_precision("highest")`: at the default a TPU
multiplies float32 in one bfloat16 pass (and a GPU in TF32), which would blur a backend's own
error. The bfloat16 reference's row is the floor that rounding to bfloat16 sets.

Forward + backward is timed too: the median of `--iters` runs after a warm-up, each waited
for with `block_until_ready`. A backend that fails (cuDNN without a GPU, in float32, a shape
it refuses, memory) is reported in its row and the others go on; no new case starts after
`--budget-s`. Prints one table and writes every row to `--out` as JSON.

Imports only jax, numpy and flaxlm's model code (no Hydra, datasets or W&B): it runs wherever
`src/` is on the path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxlm.models.attention import attention

FUSED = {"gpu": ("cudnn",), "tpu": ("splash",), "cpu": ("cudnn", "splash")}
# (batch, sequence, query heads, key/value heads, head width)
CASES = [(4, 2048, 16, 4, 64), (4, 2048, 16, 4, 128), (4, 2048, 16, 16, 128),
         (2, 4096, 16, 4, 128), (1, 8192, 16, 4, 128)]
TINY_CASES = [(1, 128, 4, 2, 16)]
MASKS = ("causal", "causal+segments")


def inputs(B: int, L: int, N: int, G: int, H: int, segmented: bool, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, L, N, H), jnp.float32)
    k = jax.random.normal(keys[1], (B, L, G, H), jnp.float32)
    v = jax.random.normal(keys[2], (B, L, G, H), jnp.float32)
    probe = jax.random.normal(keys[3], (B, L, N, H), jnp.float32)
    segments = None
    if segmented:  # packed documents of random lengths, about 8 per row
        rng = np.random.default_rng(seed)
        segments = jnp.asarray(np.sort(rng.integers(0, 8, (B, L)), axis=1), jnp.int32)
    return q, k, v, probe, segments


@functools.partial(jax.jit, static_argnames="backend")
def forward_backward(q, k, v, probe, segments, *, backend: str):
    """The output and the gradients wrt q, k, v of sum(output × probe)."""

    def loss(q, k, v):
        out = attention(q, k, v, dropout_rate=0.0, rngs=None, is_causal=True,
                        segment_ids_BxL=segments, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def precision(dtype):
    """Full float32 matrix products for float32 runs (see the docstring); the default else."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def differences(value, reference) -> tuple[float, float]:
    """The largest absolute difference, and that over the reference's largest magnitude."""
    diff = float(jnp.max(jnp.abs(value.astype(jnp.float32) - reference)))
    return diff, diff / float(jnp.max(jnp.abs(reference)))


def median_ms(fn, iters: int) -> float:
    jax.block_until_ready(fn())  # warm-up (compiled already)
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def run_case(case, mask: str, backends, dtypes, iters: int) -> list[dict]:
    B, L, N, G, H = case
    q, k, v, probe, segments = inputs(B, L, N, G, H, mask == "causal+segments")
    base = dict(batch=B, seq=L, q_heads=N, kv_heads=G, head_dim=H, mask=mask)
    with precision(jnp.float32):
        ref_out, ref_grads = forward_backward(q, k, v, probe, segments, backend="reference")
    rows = []
    for dtype in dtypes:
        low = [x.astype(dtype) for x in (q, k, v)]
        for backend in backends:
            row = dict(base, dtype=jnp.dtype(dtype).name, backend=backend, fwd_bwd_ms=None,
                       max_abs_diff_out=None, max_abs_diff_grad=None, rel_diff_out=None,
                       rel_diff_grad=None, error=None)
            try:
                with precision(dtype):
                    out, grads = forward_backward(*low, probe, segments, backend=backend)
                    row["max_abs_diff_out"], row["rel_diff_out"] = differences(out, ref_out)
                    per_grad = [differences(g, r) for g, r in zip(grads, ref_grads)]
                    row["max_abs_diff_grad"] = max(d for d, _ in per_grad)
                    row["rel_diff_grad"] = max(r for _, r in per_grad)
                    row["fwd_bwd_ms"] = median_ms(
                        lambda b=backend, x=low: forward_backward(*x, probe, segments, backend=b),
                        iters)
            except Exception as err:  # noqa: BLE001 — report it and go on with the others
                row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
            rows.append(row)
            print(format_row(row), flush=True)
    del ref_out, ref_grads
    return rows


HEADER = (f"{'seq':>5} {'heads':>6} {'H':>4} {'mask':<16} {'dtype':<9} {'backend':<10} "
          f"{'fwd+bwd ms':>10} {'max|Δout|':>10} {'rel':>8} {'max|Δgrad|':>10} {'rel':>8}  error")


def format_row(row: dict) -> str:
    def num(key, spec):
        return format(row[key], spec) if row[key] is not None else "-"

    return (f"{row['seq']:>5} {row['q_heads']:>3}/{row['kv_heads']:<2} {row['head_dim']:>4} "
            f"{row['mask']:<16} {row['dtype']:<9} {row['backend']:<10} "
            f"{num('fwd_bwd_ms', '10.2f'):>10} {num('max_abs_diff_out', '10.2e'):>10} "
            f"{num('rel_diff_out', '8.1e'):>8} {num('max_abs_diff_grad', '10.2e'):>10} "
            f"{num('rel_diff_grad', '8.1e'):>8}  {row['error'] or ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the rows as JSON")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per backend")
    parser.add_argument("--tiny", action="store_true",
                        help="one tiny case, 3 timed runs: checks the script on a CPU")
    parser.add_argument("--backends", default=None,
                        help="comma-separated (default: the platform's fused kernel, xla, "
                             "reference)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--budget-s", type=float, default=100.0,
                        help="start no new case after this many seconds")
    args = parser.parse_args(argv)
    cases = TINY_CASES if args.tiny else CASES
    iters = 3 if args.tiny else args.iters
    device = jax.devices()[0]
    backends = (args.backends.split(",") if args.backends
                else [*FUSED.get(device.platform, ()), "xla", "reference"])
    dtypes = [jnp.dtype(name) for name in args.dtypes.split(",")]
    print(f"attention backends on {device.device_kind} ({device.platform}), jax "
          f"{jax.__version__}; differences from the float32 reference\n{HEADER}", flush=True)
    started = time.perf_counter()
    rows, skipped = [], []
    for case in cases:
        for mask in MASKS:
            if time.perf_counter() - started > args.budget_s:
                skipped.append(dict(case=case, mask=mask))
                continue
            try:
                rows += run_case(case, mask, backends, dtypes, iters)
            except Exception as err:  # noqa: BLE001 — the float32 reference itself failed
                print(f"case {case} {mask}: reference failed: {err}", flush=True)
                skipped.append(dict(case=case, mask=mask, error=str(err)[:200]))
    seconds = time.perf_counter() - started
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(dict(device=device.device_kind, platform=device.platform,
                       jax=jax.__version__, seconds=seconds, rows=rows, skipped=skipped),
                  f, indent=2)
    print(f"{len(rows)} rows in {seconds:.0f} s"
          + (f"; {len(skipped)} case(s) skipped (--budget-s)" if skipped else "")
          + f"; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
