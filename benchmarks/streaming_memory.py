"""Peak memory of `language.streaming=true` as the corpus grows: it should stay flat.

For each size, the script writes that many MB of generated English text as jsonl shards, then,
in a fresh process, streams them through `load_corpus_stream` and `StreamingLoader` (tokenise,
pack, shuffle window, prefetch, global batches on 2 CPU devices) until every training block has
been read once, and prints the process's peak RSS. Nothing is asserted.

    python benchmarks/streaming_memory.py                 # 10, 40 and 160 MB
    python benchmarks/streaming_memory.py --sizes 20 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data_pipeline import peak_rss_mb, synthetic_documents, train_tokenizer  # noqa: E402

SHARD_DOCS = 2000
SEQ_LEN, BATCH = 512, 16


def write_shards(documents: list[str], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for shard, start in enumerate(range(0, len(documents), SHARD_DOCS)):
        with open(os.path.join(directory, f"{shard:05d}.jsonl"), "w", encoding="utf-8") as f:
            for text in documents[start : start + SHARD_DOCS]:
                f.write(json.dumps({"text": text}) + "\n")


def stream_once(shards: str, tokenizer_dir: str) -> dict:
    """One pass over the stream in this (fresh) process; returns blocks, seconds, peak RSS."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from train_step import config_node

    from flaxlm.data.corpus import load_corpus_stream
    from flaxlm.data.streaming import StreamingLoader
    from flaxlm.data.tokenizer import load_tokenizer
    from flaxlm.parallel import make_mesh

    language = config_node("language", ["language=files"], name="bench", streaming=True,
                           files=[os.path.join(shards, "*.jsonl")], max_eval_docs=100)
    _, train = load_corpus_stream(language)
    tokenizer = load_tokenizer(tokenizer_dir, config_node("tokenizer"))
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    # A generous step budget; the pass counter says when the stream has been read once.
    loader = StreamingLoader(train, tokenizer, SEQ_LEN, BATCH, make_mesh(None), seed=0,
                             shuffle_buffer=1000, max_steps=10**9)
    batches = 0
    for _ in loader.epoch(0):
        batches += 1
        if loader.state().passes:
            break
    return {"batches": batches, "seconds": time.perf_counter() - start,
            "rss_before": rss_before, "rss_peak": peak_rss_mb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10, 40, 160])
    parser.add_argument("--stream", nargs=2, metavar=("SHARDS", "TOKENIZER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream:
        print(json.dumps(stream_once(*args.stream)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        largest = synthetic_documents(max(args.sizes))
        tokenizer_dir = os.path.join(tmp, "tokenizer")
        train_tokenizer(largest, 8192, 4, tokenizer_dir)
        print(f"{'corpus MB':>10} {'batches':>8} {'seconds':>8} {'RSS before':>11} {'peak RSS':>9}")
        for size in sorted(args.sizes):
            shards = os.path.join(tmp, f"shards-{size:g}")
            total, documents = 0, []
            for doc in largest:  # the leading documents of the largest corpus
                if total >= size * 1e6:
                    break
                documents.append(doc)
                total += len(doc.encode("utf-8"))
            write_shards(documents, shards)
            result = json.loads(subprocess.run(
                [sys.executable, __file__, "--stream", shards, tokenizer_dir],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1])
            print(f"{size:10g} {result['batches']:8d} {result['seconds']:8.1f} "
                  f"{result['rss_before']:9.0f} MB {result['rss_peak']:6.0f} MB")


if __name__ == "__main__":
    main()
