#!/bin/bash
# FLUX.1 flow-matching training with MindSpeed-MM's own pretrain_sora.py (precomputed features),
# in MindSpeed-MM's launch style. Run from a MindSpeed-MM checkout with mm-grpo installed:
#   MINDSPEED_MM=/path/to/MindSpeed-MM bash examples/flux/mindspeed_mm/pretrain_flux.sh
# `python -m mm_grpo.run_mindspeed_mm` registers "model_id": "flux" before the script runs.
# Weights: --load an `mm-convert FluxConverter hf_to_mm` output at this TP / PP (or
# predictor.from_pretrained: one diffusers diffusion_pytorch_model.safetensors file).
# Features (feature_data.json): one .pt per sample with "video" (FLUX VAE latents [16, H/8, W/8],
# scaled and shifted) and "prompt_ids" ([T5 hidden states [512, 4096], pooled CLIP [768]]).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# CANN first, as every MindSpeed-MM script does (older installs: the ascend-toolkit path);
# MM_GRPO_ASCEND is the Ascend folder, as in shell/launch_env.sh.
ASCEND_DIR=${MM_GRPO_ASCEND:-/usr/local/Ascend}
if [ -f "$ASCEND_DIR/cann/set_env.sh" ]; then source "$ASCEND_DIR/cann/set_env.sh"
else source "$ASCEND_DIR/ascend-toolkit/set_env.sh"; fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
export ASCEND_SLOG_PRINT_TO_STDOUT=0
export ASCEND_GLOBAL_LOG_LEVEL=3
export TASK_QUEUE_ENABLE=2
export COMBINED_ENABLE=1
export CPU_AFFINITY_CONF=1
export HCCL_CONNECT_TIMEOUT=1200
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

TP=${TP:-1}
PP=${PP:-2}   # pretrain_model.json's pipeline_num_layers has one entry per stage
CP=${CP:-1}
MBS=${MBS:-1}
GRAD_ACC_STEP=${GRAD_ACC_STEP:-1}
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))

MINDSPEED_MM=${MINDSPEED_MM:?set MINDSPEED_MM to your MindSpeed-MM checkout}
MM_DATA=${MM_DATA:-$HERE/feature_data.json}
MM_MODEL=${MM_MODEL:-$HERE/pretrain_model.json}
LOAD_PATH=${LOAD_PATH:-"ckpt/flux_dev_tp${TP}_pp${PP}"}
SAVE_PATH=${SAVE_PATH:-"save/flux_pretrain"}

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

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
    --train-iters 5000 \
    --no-gradient-accumulation-fusion \
    --no-load-optim \
    --no-load-rng \
    --bf16 \
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL
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

logfile=$(date +%Y%m%d)_$(date +%H%M%S)
mkdir -p logs
cd "$MINDSPEED_MM"
torchrun $DISTRIBUTED_ARGS -m mm_grpo.run_mindspeed_mm pretrain_sora.py \
    $GPT_ARGS \
    $MM_ARGS \
    $OUTPUT_ARGS \
    2>&1 | tee logs/train_${logfile}.log
