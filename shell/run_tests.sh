#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite in it.
#   MM_GRPO_ENV   default (today's, the megatron-core wheel) or mindspeed-mm (MindSpeed-MM's,
#                 with Megatron-LM's tree on PYTHONPATH); see shell/setup_env.sh. Unset: both.
#   MEGATRON_LM   for mindspeed-mm: the Megatron-LM checkout whose `megatron/` is used
#                 (default: $MINDSPEED_MM_TESTBED/Megatron-LM, the testbed's core_v0.12.1)
# Extra arguments go to pytest (e.g. `bash shell/run_tests.sh -k parity`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# No MM_GRPO_ENV: both environments, one after the other; fails if either fails (what CI runs).
if [ -z "${MM_GRPO_ENV:-}" ]; then
  failed=()
  for env in default mindspeed-mm; do
    echo "[run_tests] MM_GRPO_ENV=$env" >&2
    MM_GRPO_ENV=$env bash "$repo/shell/run_tests.sh" "$@" || failed+=("$env")
  done
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
exec "$venv/bin/python" -m pytest tests "$@"
