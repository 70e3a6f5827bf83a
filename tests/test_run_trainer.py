"""The launch scripts around torchrun (shell/run_trainer.sh): the trainer's exit status and its one-line
error last on the console, torchrun's failure report only in the log, the log appended on resume."""
import os
import socket
import subprocess
import sys

from tests.test_launch_env import REPO


def _pythonpath():
    """This checkout first, then what the environment adds (Megatron-LM's tree in MindSpeed-MM's)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grpo_flux_sh_exits_with_the_trainers_status_and_line(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red café\n".encode("latin-1"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("an earlier run's line\n")
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable, MM_GRPO_DEVICE="cpu",
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(run_dir), NPUS_PER_NODE="1", ITERS="1",
               PROMPT_FILE=str(prompts), MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "examples/flux/grpo_flux.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    line = f"mm-grpo: error: prompt file {prompts} is not UTF-8 text (byte 9: b'\\xe9'); convert it, e.g. iconv -t UTF-8"
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "ChildFailedError" not in proc.stdout + proc.stderr
    log = (run_dir / "train.log").read_text()
    assert log.startswith("an earlier run's line\n[run_trainer] ")
    assert line in log and "ChildFailedError" in log and "exitcode  : 2" in log
