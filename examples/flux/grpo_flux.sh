#!/usr/bin/env bash
# GRPO fine-tuning of FLUX with mm-grpo (DanceGRPO / Flow-GRPO on Megatron).
#
#   bash examples/flux/grpo_flux.sh                 # no accelerator: tiny CPU demo, 2 processes
#   PIPELINE_DIR=/models/FLUX.1-dev HPS_PATH=/models/HPS_v2.1_compressed.pt \
#   PROMPT_FILE=prompts.txt NPUS_PER_NODE=8 TP=2 bash examples/flux/grpo_flux.sh [extra trainer args]
#
# Settings (environment variables; anything after the script's name goes to the trainer):
#   PIPELINE_DIR   diffusers FLUX pipeline folder (transformer/, vae/, text encoders)
#   MODEL_JSON     model.json (default: model.json, or model_tiny.json for the CPU demo)
#   DATA_JSON      data.json; PROMPT_FILE / EVAL_PROMPT_FILE fill it in
#   LOAD           a converted Megatron checkpoint (mm-convert ... hf_to_mm) to start from,
#                  or a training checkpoint to resume; SAVE where to save (default: RUN_DIR/ckpt)
#   HPS_PATH ...   reward weights named in MODEL_JSON
#   TP PP CP       tensor / pipeline / context(Ulysses) parallel sizes
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   GBS MBS G STEPS ITERS LR       batch, micro-batch, generations per prompt, denoising steps,
#                                  iterations, learning rate
#   RUN_DIR        output folder (TensorBoard logs, checkpoints, image grids)
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"

# Python: the current one if it has mm_grpo, else the project's own environment.
if [ -n "${MM_GRPO_PYTHON:-}" ]; then PY="$MM_GRPO_PYTHON"
elif python3 -c "import mm_grpo" 2>/dev/null; then PY=python3
else bash "$REPO/shell/setup_env.sh"; PY="${MM_GRPO_VENV:-$REPO/.venv}/bin/python"; fi
cd "$REPO"
DEVICE="$(PYTHONWARNINGS=ignore "$PY" -c 'import mm_grpo; print(mm_grpo.get_platform().name)' 2>/dev/null | tail -n 1)"

if [ "$DEVICE" = "npu" ]; then  # Ascend settings MindSpeed-MM's scripts use
  export TASK_QUEUE_ENABLE=2 COMBINED_ENABLE=1 CPU_AFFINITY_CONF=1 HCCL_CONNECT_TIMEOUT=1200 HCCL_BUFFSIZE=800
  export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
  source /usr/local/Ascend/ascend-toolkit/set_env.sh 2>/dev/null || true
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1

RUN_DIR="${RUN_DIR:-$REPO/runs/grpo_flux_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$RUN_DIR"
if [ -z "${PIPELINE_DIR:-}" ]; then
  if [ "$DEVICE" != "cpu" ]; then
    echo "grpo_flux.sh: set PIPELINE_DIR to a FLUX pipeline folder (the tiny demo is for CPU)" >&2; exit 2
  fi
  # The CPU demo: a tiny FLUX pipeline built locally, a reward that needs no weights.
  export PIPELINE_DIR="$REPO/runs/tiny_pipeline"
  [ -d "$PIPELINE_DIR" ] || "$PY" -m mm_grpo.pipeline.tiny --out "$PIPELINE_DIR"
  MODEL_JSON="${MODEL_JSON:-$SCRIPT_DIR/model_tiny.json}"
  export PROMPT_FILE="${PROMPT_FILE:-$SCRIPT_DIR/prompts_tiny.txt}"
  export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-$SCRIPT_DIR/eval_prompts_tiny.txt}"
  NPUS_PER_NODE="${NPUS_PER_NODE:-2}"; ITERS="${ITERS:-60}"; GBS="${GBS:-16}"; MBS="${MBS:-4}"
  G="${G:-8}"; LR="${LR:-3e-3}"; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-}"
: "${PROMPT_FILE:?set PROMPT_FILE to a prompt file (one prompt per line, or .jsonl)}"

NPUS_PER_NODE="${NPUS_PER_NODE:-8}"; NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
TP="${TP:-1}"; PP="${PP:-1}"; CP="${CP:-1}"
G="${G:-12}"; MBS="${MBS:-1}"; GBS="${GBS:-$((G * NPUS_PER_NODE * NNODES / (TP * PP * CP)))}"
STEPS="${STEPS:-16}"; ITERS="${ITERS:-200}"; LR="${LR:-1e-5}"

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size $MBS --global-batch-size $GBS --train-iters $ITERS --seed 1234 \
  --lr $LR --weight-decay 1e-4 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0"
[ "$DEVICE" = "cpu" ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-activations"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data.json}"
GRPO_ARGS="--num-generations $G --num-inference-steps $STEPS --sampler ${SAMPLER:-dance_sde} \
  --timestep-selection ${TIMESTEPS:-random} --timestep-fraction 0.6 --clip-range 1e-4 --adv-clip-max 5"
OUTPUT_ARGS="--save ${SAVE:-$RUN_DIR/ckpt} --save-interval ${SAVE_INTERVAL:-100} --log-interval ${LOG_INTERVAL:-10} \
  --tensorboard-dir $RUN_DIR/tensorboard --eval-interval ${EVAL_INTERVAL:-20} --save-image-interval 20 \
  --ckpt-format torch"
[ -n "${LOAD:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD"

echo "[grpo_flux.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE TP=$TP PP=$PP CP=$CP run=$RUN_DIR"
# shellcheck disable=SC2086
PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS \
  -m mm_grpo.training.train_grpo $GPT_ARGS $MM_ARGS $GRPO_ARGS $OUTPUT_ARGS "$@" 2>&1 | tee "$RUN_DIR/train.log"
