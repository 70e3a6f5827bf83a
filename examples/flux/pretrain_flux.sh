#!/usr/bin/env bash
# Supervised flow-matching training of FLUX (pretraining, or fine-tuning before GRPO) with mm-grpo.
#
#   PIPELINE_DIR=/models/FLUX.1-dev DATA_DIR=/data/my_captions NPUS_PER_NODE=8 TP=2 \
#   bash examples/flux/pretrain_flux.sh [extra trainer args]
#
# Settings (environment variables; anything after the script's name goes to the trainer):
#   PIPELINE_DIR   diffusers FLUX pipeline folder (its VAE and text encoders encode the data)
#   DATA_DIR       image-caption folder: metadata.jsonl ({"file_name": ..., "text": ...} per line) + images
#   MODEL_JSON DATA_JSON   configs (default: model_flow.json, data_flow.json)
#   EVAL_PROMPT_FILE       held-out prompts, ODE-sampled and scored every EVAL_INTERVAL iterations
#                          (default 500; optional; needs a "reward" block in MODEL_JSON, as in
#                          model_flow_shapes.json)
#   LOAD           a training checkpoint to resume, or a converted checkpoint to start from;
#                  SAVE where to save (default: RUN_DIR/ckpt); LOAD=$SAVE with nothing saved yet:
#                  a fresh start from PIPELINE_DIR's weights
#   TP PP CP       tensor / pipeline / context(Ulysses) parallel sizes
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   GBS MBS ITERS LR WARMUP SHIFT   batch, micro-batch, iterations, learning rate, warm-up
#                                   iterations, sigma shift (default: FLUX's resolution rule)
#   DECAY WD SEED GUIDANCE          lr decay style (constant), weight decay (1e-4), seed (1234),
#                                   guidance embedding value (3.5)
#   RECOMPUTE_METHOD RECOMPUTE_LAYERS  Megatron's full recompute on an accelerator (--recompute-granularity
#                  full --recompute-method uniform|block --recompute-num-layers N; default uniform 1: every
#                  block; block N: the first N blocks of each stage, the others keep their activations)
#   SAVE_INTERVAL LOG_INTERVAL      checkpoint (500) and log (50) intervals in iterations
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C to this script saves the iteration in progress, then
#                  ends the job (--exit-signal-handler; the script exits 143 / 130); 0: ends it at once
#   RUN_DIR        output folder (train.log, appended on each start; TensorBoard logs, checkpoints, sample grids)
#   MM_GRPO_ASCEND Ascend install folder (default /usr/local/Ascend): where it exists, its CANN
#                  cann/set_env.sh (or ascend-toolkit/set_env.sh) is sourced first and torch_npu must
#                  import (shell/launch_env.sh); MM_GRPO_DEVICE=npu|cuda|cpu forces the device
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"

source "$REPO/shell/launch_env.sh"  # PY, DEVICE, accelerator environment
source "$REPO/shell/run_trainer.sh"  # run_trainer: the trainer's exit status and one-line error last

: "${PIPELINE_DIR:?set PIPELINE_DIR to a diffusers FLUX pipeline folder}"
: "${DATA_DIR:?set DATA_DIR to an image-caption folder (metadata.jsonl + images)}"
export PIPELINE_DIR DATA_DIR EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-}"
RUN_DIR="${RUN_DIR:-$REPO/runs/pretrain_flux_$(date +%Y%m%d_%H%M%S)}"

NPUS_PER_NODE="${NPUS_PER_NODE:-$([ "$DEVICE" = "cpu" ] && echo 2 || echo 8)}"; NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"; MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6001}"
TP="${TP:-1}"; PP="${PP:-1}"; CP="${CP:-1}"; MBS="${MBS:-1}"
check_torchrun_sizes
check_layout TP PP CP
check_whole_numbers 1 MBS
GBS="${GBS:-$((MBS * NPUS_PER_NODE * NNODES / (TP * PP * CP)))}"
ITERS="${ITERS:-1000}"; LR="${LR:-1e-5}"; WARMUP="${WARMUP:-0}"; SEED="${SEED:-1234}"
SAVE_INTERVAL="${SAVE_INTERVAL:-500}"; LOG_INTERVAL="${LOG_INTERVAL:-50}"; EVAL_INTERVAL="${EVAL_INTERVAL:-500}"
check_whole_numbers 1 GBS LOG_INTERVAL
check_whole_numbers 0 ITERS WARMUP SEED SAVE_INTERVAL EVAL_INTERVAL
EXIT_SIGNAL_HANDLER="${EXIT_SIGNAL_HANDLER:-1}"; check_one_of EXIT_SIGNAL_HANDLER 0 1
mkdir -p "$RUN_DIR"

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size $MBS --global-batch-size $GBS --train-iters $ITERS --seed $SEED \
  --lr $LR --lr-warmup-iters $WARMUP --lr-decay-style ${DECAY:-constant} --weight-decay ${WD:-1e-4} \
  --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0"
[ "$DEVICE" = "cpu" ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-granularity full \
  --recompute-method ${RECOMPUTE_METHOD:-uniform} --recompute-num-layers ${RECOMPUTE_LAYERS:-1}"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model_flow.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data_flow.json}"
FLOW_ARGS="--weighting-scheme logit_normal --guidance-scale ${GUIDANCE:-3.5}"
[ -n "${SHIFT:-}" ] && FLOW_ARGS="$FLOW_ARGS --flow-shift $SHIFT"
OUTPUT_ARGS="--save ${SAVE:-$RUN_DIR/ckpt} --save-interval $SAVE_INTERVAL --log-interval $LOG_INTERVAL \
  --tensorboard-dir $RUN_DIR --eval-interval $EVAL_INTERVAL --save-image-interval $EVAL_INTERVAL"
[ -n "${LOAD:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[pretrain_flux.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE TP=$TP PP=$PP CP=$CP run=$RUN_DIR"
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS \
  -m mm_grpo.training.train_flow $GPT_ARGS $MM_ARGS $FLOW_ARGS $OUTPUT_ARGS "$@"
