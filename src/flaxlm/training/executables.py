"""Compiled steps kept on disk: a run loads what an earlier run (or `flaxlm-plan --save`, for
its TPU slice) compiled, and neither traces nor compiles its train and eval steps.

JAX's persistent cache (`job.enable_compilation_cache`) skips XLA's compile on a second run,
but every run still traces and lowers each step to find the cache's key: seconds on a TPU for a
model of any size. Here the key is made without tracing, from everything that determines the
program (`program_key`): the config less a small allow-list of keys that change no compiled
program, the numbers the steps close over that come from the data (the schedule's length),
the devices and the mesh, the versions of the compiler's stack, XLA's flags and a hash of
flaxlm's own source; each step's file is further keyed by its arguments' tree, shapes and
dtypes (`signature`), which carry the rest (the vocabulary, the batch). A miss compiles as
before and writes the executable for the next run; a hit loads it
(`jax.experimental.serialize_executable`).

`StoredStep` wraps any jitted function with the same call; `stored_steps` wraps each step of
a task's `CompiledSteps`-like dataclass. Only process 0 writes (a temporary name renamed into
place: a killed run leaves no half-file that looks whole); every process reads.

A store's directory holds `<key digest>/key.json` (the key's parts, to say what differs when a
directory written for another run is refused) and `<key digest>/<role>-<signature>.exe` (the
pickled `serialize_executable.serialize` triple, zlib-compressed).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from flaxlm import distributed
from flaxlm.config import TrainConfig
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import MESH_AXES

STORE_DIR = "executables"  # under cache_dir
KEY_FILE = "key.json"

# Config keys (dotted prefixes) that change no compiled step: where a run writes and reads,
# how often it logs, evaluates and checkpoints, what it samples and reports, and the TPU
# topology flaxlm-plan compiles for (the devices the program runs on are in the key itself).
# The steps' length (trainer.max_steps, num_epochs) is in the key as the schedule's length.
# Everything else is in the key: a key added to the config misses until it is listed here.
NOT_IN_PROGRAM = (
    "run_dir", "resume_from", "output_url", "storage_retries", "cache_dir", "compiled_steps",
    "keep_compiled_steps", "logger", "checkpoint", "samples", "eval.harness",
    "trainer.num_epochs", "trainer.max_steps", "trainer.log_every_steps",
    "trainer.eval_every_steps", "trainer.eval_before_training", "trainer.resume",
    "trainer.resume_on_changed_data", "trainer.objective", "trainer.objective_mode",
    "trainer.objective_value", "hardware.topology", "hardware.peak_tflops_per_device",
    "hardware.hbm_gib_per_device", "hardware.hbm_gbps_per_device",
    "hardware.distributed.coordinator_address", "hardware.distributed.timeout_s",
)
# The stack that traces and compiles a step; a different version of any is another program.
VERSIONED = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "flax", "optax")
# XLA's flags that do not change a program: the CPU's simulated device count (the devices
# are in the key).
_IGNORED_FLAGS = ("--xla_force_host_platform_device_count",)
# What JAX itself adds to LIBTPU_INIT_ARGS when it starts on a TPU (jax._src.cloud_tpu_init):
# a run finds it there, a plan made on a CPU never does, and it changes no program.
_JAX_TPU_INIT_ARGS = ("--xla_tpu_use_enhanced_launch_barrier",)


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """What determines a run's compiled steps, as named parts (each a JSON value)."""

    parts: dict[str, Any]

    @property
    def digest(self) -> str:
        text = json.dumps(self.parts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def program_key(config: TrainConfig, schedule_steps: int, mesh,
                data: dict[str, str] | None = None) -> ProgramKey:
    """The key of the steps a run of `config` compiles on `mesh`, its learning-rate schedule
    `schedule_steps` long. `config` with the model it starts from (`base.model_start`).
    `data`: the run's data fingerprint ({what: content hash}), for steps that close over
    numbers read from the data (a classifier's labels, say); a plan has none (its task, clm,
    takes what it reads from the data as arguments)."""
    devices = list(mesh.devices.flat)
    data_part = {} if data is None else {"data": data}
    return ProgramKey({
        **data_part,
        "config": config_part(config),
        "schedule_steps": int(schedule_steps),
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "ids": [device.id for device in devices],
            "processes": len({device.process_index for device in devices}),
            "mesh": {str(axis): int(size) for axis, size in mesh.shape.items()},
        },
        "versions": versions(),
        "environment": environment(),
        "source": source_digest(),
    })


def config_part(config: TrainConfig) -> dict[str, str]:
    """`config` as {dotted key: JSON value}, less the keys that change no program."""
    flat = _flatten(dataclasses.asdict(config))
    return {key: value for key, value in flat.items()
            if not any(key == name or key.startswith(name + ".") for name in NOT_IN_PROGRAM)}


def _flatten(tree, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        flat = {}
        for name, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{name}."))
        return flat
    return {prefix[:-1]: json.dumps(tree, sort_keys=True, default=str)}


def versions() -> dict[str, str | None]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def environment() -> dict[str, str]:
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith(_IGNORED_FLAGS)]
    return {"XLA_FLAGS": " ".join(sorted(flags)),
            "LIBTPU_INIT_ARGS": " ".join(sorted(
                arg for arg in os.environ.get("LIBTPU_INIT_ARGS", "").split()
                if not arg.startswith(_JAX_TPU_INIT_ARGS))),
            "x64": str(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision)}


@functools.cache
def source_digest() -> str:
    """SHA-256 of flaxlm's Python source: a change to any module may change a step."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def signature(args) -> str:
    """The arguments' tree, shapes and dtypes (arrays or `ShapeDtypeStruct`s), as a digest:
    what a compiled step was made for beyond its key. Their shardings follow from the key (the
    config and the mesh lay the state out; the steps fix the batch's)."""
    leaves, tree = jax.tree.flatten(args)
    described = [str(tree)] + [f"{getattr(leaf, 'shape', ())}:{getattr(leaf, 'dtype', type(leaf))}"
                               f":{getattr(leaf, 'weak_type', False)}" for leaf in leaves]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]


class StepStore:
    """A directory of compiled steps (`<cache_dir>/executables`, or one written by
    `flaxlm-plan --save`)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.expanduser(str(root)))

    def path(self, key: ProgramKey, role: str, args_signature: str) -> Path:
        return self.root / key.digest / f"{role}-{args_signature}.exe"

    def load(self, key: ProgramKey, role: str, args_signature: str):
        """The stored step, loaded onto this process's devices; None if there is none."""
        path = self.path(key, role, args_signature)
        if not path.exists():
            return None
        with open(path, "rb") as file:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(file.read()))
        # On the devices the key names, in the mesh's order: the executable's own assignment.
        by_id = {device.id: device for device in jax.devices()}
        devices = [by_id[device_id] for device_id in key.parts["devices"]["ids"]]
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices)

    def save(self, key: ProgramKey, role: str, args_signature: str, compiled) -> bool:
        """Write `compiled` (a `jax.stages.Compiled`) for later runs; False where JAX cannot
        serialise it (e.g. a program with constants passed as arguments)."""
        try:
            # zlib's fastest level: a TPU step's executable shrinks about 3.5×, in a second.
            payload = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
        except (ValueError, NotImplementedError, TypeError, pickle.PicklingError) as err:
            print(f"flaxlm: the {role} step is not kept for later runs: JAX cannot serialise "
                  f"it ({err})", flush=True)
            return False
        folder = self.root / key.digest
        try:  # a cache that cannot be written costs the next run a compile, not this run
            folder.mkdir(parents=True, exist_ok=True)
            _write_atomically(folder / KEY_FILE,
                              json.dumps(key.parts, indent=1, sort_keys=True).encode())
            _write_atomically(self.path(key, role, args_signature), payload)
        except OSError as err:
            print(f"flaxlm: the {role} step is not kept for later runs: {folder} cannot be "
                  f"written ({err})", flush=True)
            return False
        return True

    def keys(self) -> list[dict]:
        """The parts of every key stored here."""
        found = []
        for path in sorted(self.root.glob(f"*/{KEY_FILE}")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.chmod(temporary, 0o666 & ~_umask())  # as open() would make it: others may share it
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def compile_to_keep(jitted: Callable, args, platform: str):
    """`jitted` lowered for `args` and compiled, for a store. On a CPU, not from JAX's
    persistent cache: XLA:CPU serialises an executable that was itself read from that cache
    without its kernels, and the copy fails when it runs ("Function ... not found"); other
    platforms' executables serialise whole, and a cache hit is kept."""
    lowered = jitted.lower(*args)
    if platform != "cpu":
        return lowered.compile()
    from jax._src import compilation_cache  # the switch JAX reads, checked once a process

    compilation_cache.is_cache_used(jax.devices("cpu")[0].client)  # checked now, not later
    used, compilation_cache._cache_used = compilation_cache._cache_used, False
    try:
        return lowered.compile()
    finally:
        compilation_cache._cache_used = used


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class StoredStep:
    """`jitted` (a `jax.jit` function), called the same way, its compiled program looked up in
    `store` by `key` and the arguments' signature before anything is traced; a miss compiles
    (JAX's persistent cache still applies) and, on process 0, writes it there.

    `required` (a directory from flaxlm-plan --save): a miss is refused, not compiled."""

    def __init__(self, jitted: Callable, role: str, key: ProgramKey, store: StepStore,
                 required: bool = False):
        self.jitted, self.role, self.key, self.store = jitted, role, key, store
        self.required = required
        self.compiled: dict[str, Any] = {}  # by signature
        self.loaded: set[str] = set()  # the signatures whose program came from the store
        self._unchecked: set[str] = set()  # loaded, not called yet
        self.last = None  # the program of the last call, tried first: no signature per step

    def __call__(self, *args):
        if self.last is not None:
            try:  # a compiled program checks its arguments before it runs (in C++)
                return self.last(*args)
            except (TypeError, ValueError):
                pass  # other arguments than the last call's: look up their program
        args_signature = signature(args)
        compiled = self.compiled.get(args_signature)
        if compiled is None:
            self.prepare(args)
            compiled = self.compiled[args_signature]
        if args_signature in self._unchecked:
            self._unchecked.discard(args_signature)
            result = self._first_call_of_loaded(args_signature, args)
            self.last = self.compiled[args_signature]
            return result
        self.last = compiled
        return compiled(*args)

    def prepare(self, args) -> None:
        """Load or compile (and keep) the program for `args`, arrays or their shapes
        (`ShapeDtypeStruct`s with shardings): ahead of the first call
        (`flaxlm.training.ahead`), or at it."""
        args_signature = signature(args)
        if args_signature not in self.compiled:
            self.compiled[args_signature] = self._obtain(args_signature, args)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def _obtain(self, args_signature: str, args):
        started = time.perf_counter()
        try:
            loaded = self.store.load(self.key, self.role, args_signature)
        except Exception as err:  # noqa: BLE001 — a damaged or foreign file: compile instead
            if self.required:
                raise self._refusal(f"its {self.role} step could not be loaded ({err})") from err
            print(f"flaxlm: the stored {self.role} step could not be loaded ({err}); "
                  "compiling it", flush=True)
            loaded = None
        if loaded is not None:
            self.loaded.add(args_signature)
            self._unchecked.add(args_signature)
            print(f"flaxlm: the {self.role} step loaded from "
                  f"{self.store.path(self.key, self.role, args_signature)} in "
                  f"{time.perf_counter() - started:.1f} s: not traced, not compiled", flush=True)
            return loaded
        if self.required:
            raise self._refusal(
                f"it holds no {self.role} step for this run's arguments "
                f"({_describe_args(args)}): the batch, the vocabulary or the state differ "
                "from what was planned")
        compiled = compile_to_keep(self.jitted, args, self.key.parts["devices"]["platform"])
        if distributed.is_primary():
            self.store.save(self.key, self.role, args_signature, compiled)
        return compiled

    def _first_call_of_loaded(self, args_signature: str, args):
        """A loaded program checks its arguments' types and shardings before it runs (nothing
        is donated then): one made for others is dropped and the step compiled."""
        try:
            return self.compiled[args_signature](*args)
        except (TypeError, ValueError) as err:
            if self.required:
                raise self._refusal(f"its {self.role} step does not take this run's "
                                    f"arguments ({err})") from err
            print(f"flaxlm: the stored {self.role} step does not take this run's arguments "
                  f"({str(err).splitlines()[0]}); compiling it", flush=True)
            self.loaded.discard(args_signature)
            compiled = self.compiled[args_signature] = compile_to_keep(
                self.jitted, args, self.key.parts["devices"]["platform"])
            if distributed.is_primary():
                self.store.save(self.key, self.role, args_signature, compiled)
            return compiled(*args)

    def _refusal(self, why: str) -> FlaxlmError:
        return FlaxlmError(
            f"compiled_steps={self.store.root} was not made for this run: {why}. Plan it again "
            "with this run's overrides (`flaxlm-plan <overrides> --save DIR`), or leave out "
            "compiled_steps to compile here.")


def _describe_args(args) -> str:
    leaves = jax.tree.leaves(args)
    shapes = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves[-4:] if hasattr(leaf, "shape")]
    return f"{len(leaves)} arrays, the last {', '.join(shapes)}"


def stored_steps(steps, key: ProgramKey, store: StepStore, required: bool = False):
    """`steps` (a dataclass of jitted steps: `CompiledSteps`) with each step a `StoredStep`; a
    step that calls a jitted function with arguments of its own added (`TrainStep`, which
    passes the optimizer's numbers) keeps them, and its jitted function is stored."""

    def stored(role: str, step):
        if dataclasses.is_dataclass(step) and hasattr(step, "jitted"):
            return dataclasses.replace(step, jitted=stored(role, step.jitted))
        return StoredStep(step, role, key, store, required)

    return dataclasses.replace(steps, **{
        field.name: stored(field.name, getattr(steps, field.name))
        for field in dataclasses.fields(steps)})


def kept_steps(steps, config: TrainConfig, schedule_steps: int, mesh,
               data: dict[str, str]):
    """`steps` as a run of `config` (with the model it starts from) takes them: loaded from
    compiled_steps (a directory from flaxlm-plan --save; refused, before anything runs, if it
    was made for another run), else with keep_compiled_steps from `<cache_dir>/executables`
    (written there on a miss; keyed by the run's `data` fingerprint too), else as they are."""
    if config.compiled_steps:
        store, key = StepStore(config.compiled_steps), program_key(config, schedule_steps, mesh)
        check_planned(store, key)
        print(f"flaxlm: compiled steps from compiled_steps={config.compiled_steps}", flush=True)
        return stored_steps(steps, key, store, required=True)
    if config.keep_compiled_steps:
        store = StepStore(os.path.join(os.path.expanduser(config.cache_dir), STORE_DIR))
        return stored_steps(steps, program_key(config, schedule_steps, mesh, data), store)
    return steps


def check_planned(store: StepStore, key: ProgramKey) -> None:
    """A directory from `flaxlm-plan --save` (compiled_steps) must hold this run's key; if not,
    one paragraph names what differs from the nearest key it holds: the devices, config keys,
    the schedule's length, versions, XLA's flags or flaxlm's source."""
    if (store.root / key.digest / KEY_FILE).exists():
        return
    saved = store.keys()
    if not saved:
        raise FlaxlmError(
            f"compiled_steps={store.root} holds no compiled steps (no */{KEY_FILE}): write it "
            "with `flaxlm-plan <this run's overrides> trainer.max_steps=N --save DIR`, or leave "
            "out compiled_steps.")
    nearest = min(saved, key=lambda parts: len(differences(parts, key.parts)))
    raise FlaxlmError(
        f"compiled_steps={store.root} was compiled for another run and is not used: "
        + "; ".join(differences(nearest, key.parts)) + ". Plan it again with this run's "
        "overrides (`flaxlm-plan <overrides> trainer.max_steps=N --save DIR`) on the same "
        "versions of flaxlm and jax, or leave out compiled_steps to compile here.")


def differences(saved: dict, current: dict) -> list[str]:
    """What differs between two keys' parts, as phrases naming each setting."""
    found = []
    if saved.get("devices") != current["devices"]:
        found.append(f"its devices are {_devices(saved.get('devices'))}, this run's "
                     f"{_devices(current['devices'])}")
    saved_config, config = saved.get("config", {}), current["config"]
    changed = sorted(name for name in set(saved_config) | set(config)
                     if saved_config.get(name) != config.get(name))
    if changed:
        shown = ", ".join(f"{name}={saved_config.get(name, 'absent')} there, "
                          f"{config.get(name, 'absent')} here" for name in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        found.append(f"config keys differ: {shown}{more}")
    if saved.get("schedule_steps") != current["schedule_steps"]:
        found.append(f"its learning-rate schedule spans {saved.get('schedule_steps')} steps, "
                     f"this run's {current['schedule_steps']} (set trainer.max_steps="
                     f"{current['schedule_steps']} when planning)")
    for part, what in (("versions", "versions"), ("environment", "XLA settings")):
        if saved.get(part) != current[part]:
            pairs = [f"{name} {saved.get(part, {}).get(name)} there, {value} here"
                     for name, value in current[part].items()
                     if saved.get(part, {}).get(name) != value]
            found.append(f"{what} differ: {', '.join(pairs)}")
    if saved.get("source") != current["source"]:
        found.append("flaxlm's source differs (another version or local changes)")
    return found or ["its key differs"]


def _devices(devices: dict | None) -> str:
    if not devices:
        return "unrecorded"
    # In the mesh's own axis order: a record read back from JSON has its keys sorted.
    axes = sorted(devices.get("mesh", {}).items(),
                  key=lambda item: MESH_AXES.index(item[0]) if item[0] in MESH_AXES else 99)
    mesh = " ".join(f"{axis}={size}" for axis, size in axes)
    return (f"{len(devices.get('ids', []))} × {devices.get('kind')} ({devices.get('platform')}, "
            f"mesh {mesh})")
