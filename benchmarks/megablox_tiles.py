"""megablox's grouped matmuls on the TPU at hand under a grid of tiles, beside the tiles flaxlm
picks (`flaxlm.models.grouped_matmul.megablox_tiling`): each product of an MoE layer alone.

    PYTHONPATH=src python benchmarks/megablox_tiles.py                      # moe-small's layer
    PYTHONPATH=src python benchmarks/megablox_tiles.py --rows 65536 --widths 2048,1408 \\
        --experts 60 --out tiles.json

The rows (tokens × top-k) fall into `--experts` groups of skewed sizes (the busiest about twice
the idlest, as a trained router spreads them). For each kernel (gmm: rows times the experts'
matrices, the forward product and the gradient into the rows; tgmm: the matrices' gradients)
and each direction of the widths (D → F and F → D), every tiling of rows 256–2048 and widths
that divide them is timed: the mean of `--iters` calls after two. A tiling whose tiles do not
fit the kernel's VMEM fails to compile and is listed as such. `--budget-s` stops the sweep when
it is spent. TFLOP/s counts 2·rows·K·N. Needs a TPU (Mosaic), or `--interpret` at small sizes
to check the script on a CPU; nothing is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time


def divisors(size: int, options) -> list[int]:
    return [t for t in options if t <= size and size % t == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16384, help="tokens × top-k")
    parser.add_argument("--widths", default="768,2048", help="the model's and an expert's width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="a JSON file of every timing")
    parser.add_argument("--interpret", action="store_true",
                        help="Pallas interpret mode, to check the script on a CPU (small sizes)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    from flaxlm.models.grouped_matmul import megablox_tiling

    M, G = args.rows, args.experts
    odds = np.linspace(1.0, 2.0, G)
    sizes = np.floor(odds / odds.sum() * M).astype(np.int32)
    sizes[-1] += M - sizes.sum()
    group_sizes = jnp.asarray(sizes)
    D, F = (int(w) for w in args.widths.split(","))
    key = jax.random.key(0)
    started, rows = time.perf_counter(), []
    print(f"megablox on {jax.devices()[0].device_kind}: {M} rows in {G} groups, widths {D}, {F}")
    for kernel, (K, N) in itertools.product(("gmm", "tgmm"), ((D, F), (F, D))):
        if kernel == "gmm":
            lhs, rhs = (jax.random.normal(key, (M, K), jnp.bfloat16),
                        jax.random.normal(key, (G, K, N), jnp.bfloat16))
        else:
            lhs, rhs = (jax.random.normal(key, (K, M), jnp.bfloat16),
                        jax.random.normal(key, (M, N), jnp.bfloat16))
        ours = megablox_tiling(M, K, N, kernel)
        widths = (256, 384, 512, 768, 1024, 1408, 2048, 4096)
        grid = set(itertools.product(divisors(M, (256, 512, 1024, 2048)),
                                     divisors(K, widths), divisors(N, widths)))
        name, times = f"{kernel} {K}→{N}", {}
        for tiling in [ours, *sorted(grid - {ours})]:  # flaxlm's first, within any budget
            if time.perf_counter() - started > args.budget_s:
                break
            if kernel == "gmm":
                call = jax.jit(lambda a, b, g, t=tiling: gmm(a, b, g, jnp.bfloat16, t,
                                                             interpret=args.interpret))
            else:
                call = jax.jit(lambda a, b, g, t=tiling: tgmm(a, b, g, jnp.bfloat16, t, None, G,
                                                              interpret=args.interpret))
            try:
                times[tiling] = _mean_seconds(call, (lhs, rhs, group_sizes), args.iters)
            except Exception as err:  # noqa: BLE001 — a tiling the kernel cannot take
                print(f"  {name} {tiling}: failed ({str(err).splitlines()[0][:80]})")
                continue
            tflops = 2 * M * K * N / times[tiling] / 1e12
            mark = "  ← flaxlm's" if tiling == ours else ""
            print(f"  {name} {tiling}: {times[tiling] * 1e3:.3f} ms, {tflops:.1f} TFLOP/s{mark}",
                  flush=True)
            rows.append({"kernel": kernel, "K": K, "N": N, "tiling": tiling,
                         "s": times[tiling]})
        if times:
            fastest = min(times, key=times.get)
            against = f"; flaxlm's {ours}: {times[ours] * 1e3:.3f} ms" if ours in times else ""
            print(f"best {name}: {fastest} {times[fastest] * 1e3:.3f} ms{against}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(rows, out, indent=1)


def _mean_seconds(call, arguments, iters: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(call(*arguments))
    start = time.perf_counter()
    for _ in range(iters):
        out = call(*arguments)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


if __name__ == "__main__":
    main()
