#!/usr/bin/env bash
# Rebuilds the tiny shapes Qwen-Image pipeline (examples/qwen_image/tiny_shapes/) from scratch on CPU, as
# examples/flux/build_tiny_shapes.sh builds FLUX's from the same data:
#   1. the pretraining dataset: shapes images whose captions are neither GRPO nor evaluation prompts
#   2. the VAE (AutoencoderKLQwenImage, 4 latent channels), trained for reconstruction on those images
#   3. the init pipeline: that VAE, a tokenizer learnt on the grammar, a frozen random Qwen2.5-VL text
#      model, a random transformer
#   4. flow-matching pretraining of the transformer (mm_grpo.training.train_flow, 2 processes)
#   5. export (mm-convert QwenImageConverter mm_to_hf) and assembly of the diffusers pipeline folder
#
#   bash examples/qwen_image/build_tiny_shapes.sh      # OUT=examples/qwen_image/tiny_shapes (replaced)
#
# Settings: OUT, WORK (scratch folder, default runs/build_tiny_shapes_qwen_image), SEED, NUM_IMAGES,
# VAE_STEPS, ITERS (transformer iterations), GBS, LR, WARMUP (lr warm-up iterations), SAVE_INTERVAL
# and EVAL_INTERVAL (held-out accuracy during pretraining). Stage times go to $WORK/times.txt.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$REPO/shell/launch_env.sh"  # PY, DEVICE; OUT / WORK made absolute; cd REPO
source "$REPO/shell/run_trainer.sh"  # run_trainer: the trainer's exit status and one-line error last
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

OUT="${OUT:-$SCRIPT_DIR/tiny_shapes}"; WORK="${WORK:-$REPO/runs/build_tiny_shapes_qwen_image}"
SEED="${SEED:-0}"; NUM_IMAGES="${NUM_IMAGES:-6000}"; VAE_STEPS="${VAE_STEPS:-1500}"
ITERS="${ITERS:-2000}"; GBS="${GBS:-64}"; LR="${LR:-1e-3}"; WARMUP="${WARMUP:-100}"
check_whole_numbers 1 NUM_IMAGES VAE_STEPS ITERS GBS
check_whole_numbers 0 SEED WARMUP
PROMPTS="$REPO/examples/flux/shapes_prompts"  # the shapes grammar's caption split, FLUX's demo's
rm -rf "$WORK"; mkdir -p "$WORK"
START=$SECONDS; LAST=$SECONDS
stage() { echo "$1 $((SECONDS - LAST)) s" | tee -a "$WORK/times.txt"; LAST=$SECONDS; }

"$PY" -m mm_grpo.data.shapes generate --out "$WORK/data" --num-images "$NUM_IMAGES" --seed "$SEED" \
  --exclude "$PROMPTS/grpo.txt" "$PROMPTS/eval.txt"
stage data
"$PY" -m mm_grpo.tools.train_tiny_vae --family qwen-image --latent-channels 4 --latent-noise 0 --data "$WORK/data" \
  --out "$WORK/vae" --steps "$VAE_STEPS" --seed "$SEED"
stage vae
"$PY" -m mm_grpo.families.qwen_image.tiny_shapes init --vae "$WORK/vae" --out "$WORK/init" --seed "$SEED"
stage init
mkdir -p "$WORK/pretrain"
export PIPELINE_DIR="$WORK/init" DATA_DIR="$WORK/data" EVAL_PROMPT_FILE="$PROMPTS/eval.txt"
# shellcheck disable=SC2086
run_trainer "$WORK/pretrain/train.log" "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
  -m mm_grpo.training.train_flow --mm-model "$SCRIPT_DIR/model_flow_shapes.json" \
  --mm-data "$SCRIPT_DIR/data_flow_shapes.json" --micro-batch-size $((GBS / 2)) --global-batch-size "$GBS" \
  --train-iters "$ITERS" --seed "$SEED" --lr "$LR" --lr-warmup-iters "$WARMUP" --lr-decay-style cosine \
  --weight-decay 0 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0 --weighting-scheme logit_normal \
  --flow-shift 3 --true-cfg-scale 1 --save "$WORK/pretrain/ckpt" --save-interval "${SAVE_INTERVAL:-500}" \
  --log-interval 100 --eval-interval "${EVAL_INTERVAL:-500}" --eval-prompts "$(wc -l < "$PROMPTS/eval.txt")" \
  --tensorboard-dir "$WORK/pretrain" --no-progress-bar
stage pretrain
"$PY" -m converters.convert_cli QwenImageConverter mm_to_hf --cfg.source_path "$WORK/pretrain/ckpt" \
  --cfg.target_path "$WORK/transformer" --cfg.dtype fp16
"$PY" -m mm_grpo.families.qwen_image.tiny_shapes finish --init "$WORK/init" --transformer "$WORK/transformer" \
  --out "$WORK/pipeline"
rm -rf "$OUT.old"; [ -d "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$WORK/pipeline" "$OUT"; rm -rf "$OUT.old"
stage export
echo "total $((SECONDS - START)) s" | tee -a "$WORK/times.txt"
du -sh "$OUT"
