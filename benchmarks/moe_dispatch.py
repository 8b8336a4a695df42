"""How tokens reach their experts: one Mixture-of-Experts MLP, forward and backward, with each
dispatch of `model.moe.dispatch` on this machine's default device, beside the dense dispatch
(every token through every expert), measured in the same run. Nothing is asserted.

    python benchmarks/moe_dispatch.py                  # the CPU: tiled, ragged, dense
    python benchmarks/moe_dispatch.py --tokens 16384 --width 768 --expert-width 2048 \\
        --experts 8 --top-k 2 --dtype bfloat16 --dispatch megablox,ragged,dense   # a TPU

Each dispatch's time is the median of `--steps` calls after `--warmup`; the MLP's useful
FLOPs (6 · tokens · K · 3 · D · F, forward and backward of the chosen experts only) over that
time give its rate. The ratio is the dense dispatch's time over each one's.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (B × L)")
    parser.add_argument("--width", type=int, default=256, help="the model width D")
    parser.add_argument("--expert-width", type=int, default=384, help="each expert's width F")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dispatch", default="tiled,ragged,dense",
                        help="comma-separated model.moe.dispatch values; dense is the peer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from flaxlm.config import MoeConfig, MoeDispatch
    from flaxlm.models import moe

    dtype = jnp.dtype(args.dtype)
    D, F, E, K, T = args.width, args.expert_width, args.experts, args.top_k, args.tokens
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, T, D)), dtype)
    # Routing as a trained router's would spread it: each token's K distinct experts, drawn
    # with skewed odds (a busiest expert about twice the idlest's share).
    odds = np.linspace(1.0, 2.0, E)
    odds /= odds.sum()
    experts = np.stack([rng.choice(E, K, replace=False, p=odds) for _ in range(T)])[None]
    weights = jnp.asarray(rng.random((1, T, K)), dtype)
    init = jax.nn.initializers.normal(0.02)
    keys = jax.random.split(jax.random.key(0), 3)
    matrices = (init(keys[0], (E, D, F), dtype), init(keys[1], (E, D, F), dtype),
                init(keys[2], (E, F, D), dtype))

    class Experts:  # moe.Experts' interface, holding the matrices made here
        activation = staticmethod(jax.nn.silu)

        def matrices(self):
            return matrices

    print(f"one MoE MLP, forward and backward: {T} tokens, width {D}, {E} experts of width "
          f"{F}, top-{K}, {args.dtype}, on {jax.devices()[0].device_kind}", flush=True)
    useful_flops = 6 * T * K * 3 * D * F
    times = {}
    for name in args.dispatch.split(","):
        settings = MoeConfig(num_experts=E, top_k=K, normalize_top_k=True, first_dense_layers=0,
                             dispatch=MoeDispatch(name), aux_loss_coef=0.0, z_loss_coef=0.0,
                             bias_update_rate=0.0)

        @jax.jit
        def step(x, weights, settings=settings):
            def loss(x, weights):
                out, _ = moe.dispatch(x, jnp.asarray(experts), weights, Experts(), settings)
                return jnp.sum(out.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1))(x, weights)

        try:
            for _ in range(args.warmup):
                jax.block_until_ready(step(x, weights))
        except Exception as err:  # noqa: BLE001 — a dispatch this device cannot run
            print(f"{name:>9}: does not run here: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:160] if str(err) else ''}")
            continue
        samples = []
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(step(x, weights))
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
        print(f"{name:>9}: {times[name] * 1e3:8.2f} ms, "
              f"{useful_flops / times[name] / 1e12:7.2f} useful TFLOP/s", flush=True)
    if "dense" in times:
        print("against the dense dispatch: " + ", ".join(
            f"{name} {times['dense'] / seconds:.2f}×" for name, seconds in times.items()
            if name != "dense"))


if __name__ == "__main__":
    main()
