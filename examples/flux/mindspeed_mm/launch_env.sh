# Sourced by this folder's launch scripts: MindSpeed-MM's launch environment, as its own scripts set it.
# CANN first (older installs: the ascend-toolkit path); MM_GRPO_ASCEND is the Ascend folder, as in
# shell/launch_env.sh. Then the settings MindSpeed-MM exports for Ascend, and torchrun's sizes:
#   NPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT (checked, each in one line; WORLD_SIZE and
#   torchrun's DISTRIBUTED_ARGS follow), DIST_BACKEND; and shell/run_trainer.sh (its checks, run_trainer).
ASCEND_DIR=${MM_GRPO_ASCEND:-/usr/local/Ascend}
if [ -f "$ASCEND_DIR/cann/set_env.sh" ]; then source "$ASCEND_DIR/cann/set_env.sh"
else source "$ASCEND_DIR/ascend-toolkit/set_env.sh"; fi
set -euo pipefail  # after CANN's script, which reads unset variables; pipefail: torchrun's status, not tee's
export CUDA_DEVICE_MAX_CONNECTIONS=1
export ASCEND_SLOG_PRINT_TO_STDOUT=0
export ASCEND_GLOBAL_LOG_LEVEL=3
export TASK_QUEUE_ENABLE=2
export COMBINED_ENABLE=1
export CPU_AFFINITY_CONF=1
export HCCL_CONNECT_TIMEOUT=1200
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
source "$(dirname "${BASH_SOURCE[0]}")/../../../shell/run_trainer.sh"
check_torchrun_sizes
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))
DIST_BACKEND=${DIST_BACKEND:-nccl}  # as MindSpeed-MM's scripts pass it: HCCL on Ascend; gloo on a CPU
DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"
