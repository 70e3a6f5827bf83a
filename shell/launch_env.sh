# Sourced by the launch scripts (examples/flux/*.sh) after they set REPO. In MindSpeed-MM's order:
# CANN's environment first (before anything imports torch), then the Python, the device, and the
# settings MindSpeed-MM's launch scripts export for it.
#   MM_GRPO_ASCEND  the Ascend install folder (default /usr/local/Ascend). Where it exists this is
#                   an Ascend machine: its cann/set_env.sh (older CANN: ascend-toolkit/set_env.sh)
#                   is sourced, and torch_npu must then import; if it does not, the launch stops
#                   with the import error instead of running on the CPU or a GPU.
#                   MM_GRPO_DEVICE=cpu or cuda skips all of this on purpose.
#   PY              MM_GRPO_PYTHON, else the current python3 if it has mm_grpo, else the project's
#                   own environment (.venv, created by shell/setup_env.sh on first use)
#   DEVICE          npu | cuda | cpu (mm_grpo's platform adaptor decides; MM_GRPO_DEVICE forces one)
ASCEND_DIR="${MM_GRPO_ASCEND:-/usr/local/Ascend}"
CANN_ENV=""
case "${MM_GRPO_DEVICE:-}" in cpu|cuda) ;; *)
  if [ -d "$ASCEND_DIR" ]; then
    for candidate in "$ASCEND_DIR/cann/set_env.sh" "$ASCEND_DIR/ascend-toolkit/set_env.sh"; do
      if [ -f "$candidate" ]; then CANN_ENV="$candidate"; break; fi
    done
    if [ -z "$CANN_ENV" ]; then
      echo "launch_env.sh: $ASCEND_DIR has neither cann/set_env.sh nor ascend-toolkit/set_env.sh: install CANN" \
           "there, point MM_GRPO_ASCEND at its folder, or set MM_GRPO_DEVICE=cpu|cuda" >&2
      exit 1
    fi
    # CANN's script reads variables that may be unset: the caller's `set -eu` must not stop it.
    _caller_flags="$-"; set +eu
    source "$CANN_ENV"
    case "$_caller_flags" in *e*) set -e ;; esac
    case "$_caller_flags" in *u*) set -u ;; esac
    unset _caller_flags
  fi ;;
esac

if [ -n "${MM_GRPO_PYTHON:-}" ]; then PY="$MM_GRPO_PYTHON"
# (probed from / : started in the repository, python3 would find mm_grpo in the current folder)
elif (cd / && python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('mm_grpo') and u.find_spec('torch')))") 2>/dev/null; then PY=python3
else bash "$REPO/shell/setup_env.sh"; PY="${MM_GRPO_VENV:-$REPO/.venv}/bin/python"; fi
export MM_GRPO_PYTHON="$PY"
# Paths the user gave are relative to where the script was started: make them absolute
# before leaving for the repository (configs resolve the rest against their own folder).
for var in PIPELINE_DIR DATA_DIR PROMPT_FILE EVAL_PROMPT_FILE MODEL_JSON DATA_JSON LOAD SAVE RUN_DIR HPS_PATH OUT WORK REWARDS; do
  value="${!var:-}"
  if [ -n "$value" ] && [ "${value#/}" = "$value" ]; then printf -v "$var" '%s' "$PWD/$value"; fi
done
cd "$REPO"

if [ -n "$CANN_ENV" ] && ! _npu_error="$("$PY" -c 'import torch_npu' 2>&1)"; then
  echo "launch_env.sh: this is an Ascend machine ($ASCEND_DIR; sourced $CANN_ENV) but torch_npu does not import" \
       "with $PY: $(printf '%s\n' "$_npu_error" | tail -n 1)" >&2
  exit 1
fi
if ! _detected="$(PYTHONWARNINGS=ignore "$PY" -c 'import mm_grpo; print(mm_grpo.get_platform().name)' 2>&1)"; then
  printf 'launch_env.sh: mm_grpo could not choose a device:\n%s\n' "$_detected" >&2
  exit 1
fi
DEVICE="$(printf '%s\n' "$_detected" | tail -n 1)"
unset _npu_error _detected

if [ "$DEVICE" = "npu" ]; then
  # MindSpeed-MM's settings for Ascend (examples/dancegrpo/posttrain_flux_dancegrpo.sh; meanings as in
  # its examples/wan2.1/README.md); a value already in the environment wins.
  export ASCEND_SLOG_PRINT_TO_STDOUT="${ASCEND_SLOG_PRINT_TO_STDOUT:-0}"  # CANN logs not printed to the screen
  export ASCEND_GLOBAL_LOG_LEVEL="${ASCEND_GLOBAL_LOG_LEVEL:-3}"  # CANN log level: 0 debug .. 3 error, 4 none
  export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-2}"  # operator dispatch queue optimisation: 0 off, level 1 or 2
  export COMBINED_ENABLE="${COMBINED_ENABLE:-1}"  # optimise two non-contiguous operators combined
  export CPU_AFFINITY_CONF="${CPU_AFFINITY_CONF:-2}"  # bind operator tasks to CPU cores: 1 coarse, 2 fine-grained
  export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1200}"  # seconds to set up socket links between devices
  export NPU_ASD_ENABLE="${NPU_ASD_ENABLE:-0}"  # torch_npu's feature-value (silent data corruption) check: off
  export ASCEND_LAUNCH_BLOCKING="${ASCEND_LAUNCH_BLOCKING:-0}"  # asynchronous operator execution (1: synchronous)
  export ACLNN_CACHE_LIMIT="${ACLNN_CACHE_LIMIT:-100000}"  # host-side cache entries of single-operator API info
  export MULTI_STREAM_MEMORY_REUSE="${MULTI_STREAM_MEMORY_REUSE:-2}"  # memory reuse across streams (collectives)
  export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"  # expandable memory segments
  export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-800}"  # MB of HCCL buffer per communication domain
fi
# Only there for Megatron's check (MindSpeed-MM: "no effect on the NPU"); one queue on a GPU.
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$DEVICE" = "cpu" ]; then
  # One thread per process: the launchers start one process per core.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # glibc returns freed blocks above 128 kB to the OS and page-faults them in again on the next
  # use (at the bench preset ~160k faults per iteration); keep them (docs/performance.md).
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-33554432}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-4294967296}"
fi
true
