"""The launch scripts around torchrun (shell/run_trainer.sh): the trainer's exit status and its one-line
error last on the console, torchrun's failure report only in the log, the log appended on resume;
SIGTERM / SIGINT to the script passed to the trainers, the script waiting for them (a second signal
kills the job); and examples/flux/grpo_flux.sh as shipped, training its CPU demo and stopped by SIGTERM."""
import math
import os
import re
import signal
import subprocess
import sys
import time

from tests.ports import free_port
from tests.test_launch_env import REPO


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def running(pid):
    """Alive and not a zombie (a dead child nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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


# --- stopping a job: SIGTERM / SIGINT to the launch script ---------------------------------------------
# A stand-in for torchrun: two workers that announce themselves, and on SIGTERM take STOP_S to "save"
# before they exit 0 (or, with IGNORE=1, note it and go on for ever).
FAKE_TORCHRUN = """
for rank in 0 1; do
  bash -c 'if [ "$IGNORE" = 1 ]; then trap "echo $0 got TERM >> $MARKS" TERM
           else trap "echo $0 got TERM >> $MARKS; sleep $STOP_S; exit 0" TERM; fi
           echo $0 up >> $MARKS; while :; do sleep 0.05; done' "rank$rank" &
done
wait
"""
STOP_S = 1.0  # the workers' save: the script must wait for it
WAIT_S = 30  # generous bounds for a loaded machine


def _launch_fake_job(tmp_path, ignore_term):
    marks = tmp_path / "marks"
    script = 'source shell/run_trainer.sh; run_trainer "$LOG" bash -c "$FAKE"'
    env = dict(os.environ, LOG=str(tmp_path / "log"), FAKE=FAKE_TORCHRUN, MARKS=str(marks), STOP_S=str(STOP_S),
               IGNORE="1" if ignore_term else "0")
    # SIGINT at its default, as at a terminal: a shell started with it ignored (pytest run in the
    # background of a script, as shell/run_tests.sh runs MindSpeed-MM's suite) cannot trap it.
    proc = subprocess.Popen(["bash", "-c", script, "job.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + WAIT_S
    while not (marks.exists() and marks.read_text().count(" up") == 2):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc, marks


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _job_pids(script_pid):
    """The stand-in torchrun and its workers: the script's child that runs another command (the log
    filter beside it is a subshell, which keeps the script's command line) and that child's children."""
    for child in children(script_pid):
        if _cmdline(child) != _cmdline(script_pid):
            return [child, *children(child)]
    return []


def _all_end(pids, within=WAIT_S):
    """Whether every process of `pids` has ended (killed ones are reaped by init) within `within` s."""
    deadline = time.time() + within
    while any(running(p) for p in pids):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigterm_to_the_script_goes_to_the_workers_and_the_script_waits_for_them(tmp_path):
    proc, marks = _launch_fake_job(tmp_path, ignore_term=False)
    job = _job_pids(proc.pid)
    assert len(job) == 3 and b"rank$rank" in _cmdline(job[0])  # the stand-in torchrun, then its workers
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM  # 143: the run did not finish
    assert time.time() - signalled >= STOP_S  # it waited for the workers' save
    assert sorted(marks.read_text().split("\n")[2:4]) == ["rank0 got TERM", "rank1 got TERM"]
    assert err.splitlines() == ["[job.sh] SIGTERM: passed to the trainers as SIGTERM, waiting for them to end (with "
                                "--exit-signal-handler they save the iteration in progress first); another SIGTERM "
                                "or Ctrl-C ends them now"]
    assert _all_end(job)


def test_a_second_signal_kills_the_job_at_once(tmp_path):
    proc, marks = _launch_fake_job(tmp_path, ignore_term=True)  # workers that would never stop
    job = _job_pids(proc.pid)
    assert len(job) == 3 and b"rank$rank" in _cmdline(job[0])  # the stand-in torchrun, then its workers
    proc.send_signal(signal.SIGTERM)
    # The second signal once the first has reached the workers: sent together, bash would run the
    # traps in signal-number order (SIGINT's first), as on a loaded machine where the script waits.
    deadline = time.time() + WAIT_S
    while marks.read_text().count("got TERM") < 2:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err  # the first signal's status
    assert err.splitlines()[-1] == "[job.sh] SIGINT again: killing the job", err
    assert _all_end(job, within=5), [p for p in job if running(p)]  # killed, not waited for


def test_a_port_taken_after_the_check_is_one_line_naming_master_port(tmp_path):
    """torchrun's 40-line traceback when its store cannot listen (another job took MASTER_PORT between the
    script's check and torchrun's start) is kept in the log; the console gets one line naming the variable."""
    traceback = "\n".join([
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py", '
        "line 67, in next_rendezvous",
        "    self._store = TCPStore(  # type: ignore[call-arg]",
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: 6000, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"])
    script = ('source shell/run_trainer.sh; MASTER_PORT=6000; '
              'run_trainer "$LOG" bash -c "printf \'%s\\n\' \\"$TB\\"; exit 1"')
    proc = subprocess.run(["bash", "-c", script, "grpo_flux.sh"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, LOG=str(tmp_path / "log"), TB=traceback), timeout=WAIT_S)
    assert proc.returncode == 1 and proc.stderr == ""
    assert proc.stdout.splitlines() == ["grpo_flux.sh: MASTER_PORT=6000: torchrun could not listen on it (EADDRINUSE): "
                                        "set MASTER_PORT to a free port"]
    assert traceback in (tmp_path / "log").read_text()


def test_sigterm_to_grpo_flux_sh_saves_the_iteration_in_progress_and_ends_every_process(tmp_path):
    """A scheduler's SIGTERM to the shipped script (2 processes, the CPU demo shrunk, training for ever,
    no interval saves): the trainers finish the iteration in progress, save it, and every process of
    the job ends; the script exits 143 and the run folder holds that iteration, unlocked."""
    run_dir, log = tmp_path / "run", tmp_path / "run" / "train.log"
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable, MM_GRPO_DEVICE="cpu",
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(run_dir), NPUS_PER_NODE="2",
               PROMPTS="2", G="4", MBS="4", STEPS="5", ITERS="1000", SAVE_INTERVAL="0", EVAL_INTERVAL="0",
               IMAGE_INTERVAL="0", LOG_INTERVAL="1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    script = subprocess.Popen(["bash", "examples/flux/grpo_flux.sh", "--no-progress-bar"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = []
    try:
        deadline = time.time() + 300
        while not (log.exists() and re.search(r"^iteration +1 \|", log.read_text(), re.M)):
            assert script.poll() is None and time.time() < deadline, log.read_text()[-3000:] if log.exists() else ""
            time.sleep(0.2)
        job = _job_pids(script.pid)  # torchrun and its two workers
        launcher = _cmdline(job[0]) if job else b""
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=120)
    finally:
        for pid in job:  # should the test fail: the processes it started
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if script.poll() is None:
            script.kill()
    assert script.returncode == 128 + signal.SIGTERM, out[-3000:] + err[-3000:]
    assert len(job) == 3 and b"torch" in launcher and _all_end(job), launcher
    done = int(re.findall(r"^iteration +(\d+) \|", out, re.M)[-1])  # the last iteration logged
    save = run_dir / "ckpt"
    line = (f"mm-grpo: SIGTERM received (--exit-signal-handler): stopped after iteration {done} of 1000, saved in "
            f"{save}; resume with --load {save}")
    assert out.count(line) == 1 and log.read_text().count(line) == 1, out[-3000:]
    assert sorted(os.listdir(save)) == [f"iter_{done:07d}", "latest_checkpointed_iteration.txt"]  # unlocked
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(done)
