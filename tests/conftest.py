"""Shared test set-up: 8 simulated CPU devices, and caches that never touch the user's; and
everything more than one test module uses (no test module imports another): the tiny model,
composing the config, corpora and files to train on, running `flaxlm-train` in this process,
and comparing runs and checkpoints."""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

# Before JAX starts: every multi-device path runs on 8 simulated CPU devices, as on one 8-core
# TPU host. Tests that want fewer devices build a smaller mesh.
# The tests' programs are tiny and run in milliseconds, while compiling them is most of the
# suite's time: XLA's older elemental emitters and LLVM's cheaper optimisation level compile
# them in less than half of it.
COMPILER_FLAGS = ["--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true"]
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8", *COMPILER_FLAGS]
)
# On a TPU VM, `FLAXLM_TEST_TPU=1 python -m pytest -m tpu` runs the tests marked `tpu` on the
# chip (tests/test_tpu.py); everywhere else the whole suite runs on the CPU, and those are skipped.
ON_TPU = os.environ.get("FLAXLM_TEST_TPU") == "1"
if not ON_TPU:
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

# The S3 and GCS emulators, started by the tests that ask for a bucket (tests/buckets.py).
from buckets import gcs, gcs_endpoint, gcs_env, s3, s3_endpoint, s3_env  # noqa: E402, F401

# A module's end-to-end tests take ten times an ordinary test's time (`slow`: a few seconds), or
# forty (`multiprocess`: two processes that each start Python and JAX, 20-40 s): their weights,
# for the order below.
_TEST_WEIGHTS = {"multiprocess": 40, "slow": 10}


def pytest_configure(config):
    """A test process ends as flaxlm's commands do, without Python's final garbage collection:
    after a worker's share of the suite, that walk over its objects takes seconds."""
    from flaxlm.cli.common import end_without_final_collection

    end_without_final_collection()
    # pytest-xdist (3.7 and later) hands out `--dist loadfile`'s modules in its own order, the
    # ones with the most tests first, unless told to keep the collection's: the order of
    # pytest_collection_modifyitems below, longest first. Left to xdist, modules of a few long
    # end-to-end tests (test_multihost.py, test_wheel.py, test_resume_data.py) started last,
    # and the worker that drew them finished minutes after the other.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # JAX starts now, on the 8 devices set above, before any test does. Left to the first test
    # of a worker, a flaxlm-train run with hardware=cpu in this process would start it with one
    # device per core (configure_platform), and every later test there would see that many.
    import jax

    jax.devices()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collecting imports every test module, and with them most of the libraries, in each
    worker: as flaxlm-train loads its own, without the garbage collector walking them."""
    from flaxlm.cli.common import collector_paused_while_importing

    with collector_paused_while_importing():
        return (yield)


def pytest_collection_modifyitems(items):
    """The heaviest modules first, each module's tests together and in their order. With
    `pytest -n 2 --dist loadfile` (`make test`) a module runs on one worker, so its
    module-scoped runs are trained once, and the longest modules start first so that the last
    to finish is a short one."""
    weights: dict[str, int] = {}
    for item in items:
        on_the_chip = item.get_closest_marker("tpu") is not None
        if on_the_chip and not ON_TPU:
            item.add_marker(pytest.mark.skip(
                reason="needs a TPU: on a TPU VM, FLAXLM_TEST_TPU=1 python -m pytest -m tpu"))
        elif ON_TPU and not on_the_chip:
            item.add_marker(pytest.mark.skip(
                reason="FLAXLM_TEST_TPU=1 runs the tests marked tpu; the rest run on the CPU"))
        weight = next((weight for marker, weight in _TEST_WEIGHTS.items()
                       if item.get_closest_marker(marker)), 1)
        weights[item.module.__name__] = weights.get(item.module.__name__, 0) + weight
    items.sort(key=lambda item: -weights[item.module.__name__])


def user_env(*unset: str, **changes: str) -> dict[str, str]:
    """The environment for a child process that starts JAX as a user's command does: no JAX
    platform and no device count (its hardware group picks them), only the tests' cheaper
    compiler settings; without the variables `unset`, with `changes`."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", *unset)}
    return {**env, "XLA_FLAGS": " ".join(COMPILER_FLAGS), **changes}


def compiled_programs_dir(tmp_path_factory) -> Path:
    """Where the session keeps compiled programs: one folder that pytest-xdist's workers share
    (the same small steps recur across modules)."""
    session_dir = tmp_path_factory.getbasetemp()
    workers_dir = session_dir.parent if os.environ.get("PYTEST_XDIST_WORKER") else session_dir
    return workers_dir / "xla"


@pytest.fixture(autouse=True, scope="session")
def compiled_programs_kept(tmp_path_factory):
    """JAX's persistent cache on from a worker's first test, as `flaxlm.job.train` turns it on
    (every program kept, however quickly it compiled): left to the first in-process run, a
    worker compiled every program of the tests before it anew, though most tests build the
    same tiny models and steps as others (the cache is keyed by the program, not the Python
    function). On test_attention, test_llama, test_documents, test_losses, test_model and
    test_bert in one process: 124 s of CPU time instead of 132."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(compiled_programs_dir(tmp_path_factory)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path_factory, monkeypatch):
    """flaxlm's cache (tokenizers, packed blocks) in a per-session temp dir; compiled programs
    in the session's (`compiled_programs_dir`); `datasets`' cache in one per test (it would
    take a local dataset laid out like another test's for that one); the Hub offline."""
    import datasets
    import huggingface_hub

    session_dir = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("FLAXLM_CACHE", str(session_dir / "flaxlm-cache"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(compiled_programs_dir(tmp_path_factory)))
    # No run loads steps an earlier test compiled (flaxlm.training.executables): a test that
    # patches a step's code keeps the config, so the key would not tell its program apart.
    monkeypatch.setenv("FLAXLM_KEEP_COMPILED_STEPS", "false")
    hf_cache = tmp_path_factory.mktemp("hf-datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hf_cache))
    # `datasets` reads its settings once, at import: patch them where it looks them up.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", hf_cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH",
                        hf_cache / "downloads" / "extracted")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def cache_with_builtin(path: Path) -> Path:
    """A new flaxlm cache directory at `path` that holds the builtin corpus already, as the
    session's does: a process given a cache of its own would otherwise spend seconds reading
    the standard library again."""
    from flaxlm.data.corpus import builtin_documents

    session_cache = Path(os.environ["FLAXLM_CACHE"])
    builtin_documents(str(session_cache))  # kept there, parsed at most once a process
    shutil.copytree(session_cache / "builtin", path / "builtin")
    return path


@pytest.fixture
def unwritable(tmp_path):
    """A directory this process cannot write to: read-only by its mode, or, for root (whom
    modes do not stop), one under /sys, which is read-only on Linux."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    yield directory if not os.access(directory, os.W_OK) else Path("/sys/flaxlm-test")
    directory.chmod(0o755)


@pytest.fixture(scope="session")
def train_state():
    """A small GPT-2's train state (AdamW), replicated on 2 devices: what checkpoints hold."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from flaxlm.models.gpt2 import GPT2LMHeadModel
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.parallel import make_mesh, replicated
    from flaxlm.training.step import create_state

    config = config_node("model", ["model=gpt2"], num_layers=2, hidden_size=32, num_heads=2,
                         max_positions=16, vocab_size=64)
    model = GPT2LMHeadModel(TransformerSpec(config, jnp.float32, jnp.float32), nnx.Rngs(params=0))
    _, state = create_state(model, optax.adamw(1e-3))
    return jax.device_put(state, replicated(make_mesh(2)))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = os.path.join(REPO, "conf")

# A model and corpus small enough for a training run of a few seconds on 2 cores. No samples at
# the end (an eighth of such a run's time): test_export and test_generate test them.
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.max_positions=64",
    "model.vocab_size=512",
    "hardware.per_device_batch_size=2",
    "logger=none",
    "hardware=cpu-8",
    "samples.prompts=[]",
]


def trained_run(tmp_path_factory, name: str, overrides) -> str:
    """A run of `overrides` trained to its end in a fresh folder, for a module-scoped fixture
    that tests compare their runs with (the session's flaxlm cache, as every test has)."""
    from flaxlm.job import train

    run_dir = tmp_path_factory.mktemp(name) / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        train(compose(overrides, run_dir=run_dir))
    return run_dir


@functools.cache
def _composed(overrides: tuple[str, ...]):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose(overrides))


def config_node(node: str, overrides=(), **changes):
    """One typed node of the config `overrides` compose to (e.g. config_node("model",
    ["model=llama-tiny"], num_layers=2)), with `changes`: how a test builds a config in code while
    every value it does not change still comes from conf/, the one home of each value."""
    return dataclasses.replace(getattr(_composed(tuple(overrides)), node), **changes)


# An option of each model family: what model_config takes the family's settings from.
FAMILY_OPTIONS = {"gpt2": "gpt2", "bert": "bert-tiny", "llama": "llama-tiny",
                  "qwen2": "qwen2.5-0.5b"}


def model_config(family: str = "gpt2", **fields):
    """A network of `family` with the shape `fields` give, built in code: the family's
    settings (activation, dropout, epsilon, ...) come from conf/ through one of its options,
    whose optional shape settings (mlp_size, num_kv_heads) and pretrained weights are left out."""
    unset = {"mlp_size": None, "num_kv_heads": None, "init_from": None}
    return config_node("model", [f"model={FAMILY_OPTIONS[family]}"], **{**unset, **fields})


def mesh_config(**sizes):
    """The default hardware's mesh (conf/) with `sizes` changed, e.g. mesh_config(fsdp=8)."""
    return dataclasses.replace(config_node("hardware").mesh, **sizes)


def compose(overrides=(), run_dir=None, return_hydra_config=False):
    """conf/train.yaml composed as `flaxlm-train` would, outside a Hydra app (with its `hydra`
    node if `return_hydra_config`): a copy of its own, which the test may change."""
    from flaxlm.cli.language_list import expand_language_list

    extra = [f"run_dir={run_dir}"] if run_dir is not None else ["run_dir=unset"]
    return copy.deepcopy(_composed_once((*expand_language_list(overrides), *extra),
                                        return_hydra_config))


@functools.cache
def _composed_once(overrides: tuple[str, ...], return_hydra_config: bool):
    """Composing takes a tenth of a second, and the suite composes the same overrides hundreds
    of times; copying a composed config takes a few milliseconds."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from flaxlm.config import register_configs

    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


# --- corpora and files to train on ----------------------------------------------------------------

ENGLISH = """\
The village stood at the edge of a wide marsh, and in winter the wind came across it without
anything to stop it. The houses were low and built of grey stone, with small windows facing
away from the weather.

Every morning the baker opened his shop before the sun was up. He sold bread, a few cakes on
Sundays, and, when the boats came in, the small hard biscuits that fishermen took to sea.

The school had one room and one teacher. She taught reading, writing and arithmetic to
children of every age, and in the afternoons she read to them from a book of old stories.

In spring the marsh turned green and the birds returned. People walked out along the dykes in
the evenings to watch them settle on the water, and the older ones named every kind they saw.

The road to the town was long and often flooded. A cart took most of a day to make the
journey, and the carter knew every farm along the way and every dog that barked at him.

When the railway finally arrived, the village changed more in five years than it had in the
fifty before. New people came, the old inn was rebuilt, and the children went to school in town.

Some of the older people never trusted the trains. They said the noise frightened the cows
and the smoke spoiled the washing, and they went on taking the cart as long as there was one.

By the end of the century the marsh had been drained, the fields were ploughed, and only the
names of the lanes remembered the water that had once covered everything as far as the sea.
"""
TINY_CORPUS = "A few words.\n\nAnd a few more.\n"

# Training should never start in bad-input tests; if a check is missing, keep the run short.
SHORT = [*TINY, "hardware=cpu-8", "trainer.max_steps=1", "trainer.eval_before_training=false"]


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def assert_same_final_weights(run_dir, reference) -> None:
    """Two runs' final model/model.safetensors hold the same tensors, bit for bit."""
    import safetensors.numpy

    weights = "model/model.safetensors"
    ours = safetensors.numpy.load_file(str(Path(run_dir) / weights))
    theirs = safetensors.numpy.load_file(str(Path(reference) / weights))
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)  # bitwise


def assert_names(error: Exception | str, *fragments: str) -> None:
    """`error`'s message holds every fragment, in one paragraph."""
    message = str(error)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "\n\n" not in message


_WORDS = (
    "og í að er sem á það var til með fyrir en um af hann hún við þetta eru ekki sér eftir "
    "landið fólk veður fjall sjór hús bók saga dagur nótt vatn eldur jökull fjörður bátur "
    "skrifa lesa tala ganga sigla búa vinna hugsa segja sjá koma fara gera vita eiga "
    "stór lítill gamall nýr góður fallegur kaldur heitur langur stuttur"
).split()


def in_memory_dataset(data, features=None):
    """A `datasets.Dataset` of `data` (columns: a dict of lists; rows: a list of dicts), named by
    its content as flaxlm names the datasets it makes (`flaxlm.data.tables`):
    `Dataset.from_dict` / `from_list` would pickle the table with dill to name it, which fails
    where pyarrow lies outside the interpreter's prefix (a TPU VM's `pip install --target`)."""
    import hashlib
    import pickle

    import datasets
    import pyarrow as pa

    from flaxlm.data.tables import named_dataset

    fingerprint = hashlib.sha256(pickle.dumps(data)).hexdigest()
    if features is not None:
        return named_dataset(data, features, fingerprint)
    table = pa.Table.from_pylist(data) if isinstance(data, list) else pa.Table.from_pydict(data)
    return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=fingerprint)


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents of pseudo-Icelandic: a few sentences of 6-14 words each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
            for _ in range(rng.randint(2, 5))
        ]
        docs.append(" ".join(sentences))
    return docs


def write_hub_stand_in(
    root: Path, config: str, train_docs: list[str], test_docs: list[str]
) -> Path:
    """A directory laid out like a Hub dataset repo: a README whose YAML declares `config` with a
    train and a test split, parquet shards under data/<config>/<split>/, and the extra columns
    FineWeb-2 and Wikipedia carry next to `text`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, docs in (("train", train_docs), ("test", test_docs)):
        folder = root / "data" / config / split
        folder.mkdir(parents=True)
        half = (len(docs) + 1) // 2
        for shard, part in enumerate((docs[:half], docs[half:])):
            table = pa.table(
                {
                    "id": [f"{split}-{shard}-{i}" for i in range(len(part))],
                    "url": [f"https://example.is/{split}/{shard}/{i}" for i in range(len(part))],
                    "text": part,
                    "language_score": [0.99] * len(part),
                }
            )
            pq.write_table(table, folder / f"{shard:03d}_00000.parquet")
    (root / "README.md").write_text(
        "---\nlicense: odc-by\nconfigs:\n"
        f"- config_name: {config}\n  data_files:\n"
        f"  - split: train\n    path: data/{config}/train/*\n"
        f"  - split: test\n    path: data/{config}/test/*\n---\n# A local stand-in\n",
        encoding="utf-8",
    )
    return root


def streaming_run(tmp_path: Path, *extra: str):
    """A language.streaming run's config over three JSON-lines shards written into `tmp_path`."""
    docs = documents(300, seed=4)
    for shard in range(3):
        part = docs[shard * 100 : (shard + 1) * 100]
        (tmp_path / f"c{shard}.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in part))
    return compose(
        [*TINY, "language=files", f"language.files=[{tmp_path}/*.jsonl]",
         "language.streaming=true", "language.max_eval_docs=30", "language.shuffle_buffer=16",
         "tokenizer.train_docs=100", "task.max_seq_length=32", "trainer.log_every_steps=1", *extra],
        run_dir=tmp_path / "run",
    )


# A BERT classifier small enough for a few seconds on 2 cores; 8 simulated devices × 2 rows.
TINY_CLASSIFY = [
    "task=classify",
    "model=bert-tiny",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.mlp_size=64",
    "model.vocab_size=512",
    "task.max_seq_length=24",
    "task.text_pair_column=sentence2",
    "task.metrics=[accuracy,f1]",
    "hardware=cpu-8",
    "hardware.per_device_batch_size=2",
    "logger=none",
    "optimizer.lr=3e-3",
    "optimizer.warmup_steps=0",
    "trainer.log_every_steps=5",
]

_POOL_A = "alpha bravo charlie delta echo foxtrot golf hotel".split()
_POOL_B = "india juliet kilo lima mike november oscar papa".split()
_FILLER = "the a of to and in is it that was for on".split()


def write_pairs(path, num_rows: int, seed: int) -> str:
    """A pair task a tiny model learns in a few dozen steps: label 1 when the second sentence
    is drawn from one word pool, 0 from another; both share filler words."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["sentence1", "sentence2", "label"])
        for _ in range(num_rows):
            label = rng.randrange(2)
            pool = _POOL_A if label else _POOL_B
            first = " ".join(rng.choice(_FILLER + _POOL_A + _POOL_B) for _ in range(6))
            second = " ".join(rng.choice(pool if rng.random() < 0.5 else _FILLER)
                              for _ in range(6))
            writer.writerow([first, second, label])
    return str(path)


def files_overrides(pair_files) -> list[str]:
    """The overrides that fine-tune on a (train, validation) pair of files."""
    train, validation = pair_files
    return [f"task.files=[{train}]", f"task.eval_files=[{validation}]"]


TOKENIZER_TEXT = ["the cat sat on the mat", "a much longer prompt on the mat",
                  "the dog ate the cat"] * 5


def make_tokenizer(vocab_size: int = 97):
    """A small byte-level BPE over the letters of TOKENIZER_TEXT (no full byte alphabet, so it
    fits a 97-token model), with flaxlm's special tokens."""
    import tokenizers
    import transformers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    model.train_from_iterator(
        TOKENIZER_TEXT,
        tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials),
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
        unk_token="<unk>", mask_token="<mask>",
    )


# --- `flaxlm-train` in this process -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def train_cli(monkeypatch, capsys):
    """`flaxlm-train ARGS` run by its `main()` in this process, in the folder `cwd`: its exit
    code, stdout and stderr, as a subprocess would give them, without a Python+JAX start-up
    per call. JAX already runs here (8 CPU devices): what JAX's start-up does needs a process
    of its own. The process state `main()` changes (the environment, Hydra's global state,
    flaxlm.distributed) is put back after each call."""
    from hydra._internal import logging_config
    from hydra.core.global_hydra import GlobalHydra

    from flaxlm import distributed
    from flaxlm.cli.train import main

    def run(*args: str, cwd: Path) -> CliResult:
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("HYDRA_FULL_ERROR", "")  # main() sets it; this restores it after
        monkeypatch.setattr(sys, "argv", ["flaxlm-train", *args])
        monkeypatch.setattr(distributed._run, "supervise", distributed._run.supervise)
        # Hydra's logging set-up closes every handler it replaces, and with absl's the stream it
        # was made with: pytest's capture of an earlier moment. flaxlm prints what it says, so
        # nothing checked goes through logging.
        monkeypatch.setattr(logging_config, "configure_logging", lambda config: None)
        capsys.readouterr()
        GlobalHydra.instance().clear()
        try:
            main()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        finally:
            GlobalHydra.instance().clear()
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


# --- comparing runs and checkpoints ---------------------------------------------------------------

VOLATILE = {"time", "train/tokens_per_second", "train/mfu"}  # wall-clock dependent


def metrics_of(run_dir) -> list[dict]:
    """A run's metrics.jsonl without the wall-clock dependent values."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in f]


def assert_same_params(run_dir, reference_dir) -> None:
    """The two runs' latest checkpoints hold bitwise the same parameters, at the same step."""
    import numpy as np

    from flaxlm.training.checkpoint.manager import restore_params

    params, _, step = restore_params(str(run_dir))
    expected, _, expected_step = restore_params(str(reference_dir))
    assert step == expected_step
    for (path, leaf), (_, other) in zip(flat(params), flat(expected), strict=True):
        assert np.array_equal(leaf, other), path  # bitwise


def flat(tree, path=()):
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from flat(tree[key], (*path, key))
    else:
        yield path, tree


def stop_at(monkeypatch, stop_step: int, sig=signal.SIGTERM) -> None:
    """Send `sig` to this process while the loop logs `step`'s train metrics."""
    from flaxlm.tracking import Tracker

    log = Tracker.log

    def log_then_signal(self, metrics, step):  # noqa: F811 — Tracker.log's own signature
        log(self, metrics, step=step)
        if step == stop_step and "train/loss" in metrics:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(Tracker, "log", log_then_signal)


def assert_resumes_as_never_stopped(overrides: list[str], tmp_path: Path, monkeypatch, capsys,
                                    stop_step: int) -> None:
    """A run of `overrides` trained straight into tmp_path/straight, and one stopped by SIGTERM
    at `stop_step` and started again into tmp_path/resumed: the second resumes from its
    checkpoint there and ends with the first's metrics."""
    from flaxlm.job import train
    from flaxlm.training.stop import Preempted

    train(compose(overrides, run_dir=tmp_path / "straight"))
    with monkeypatch.context() as patch:
        stop_at(patch, stop_step)
        with pytest.raises(Preempted):
            train(compose(overrides, run_dir=tmp_path / "resumed"))
    capsys.readouterr()
    train(compose(overrides, run_dir=tmp_path / "resumed"))
    assert f"from its checkpoint at step {stop_step}" in capsys.readouterr().out
    assert metrics_of(tmp_path / "resumed") == metrics_of(tmp_path / "straight")


# --- two processes joined by jax.distributed ------------------------------------------------------

# What a script run by `in_two_processes` starts with: 4 CPU devices in each process, joined
# over gloo into one mesh of 8 (sys.argv: its process id, the coordinator's address).
TWO_PROCESSES_JOINED = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
"""


def in_two_processes(body: str, tmp_path: Path, timeout: float = 120) -> None:
    """Run `body` (Python, after TWO_PROCESSES_JOINED) in two processes; each must end well,
    having printed "process <its index> ok"."""
    import socket
    import subprocess

    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES_JOINED + body)
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        address = f"localhost:{sock.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    workers = [subprocess.Popen([sys.executable, str(script), str(i), address], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    try:
        outputs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for i, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0 and f"process {i} ok" in output, output[-3000:]


CHECKPOINT_LOADER = {"kind": "blocks", "epoch": 1, "step_in_epoch": 3, "seed": 0}


def bumped(state, by: float):
    """A distinct state per step: every float leaf + by, step = by."""
    import jax
    import jax.numpy as jnp

    moved = jax.tree.map(lambda x: x + by if jnp.issubdtype(x.dtype, jnp.inexact) else x, state)
    return moved.replace(step=jnp.asarray(int(by), jnp.int32))


@functools.cache
def _jitted_forward():
    from flax import nnx

    return nnx.jit(lambda model, ids_BxL: model(ids_BxL))


def full_forward(model, ids_BxL):
    """A language model's logits of `ids_BxL`, the whole forward pass as one program."""
    return _jitted_forward()(model, ids_BxL)


def greedy_by_recomputing(model, prompt: list[int], new_tokens: int, context: int,
                          eos: int | None = None) -> list[int]:
    """The reference of cached generation: the full forward pass over the whole prefix for
    every new token, the argmax of its last position; stops before `eos`. The prefix is
    right-padded to `context` tokens (one compiled shape); causal attention means the padding
    after it changes nothing."""
    import jax.numpy as jnp
    import numpy as np

    ids = list(prompt)
    for _ in range(new_tokens):
        padded = np.zeros((1, context), np.int32)
        padded[0, : len(ids)] = ids
        ids.append(int(jnp.argmax(full_forward(model, jnp.asarray(padded))[0, len(ids) - 1])))
        if ids[-1] == eos:
            return ids[len(prompt):-1]
    return ids[len(prompt):]


def leaves_equal(a, b) -> bool:
    import jax
    import numpy as np

    pairs = zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


def save_steps(directory, state, steps, **options):
    """A Checkpointer in `directory` that saved `bumped(state, step)` for each of `steps`."""
    from flaxlm.training.checkpoint.manager import Checkpointer

    checkpointer = Checkpointer(str(directory), **options)
    for step in steps:
        checkpointer.save(step, bumped(state, step), {**CHECKPOINT_LOADER, "step": step},
                          {"config": {"model": {"num_layers": 2}}})
    checkpointer.wait()
    return checkpointer
