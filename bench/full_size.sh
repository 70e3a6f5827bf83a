#!/usr/bin/env bash
# Issue 48's figures on one CUDA GPU in at most 8 minutes, each step bounded in time so that a failure
# or a hang leaves the later steps theirs. Everything goes to $OUT_DIR: log.txt, one JSON per step
# (written as each figure is measured, so a step stopped at its bound keeps what it had), summary.md.
#   OUT_DIR=runs/full_size bash bench/full_size.sh                  # the default steps, in order
#   STEPS="anchors summary" OUT_DIR=runs/full_size bash bench/full_size.sh
#   MODEL=tiny bash bench/full_size.sh                              # the same steps, tiny sizes, on CPU
# On a machine without megatron-core / diffusers (the offline H200 image), install the wheels of .whl/
# first (docs/performance.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD
#
# Default steps, each one process, with its bound in seconds (FLUX.1-dev shapes, random weights, one
# H200); in brackets what each took on 2026-11-28 (docs/measurements/h200_2026-11-28/log.txt: 435 s
# in all, before the mm_grpo_base row):
#   anchors       215  one transformer call at 12 x 512 px, 512 text tokens: diffusers bf16, mm-grpo's
#                      frozen bf16 base alone and with LoRA 64, eager; both compiled; no-grad forward
#                      and forward + backward to the input, median of 4 (ANCHOR_CALLS), ratios; bf16
#                      velocity against fp32 of the same weights, 2 samples (185, + ~15 for the base row)
#   grpo          120  the eager GRPO iteration at 512:12, LoRA 64, N = 16: one warm-up + one timed,
#                      phases, MFU, peak, the plan's prediction, the PPO ratio (83)
#   grpo_compiled 125  the same with compiled blocks (103: the first iteration 51 s, compiling)
#   loop           90  the loop around the model (bench/loop_overhead.py): a rollout step and a trained
#                      micro-batch against the model call alone, 4 steps, one turn, profiled (64)
#   summary         5  summary.md: the tables, from the JSONs (no torch) (0)
#   total         555  (+ 5 s of SIGKILL grace for a step that ignores SIGTERM); each JSON is written as
#                      its figures come (an iteration, an anchor row), so a step stopped at its bound
#                      keeps what it had measured
# Further steps, by name:
#   smoke          35  one double + one single block at the anchors' call: both models built, the same
#                      weights loaded, LoRA, numerics, eager calls (a quick check of a new machine)
#   grpo_1024     300  512:12 then 1024:6 (12 does not fit an H100), bf16 against fp32 before LoRA
#   width          70  FLUX width (2 double + 4 single blocks, 128 text tokens, full fine-tuning, no
#                      recompute: bench_grpo's flux-width preset), one iteration profiled
#   width_compiled 75  the same with compiled blocks, dynamo's recompiles logged
#   reference      60  the DanceGRPO-style reference alone, kernels launched synchronously
#   ratio         300  the reference against mm-grpo at the flux-width preset, taking turns
#   width20       150  FLUX width with LoRA 64 for 20 iterations: ratio and finiteness in bf16
# Qwen-Image (bench/full_size_qwen_image.py), MODEL=qwen-image (20B, random weights: LoRA 64, G 12 at
# 512 px, true CFG 4) or qwen-image-tiny (the tiny pipeline's sizes, on CPU in seconds), bounds not
# measured on an accelerator yet:
#   anchors       300  one transformer call, diffusers' QwenImageTransformer2DModel beside mm-grpo's base
#                      and its LoRA model, eager and compiled, forward and forward + backward, median of
#                      ANCHOR_CALLS, ratios, the velocity errors (tiny: 18 s on 2 CPU cores)
#   grpo          240  one warm-up + one timed GRPO iteration, phases, peak, the plan's prediction (tiny: 8 s)
#   COMPILE_BACKEND (Qwen-Image only): torch.compile's backend (default inductor; eager: dynamo alone)
# Environment: OUT_DIR, STEPS, MODEL (flux-dev | tiny | qwen-image | qwen-image-tiny), SCALE (multiplies
# every bound; tiny: 8), ANCHOR_CALLS (4).
set -uo pipefail
OUT_DIR=${OUT_DIR:-runs/full_size}
MODEL=${MODEL:-flux-dev}
case $MODEL in
    qwen-image|qwen-image-tiny) STEPS=${STEPS:-anchors grpo} ;;
    *) STEPS=${STEPS:-anchors grpo grpo_compiled loop summary} ;;
esac
ANCHOR_CALLS=${ANCHOR_CALLS:-4}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
LOG="$OUT_DIR/log.txt"
if [ "$MODEL" = tiny ]; then  # the same steps on CPU in minutes: tiny widths, 64 px, G = 4, N = 4
    SCALE=${SCALE:-8}
    CALL=64:4; TEXT=32; GRPO_SIZE=64:4; GRPO="--num-generations 4 --num-inference-steps 4 --lora-rank 4"
    WORKDIR=/tmp/mm_grpo_full_size_tiny
else
    SCALE=${SCALE:-1}
    CALL=512:12; TEXT=512; GRPO_SIZE=512:12; GRPO=""
    WORKDIR=/tmp/mm_grpo_full_size
fi
FS="python3 -m bench.full_size --model $MODEL --text-tokens $TEXT --workdir $WORKDIR"
WIDTH="python3 -m bench.full_size --model flux-dev --depth 2 4 --sizes 512:12 --text-tokens 128"
START=$(date +%s)
run() {  # run SECONDS COMMAND...: bounded (SCALE x SECONDS), output appended to $LOG, seconds taken logged
    local seconds=$(($1 * SCALE)) begin=$(date +%s); shift
    echo "=== $* (at most ${seconds} s; $((begin - START)) s since the start)" | tee -a "$LOG"
    timeout -k 5 "$seconds" "$@" 2>&1 | grep --line-buffered -v -e "UserWarning" -e "warnings.warn" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local why=""; [ "$rc" = 124 ] && why=" (stopped at its bound)"
    echo "=== exit $rc$why after $(($(date +%s) - begin)) s" | tee -a "$LOG"
}
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
fi
QWEN_IMAGE="python3 -m bench.full_size_qwen_image --model $MODEL --workdir /tmp/mm_grpo_full_size_$MODEL \
    ${COMPILE_BACKEND:+--compile-backend $COMPILE_BACKEND}"
qwen_image_step() {  # qwen_image_step STEP: bench/full_size_qwen_image.py's steps
    case $1 in
        anchors) TORCH_LOGS=recompiles run 300 $QWEN_IMAGE anchors --calls "$ANCHOR_CALLS" --json "$OUT_DIR/anchors.json" ;;
        grpo) run 240 $QWEN_IMAGE grpo --iters 1 --json "$OUT_DIR/grpo.json" ;;
        *) echo "unknown step $1 for $MODEL (anchors grpo)" >&2; exit 2 ;;
    esac
}
for step in $STEPS; do
    case $MODEL in qwen-image|qwen-image-tiny) qwen_image_step "$step"; continue ;; esac
    case $step in
        smoke) run 35 $FS --anchors --depth 1 1 --sizes $CALL --no-anchor-compile --anchor-calls 1 \
                   --json "$OUT_DIR/smoke.json" ;;
        anchors) TORCH_LOGS=recompiles run 215 $FS --anchors --sizes $CALL --anchor-calls "$ANCHOR_CALLS" \
                     --json "$OUT_DIR/anchors.json" ;;
        grpo) run 120 $FS --sizes $GRPO_SIZE --iters 1 $GRPO --json "$OUT_DIR/grpo.json" ;;
        grpo_compiled) TORCH_LOGS=recompiles run 125 $FS --sizes $GRPO_SIZE --iters 1 $GRPO --compile \
                           --json "$OUT_DIR/grpo_compiled.json" ;;
        loop) run 90 python3 -m bench.loop_overhead --model $MODEL --steps 4 --repeats 1 \
                  --profile "$OUT_DIR/loop_profile.txt" --json "$OUT_DIR/loop.json" ;;
        summary) run 5 python3 -m bench.full_size_summary "$OUT_DIR" ;;
        grpo_1024) run 300 $FS --sizes 512:12 1024:6 --iters 1 --check-bf16 --json "$OUT_DIR/grpo_1024.json" ;;
        width) run 70 $WIDTH --lora-rank 0 --no-recompute --iters 2 --profile "$OUT_DIR/profile.txt" \
                   --json "$OUT_DIR/flux_width.json" ;;
        width_compiled) TORCH_LOGS=recompiles run 75 $WIDTH --lora-rank 0 --no-recompute --iters 2 --compile \
                            --workdir /tmp/mm_grpo_full_size_compiled --json "$OUT_DIR/width_compiled.json" ;;
        reference) CUDA_LAUNCH_BLOCKING=1 run 60 python3 -m bench.bench_grpo --preset flux-width --iters 0 \
                       --only reference ;;
        ratio) run 300 python3 -m bench.bench_grpo --preset flux-width --iters 2 --json "$OUT_DIR/ratio.json" ;;
        width20) run 150 $WIDTH --iters 20 --json "$OUT_DIR/width20.json" ;;
        *) echo "unknown step $step (smoke anchors grpo grpo_compiled loop summary grpo_1024 width width_compiled" \
                "reference ratio width20)" >&2; exit 2 ;;
    esac
done
echo "=== all steps: $(($(date +%s) - START)) s" | tee -a "$LOG"
