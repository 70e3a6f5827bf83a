#!/usr/bin/env bash
# GRPO fine-tuning of Qwen-Image with mm-grpo's trainer (Flow-GRPO / DanceGRPO on Megatron, true CFG).
#
#   bash examples/qwen_image/grpo_qwen_image.sh     # no accelerator: a short run of a tiny random Qwen-Image
#                                                   # on 2 CPU processes (it shows the run works, not learning)
#   PIPELINE_DIR=/models/Qwen-Image HPS_PATH=/models/HPS_v2.1_compressed.pt PROMPT_FILE=prompts.txt \
#   NPUS_PER_NODE=8 TP=4 bash examples/qwen_image/grpo_qwen_image.sh [extra trainer args]
#
# Settings (environment variables; anything after the script's name goes to the trainer):
#   PIPELINE_DIR   diffusers Qwen-Image pipeline folder (transformer/, vae/, text_encoder/, tokenizer/, scheduler/)
#   MODEL_JSON DATA_JSON  model.json / data.json (default: this folder's; model_tiny.json for the CPU run);
#                  PROMPT_FILE / EVAL_PROMPT_FILE fill data.json in
#   LOAD           a converted checkpoint (mm-convert QwenImageConverter hf_to_mm) to start from, or a
#                  training checkpoint to resume; SAVE where to save (default: RUN_DIR/ckpt)
#   TP PP CP       tensor / pipeline / context (Ulysses) parallel sizes (`mm-grpo plan --model qwen-image`)
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   PROMPTS MBS G STEPS ITERS LR SEED  prompts per iteration, micro-batch, generations per prompt, denoising
#                  steps, iterations, learning rate, seed
#   TRUE_CFG NEGATIVE_PROMPT  true CFG scale (QwenImagePipeline's 4; 1: none) and its negative prompt (" ")
#   SAMPLER POLICY_LOSS TIMESTEP_FRACTION CLIP KL_BETA  as in examples/flux/grpo_flux.sh
#   LORA_R         LoRA rank on the recommended targets (default 64 on an accelerator; 0: full fine-tuning)
#   SAVE_INTERVAL LOG_INTERVAL EVAL_INTERVAL EVAL_PROMPTS IMAGE_INTERVAL   as in grpo_flux.sh
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C saves the iteration in progress, then ends the job
#   RUN_DIR        output folder (train.log, TensorBoard logs, checkpoints, image grids)
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"

source "$REPO/shell/launch_env.sh"  # PY, DEVICE, accelerator environment
source "$REPO/shell/run_trainer.sh"  # run_trainer: the trainer's exit status and one-line error last

RUN_DIR="${RUN_DIR:-$REPO/runs/grpo_qwen_image_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$RUN_DIR"
if [ -z "${PIPELINE_DIR:-}" ]; then
  if [ "$DEVICE" != "cpu" ]; then
    echo "grpo_qwen_image.sh: set PIPELINE_DIR to a Qwen-Image pipeline folder, or run the tiny CPU run with MM_GRPO_DEVICE=cpu" >&2; exit 2
  fi
  # The tiny CPU run: a random tiny Qwen-Image pipeline (mm_grpo/families/qwen_image/tiny.py), JPEG
  # compressibility, true CFG, LoRA, 2 processes (data parallel).
  export PIPELINE_DIR="$RUN_DIR/tiny_qwen_image"
  [ -d "$PIPELINE_DIR" ] || "$PY" -m mm_grpo.families.qwen_image.tiny --out "$PIPELINE_DIR" > /dev/null
  MODEL_JSON="${MODEL_JSON:-$SCRIPT_DIR/model_tiny.json}"
  SHAPES="$REPO/examples/flux/shapes_prompts"  # the shapes grammar's prompt split (mm_grpo/data/shapes.py)
  export PROMPT_FILE="${PROMPT_FILE:-$SHAPES/grpo.txt}" EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE-$SHAPES/eval.txt}"
  NPUS_PER_NODE="${NPUS_PER_NODE:-2}"; ITERS="${ITERS:-4}"; PROMPTS="${PROMPTS:-2}"; MBS="${MBS:-2}"; G="${G:-4}"
  STEPS="${STEPS:-6}"; LR="${LR:-1e-3}"; LORA_R="${LORA_R:-4}"; EVAL_INTERVAL="${EVAL_INTERVAL:-$ITERS}"
  EVAL_PROMPTS="${EVAL_PROMPTS:-4}"; IMAGE_INTERVAL="${IMAGE_INTERVAL:-$ITERS}"; SAVE_INTERVAL="${SAVE_INTERVAL:-$ITERS}"
  LOG_INTERVAL="${LOG_INTERVAL:-1}"
fi
export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-}"
: "${PROMPT_FILE:?set PROMPT_FILE to a prompt file (one prompt per line, or .jsonl)}"

NPUS_PER_NODE="${NPUS_PER_NODE:-8}"; NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
TP="${TP:-1}"; PP="${PP:-1}"; CP="${CP:-1}"
check_torchrun_sizes
check_layout TP PP CP
G="${G:-12}"; MBS="${MBS:-1}"; PROMPTS="${PROMPTS:-$((NPUS_PER_NODE * NNODES / (TP * PP * CP)))}"  # one per DP rank
STEPS="${STEPS:-16}"; ITERS="${ITERS:-200}"; LR="${LR:-1e-5}"; SEED="${SEED:-1234}"; LORA_R="${LORA_R:-64}"
EVAL_PROMPTS="${EVAL_PROMPTS:-8}"; SAVE_INTERVAL="${SAVE_INTERVAL:-100}"; LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-20}"; IMAGE_INTERVAL="${IMAGE_INTERVAL:-20}"; TRUE_CFG="${TRUE_CFG:-4.0}"
check_whole_numbers 1 G MBS PROMPTS STEPS EVAL_PROMPTS LOG_INTERVAL
check_whole_numbers 0 ITERS SEED SAVE_INTERVAL EVAL_INTERVAL IMAGE_INTERVAL LORA_R
EXIT_SIGNAL_HANDLER="${EXIT_SIGNAL_HANDLER:-1}"; check_one_of EXIT_SIGNAL_HANDLER 0 1

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size $MBS --train-iters $ITERS --seed $SEED \
  --lr $LR --weight-decay 1e-4 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0"
[ "$DEVICE" = "cpu" ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-activations"
[ "$LORA_R" = 0 ] || GPT_ARGS="$GPT_ARGS --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --lora-r $LORA_R --lora-alpha $LORA_R"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data.json}"
GRPO_ARGS=(--prompts-per-iteration "$PROMPTS" --num-generations "$G" --num-inference-steps "$STEPS"
  --sampler "${SAMPLER:-flow_sde}" --policy-loss "${POLICY_LOSS:-ppo}" --timestep-fraction "${TIMESTEP_FRACTION:-0.6}"
  --clip-range "${CLIP:-1e-4}" --adv-clip-max 5 --eval-prompts "$EVAL_PROMPTS" --true-cfg-scale "$TRUE_CFG")
[ -n "${NEGATIVE_PROMPT:-}" ] && GRPO_ARGS+=(--negative-prompt "$NEGATIVE_PROMPT")
[ -n "${KL_BETA:-}" ] && GRPO_ARGS+=(--kl-beta "$KL_BETA")
OUTPUT_ARGS="--save ${SAVE:-$RUN_DIR/ckpt} --save-interval $SAVE_INTERVAL --log-interval $LOG_INTERVAL \
  --tensorboard-dir $RUN_DIR --eval-interval $EVAL_INTERVAL --save-image-interval $IMAGE_INTERVAL"
[ -n "${LOAD:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[grpo_qwen_image.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE TP=$TP PP=$PP CP=$CP run=$RUN_DIR"
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS \
  -m mm_grpo.training.train_grpo $GPT_ARGS $MM_ARGS "${GRPO_ARGS[@]}" $OUTPUT_ARGS "$@"
