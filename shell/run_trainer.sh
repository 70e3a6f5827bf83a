# Sourced by the launch scripts that start torchrun.
#   check_whole_numbers MIN VAR...  each VAR a whole number >= MIN, else one line naming it (exit 2)
#   check_torchrun_sizes            NPUS_PER_NODE NNODES NODE_RANK MASTER_PORT, and on the master node
#                                   (NODE_RANK 0) that MASTER_PORT is free, before any process starts
#   check_layout VAR...             the parallel sizes VAR... whole numbers >= 1 whose product divides
#                                   the processes
#   check_one_of VAR VALUE...       VAR is one of the VALUEs
#   run_trainer LOG COMMAND...      runs torchrun (COMMAND) so that
#   - LOG gets everything, appended (a resume into the same run folder keeps the earlier lines);
#   - the console gets the same minus torchrun's failure report (its ChildFailedError traceback
#     and elastic's shutdown warnings, kept in LOG) and minus the trainer's error lines;
#   - it returns the trainer's exit status (2: bad configuration or file, 3: the run had to stop),
#     not torchrun's 1, after printing the trainer's one-line error last (once on the console);
#   - SIGTERM or SIGINT to the script goes to the trainers (torchrun's workers) as SIGTERM, and the
#     script waits for torchrun to end: with --exit-signal-handler they save the iteration in progress
#     and exit 0, without it they end at once; either way it returns 128 + the signal's number (143
#     for SIGTERM): the run did not finish. A second signal kills the job at once. (torchrun itself,
#     when the signal reaches it too, as Ctrl-C's does, kills its workers 30 s after passing it on:
#     torch's --shutdown-timeout / TORCH_ELASTIC_SHUTDOWN_TIMEOUT, where torch has them.)
# The trainers append "status<TAB>line" to $MM_GRPO_ERROR_FILE (mm_grpo/training/entry.py).

# Drops torchrun's report: a Python traceback whose exception line is ChildFailedError or torch
# elastic's SignalException, and what follows it; one whose exception is EADDRINUSE becomes one line
# naming MASTER_PORT (another job took the port after check_torchrun_sizes); any other passes through.
_TORCHRUN_REPORT_FILTER='
  /^Traceback \(most recent call last\):/ && !held { buf = $0; held = 1; next }
  held && /^[ \t]/ { buf = buf "\n" $0; next }
  held && /ChildFailedError|SignalException/ { held = 0; skip = 1; next }
  held && /EADDRINUSE/ { held = 0; skip = 1; print port_line; next }
  held { print buf; held = 0 }
  skip { next }
  /torch\/distributed\/elastic\// { next }
  /^mm-grpo: error: / { next }
  { print; fflush() }
  END { if (held) print buf }'
_LAUNCHER="$(basename "$0")"
_SIGNAL_STATUS=128  # a process ended by signal N exits 128 + N

check_whole_numbers() {
  local minimum="$1" var value; shift
  for var in "$@"; do
    value="${!var:-}"
    if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "$((10#$value))" -lt "$minimum" ]; then
      echo "$_LAUNCHER: $var=$value: must be a whole number >= $minimum" >&2
      exit 2
    fi
  done
}

check_one_of() {
  local var="$1" value; shift
  for value in "$@"; do [ "${!var:-}" = "$value" ] && return 0; done
  echo "$_LAUNCHER: $var=${!var:-}: must be one of: $*" >&2
  exit 2
}

check_torchrun_sizes() {
  check_whole_numbers 1 NPUS_PER_NODE NNODES MASTER_PORT
  check_whole_numbers 0 NODE_RANK
  if [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "$_LAUNCHER: NODE_RANK=$NODE_RANK: must be below NNODES=$NNODES (nodes are numbered from 0)" >&2; exit 2
  fi
  if [ "$MASTER_PORT" -gt 65535 ]; then
    echo "$_LAUNCHER: MASTER_PORT=$MASTER_PORT: must be a port number, 1-65535" >&2; exit 2
  fi
  # The master node's torchrun listens on MASTER_PORT; something answering there already is another job.
  if [ "$NODE_RANK" = 0 ] && (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null; then
    echo "$_LAUNCHER: MASTER_PORT=$MASTER_PORT is in use on this machine (another job's torchrun?): set" \
         "MASTER_PORT to a free port" >&2
    exit 2
  fi
}

check_layout() {
  local var product=1 processes=$((NPUS_PER_NODE * NNODES)) names=()
  check_whole_numbers 1 "$@"
  for var in "$@"; do product=$((product * ${!var})); names+=("$var=${!var}"); done
  if [ $((processes % product)) != 0 ]; then
    echo "$_LAUNCHER: ${names[*]}: their product $product must divide the $processes processes" \
         "(NPUS_PER_NODE x NNODES)" >&2
    exit 2
  fi
}

# The signal trap of run_trainer: the first signal goes to torchrun's workers as SIGTERM (to torchrun
# itself while it has none yet), a second kills them and torchrun.
_stop_trainers() {
  if [ -z "$_stopped_by" ]; then
    _stopped_by="$1"
    echo "[$_LAUNCHER] SIG$1: passed to the trainers as SIGTERM, waiting for them to end (with" \
         "--exit-signal-handler they save the iteration in progress first); another SIGTERM or Ctrl-C ends them now" >&4
    pkill -TERM -P "$_torchrun" || kill -TERM "$_torchrun" 2>/dev/null
  else
    echo "[$_LAUNCHER] SIG$1 again: killing the job" >&4
    pkill -KILL -P "$_torchrun"
    kill -KILL "$_torchrun" 2>/dev/null
    disown "$_torchrun" 2>/dev/null  # no "Killed" notice from bash whenever it reaps it
  fi
}

run_trainer() {
  local log="$1"; shift
  local scratch filter status line
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/mm_grpo_launch.XXXXXX")"
  mkfifo "$scratch/output"
  echo "[run_trainer] $(date -u +%Y-%m-%dT%H:%M:%SZ) $*" >> "$log"
  set +e
  # The log and console writers ignore the stop signals and end with torchrun's output, so that what
  # the trainers print while they save never meets a closed pipe.
  (trap '' TERM INT; tee -a "$log" < "$scratch/output" | awk -v port_line="$_LAUNCHER: MASTER_PORT=${MASTER_PORT:-}:\
 torchrun could not listen on it (EADDRINUSE): set MASTER_PORT to a free port" "$_TORCHRUN_REPORT_FILTER") &
  filter=$!
  MM_GRPO_ERROR_FILE="$scratch/errors" "$@" > "$scratch/output" 2>&1 &
  _torchrun=$! _stopped_by=""
  exec 4>&2  # the trap's lines: the console's stderr, while the loop's own goes nowhere
  trap '_stop_trainers TERM' TERM
  trap '_stop_trainers INT' INT
  while :; do  # a trapped signal interrupts `wait`: wait again until torchrun has ended
    wait "$_torchrun"
    status=$?
    kill -0 "$_torchrun" 2>/dev/null || break
  done 2>/dev/null
  trap - TERM INT
  exec 4>&-
  wait "$filter"
  set -e
  if [ -n "$_stopped_by" ]; then
    status=$((_SIGNAL_STATUS + $(kill -l "$_stopped_by")))
  elif [ "$status" -ne 0 ] && [ -s "$scratch/errors" ]; then
    IFS=$'\t' read -r status line < "$scratch/errors"
    echo "$line" >&2
  fi
  rm -rf "$scratch"
  return "$status"
}
