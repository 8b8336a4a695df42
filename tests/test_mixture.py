"""Several corpora in one run (`language=[a,b,c]`): the weights, the rows each source gives
(shares, determinism, blocks that never mix sources, epochs per source, disjoint rows per
process), the loader's position surviving a checkpoint mid-stage, the tokenizer's sample; and
one tiny run of three corpora with distinct alphabets, one of each kind of source (files, a Hub
dataset, a streamed one), whose per-language evaluation reaches metrics.jsonl, the report and
the objective, and which resumes mid-stage exactly, stream position included."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
from conftest import (
    TINY,
    assert_same_params,
    compose,
    config_node,
    documents,
    metrics_of,
    write_hub_stand_in,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from flaxlm.config import MixtureConfig, MixtureStage
from flaxlm.data.mixture import (
    MixtureSchedule,
    check_mixture_settings,
    mixture_weights,
    text_bytes,
    tokenizer_sample,
)
from flaxlm.data.mixture_loader import MixtureLoader, PackedSource, StreamedSource
from flaxlm.data.streaming import process_shard
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import train_bpe
from flaxlm.errors import FlaxlmError
from flaxlm.parallel import make_mesh

SEQ = 8


def mixture_of(names, **fields) -> MixtureConfig:
    language = config_node("language", ["language=files"])
    settings_ = {"temperature": 0.3, **fields}
    return MixtureConfig(sources={n: dataclasses.replace(language, name=n) for n in names},
                         **settings_)


# --- the command line -----------------------------------------------------------------------------


def test_a_list_of_languages_is_spelt_as_a_mixture_and_named_as_the_list():
    from flaxlm.cli.language_list import expand_language_list, folded
    from flaxlm.tracking import language_tags

    expanded = expand_language_list(["-m", "language=[is, no]", "model=gpt2"])
    assert expanded == ["-m", "language=mixture", "+language@mixture.sources.is=is",
                        "+language@mixture.sources.no=no", "model=gpt2"]
    assert folded(expanded[1:]) == ["language=[is,no]", "model=gpt2"]  # the W&B run's name
    assert expand_language_list(["language=[is]", "logger=[wandb]"]) == ["language=is",
                                                                         "logger=[wandb]"]
    with pytest.raises(FlaxlmError, match="names a language twice"):
        expand_language_list(["language=[is,is]"])
    config = OmegaConf.to_container(compose(["language=[is,no]"]))
    assert language_tags(config) == ["language=is", "language=no"]


# --- weights --------------------------------------------------------------------------------------


def test_weights_go_by_size_to_the_temperature_or_as_given():
    sizes = {"a": 100, "b": 400, "c": 1600}
    by = {t: mixture_weights(mixture_of(sizes, temperature=t), sizes) for t in (1.0, 0.5, 0.0)}
    assert by[1.0] == pytest.approx({"a": 1 / 21, "b": 4 / 21, "c": 16 / 21})
    assert by[0.5] == pytest.approx({"a": 1 / 7, "b": 2 / 7, "c": 4 / 7})
    assert by[0.0] == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    given_ = mixture_of(sizes, weights={"a": 2, "b": 1, "c": 1})
    assert mixture_weights(given_, sizes) == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})


@pytest.mark.parametrize(("fields", "names"), [
    ({"weights": {"a": -1, "b": 1}}, ["mixture.weights.a=-1"]),
    ({"weights": {"a": 0, "b": 0}}, ["mixture.weights", "all zero"]),
    ({"weights": {"a": 1, "b": 1, "is": 1}}, ["mixture.weights.is", "not in the mixture"]),
    ({"weights": {"a": 1}}, ["mixture.weights", "no weight to b"]),
    ({"temperature": -0.5}, ["mixture.temperature=-0.5"]),
    ({"stages": [MixtureStage(0, {"a": 1, "b": 1})]}, ["mixture.stages[0].start_step=0"]),
    ({"stages": [MixtureStage(5, {"a": 1, "c": 1})]}, ["mixture.stages[0].weights.c"]),
])
def test_bad_mixture_settings_name_the_key(fields, names):
    with pytest.raises(FlaxlmError) as info:
        check_mixture_settings(mixture_of(["a", "b"], **fields))
    assert all(name in str(info.value) for name in names), str(info.value)


def test_a_streamed_source_needs_weights_unless_they_are_equal():
    mixture = mixture_of(["a", "b"])
    mixture.sources["b"] = dataclasses.replace(mixture.sources["b"], streaming=True)
    with pytest.raises(FlaxlmError, match="streamed source.*b.*mixture.weights"):
        check_mixture_settings(mixture)
    check_mixture_settings(dataclasses.replace(mixture, temperature=0.0))
    check_mixture_settings(dataclasses.replace(mixture, weights={"a": 1, "b": 3}))


# --- which source gives each row ------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(weights=st.lists(st.integers(0, 20), min_size=2, max_size=5).filter(any),
       batch=st.integers(1, 48))
def test_each_sources_count_stays_within_a_row_of_its_weights_share(weights, batch):
    """Over a few thousand rows, every source's share is its weight's to ±1% (and at every
    batch its count is within one row of weight × rows)."""
    share = np.asarray(weights, float) / sum(weights)
    schedule = MixtureSchedule.of("abcde"[:len(weights)], dict(zip("abcde", share)))
    position, counts = schedule.start(), np.zeros(len(weights))
    while position.steps * batch < 3000:
        sources, numbers, position = schedule.draw(position, batch)
        for source, number in zip(sources, numbers):  # each source's rows in order
            assert number == counts[source]
            counts[source] += 1
        assert np.all(np.abs(counts - share * counts.sum()) < 1)
    assert np.all(np.abs(counts / counts.sum() - share) <= 0.01)
    assert np.all(counts[share == 0] == 0)


def test_a_stage_changes_the_shares_from_its_step_on():
    schedule = MixtureSchedule.of("ab", {"a": 0.5, "b": 0.5}, [(10, {"a": 0.9, "b": 0.1})])
    position, rows = schedule.start(), []
    for _ in range(110):
        sources, _, position = schedule.draw(position, 10)
        rows.append(sources)
    before, after = np.concatenate(rows[:9]), np.concatenate(rows[9:])  # steps 1-9, 10-
    assert (before == 0).mean() == 0.5
    assert (after == 0).mean() == pytest.approx(0.9, abs=0.01)


# --- the loader -----------------------------------------------------------------------------------


def packed(name: str, index: int, num_blocks: int, seed: int = 0) -> PackedSource:
    """Blocks whose every token says which source and block they are: (index + 1)·1000 +
    block (a streamed source's tokens are below 1000)."""
    blocks = np.repeat(np.arange(num_blocks, dtype=np.int32)[:, None] + 1000 * (index + 1),
                       SEQ, 1)
    return PackedSource(name, blocks, None, seed)


@pytest.fixture(scope="module")
def tokenizer():
    texts = text_dataset(documents(50, seed=9))
    return train_bpe(config_node("tokenizer"), texts, vocab_size=300)


def streamed(tokenizer, seed: int = 0, rank: int = 0, world: int = 1) -> StreamedSource:
    stream = text_dataset(documents(40, seed=5)).to_iterable_dataset()
    return StreamedSource("s", process_shard(stream, rank, world), tokenizer, SEQ, seed,
                          shuffle_buffer=4)


STAGES = [(3, {"a": 0.2, "b": 0.2, "c": 0.6})]


def loader_of(sources, seed=0, stages=(), batch=8, weights=None) -> MixtureLoader:
    weights = weights or dict.fromkeys([s.name for s in sources], 1 / len(sources))
    schedule = MixtureSchedule.of([s.name for s in sources], weights, stages)
    return MixtureLoader(sources, schedule, batch, make_mesh(1), seed, max_steps=12)


def take(loader, epoch=0, start=0, steps=None) -> list[np.ndarray]:
    batches = []
    for batch in loader.epoch(epoch, start):
        batches.append(np.asarray(batch))
        if steps is not None and len(batches) == steps:
            break
    return batches


def test_the_same_seed_gives_the_same_blocks_and_no_block_mixes_sources(capsys):
    def run(seed):
        return np.stack(take(loader_of([packed("a", 0, 5, seed), packed("b", 1, 11, seed),
                                        packed("c", 2, 30, seed)], seed)))

    rows = run(0).reshape(-1, SEQ)
    assert len(rows) == 5 * 8  # (5 + 11 + 30) // 8 steps: an epoch of the blocks together
    assert np.all(rows == rows[:, :1])  # every row is one block of one source
    np.testing.assert_array_equal(run(0), run(0))
    assert not np.array_equal(run(0), run(1))
    # Source a ran out twice, each time starting a new epoch: a new shuffle of its 5 blocks.
    a_blocks = rows[rows[:, 0] // 1000 == 1, 0] - 1000
    assert len(a_blocks) in (13, 14)
    epochs = [a_blocks[i:i + 5] for i in (0, 5)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs)
    assert not np.array_equal(*epochs)
    assert "mixture source a ran out and begins its epoch 3" in capsys.readouterr().out


def test_a_resumed_loader_continues_mid_stage_exactly(tokenizer):
    """12 steps straight, against 7 steps, a checkpoint's state (as JSON), and the rest: a
    stage begins at step 3, source a runs out, the streamed source is mid-window."""
    def sources():
        return [packed("a", 0, 4), packed("b", 1, 9), streamed(tokenizer)]

    weights = {"a": 0.3, "b": 0.3, "s": 0.4}
    stages = [(3, {"a": 0.2, "b": 0.2, "s": 0.6})]
    straight = take(loader_of(sources(), stages=stages, weights=weights))
    first = loader_of(sources(), stages=stages, weights=weights)
    assert len(take(first, steps=7)) == 7
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["position"]["stage"] == 1 and saved["streams"]["s"]["documents"] > 0
    resumed = loader_of(sources(), stages=stages, weights=weights)
    resumed.load_state_dict(saved)
    rest = take(resumed, 0, 7)
    assert len(rest) == 5
    for got, expected in zip(rest, straight[7:]):
        np.testing.assert_array_equal(got, expected)
    other = loader_of([packed("a", 0, 4), packed("b", 1, 10), streamed(tokenizer)],
                      stages=stages, weights=weights)
    with pytest.raises(FlaxlmError, match="num_blocks"):
        other.load_state_dict(saved)


def test_two_processes_read_disjoint_rows_of_every_source(tokenizer):
    """Each process reads its half of every global batch: of a packed source, blocks that the
    other does not read, together those one process reads; of a streamed source, the blocks
    of its own shard of the documents."""
    def loader(rank):
        return loader_of([packed("a", 0, 30), packed("b", 1, 40),  # no epoch ends in 6 steps
                          streamed(tokenizer, rank=rank, world=2)])

    def first(batches, steps=6):
        return [next(batches)[0] for _ in range(steps)]

    whole = first(loader(0).local_batches(0, 8))
    halves = [first(loader(0).local_batches(0, 4)), first(loader(1).local_batches(4, 4))]
    for step in range(6):
        both = np.concatenate([halves[0][step], halves[1][step]])
        packed_rows = whole[step][:, 0] >= 1000  # the same rows come from the same source
        np.testing.assert_array_equal(both[packed_rows], whole[step][packed_rows])
    for code in (1, 2):  # sources a and b
        read = [[int(r[0]) for h in half for r in h if r[0] // 1000 == code] for half in halves]
        assert read[0] and read[1] and not set(read[0]) & set(read[1])
        assert len(set(read[0] + read[1])) == len(read[0] + read[1])  # no block read twice
    shards = [[row["text"] for row in loader(rank).sources[2].shard] for rank in (0, 1)]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) + len(shards[1]) == 40


# What each of two real processes joined by jax.distributed reads of three global batches: its
# rows' first tokens from the packed sources (which say the block), and its rows of the
# streamed source (its own shard) whole.
TWO_PROCESSES = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_platforms", "cpu")
port, rank, tokenizer_dir, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank,
                           initialization_timeout=60)
import numpy as np, transformers
from flaxlm.data.mixture import MixtureSchedule
from flaxlm.data.mixture_loader import MixtureLoader, PackedSource, StreamedSource
from flaxlm.data.streaming import process_shard
from flaxlm.data.tables import text_dataset
from flaxlm.parallel import make_mesh, process_rows

def packed(name, index, num_blocks):
    blocks = np.repeat(np.arange(num_blocks, dtype=np.int32)[:, None] + 1000 * (index + 1), 8, 1)
    return PackedSource(name, blocks, None, 0)

texts = json.loads(os.environ["MIXTURE_TEXTS"])
stream = text_dataset(texts).to_iterable_dataset()
tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
shard = process_shard(stream, jax.process_index(), jax.process_count())
sources = [packed("a", 0, 30), packed("b", 1, 40), StreamedSource("s", shard, tokenizer, 8, 0, 4)]
schedule = MixtureSchedule.of("abs", {"a": 0.3, "b": 0.3, "s": 0.4})
mesh = make_mesh(None)
loader = MixtureLoader(sources, schedule, 8, mesh, 0, max_steps=3)
first, count = process_rows(8, mesh)
def local(batch):  # this process's rows of a global array, in row order
    shards = sorted(batch.addressable_shards, key=lambda shard: shard.index[0].start)
    return np.concatenate([np.asarray(shard.data) for shard in shards]).tolist()

rows = [local(batch) for batch, _ in zip(loader.epoch(0), range(3))]
with open(out, "w") as f:
    json.dump({"first": first, "count": count, "rows": rows}, f)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_real_processes_read_disjoint_rows_of_every_source(tokenizer, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    texts = documents(40, seed=5)
    env = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")},
           "MIXTURE_TEXTS": json.dumps(texts)}
    processes = [subprocess.Popen(
        [sys.executable, "-c", TWO_PROCESSES, str(port), str(rank), str(tmp_path / "tokenizer"),
         str(tmp_path / f"rows-{rank}.json")], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    read = [json.loads((tmp_path / f"rows-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["first"], r["count"]) for r in read] == [(0, 4), (4, 4)]
    # A global batch's rows hold what each process read of it (a streamed row: its own).
    packed_rows = [[tuple(row) for batch in r["rows"] for row in batch if row[0] >= 1000]
                   for r in read]
    streamed_rows = [[tuple(row) for batch in r["rows"] for row in batch if row[0] < 1000]
                     for r in read]
    for code in (1, 2):  # sources a and b: no block read by both, none twice
        blocks = [[row[0] for row in rows if row[0] // 1000 == code] for rows in packed_rows]
        assert blocks[0] and blocks[1] and not set(blocks[0]) & set(blocks[1])
        assert len(set(blocks[0] + blocks[1])) == len(blocks[0] + blocks[1])
    assert streamed_rows[0] and streamed_rows[1]
    assert not set(streamed_rows[0]) & set(streamed_rows[1])
    # Process 0's rows of the streamed source are blocks of its own documents: every other one.
    own = tokenizer.decode([t for row in streamed_rows[0] for t in row])
    assert texts[0].split()[0] in own or texts[2].split()[0] in own


# --- the tokenizer's text -------------------------------------------------------------------------


def test_the_tokenizer_sample_gives_each_source_its_weights_share_of_bytes():
    texts = {name: text_dataset(documents(n, seed=i))
             for i, (name, n) in enumerate([("a", 400), ("b", 100), ("c", 40)])}
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    sample = tokenizer_sample(texts, weights)
    by_source = {name: [t for t in sample["text"] if t in set(docs["text"])]
                 for name, docs in texts.items()}
    total = sum(int(text_bytes(text_dataset(d)).sum())
                for d in by_source.values())
    for name, docs in by_source.items():
        size = text_bytes(text_dataset(docs)).sum()
        assert size / total == pytest.approx(weights[name], abs=0.02), name
    assert len(by_source["c"]) == 40  # the source that limits the sample gives all it has


# --- a tiny run of three languages ----------------------------------------------------------------

# Three alphabets, so that a block from the wrong source would show in its characters.
ALPHABETS = {"ice": None, "cons": "bcdfghklmnprst", "greek": "αβγδεζηθικλμνξοπρστ"}
RUN = [*TINY, "task.max_seq_length=32", "trainer.max_steps=5", "trainer.log_every_steps=2",
       "trainer.eval_before_training=false", "checkpoint.every_steps=4",
       "samples.prompts=[]", "trainer.objective=eval/greek/bits_per_byte",
       "mixture.stages=[{start_step: 3, weights: {ice: 1, cons: 1, greek: 2}}]"]


def words(alphabet: str, docs: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(" ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7)))
                                for _ in range(rng.randint(20, 60))) for _ in range(docs))


def three_languages(folder) -> list[str]:
    """The overrides of a mixture of three corpora written into `folder`, one of each kind of
    source: local files (ice), a Hub dataset (cons, a local stand-in of Icelandic's FineWeb-2
    config) and the same streamed (greek). A stream has no known size: the weights are given."""
    folder.mkdir(exist_ok=True)
    texts = {name: ["\n\n".join(documents(120, seed))] if alphabet is None
             else words(alphabet, 100, seed).split("\n\n")
             for seed, (name, alphabet) in enumerate(ALPHABETS.items())}
    (folder / "ice.txt").write_text(texts["ice"][0], encoding="utf-8")
    overrides = ["language=mixture", "+language@mixture.sources.ice=files",
                 f"mixture.sources.ice.files=[{folder / 'ice.txt'}]",
                 "mixture.weights={ice: 0.5, cons: 0.3, greek: 0.2}"]
    for name, streaming in (("cons", False), ("greek", True)):
        hub = write_hub_stand_in(folder / name, "isl_Latn", texts[name][10:], texts[name][:10])
        overrides += [f"+language@mixture.sources.{name}=is",
                      f"mixture.sources.{name}.hub_path={hub}",
                      f"mixture.sources.{name}.streaming={str(streaming).lower()}"]
    overrides += ["mixture.sources.greek.max_eval_docs=10",
                  "mixture.sources.greek.shuffle_buffer=8"]
    return overrides


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    from flaxlm.job import train

    data = tmp_path_factory.mktemp("languages")
    run_dir = data / "run"
    overrides = [*RUN, *three_languages(data)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLAXLM_CACHE", str(tmp_path_factory.getbasetemp() / "flaxlm-cache"))
        train(compose(overrides, run_dir=run_dir))
    return run_dir, overrides


@pytest.mark.slow
def test_a_mixture_run_evaluates_each_language_and_records_its_weights(mixture_run):
    run_dir, _ = mixture_run
    last = [r for r in metrics_of(run_dir) if "eval/loss" in r][-1]
    for name in ALPHABETS:
        assert np.isfinite(last[f"eval/{name}/loss"]) and last[f"eval/{name}/bits_per_byte"] > 0
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert OmegaConf.to_container(saved.mixture.weights) == {"ice": 0.5, "cons": 0.3,
                                                             "greek": 0.2}
    assert saved.trainer.objective == "eval/greek/bits_per_byte"
    loader = json.loads((run_dir / "checkpoints" / "5" / "loader" / "metadata").read_text())
    assert set(loader["num_blocks"]) == {"ice", "cons"} and set(loader["streams"]) == {"greek"}
    # The 80 rows by source: 32 at 0.5/0.3/0.2 before the stage of step 3, 48 at 1/1/2 in it.
    assert loader["position"]["taken"] == [28, 22, 30]
    card = (run_dir / "model" / "README.md").read_text()
    assert "on ice, cons, greek" in card and "eval bits per byte, greek" in card

    from flaxlm.report import build_table, collect_runs

    table = build_table(collect_runs([str(run_dir)]), "eval/greek/bits_per_byte", False)
    assert {f"final eval/{name}/bits_per_byte" for name in ALPHABETS} <= set(table.header)
    assert "best eval/ice/loss" in table.header


@pytest.mark.slow
def test_a_mixture_run_resumed_mid_stage_equals_the_uninterrupted_run(mixture_run, tmp_path):
    from flaxlm.job import train

    reference, overrides = mixture_run
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    # The checkpoint at step 4 is left, two steps into the stage that begins at step 3.
    shutil.rmtree(run_dir / "checkpoints" / "5")
    train(compose(overrides, run_dir=run_dir))
    assert metrics_of(run_dir) == metrics_of(reference)
    assert_same_params(run_dir, reference)
