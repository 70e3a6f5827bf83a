#!/usr/bin/env bash
# Flow-matching training of Wan2.1's text-to-video DiT (MindSpeed-MM's own `wandit`) with MindSpeed-MM's own
# pretrain_sora.py on precomputed features, as MindSpeed-MM's examples/wan2.1/1.3b/t2v/pretrain.sh launches it
# (through `python -m mm_grpo.mindspeed_mm.run`, which sets up the accelerator first: docs/mindspeed_mm.md).
#
#   1. features: python -m mm_grpo.tools.write_features --family wan --pipeline WAN_PIPELINE --data VIDEO_DIR \
#          --out $DATA_ROOT/motion_features --max-sequence-length 16     (data.json names ./motion_features)
#   2. MM_GRPO_DEVICE=cpu DATA_ROOT=... bash examples/wan/pretrain_wan.sh      # CPU: the testbed, gloo, fp32
#      MINDSPEED_MM=/path/to/MindSpeed-MM MODEL_JSON=... DATA_JSON=... LOAD_PATH=ckpt/wan_1.3b NPUS_PER_NODE=8 \
#          bash examples/wan/pretrain_wan.sh [pretrain_sora.py args]
#
# examples/wan/build_tiny_motion.sh runs it on the tiny motion DiT. Settings (environment variables; anything
# after the script's name goes to pretrain_sora.py):
#   MINDSPEED_MM   the MindSpeed-MM checkout; with MM_GRPO_DEVICE=cpu and none given, the testbed's, in
#                  MindSpeed-MM's environment with torch_npu's stand-ins (examples/wan/cpu_env.sh)
#   MODEL_JSON DATA_JSON  MindSpeed-MM's model.json and data.json (default: pretrain_model_motion.json, the tiny
#                  motion DiT, and feature_data_motion.json, ./motion_features)
#   DATA_ROOT      the folder the launch runs from, where data.json's relative paths, LOAD_PATH and SAVE_PATH
#                  resolve (default $MINDSPEED_MM, as MindSpeed-MM's own scripts run)
#   LOAD_PATH      weights to start from (mm-convert WanConverter hf_to_mm), or a checkpoint to resume; none, or a
#                  folder without a checkpoint: the predictor's own random initialisation
#   SAVE_PATH      where checkpoints go (default RUN_DIR/ckpt)
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun
#   CP PP          Ulysses context-parallel and pipeline-parallel sizes (wandit runs TP 1; under PP the data.json
#                  needs num_frames, max_height and max_width: MindSpeed-MM sizes the stage tensors by them)
#   GBS            videos per optimizer step: one per micro-batch (wandit's head is right for one sample),
#                  GBS / DP micro-batches accumulated on each data-parallel rank
#   ITERS LR MIN_LR WARMUP DECAY WD CLIP SEED   iterations, learning rate (cosine decay to MIN_LR after WARMUP
#                  iterations unless DECAY says otherwise), weight decay, gradient clip, seed
#   SAVE_INTERVAL LOG_INTERVAL   checkpoint and log intervals in iterations
#   RUN_DIR        output folder (train.log, appended on each start; TensorBoard events)
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C to this script saves the iteration in progress, then
#                  ends the job (Megatron's --exit-signal-handler; the script exits 143 / 130); 0: ends it at once
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
RUN_DIR="${RUN_DIR:-$PWD/runs/pretrain_wan_$(date +%Y%m%d_%H%M%S)}"
[ "${MM_GRPO_DEVICE:-}" = cpu ] && [ -z "${MINDSPEED_MM:-}" ] && source "$SCRIPT_DIR/cpu_env.sh"
[ -z "${DATA_ROOT:-}" ] || DATA_ROOT="$(cd "$DATA_ROOT" && pwd)"  # given relative to here; the launch runs there
MINDSPEED_MM="${MINDSPEED_MM:?set MINDSPEED_MM to your MindSpeed-MM checkout (or MM_GRPO_DEVICE=cpu for the testbed)}"
NEEDS_MINDSPEED_MM=1
source "$REPO/shell/launch_env.sh"  # PY, DEVICE; CANN's environment on an Ascend machine
source "$REPO/shell/run_trainer.sh"  # run_trainer: the entry's exit status and one-line error last
DATA_ROOT="${DATA_ROOT:-$MINDSPEED_MM}"

NPUS_PER_NODE="${NPUS_PER_NODE:-$([ "$DEVICE" = cpu ] && echo 2 || echo 8)}"; NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"; MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
CP="${CP:-1}"; PP="${PP:-1}"
check_torchrun_sizes
check_layout CP PP
DP=$((NPUS_PER_NODE * NNODES / CP / PP))
GBS="${GBS:-$DP}"; ITERS="${ITERS:-1000}"; LR="${LR:-1e-4}"; WARMUP="${WARMUP:-0}"; SEED="${SEED:-1234}"
LOG_INTERVAL="${LOG_INTERVAL:-100}"; SAVE_INTERVAL="${SAVE_INTERVAL:-$ITERS}"
check_whole_numbers 1 GBS LOG_INTERVAL
check_whole_numbers 0 ITERS WARMUP SEED SAVE_INTERVAL
[ $((GBS % DP)) = 0 ] \
  || { echo "pretrain_wan.sh: GBS $GBS must be a positive multiple of DP $DP (one video per micro-batch)" >&2; exit 2; }
EXIT_SIGNAL_HANDLER="${EXIT_SIGNAL_HANDLER:-1}"; check_one_of EXIT_SIGNAL_HANDLER 0 1
mkdir -p "$RUN_DIR"

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size 1 --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size 1 --global-batch-size $GBS --train-iters $ITERS --seed $SEED \
  --lr $LR --min-lr ${MIN_LR:-0} --lr-warmup-init 0 --lr-warmup-iters $WARMUP --lr-decay-style ${DECAY:-cosine} \
  --weight-decay ${WD:-0} --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --clip-grad ${CLIP:-1.0} \
  --distributed-backend $([ "$DEVICE" = cpu ] && echo gloo || echo nccl) --no-gradient-accumulation-fusion"
[ "$PP" = 1 ] || GPT_ARGS="$GPT_ARGS --use-multiparameter-pipeline-model-parallel"
# On a CPU: fp32 (megatron-core's linear layers restore CUDA's autocast in their backward, not the CPU's) and the
# data read in the training process (no loader workers competing for the cores the ranks use).
[ "$DEVICE" = cpu ] && GPT_ARGS="$GPT_ARGS --num-workers 0" || GPT_ARGS="$GPT_ARGS --bf16 --num-workers 8"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/pretrain_model_motion.json} \
  --mm-data ${DATA_JSON:-$SCRIPT_DIR/feature_data_motion.json} \
  --mm-tool ${MM_TOOL:-$MINDSPEED_MM/mindspeed_mm/tools/tools.json}"
OUTPUT_ARGS="--log-interval $LOG_INTERVAL --save-interval $SAVE_INTERVAL \
  --eval-interval $((ITERS + 1)) --eval-iters 0 --save ${SAVE_PATH:-$RUN_DIR/ckpt} --tensorboard-dir $RUN_DIR/tb --ckpt-format torch"
[ -n "${LOAD_PATH:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD_PATH"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[pretrain_wan.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE CP=$CP PP=$PP DP=$DP GBS=$GBS run=$RUN_DIR"
cd "$DATA_ROOT"  # MindSpeed-MM's launches run where their data.json's relative paths point
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run \
  $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.run "$MINDSPEED_MM/pretrain_sora.py" $GPT_ARGS $MM_ARGS $OUTPUT_ARGS "$@"
