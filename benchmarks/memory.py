"""Parameters + AdamW state per device on a `data=8` mesh against `fsdp=8`, and the largest GPT-2
preset that trains one step with each on this machine's 8 simulated CPU devices.

    python benchmarks/memory.py                      # both parts
    python benchmarks/memory.py --bytes-only         # the per-device table only (seconds)
    python benchmarks/memory.py --lora               # full fine-tuning vs LoRA's optimizer state
    python benchmarks/memory.py --memory-gb 12 --timeout 900 --seq 128

The table is exact and allocates nothing: each array's shard shape on the mesh (the state's
shapes from `jax.eval_shape`, its layout from the parameters' logical axes).

The largest-model part tries the GPT-2 presets smallest first, each in a fresh process capped at
`--memory-gb` of address space (all 8 simulated devices share this machine's memory, so the cap
stands for the memory of the whole slice) and `--timeout` seconds, and stops at a mesh's first
failure. A try creates the model and its AdamW state already sharded (never whole in one place)
and runs one train step of one row of `--seq` tokens per device. Nothing is asserted: it is a
measurement of this machine.

    python benchmarks/memory.py --breakdown          # what holds a real run's memory (minutes)
    python benchmarks/memory.py --breakdown --case minilm-mrpc-8 --steps 5 model.remat=full

The breakdown runs `flaxlm-train` itself for a few steps and one evaluation, each case in a fresh
process: the quickstart (gpt2-tiny, builtin corpus, 2 CPU devices) and the MiniLM fine-tune
(`experiment=minilm-mrpc-offline` on the demo pairs of `flaxlm-pairs`) on 2 and on 8
simulated CPU devices, and on 8 with the state split over `fsdp`. It reports the process's peak
RSS and the RSS of each phase of the run (sampled by a thread), and per device what the
compiled train and eval steps hold by XLA's own accounting (`memory_analysis`): the train state
by kind (parameters, AdamW's mu and nu), the batch, the outputs and how much of them reuse the
donated state's buffers, the temporaries (activations, gradients) and the generated code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("gpt2-tiny", "distilgpt2", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
MESHES = {"data=8": {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1},
          "fsdp=8": {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}}
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
    from train_step import config_node

    from flaxlm.training.optimizer import make_optimizer, make_schedule

    config = config_node("optimizer", ["optimizer=adamw"], lr=1e-4)
    return make_optimizer(config, make_schedule(config, total_steps=10))


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


LORA_PRESET = "llama-1b-lora"  # conf/experiment/: its model and its model.lora settings


def lora_table() -> None:
    """Full fine-tuning against the adapters of experiment=llama-1b-lora: parameters, those
    that train, and the AdamW state of those, whole (from the abstract state: exact, nothing
    allocated)."""
    import dataclasses

    import jax
    from flax import nnx
    from omegaconf import OmegaConf
    from train_step import config_node

    from flaxlm.config import LoraConfig
    from flaxlm.models import lora
    from flaxlm.models.build import build_lm
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.training.step import create_state, trained_part

    tx, _ = optimizer()
    preset = OmegaConf.load(os.path.join(REPO, "conf", "experiment", f"{LORA_PRESET}.yaml"))
    settings = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LoraConfig),
                                                   preset.model.lora))
    base = config_node("model", ["model=llama-1b"])
    print(f"llama-1b, AdamW state of what trains, float32 (experiment={LORA_PRESET}: rank "
          f"{settings.rank} on {', '.join(settings.targets)}):")
    print(f"  {'':18} {'params':>9} {'trained':>9} {'optimizer state':>16}")
    for name, model in [("full fine-tuning", base),
                        (f"LoRA r{settings.rank}", dataclasses.replace(base, lora=settings))]:
        abstract = nnx.eval_shape(lambda model=model: build_lm(TransformerSpec(model),
                                                               nnx.Rngs(0)))
        trainable = lora.trainable(model)
        _, state = create_state(abstract, tx, trainable=trainable)
        count = lambda tree: sum(leaf.size for leaf in jax.tree.leaves(tree))  # noqa: E731
        opt_bytes = sum(leaf.size * leaf.dtype.itemsize
                        for leaf in jax.tree.leaves(state.opt_state))
        print(f"  {name:18} {count(state.params) / 1e6:8.1f}M "
              f"{count(trained_part(state, trainable).params) / 1e6:8.2f}M "
              f"{opt_bytes / 2**20:13,.1f}MiB")


def train_one_step(preset: str, mesh_name: str, seq_len: int) -> dict:
    """In this (child) process: the sharded state and one train step; what it took."""
    import jax
    import numpy as np

    from flaxlm.config import MeshConfig
    from flaxlm.parallel import global_batch, make_mesh, state_shardings
    from flaxlm.training.step import compile_steps

    start = time.perf_counter()
    mesh = make_mesh(NUM_DEVICES, MeshConfig(**MESHES[mesh_name]))
    tx = optimizer()
    init, graphdef = init_fn(preset, tx)
    abstract = jax.eval_shape(init)
    state = jax.jit(init, out_shardings=state_shardings(abstract, mesh))()
    train = compile_steps(mesh, graphdef, tx).train
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


# ------------------------------------------------------------- what holds a real run's memory

STEPS_DEFAULT = 4
BREAKDOWN_PREFIX = "BREAKDOWN-RESULT "
KINDS = ("params", "mu", "nu", "other")  # "other": step and optimizer counters


def breakdown_cases(pairs_dir: str) -> dict[str, list[str]]:
    """`flaxlm-train` overrides of each case, beyond the few-steps settings."""
    minilm = ["experiment=minilm-mrpc-offline", f"task.files=[{pairs_dir}/train.tsv]",
              f"task.eval_files=[{pairs_dir}/validation.tsv]"]
    return {
        "quickstart": ["hardware.cpu_devices=2"],
        "minilm-mrpc-2": [*minilm, "hardware.cpu_devices=2"],
        "minilm-mrpc-8": [*minilm, "hardware.cpu_devices=8"],
        "minilm-mrpc-8-fsdp": [*minilm, "hardware.cpu_devices=8", "hardware.mesh.data=1",
                               "hardware.mesh.fsdp=8"],
    }


def proc_status(field: str) -> int:
    """A number of this process's /proc/self/status, in bytes where it is a size in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                number, *unit = line.split()[1:]
                return int(number) * (1024 if unit == ["kB"] else 1)
    return 0


def vm_rss() -> int:
    """This process's resident set now, in bytes."""
    return proc_status("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: ru_maxrss (KiB on Linux), or VmHWM
    where the kernel has not folded the latest pages into ru_maxrss yet."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, proc_status("VmHWM"))


class PhaseSampler:
    """A thread that reads VmRSS every `interval` seconds and keeps the peak of each named phase
    of the run (a phase entered again, such as the train steps after an evaluation, adds to its
    own peak) and the RSS at each phase's last end."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.phase = "start"
        self.peaks: dict[str, int] = {self.phase: vm_rss()}
        self.ends: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> PhaseSampler:
        self._thread.start()
        return self

    def enter(self, phase: str) -> None:
        rss = vm_rss()
        self._note(rss)
        self.ends[self.phase] = rss
        self.phase = phase
        self._note(rss)

    def stop(self) -> None:
        self.enter("stopped")
        self._stop.set()
        self._thread.join()

    def table(self) -> list[tuple[str, int, int]]:
        """(phase, peak, RSS at its end) in the order the phases were first entered."""
        return [(phase, peak, self.ends.get(phase, peak)) for phase, peak in self.peaks.items()
                if phase != "stopped"]

    def _note(self, rss: int) -> None:
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._note(vm_rss())


def abstract(tree):
    """`tree` with every array replaced by its shape, dtype and sharding."""
    import jax

    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                          sharding=leaf.sharding)
                        if isinstance(leaf, jax.Array) else leaf, tree)


def device_bytes(leaf) -> int:
    """Bytes one device holds of an array (or of its abstract value with a sharding)."""
    import numpy as np

    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    return int(np.prod(shape)) * leaf.dtype.itemsize


def state_bytes_by_kind(state) -> dict[str, int]:
    """Bytes per device of a train state (arrays or abstract ones), by KINDS: parameters,
    AdamW's first and second moments, and the rest (step and optimizer counters)."""
    import jax

    totals = dict.fromkeys(KINDS, 0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        fields = [key.name for key in path if isinstance(key, jax.tree_util.GetAttrKey)]
        kind = next((name for name in ("mu", "nu") if name in fields), None)
        if kind is None:
            kind = "params" if fields[:1] == ["params"] else "other"
        totals[kind] += device_bytes(leaf)
    return totals


def step_memory(jitted, args) -> dict[str, int] | None:
    """XLA's accounting of one device's memory for `jitted` compiled for `args` (abstract ones
    do): arguments, outputs, the part of the outputs written over donated arguments, temporaries
    and generated code. None where the backend keeps no such record."""
    stats = jitted.lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
        "code": stats.generated_code_size_in_bytes,
    }


def watch_phases(sampler: PhaseSampler, record: dict) -> None:
    """Wrap the job's entry, the shared training set-up, the loop, its checkpoint saves and the
    compiled train and eval steps, so that the sampler knows the phase of the run; `record`
    gets the abstract train state, each step's first arguments, the first state passed in (to
    tell whether the step took it over) and the bytes of the model's own arrays still alive
    once the state is on the mesh, at the first steps and after the loop (host or one-device
    copies of the weights kept by mistake)."""
    import dataclasses
    import weakref

    import jax
    from flax import nnx

    from flaxlm import job
    from flaxlm.tasks import base

    def model_arrays_alive(when: str) -> None:
        alive = [ref() for ref in record["model_arrays"]]
        record[f"model_arrays_{when}"] = sum(leaf.nbytes for leaf in alive if leaf is not None)

    def watched(name: str, step):
        def call(*args):
            if name not in record:
                model_arrays_alive(f"at_first_{name}_step")
                sampler.enter(f"{name} step: compile + first run")
                record[name] = (step, abstract(args))
                if name == "train":
                    record["first_state"] = args[0]
            else:
                sampler.enter(f"{name} steps")
            return step(*args)
        return call

    def wrap(module, name: str, before: str | None, after: str | None, change=None):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            if before:
                sampler.enter(before)
            result = original(*args, **kwargs)
            if change:
                result = change(result)
            if after:
                sampler.enter(after)
            return result
        setattr(module, name, wrapper)

    def create_state(model, *args, **kwargs):
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        record["model_arrays"] = [weakref.ref(leaf) for leaf in leaves]
        return original_create_state(model, *args, **kwargs)

    original_create_state = base.create_state
    base.create_state = create_state

    def watch_training(training):
        model_arrays_alive("after_set_up")
        record["state"] = abstract(training.state)
        training.steps = dataclasses.replace(
            training.steps, train=watched("train", training.steps.train),
            eval=watched("eval", training.steps.eval))
        return training

    class WatchedSaver(base.CheckpointSaver):
        def __call__(self, *args, **kwargs):
            sampler.enter("checkpoint save")
            return super().__call__(*args, **kwargs)

    base.CheckpointSaver = WatchedSaver
    wrap(job, "train", "platform, data, tokenizer", "done")
    wrap(base, "prepare_training", "model, pretrained weights, state on the mesh",
         "model dir, evaluator", watch_training)
    wrap(base, "run_loop", None, "after the loop: export, samples",
         lambda result: model_arrays_alive("after_the_loop") or result)


def breakdown_child(case: str, pairs_dir: str, run_dir: str, steps: int,
                    overrides: list[str]) -> None:
    """In this fresh process: `flaxlm-train` for the case, watched; the result line."""
    sampler = PhaseSampler().start()
    sampler.enter("imports: hydra, jax, flax, optax")
    import hydra  # noqa: F401 — what every run imports first, as a phase of its own
    import jax
    import optax  # noqa: F401
    from flax import nnx  # noqa: F401

    sampler.enter("imports: flaxlm, transformers, datasets")
    from flaxlm.cli import train as cli
    from flaxlm.tasks import base  # noqa: F401

    torch_imported = "torch" in sys.modules
    record: dict = {}
    watch_phases(sampler, record)
    sys.argv = ["flaxlm-train", *breakdown_cases(pairs_dir)[case], "logger=none",
                f"trainer.max_steps={steps}", "optimizer.warmup_steps=0",
                "trainer.eval_before_training=false", *overrides,
                f"hydra.run.dir={run_dir}"]
    cli.train_job()
    sampler.stop()
    peak = peak_rss()  # before the steps are compiled again for their accounting below
    state = record["state"]
    result = {
        "case": case, "peak_rss": peak, "phases": sampler.table(),
        "devices": len(jax.tree.leaves(state)[0].sharding.device_set),
        "state": state_bytes_by_kind(state),
        "donated": all(leaf.is_deleted() for leaf in jax.tree.leaves(record["first_state"])),
        "torch_imported": torch_imported, "threads": proc_status("Threads"),
        "model_arrays": {key.removeprefix("model_arrays_"): value for key, value in record.items()
                         if key.startswith("model_arrays_")},
    }
    for name in ("train", "eval"):
        jitted, args = record[name]
        result[name] = step_memory(jitted, args)
        result[f"{name}_inputs"] = sum(device_bytes(leaf) for leaf in jax.tree.leaves(args[1:]))
    print(BREAKDOWN_PREFIX + json.dumps(result), flush=True)


def run_breakdown_case(case: str, pairs_dir: str, args) -> dict | str:
    """The case's result, or why there is none."""
    import tempfile

    with tempfile.TemporaryDirectory() as run_root:
        command = [sys.executable, __file__, "--breakdown-child", case, pairs_dir,
                   os.path.join(run_root, "run"), "--steps", str(args.steps), *args.overrides]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return f"still running after {args.timeout}s"
    lines = [line for line in done.stdout.splitlines() if line.startswith(BREAKDOWN_PREFIX)]
    if done.returncode or not lines:
        last = (done.stderr + done.stdout).strip().splitlines() or [""]
        return f"exit {done.returncode}: {last[-1].strip()[:200]}"
    return json.loads(lines[-1][len(BREAKDOWN_PREFIX):])


def mb(count: int) -> str:
    return f"{count / 2**20:,.0f} MB"


def print_breakdown(result: dict) -> None:
    devices, state, train = result["devices"], result["state"], result["train"]
    per_device = sum(state.values())
    print(f"\n{result['case']}: peak RSS {result['peak_rss'] / 2**30:.2f} GB on {devices} "
          f"devices = {mb(result['peak_rss'] / devices)} per device"
          f"; {result['threads']} threads{'; torch imported' if result['torch_imported'] else ''}")
    print(f"  {'phase':46} {'peak RSS':>10} {'at its end':>10}")
    for phase, peak, end in result["phases"]:
        print(f"  {phase:46} {mb(peak):>10} {mb(end):>10}")
    print(f"  per device: train state {mb(per_device)} = "
          + " + ".join(f"{kind} {mb(state[kind])}" for kind in KINDS)
          + f"; train batch {mb(result['train_inputs'])}, eval batch {mb(result['eval_inputs'])}")
    for name in ("train", "eval"):
        stats = result[name]
        if stats is None:
            print(f"  {name} step: no memory analysis on this backend")
            continue
        print(f"  {name} step per device (XLA): arguments {mb(stats['arguments'])}, outputs "
              f"{mb(stats['outputs'])} ({mb(stats['aliased'])} in donated buffers), temporaries "
              f"{mb(stats['temp'])}, code {mb(stats['code'])}")
    print("  the model's own arrays (host or one-device copies) still alive: " + ", ".join(
        f"{when.replace('_', ' ')} {mb(count)}" for when, count in result["model_arrays"].items()))
    held = devices * (per_device + train["temp"] + train["outputs"] - train["aliased"])
    print(f"  train step on all devices: {mb(held)} (state, temporaries, outputs not in donated "
          f"buffers); the state {'was' if result['donated'] else 'was NOT'} taken over by the "
          f"step; the rest of the peak, {mb(result['peak_rss'] - held)}, is the host's "
          "(imports, data, XLA's compiler and runtime)")


def breakdown(args) -> None:
    import tempfile

    from flaxlm.data.pairs import write_pair_dataset

    with tempfile.TemporaryDirectory() as pairs_dir:
        write_pair_dataset(pairs_dir)
        cases = args.case or list(breakdown_cases(pairs_dir))
        extra = f" ({' '.join(args.overrides)})" if args.overrides else ""
        print(f"memory of `flaxlm-train` runs of {args.steps} steps and one evaluation{extra}, "
              "each in a fresh process:")
        for case in cases:
            result = run_breakdown_case(case, pairs_dir, args)
            if isinstance(result, str):
                print(f"\n{case}: {result}", flush=True)
            else:
                print_breakdown(result)
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes-only", action="store_true")
    parser.add_argument("--lora", action="store_true",
                        help=f"full fine-tuning against experiment={LORA_PRESET} (only this)")
    parser.add_argument("--memory-gb", type=float, default=8.0)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("PRESET", "MESH"), help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true",
                        help="what holds the memory of real runs (only this part)")
    parser.add_argument("--case", action="append", choices=list(breakdown_cases("")),
                        help="a case of the breakdown (repeat for several; default: all)")
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT,
                        help="training steps of each breakdown run")
    parser.add_argument("--breakdown-child", nargs=3, metavar=("CASE", "PAIRS", "RUN_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides added to every breakdown case, e.g. model.remat=full")
    args = parser.parse_args()
    if args.breakdown_child:  # the run sets its own device count, as flaxlm-train does
        breakdown_child(*args.breakdown_child, args.steps, args.overrides)
        return
    if args.breakdown:
        breakdown(args)
        return
    use_cpu_devices()
    if args.lora:
        lora_table()
        return
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
