"""language.streaming: the corpus read as a stream, packed on the fly, shuffled a window at a time,
with a validation head never trained on and an explicit, restartable stream position."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time

import datasets
import numpy as np
import pytest
from conftest import compose, config_node, documents, streaming_run, write_hub_stand_in
from omegaconf import OmegaConf

from flaxlm.data.corpus import load_corpus_stream
from flaxlm.data.packing import cut_blocks, join_documents
from flaxlm.data.streaming import Prefetcher, StreamingLoader, process_shard
from flaxlm.data.tables import text_dataset
from flaxlm.data.tokenizer import train_bpe
from flaxlm.errors import FlaxlmError
from flaxlm.job import train
from flaxlm.parallel import make_mesh

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer():
    texts = text_dataset(documents(50, seed=9))
    return train_bpe(config_node("tokenizer"), texts, vocab_size=300)


@pytest.fixture
def hub_dir(tmp_path):
    """A local directory laid out like a Hub dataset: config `isl_Latn`, two parquet shards."""
    docs = documents(60, seed=1)
    root = write_hub_stand_in(tmp_path / "hub", "isl_Latn", docs, documents(4, seed=2))
    return root, docs


def language_of(overrides):
    return OmegaConf.to_object(compose(overrides)).language


def hub_stream(root, *extra):
    return load_corpus_stream(
        language_of(["language=is", f"language.hub_path={root}", "language.streaming=true",
                     *extra])
    )


def texts(stream) -> list[str]:
    return [row["text"] for row in stream]


def reference_blocks(docs, tokenizer) -> np.ndarray:
    """The non-streaming packing of `docs`."""
    ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)]
    return cut_blocks(join_documents(ids, tokenizer.eos_token_id), SEQ)


def loader_of(shard, tokenizer, mesh, **kwargs):
    settings = dict(max_seq_length=SEQ, global_batch_size=mesh.size, mesh=mesh, seed=0,
                    shuffle_buffer=1, max_steps=1000)
    return StreamingLoader(shard, tokenizer, **{**settings, **kwargs})


def take(loader, n) -> list[np.ndarray]:
    return [np.asarray(batch) for batch in itertools.islice(loader.epoch(0), n)]


# --- the corpus as a stream -----------------------------------------------------------------------


def test_a_local_hub_layout_streams_with_a_held_out_head(hub_dir):
    root, docs = hub_dir
    validation, train_stream = hub_stream(root, "language.max_eval_docs=7")
    assert isinstance(train_stream, datasets.IterableDataset)
    assert list(validation["text"]) == docs[:7]
    train_texts = texts(train_stream)
    assert train_texts == docs[7:]
    assert not set(validation["text"]) & set(train_texts)  # by content: never trained on


def test_a_glob_of_jsonl_files_streams_in_file_order(tmp_path):
    docs = documents(30, seed=3)
    for shard, part in enumerate((docs[:12], docs[12:])):
        rows = [{"id": i, "body": text} for i, text in enumerate(part)]
        rows.insert(1, {"id": -1, "body": "   "})  # blank: dropped before the head is taken
        (tmp_path / f"part-{shard}.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    language = language_of([
        "language=files", f"language.files=[{tmp_path}/*.jsonl]", "language.text_column=body",
        "language.streaming=true", "language.max_eval_docs=3",
    ])
    validation, train_stream = load_corpus_stream(language)
    assert list(validation["text"]) == docs[:3]
    assert texts(train_stream) == docs[3:]


def test_max_eval_docs_defaults_to_1000_and_must_leave_training_documents(hub_dir):
    root, _ = hub_dir
    with pytest.raises(FlaxlmError, match=r"language.max_eval_docs=1000"):
        hub_stream(root)  # 60 documents: all of them would be validation


def test_two_processes_read_disjoint_documents_whose_union_is_the_stream(hub_dir):
    root, docs = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    rank0, rank1 = (texts(process_shard(train_stream, rank, 2)) for rank in (0, 1))
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(docs[5:])


# --- packing, shuffle, state ----------------------------------------------------------------------


def test_with_a_shuffle_buffer_of_one_blocks_are_the_non_streaming_packing(hub_dir, tokenizer):
    root, docs = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    mesh = make_mesh(2)
    expected = reference_blocks(docs[5:], tokenizer)
    batches = take(loader_of(train_stream, tokenizer, mesh), len(expected) // 2)
    assert len(batches) >= 10
    np.testing.assert_array_equal(np.concatenate(batches), expected[: 2 * len(batches)])


def test_the_shuffle_is_seeded(hub_dir, tokenizer):
    root, _ = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    mesh = make_mesh(2)

    def run(seed):
        loader = loader_of(train_stream, tokenizer, mesh, seed=seed, shuffle_buffer=8)
        return np.stack(take(loader, 8))

    in_order = np.stack(take(loader_of(train_stream, tokenizer, mesh), 8))
    np.testing.assert_array_equal(run(0), run(0))
    assert not np.array_equal(run(0), run(1))
    assert not np.array_equal(run(0), in_order)
    # Two whole windows of 8 blocks (8 batches of 2), each permuted: the same 16 blocks
    def rows(batches):
        return sorted(map(bytes, batches.reshape(-1, SEQ)))

    assert rows(run(0)) == rows(in_order)


@pytest.mark.parametrize("steps_before", [1, 3, 5])
def test_restarting_from_a_saved_state_yields_the_same_next_batch(hub_dir, tokenizer, steps_before):
    root, _ = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    mesh = make_mesh(2)
    first = loader_of(train_stream, tokenizer, mesh, seed=3, shuffle_buffer=5)
    batches = take(first, steps_before + 1)  # the loader's state is after the last one yielded
    before = loader_of(train_stream, tokenizer, mesh, seed=3, shuffle_buffer=5)
    take(before, steps_before)
    saved = before.state()
    assert saved.documents > 0 or saved.window_blocks > 0  # mid-stream
    resumed = loader_of(train_stream, tokenizer, mesh, seed=3, shuffle_buffer=5, start_from=saved)
    np.testing.assert_array_equal(take(resumed, 1)[0], batches[-1])


def test_the_stream_starts_a_new_pass_when_it_ends(hub_dir, tokenizer, capsys):
    root, docs = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    mesh = make_mesh(2)
    per_pass = len(reference_blocks(docs[5:], tokenizer)) // 2
    loader = loader_of(train_stream, tokenizer, mesh)
    take(loader, per_pass + 2)
    assert loader.state().passes == 1
    assert "starting pass 2" in capsys.readouterr().out


# --- the producer thread --------------------------------------------------------------------------


def test_the_producer_holds_at_most_the_queue_size_ahead_of_the_consumer():
    produced = itertools.count()
    source = (next(produced) for _ in itertools.count())  # endless, like the stream
    prefetcher = Prefetcher(source, size=3)
    assert next(prefetcher) == 0
    time.sleep(0.3)  # ample time to run ahead, were it unbounded
    # the queue's 3, plus one item the producer holds while waiting for room
    assert next(produced) <= 1 + 3 + 1
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


def test_an_error_in_the_producer_is_raised_in_the_consumer_and_the_thread_ends():
    def source():
        yield 1
        raise ValueError("bad shard")

    prefetcher = Prefetcher(source(), size=2)
    assert next(prefetcher) == 1
    with pytest.raises(ValueError, match="bad shard"):
        next(prefetcher)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


def test_a_loader_stops_its_thread_when_the_consumer_stops(hub_dir, tokenizer):
    root, _ = hub_dir
    _, train_stream = hub_stream(root, "language.max_eval_docs=5")
    before = {t for t in threading.enumerate() if t.name == "flaxlm-stream"}
    batches = loader_of(train_stream, tokenizer, make_mesh(2)).epoch(0)
    next(batches)
    batches.close()
    assert {t for t in threading.enumerate() if t.name == "flaxlm-stream"} == before


# --- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_short_streaming_run_trains_to_a_finite_loss(tmp_path):
    loss = train(streaming_run(tmp_path, "trainer.max_steps=3"))
    assert math.isfinite(loss)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "train/loss" in line] == [1, 2, 3]


def test_streaming_without_max_steps_fails_naming_it(tmp_path):
    with pytest.raises(FlaxlmError, match=r"trainer\.max_steps"):
        train(streaming_run(tmp_path))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before anything was claimed
