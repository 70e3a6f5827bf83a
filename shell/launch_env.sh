# Sourced by the launch scripts (examples/flux/*.sh) after they set REPO: picks the Python, finds
# the accelerator and sets the environment MindSpeed-MM's launch scripts set for it.
#   PY       MM_GRPO_PYTHON, else the current python3 if it has mm_grpo, else the project's own
#            environment (.venv, created by shell/setup_env.sh on first use)
#   DEVICE   npu | cuda | cpu (mm_grpo's platform adaptor decides; MM_GRPO_DEVICE forces one)
if [ -n "${MM_GRPO_PYTHON:-}" ]; then PY="$MM_GRPO_PYTHON"
elif python3 -c "import mm_grpo" 2>/dev/null; then PY=python3
else bash "$REPO/shell/setup_env.sh"; PY="${MM_GRPO_VENV:-$REPO/.venv}/bin/python"; fi
export MM_GRPO_PYTHON="$PY"
# Paths the user gave are relative to where the script was started: make them absolute
# before leaving for the repository (configs resolve the rest against their own folder).
for var in PIPELINE_DIR DATA_DIR PROMPT_FILE EVAL_PROMPT_FILE MODEL_JSON DATA_JSON LOAD SAVE RUN_DIR HPS_PATH OUT WORK; do
  value="${!var:-}"
  if [ -n "$value" ] && [ "${value#/}" = "$value" ]; then printf -v "$var" '%s' "$PWD/$value"; fi
done
cd "$REPO"
DEVICE="$(PYTHONWARNINGS=ignore "$PY" -c 'import mm_grpo; print(mm_grpo.get_platform().name)' 2>/dev/null | tail -n 1)"

if [ "$DEVICE" = "npu" ]; then  # Ascend settings MindSpeed-MM's scripts use
  export TASK_QUEUE_ENABLE=2 COMBINED_ENABLE=1 CPU_AFFINITY_CONF=1 HCCL_CONNECT_TIMEOUT=1200 HCCL_BUFFSIZE=800
  export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
  source /usr/local/Ascend/ascend-toolkit/set_env.sh 2>/dev/null || true
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$DEVICE" = "cpu" ]; then
  # One thread per process: the launchers start one process per core.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # glibc returns freed blocks above 128 kB to the OS and page-faults them in again on the next
  # use (at the bench preset ~160k faults per iteration); keep them (docs/performance.md).
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-33554432}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
fi
true
