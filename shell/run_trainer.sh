# Sourced by the launch scripts: `run_trainer LOG COMMAND...` runs torchrun (COMMAND) so that
#   - LOG gets everything, appended (a resume into the same run folder keeps the earlier lines);
#   - the console gets the same minus torchrun's failure report (its ChildFailedError traceback
#     and elastic's shutdown warnings, kept in LOG) and minus the trainer's error lines;
#   - it returns the trainer's exit status (2: bad configuration or file, 3: the run had to stop),
#     not torchrun's 1, after printing the trainer's one-line error last (once on the console).
# The trainers append "status<TAB>line" to $MM_GRPO_ERROR_FILE (mm_grpo/training/entry.py).

# Drops torchrun's report: a Python traceback whose exception line is ChildFailedError, and what
# follows it; any other traceback passes through.
_TORCHRUN_REPORT_FILTER='
  /^Traceback \(most recent call last\):/ && !held { buf = $0; held = 1; next }
  held && /^[ \t]/ { buf = buf "\n" $0; next }
  held && /ChildFailedError/ { held = 0; skip = 1; next }
  held { print buf; held = 0 }
  skip { next }
  /torch\/distributed\/elastic\// { next }
  /^mm-grpo: error: / { next }
  { print; fflush() }
  END { if (held) print buf }'

run_trainer() {
  local log="$1"; shift
  local errors status line
  errors="$(mktemp "${TMPDIR:-/tmp}/mm_grpo_errors.XXXXXX")"
  echo "[run_trainer] $(date -u +%Y-%m-%dT%H:%M:%SZ) $*" >> "$log"
  set +e
  MM_GRPO_ERROR_FILE="$errors" "$@" 2>&1 | tee -a "$log" | awk "$_TORCHRUN_REPORT_FILTER"
  status="${PIPESTATUS[0]}"
  set -e
  if [ "$status" -ne 0 ] && [ -s "$errors" ]; then
    IFS=$'\t' read -r status line < "$errors"
    echo "$line" >&2
  fi
  rm -f "$errors"
  return "$status"
}
