"""transformers 4's Flax models as a benchmark peer, with a plain data-parallel step: pmap
over the devices, gradients averaged with pmean, AdamW, dropout on.

transformers 5 has no Flax models and cannot share an environment with transformers 4, so
`contender` builds a small side environment once and keeps it (in ~/.cache/flaxlm): a venv
holding only transformers 4 and the hub and tokenizer versions it accepts, which reads
everything else (jax, flax, optax, numpy) from this environment. Where it cannot be built
(offline, no pip), the contender is skipped with the reason. On a machine without network
(a TPU VM with its own index), install those three as wheels into a folder and name it in
`FLAXLM_TRANSFORMERS4_SITE`: the worker then runs in this Python with that folder first on
its path (`benchmarks/tpu_vm.sh` does this).

On an accelerator the model computes in the hardware group's compute dtype (bfloat16 on the
shipped GPU and TPU groups), with float32 parameters: `from_config(..., dtype=bfloat16)`, as
the Flax examples of transformers 4 ran on TPUs; on a CPU in float32, as flaxlm's cpu group.

Run as a script (by the harness, in that environment) it is the worker: `--spec` is a JSON
object with the task (causal-lm or sequence-classification), the HF config, batch, sequence
length, steps and optimizer settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SIDE_PACKAGES = ("transformers==4.57.1", "huggingface_hub<1.0", "tokenizers>=0.22,<0.23")
SITE_ENV = "FLAXLM_TRANSFORMERS4_SITE"  # a folder holding SIDE_PACKAGES, installed already
SIDE_ENV = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "flaxlm", "bench-transformers4-flax")


def side_python() -> tuple[str | None, str | None]:
    """The side environment's python (built on first use), or None and why it is not there."""
    python = os.path.join(SIDE_ENV, "bin", "python")
    built = os.path.join(SIDE_ENV, ".built")
    if os.path.exists(built):
        return python, None
    print(f"building the transformers 4 environment in {SIDE_ENV} (once)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", SIDE_ENV],
                       check=True, capture_output=True, text=True)
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip()
        # After the side packages on sys.path: this environment's jax, flax, optax, numpy.
        with open(os.path.join(site, "zz_flaxlm_main_env.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", site, *SIDE_PACKAGES],
                       check=True, capture_output=True, text=True, timeout=900)
        subprocess.run([python, "-c", "from transformers import FlaxAutoModelForCausalLM"],
                       check=True, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as err:
        stderr = getattr(err, "stderr", None) or ""
        detail = (stderr.strip().splitlines() or [str(err)])[-1]
        return None, f"could not build the transformers 4 environment ({detail})"
    open(built, "w").close()
    return python, None


def contender(name: str, spec: dict) -> harness.Contender:
    """The peer for `spec` (see the module docstring), or a skipped one."""
    site = os.environ.get(SITE_ENV)
    if site:
        path = os.pathsep.join(filter(None, [os.path.abspath(site), os.environ.get("PYTHONPATH")]))
        return harness.Contender(name, (sys.executable, os.path.abspath(__file__), "--spec",
                                        json.dumps(spec, default=str)), env={"PYTHONPATH": path})
    python, reason = side_python()
    if python is None:
        return harness.Contender(name, (), skip_reason=reason)
    command = (python, os.path.abspath(__file__), "--spec", json.dumps(spec, default=str))
    return harness.Contender(name, command)


def worker(spec: dict) -> None:
    if spec["platform"] == "cpu":  # one device per core, as the cpu hardware group has
        count = spec.get("cpu_devices") or os.cpu_count()
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join([*flags,
                                            f"--xla_force_host_platform_device_count={count}"])
    import jax
    import numpy as np
    import optax
    import transformers

    hf_config = dict(spec["config"])
    config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    classify = spec["task"] == "sequence-classification"
    auto = (transformers.FlaxAutoModelForSequenceClassification if classify
            else transformers.FlaxAutoModelForCausalLM)
    # The compute dtype on an accelerator (parameters stay float32): transformers 4's `dtype`.
    compute = spec.get("compute_dtype", "float32") if spec["platform"] != "cpu" else "float32"
    model = auto.from_config(config, seed=0, dtype=jax.numpy.dtype(compute))
    opt = spec["optimizer"]
    tx = optax.adamw(opt["lr"], b1=opt["b1"], b2=opt["b2"], eps=opt["eps"],
                     weight_decay=opt["weight_decay"])
    batch, seq, devices = spec["batch"], spec["seq"], jax.local_device_count()
    if batch % devices:
        sys.exit(f"batch {batch} does not divide over {devices} devices")
    rng = np.random.default_rng(0)
    if classify:
        token_type_ids = np.zeros((batch, seq), np.int32)
        token_type_ids[:, seq // 2:] = 1
        inputs = {"input_ids": rng.integers(1000, config.vocab_size, (batch, seq)),
                  "attention_mask": np.ones((batch, seq), np.int32),
                  "token_type_ids": token_type_ids,
                  "labels": rng.integers(0, 2, batch)}
    else:
        inputs = {"input_ids": rng.integers(0, config.vocab_size, (batch, seq))}
    inputs = {k: np.asarray(v, np.int32).reshape(devices, batch // devices, *v.shape[1:])
              for k, v in inputs.items()}

    def loss_fn(params, inputs, dropout_rng):
        features = {k: v for k, v in inputs.items() if k != "labels"}
        logits = model(**features, params=params, dropout_rng=dropout_rng, train=True).logits
        if classify:
            return optax.softmax_cross_entropy_with_integer_labels(logits, inputs["labels"]).mean()
        ids = inputs["input_ids"]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    def train_step(params, opt_state, inputs, dropout_rng):
        dropout_rng, this_step = jax.random.split(dropout_rng)
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, this_step)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, dropout_rng,
                jax.lax.pmean(loss, "batch"))

    p_step = jax.pmap(train_step, "batch", donate_argnums=(0, 1))
    replicate = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: np.broadcast_to(np.asarray(x), (devices, *np.shape(x))), tree)
    state = {"params": replicate(model.params), "opt_state": replicate(tx.init(model.params)),
             "rng": jax.random.split(jax.random.PRNGKey(0), devices)}

    def step():
        state["params"], state["opt_state"], state["rng"], loss = p_step(
            state["params"], state["opt_state"], inputs, state["rng"])
        jax.block_until_ready(loss)

    first_step_s = harness.seconds(step)  # compiles for the host arrays; the warm-up's first
    # step compiles again for device-resident ones
    harness.save_program(lambda: p_step.lower(state["params"], state["opt_state"], inputs,
                                              state["rng"]).compile())
    harness.emit(harness.time_steps(step, spec["warmup"], spec["steps"]),
                 transformers=transformers.__version__, devices=devices, compute_dtype=compute,
                 first_step_s=first_step_s)


if __name__ == "__main__":
    worker(json.loads(sys.argv[sys.argv.index("--spec") + 1]))
