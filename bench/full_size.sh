#!/usr/bin/env bash
# The full-size measurements on one CUDA GPU, in order of priority, each step bounded so that a
# failure or a hang leaves the later steps their time. Figures and logs go to $OUT_DIR.
#   OUT_DIR=runs/full_size bash bench/full_size.sh
# 1. a smoke run of the same path (FLUX.1-dev width, one block of each kind, 256 px);
# 2. FLUX.1-dev at full size, LoRA rank 64, G = 12, N = 16: 512 px then 1024 px (micro-batch 6: 12
#    does not fit an H100), bf16 numerics;
# 3. FLUX width (2 double + 4 single blocks, 128 text tokens, full fine-tuning, no recompute: the
#    flux-width preset of bench_grpo) with one iteration profiled;
# 4. the same with compiled blocks, dynamo's recompiles logged;
# 5. the DanceGRPO-style reference alone (bench_grpo --only reference), kernels launched
#    synchronously so that a failing kernel is named where it fails.
set -uo pipefail
OUT_DIR=${OUT_DIR:-runs/full_size}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
LOG="$OUT_DIR/log.txt"
run() {  # run SECONDS COMMAND...: bounded, output appended to $LOG
    local seconds=$1; shift
    echo "=== $* (at most ${seconds} s)" | tee -a "$LOG"
    timeout "$seconds" "$@" 2>&1 | grep --line-buffered -v -e "UserWarning" -e "warnings.warn" | tee -a "$LOG"
    echo "=== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c "import torch, megatron.core, diffusers; print(torch.__version__, megatron.core.__version__, diffusers.__version__)" | tee -a "$LOG"
FS="python3 -m bench.full_size --model flux-dev"
run 70 $FS --depth 1 1 --sizes 256:4 --num-generations 4 --num-inference-steps 3 --check-bf16 \
    --json "$OUT_DIR/smoke.json"
run "${FULL_SECONDS:-300}" $FS --sizes 512:12 1024:6 --iters 1 --check-bf16 --json "$OUT_DIR/flux_dev.json"
WIDTH="$FS --depth 2 4 --sizes 512:12 --text-tokens 128 --lora-rank 0 --no-recompute --iters 2"
run 70 $WIDTH --profile "$OUT_DIR/profile.txt" --json "$OUT_DIR/flux_width.json"
TORCH_LOGS=recompiles run 75 $WIDTH --compile --workdir /tmp/mm_grpo_full_size_compiled
CUDA_LAUNCH_BLOCKING=1 run 60 python3 -m bench.bench_grpo --preset flux-width --iters 0 --only reference
