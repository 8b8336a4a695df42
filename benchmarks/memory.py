"""Parameters + AdamW state per device on a `data=8` mesh against `fsdp=8`, and the largest GPT-2
preset that trains one step with each on this machine's 8 simulated CPU devices.

    python benchmarks/memory.py                      # both parts
    python benchmarks/memory.py --bytes-only         # the per-device table only (seconds)
    python benchmarks/memory.py --memory-gb 12 --timeout 900 --seq 128

The table is exact and allocates nothing: each array's shard shape on the mesh (the state's
shapes from `jax.eval_shape`, its layout from the parameters' logical axes).

The largest-model part tries the GPT-2 presets smallest first, each in a fresh process capped at
`--memory-gb` of address space (all 8 simulated devices share this machine's memory, so the cap
stands for the memory of the whole slice) and `--timeout` seconds, and stops at a mesh's first
failure. A try creates the model and its AdamW state already sharded (never whole in one place)
and runs one train step of one row of `--seq` tokens per device. Nothing is asserted: it is a
measurement of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("gpt2-tiny", "distilgpt2", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MESHES = {"data=8": {"data": 8}, "fsdp=8": {"data": 1, "fsdp": 8}}
NUM_DEVICES = 8


def use_cpu_devices() -> None:
    """Before JAX starts: 8 simulated CPU devices, as in the tests."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={NUM_DEVICES}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"


def model_config(preset: str):
    from omegaconf import OmegaConf

    from flaxlm.config import ModelConfig

    loaded = OmegaConf.load(os.path.join(REPO, "conf", "model", f"{preset}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), loaded))


def init_fn(preset: str, tx):
    """A function that creates the train state, and the model's static graph."""
    from flax import nnx

    from flaxlm.models.gpt2 import GPT2LMHeadModel
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.training.step import create_state

    spec = TransformerSpec(model_config(preset))

    def init():
        return create_state(GPT2LMHeadModel(spec, nnx.Rngs(0)), tx)[1]

    graphdef = nnx.split(nnx.eval_shape(lambda: GPT2LMHeadModel(spec, nnx.Rngs(0))), nnx.Param)[0]
    return init, graphdef


def optimizer():
    from flaxlm.config import OptimizerConfig
    from flaxlm.training.optimizer import make_optimizer, make_schedule

    config = OptimizerConfig(name="adamw", lr=1e-4)
    schedule = make_schedule(config, total_steps=10)
    return make_optimizer(config, schedule), schedule


def bytes_per_device(abstract_state, mesh) -> tuple[int, int]:
    """(bytes of the whole state, bytes one device holds), from the shard shapes alone."""
    import jax
    import numpy as np

    from flaxlm.parallel import state_shardings

    leaves = jax.tree.leaves(abstract_state)
    shardings = jax.tree.leaves(state_shardings(abstract_state, mesh))
    whole = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    one = sum(int(np.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
              for leaf, sharding in zip(leaves, shardings))
    return whole, one


def bytes_table() -> None:
    import jax

    from flaxlm.config import MeshConfig
    from flaxlm.parallel import make_mesh

    tx, _ = optimizer()
    meshes = {name: make_mesh(NUM_DEVICES, MeshConfig(**sizes)) for name, sizes in MESHES.items()}
    print("parameters + AdamW state (+ step counters), per device, float32:")
    print(f"  {'model':12} {'params':>9} {'whole state':>12} {'data=8':>10} {'fsdp=8':>10} ratio")
    for preset in PRESETS:
        init, _ = init_fn(preset, tx)
        abstract = jax.eval_shape(init)
        params = sum(leaf.size for leaf in jax.tree.leaves(abstract.params))
        whole, data = bytes_per_device(abstract, meshes["data=8"])
        _, fsdp = bytes_per_device(abstract, meshes["fsdp=8"])
        print(f"  {preset:12} {params / 1e6:8.1f}M {whole / 2**20:10.0f}MB "
              f"{data / 2**20:8.0f}MB {fsdp / 2**20:8.0f}MB 1/{data / fsdp:.2f}")


def train_one_step(preset: str, mesh_name: str, seq_len: int) -> dict:
    """In this (child) process: the sharded state and one train step; what it took."""
    import jax
    import numpy as np

    from flaxlm.config import MeshConfig
    from flaxlm.parallel import global_batch, make_mesh, state_shardings
    from flaxlm.training.step import compile_steps

    start = time.perf_counter()
    mesh = make_mesh(NUM_DEVICES, MeshConfig(**MESHES[mesh_name]))
    tx, schedule = optimizer()
    init, graphdef = init_fn(preset, tx)
    abstract = jax.eval_shape(init)
    state = jax.jit(init, out_shardings=state_shardings(abstract, mesh))()
    train = compile_steps(mesh, graphdef, tx, schedule).train
    vocab = abstract.params["wte"]["embedding"].shape[0]
    rows = np.random.default_rng(0).integers(0, vocab, (NUM_DEVICES, seq_len), dtype=np.int32)
    state, metrics = train(state, global_batch(rows, mesh), jax.random.key(0))
    loss = float(metrics["loss"])
    return {"loss": loss, "seconds": time.perf_counter() - start,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "state_gb_per_device": bytes_per_device(abstract, mesh)[1] / 2**30}


def try_in_child(preset: str, mesh_name: str, args) -> tuple[bool, str]:
    command = [sys.executable, __file__, "--child", preset, mesh_name, "--seq", str(args.seq),
               "--memory-gb", str(args.memory_gb)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return False, f"still running after {args.timeout}s"
    if done.returncode == 0:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return True, (f"trains: loss {result['loss']:.3f}, {result['seconds']:.0f}s, state "
                      f"{result['state_gb_per_device']:.2f} GB/device, peak RSS "
                      f"{result['peak_rss_gb']:.1f} GB")
    lines = (done.stderr + done.stdout).strip().splitlines() or [""]
    signs = ("RESOURCE_EXHAUSTED", "bad_alloc", "MemoryError", "Cannot allocate", "Out of memory")
    out_of_memory = [line for line in lines if any(sign in line for sign in signs)]
    if out_of_memory:
        return False, f"out of memory: {out_of_memory[0].strip()[:160]}"
    return False, f"exit {done.returncode}: {lines[-1].strip()[:160]}"


def largest_models(args) -> None:
    print(f"\nlargest GPT-2 that trains one step ({NUM_DEVICES} CPU devices, "
          f"{args.memory_gb:g} GB address-space cap, {args.timeout}s per try, "
          f"{NUM_DEVICES}×{args.seq} tokens):")
    for mesh_name in MESHES:
        largest = None
        for preset in PRESETS:
            ok, what = try_in_child(preset, mesh_name, args)
            print(f"  {mesh_name:7} {preset:12} {what}", flush=True)
            if not ok:
                break
            largest = preset
        print(f"  {mesh_name:7} → largest: {largest or 'none'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes-only", action="store_true")
    parser.add_argument("--memory-gb", type=float, default=8.0)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("PRESET", "MESH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_cpu_devices()
    if args.child:  # the cap holds this process only, set before JAX allocates anything
        cap = int(args.memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        print(json.dumps(train_one_step(*args.child, args.seq)))
        return
    bytes_table()
    if not args.bytes_only:
        largest_models(args)


if __name__ == "__main__":
    main()
