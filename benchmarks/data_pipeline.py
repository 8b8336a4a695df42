"""Data-pipeline throughput: tokenising and packing ~100 MB of text into blocks.

On one deterministic synthetic corpus (documents of varied length sampled with a seeded RNG
from the paragraphs of the builtin corpus) and one byte-level BPE trained once (untimed), the
script times, each in a fresh subprocess so that peak memory is measured per approach:

* floor: `tokenizer.backend_tokenizer.encode_batch` alone over batches of 1000 documents,
  results thrown away (with --fast-floor also `encode_batch_fast`, which skips offsets);
* ours:  `flaxlm.data.packing.tokenize_and_pack` with a cold cache, and its overhead over the
  floor (target <= 25%);
* seed:  the seed notebook's `Dataset.map(tokenize)` then `.map(group_texts)` with
  `sum(lists, [])`, num_proc=1, on a smaller slice (`--seed-mb`) since it is quadratic per
  batch; rates are compared per MB;
* mmap:  peak memory of loading our cached blocks memory-mapped and reading one shuffled epoch.

It prints a table of MB/s, tokens/s and peak RSS. Nothing is asserted: the machine is shared and
noisy, so only the ratios mean something.

    python benchmarks/data_pipeline.py                       # 100 MB, vocab 8192, blocks of 512
    python benchmarks/data_pipeline.py --mb 20 --seed-mb 5   # quicker
    python benchmarks/data_pipeline.py --only ours --workdir DIR   # one approach (internal use)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

APPROACHES = ("floor", "ours", "seed", "mmap")
ENCODE_BATCH = 1000


# --- the corpus and the tokenizer (built once, untimed) ------------------------------------------


def synthetic_documents(megabytes: float, seed: int = 0) -> list[str]:
    """Documents of `megabytes` MB in total (UTF-8), each a seeded random draw of paragraphs of the
    builtin corpus: lengths vary from one paragraph to a few hundred (log-normal count, median
    ~12 paragraphs, ~2 KB), so no document is a repeat of another."""
    from flaxlm.data.corpus import builtin_documents

    paragraphs = [
        p.strip() for doc in builtin_documents() for p in re.split(r"\n\s*\n", doc) if p.strip()
    ]
    sizes = np.array([len(p.encode("utf-8")) + 2 for p in paragraphs])
    rng = np.random.default_rng(seed)
    target = int(megabytes * 1e6)
    documents, total = [], 0
    while total < target:
        count = int(np.clip(rng.lognormal(mean=np.log(12), sigma=1.0), 1, 400))
        picks = rng.integers(0, len(paragraphs), count)
        documents.append("\n\n".join(paragraphs[i] for i in picks))
        total += int(sizes[picks].sum()) - 2
    return documents


def text_megabytes(documents: list[str]) -> float:
    return sum(len(d.encode("utf-8")) for d in documents) / 1e6


def first_megabytes(documents: list[str], megabytes: float) -> list[str]:
    """The leading documents holding at most `megabytes` MB (at least one)."""
    total, limit = 0, megabytes * 1e6
    for n, doc in enumerate(documents):
        total += len(doc.encode("utf-8"))
        if total > limit:
            return documents[: max(n, 1)]
    return documents


def train_tokenizer(documents: list[str], vocab_size: int, sample_mb: float, directory: str):
    import datasets
    from train_step import config_node

    from flaxlm.data.tokenizer import train_bpe

    sample = datasets.Dataset.from_dict({"text": first_megabytes(documents, sample_mb)})
    settings = config_node("tokenizer", vocab_size=vocab_size)
    train_bpe(settings, sample, vocab_size).save_pretrained(directory)


def load(workdir: str, documents: bool = True):
    """The corpus as a list of str (if `documents`) and the tokenizer, saved by the parent."""
    from train_step import config_node

    from flaxlm.data.tokenizer import load_tokenizer

    if documents:
        with open(os.path.join(workdir, "docs.pkl"), "rb") as f:
            documents = pickle.load(f)
    return documents, load_tokenizer(os.path.join(workdir, "tokenizer"), config_node("tokenizer"))


# --- the approaches, each run in its own process -----------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak RSS in MB. VmHWM rather than getrusage's ru_maxrss: Linux carries
    ru_maxrss over fork and exec, so a child would inherit the parent's peak."""
    peak = proc_status_mb("VmHWM")
    return peak if peak == peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_floor(args) -> dict:
    documents, tokenizer = load(args.workdir)
    backend = tokenizer.backend_tokenizer
    result = {"mb": text_megabytes(documents), "docs": len(documents), "rss_before": peak_rss_mb()}
    names = ["encode_batch"] + (["encode_batch_fast"] if args.fast_floor else [])
    for name in names:
        encode = getattr(backend, name, None)
        if encode is None:
            continue
        tokens, start, cpu = 0, time.perf_counter(), time.process_time()
        for i in range(0, len(documents), ENCODE_BATCH):
            tokens += sum(len(e) for e in encode(documents[i : i + ENCODE_BATCH],
                                                 add_special_tokens=False))
        result[name] = {"seconds": time.perf_counter() - start, "tokens": tokens,
                        "cpu": time.process_time() - cpu}
    result["rss_peak"] = peak_rss_mb()
    return result


class _TimedBackend:
    """The tokenizer's backend, timing its `encode_batch` calls: what `tokenize_and_pack`
    spends outside them is the packing overhead, measured in the same run as the encoding, so
    a busy machine slows both alike."""

    def __init__(self, backend):
        self._backend, self.encode_cpu, self.encode_seconds = backend, 0.0, 0.0

    def encode_batch(self, *args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return self._backend.encode_batch(*args, **kwargs)
        finally:
            self.encode_seconds += time.perf_counter() - start
            self.encode_cpu += time.process_time() - cpu

    def __getattr__(self, name):
        return getattr(self._backend, name)


class _TimedTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.backend_tokenizer = _TimedBackend(tokenizer.backend_tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def run_ours(args) -> dict:
    import datasets

    from flaxlm.data.packing import tokenize_and_pack

    # As in training: the text is an Arrow dataset on disk (memory-mapped), not a Python list.
    texts = datasets.load_from_disk(os.path.join(args.workdir, "docs-arrow"))
    tokenizer = _TimedTokenizer(load(args.workdir, documents=False)[1])
    cache = os.path.join(args.workdir, "ours-cache")
    shutil.rmtree(cache, ignore_errors=True)
    rss_before = peak_rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    blocks = tokenize_and_pack(texts, tokenizer, args.block, cache, desc="ours")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rss_peak = peak_rss_mb()
    backend = tokenizer.backend_tokenizer
    # Untimed: the same packing on the seed's slice, to compare block counts.
    sizes = np.cumsum([len(t.encode("utf-8")) for t in texts["text"]])
    seed_docs = max(int(np.searchsorted(sizes, args.seed_mb * 1e6, side="right")), 1)
    seed_slice = tokenize_and_pack(texts.select(range(seed_docs)), tokenizer._tokenizer,
                                   args.block, cache + "-seed-slice")
    return {"mb": sizes[-1] / 1e6, "docs": len(texts), "seconds": seconds, "cpu": cpu,
            "encode_seconds": backend.encode_seconds, "encode_cpu": backend.encode_cpu,
            "seed_slice_blocks": len(seed_slice), "tokens": int(blocks.size),
            "blocks": len(blocks), "eos": tokenizer.eos_token_id, "rss_before": rss_before,
            "rss_peak": rss_peak}


def run_seed(args) -> dict:
    """The seed notebook's tokenize + group_texts, as it wrote them."""
    import datasets

    documents, tokenizer = load(args.workdir)
    documents = first_megabytes(documents, args.seed_mb)
    block_size = args.block

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        # Concatenate all texts.
        concatenated_examples = {k: sum(examples[k], []) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        # We drop the small remainder, we could add padding if the model supported it instead of
        # this drop, you can customize this part to your needs.
        total_length = (total_length // block_size) * block_size
        # Split by chunks of max_len.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    rss_before = peak_rss_mb()
    start = time.perf_counter()
    raw = datasets.Dataset.from_dict({"text": documents})
    from_dict_s = time.perf_counter() - start
    cpu = time.process_time()
    # num_proc=None: one worker, in this process. The notebook's num_proc=1 meant that too, but
    # the installed datasets runs num_proc=1 in a pool process, out of this process's rusage.
    tokenized = raw.map(tokenize_function, batched=True, num_proc=None, remove_columns=["text"])
    tokenize_s = time.perf_counter() - start - from_dict_s
    lm_dataset = tokenized.map(group_texts, batched=True, num_proc=None)
    seconds = time.perf_counter() - start - from_dict_s
    cpu = time.process_time() - cpu
    return {"mb": text_megabytes(documents), "docs": len(documents), "seconds": seconds, "cpu": cpu,
            "from_dict_s": from_dict_s, "tokenize_s": tokenize_s, "blocks": len(lm_dataset),
            "tokens": len(lm_dataset) * block_size, "rss_before": rss_before,
            "rss_peak": peak_rss_mb()}


def run_mmap(args) -> dict:
    """Load our cached blocks memory-mapped and read one epoch of shuffled batches, as the
    training loader does; RSS counts the mapped file's resident pages (reclaimable page cache),
    so the anonymous part (what the process really holds) is sampled too."""
    (path,) = glob.glob(os.path.join(args.workdir, "ours-cache", "blocks", "*.npy"))
    rss_before, anon_before = peak_rss_mb(), proc_status_mb("RssAnon")
    start, cpu = time.perf_counter(), time.process_time()
    blocks = np.load(path, mmap_mode="r")
    order = np.random.default_rng(0).permutation(len(blocks))
    anon_peak, checksum, batch = anon_before, 0, 32
    for i in range(0, len(order) - batch + 1, batch):
        rows = np.stack([blocks[j] for j in order[i : i + batch]])
        checksum += int(rows[:, 0].sum())
        if i % (batch * 64) == 0:
            anon_peak = max(anon_peak, proc_status_mb("RssAnon"))
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
            "file_mb": os.path.getsize(path) / 2**20,
            "blocks": len(blocks), "rss_before": rss_before, "rss_peak": peak_rss_mb(),
            "anon_before": anon_before, "anon_peak": anon_peak}


# --- the parent: prepare, spawn, report --------------------------------------------------------


def spawn(approach: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--only", approach, "--workdir",
               args.workdir, "--block", str(args.block), "--seed-mb", str(args.seed_mb)]
    command += ["--fast-floor"] if args.fast_floor else []
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1",
                               "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
    if done.returncode != 0:
        sys.exit(f"--only {approach} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100, help="MB of text for floor and ours")
    parser.add_argument("--seed-mb", type=float, default=10, help="MB of text for the seed's way")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block", type=int, default=512, help="tokens per block")
    parser.add_argument("--tokenizer-mb", type=float, default=4, help="BPE training sample")
    parser.add_argument("--fast-floor", action="store_true",
                        help="also time encode_batch_fast (no offsets) as a floor")
    parser.add_argument("--only", choices=APPROACHES, help="run one approach in this process")
    parser.add_argument("--workdir", help="corpus, tokenizer and caches (default: a temp dir)")
    args = parser.parse_args()

    if args.only:
        print(json.dumps(globals()[f"run_{args.only}"](args)))
        return

    owned = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="flaxlm-data-bench-")
    try:
        report(args)
    finally:
        if owned:
            shutil.rmtree(args.workdir, ignore_errors=True)


def report(args) -> None:
    start = time.perf_counter()
    documents = synthetic_documents(args.mb)
    with open(os.path.join(args.workdir, "docs.pkl"), "wb") as f:
        pickle.dump(documents, f, protocol=pickle.HIGHEST_PROTOCOL)
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": documents}).save_to_disk(
        os.path.join(args.workdir, "docs-arrow"))
    lengths = np.array([len(d.encode("utf-8")) for d in documents])
    print(f"corpus: {lengths.sum() / 1e6:.1f} MB in {len(documents)} documents (bytes: median "
          f"{np.median(lengths):.0f}, p5 {np.percentile(lengths, 5):.0f}, p95 "
          f"{np.percentile(lengths, 95):.0f}, max {lengths.max()}), built in "
          f"{time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    train_tokenizer(documents, args.vocab, args.tokenizer_mb,
                    os.path.join(args.workdir, "tokenizer"))
    print(f"tokenizer: byte-level BPE, vocab {args.vocab}, trained on the first "
          f"{args.tokenizer_mb:g} MB in {time.perf_counter() - start:.0f} s (untimed below); "
          f"blocks of {args.block} tokens; {os.cpu_count()} CPUs; each approach in a fresh "
          "process")
    del documents

    results = {}
    for approach in APPROACHES:
        print(f"  running {approach} ...", flush=True)
        results[approach] = spawn(approach, args)
    floor, ours, seed, mmap = (results[a] for a in APPROACHES)

    def rates(mb, seconds, tokens, cpu):
        return (f"{mb:7.1f} {seconds:8.1f} {cpu:7.1f} {mb / seconds:8.2f} "
                f"{tokens / seconds / 1e6:9.3f}")

    def rss(r):
        return f"{r['rss_peak']:9.0f} {r['rss_peak'] - r['rss_before']:+9.0f}"

    print()
    print(f"{'approach':44s} {'MB':>7s} {'seconds':>8s} {'cpu s':>7s} {'MB/s':>8s} "
          f"{'Mtok/s':>9s} {'peakRSS':>9s} {'(+MB)':>9s}")
    for name in ("encode_batch", "encode_batch_fast"):
        if name in floor:
            f = floor[name]
            print(f"{'(a) floor: backend.' + name + ' only':44s} "
                  f"{rates(floor['mb'], f['seconds'], f['tokens'], f['cpu'])} {rss(floor)}")
    print(f"{'(b) ours: tokenize_and_pack (cold cache)':44s} "
          f"{rates(ours['mb'], ours['seconds'], ours['tokens'], ours['cpu'])} {rss(ours)}")
    print(f"{'(c) seed: map(tokenize) + map(group_texts)':44s} "
          f"{rates(seed['mb'], seed['seconds'], seed['tokens'], seed['cpu'])} {rss(seed)}")
    print(f"{'(d) mmap: np.load(mmap_mode=r) + 1 epoch':44s} {'':7s} {mmap['seconds']:8.1f} "
          f"{mmap['cpu']:7.1f} {'':8s} {'':9s} {rss(mmap)}")
    print("  seconds: wall; cpu s: CPU time of the process, all threads (steadier than wall on a "
          "shared machine).\n  peakRSS: the process's peak RSS (VmHWM) in MB; (+MB): its growth "
          "during the timed part (the corpus and tokenizer are loaded before).\n  Mtok/s: tokens "
          "in the floor's output, or in the blocks for (b) and (c).")

    print()
    for name in ("encode_batch", "encode_batch_fast"):
        if name in floor:
            print(f"packing overhead (b)/(a) - 1, floor {name}: wall "
                  f"{ours['seconds'] / floor[name]['seconds'] - 1:+.1%}, cpu "
                  f"{ours['cpu'] / floor[name]['cpu'] - 1:+.1%}   (target: <= 25%; two "
                  "processes, so it includes the machine's drift)")
    print(f"packing overhead inside (b), time outside encode_batch / time in it: wall "
          f"{ours['seconds'] / ours['encode_seconds'] - 1:+.1%}, cpu "
          f"{ours['cpu'] / ours['encode_cpu'] - 1:+.1%}   (target: <= 25%; same run, so "
          f"steadier; encode_batch took {ours['encode_seconds']:.1f} s of {ours['seconds']:.1f} s)")
    speedup = (ours["mb"] / ours["seconds"]) / (seed["mb"] / seed["seconds"])
    speedup_cpu = (ours["mb"] / ours["cpu"]) / (seed["mb"] / seed["cpu"])
    print(f"ours vs seed, MB of text per second: {speedup:.1f}x wall, {speedup_cpu:.1f}x cpu"
          + (f"   (the seed's way ran on the first {seed['mb']:.1f} MB only, see --seed-mb; "
             "per-MB rates compared)" if seed["mb"] < ours["mb"] * 0.99 else ""))
    print(f"  seed split: Dataset.from_dict {seed['from_dict_s']:.1f} s (not counted), "
          f"map(tokenize) {seed['tokenize_s']:.1f} s, map(group_texts) "
          f"{seed['seconds'] - seed['tokenize_s']:.1f} s")
    print(f"blocks of {args.block} on the seed's {seed['mb']:.1f} MB ({seed['docs']} documents), "
          f"same tokenizer: ours {ours['seed_slice_blocks']} (EOS id {ours['eos']} after each "
          f"document), seed {seed['blocks']} (no EOS; remainder dropped per batch of 1000); "
          f"ours on all {ours['mb']:.1f} MB: {ours['blocks']}")
    print(f"mmap: blocks file {mmap['file_mb']:.0f} MiB; reading one shuffled epoch in batches "
          f"of 32 grew RSS by {mmap['rss_peak'] - mmap['rss_before']:.0f} MB, of which anonymous "
          f"memory {mmap['anon_peak'] - mmap['anon_before']:+.0f} MB (the rest is the file's page "
          f"cache, mapped and reclaimable)")


if __name__ == "__main__":
    main()
