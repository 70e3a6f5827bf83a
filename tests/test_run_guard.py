"""A training run on a flaky cluster, single process: a run that cannot learn stops, the save folder
is locked, cleared of our crashed saves and probed before the first rollout, a failed save leaves
nothing behind and names its file (docs/reliability.md)."""
import errno
import os
import resource
import signal
import socket
import subprocess
import sys

import pytest
import torch

from mm_grpo.files.lock import LOCK_FILE, RunFolderLock, RunFolderLocked
from mm_grpo.rewards.base import REWARDS, Reward, register_reward
from mm_grpo.training import run_guard
from mm_grpo.training.entry import run_entry
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs
from tests.testbed import has_megatron_training, subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACKER = "latest_checkpointed_iteration.txt"

if "test_nan" not in REWARDS:
    @register_reward("test_nan")
    class NanReward(Reward):
        """Non-finite for every image once the environment says so (a broken reward model)."""

        def score(self, images, prompts):
            bad = os.environ.get("MM_GRPO_TEST_NAN") == "1"
            return torch.full((len(images),), float("nan") if bad else 0.0) + images.flatten(1).mean(1)


def _pythonpath():
    """This checkout first, then what the environment adds (Megatron-LM's tree in MindSpeed-MM's)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("guard_cfg"), tiny_pipeline_dir,
                         reward=[{"name": "test_nan", "weight": 1.0}])


def _entry(argv, capsys):
    """The trainer's `python -m` entry in this process: (exit status, stderr)."""
    from mm_grpo.training import train_grpo
    with pytest.raises(SystemExit) as stop:
        run_entry(lambda: train_grpo.main(argv))
    return stop.value.code, "".join(line + "\n" for line in capsys.readouterr().err.splitlines()
                                    if line.startswith("mm-grpo:"))  # not the loading progress bars


def _no_rollout(monkeypatch):
    from mm_grpo.grpo.schedule import GRPOSchedule

    def refuse(*a, **k):
        raise AssertionError("a rollout ran")
    monkeypatch.setattr(GRPOSchedule, "prepare", refuse)


def _entries(folder):
    return sorted(os.listdir(folder))


# --- 4: a run that cannot learn ----------------------------------------------------------------
def test_all_nan_rewards_stop_the_run_without_a_new_checkpoint(parallel_1proc, configs, tmp_path, capsys,
                                                               monkeypatch):
    save = str(tmp_path / "ckpt")
    run_grpo(grpo_argv(*configs, iters=2, extra=["--save", save]))
    monkeypatch.setenv("MM_GRPO_TEST_NAN", "1")
    status, err = _entry(grpo_argv(*configs, iters=20, extra=["--save", save, "--load", save, "--save-interval", "1",
                                                              "--max-skipped-iterations", "3"]), capsys)
    assert status == 3
    lines = err.splitlines()
    assert len(lines) == 1 and "3 iterations in a row skipped (up to iteration 5" in lines[0], err
    assert "non-finite" in lines[0]
    assert open(os.path.join(save, TRACKER)).read() == "2"
    assert _entries(save) == ["iter_0000002", TRACKER]  # no new iteration, no temp, lock released


def test_a_skipped_iteration_is_never_saved(parallel_1proc, configs, tmp_path, monkeypatch):
    """Save interval 2 over 3 iterations, the 2nd skipped: its save waits for the 3rd; a skipped
    last iteration is not saved either."""
    from mm_grpo.training.train_grpo import GRPORun
    step = GRPORun.step

    def nan_on(bad):
        def patched(self, iteration):
            monkeypatch.setenv("MM_GRPO_TEST_NAN", "1" if iteration in bad else "0")
            return step(self, iteration)
        return patched
    save = str(tmp_path / "ckpt")
    monkeypatch.setattr(GRPORun, "step", nan_on({1}))
    history, _ = run_grpo(grpo_argv(*configs, iters=3, extra=["--save", save, "--save-interval", "2"]))
    assert [h["skipped"] for h in history] == [0.0, 1.0, 0.0]
    assert _entries(save) == ["iter_0000003", TRACKER]
    monkeypatch.setattr(GRPORun, "step", nan_on({3}))
    run_grpo(grpo_argv(*configs, iters=4, extra=["--save", save, "--load", save]))
    assert open(os.path.join(save, TRACKER)).read() == "3"
    assert _entries(save) == ["iter_0000003", TRACKER]


# --- 3: the save folder before the first rollout -------------------------------------------------
def test_unwritable_save_folder_fails_before_the_first_rollout(parallel_1proc, configs, tmp_path, capsys,
                                                               monkeypatch):
    _no_rollout(monkeypatch)
    (tmp_path / "file").write_text("not a folder")
    status, err = _entry(grpo_argv(*configs, iters=2, extra=["--save", str(tmp_path / "file" / "ckpt")]), capsys)
    assert status == 2
    assert err.count("\n") == 1 and "cannot use --save" in err and "Not a directory" in err


def _run_limited(argv, file_size_limit, tmp_path):
    """The trainer as its own process with a file-size limit (a disk that is full beyond it)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    # TORCHINDUCTOR_COMPILE_THREADS=1 comes from tests/conftest.py: no compile-worker subprocess, whose
    # start-up warning on the shared stderr could land after the trainer's last line.
    env = dict(os.environ, PYTHONPATH=_pythonpath(), MM_GRPO_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TORCHELASTIC_RUN_ID", None)
    if has_megatron_training():
        env = subprocess_env(env)
    return subprocess.run([sys.executable, "-m", "mm_grpo.training.train_grpo", *argv], cwd=str(tmp_path), env=env,
                          preexec_fn=limit, capture_output=True, text=True, timeout=300)


def test_full_save_folder_fails_before_the_first_rollout(tiny_pipeline_dir, tmp_path):
    save = tmp_path / "ckpt"
    configs = write_configs(tmp_path / "cfg", tiny_pipeline_dir)  # a reward the subprocess knows
    proc = _run_limited(grpo_argv(*configs, iters=2, extra=["--save", str(save)]), 256 << 10, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mm-grpo: error: cannot write to --save") and "File too large" in last, last
    assert ".probe-" in last and "reward" not in proc.stdout  # nothing trained
    assert os.listdir(save) == []  # probe and lock removed


def test_a_failed_save_removes_its_temp_and_names_the_file(parallel_1proc, configs, tmp_path, capsys, monkeypatch):
    from mm_grpo.checkpoint import shard_io

    def full_disk(f, offset, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")
    save = str(tmp_path / "ckpt")
    monkeypatch.setattr(shard_io, "write_tensor_at", full_disk)
    status, err = _entry(grpo_argv(*configs, iters=1, extra=["--save", save]), capsys)
    assert status == 3
    line, = err.strip().splitlines()
    assert "saving iteration 1 failed, partial" in line and ".iter_0000001.tmp removed" in line
    assert "No space left on device" in line and "mp_rank_00/model_optim_rng.pt" in line
    assert _entries(save) == []


def test_free_space_short_of_a_checkpoint_is_warned(parallel_1proc, configs, tmp_path, capsys, monkeypatch):
    import collections
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(run_guard.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1 << 20))
    run_grpo(grpo_argv(*configs, iters=0, extra=["--save", str(tmp_path / "ckpt")]))
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "0.00 GiB free, a checkpoint needs about 0.0" in warning[0], err


def test_a_checkpoint_is_sized_by_what_it_holds(parallel_1proc):
    """Full fine-tuning saves every weight with Adam's two fp32 moments; a LoRA run its adapters only."""
    from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, lora
    model = FluxTransformer(FluxConfig.preset("tiny"))
    assert run_guard.checkpoint_bytes([model]) == 12 * sum(p.numel() for p in model.parameters())
    lora.add_adapters(model, lora.LoRAConfig(r=4), seed=0)
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert adapters and run_guard.checkpoint_bytes([model]) == 12 * sum(p.numel() for p in adapters)


def test_stale_temps_of_ours_are_removed_at_start(parallel_1proc, configs, tmp_path):
    save = tmp_path / "ckpt"
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [".iter_0000004.tmp", f".x.tmp-{host}:{dead.pid}-abcdefgh"]
    kept = [f".x.tmp-{host}:{os.getpid()}-abcdefgh", f".x.tmp-otherhost:{dead.pid}-abcdefgh", ".mine.tmp", "notes"]
    for name in stale + kept:
        (save / name).mkdir(parents=True)
    run_grpo(grpo_argv(*configs, iters=0, extra=["--save", str(save)]))
    assert _entries(save) == sorted(kept)


# --- 1: one job per run folder ---------------------------------------------------------------------
def test_run_folder_lock_names_its_holder_and_takes_over_dead_local_ones(tmp_path):
    lock = RunFolderLock(str(tmp_path)).acquire()
    assert open(tmp_path / LOCK_FILE).read().strip() == f"{socket.gethostname()}:{os.getpid()}"
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(f"{socket.gethostname()}:{dead.pid}\n")
    RunFolderLock(str(tmp_path)).acquire().release()  # stale: taken over
    for holder in ("node7:1234", f"{socket.gethostname()}:{os.getppid()}"):  # another host's, a live one
        (tmp_path / LOCK_FILE).write_text(holder + "\n")
        with pytest.raises(RunFolderLocked, match=f"in use by the job of process {holder} "):
            RunFolderLock(str(tmp_path)).acquire()
        assert open(tmp_path / LOCK_FILE).read().strip() == holder


def test_a_locked_run_folder_is_refused_in_one_line(parallel_1proc, configs, tmp_path, capsys, monkeypatch):
    _no_rollout(monkeypatch)
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LOCK_FILE).write_text("node7:1234\n")
    status, err = _entry(grpo_argv(*configs, iters=2, extra=["--save", str(save)]), capsys)
    assert status == 2 and err.count("\n") == 1 and "in use by the job of process node7:1234" in err


# --- 6: checksums ------------------------------------------------------------------------------------
def test_a_flipped_byte_in_a_training_shard_stops_the_resume(parallel_1proc, configs, tmp_path, capsys):
    from tests.test_checksum import _flip_a_byte
    save = tmp_path / "ckpt"
    run_grpo(grpo_argv(*configs, iters=1, extra=["--save", str(save)]))
    shard = save / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    assert (save / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt.sha256").exists()
    _flip_a_byte(shard)
    status, err = _entry(grpo_argv(*configs, iters=2, extra=["--load", str(save)]), capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"mm-grpo: error: {save / 'iter_0000001'} is unreadable (mp_rank_00/model_optim_rng.pt "
                          "does not match its checksum (model_optim_rng.pt.sha256: sha256 "), err
    assert err.endswith(f"changed or corrupted after it was written); no other checkpoint in {save} is intact: "
                        "restore it, or start afresh without --load\n"), err


def test_file_errors_name_the_file(tmp_path):
    from mm_grpo.data import read_prompts
    from mm_grpo.files.jsonfile import load_json
    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("a café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=f"prompt file {latin1} is not UTF-8 text"):
        read_prompts(str(latin1))
    with pytest.raises(ValueError, match=f"--mm-data {latin1} is not valid JSON"):
        load_json(str(latin1), "--mm-data")


def test_an_empty_load_folder_is_a_fresh_start(parallel_1proc, configs, tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / ".iter_0000001.tmp").mkdir()  # hidden entries (our temps) do not count
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=["--load", str(save), "--save", str(save)]))
    assert not run.model.resume and run.start_iteration == 0
    out = capsys.readouterr().out
    assert f"mm-grpo: --load {save} holds no checkpoint yet: a fresh start from predictor.from_pretrained" in out
    missing = tmp_path / "typo"  # a missing folder other than --save stays an error
    with pytest.raises(FileNotFoundError, match=str(missing)):
        run_grpo(grpo_argv(*configs, iters=0, extra=["--load", str(missing), "--save", str(save)]))
