"""The launch scripts around torchrun (shell/run_trainer.sh): the trainer's exit status and its one-line
error last on the console, torchrun's failure report only in the log, the log appended on resume; and
examples/flux/grpo_flux.sh as shipped, training its CPU demo."""
import math
import os
import re
import subprocess
import sys

from tests.ports import free_port
from tests.test_launch_env import REPO


def _pythonpath():
    """This checkout first, then what the environment adds (Megatron-LM's tree in MindSpeed-MM's)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def test_grpo_flux_sh_exits_with_the_trainers_status_and_line(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red café\n".encode("latin-1"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("an earlier run's line\n")
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable, MM_GRPO_DEVICE="cpu",
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(run_dir), NPUS_PER_NODE="1", ITERS="1",
               PROMPT_FILE=str(prompts), MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "examples/flux/grpo_flux.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    line = f"mm-grpo: error: prompt file {prompts} is not UTF-8 text (byte 9: b'\\xe9'); convert it, e.g. iconv -t UTF-8"
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "ChildFailedError" not in proc.stdout + proc.stderr
    log = (run_dir / "train.log").read_text()
    assert log.startswith("an earlier run's line\n[run_trainer] ")
    assert line in log and "ChildFailedError" in log and "exitcode  : 2" in log


def test_grpo_flux_sh_as_shipped_trains_the_cpu_demo(tmp_path):
    """examples/flux/grpo_flux.sh unchanged, as a first run on a machine without an accelerator
    (the tiny shapes demo), only its sizes through its variables: one process, one iteration of one
    prompt's 16 generations (the demo's G), one held-out prompt. It trains, evaluates, saves and draws its figures."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable,
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(run_dir), NPUS_PER_NODE="1", ITERS="1",
               PROMPTS="1", MBS="16", EVAL_PROMPTS="1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    env.pop("MM_GRPO_DEVICE", None)  # the script finds the CPU itself
    proc = subprocess.run(["bash", "examples/flux/grpo_flux.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[grpo_flux.sh] device=cpu nodes=1 x 1" in proc.stdout
    out = proc.stdout + proc.stderr
    rewards = re.search(r"\[mm-grpo\] 1 iterations in .*; mean reward first (\S+) -> last (\S+)", out)
    assert rewards and all(math.isfinite(float(r)) for r in rewards.groups()), proc.stdout[-3000:]
    assert re.search(r"held-out evaluation \(\d+ samples, ODE, fixed noise\), iteration 0 -> 1", out)
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (run_dir / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert all((run_dir / f).is_file() for f in ("train.log", "reward_curve.png", "before_after.png"))
