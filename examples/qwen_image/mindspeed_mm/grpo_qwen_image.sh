#!/bin/bash
# GRPO of Qwen-Image inside MindSpeed-MM's own training loop (its `pretrain`), in MindSpeed-MM's launch
# style: mm_grpo.mindspeed_mm.grpo (docs/grpo_schedule.md section 11). Run from a MindSpeed-MM
# checkout with mm-grpo installed:
#   MINDSPEED_MM=/path/to/MindSpeed-MM PIPELINE_DIR=/models/Qwen-Image HPS_PATH=/models/HPS_v2.1_compressed.pt \
#   PROMPT_FILE=prompts.txt bash examples/qwen_image/mindspeed_mm/grpo_qwen_image.sh [more arguments of the entry]
# Weights: LOAD_PATH, an `mm-convert QwenImageConverter hf_to_mm` output at this TP and PP 1 (the entry
# refuses pipeline parallelism for Qwen-Image), or predictor.from_pretrained in MM_MODEL (one diffusers
# diffusion_pytorch_model.safetensors file); to resume a run, LOAD_PATH=$SAVE_PATH.
# MM_MODEL (grpo_model.json): the VAE and Qwen2.5-VL of $PIPELINE_DIR and the rewards ($HPS_PATH);
# TRUE_CFG: QwenImagePipeline's true CFG scale (4; 1: none), NEGATIVE_PROMPT its negative prompt (" ");
# MM_DATA (grpo_data.json): $PROMPT_FILE, and $EVAL_PROMPT_FILE for the held-out evaluation (unset: none).
# The batch is PROMPTS prompts per iteration x G generations; the entry derives Megatron's
# --global-batch-size from it (the (generation, trained step) rows of an optimizer step, grpo/batch.py).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# MindSpeed-MM's launch environment, as every model's script here sets it: CANN, MindSpeed-MM's exports,
# torchrun's sizes, run_trainer (shell/run_trainer.sh)
source "$HERE/../../flux/mindspeed_mm/launch_env.sh"

TP=${TP:-1}
CP=${CP:-1}
check_layout TP CP
DP=$(($WORLD_SIZE/$TP/$CP))
MBS=${MBS:-1}
G=${G:-12}           # generations per prompt
STEPS=${STEPS:-16}   # denoising steps of a rollout
PROMPTS=${PROMPTS:-$DP}  # prompts per iteration: one per data-parallel rank
TRAIN_ITERS=${TRAIN_ITERS:-300}
LR=${LR:-1e-5}
SEED=${SEED:-42}
KL_BETA=${KL_BETA:-0}
SAVE_INTERVAL=${SAVE_INTERVAL:-50}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
EVAL_PROMPTS=${EVAL_PROMPTS:-8}
MAX_SKIPPED=${MAX_SKIPPED:-10}
check_whole_numbers 1 MBS G STEPS PROMPTS EVAL_PROMPTS
check_whole_numbers 0 TRAIN_ITERS SEED SAVE_INTERVAL EVAL_INTERVAL MAX_SKIPPED
# 1: SIGTERM or Ctrl-C to this script saves the iteration in progress (at a rollout's end), then ends the job
# (Megatron's --exit-signal-handler; the script exits 143 / 130); 0: ends it at once
EXIT_SIGNAL_HANDLER=${EXIT_SIGNAL_HANDLER:-1}
check_one_of EXIT_SIGNAL_HANDLER 0 1

MINDSPEED_MM=${MINDSPEED_MM:?set MINDSPEED_MM to your MindSpeed-MM checkout}
MM_MODEL=${MM_MODEL:-$HERE/grpo_model.json}
MM_DATA=${MM_DATA:-$HERE/grpo_data.json}
MM_TOOL=${MM_TOOL:-$MINDSPEED_MM/mindspeed_mm/tools/tools.json}
export EVAL_PROMPT_FILE=${EVAL_PROMPT_FILE:-}
LOAD_PATH=${LOAD_PATH:-"ckpt/qwen_image_tp${TP}_pp1"}
SAVE_PATH=${SAVE_PATH:-"save/qwen_image_grpo"}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-"tensorboard/qwen_image_grpo"}
LOG_DIR=${LOG_DIR:-logs}

GPT_ARGS="
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size 1 \
    --context-parallel-size ${CP} \
    --context-parallel-algo ulysses_cp_algo \
    --micro-batch-size ${MBS} \
    --lr ${LR} \
    --min-lr 0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --adam-eps 1e-8 \
    --lr-decay-style constant \
    --weight-decay 1e-4 \
    --lr-warmup-iters 0 \
    --clip-grad 1.0 \
    --train-iters ${TRAIN_ITERS} \
    --seed ${SEED} \
    --distributed-backend ${DIST_BACKEND} \
    --no-gradient-accumulation-fusion \
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL \
    --mm-tool $MM_TOOL
"

GRPO_ARGS="
    --prompts-per-iteration ${PROMPTS} \
    --num-generations ${G} \
    --num-inference-steps ${STEPS} \
    --sampler ${SAMPLER:-flow_sde} \
    --true-cfg-scale ${TRUE_CFG:-4.0} \
    --policy-loss ${POLICY_LOSS:-ppo} \
    --timestep-fraction ${TIMESTEP_FRACTION:-0.6} \
    --clip-range ${CLIP:-1e-4} \
    --kl-beta ${KL_BETA} \
    --max-skipped-iterations ${MAX_SKIPPED} \
    --eval-prompts ${EVAL_PROMPTS} \
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval ${SAVE_INTERVAL} \
    --eval-interval ${EVAL_INTERVAL} \
    --load $LOAD_PATH \
    --save $SAVE_PATH \
    --tensorboard-dir $TENSORBOARD_DIR \
    --ckpt-format torch \
"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"
NEGATIVE=()
[ -n "${NEGATIVE_PROMPT:-}" ] && NEGATIVE=(--negative-prompt "$NEGATIVE_PROMPT")

logfile=$(date +%Y%m%d)_$(date +%H%M%S)
cd "$MINDSPEED_MM"
mkdir -p "$LOG_DIR"
# shellcheck disable=SC2086
run_trainer "$LOG_DIR/grpo_${logfile}.log" torchrun $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.grpo \
    $GPT_ARGS \
    $MM_ARGS \
    $GRPO_ARGS \
    $OUTPUT_ARGS \
    "${NEGATIVE[@]}" \
    "$@"
