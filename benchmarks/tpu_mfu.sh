#!/usr/bin/env bash
# The training step on one TPU chip against the seed's stack (docs/benchmarks.md, "MFU on one
# TPU v5e chip"): on a TPU VM after `benchmarks/tpu_vm.sh install` (its PYTHONPATH exported),
#
#   benchmarks/tpu_mfu.sh OUT STAGE...
#
# runs each STAGE (names below) into OUT: its log and, for a profiled stage, where the step's
# time goes (benchmarks/profile_summary.py over its trace and HLO), also printed.
# The transformers 4 peer needs .whl-side/ (transformers 4.57.1, huggingface_hub 0.36,
# tokenizers 0.22 as wheels, `benchmarks/tpu_vm.sh wheels` fetches them). Each stage gets
# FLAXLM_STAGE_TIMEOUT seconds (default 300), so that a slow one cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift
mkdir -p "$OUT"
TIMEOUT=${FLAXLM_STAGE_TIMEOUT:-300}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
if [ -d .whl-side ] && [ ! -d /tmp/side ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --target /tmp/side .whl-side/*.whl
fi
export FLAXLM_TRANSFORMERS4_SITE=/tmp/side

SMOLLM=(model=smollm-135m hardware=tpu --seq 2048 --rounds 1 --warmup 2 --steps 10)
QWEN=(model=qwen2.5-0.5b hardware=tpu --seq 2048 --rounds 1 --warmup 2 --steps 10)
LLAMA1B=(model=llama-1b hardware=tpu --seq 2048 --rounds 1 --warmup 2 --steps 10)

first_steps() {  # STAGE ARGS...: flaxlm-train ARGS for one step, twice with one cache: the
  # wall time from the process's start to its first training step, cold and warm
  local stage=$1; shift
  local cache=/tmp/first-step-cache label started profile
  rm -rf "$cache"
  for label in cold warm; do
    # The warm run under cProfile: where a start that compiles nothing spends its time.
    profile=()
    [ "$label" = warm ] && profile=(-m cProfile -o "/tmp/$stage.prof")
    started=$(date +%s.%N)
    FLAXLM_CACHE=$cache JAX_COMPILATION_CACHE_DIR= timeout "$TIMEOUT" python3 -u \
      "${profile[@]}" -m flaxlm.cli.train logger=none trainer.max_steps=1 \
      trainer.eval_before_training=false trainer.eval_every_steps=null \
      language.max_eval_docs=8 samples.prompts=[] \
      "run_dir=/tmp/runs/$stage-$label" "$@" > "$OUT/$stage-$label.log" 2>&1
    python3 - "$stage $label" "/tmp/runs/$stage-$label" "$started" <<'PY' | tee -a "$OUT/$stage.log"
import json, sys
name, run_dir, started = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    first = next(r for r in map(json.loads, open(f"{run_dir}/metrics.jsonl"))
                 if "train/loss" in r)
    print(f"{name}: first training step {first['time'] - started:.1f} s after the start")
except (OSError, StopIteration) as err:
    print(f"{name}: no training step ({err})")
PY
  done
  python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative')\
.print_stats(45)" "/tmp/$stage.prof" > "$OUT/$stage-warm.startup.txt" 2>&1
}

step() {  # STAGE ARGS...: benchmarks/train_step.py with ARGS, profiled into OUT/STAGE
  local stage=$1; shift
  timeout "$TIMEOUT" python3 -u benchmarks/train_step.py "$@" --profile "/tmp/prof/$stage" \
    > "$OUT/$stage.log" 2>&1 || echo "$stage: exit $?" >> "$OUT/$stage.log"
  local vocab
  vocab=$(sed -n 's/.*vocab \([0-9]*\);.*/\1/p' "$OUT/$stage.log" | head -n 1)
  # The summary only: a 30-layer step's trace and HLO run to tens of MB each, more than a
  # lent machine hands back; they stay in /tmp/prof for a closer look there.
  python3 benchmarks/profile_summary.py "/tmp/prof/$stage" --top 25 ${vocab:+--vocab "$vocab"} \
    > "$OUT/$stage.profile.txt" 2>&1
  cat "$OUT/$stage.profile.txt"
}

for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    blocks) timeout "$TIMEOUT" python3 -u benchmarks/splash_blocks.py --iters 5 \
              --out "$OUT/blocks.json" > "$OUT/blocks.log" 2>&1 ;;
    smollm-splash-4) step "$stage" "${SMOLLM[@]}" --batch 4 model.attention=splash --only flaxlm ;;
    smollm-splash-8) step "$stage" "${SMOLLM[@]}" --batch 8 model.attention=splash --only flaxlm ;;
    # Scanned layers keep every layer's residuals stacked: without remat smollm-135m needs
    # 16.14 GiB at 4 rows (flaxlm-plan), with remat=block 8.70; it compiles in 12 s, not 92.
    smollm-scan-4) step "$stage" "${SMOLLM[@]}" --batch 4 model.attention=splash \
                     model.scan_layers=true model.remat=block --only flaxlm ;;
    smollm-scan-8) step "$stage" "${SMOLLM[@]}" --batch 8 model.attention=splash \
                     model.scan_layers=true model.remat=block --only flaxlm ;;
    smollm-peer-1) step "$stage" "${SMOLLM[@]}" --batch 1 model.attention=xla \
                     --only flaxlm,transformers4-flax ;;
    smollm-reference-1) step "$stage" "${SMOLLM[@]}" --batch 1 model.attention=reference \
                          --only flaxlm ;;
    qwen-block-4) step "$stage" "${QWEN[@]}" --batch 4 model.attention=splash model.remat=block \
                    trainer.loss_chunk_size=512 --only flaxlm ;;
    qwen-none-2) step "$stage" "${QWEN[@]}" --batch 2 model.attention=splash \
                   trainer.loss_chunk_size=512 --only flaxlm ;;
    # flaxlm-plan: 4 rows without remat fit in 14.16 GiB (loss in chunks of 512).
    qwen-none-4) step "$stage" "${QWEN[@]}" --batch 4 model.attention=splash \
                   trainer.loss_chunk_size=512 --only flaxlm ;;
    # hardware=tpu with nothing more: rows by hardware.tokens_per_device, the loss chunked
    # where the whole logits would be large (trainer.loss_chunk_size's default).
    smollm-default) step "$stage" model=smollm-135m hardware=tpu task.max_seq_length=2048 \
                      --seq 2048 --rounds 1 --warmup 2 --steps 10 --only flaxlm ;;
    qwen-default) step "$stage" model=qwen2.5-0.5b hardware=tpu task.max_seq_length=2048 \
                    --seq 2048 --rounds 1 --warmup 2 --steps 10 --only flaxlm ;;
    # llama-1b as hardware=tpu gives it once the two settings it needs are added: bfloat16
    # moments, 2 rows (the loss whole: 1.96 GiB of logits, under the 2 GiB that chunks it).
    llama1b-default-bf16-moments-2) step "$stage" model=llama-1b hardware=tpu \
                                      task.max_seq_length=2048 optimizer.moment_dtype=bfloat16 \
                                      hardware.per_device_batch_size=2 --seq 2048 --rounds 1 \
                                      --warmup 2 --steps 10 --only flaxlm ;;
    # The loss in other chunks: fewer or more trips through its loop (1024: 14.78 GiB in
    # flaxlm-plan). Both were slower than 512 on the chip.
    qwen-none-4-chunks-1024) step "$stage" "${QWEN[@]}" --batch 4 model.attention=splash \
                               trainer.loss_chunk_size=1024 --only flaxlm ;;
    qwen-none-4-chunks-256) step "$stage" "${QWEN[@]}" --batch 4 model.attention=splash \
                              trainer.loss_chunk_size=256 --only flaxlm ;;
    # bfloat16 moments free the GiB a fifth row needs without remat: 55.8% MFU on the chip.
    qwen-bf16-moments-5) step "$stage" "${QWEN[@]}" --batch 5 model.attention=splash \
                           optimizer.moment_dtype=bfloat16 trainer.loss_chunk_size=512 \
                           --only flaxlm ;;
    llama1b-bf16-moments-2) step "$stage" "${LLAMA1B[@]}" --batch 2 model.attention=splash \
                              optimizer.moment_dtype=bfloat16 trainer.loss_chunk_size=512 \
                              --only flaxlm ;;
    llama1b-adafactor-4) step "$stage" "${LLAMA1B[@]}" --batch 4 model.attention=splash \
                           optimizer=adafactor model.remat=block trainer.loss_chunk_size=512 \
                           --only flaxlm ;;
    # Time to the first step of `flaxlm-train` on the builtin corpus, cold and warm cache.
    smollm-first-step) first_steps "$stage" model=smollm-135m hardware=tpu \
                         hardware.per_device_batch_size=4 task.max_seq_length=2048 ;;
    smollm-first-step-scan) first_steps "$stage" model=smollm-135m hardware=tpu \
                              hardware.per_device_batch_size=4 task.max_seq_length=2048 \
                              model.scan_layers=true model.remat=block ;;
    *) echo "unknown stage $stage" ;;
  esac
  tail -n 12 "$OUT/$stage.log" 2>/dev/null
done
