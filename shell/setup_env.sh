#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment on a fresh machine.
#   MM_GRPO_VENV  where to put it (default: <repo>/.venv)
# torch and torchvision are installed together from the registry at the versions
# pinned in constraints.txt (see the note there); everything else follows the same pins.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MM_GRPO_VENV:-$repo/.venv}"
stamp="$venv/.mm_grpo_installed"
want="$(sha256sum "$repo/constraints.txt" "$repo/setup.py" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "[setup_env] installing into $venv (first run: torch+torchvision are ~5 GB, a few minutes)" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$repo/constraints.txt" torch torchvision
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$repo/constraints.txt" -e "$repo[test]"
echo "$want" > "$stamp"
