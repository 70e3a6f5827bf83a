import json
import os
import signal
import subprocess
import sys

import pytest

from tests.env_split import record_check_read
from tests.testbed import has_megatron_training, subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_TIMEOUT_S = 900


def launch(nproc, tmp_dir, extra_env, module="tests.distributed.worker", args=()):
    """torchrun --nproc_per_node nproc -m module OUT.json *args -> the results it wrote to OUT.json."""
    out = os.path.join(tmp_dir, f"results_{nproc}.json")
    log = os.path.join(tmp_dir, f"torchrun_{nproc}.log")
    # --standalone: the rendezvous store binds a free port itself and the workers use it; a port
    # picked beforehand can be taken by another process before torchrun binds it (EADDRINUSE).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, out, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MM_GRPO_DEVICE="cpu", PYTHONWARNINGS="ignore", **extra_env)
    if has_megatron_training():  # MindSpeed-MM's environment: the testbed in every worker
        env = subprocess_env(env)
    with open(log, "w") as f:
        # A session of its own, so that a launch that times out is stopped with all its workers.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    with open(log) as f:
        tail = f.read()[-6000:]
    if not os.path.exists(out):
        pytest.fail(f"torchrun --nproc_per_node {nproc} produced no results (rc={rc}):\n{tail}")
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def grpo_out_dir(tmp_path_factory):
    """Where multi-process checks leave files for the pytest side (MM_GRPO_TEST_OUT)."""
    return str(tmp_path_factory.mktemp("checks_out"))


@pytest.fixture(scope="session")
def torchrun(tmp_path_factory, tiny_pipeline_dir, grpo_out_dir):
    """torchrun(nproc) -> {check_name: {"ok", "error", "metrics"}}, one launch per world size."""
    cache = {}
    env = {"MM_GRPO_TEST_PIPELINE": str(tiny_pipeline_dir), "MM_GRPO_TEST_OUT": grpo_out_dir}

    def results(nproc):
        if nproc not in cache:
            cache[nproc] = launch(nproc, str(tmp_path_factory.mktemp(f"torchrun{nproc}")), env)
        return cache[nproc]
    return results


def check_result(results, name):
    """The metrics of check `name`, failing the test with the workers' traceback if it failed."""
    if name not in results:
        pytest.fail(f"check {name} did not run (see the worker's log)")
    res = results[name]
    record_check_read(name, res.get("seconds", 0.0))
    if not res["ok"]:
        pytest.fail(f"check {name} failed:\n{res['error']}")
    if record := os.environ.get("MM_GRPO_CHECK_METRICS"):  # a JSON line per check read, for the docs' figures
        with open(record, "a") as f:
            env = "mindspeed-mm" if has_megatron_training() else "default"
            f.write(json.dumps({"env": env, "check": name, "metrics": res["metrics"]}, default=str) + "\n")
    return res["metrics"]
