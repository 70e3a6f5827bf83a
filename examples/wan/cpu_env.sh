# Sourced by this folder's launch scripts (after they set REPO) for a CPU run on the testbed: MindSpeed-MM's
# environment (.venv-mindspeed-mm, made by shell/setup_env.sh with MM_GRPO_ENV=mindspeed-mm) with the
# MindSpeed-MM, MindSpeed and Megatron-LM trees of $MINDSPEED_MM_TESTBED (default ../shared/mindspeed_mm_testbed
# beside the repository). MindSpeed-MM imports torch_npu in every module, so on a CPU the stand-ins of its test
# environment take its place (tests/standins, tests/testbed.py). Sets MM_GRPO_DEVICE (cpu unless set),
# MINDSPEED_MM (unless set), MM_GRPO_PYTHON and PYTHONPATH.
export MM_GRPO_DEVICE="${MM_GRPO_DEVICE:-cpu}"
TESTBED="${MINDSPEED_MM_TESTBED:-$REPO/../shared/mindspeed_mm_testbed}"
MINDSPEED_MM="${MINDSPEED_MM:-$TESTBED/MindSpeed-MM}"
export MM_GRPO_PYTHON="${MM_GRPO_PYTHON:-$REPO/.venv-mindspeed-mm/bin/python}"
[ -x "$MM_GRPO_PYTHON" ] || MM_GRPO_ENV=mindspeed-mm bash "$REPO/shell/setup_env.sh"
export PYTHONPATH="$REPO/tests/standins:$TESTBED/MindSpeed-MM:$TESTBED/MindSpeed:$TESTBED/Megatron-LM:$REPO${PYTHONPATH:+:$PYTHONPATH}"
