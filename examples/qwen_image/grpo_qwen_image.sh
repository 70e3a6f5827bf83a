#!/usr/bin/env bash
# GRPO fine-tuning of Qwen-Image with mm-grpo's trainer (Flow-GRPO / DanceGRPO on Megatron, true CFG).
#
#   bash examples/qwen_image/grpo_qwen_image.sh     # no accelerator: the tiny CPU demo, 2 processes (GRPO of
#                                                   # the shipped tiny shapes Qwen-Image, docs/qwen_image.md)
#   PIPELINE_DIR=/models/Qwen-Image HPS_PATH=/models/HPS_v2.1_compressed.pt PROMPT_FILE=prompts.txt \
#   NPUS_PER_NODE=8 TP=4 bash examples/qwen_image/grpo_qwen_image.sh [extra trainer args]
#
# Settings (environment variables; anything after the script's name goes to the trainer):
#   PIPELINE_DIR   diffusers Qwen-Image pipeline folder (transformer/, vae/, text_encoder/, tokenizer/, scheduler/)
#   MODEL_JSON DATA_JSON  model.json / data.json (default: this folder's; model_shapes_demo.json for the CPU demo);
#                  PROMPT_FILE / EVAL_PROMPT_FILE fill data.json in
#   LOAD           a converted checkpoint (mm-convert QwenImageConverter hf_to_mm) to start from, or a
#                  training checkpoint to resume; SAVE where to save (default: RUN_DIR/ckpt)
#   TP PP CP       tensor / pipeline / context (Ulysses) parallel sizes (`mm-grpo plan --model qwen-image`)
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   PROMPTS MBS G STEPS ITERS LR SEED  prompts per iteration, micro-batch, generations per prompt, denoising
#                  steps, iterations, learning rate, seed
#   TRUE_CFG NEGATIVE_PROMPT  true CFG scale (QwenImagePipeline's 4; 1: none) and its negative prompt (" ")
#   SAMPLER POLICY_LOSS TIMESTEP_FRACTION CLIP KL_BETA SAME_NOISE EMA_DECAY EMA_DECAY_RAMP  as in
#                  examples/flux/grpo_flux.sh; EVAL_SAMPLES EVAL_SEED: the CPU demo's fixed noises (64, seed 1)
#   LORA_R         LoRA rank on the recommended targets (default 64 on an accelerator; 0: full fine-tuning)
#   RECOMPUTE_METHOD RECOMPUTE_LAYERS  Megatron's full recompute on an accelerator (--recompute-granularity
#                  full --recompute-method uniform|block --recompute-num-layers N; default uniform 1: every
#                  block; block N: the first N blocks of each stage, the others keep their activations)
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
    echo "grpo_qwen_image.sh: set PIPELINE_DIR to a Qwen-Image pipeline folder, or run the tiny CPU demo with MM_GRPO_DEVICE=cpu" >&2; exit 2
  fi
  # The CPU demo (docs/qwen_image.md "The CPU demo"): the tiny shapes Qwen-Image shipped in
  # examples/qwen_image/tiny_shapes (pretrained by build_tiny_shapes.sh on FLUX's demo data), with FLUX's
  # demo settings: DiffusionNFT on ODE rollouts rewarded by full-prompt accuracy plus the objects' F1, on
  # single objects and counts, evaluated on the reporting half of the held-out prompts x 64 fixed noises
  # (seed 1: never used while choosing settings); full fine-tuning, no true CFG (the tiny model never saw
  # an empty caption, so its unconditional velocity means nothing).
  export PIPELINE_DIR="$SCRIPT_DIR/tiny_shapes"
  SHAPES="$REPO/examples/flux/shapes_prompts"  # the shapes grammar's prompt split (mm_grpo/data/shapes.py)
  MODEL_JSON="${MODEL_JSON:-$SCRIPT_DIR/model_shapes_demo.json}"
  DATA_JSON="${DATA_JSON:-$REPO/examples/flux/data_shapes_demo.json}"
  export PROMPT_FILE="${PROMPT_FILE:-$SHAPES/grpo_objects.txt}"
  export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-$SHAPES/eval_objects_report.txt}"
  export EVAL_SAMPLES="${EVAL_SAMPLES:-64}" EVAL_SEED="${EVAL_SEED:-1}"  # data_shapes_demo.json reads them
  NPUS_PER_NODE="${NPUS_PER_NODE:-2}"; ITERS="${ITERS:-110}"; PROMPTS="${PROMPTS:-8}"; MBS="${MBS:-32}"
  SEED="${SEED:-1}"; G="${G:-16}"; LR="${LR:-2e-4}"; LORA_R="${LORA_R:-0}"; TRUE_CFG="${TRUE_CFG:-1}"
  SAMPLER="${SAMPLER:-ode}"; POLICY_LOSS="${POLICY_LOSS:-nft}"; TIMESTEP_FRACTION="${TIMESTEP_FRACTION:-0.25}"
  KL_BETA="${KL_BETA:-0.5}"; EMA_DECAY="${EMA_DECAY-0.5}"; EMA_DECAY_RAMP="${EMA_DECAY_RAMP:-0.01}"
  EVAL_INTERVAL="${EVAL_INTERVAL:-55}"; IMAGE_INTERVAL="${IMAGE_INTERVAL:-$ITERS}"
  SAVE_INTERVAL="${SAVE_INTERVAL:-$ITERS}"; EVAL_PROMPTS="${EVAL_PROMPTS:-$(wc -l < "$EVAL_PROMPT_FILE")}"
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
[ "$DEVICE" = "cpu" ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-granularity full \
  --recompute-method ${RECOMPUTE_METHOD:-uniform} --recompute-num-layers ${RECOMPUTE_LAYERS:-1}"
[ "$LORA_R" = 0 ] || GPT_ARGS="$GPT_ARGS --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --lora-r $LORA_R --lora-alpha $LORA_R"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data.json}"
GRPO_ARGS=(--prompts-per-iteration "$PROMPTS" --num-generations "$G" --num-inference-steps "$STEPS"
  --sampler "${SAMPLER:-flow_sde}" --policy-loss "${POLICY_LOSS:-ppo}" --timestep-fraction "${TIMESTEP_FRACTION:-0.6}"
  --clip-range "${CLIP:-1e-4}" --adv-clip-max 5 --eval-prompts "$EVAL_PROMPTS" --true-cfg-scale "$TRUE_CFG")
[ -n "${NEGATIVE_PROMPT:-}" ] && GRPO_ARGS+=(--negative-prompt "$NEGATIVE_PROMPT")
[ -n "${KL_BETA:-}" ] && GRPO_ARGS+=(--kl-beta "$KL_BETA")
[ "${SAME_NOISE:-0}" = 1 ] && GRPO_ARGS+=(--init-same-noise)
[ -n "${EMA_DECAY:-}" ] && GRPO_ARGS+=(--ema-decay "$EMA_DECAY")
[ -n "${EMA_DECAY_RAMP:-}" ] && GRPO_ARGS+=(--ema-decay-ramp "$EMA_DECAY_RAMP")
OUTPUT_ARGS="--save ${SAVE:-$RUN_DIR/ckpt} --save-interval $SAVE_INTERVAL --log-interval $LOG_INTERVAL \
  --tensorboard-dir $RUN_DIR --eval-interval $EVAL_INTERVAL --save-image-interval $IMAGE_INTERVAL"
[ -n "${LOAD:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[grpo_qwen_image.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE TP=$TP PP=$PP CP=$CP run=$RUN_DIR"
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS \
  -m mm_grpo.training.train_grpo $GPT_ARGS $MM_ARGS "${GRPO_ARGS[@]}" $OUTPUT_ARGS "$@"
