#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite in it.
#   MM_GRPO_ENV   default (today's, the megatron-core wheel) or mindspeed-mm (MindSpeed-MM's,
#                 with Megatron-LM's tree on PYTHONPATH); see shell/setup_env.sh. Unset: both, side
#                 by side; MindSpeed-MM's runs only the tests that can differ there (tests/conftest.py)
#   MEGATRON_LM   for mindspeed-mm: the Megatron-LM checkout whose `megatron/` is used
#                 (default: $MINDSPEED_MM_TESTBED/Megatron-LM, the testbed's core_v0.12.1)
# Extra arguments go to pytest (e.g. `bash shell/run_tests.sh -k parity`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# No MM_GRPO_ENV: both environments (what CI runs), set up one after the other, then tested side by
# side: a suite alone keeps the two cores about 60% busy (imports, launches, a wait for a collective
# timeout), so together they finish before one after the other (docs/running.md#tests). The default
# environment's output streams; MindSpeed-MM's follows when both are done. Fails if either fails.
if [ -z "${MM_GRPO_ENV:-}" ]; then
  for env in default mindspeed-mm; do
    MM_GRPO_ENV=$env bash "$repo/shell/setup_env.sh"
  done
  started=$SECONDS
  # One OpenMP thread a suite: two suites of two threads each on two cores would spin-wait on each
  # other at every parallel region (docs/performance.md).
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  ms_log="$(mktemp)"
  echo "[run_tests] MM_GRPO_ENV=mindspeed-mm in the background (its output follows the default environment's)" >&2
  # Its own process group, so that an interrupted run stops it with every process it started.
  MM_GRPO_ENV=mindspeed-mm setsid -w bash "$repo/shell/run_tests.sh" "$@" > "$ms_log" 2>&1 &
  ms_pid=$!
  trap 'kill -- -"$ms_pid" 2>/dev/null || true; rm -f "$ms_log"' EXIT
  trap 'exit 130' INT TERM
  failed=()
  echo "[run_tests] MM_GRPO_ENV=default" >&2
  MM_GRPO_ENV=default bash "$repo/shell/run_tests.sh" "$@" || failed+=(default)
  ms_status=0
  wait "$ms_pid" || ms_status=$?
  # 5: pytest selected nothing there, as when a -k selection holds only env_independent tests.
  [ "$ms_status" -eq 0 ] || [ "$ms_status" -eq 5 ] || failed+=(mindspeed-mm)
  echo "[run_tests] MM_GRPO_ENV=mindspeed-mm" >&2
  cat "$ms_log"
  echo "[run_tests] both suites side by side: $((SECONDS - started)) s wall" >&2
  if [ ${#failed[@]} -gt 0 ]; then
    echo "[run_tests] tests failed in: ${failed[*]}" >&2
    exit 1
  fi
  exit 0
fi
bash "$repo/shell/setup_env.sh"
cd "$repo"
if [ "${MM_GRPO_ENV:-default}" = mindspeed-mm ]; then
  venv="${MM_GRPO_VENV:-$repo/.venv-mindspeed-mm}"
  megatron_lm="${MEGATRON_LM:-${MINDSPEED_MM_TESTBED:-$repo/../shared/mindspeed_mm_testbed}/Megatron-LM}"
  if [ ! -d "$megatron_lm/megatron/core" ]; then
    echo "[run_tests] $megatron_lm/megatron/core not found: set MEGATRON_LM to a Megatron-LM checkout" >&2
    exit 1
  fi
  export PYTHONPATH="$(cd "$megatron_lm" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
else
  venv="${MM_GRPO_VENV:-$repo/.venv}"
fi
# Wall and CPU time of the suite, the processes it starts included (docs/running.md#tests).
TIMEFORMAT="[run_tests] MM_GRPO_ENV=${MM_GRPO_ENV:-default}: %0R s wall, %0U s user + %0S s sys CPU"
time "$venv/bin/python" -m pytest tests "$@"
