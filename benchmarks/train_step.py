"""Training-step throughput of flaxlm's language model against its peers on this machine.

The contenders: flaxlm (jit on the hardware group's devices), transformers' PyTorch model of
the same family and shape (eager, and with torch.compile), and transformers 4's Flax model with
a pmapped data-parallel step, gradients averaged with pmean (in a side environment this script
builds; skipped with the reason when it cannot). Same shape, global batch, sequence length,
AdamW and dropout. Each contender runs in a process of its own, once per round, alternating
(see harness.py); the table gives each one's median tokens/s, the spread, and the ratio of
medians to flaxlm's. MFU is shown only where the device's peak is known (not on a CPU). Nothing
is asserted.

    python benchmarks/train_step.py                          # gpt2-tiny on the cpu group
    python benchmarks/train_step.py model=llama-tiny         # another family: its HF peers
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import transformers4_flax  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compose(overrides: list[str]):
    """conf/train.yaml composed with `overrides`, as a typed TrainConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from flaxlm.config import register_configs

    register_configs()
    with initialize_config_dir(os.path.join(REPO, "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=[*overrides, "run_dir=unused"])
    return OmegaConf.to_object(cfg)


def config_node(node: str, overrides=(), **changes):
    """One node of the composed config with `changes`: a config built in code whose other
    values still come from conf/."""
    import dataclasses

    return dataclasses.replace(getattr(compose(list(overrides)), node), **changes)


def flax_worker(config, tokens_np, args) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flaxlm.hardware_peak import peak_flops
    from flaxlm.models.build import build_lm, lm_flops_per_token
    from flaxlm.models.layers import TransformerSpec, count_params
    from flaxlm.parallel import configure_platform, global_batch, make_mesh, replicated
    from flaxlm.tasks.language_model import lm_steps_compiler
    from flaxlm.training.optimizer import make_optimizer, make_schedule
    from flaxlm.training.step import create_state

    configure_platform(config.hardware, config.model.remat)
    mesh = make_mesh(config.hardware.num_devices)
    if len(tokens_np) % mesh.size:
        sys.exit(f"--batch {len(tokens_np)} does not divide over {mesh.size} devices")
    schedule = make_schedule(config.optimizer, 10_000)
    tx = make_optimizer(config.optimizer, schedule)
    spec = TransformerSpec(config.model, jnp.dtype(config.hardware.compute_dtype),
                           jnp.dtype(config.hardware.param_dtype))
    model = build_lm(spec, nnx.Rngs(params=0))
    num_params = count_params(model)
    graphdef, state = create_state(model, tx)
    state = jax.device_put(state, replicated(mesh))
    compiled = lm_steps_compiler(config)(mesh, graphdef, tx)  # training's own step
    inputs = global_batch(tokens_np, mesh)
    if args.documents:  # packed documents, each attending to itself (task.document_masking)
        inputs = {name: global_batch(array, mesh) for name, array in
                  documents_batch(tokens_np, args.documents).items()}
    key = jax.random.key(0)
    holder = {"state": state}

    def step():
        holder["state"], metrics = compiled.train(holder["state"], inputs, key)
        jax.block_until_ready(metrics["loss"])

    first_step_s = harness.seconds(step)  # its compilation, mostly
    seconds = harness.time_steps(step, args.warmup, args.steps)
    kinds = [device.device_kind for device in mesh.devices.flat]
    memory = mesh.devices.flat[0].memory_stats() or {}  # None where the platform keeps none
    # The step's own footprint, as XLA's buffer assignment sized it: a TPU reserves a program's
    # temporaries outside the allocator whose peak memory_stats reports, so on a TPU that peak
    # is the train state and batch alone. Lowering again after the timed steps reuses the
    # executable they ran (JAX caches the lowering and the compile).
    executable = compiled.train.lower(holder["state"], inputs, key).compile()
    harness.save_program(lambda: executable)  # with --profile: the HLO beside the trace
    footprint = executable.memory_analysis()
    harness.emit(seconds, flops_per_token=lm_flops_per_token(config.model, num_params, args.seq),
                 peak_flops=peak_flops(config.hardware.peak_tflops_per_device, kinds),
                 devices=f"{mesh.size} × {kinds[0]}", num_params=num_params,
                 peak_bytes_in_use=memory.get("peak_bytes_in_use"),
                 bytes_limit=memory.get("bytes_limit"), first_step_s=first_step_s,
                 step_bytes=footprint and (footprint.argument_size_in_bytes
                                           + footprint.output_size_in_bytes
                                           - footprint.alias_size_in_bytes
                                           + footprint.temp_size_in_bytes),
                 temp_bytes=footprint and footprint.temp_size_in_bytes)


def documents_batch(tokens_BxL: np.ndarray, mean_length: int) -> dict[str, np.ndarray]:
    """`tokens_BxL` as packed documents of about `mean_length` tokens (lengths drawn from an
    exponential law, as a web corpus's are roughly), with their segment ids and positions."""
    from flaxlm.data.documents import with_documents

    rng = np.random.default_rng(1)
    starts_BxL = rng.random(tokens_BxL.shape) < 1 / mean_length
    return with_documents(tokens_BxL, starts_BxL)


def torch_worker(config, tokens_np, args, compiled: bool) -> None:
    import torch
    import transformers

    from flaxlm.models.hf import to_lm_config

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    # On a GPU, PyTorch as its users train there: the model on the GPU, float32 parameters
    # with bfloat16 autocast (flaxlm's mixed precision), the fused AdamW.
    on_gpu = config.hardware.platform == "gpu" and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    autocast_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(config.hardware.compute_dtype))
    hf_config = to_lm_config(config.model, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).train().to(device)
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.b1, opt.b2),
                                  eps=opt.eps, weight_decay=opt.weight_decay, fused=on_gpu)
    inputs = torch.from_numpy(tokens_np.astype(np.int64)).to(device)
    forward = torch.compile(model) if compiled else model

    def step():
        with torch.autocast(device, dtype=autocast_dtype, enabled=on_gpu and autocast_dtype
                            is not None):
            loss = forward(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()

    if compiled:
        try:
            step()  # compiles
        except Exception as err:  # noqa: BLE001 — any compiler failure means "not here"
            harness.emit(skip=f"torch.compile does not work here: {type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0][:200] if str(err) else ''}")
            return
    harness.emit(harness.time_steps(step, args.warmup, args.steps),
                 threads=torch.get_num_threads())


def contenders(config, args, argv: list[str], only: set[str] | None) -> list[harness.Contender]:
    """flaxlm first (the baseline), then its peers; a new peer is one more entry here."""
    from flaxlm.models.hf import to_lm_config

    script = os.path.abspath(__file__)
    chosen = [harness.Contender(name, harness.worker_command(script, argv, name))
              for name in ("flaxlm", "pytorch", "pytorch-compile")]
    if only is None or "transformers4-flax" in only:
        hf_config = to_lm_config(config.model, bos_token_id=0, eos_token_id=2, pad_token_id=1)
        chosen.append(transformers4_flax.contender("transformers4-flax", {
            "task": "causal-lm", "config": hf_config.to_dict(), **side_settings(config, args)}))
    return [c for c in chosen if only is None or c.name in only]


def side_settings(config, args) -> dict:
    """What a worker of another environment needs besides the model: batch, steps, optimizer."""
    opt, hardware = config.optimizer, config.hardware
    return {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "optimizer": {"lr": opt.lr, "b1": opt.b1, "b2": opt.b2, "eps": opt.eps,
                          "weight_decay": opt.weight_decay},
            "platform": hardware.platform, "cpu_devices": hardware.cpu_devices,
            "compute_dtype": str(hardware.compute_dtype)}


def run_worker(name: str, config, tokens, args) -> None:
    if name == "flaxlm":
        flax_worker(config, tokens, args)
    elif name in ("pytorch", "pytorch-compile"):
        torch_worker(config, tokens, args, compiled=name == "pytorch-compile")
    else:
        sys.exit(f"unknown worker {name!r}")


def quickstart_time_to_first_step() -> None:
    """Run the quickstart for one step in a fresh process, with a cold and then a warm cache:
    the wall time from the process's start to its first training step (when metrics.jsonl got
    that step's line), and to the end of the process (one small eval, a checkpoint, export)."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        for label in ("cold cache", "warm cache"):
            env = {**os.environ, "FLAXLM_CACHE": os.path.join(tmp, "cache")}
            run_dir = os.path.join(tmp, label.replace(" ", "-"))
            start = time.time()
            subprocess.run(
                [sys.executable, "-m", "flaxlm.cli.train", "logger=none", "trainer.max_steps=1",
                 "trainer.eval_before_training=false", "language.max_eval_docs=8",
                 "samples.prompts=[]", f"hydra.run.dir={run_dir}"],
                env=env, check=True, capture_output=True,
            )
            ended = time.time()
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                first_step = next(record["time"] for record in map(json.loads, f)
                                  if "train/loss" in record)
            print(f"quickstart ({label}): first training step {first_step - start:.1f} s after "
                  f"the process started (start-up, corpus, tokenizer, packing, compilation); "
                  f"process done after {ended - start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt2")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch (default 8; with hardware=tpu, one chip's rows by "
                             "hardware.tokens_per_device: what flaxlm-train would run)")
    parser.add_argument("--vocab", type=int, default=None, help="override model.vocab_size")
    parser.add_argument("--documents", type=int, default=None, metavar="MEAN_LENGTH",
                        help="flaxlm only: rows packed with documents of about this many "
                             "tokens, attention kept within each (task.document_masking)")
    harness.add_arguments(parser)
    parser.add_argument("--quickstart", action="store_true")
    args = parser.parse_intermixed_args()  # overrides may follow the options

    overrides = list(args.overrides)
    if args.vocab:
        overrides.append(f"model.vocab_size={args.vocab}")
    config = compose(overrides)
    if args.batch is None:
        args.batch = 8 if config.hardware.tokens_per_device is None else (
            config.hardware.per_device_batch_size)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (args.batch, args.seq))
    if args.worker:
        run_worker(args.worker, config, tokens, args)
        return

    m = config.model
    family = getattr(m.family, "value", m.family)
    print(f"training step, {m.name} ({family}): {m.num_layers} layers, {m.hidden_size} wide, "
          f"{m.num_heads} heads, vocab {m.vocab_size}; sequence {args.seq}, global batch "
          f"{args.batch}, AdamW, dropout "
          f"{m.hidden_dropout}/{m.embedding_dropout}/{m.attention_dropout}; "
          f"hardware={config.hardware.name}, PyTorch {args.threads} threads")
    print(harness.machine_description())
    chosen = contenders(config, args, sys.argv[1:],
                        set(args.only.split(",")) if args.only else None)
    print(f"{args.rounds} rounds of {len(chosen)} contenders, each in a fresh process: "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    rates, notes, info = harness.run_rounds(chosen, args.rounds, args.batch * args.seq,
                                            profile=args.profile)
    rows = harness.summarise(rates, notes, baseline="flaxlm")
    ours = info.get("flaxlm", {})
    mfu = None
    if ours.get("peak_flops"):
        def mfu(rate):
            return rate * ours["flops_per_token"] / ours["peak_flops"]
    print()
    print(harness.format_table(rows, "tokens/s", "flaxlm", mfu))
    if ours and not mfu:
        print(f"no MFU: the peak FLOP/s of {ours['devices']} is not known")
    for name, result in info.items():  # what the table leaves out: compile time, memory
        keys = ("first_step_s", "step_bytes", "temp_bytes", "compute_dtype")
        extras = {key: result[key] for key in keys if result.get(key) is not None}
        if extras:
            print(f"{name}: " + ", ".join(f"{key} {value:,.1f}" if isinstance(value, float)
                                          else f"{key} {value}" for key, value in extras.items()))
    if args.quickstart:
        quickstart_time_to_first_step()


if __name__ == "__main__":
    main()
