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
# A script that runs MindSpeed-MM's code sets NEEDS_MINDSPEED_MM=1 (and MINDSPEED_MM, its checkout) first:
# PY must then import megatron.training and mindspeed_mm there (MindSpeed-MM's environment).
# What is wrong with MM_GRPO_DEVICE, the Python or the device is one line, exit 2.
_LAUNCH_ENV="launch_env.sh"
case "${MM_GRPO_DEVICE:-}" in ""|npu|cuda|cpu) ;; *)
  echo "$_LAUNCH_ENV: MM_GRPO_DEVICE=$MM_GRPO_DEVICE: must be npu, cuda or cpu (unset: detected)" >&2; exit 2 ;;
esac
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

_python="MM_GRPO_PYTHON=${MM_GRPO_PYTHON:-}"  # how the error lines below name the Python
if [ -n "${MM_GRPO_PYTHON:-}" ]; then PY="$MM_GRPO_PYTHON"
# (probed from / : started in the repository, python3 would find mm_grpo in the current folder)
elif (cd / && python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('mm_grpo') and u.find_spec('torch')))") 2>/dev/null; then PY=python3
else bash "$REPO/shell/setup_env.sh"; PY="${MM_GRPO_VENV:-$REPO/.venv}/bin/python"; fi
[ -n "${MM_GRPO_PYTHON:-}" ] || _python="$PY"
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
# mm_grpo picks the device on import; the modules the script needs import after it, as they will run.
# The last line printed: the device, or what failed (python: mm_grpo is not there, device, needs) and
# the exception's first line.
_LAUNCH_PROBE='
import importlib, sys
stage = "python"
try:
    import mm_grpo
    stage, device = "needs", mm_grpo.get_platform().name
    for module in sys.argv[1:]:
        importlib.import_module(module)
except Exception as e:
    if stage == "python" and not isinstance(e, ImportError):
        stage = "device"
    print(stage, f"{type(e).__name__}: {e}".splitlines()[0])
    sys.exit(1)
print(device)'
if ! command -v "$PY" > /dev/null; then
  echo "$_LAUNCH_ENV: $_python: no such program: point MM_GRPO_PYTHON at the Python of an environment with" \
       "mm-grpo and torch (bash shell/setup_env.sh makes .venv), or leave it unset" >&2
  exit 2
fi
_needs=()
[ -z "${NEEDS_MINDSPEED_MM:-}" ] || _needs=(megatron.training mindspeed_mm)
_detected="$(cd "${MINDSPEED_MM:-$REPO}" && PYTHONWARNINGS=ignore "$PY" -c "$_LAUNCH_PROBE" "${_needs[@]}" 2>&1)" \
  && _status=0 || _status=$?
if [ "$_status" != 0 ]; then
  read -r _stage _why <<< "$(printf '%s\n' "$_detected" | tail -n 1)"
  case "$_stage" in python|needs|device) ;; *) _why="$(printf '%s\n' "$_detected" | tail -n 1)" ;; esac
  # where MindSpeed is on the path, importing mm_grpo imports it (and Megatron's training) too
  [ "$_stage" != python ] || [ ${#_needs[@]} = 0 ] || _stage=needs
  case "$_stage" in
    needs) echo "$_LAUNCH_ENV: $(basename "$0") runs MindSpeed-MM's code, which $_python cannot import ($_why):" \
                "use MindSpeed-MM's environment (MM_GRPO_PYTHON=$REPO/.venv-mindspeed-mm/bin/python, made by" \
                "MM_GRPO_ENV=mindspeed-mm bash shell/setup_env.sh)" >&2 ;;
    device) echo "$_LAUNCH_ENV: ${MM_GRPO_DEVICE:+MM_GRPO_DEVICE=$MM_GRPO_DEVICE: }mm_grpo could not use the device" \
                 "with $_python ($_why): install its support there${MM_GRPO_DEVICE:+, or set another MM_GRPO_DEVICE}" >&2 ;;
    *) echo "$_LAUNCH_ENV: $_python cannot start mm-grpo (${_why:-it printed nothing}; exit status $_status):" \
            "point MM_GRPO_PYTHON at the Python of an environment with mm-grpo and torch (bash" \
            "shell/setup_env.sh makes .venv), or leave it unset" >&2 ;;
  esac
  exit 2
fi
DEVICE="$(printf '%s\n' "$_detected" | tail -n 1)"
unset _npu_error _detected _needs _python _stage _why _status

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
