#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
# Extra arguments go to pytest (e.g. `bash shell/run_tests.sh -k parity`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/shell/setup_env.sh"
cd "$repo"
exec "${MM_GRPO_VENV:-$repo/.venv}/bin/python" -m pytest tests "$@"
