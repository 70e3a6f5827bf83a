"""Stand-in of an Ascend install for shell/launch_env.sh (tests/testbed.py, STANDINS): the folder
MM_GRPO_ASCEND names, with CANN's set_env.sh, and a `python` that answers as on an NPU machine.

CANN's real script sets up the toolkit's paths and libraries; this one exports SET_ENV_SOURCED
(which folder's script ran) after reading an unset variable, as CANN's does (launch_env.sh must
source it with `set -u` lifted), and can put a torch_npu that imports and sees no NPU on
PYTHONPATH, as installing torch_npu next to CANN does.
"""
import pathlib

SOURCED = "SET_ENV_SOURCED"  # the variable the stand-in set_env.sh exports


def ascend_install(root, set_env="cann", torch_npu=False) -> pathlib.Path:
    """root/Ascend with `<set_env>/set_env.sh` ("cann", or "ascend-toolkit" as older CANN has it;
    None: no script). With `torch_npu`, sourcing it makes a torch_npu without an NPU importable."""
    ascend = pathlib.Path(root) / "Ascend"
    ascend.mkdir()
    if set_env:
        script = ascend / set_env / "set_env.sh"
        script.parent.mkdir()
        lines = [f"export {SOURCED}={set_env}${{SOME_UNSET_CANN_VARIABLE}}"]
        if torch_npu:
            package = pathlib.Path(root) / "cann_python" / "torch_npu"
            package.mkdir(parents=True)
            (package / "__init__.py").write_text(
                "class npu:\n    @staticmethod\n    def is_available():\n        return False\n")
            lines.append(f"export PYTHONPATH={package.parent}${{PYTHONPATH:+:$PYTHONPATH}}")
        script.write_text("\n".join(lines) + "\n")
    return ascend


def npu_python(root) -> pathlib.Path:
    """A `python` for which torch_npu imports and mm_grpo picks the NPU; any other command fails."""
    script = pathlib.Path(root) / "python"
    script.write_text('#!/bin/bash\ncase "$*" in *get_platform*) echo npu ;; *"import torch_npu"*) exit 0 ;; '
                      '*) exit 3 ;; esac\n')
    script.chmod(0o755)
    return script
