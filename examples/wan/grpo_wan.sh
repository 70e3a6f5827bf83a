#!/usr/bin/env bash
# GRPO of Wan2.1 text-to-video on MindSpeed-MM's own DiT (`"model_id": "wandit"`) inside MindSpeed-MM's
# `pretrain`: mm_grpo.mindspeed_mm.grpo, as examples/flux/mindspeed_mm/grpo_flux.sh runs FLUX (docs/video.md).
#
#   bash examples/wan/grpo_wan.sh           # no PIPELINE_DIR: a tiny CPU run (a few minutes, 2 processes):
#                                           # tiny random Wan pipeline, converted by mm-convert WanConverter,
#                                           # motion prompts scored by the rule-based motion reward plus
#                                           # JPEG compressibility over frames (dense: the advantages are not 0)
#   MINDSPEED_MM=/path/to/MindSpeed-MM PIPELINE_DIR=/models/Wan2.1-T2V-1.3B-Diffusers HPS_PATH=/models/HPS_v2.1.pt \
#   PROMPT_FILE=prompts.txt LOAD_PATH=ckpt/wan_1.3b NPUS_PER_NODE=8 CP=2 bash examples/wan/grpo_wan.sh [entry args]
#
# Settings (environment variables; anything after the script's name goes to the entry):
#   MINDSPEED_MM   the MindSpeed-MM checkout the launch runs from (Megatron-LM's megatron/ inside it, as its
#                  install guide has it); the tiny run: $MINDSPEED_MM_TESTBED/MindSpeed-MM
#   PIPELINE_DIR   diffusers Wan pipeline folder (text_encoder/ + tokenizer/: umT5, vae/: AutoencoderKLWan)
#   LOAD_PATH      the DiT's weights, `mm-convert WanConverter hf_to_mm` of PIPELINE_DIR/transformer (TP 1;
#                  under PP, --cfg.target_parallel_config.pp_layers as pipeline_num_layers); to resume,
#                  LOAD_PATH=$SAVE_PATH
#   MODEL_JSON DATA_JSON  model.json (Wan2.1-T2V-1.3B, 81 frames at 480x832; model_14b.json: Wan2.1-T2V-14B,
#                  PP=4; model_tiny.json for the tiny run) and data.json ($PROMPT_FILE, $EVAL_PROMPT_FILE)
#   HPS_PATH       the image reward model.json averages over 4 frames of each video
#   CP             Ulysses context-parallel size (it must divide the video tokens; wandit runs TP 1 and one
#                  sample per micro-batch: docs/video.md)
#   PP             pipeline-parallel size: model.json's predictor.pipeline_num_layers lists the blocks of
#                  each stage (the tiny run converts LOAD_PATH for it); under PP the launch adds
#                  --use-multiparameter-pipeline-model-parallel (MindSpeed's multi-tensor schedule)
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun
#   PROMPTS G STEPS ITERS LR SEED KL_BETA  prompts per iteration (default: one per data-parallel rank),
#                  generations per prompt, denoising steps, iterations, learning rate, seed, KL weight
#   SAMPLER POLICY_LOSS CLIP   rollout step, objective, clip range (as grpo_flux.sh)
#   CFG            classifier-free guidance scale of the rollout and the trained steps (default 5: DanceGRPO's
#                  Wan recipe, diffusers' WanPipeline and MindSpeed-MM's Wan inference; 1: none, half the DiT
#                  work); the unconditional prompt is MindSpeed-MM's Wan2.1 negative prompt (--negative-prompt)
#   RUN_DIR        output folder (log, TensorBoard, checkpoints; the tiny run's pipeline and prompts)
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C to this script saves the iteration in progress (at a
#                  rollout's end), then ends the job (Megatron's --exit-signal-handler; the script exits 143 /
#                  130); 0: ends it at once
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
RUN_DIR="${RUN_DIR:-$PWD/runs/grpo_wan_$(date +%Y%m%d_%H%M%S)}"

TINY=0
if [ -z "${PIPELINE_DIR:-}" ]; then
  TINY=1
  source "$SCRIPT_DIR/cpu_env.sh"  # MindSpeed-MM's environment on the testbed, torch_npu's stand-ins
fi
MINDSPEED_MM="${MINDSPEED_MM:?set MINDSPEED_MM to your MindSpeed-MM checkout}"
NEEDS_MINDSPEED_MM=1
source "$REPO/shell/launch_env.sh"  # PY, DEVICE; CANN's environment on an Ascend machine
source "$REPO/shell/run_trainer.sh"  # run_trainer: the entry's exit status and one-line error last

if [ "$TINY" = 1 ]; then
  if [ "$DEVICE" != cpu ]; then
    echo "grpo_wan.sh: set PIPELINE_DIR (a Wan pipeline folder) and LOAD_PATH, or MM_GRPO_DEVICE=cpu for the tiny run" >&2
    exit 2
  fi
  NPUS_PER_NODE="${NPUS_PER_NODE:-2}"; G="${G:-4}"; STEPS="${STEPS:-6}"; ITERS="${ITERS:-3}"
  LR="${LR:-1e-3}"; SEED="${SEED:-1}"; EVAL_INTERVAL="${EVAL_INTERVAL:-$ITERS}"; EVAL_PROMPTS="${EVAL_PROMPTS:-4}"
  DIST_BACKEND=gloo
fi
NPUS_PER_NODE="${NPUS_PER_NODE:-8}"; NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
CP="${CP:-1}"; PP="${PP:-1}"
check_torchrun_sizes
check_layout CP PP
DP=$((NPUS_PER_NODE * NNODES / CP / PP))
G="${G:-8}"; STEPS="${STEPS:-16}"; ITERS="${ITERS:-200}"; LR="${LR:-1e-5}"; SEED="${SEED:-1234}"
PROMPTS="${PROMPTS:-$DP}"  # prompts per iteration, one per data-parallel rank (the entry derives --global-batch-size)
EVAL_PROMPTS="${EVAL_PROMPTS:-8}"; MAX_SKIPPED="${MAX_SKIPPED:-10}"; RECOMPUTE_LAYERS="${RECOMPUTE_LAYERS:-30}"
SAVE_INTERVAL="${SAVE_INTERVAL:-50}"; EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
check_whole_numbers 1 G STEPS PROMPTS EVAL_PROMPTS RECOMPUTE_LAYERS
check_whole_numbers 0 ITERS SEED MAX_SKIPPED SAVE_INTERVAL EVAL_INTERVAL
EXIT_SIGNAL_HANDLER="${EXIT_SIGNAL_HANDLER:-1}"; check_one_of EXIT_SIGNAL_HANDLER 0 1
mkdir -p "$RUN_DIR"

if [ "$TINY" = 1 ]; then
  export PIPELINE_DIR="$RUN_DIR/tiny_wan"
  [ -d "$PIPELINE_DIR" ] || "$PY" -m mm_grpo.families.wan.tiny --out "$PIPELINE_DIR" > /dev/null
  LOAD_PATH="${LOAD_PATH:-$RUN_DIR/tiny_wan_mm}"
  MODEL_JSON="${MODEL_JSON:-$SCRIPT_DIR/model_tiny.json}"
  PP_LAYERS=()  # the stages' blocks, model.json's pipeline_num_layers, for the converter's split
  [ "$PP" = 1 ] || PP_LAYERS=(--cfg.target_parallel_config.pp_layers "$("$PY" -c \
    'import json, sys; print(json.load(open(sys.argv[1]))["predictor"]["pipeline_num_layers"])' "$MODEL_JSON" \
    | tr -d ' ')")
  [ -d "$LOAD_PATH" ] || "$PY" -m converters.convert_cli WanConverter hf_to_mm \
    --cfg.source_path "$PIPELINE_DIR/transformer" --cfg.target_path "$LOAD_PATH" --cfg.target_parallel_config.tp_size 1 \
    "${PP_LAYERS[@]}" > "$RUN_DIR/convert.log"
  [ -f "$RUN_DIR/prompts/train.txt" ] || "$PY" -m mm_grpo.data.motion split --out "$RUN_DIR/prompts" --num-prompts 60 > /dev/null
  export PROMPT_FILE="${PROMPT_FILE:-$RUN_DIR/prompts/train.txt}"
  export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE-$RUN_DIR/prompts/held_out.txt}"
fi
export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-}"
: "${PROMPT_FILE:?set PROMPT_FILE to a prompt file (one prompt per line)}"
: "${LOAD_PATH:?set LOAD_PATH to mm-convert WanConverter hf_to_mm output of PIPELINE_DIR/transformer}"

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size 1 --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size 1 --train-iters $ITERS --seed $SEED \
  --lr $LR --min-lr 0 --lr-decay-style constant --lr-warmup-iters 0 --weight-decay 1e-4 \
  --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --clip-grad 1.0 \
  --distributed-backend ${DIST_BACKEND:-nccl} --no-gradient-accumulation-fusion"
[ "$PP" = 1 ] || GPT_ARGS="$GPT_ARGS --use-multiparameter-pipeline-model-parallel"
[ "$DEVICE" = cpu ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-granularity full --recompute-method block \
  --recompute-num-layers $RECOMPUTE_LAYERS --use-fused-rmsnorm"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data.json} \
  --mm-tool ${MM_TOOL:-$MINDSPEED_MM/mindspeed_mm/tools/tools.json}"
GRPO_ARGS="--prompts-per-iteration $PROMPTS --num-generations $G --num-inference-steps $STEPS --sampler ${SAMPLER:-dance_sde} --cfg-scale ${CFG:-5} \
  --policy-loss ${POLICY_LOSS:-ppo} --timestep-fraction ${TIMESTEP_FRACTION:-0.6} --clip-range ${CLIP:-1e-4} \
  --kl-beta ${KL_BETA:-0} --max-skipped-iterations $MAX_SKIPPED --eval-prompts $EVAL_PROMPTS"
OUTPUT_ARGS="--log-interval 1 --save-interval $SAVE_INTERVAL --eval-interval $EVAL_INTERVAL \
  --load $LOAD_PATH --save ${SAVE_PATH:-$RUN_DIR/ckpt} --tensorboard-dir $RUN_DIR/tb --ckpt-format torch"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[grpo_wan.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE CP=$CP PP=$PP DP=$DP run=$RUN_DIR"
cd "$MINDSPEED_MM"  # MindSpeed-MM's launches run from its checkout (its megatron/ and relative paths)
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run \
  $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.grpo $GPT_ARGS $MM_ARGS $GRPO_ARGS $OUTPUT_ARGS "$@"
