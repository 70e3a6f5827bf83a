#!/usr/bin/env bash
# The full-size measurements on one CUDA GPU, each step bounded in time so that a failure or a
# hang leaves the later steps theirs. Figures and logs go to $OUT_DIR (log.txt, one JSON per step).
#   OUT_DIR=runs/full_size bash bench/full_size.sh                      # the default steps, in order
#   STEPS="compile reference" OUT_DIR=runs/full_size bash bench/full_size.sh
# Steps (seconds bound):
#   smoke       FLUX.1-dev width, one block of each kind, 256 px: the same path, small (70)
#   flux_dev    FLUX.1-dev, LoRA 64, G = 12, N = 16: 512 px at micro-batch 12, then 1024 px at 6
#               (12 does not fit an H100), bf16 against fp32 velocity (FULL_SECONDS, 300)
#   width       FLUX width (2 double + 4 single blocks, 128 text tokens, full fine-tuning, no recompute:
#               bench_grpo's flux-width preset) with one iteration profiled (70)
#   compile     the same with compiled blocks, dynamo's recompiles logged (75)
#   reference   the DanceGRPO-style reference alone, kernels launched synchronously so that a
#               failing kernel is named where it fails (60)
#   ratio       the reference against mm-grpo at the flux-width preset, taking turns (300; not default)
#   width20     FLUX width with LoRA 64 for 20 iterations: ratio and finiteness in bf16 (150; not default)
set -uo pipefail
OUT_DIR=${OUT_DIR:-runs/full_size}
STEPS=${STEPS:-smoke flux_dev width compile reference}
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
WIDTH="$FS --depth 2 4 --sizes 512:12 --text-tokens 128"
for step in $STEPS; do
    case $step in
        smoke) run 70 $FS --depth 1 1 --sizes 256:4 --num-generations 4 --num-inference-steps 3 --check-bf16 \
                   --json "$OUT_DIR/smoke.json" ;;
        flux_dev) run "${FULL_SECONDS:-300}" $FS --sizes 512:12 1024:6 --iters 1 --check-bf16 \
                      --json "$OUT_DIR/flux_dev.json" ;;
        width) run 70 $WIDTH --lora-rank 0 --no-recompute --iters 2 --profile "$OUT_DIR/profile.txt" \
                   --json "$OUT_DIR/flux_width.json" ;;
        compile) TORCH_LOGS=recompiles run 75 $WIDTH --lora-rank 0 --no-recompute --iters 2 --compile \
                     --workdir /tmp/mm_grpo_full_size_compiled --json "$OUT_DIR/compiled.json" ;;
        reference) CUDA_LAUNCH_BLOCKING=1 run 60 python3 -m bench.bench_grpo --preset flux-width --iters 0 \
                       --only reference ;;
        ratio) run 300 python3 -m bench.bench_grpo --preset flux-width --iters 2 --json "$OUT_DIR/ratio.json" ;;
        width20) run 150 $WIDTH --iters 20 --json "$OUT_DIR/width20.json" ;;
        *) echo "unknown step $step (smoke flux_dev width compile reference ratio width20)" >&2; exit 2 ;;
    esac
done
