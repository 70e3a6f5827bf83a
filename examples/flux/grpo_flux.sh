#!/usr/bin/env bash
# GRPO fine-tuning of FLUX with mm-grpo (DanceGRPO / Flow-GRPO on Megatron).
#
#   bash examples/flux/grpo_flux.sh                 # no accelerator: the tiny CPU demo, 2 processes
#                                                   # (GRPO of the shipped tiny shapes FLUX, docs/demo.md;
#                                                   # 4.5-9.5 min on 2 cores, by machine; ITERS=20: a look)
#   PIPELINE_DIR=/models/FLUX.1-dev HPS_PATH=/models/HPS_v2.1_compressed.pt \
#   PROMPT_FILE=prompts.txt NPUS_PER_NODE=8 TP=2 bash examples/flux/grpo_flux.sh [extra trainer args]
#
# Settings (environment variables; anything after the script's name goes to the trainer):
#   PIPELINE_DIR   diffusers FLUX pipeline folder (transformer/, vae/, text encoders)
#   MODEL_JSON     model.json (default: model.json, or model_shapes.json for the CPU demo)
#   DATA_JSON      data.json (data_shapes.json for the CPU demo); PROMPT_FILE / EVAL_PROMPT_FILE fill it in
#   LOAD           a converted Megatron checkpoint (mm-convert ... hf_to_mm) to start from,
#                  or a training checkpoint to resume; SAVE where to save (default: RUN_DIR/ckpt);
#                  LOAD=$SAVE with nothing saved yet: a fresh start from PIPELINE_DIR's weights; an earlier
#                  iteration of LOAD (e.g. when the latest is damaged): --ckpt-step N after the script's name
#   HPS_PATH ...   reward weights named in MODEL_JSON
#   TP PP CP       tensor / pipeline / context(Ulysses) parallel sizes
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT   torchrun (multi-node)
#   PROMPTS MBS G STEPS ITERS LR SEED  prompts per iteration (each rolled out G times), micro-batch,
#                                  generations per prompt, denoising steps, iterations, learning rate, seed
#   SAMPLER TIMESTEPS CLIP         dance_sde | flow_sde | cps (| ode with POLICY_LOSS=awm|nft SAME_NOISE=0); random | ordered | window
#                                  (MixGRPO) | branch (Flow-GRPO-Fast: sets SAME_NOISE=1); clip range
#   WINDOW ODE_REUSE               SDE steps of the window / branch; model every k-th ODE step outside it
#   POLICY_LOSS    ppo (PPO-clip on log-probs) | awm (advantage-weighted flow matching) | nft (DiffusionNFT;
#                  with --ema-decay its old policy is an EMA) (docs/grpo_schedule.md section 7)
#   SAME_NOISE=1   the same initial noise for a prompt's G generations (DanceGRPO's init_same_noise)
#   TIMESTEP_FRACTION  share of the denoising steps trained per sample (0.6; CPU demo 0.25)
#   KL_BETA        weight of the KL term to the starting policy (0; CPU demo 0.5)
#   EMA_DECAY EMA_DECAY_RAMP  an EMA of the policy (--ema-decay, --ema-decay-ramp): nft's old policy,
#                  and what evaluation scores (unset: none; CPU demo 0.5 and 0.01, EMA_DECAY= for none)
#   EVAL_INTERVAL  held-out evaluation (before training, every EVAL_INTERVAL iterations, at the end)
#   EVAL_PROMPTS   held-out prompts per evaluation (the CPU demo: all of EVAL_PROMPT_FILE)
#   EVAL_SAMPLES EVAL_SEED  the CPU demo's fixed noises per held-out prompt and their seed (64 and 1:
#                  the reporting half; tuning: EVAL_PROMPT_FILE=.../eval_objects_tuning.txt EVAL_SEED=0)
#   IMAGE_INTERVAL a grid of held-out samples every IMAGE_INTERVAL iterations (RUN_DIR/samples)
#   RECOMPUTE_METHOD RECOMPUTE_LAYERS  Megatron's full recompute on an accelerator (--recompute-granularity
#                  full --recompute-method uniform|block --recompute-num-layers N; default uniform 1: every
#                  block; block N: the first N blocks of each stage, the others keep their activations)
#   SAVE_INTERVAL LOG_INTERVAL     checkpoint and log intervals in iterations
#   EXIT_SIGNAL_HANDLER  1 (default): SIGTERM or Ctrl-C to this script saves the iteration in progress, then
#                  ends the job (--exit-signal-handler; a second signal ends it at once; the script exits 143 /
#                  130); 0: the job ends at once, saving nothing. A wall-clock limit: --exit-duration-in-mins N
#                  after the script's name saves and exits 0 before N minutes
#   RUN_DIR        output folder (train.log, appended on each start; TensorBoard logs, checkpoints,
#                  image grids, reward_curve.png and before_after.png)
#   MM_GRPO_ASCEND Ascend install folder (default /usr/local/Ascend): where it exists, its CANN
#                  cann/set_env.sh (or ascend-toolkit/set_env.sh) is sourced first and torch_npu must
#                  import (shell/launch_env.sh); MM_GRPO_DEVICE=npu|cuda|cpu forces the device
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"

source "$REPO/shell/launch_env.sh"  # PY, DEVICE, accelerator environment
source "$REPO/shell/run_trainer.sh"  # run_trainer: the trainer's exit status and one-line error last

RUN_DIR="${RUN_DIR:-$REPO/runs/grpo_flux_$(date +%Y%m%d_%H%M%S)}"
if [ -z "${PIPELINE_DIR:-}" ]; then
  if [ "$DEVICE" != "cpu" ]; then
    echo "grpo_flux.sh: set PIPELINE_DIR to a FLUX pipeline folder, or run the tiny demo on the CPU with MM_GRPO_DEVICE=cpu" >&2; exit 2
  fi
  # The CPU demo (docs/demo.md): the tiny shapes FLUX shipped in examples/flux/tiny_shapes
  # (pretrained by build_tiny_shapes.sh), DiffusionNFT on ODE rollouts rewarded by full-prompt
  # accuracy plus the objects' F1, on the families the model meets in 20-60% of samples (single
  # objects, counts), evaluated on the reporting half of the other prompts of those families x 64
  # fixed noises (seed 1: never used while choosing the settings; docs/demo.md#evaluation). 8 prompts
  # x G 16 per iteration, a random quarter of the 16 steps trained, the old policy an EMA, a KL
  # anchor; micro-batch 32: the tiny model's calls are mostly overhead (bench/demo_compute.py).
  export PIPELINE_DIR="$SCRIPT_DIR/tiny_shapes"
  MODEL_JSON="${MODEL_JSON:-$SCRIPT_DIR/model_shapes_demo.json}"; DATA_JSON="${DATA_JSON:-$SCRIPT_DIR/data_shapes_demo.json}"
  export PROMPT_FILE="${PROMPT_FILE:-$SCRIPT_DIR/shapes_prompts/grpo_objects.txt}"
  export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-$SCRIPT_DIR/shapes_prompts/eval_objects_report.txt}"
  export EVAL_SAMPLES="${EVAL_SAMPLES:-64}" EVAL_SEED="${EVAL_SEED:-1}"  # data_shapes_demo.json reads them
  NPUS_PER_NODE="${NPUS_PER_NODE:-2}"; ITERS="${ITERS:-110}"; PROMPTS="${PROMPTS:-8}"; MBS="${MBS:-32}"
  SEED="${SEED:-1}"  # the README's figures are seeds 1-3; the default run repeats seed 1 exactly
  G="${G:-16}"; LR="${LR:-2e-4}"; SAMPLER="${SAMPLER:-ode}"; POLICY_LOSS="${POLICY_LOSS:-nft}"; SAME_NOISE="${SAME_NOISE:-0}"
  TIMESTEP_FRACTION="${TIMESTEP_FRACTION:-0.25}"; KL_BETA="${KL_BETA:-0.5}"
  EMA_DECAY="${EMA_DECAY-0.5}"; EMA_DECAY_RAMP="${EMA_DECAY_RAMP:-0.01}"
  EVAL_INTERVAL="${EVAL_INTERVAL:-55}"; IMAGE_INTERVAL="${IMAGE_INTERVAL:-$ITERS}"
  EVAL_PROMPTS="${EVAL_PROMPTS:-$(wc -l < "$EVAL_PROMPT_FILE")}"
fi
export EVAL_PROMPT_FILE="${EVAL_PROMPT_FILE:-}"
: "${PROMPT_FILE:?set PROMPT_FILE to a prompt file (one prompt per line, or .jsonl)}"

NPUS_PER_NODE="${NPUS_PER_NODE:-8}"; NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-6000}"
TP="${TP:-1}"; PP="${PP:-1}"; CP="${CP:-1}"
check_torchrun_sizes
check_layout TP PP CP
G="${G:-12}"; MBS="${MBS:-1}"; PROMPTS="${PROMPTS:-$((NPUS_PER_NODE * NNODES / (TP * PP * CP)))}"  # one per DP rank
STEPS="${STEPS:-16}"; ITERS="${ITERS:-200}"; LR="${LR:-1e-5}"; SEED="${SEED:-1234}"
WINDOW="${WINDOW:-3}"; ODE_REUSE="${ODE_REUSE:-1}"; EVAL_PROMPTS="${EVAL_PROMPTS:-8}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"; LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-20}"; IMAGE_INTERVAL="${IMAGE_INTERVAL:-20}"
check_whole_numbers 1 G MBS PROMPTS STEPS WINDOW ODE_REUSE EVAL_PROMPTS LOG_INTERVAL
check_whole_numbers 0 ITERS SEED SAVE_INTERVAL EVAL_INTERVAL IMAGE_INTERVAL
EXIT_SIGNAL_HANDLER="${EXIT_SIGNAL_HANDLER:-1}"; check_one_of EXIT_SIGNAL_HANDLER 0 1
mkdir -p "$RUN_DIR"

DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
  --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
  --context-parallel-size $CP --context-parallel-algo ulysses_cp_algo \
  --micro-batch-size $MBS --train-iters $ITERS --seed $SEED \
  --lr $LR --weight-decay 1e-4 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0"
[ "$DEVICE" = "cpu" ] || GPT_ARGS="$GPT_ARGS --bf16 --recompute-granularity full \
  --recompute-method ${RECOMPUTE_METHOD:-uniform} --recompute-num-layers ${RECOMPUTE_LAYERS:-1}"
MM_ARGS="--mm-model ${MODEL_JSON:-$SCRIPT_DIR/model.json} --mm-data ${DATA_JSON:-$SCRIPT_DIR/data.json}"
GRPO_ARGS="--prompts-per-iteration $PROMPTS --num-generations $G --num-inference-steps $STEPS --sampler ${SAMPLER:-dance_sde} --policy-loss ${POLICY_LOSS:-ppo} \
  --timestep-selection ${TIMESTEPS:-random} --timestep-fraction ${TIMESTEP_FRACTION:-0.6} --clip-range ${CLIP:-1e-4} \
  --adv-clip-max 5 \
  --window-size $WINDOW --ode-reuse $ODE_REUSE --eval-prompts $EVAL_PROMPTS"
[ "${TIMESTEPS:-random}" = branch ] && SAME_NOISE=1  # a group branches from one shared prefix
[ "${SAME_NOISE:-0}" = 1 ] && GRPO_ARGS="$GRPO_ARGS --init-same-noise"
[ -n "${KL_BETA:-}" ] && GRPO_ARGS="$GRPO_ARGS --kl-beta $KL_BETA"
[ -n "${EMA_DECAY:-}" ] && GRPO_ARGS="$GRPO_ARGS --ema-decay $EMA_DECAY"
[ -n "${EMA_DECAY_RAMP:-}" ] && GRPO_ARGS="$GRPO_ARGS --ema-decay-ramp $EMA_DECAY_RAMP"
OUTPUT_ARGS="--save ${SAVE:-$RUN_DIR/ckpt} --save-interval $SAVE_INTERVAL --log-interval $LOG_INTERVAL \
  --tensorboard-dir $RUN_DIR --eval-interval $EVAL_INTERVAL --save-image-interval $IMAGE_INTERVAL"
[ -n "${LOAD:-}" ] && OUTPUT_ARGS="$OUTPUT_ARGS --load $LOAD"
[ "$EXIT_SIGNAL_HANDLER" = 1 ] && OUTPUT_ARGS="$OUTPUT_ARGS --exit-signal-handler"

echo "[grpo_flux.sh] device=$DEVICE nodes=$NNODES x $NPUS_PER_NODE TP=$TP PP=$PP CP=$CP run=$RUN_DIR"
# shellcheck disable=SC2086
run_trainer "$RUN_DIR/train.log" env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS \
  -m mm_grpo.training.train_grpo $GPT_ARGS $MM_ARGS $GRPO_ARGS $OUTPUT_ARGS "$@"
