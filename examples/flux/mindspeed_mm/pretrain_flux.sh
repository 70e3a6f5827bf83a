#!/bin/bash
# FLUX.1 flow-matching training with MindSpeed-MM's own pretrain_sora.py (precomputed features),
# in MindSpeed-MM's launch style (docs/mindspeed_mm.md). With mm-grpo installed:
#
#   1. the features, from an image-caption folder (metadata.jsonl + images) and the FLUX pipeline:
#      python -m mm_grpo.tools.write_features --pipeline /models/FLUX.1-dev --data DATA_DIR \
#          --out $MINDSPEED_MM/flux_features --resolution 1024 --device npu
#      (one .pt per sample: "video" VAE latents [16, H/8, W/8], scaled and shifted; "prompt_ids"
#      [T5 hidden states [512, 4096], pooled CLIP [768]]; "prompt_mask"; listed in data.jsonl.
#      feature_data.json reads ./flux_features at 1024 x 1024; the predictor's text_len is 512.)
#   2. MINDSPEED_MM=/path/to/MindSpeed-MM bash examples/flux/mindspeed_mm/pretrain_flux.sh
#
# `python -m mm_grpo.mindspeed_mm.run` registers "model_id": "flux" before the script runs.
# Weights: LOAD_PATH, an `mm-convert FluxConverter hf_to_mm` output at this TP / PP (or
# predictor.from_pretrained: one diffusers diffusion_pytorch_model.safetensors file).
# Settings (environment variables; relative paths are relative to $MINDSPEED_MM, where it runs):
#   MINDSPEED_MM   the MindSpeed-MM checkout (required)
#   MM_MODEL MM_DATA MM_TOOL   model.json, data.json (pretrain_model.json, feature_data.json here)
#                  and MindSpeed-MM's tools.json (its profiler settings)
#   LOAD_PATH SAVE_PATH LOG_DIR   checkpoint to start from, where to save, where the log goes
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   TP PP CP MBS GRAD_ACC_STEP TRAIN_ITERS   parallel sizes (PP: one pipeline_num_layers entry per
#                  stage), micro-batch, gradient accumulation, iterations (5000)
#   PRECISION      bf16 (default) | fp32;  DIST_BACKEND  nccl (default) | gloo
#   MM_GRPO_ASCEND the Ascend folder whose CANN set_env.sh is sourced (/usr/local/Ascend)
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C to this script saves the iteration in progress, then
#                  ends the job (Megatron's --exit-signal-handler; the script exits 143 / 130); 0: ends it at once
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/launch_env.sh"  # CANN, MindSpeed-MM's exports, torchrun's sizes, run_trainer (shell/run_trainer.sh)

TP=${TP:-1}
PP=${PP:-2}   # pretrain_model.json's pipeline_num_layers has one entry per stage
CP=${CP:-1}
MBS=${MBS:-1}
GRAD_ACC_STEP=${GRAD_ACC_STEP:-1}
check_layout TP PP CP
check_whole_numbers 1 MBS GRAD_ACC_STEP
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))

MINDSPEED_MM=${MINDSPEED_MM:?set MINDSPEED_MM to your MindSpeed-MM checkout}
MM_DATA=${MM_DATA:-$HERE/feature_data.json}
MM_MODEL=${MM_MODEL:-$HERE/pretrain_model.json}
MM_TOOL=${MM_TOOL:-$MINDSPEED_MM/mindspeed_mm/tools/tools.json}  # MindSpeed-MM's profiler settings; pretrain reads them
LOAD_PATH=${LOAD_PATH:-"ckpt/flux_dev_tp${TP}_pp${PP}"}
SAVE_PATH=${SAVE_PATH:-"save/flux_pretrain"}
LOG_DIR=${LOG_DIR:-logs}
TRAIN_ITERS=${TRAIN_ITERS:-5000}
check_whole_numbers 0 TRAIN_ITERS
EXIT_SIGNAL_HANDLER=${EXIT_SIGNAL_HANDLER:-1}
check_one_of EXIT_SIGNAL_HANDLER 0 1
# bf16 (Megatron's --bf16) or fp32; a CPU takes fp32 only (megatron-core's linear layers restore
# CUDA's autocast in their backward, not the CPU's), with "dtype": "fp32" in MM_MODEL's predictor
PRECISION=${PRECISION:-bf16}
case "$PRECISION" in
    bf16) PRECISION_ARG=--bf16 ;;
    fp32) PRECISION_ARG= ;;
    *) echo "pretrain_flux.sh: PRECISION must be bf16 or fp32, got '$PRECISION'" >&2; exit 2 ;;
esac

GPT_ARGS="
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --context-parallel-size ${CP} \
    --context-parallel-algo ulysses_cp_algo \
    --use-multiparameter-pipeline-model-parallel \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --num-workers 8 \
    --lr 1e-5 \
    --min-lr 1e-5 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --adam-eps 1e-8 \
    --lr-decay-style constant \
    --weight-decay 1e-2 \
    --lr-warmup-init 0 \
    --lr-warmup-iters 0 \
    --clip-grad 1.0 \
    --train-iters ${TRAIN_ITERS} \
    --no-gradient-accumulation-fusion \
    --no-load-optim \
    --no-load-rng \
    $PRECISION_ARG \
    --distributed-backend ${DIST_BACKEND} \
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL \
    --mm-tool $MM_TOOL
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 1000 \
    --eval-interval 10000 \
    --eval-iters 10 \
    --load $LOAD_PATH \
    --save $SAVE_PATH \
    --ckpt-format torch \
"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

logfile=$(date +%Y%m%d)_$(date +%H%M%S)
cd "$MINDSPEED_MM"
mkdir -p "$LOG_DIR"
# shellcheck disable=SC2086
run_trainer "$LOG_DIR/train_${logfile}.log" torchrun $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.run pretrain_sora.py \
    $GPT_ARGS \
    $MM_ARGS \
    $OUTPUT_ARGS
