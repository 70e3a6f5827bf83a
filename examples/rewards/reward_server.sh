#!/usr/bin/env bash
# A reward server (mm_grpo/tools/reward_server.py): scores images over HTTP for trainers on other
# machines, e.g. HPS on a GPU box beside an NPU cluster (docs/rewards.md#reward-servers).
#
#   bash examples/rewards/reward_server.sh                    # the rule-based shapes rewards, port 8000
#   REWARDS=examples/rewards/rewards_hps.json HPS_PATH=/models/HPS_v2.1_compressed.pt \
#   MM_GRPO_DEVICE=cuda PORT=8000 bash examples/rewards/reward_server.sh
#
# Then name it in the trainer's model.json: "reward": [{"name": "remote", "url": "http://<host>:8000"}].
# Settings (environment variables; anything after the script's name goes to the server):
#   REWARDS        JSON list of reward configs, or a model.json whose `reward` block is served
#                  (default: rewards_shapes.json, the compositional rewards of the CPU demo)
#   HPS_PATH ...   reward weights named in REWARDS
#   HOST PORT      where to listen (default 0.0.0.0:8000: every interface; PORT=0: a free port, named at start)
#   MAX_BATCH      images scored together (default 64); MAX_QUEUE requests waiting (default 256)
#   MAX_REQUEST_MB largest request body (default 64)
#   MM_GRPO_DEVICE npu | cuda | cpu: the reward models' device (default: what mm_grpo detects)
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
REWARDS="${REWARDS:-$SCRIPT_DIR/rewards_shapes.json}"

source "$REPO/shell/launch_env.sh"  # PY, DEVICE, accelerator environment; relative paths made absolute

exec "$PY" -m mm_grpo.tools.reward_server --rewards "$REWARDS" --device "$DEVICE" \
  --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" --max-batch "${MAX_BATCH:-64}" --max-queue "${MAX_QUEUE:-256}" \
  --max-request-mb "${MAX_REQUEST_MB:-64}" "$@"
