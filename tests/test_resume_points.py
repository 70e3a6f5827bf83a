"""Resuming after a damaged checkpoint, as a user meets it: the latest iteration truncated, a crafted
pickle, a tracker or metadata that is not what mm-grpo wrote, --train-iters below the checkpoint.
Each is one line (printed once, also through the launch script) that names the file and the newest
intact iteration with the flag that resumes it (--ckpt-step); --ckpt-step then resumes exactly. A run
stopped by SIGTERM (--exit-signal-handler) resumes exactly too, and a resume with other batch sizes says so."""
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from mm_grpo.checkpoint import checksum
from mm_grpo.checkpoint.paths import META_KEY, TRACKER_FILE
from mm_grpo.checkpoint.resume import ResumeRefused, damage
from mm_grpo.training.entry import run_entry
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import flow_argv, grpo_argv, run_grpo, write_configs, write_flow_configs
from tests.test_convert_cli import diffusers_folder, hf_to_mm, state_dict  # noqa: F401
from tests.test_run_trainer import _pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = os.path.join("mp_rank_00", "model_optim_rng.pt")
LAUNCH_TIMEOUT_S = 300  # a trainer that stops before building anything: seconds


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("resume_cfg"), tiny_pipeline_dir)


@pytest.fixture(scope="module")
def saved(parallel_1proc, configs, tmp_path_factory):  # noqa: F811
    """Three GRPO iterations, each saved: (checkpoint folder, the run's per-iteration stats)."""
    save = tmp_path_factory.mktemp("resume_runs") / "ckpt"
    history, _ = run_grpo(grpo_argv(*configs, iters=3, extra=["--save", str(save), "--save-interval", "1"]))
    assert (save / TRACKER_FILE).read_text() == "3"
    return save, history


def _copy(saved, tmp_path):
    return shutil.copytree(saved[0], tmp_path / "ckpt")


def _entry(argv, capsys, monkeypatch):
    """The GRPO entry in this process, refusing any rollout: (exit status, stdout + stderr)."""
    from mm_grpo.grpo.schedule import GRPOSchedule
    from mm_grpo.training import train_grpo

    def refuse(*a, **k):
        raise AssertionError("a rollout ran")
    monkeypatch.setattr(GRPOSchedule, "prepare", refuse)
    with pytest.raises(SystemExit) as stop:
        run_entry(lambda: train_grpo.main(argv))
    out = capsys.readouterr()
    return stop.value.code, out.out + out.err


def _truncate(path):
    size = os.path.getsize(path) // 2
    os.truncate(path, size)
    return size


def _rewrite_shard(path, change):
    """The shard file at `path` rewritten with `change(tree)` applied, with a matching checksum file
    (what a tool that rewrites shards would leave)."""
    tree = torch.load(path, weights_only=True)
    change(tree)
    torch.save(tree, path)
    checksum.write_checksum(str(path))


class RunsACommand:
    """What a crafted pickle holds: unpickled without weights_only, it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def _assert_iteration_3_as_uninterrupted(saved, history, run):
    """A run resumed at iteration 2 trained iteration 3 as the uninterrupted run (`saved`) did: reward,
    loss, grad norm, every weight."""
    assert run.start_iteration == 2 and len(history) == 1
    for key in ("reward/mean", "loss", "grad_norm"):
        assert history[0][key] == saved[1][2][key], key
    uninterrupted = torch.load(saved[0] / "iter_0000003" / SHARD, weights_only=True)["model"]
    trained = run.model.modules[0].state_dict()
    assert all(torch.equal(trained[name], uninterrupted[name]) for name, _ in run.model.modules[0].named_parameters())


# --- the latest checkpoint damaged ------------------------------------------------------------------
def test_a_truncated_latest_checkpoint_names_the_intact_one_and_ckpt_step_resumes_it_exactly(
        parallel_1proc, configs, saved, tmp_path, capsys, monkeypatch):  # noqa: F811
    save = _copy(saved, tmp_path)
    size = _truncate(save / "iter_0000003" / SHARD)
    status, output = _entry(grpo_argv(*configs, iters=4, extra=["--load", str(save)]), capsys, monkeypatch)
    line = (f"mm-grpo: error: {save}/iter_0000003 is unreadable ({SHARD} is truncated, or not a torch.save file: "
            f"no zip directory at its end ({size} bytes)); the newest intact checkpoint is iteration 2: resume from "
            "it with --ckpt-step 2")
    assert status == 2 and output.count(line) == 1 and output.count("mm-grpo: error:") == 1, output
    monkeypatch.undo()
    # --ckpt-step 2 loads iteration 2 and trains iteration 3 as the uninterrupted run did.
    _assert_iteration_3_as_uninterrupted(saved, *run_grpo(grpo_argv(*configs, iters=3, extra=[
        "--load", str(save), "--ckpt-step", "2"])))
    # Without --save nothing was written: the tracker still names iteration 3 (only a save moves it).
    assert (save / TRACKER_FILE).read_text() == "3" and os.path.getsize(save / "iter_0000003" / SHARD) == size


def test_the_line_is_printed_once_through_the_launch_script(configs, saved, tmp_path, capsys, monkeypatch):
    """The user's path, shell/run_trainer.sh around the trainer (it prints the trainer's error last): once
    in everything the console gets, once in the log. Under torchrun's two workers the second leaves the
    line to the first (it is the same on every process), as the entry does here as local rank 1."""
    save = _copy(saved, tmp_path)
    _truncate(save / "iter_0000003" / SHARD)
    argv = grpo_argv(*configs, iters=4, extra=["--load", str(save)])
    log = tmp_path / "train.log"
    script = 'source shell/run_trainer.sh; run_trainer "$LOG" "$PY" -m mm_grpo.training.train_grpo "$@"'
    env = dict(os.environ, PYTHONPATH=_pythonpath(), LOG=str(log), PY=sys.executable, PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "-c", script, "run", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    line = f"mm-grpo: error: {save}/iter_0000003 is unreadable ("
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("mm-grpo: error:") == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(line)
    assert log.read_text().count("mm-grpo: error:") == 1
    from mm_grpo.training import entry, train_grpo
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(entry.time, "sleep", lambda s: None)  # the grace that lets local rank 0 exit first
    monkeypatch.setattr(sys, "argv", ["train_grpo", *argv])
    with pytest.raises(SystemExit) as stop:
        train_grpo.cli()
    assert stop.value.code == 2 and "mm-grpo" not in capsys.readouterr().err


def test_a_crafted_pickle_in_the_latest_checkpoint_runs_nothing(parallel_1proc, configs, saved, tmp_path, capsys,
                                                                monkeypatch):  # noqa: F811
    save = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "iteration": 3, "args": RunsACommand(marker)}, save / "iter_0000003" / SHARD)
    checksum.write_checksum(str(save / "iter_0000003" / SHARD))
    status, output = _entry(grpo_argv(*configs, iters=4, extra=["--load", str(save)]), capsys, monkeypatch)
    assert status == 2 and output.count("mm-grpo: error:") == 1, output
    assert (f"mm-grpo: error: {save}/iter_0000003 is unreadable ({SHARD} is refused: its pickle names posix.system, "
            "which a checkpoint never holds (read with weights_only=True: nothing ran)); the newest intact checkpoint "
            "is iteration 2: resume from it with --ckpt-step 2\n") in output, output
    assert not marker.exists()


def test_a_file_found_damaged_while_loading_gives_the_same_line(parallel_1proc, configs, tmp_path):  # noqa: F811
    """The distributed optimizer's shard is hashed when it is loaded, after the model is built (module
    doc of mm_grpo/checkpoint/resume.py): a flipped byte there stops the resume with the same line."""
    from tests.test_checksum import _flip_a_byte
    save = tmp_path / "ckpt"
    argv = lambda iters, *extra: grpo_argv(*configs, iters=iters, extra=["--use-distributed-optimizer", *extra])  # noqa
    run_grpo(argv(2, "--save", str(save), "--save-interval", "1"))
    _flip_a_byte(save / "iter_0000002" / "mp_rank_00" / "distrib_optim_dp000.pt")
    with pytest.raises(ResumeRefused) as refused:
        run_grpo(argv(3, "--load", str(save)))
    assert str(refused.value).startswith(
        f"{save}/iter_0000002 is unreadable (mp_rank_00/distrib_optim_dp000.pt does not match its checksum ")
    assert str(refused.value).endswith("changed or corrupted after it was written); the newest intact checkpoint is "
                                       "iteration 1: resume from it with --ckpt-step 1")


# --- a preempted run ------------------------------------------------------------------------------
def test_sigterm_with_the_exit_handler_saves_the_iteration_in_progress_and_the_resume_is_exact(
        parallel_1proc, configs, saved, tmp_path, capsys, monkeypatch):  # noqa: F811
    """SIGTERM while iteration 2 runs (no interval saves): iteration 2 is finished and saved, the run
    returns; resumed, iteration 3 is the uninterrupted run's (reward, loss, grad norm, every weight)."""
    from mm_grpo.training.train_grpo import GRPORun
    step = GRPORun.step

    def preempted_during_the_second(self, iteration):
        if iteration == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends; it lands mid-iteration
        return step(self, iteration)
    monkeypatch.setattr(GRPORun, "step", preempted_during_the_second)
    save = tmp_path / "ckpt"
    history, run = run_grpo(grpo_argv(*configs, iters=3, extra=["--save", str(save), "--exit-signal-handler"]))
    assert len(history) == 2 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler removed
    assert capsys.readouterr().out.count(f"mm-grpo: SIGTERM received (--exit-signal-handler): stopped after iteration "
                                         f"2 of 3, saved in {save}; resume with --load {save}\n") == 1
    assert sorted(os.listdir(save)) == ["iter_0000002", TRACKER_FILE]  # saved, nothing half-written, unlocked
    monkeypatch.undo()
    _assert_iteration_3_as_uninterrupted(saved, *run_grpo(grpo_argv(*configs, iters=3, extra=["--load", str(save)])))


def test_a_resume_with_other_batch_sizes_says_so(parallel_1proc, configs, saved, capsys):  # noqa: F811
    save = saved[0]  # 2 prompts x 4 generations per iteration, micro-batch 2
    run_grpo(grpo_argv(*configs, iters=3, extra=["--load", str(save), "--num-generations", "2",
                                                  "--micro-batch-size", "1"]))  # --train-iters 3: loaded, nothing left to train
    assert capsys.readouterr().out.count(
        f"mm-grpo: {save}/iter_0000003 (iteration 3) was saved with --num-generations 4 --micro-batch-size 2; this run "
        "goes on with --num-generations 2 --micro-batch-size 1\n") == 1
    run_grpo(grpo_argv(*configs, iters=3, extra=["--load", str(save)]))  # the same sizes: not a word
    assert "was saved with" not in capsys.readouterr().out


# --- the tracker and the metadata name their file -----------------------------------------------
@pytest.mark.parametrize("content,shown", [(b"\xff3\n", "is not text: byte 0 is b'\\xff'"), (b"", "holds ''"),
                                           (b"three\n", "holds 'three'")])
def test_a_damaged_tracker_names_its_file_and_what_it_should_hold(parallel_1proc, configs, saved, tmp_path, capsys,
                                                                  monkeypatch, content, shown):  # noqa: F811
    save = _copy(saved, tmp_path)
    tracker = save / TRACKER_FILE
    tracker.write_bytes(content)
    status, output = _entry(grpo_argv(*configs, iters=4, extra=["--load", str(save)]), capsys, monkeypatch)
    assert status == 2 and output.count("mm-grpo: error:") == 1, output
    assert (f'mm-grpo: error: {tracker} {shown}; it should hold "release" or an iteration number; the newest intact '
            "checkpoint is iteration 3: resume from it with --ckpt-step 3\n") in output, output
    # mm-convert names it too (no trainer flags there)
    from tests.test_convert_cli import run
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", save, "--cfg.target_path",
                       tmp_path / "hf")
    assert code == 1
    assert err == f'mm-convert: error: {tracker} {shown}; it should hold "release" or an iteration number\n'


@pytest.mark.parametrize("change,detail", [
    (lambda tree: tree[META_KEY].pop("parallel"), "no 'parallel' entry"),
    (lambda tree: tree.__setitem__(META_KEY, '{"format": '), "a str, not a dict"),
    (lambda tree: tree[META_KEY].__setitem__("format", "other/format"),
     "ValueError: unknown checkpoint metadata format 'other/format' v1 (expected 'mm-grpo/megatron-torch' v1)"),
])
def test_unreadable_metadata_names_its_shard(parallel_1proc, configs, saved, tmp_path, capsys, monkeypatch, change,
                                             detail):  # noqa: F811
    save = _copy(saved, tmp_path)
    shard = save / "iter_0000003" / SHARD
    _rewrite_shard(shard, change)
    status, output = _entry(grpo_argv(*configs, iters=4, extra=["--load", str(save)]), capsys, monkeypatch)
    assert status == 2 and output.count("mm-grpo: error:") == 1, output
    assert (f"mm-grpo: error: {save}/iter_0000003 is unreadable ({shard}: its mm-grpo metadata ({META_KEY}) is "
            f"unreadable ({detail}); the checkpoint cannot be read without it); the newest intact checkpoint is "
            "iteration 2: resume from it with --ckpt-step 2\n") in output, output


# --- what to load, and how far to train -----------------------------------------------------------
def test_train_iters_below_the_checkpoint_is_refused_and_equal_says_nothing_is_left(
        parallel_1proc, configs, saved, tmp_path, capsys, monkeypatch):  # noqa: F811
    save = _copy(saved, tmp_path)
    status, output = _entry(grpo_argv(*configs, iters=2, extra=["--load", str(save), "--save", str(save)]), capsys,
                            monkeypatch)
    assert status == 2 and output.count("mm-grpo: error:") == 1, output
    assert (f"mm-grpo: error: --train-iters 2 is less than the checkpoint's iteration 3 ({save}/iter_0000003): nothing "
            "to train; --train-iters counts from iteration 0: raise it, or load an earlier iteration with "
            "--ckpt-step\n") in output, output
    monkeypatch.undo()
    before = {p: p.stat().st_mtime_ns for p in save.rglob("*")}
    history, _ = run_grpo(grpo_argv(*configs, iters=3, extra=["--load", str(save), "--save", str(save)]))
    assert history == [] and {p: p.stat().st_mtime_ns for p in save.rglob("*")} == before  # nothing saved
    assert capsys.readouterr().out.count(f"mm-grpo: {save}/iter_0000003 is iteration 3, --train-iters 3: nothing to "
                                         "train (raise --train-iters to train on)\n") == 1
    # --train-iters 0 asks for no training: the benches load a checkpoint so, to evaluate it
    history, run = run_grpo(grpo_argv(*configs, iters=0, extra=["--load", str(save)]))
    assert history == [] and run.start_iteration == 3 and "mm-grpo" not in capsys.readouterr().out


def test_ckpt_step_names_what_is_there(parallel_1proc, configs, saved, tmp_path, capsys, monkeypatch,
                                       tiny_pipeline_dir):  # noqa: F811
    save = _copy(saved, tmp_path)
    cases = [(["--load", str(save), "--ckpt-step", "7"],
              f"--ckpt-step 7: {save} has no iteration 7 (it holds iterations 1, 2, 3)"),
             (["--ckpt-step", "2"], "--ckpt-step 2 needs --load: the checkpoint folder to resume"),
             (["--load", str(save / "iter_0000002"), "--ckpt-step", "2"],
              f"--ckpt-step 2: --load {save / 'iter_0000002'} is one iteration folder; give the folder that holds "
              "the iterations (and its latest_checkpointed_iteration.txt)")]
    size = _truncate(save / "iter_0000003" / SHARD)  # an iteration folder given as --load itself
    cases.append((["--load", str(save / "iter_0000003")],
                  f"{save}/iter_0000003 is unreadable ({SHARD} is truncated, or not a torch.save file: no zip directory "
                  f"at its end ({size} bytes)); the newest intact checkpoint is iteration 2: resume from it with "
                  f"--load {save} --ckpt-step 2"))
    for extra, line in cases:
        status, output = _entry(grpo_argv(*configs, iters=4, extra=extra), capsys, monkeypatch)
        assert status == 2 and output.count("mm-grpo: error:") == 1 and f"mm-grpo: error: {line}\n" in output, output
    # the flow-matching trainer resumes the same way
    from mm_grpo.training import train_flow
    flow = write_flow_configs(tmp_path / "flow", tiny_pipeline_dir, num_images=4)
    with pytest.raises(SystemExit) as stop:
        run_entry(lambda: train_flow.main(flow_argv(*flow, iters=4, extra=cases[0][0])))
    assert stop.value.code == 2 and f"mm-grpo: error: {cases[0][1]}\n" in capsys.readouterr().err


def test_an_intact_iteration_is_told_from_a_damaged_one_without_reading_the_weights(saved, tmp_path, capsys,
                                                                                    state_dict):  # noqa: F811
    save = _copy(saved, tmp_path)
    assert damage(str(save / "iter_0000002")) is None
    shutil.rmtree(save / "iter_0000001" / "mp_rank_00")
    assert damage(str(save / "iter_0000001")) == "it holds no mp_rank_*/model_optim_rng.pt"
    # two shards (TP 2): a copy that lost a checksum file, then a whole shard
    assert hf_to_mm(capsys, diffusers_folder(tmp_path / "hf", state_dict), tmp_path / "mm",
                    "--cfg.target_parallel_config.tp_size", "2")[0] == 0
    release = tmp_path / "mm" / "release"
    assert damage(str(release)) is None
    (release / "mp_rank_01" / "model_optim_rng.pt.sha256").unlink()
    assert damage(str(release)) == ("mp_rank_01/model_optim_rng.pt has no .sha256 file, which the others have: an "
                                    "incomplete copy?")
    shutil.rmtree(release / "mp_rank_01")
    assert damage(str(release)).startswith(f"checkpoint shard {release}/mp_rank_01/model_optim_rng.pt is missing "
                                           "(layout: TP 2")
