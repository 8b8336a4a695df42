"""Training-step throughput of flaxlm's GPT-2 against transformers' PyTorch GPT2LMHeadModel.

Both run the same shape, global batch, sequence length and AdamW on this machine, in this
process, one after the other; the script prints tokens/s and MFU of each and their ratio.
Nothing is asserted: machines are shared and noisy, so only the ratio means something.

    python benchmarks/train_step.py                          # gpt2-tiny on the cpu group
    python benchmarks/train_step.py model=distilgpt2 hardware=gpu --seq 512 --batch 64
    python benchmarks/train_step.py --quickstart            # also: wall time to the first step

Positional arguments are Hydra overrides of conf/train.yaml (model=..., hardware=...).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from flaxlm.config import register_configs

    register_configs()
    with initialize_config_dir(os.path.join(REPO, "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=[*overrides, "run_dir=unused"])


def time_steps(step, warmup: int, steps: int) -> float:
    """Seconds per step after `warmup` untimed steps; `step()` must block until done."""
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def flax_seconds_per_step(config, tokens_np, warmup, steps) -> tuple[float, int, int]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flaxlm.models.gpt2 import GPT2LMHeadModel
    from flaxlm.models.layers import TransformerSpec, count_params
    from flaxlm.parallel import configure_platform, global_batch, make_mesh, replicated
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import compile_steps, create_state

    configure_platform(config.hardware)
    mesh = make_mesh(config.hardware.num_devices)
    if len(tokens_np) % mesh.size:
        sys.exit(f"--batch {len(tokens_np)} does not divide over {mesh.size} devices")
    schedule = make_schedule(config.optimizer, 10_000)
    tx = make_optimizer(config.optimizer, schedule)
    spec = TransformerSpec(config.model, jnp.dtype(config.hardware.compute_dtype),
                           jnp.dtype(config.model.param_dtype or config.hardware.param_dtype))
    model = GPT2LMHeadModel(spec, nnx.Rngs(params=0))
    num_params = count_params(model)
    graphdef, state = create_state(model, tx)
    state = jax.device_put(state, replicated(mesh))
    compiled = compile_steps(mesh, graphdef, tx, schedule)
    inputs = global_batch(tokens_np, mesh)
    key = jax.random.key(0)
    holder = {"state": state}

    def step():
        holder["state"], metrics = compiled.train(holder["state"], inputs, key)
        jax.block_until_ready(metrics["loss"])

    print(f"flax:    {mesh.size} {jax.default_backend()} device(s), "
          f"{config.hardware.compute_dtype} compute")
    return time_steps(step, warmup, steps), num_params, mesh.size


def torch_seconds_per_step(config, tokens_np, warmup, steps) -> float:
    import torch
    import transformers

    from flaxlm.models.hf import to_lm_config

    torch.manual_seed(0)
    gpt2_config = to_lm_config(config.model, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model = transformers.GPT2LMHeadModel(gpt2_config).train()
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2),
                                  eps=opt.eps, weight_decay=opt.weight_decay)
    inputs = torch.from_numpy(tokens_np.astype(np.int64))

    def step():
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    print(f"pytorch: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"attention {gpt2_config._attn_implementation}")
    return time_steps(step, warmup, steps)


def quickstart_time_to_first_step() -> None:
    """Run the quickstart for one step in a fresh process, with a cold and then a warm cache."""
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("cold cache", "warm cache"):
            env = {**os.environ, "FLAXLM_CACHE": os.path.join(tmp, "cache")}
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "flaxlm.cli.train", "logger=none", "trainer.max_steps=1",
                 "trainer.eval_before_training=false", "language.max_eval_docs=8",
                 f"hydra.run.dir={tmp}/{label.replace(' ', '-')}"],
                env=env, check=True, capture_output=True,
            )
            print(f"quickstart, wall time to the first training step ({label}, including "
                  f"start-up, corpus, tokenizer, packing, compile; one small eval after): "
                  f"{time.perf_counter() - start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt2")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--vocab", type=int, default=None, help="override model.vocab_size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--quickstart", action="store_true")
    args = parser.parse_args()

    overrides = list(args.overrides)
    if args.vocab:
        overrides.append(f"model.vocab_size={args.vocab}")
    cfg = compose(overrides)
    from omegaconf import OmegaConf

    from flaxlm.tasks.clm import flops_per_token

    config = OmegaConf.to_object(cfg)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (args.batch, args.seq))
    tokens_per_step = args.batch * args.seq
    m = config.model
    print(f"shape: {m.n_layer} layers, {m.n_embd} wide, {m.n_head} heads, vocab {m.vocab_size}; "
          f"sequence {args.seq}, global batch {args.batch}, AdamW, dropout "
          f"{m.resid_pdrop}/{m.embd_pdrop}/{m.attn_pdrop}")

    flax_s, num_params, num_devices = flax_seconds_per_step(config, tokens, args.warmup, args.steps)
    flops = flops_per_token(config.model, num_params, args.seq)
    # Both frameworks use the whole machine: the peak of all the group's devices together.
    peak = config.hardware.peak_tflops_per_device * 1e12 * num_devices

    def report(name, seconds):
        rate = tokens_per_step / seconds
        print(f"{name:8s} {seconds * 1e3:8.1f} ms/step  {rate:10.0f} tokens/s  "
              f"MFU {rate * flops / peak:.1%} (of {config.hardware.name}'s peak)")
        return rate

    flax_rate = report("flax", flax_s)
    if not args.no_torch:
        torch_rate = report("pytorch", torch_seconds_per_step(config, tokens, args.warmup,
                                                              args.steps))
        print(f"ratio flax / pytorch tokens/s: {flax_rate / torch_rate:.2f}x")
    if args.quickstart:
        quickstart_time_to_first_step()


if __name__ == "__main__":
    main()
