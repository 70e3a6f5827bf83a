#!/usr/bin/env bash
# Builds a tiny Wan2.1 text-to-video pipeline that has learnt moving shapes, from scratch on CPU (the video
# counterpart of examples/flux/build_tiny_shapes.sh; docs/video.md):
#   0. the prompt split of the motion grammar (examples/wan/motion_prompts: pretrain / grpo / eval), checked
#   1. the pretraining dataset: moving-shape videos whose captions are neither GRPO nor evaluation prompts
#   2. Wan's VAE (AutoencoderKLWan), trained for reconstruction on those videos
#   3. the init pipeline: that VAE, a umT5 tokenizer learnt on the grammar, a frozen random umT5, a random DiT;
#      the motion reward's ceiling through the VAE is printed here (what a perfect DiT could reach)
#   4. the features MindSpeed-MM's pretrain_sora.py reads (mm_grpo.tools.write_features --family wan)
#   5. flow-matching pretraining of MindSpeed-MM's own wandit with its pretrain_sora.py on 2 processes
#      (examples/wan/pretrain_wan.sh: gloo, fp32, torch_npu's stand-ins), from its own random initialisation
#   6. export (mm-convert WanConverter mm_to_hf) and assembly of the diffusers pipeline folder
#   7. the held-out motion accuracy: ODE samples of eval.txt's prompts scored by the motion reward
#      (mm_grpo.tools.tiny_motion evaluate: what a GRPO run's held-out evaluation measures before training)
#
#   bash examples/wan/build_tiny_motion.sh            # OUT=examples/wan/tiny_motion (replaced)
#
# It runs in MindSpeed-MM's environment on the testbed (examples/wan/cpu_env.sh). Settings: OUT, WORK (scratch
# folder, default runs/build_tiny_motion), SEED, NUM_VIDEOS, FRAMES and SIZE (4k + 1 frames of SIZE x SIZE),
# VAE_STEPS, VAE_HELD_OUT (videos the VAE does not train on), ITERS (DiT iterations), GBS (videos per iteration),
# LR, WARMUP (lr warm-up iterations), LOG_INTERVAL (iterations per logged loss), EVAL_SAMPLES (noises per
# held-out prompt). Stage times go to $WORK/times.txt, the held-out evaluation to $WORK/eval.json.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/cpu_env.sh"  # MindSpeed-MM's environment on the testbed, torch_npu's stand-ins
source "$REPO/shell/launch_env.sh"  # PY, DEVICE; OUT / WORK made absolute; cd REPO
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

OUT="${OUT:-$SCRIPT_DIR/tiny_motion}"; WORK="${WORK:-$REPO/runs/build_tiny_motion}"
SEED="${SEED:-0}"; NUM_VIDEOS="${NUM_VIDEOS:-6000}"; FRAMES="${FRAMES:-9}"; SIZE="${SIZE:-32}"
VAE_STEPS="${VAE_STEPS:-1200}"; VAE_HELD_OUT="${VAE_HELD_OUT:-256}"
ITERS="${ITERS:-5000}"; GBS="${GBS:-16}"; LR="${LR:-1e-3}"; WARMUP="${WARMUP:-100}"; EVAL_SAMPLES="${EVAL_SAMPLES:-32}"
RANKS=2  # the pretraining's processes, one per core
PROMPTS="$SCRIPT_DIR/motion_prompts"
# Before any work: the video size against Wan's VAE and DiT, the batch against the ranks.
"$PY" -m mm_grpo.tools.tiny_motion check --num-frames "$FRAMES" --image-size "$SIZE" || exit 2
[ $((GBS % RANKS)) = 0 ] && [ "$GBS" -gt 0 ] \
  || { echo "build_tiny_motion.sh: GBS $GBS must be a positive multiple of the $RANKS pretraining processes" >&2
       exit 2; }
rm -rf "$WORK"; mkdir -p "$WORK"
START=$SECONDS; LAST=$SECONDS
stage() { echo "$1 $((SECONDS - LAST)) s" | tee -a "$WORK/times.txt"; LAST=$SECONDS; }

# 0. The prompt split is part of the repository (split seed 0, whatever SEED is): check it.
"$PY" -m mm_grpo.data.motion pretrain-split --out "$WORK/prompts" --seed 0 > /dev/null
for f in pretrain grpo eval; do cmp -s "$WORK/prompts/$f.txt" "$PROMPTS/$f.txt" \
  || { echo "build_tiny_motion.sh: $PROMPTS/$f.txt differs from the seed-0 split" >&2; exit 2; }; done

"$PY" -m mm_grpo.data.motion generate --out "$WORK/data" --num-videos "$NUM_VIDEOS" --num-frames "$FRAMES" \
  --image-size "$SIZE" --seed "$SEED" --exclude "$PROMPTS/grpo.txt" "$PROMPTS/eval.txt"
stage data
"$PY" -m mm_grpo.tools.train_tiny_vae --family wan --data "$WORK/data" --out "$WORK/vae" --steps "$VAE_STEPS" \
  --held-out "$VAE_HELD_OUT" --seed "$SEED"
stage vae
"$PY" -m mm_grpo.tools.tiny_motion init --vae "$WORK/vae" --out "$WORK/init" --seed "$SEED"
"$PY" -m mm_grpo.tools.tiny_motion evaluate --references-only --pipeline "$WORK/init" --prompts "$PROMPTS/eval.txt" \
  --num-frames "$FRAMES" --image-size "$SIZE" --samples "$EVAL_SAMPLES"
stage init
# pretrain_wan.sh runs from WORK: feature_data_motion.json reads ./motion_features, umT5 states of the
# predictor's text_len tokens
TEXT_LEN="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["predictor"]["text_len"])' \
  "$SCRIPT_DIR/pretrain_model_motion.json")"
"$PY" -m mm_grpo.tools.write_features --family wan --pipeline "$WORK/init" --data "$WORK/data" \
  --out "$WORK/motion_features" --max-sequence-length "$TEXT_LEN" --dtype float32 --batch-size 32
stage features
# The DiT's seed is SEED + 1: Megatron refuses 0.
DATA_ROOT="$WORK" RUN_DIR="$WORK/pretrain" NPUS_PER_NODE="$RANKS" ITERS="$ITERS" GBS="$GBS" LR="$LR" \
WARMUP="$WARMUP" SEED=$((SEED + 1)) LOG_INTERVAL="${LOG_INTERVAL:-250}" \
  bash "$SCRIPT_DIR/pretrain_wan.sh"
stage pretrain
"$PY" -m mm_grpo.tools.tiny_motion converter-reference --init "$WORK/init" --out "$WORK/hf_reference"
"$PY" -m converters.convert_cli WanConverter mm_to_hf --cfg.source_path "$WORK/pretrain/ckpt" \
  --cfg.hf_dir "$WORK/hf_reference" --cfg.target_path "$WORK/transformer"
"$PY" -m mm_grpo.tools.tiny_motion finish --init "$WORK/init" --transformer "$WORK/transformer" --out "$WORK/pipeline"
rm -rf "$OUT.old"; [ -d "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$WORK/pipeline" "$OUT"; rm -rf "$OUT.old"
stage export
"$PY" -m mm_grpo.tools.tiny_motion evaluate --pipeline "$OUT" --prompts "$PROMPTS/eval.txt" --num-frames "$FRAMES" \
  --image-size "$SIZE" --samples "$EVAL_SAMPLES" --out "$WORK/eval.json"
stage eval
echo "total $((SECONDS - START)) s" | tee -a "$WORK/times.txt"
du -sh "$OUT"
