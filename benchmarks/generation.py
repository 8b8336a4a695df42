"""Generation speed: flaxlm's KV-cache decoding against transformers' PyTorch `generate`.

The same model (random weights, the family and shape of the chosen preset), the same prompts
(`--batch` rows of `--prompt` tokens) and `--new` new tokens per row, never stopped early by an
end-of-text token. Each contender runs in a process of its own, once per round, alternating
(harness.py); the table gives new tokens per second per row, median and spread, and the
milliseconds per new token. flaxlm's first call compiles and is not timed.

    python benchmarks/generation.py                          # gpt2-tiny, batch 1, greedy
    python benchmarks/generation.py model=llama-tiny --batch 8 --sample

Positional arguments are Hydra overrides of conf/train.yaml (model=...).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from train_step import compose  # noqa: E402

TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.95  # the sampling settings of both contenders


def flax_worker(config, prompts: np.ndarray, args) -> None:
    from flax import nnx

    from flaxlm.generate import GenerationSettings, generate_ids
    from flaxlm.models.build import build_lm
    from flaxlm.models.layers import TransformerSpec

    model = build_lm(TransformerSpec(config.model), nnx.Rngs(params=0))
    settings = GenerationSettings(max_new_tokens=args.new, greedy=not args.sample,
                                  temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    rows = prompts.tolist()

    def run():
        new = generate_ids(model, rows, settings, eos_token_id=None, pad_token_id=1)
        assert all(len(ids) == args.new for ids in new)  # nothing stopped early

    harness.emit(harness.time_steps(run, warmup=1, steps=args.repeats))


def torch_worker(config, prompts: np.ndarray, args) -> None:
    import torch
    import transformers

    from flaxlm.models.hf import to_lm_config

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    hf_config = to_lm_config(config.model, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    input_ids = torch.from_numpy(prompts.astype(np.int64))
    sampling = dict(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)

    def run():
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=args.new, min_new_tokens=args.new,
                                 pad_token_id=1, **(sampling if args.sample else
                                                    {"do_sample": False}))
        assert out.shape[1] == input_ids.shape[1] + args.new

    harness.emit(harness.time_steps(run, warmup=1, steps=args.repeats),
                 threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama-tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=200, help="new tokens per row")
    parser.add_argument("--sample", action="store_true", help="top-k/top-p sampling, not greedy")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per process")
    harness.add_arguments(parser, timed_steps=False, choose=False)
    args = parser.parse_args()

    config = compose(list(args.overrides))
    # Token ids 3 and up: clear of the special ids (0, 1, 2) both contenders are given.
    prompts = np.random.default_rng(0).integers(3, config.model.vocab_size,
                                                (args.batch, args.prompt))
    workers = {"flaxlm": flax_worker, "pytorch": torch_worker}
    if args.worker:
        workers[args.worker](config, prompts, args)
        return

    m = config.model
    mode = f"sampling (T {TEMPERATURE}, top-k {TOP_K}, top-p {TOP_P})" if args.sample else "greedy"
    print(f"generation, {m.name}: batch {args.batch}, {args.prompt}-token prompts, {args.new} "
          f"new tokens, {mode}; PyTorch {args.threads} threads")
    print(harness.machine_description())
    script = os.path.abspath(__file__)
    chosen = [harness.Contender(name, harness.worker_command(script, sys.argv[1:], name))
              for name in workers]
    rates, notes, _ = harness.run_rounds(chosen, args.rounds, args.new, profile=args.profile)
    rows = harness.summarise(rates, notes, baseline="flaxlm")
    print()
    print(harness.format_table(rows, "new tokens/s per row", "flaxlm"))
    for row in rows:
        if row.median:
            print(f"{row.name}: {1000 / row.median:.2f} ms per new token")


if __name__ == "__main__":
    main()
