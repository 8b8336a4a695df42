"""The splash attention kernel's tile sizes and layouts on the TPU at hand: forward + backward
of causal attention in bfloat16 for the shapes of flaxlm's presets, one row per variant.

    PYTHONPATH=src python benchmarks/splash_blocks.py --out splash.json

Each variant is a `BlockSizes` (query / key-value blocks of the forward pass and of the two
backward kernels, the fused backward kernel, the key layout); each case is a preset's
attention shape (batch, sequence, query heads, key/value heads, head width). The time is the
median of `--iters` runs of the jitted forward + backward after a warm-up; TFLOP/s counts
the causal half of the 4·B·N·L²·H multiply-adds of the forward pass and 2.5 times that for
the backward pass. On a CPU (`--tiny`) the kernel runs in Pallas interpret mode, to check the
script only. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

# (name, batch, sequence, query heads, key/value heads, head width)
CASES = [("smollm-135m", 4, 2048, 9, 3, 64), ("qwen2.5-0.5b", 4, 2048, 14, 2, 64),
         ("llama-1b", 2, 2048, 32, 8, 64)]
TINY_CASES = [("tiny", 1, 256, 2, 1, 64)]
# Long rows (--long): smollm-135m's heads at the 16k and 32k tokens of long-context training.
LONG_CASES = [("smollm-135m-16k", 1, 16384, 9, 3, 64), ("smollm-135m-32k", 1, 32768, 9, 3, 64)]


def variants(L: int) -> dict[str, dict]:
    """Name → BlockSizes arguments; blocks are clipped to the sequence."""
    def blocks(q, kv, q_bwd=None, kv_bwd=None, fused=False, **layouts):
        q, kv = min(q, L), min(kv, L)
        q_bwd, kv_bwd = min(q_bwd or q, L), min(kv_bwd or kv, L)
        sizes = dict(block_q=q, block_kv=kv, block_kv_compute=kv, block_q_dkv=q_bwd,
                     block_kv_dkv=kv_bwd, block_kv_dkv_compute=kv_bwd,
                     use_fused_bwd_kernel=fused, **layouts)
        if not fused:
            sizes.update(block_q_dq=q_bwd, block_kv_dq=kv_bwd)
        return sizes

    return {
        "512/512": blocks(512, 512),
        "512/1024": blocks(512, 1024),
        "1024/512": blocks(1024, 512),
        "1024/1024": blocks(1024, 1024),
        "2048/2048": blocks(2048, 2048),
        "512/512 fused bwd (flaxlm below 16k)": blocks(512, 512, fused=True),
        "1024/1024 fused bwd": blocks(1024, 1024, fused=True),
        "2048/1024 fwd, 1024/1024 bwd fused": blocks(2048, 1024, 1024, 1024, fused=True),
        "512/512 k seq-minor": blocks(512, 512, k_layout="SEQ_MINOR"),
        "1024/1024 fused, k seq-minor": blocks(1024, 1024, fused=True, k_layout="SEQ_MINOR"),
        "1024/2048 fused": blocks(1024, 2048, fused=True),
        "2048/2048 fused": blocks(2048, 2048, fused=True),
        "2048/1024 fused": blocks(2048, 1024, fused=True),
        "4096/1024 fwd, 2048/1024 bwd fused": blocks(4096, 1024, 2048, 1024, fused=True),
    }


def make_kernel(L: int, N: int, sizes: dict, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = dict(sizes)
    for layout in ("q_layout", "k_layout", "v_layout"):
        if layout in sizes:
            sizes[layout] = getattr(splash.QKVLayout, sizes[layout])
    return splash.make_splash_mha(splash.MultiHeadMask([splash.CausalMask((L, L))] * N),
                                  head_shards=1, q_seq_shards=1,
                                  block_sizes=splash.BlockSizes(**sizes), interpret=interpret)


def time_variant(case, sizes: dict, iters: int, interpret: bool) -> float:
    _, B, L, N, G, H = case
    kernel = jax.vmap(make_kernel(L, N, sizes, interpret))
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, N, L, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, G, L, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, G, L, H), jnp.bfloat16)
    probe = jax.random.normal(keys[3], (B, N, L, H), jnp.bfloat16)

    @functools.partial(jax.jit)
    def forward_backward(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum((kernel(q, k, v) * probe).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    jax.block_until_ready(forward_backward(q, k, v))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(forward_backward(q, k, v))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a small case, in interpret mode")
    parser.add_argument("--long", action="store_true", help="long rows (16k, 32k tokens)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    interpret = jax.devices()[0].platform != "tpu"
    rows = []
    print(f"{jax.devices()[0].device_kind}: forward + backward, bfloat16, causal")
    for case in TINY_CASES if args.tiny else LONG_CASES if args.long else CASES:
        name, B, L, N, G, H = case
        flops = 3.5 * 4 * B * N * L * L * H / 2
        for label, sizes in variants(L).items():
            try:
                seconds = time_variant(case, sizes, 2 if args.tiny else args.iters, interpret)
                row = {"case": name, "variant": label, "ms": seconds * 1e3,
                       "tflops": flops / seconds / 1e12}
                print(f"{name:14} B{B} L{L} {N}/{G}x{H}  {label:36} {row['ms']:8.3f} ms "
                      f"{row['tflops']:6.1f} TFLOP/s", flush=True)
            except Exception as err:  # noqa: BLE001 — a variant the kernel refuses is a row
                row = {"case": name, "variant": label, "error": f"{type(err).__name__}: "
                       f"{str(err).splitlines()[0][:160] if str(err) else ''}"}
                print(f"{name:14} {label:36} failed: {row['error']}", flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
