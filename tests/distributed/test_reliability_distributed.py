"""A flaky cluster under torchrun (2 processes, gloo): a killed launcher takes its workers with it,
a hung rank ends the job within the timeout, a SIGTERM to one rank stops every rank at the same saved
iteration (--exit-signal-handler). Slow by nature (each waits for a kill or a timeout,
~1-2 min): marked `slow`; docs/reliability.md has the measured figures."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mm_grpo.files.lock import LOCK_FILE, is_dead_local_owner
from tests.distributed.conftest import REPO
from tests.grpo_helpers import grpo_argv, write_configs
from tests.test_run_trainer import children, running
from tests.testbed import has_megatron_training, subprocess_env

pytestmark = pytest.mark.slow
TRACKER = "latest_checkpointed_iteration.txt"


def _pythonpath():
    """This checkout first, then what the environment adds (Megatron-LM's tree in MindSpeed-MM's)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def _torchrun(args, log):
    env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS="1", MM_GRPO_DEVICE="cpu", PYTHONWARNINGS="ignore")
    if has_megatron_training():
        env = subprocess_env(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    # Its own session and process group, as a scheduler starts a job.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_killing_the_launcher_group_stops_every_worker(tiny_pipeline_dir, tmp_path):
    model, data = write_configs(tmp_path / "cfg", tiny_pipeline_dir)
    save = tmp_path / "ckpt"
    argv = grpo_argv(model, data, iters=1000, extra=["--save", str(save), "--save-interval", "1"])
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = _torchrun(["-m", "mm_grpo.training.train_grpo", *argv], log)
    workers = []
    try:
        deadline = time.time() + 300
        while not (save / TRACKER).exists():  # training and saving
            assert launcher.poll() is None and time.time() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.5)
        workers = children(launcher.pid)
        assert len(workers) >= 2  # the two ranks (torch 2.7's launcher may hold a helper process too)
        os.killpg(launcher.pid, signal.SIGKILL)  # what a scheduler or the OOM killer does to the job
        launcher.wait()
        time.sleep(3)
        assert [w for w in workers if running(w)] == []
        tracker = (save / TRACKER).read_text()
        time.sleep(10)  # an orphan would save an iteration every ~2 s
        assert (save / TRACKER).read_text() == tracker
        holder = (save / LOCK_FILE).read_text().strip()  # left by the killed job: a requeued one takes it over
        assert is_dead_local_owner(holder), holder
    finally:
        for pid in workers:  # the workers this test started, should they have survived
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP) with a collective timeout of half a minute: rank 0's data-parallel reduction
    (a megatron-core group) times out after 30 s, says so in one line, and the job ends."""
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        launcher = _torchrun(["-m", "tests.distributed.hang_worker", "0.5"], log)
    try:
        rc = launcher.wait(timeout=600)  # start-up included: slow on a loaded machine
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        pytest.fail("the job still ran 10 minutes after its start")
    ended = time.time()
    text = log_path.read_text()
    stopped = float(re.search(r"rank 1 stops at ([\d.]+)", text)[1])
    assert rc != 0 and ended - stopped < 120, (rc, ended - stopped)  # torchrun SIGKILLs the stopped rank 30 s on
    lines = [line for line in text.splitlines() if line.startswith("mm-grpo: error:")]
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith("mm-grpo: error: rank 0: collective all_reduce timed out in dp_reduce "
                               "(mm_grpo/parallel/state.py:"), lines[0]
    assert "Timed out waiting 30000ms" in lines[0]


def _rank_of(pid):
    with open(f"/proc/{pid}/environ") as f:
        return int(next(v[len("RANK="):] for v in f.read().split("\0") if v.startswith("RANK=")))


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_iteration_saved(tiny_pipeline_dir, tmp_path):
    """--exit-signal-handler with the signal on rank 1 only (a node that is preempted first): after the
    iteration in progress every rank learns of it, all save that iteration, and the job exits 0."""
    model, data = write_configs(tmp_path / "cfg", tiny_pipeline_dir)
    save, log_path = tmp_path / "ckpt", tmp_path / "torchrun.log"
    argv = grpo_argv(model, data, iters=1000, extra=["--save", str(save), "--exit-signal-handler",
                                                     "--log-interval", "1"])
    with open(log_path, "w") as log:
        launcher = _torchrun(["-m", "mm_grpo.training.train_grpo", *argv], log)
    workers = []
    try:
        deadline = time.time() + 300
        while not re.search(r"^iteration +1 \|", log_path.read_text(), re.M):
            assert launcher.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        workers = children(launcher.pid)
        rank1, = [w for w in workers if _rank_of(w) == 1]
        os.kill(rank1, signal.SIGTERM)
        rc = launcher.wait(timeout=120)
    finally:
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert rc == 0 and not any(running(w) for w in workers), text[-3000:]
    done = int(re.findall(r"^iteration +(\d+) \|", text, re.M)[-1])
    assert text.count(f"mm-grpo: SIGTERM received (--exit-signal-handler): stopped after iteration {done} of 1000, "
                      f"saved in {save}; resume with --load {save}") == 1, text[-3000:]
    assert sorted(os.listdir(save)) == [f"iter_{done:07d}", TRACKER] and (save / TRACKER).read_text() == str(done)
