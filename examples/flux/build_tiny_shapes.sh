#!/usr/bin/env bash
# Rebuilds the tiny shapes FLUX pipeline (examples/flux/tiny_shapes/) from scratch on CPU:
#   1. the pretraining dataset: shapes images whose captions are neither GRPO nor evaluation prompts
#   2. the VAE, trained for reconstruction on those images
#   3. the init pipeline: that VAE, tokenizers learnt on the grammar, frozen random text encoders,
#      a random transformer
#   4. flow-matching pretraining of the transformer (examples/flux/pretrain_flux.sh, 2 processes)
#   5. export (mm-convert FluxConverter mm_to_hf) and assembly of the diffusers pipeline folder
#
#   bash examples/flux/build_tiny_shapes.sh            # OUT=examples/flux/tiny_shapes (replaced)
#
# Settings: OUT, WORK (scratch folder, default runs/build_tiny_shapes), SEED, NUM_IMAGES,
# VAE_STEPS, ITERS (transformer iterations), GBS, LR, WARMUP (lr warm-up iterations), SAVE_INTERVAL
# and EVAL_INTERVAL (held-out accuracy during pretraining). Stage times go to $WORK/times.txt.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$REPO/shell/launch_env.sh"  # PY, DEVICE; OUT / WORK made absolute; cd REPO
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

OUT="${OUT:-$SCRIPT_DIR/tiny_shapes}"; WORK="${WORK:-$REPO/runs/build_tiny_shapes}"
SEED="${SEED:-0}"; NUM_IMAGES="${NUM_IMAGES:-6000}"; VAE_STEPS="${VAE_STEPS:-2000}"
ITERS="${ITERS:-2000}"; GBS="${GBS:-64}"; LR="${LR:-1e-3}"; WARMUP="${WARMUP:-100}"
PROMPTS="$SCRIPT_DIR/shapes_prompts"
rm -rf "$WORK"; mkdir -p "$WORK"
START=$SECONDS; LAST=$SECONDS
stage() { echo "$1 $((SECONDS - LAST)) s" | tee -a "$WORK/times.txt"; LAST=$SECONDS; }

# 0. The caption split is part of the repository (split seed 0, whatever SEED is): check it.
"$PY" -m mm_grpo.data.shapes split --out "$WORK/prompts" --seed 0 > /dev/null
for f in pretrain grpo eval; do cmp -s "$WORK/prompts/$f.txt" "$PROMPTS/$f.txt" \
  || { echo "build_tiny_shapes.sh: $PROMPTS/$f.txt differs from the seed-0 split" >&2; exit 2; }; done

"$PY" -m mm_grpo.data.shapes generate --out "$WORK/data" --num-images "$NUM_IMAGES" --seed "$SEED" \
  --exclude "$PROMPTS/grpo.txt" "$PROMPTS/eval.txt"
stage data
"$PY" -m mm_grpo.tools.train_tiny_vae --data "$WORK/data" --out "$WORK/vae" --steps "$VAE_STEPS" --seed "$SEED"
stage vae
"$PY" -m mm_grpo.families.flux.tiny_shapes init --vae "$WORK/vae" --out "$WORK/init" --seed "$SEED"
stage init
PIPELINE_DIR="$WORK/init" DATA_DIR="$WORK/data" RUN_DIR="$WORK/pretrain" \
MODEL_JSON="$SCRIPT_DIR/model_flow_shapes.json" DATA_JSON="$SCRIPT_DIR/data_flow_shapes.json" \
NPUS_PER_NODE=2 ITERS="$ITERS" GBS="$GBS" MBS=$((GBS / 2)) LR="$LR" WARMUP="$WARMUP" DECAY=cosine WD=0 SHIFT=3 \
SEED="$SEED" SAVE_INTERVAL="${SAVE_INTERVAL:-500}" EVAL_INTERVAL="${EVAL_INTERVAL:-500}" LOG_INTERVAL=100 \
  bash "$SCRIPT_DIR/pretrain_flux.sh" --no-progress-bar --eval-prompts "$(wc -l < "$PROMPTS/eval.txt")"
stage pretrain
"$PY" -m converters.convert_cli FluxConverter mm_to_hf --cfg.source_path "$WORK/pretrain/ckpt" \
  --cfg.target_path "$WORK/transformer" --cfg.dtype fp16
"$PY" -m mm_grpo.families.flux.tiny_shapes finish --init "$WORK/init" --transformer "$WORK/transformer" \
  --out "$WORK/pipeline"
rm -rf "$OUT.old"; [ -d "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$WORK/pipeline" "$OUT"; rm -rf "$OUT.old"
stage export
echo "total $((SECONDS - START)) s" | tee -a "$WORK/times.txt"
du -sh "$OUT"
