#!/usr/bin/env bash
# flaxlm on a TPU VM whose Python already has jax[tpu] (a Cloud TPU VM image, or one without
# network access but with its own package index), in three steps (docs/development.md):
#
#   benchmarks/tpu_vm.sh wheels             # where pip reaches PyPI: .whl-tpu/, the wheels a
#                                           # VM without network lacks (Python 3.11, x86-64)
#   benchmarks/tpu_vm.sh install            # on the VM: those wheels and the index's packages
#                                           # into $FLAXLM_SITE (default /tmp/site)
#   benchmarks/tpu_vm.sh check OUT          # on the VM: the quickstart and the Llama preset on
#                                           # the chip, the tpu tests, and the numerics tests on
#                                           # the host's CPU; logs and a summary into OUT
#
# `install` and `check` add to PYTHONPATH rather than replace it, so that the VM's own JAX and
# libtpu stay first; `check` expects the PYTHONPATH that `install` prints.
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${FLAXLM_SITE:-/tmp/site}
WHEELS=.whl-tpu
# The VM's own index (a path, or pip's default where the VM reaches PyPI).
INDEX=${FLAXLM_INDEX:-file:///opt/pypi/simple}
# What flaxlm needs that the TPU image's index holds; JAX and libtpu come with the image.
FROM_INDEX=(flax optax orbax-checkpoint transformers datasets tokenizers safetensors tqdm
            scikit-learn scipy matplotlib pyarrow)
# What it lacks, as wheels (versions as `make test` resolves them here). antlr4-python3-runtime
# 4.9.3, which omegaconf pins, exists only as a source archive: built into a wheel here.
# flax and optax too, though the index has them: a plan saved here (flaxlm-plan --save) loads
# only where the same versions trace the steps (flaxlm.training.executables).
CARRIED=(hydra-core==1.3.8 omegaconf==2.3.1 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
         cloudpickle==3.1.3 pytest-xdist==3.8.0 execnet==2.1.2 flax==0.12.8 optax==0.2.8)
# The files whose tests compare floats computed by XLA (tests/numerics.py's tolerances), run on
# the VM host's CPU: another CPU model than CI's. Their tests marked torch, harness, libtpu or
# multiprocess are left out there (no PyTorch, no lm-eval, no sockets).
NUMERICS_TESTS=${FLAXLM_NUMERICS_TESTS:-
  tests/test_numerics.py tests/test_optimizers.py tests/test_parallel.py tests/test_sharding.py
  tests/test_attention.py tests/test_losses.py tests/test_model.py tests/test_llama.py
  tests/test_scan.py tests/test_lora.py tests/test_bert.py tests/test_hf_import.py
  tests/test_open_presets.py tests/test_export.py tests/test_generate.py tests/test_finetune.py
  tests/test_dpo.py tests/test_sft.py tests/test_distributed_eval.py tests/test_documents.py
  tests/test_properties.py tests/test_scoring.py tests/test_config.py tests/test_compat.py}

wheels() {
  local platforms=()
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${tag}_x86_64")
  done
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp "${platforms[@]}" -d "$WHEELS" "${CARRIED[@]}"
  python3 -m pip wheel --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
  # The seed's stack, for benchmarks/tpu_mfu.sh's peer: in a folder of its own, as it cannot
  # share one with the image's transformers 5 (benchmarks/transformers4_flax.py).
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp "${platforms[@]}" -d .whl-side transformers==4.57.1 \
    huggingface_hub==0.36.2 tokenizers==0.22.2
}

install() {
  local pip=(env PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile
             --no-cache-dir --upgrade --target "$SITE")
  "${pip[@]}" --only-binary=:all: --index-url "$INDEX" "${FROM_INDEX[@]}"
  "${pip[@]}" --no-index --no-deps "$WHEELS"/*.whl
  echo "export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$SITE:$PWD/src"
}

# The wall time from a run's start to its first logged training step (metrics.jsonl's first
# line with train/loss: trainer.log_every_steps), and its evaluations' loss, first and last.
summarise_run() {
  python3 - "$@" <<'PY'
import json, sys
name, run_dir, started, ended = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
first = next(r for r in records if "train/loss" in r)
evals = [r for r in records if "eval/loss" in r]
print(f"{name}: first logged step ({first['step']}) {first['time'] - started:.1f} s after the "
      f"start, {first['train/tokens_per_second']:,.0f} tokens/s, done after "
      f"{ended - started:.1f} s, {evals[-1]['step']} steps, eval loss "
      f"{evals[0]['eval/loss']:.4f} -> {evals[-1]['eval/loss']:.4f} "
      f"(perplexity {evals[-1].get('eval/perplexity', float('nan')):.1f})")
PY
}

train_on_chip() {  # NAME OUT RUNS ARGS...: one flaxlm-train run, its log and its summary line
  local name=$1 out=$2 runs=$3; shift 3
  local started ended
  started=$(date +%s.%N)
  python3 -u -m flaxlm.cli.train logger=none "run_dir=$runs/$name" "$@" \
    > "$out/$name.log" 2>&1 || { echo "$name: failed: $(tail -n 3 "$out/$name.log")"; return 0; }
  ended=$(date +%s.%N)
  summarise_run "$name" "$runs/$name" "$started" "$ended"
}

check() {
  local out=$1 runs=${FLAXLM_RUNS:-$1/runs}
  mkdir -p "$out" "$runs"
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
  {
    grep -m1 'model name' /proc/cpuinfo
    python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  } > "$out/summary.txt" 2>&1
  # The host's CPU, kept off the chip, while the chip trains.
  FLAXLM_NUMERICS_LOG="$out/margins.log" JAX_PLATFORMS=cpu \
    python3 -m pytest -q -p no:cacheprovider -n 6 \
    -m "not torch and not harness and not libtpu and not multiprocess" \
    $NUMERICS_TESTS > "$out/numerics-on-host-cpu.log" 2>&1 &
  local numerics=$!
  {
    train_on_chip quickstart "$out" "$runs" hardware=tpu
    train_on_chip quickstart-batch-8 "$out" "$runs" hardware=tpu hardware.per_device_batch_size=8
    train_on_chip llama-tiny "$out" "$runs" experiment=llama-tiny-en-builtin hardware=tpu
    python3 -m flaxlm.cli.generate "$runs/quickstart" --prompt "The module" \
      > "$out/generate.log" 2>&1; echo "generate: $(tail -n 1 "$out/generate.log")"
    python3 -m flaxlm.cli.export "$runs/llama-tiny" --out "$runs/llama-export" \
      >> "$out/generate.log" 2>&1; echo "export: $(ls "$runs/llama-export" | tr '\n' ' ')"
    FLAXLM_TEST_TPU=1 python3 -m pytest -q -p no:cacheprovider -m tpu tests/test_tpu.py \
      > "$out/tpu-tests.log" 2>&1; echo "tpu tests: $(tail -n 1 "$out/tpu-tests.log")"
  } 2>&1 | tee -a "$out/summary.txt"
  wait "$numerics" || true
  {
    echo "numerics on the host's CPU: $(tail -n 1 "$out/numerics-on-host-cpu.log")"
    # test_numerics.py's own comparisons that must fail (a term left out) are left out here.
    echo "the comparisons that used most of their tolerance there (tests/numerics.py):"
    grep -v '^test_numerics.py' "$out/margins.log" | sort -k2 -g -r | head -n 5
  } | tee -a "$out/summary.txt"
}

case "${1:-}" in
  wheels) wheels ;;
  install) install ;;
  check) check "${2:?usage: benchmarks/tpu_vm.sh check OUT}" ;;
  *) echo "usage: benchmarks/tpu_vm.sh wheels | install | check OUT" >&2; exit 2 ;;
esac
