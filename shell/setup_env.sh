#!/usr/bin/env bash
# Creates (or refreshes) one of the project's two virtual environments; run again with the same
# pins it does nothing.
#   MM_GRPO_ENV   default       today's: torch 2.14, the megatron-core wheel (constraints.txt)
#                 mindspeed-mm  MindSpeed-MM's: its pins (constraints-mindspeed-mm.txt), its own
#                               dependency list, and no megatron wheel: Megatron-LM core_v0.12.1's
#                               tree goes on PYTHONPATH when the tests run (shell/run_tests.sh)
#   MM_GRPO_VENV  where to put it (default: <repo>/.venv, or <repo>/.venv-mindspeed-mm)
#   MINDSPEED_MM_TESTBED  the MindSpeed-MM checkout whose pyproject.toml lists its dependencies
#                 (default: <repo>/../shared/mindspeed_mm_testbed, as tests/testbed.py)
# torch and torchvision are installed together from the registry at the pinned versions
# (see the note in constraints.txt); everything else follows the same pins.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${MM_GRPO_ENV:-default}" in
  default)
    venv="${MM_GRPO_VENV:-$repo/.venv}"
    pins="$repo/constraints.txt"
    extras="test,megatron,serve" ;;
  mindspeed-mm)
    venv="${MM_GRPO_VENV:-$repo/.venv-mindspeed-mm}"
    pins="$repo/constraints-mindspeed-mm.txt"
    extras="test,serve"
    pyproject="${MINDSPEED_MM_TESTBED:-$repo/../shared/mindspeed_mm_testbed}/MindSpeed-MM/pyproject.toml"
    if [ ! -f "$pyproject" ]; then
      echo "[setup_env] $pyproject not found: set MINDSPEED_MM_TESTBED to a folder with MindSpeed-MM/" >&2
      exit 1
    fi ;;
  *)
    echo "[setup_env] unknown MM_GRPO_ENV '${MM_GRPO_ENV}': use default or mindspeed-mm" >&2
    exit 2 ;;
esac

stamp="$venv/.mm_grpo_installed"
want="$( (sha256sum "$pins" "$repo/setup.py" ${pyproject:+"$pyproject"}; echo "$extras") | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "[setup_env] installing into $venv (first run: torch+torchvision are ~5 GB, a few minutes)" >&2
# MindSpeed-MM's own dependencies, as its pyproject.toml lists them (pinned where the pin file says).
mindspeed_mm_deps=()
if [ -n "${pyproject:-}" ]; then
  deps="$("$venv/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' "$pyproject")"
  mapfile -t mindspeed_mm_deps <<< "$deps"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins")
"${pip[@]}" torch torchvision
"${pip[@]}" "${mindspeed_mm_deps[@]}" -e "$repo[$extras]"
echo "$want" > "$stamp"
