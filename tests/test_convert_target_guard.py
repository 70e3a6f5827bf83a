"""mm-convert cannot destroy a checkpoint: targets inside or around the source and folders written by
training are refused, overwrite or not; crashed conversions' temporary folders are removed."""
import os
import socket
import subprocess

import pytest

from tests.test_convert_cli import REPO, diffusers_folder, hf_to_mm, run, state_dict  # noqa: F401

OVERWRITE = ("--cfg.overwrite", "true")


def _pythonpath():
    """This checkout first, then what the environment adds (Megatron-LM's tree in MindSpeed-MM's)."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def _snapshot(folder):
    """{relative path: (size, mtime_ns)} of every file below `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), folder)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def layout(tmp_path, capsys, state_dict):  # noqa: F811
    """hf/ (diffusers), release/ (a converted checkpoint) and run/ (a training run: iter_0000008, tracker 8)."""
    hf = diffusers_folder(tmp_path / "hf", state_dict)
    assert hf_to_mm(capsys, hf, tmp_path / "release")[0] == 0
    assert hf_to_mm(capsys, hf, tmp_path / "run")[0] == 0
    os.rename(tmp_path / "run" / "release", tmp_path / "run" / "iter_0000008")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("8")
    return tmp_path


def _verb(capsys, verb, source, target):
    return run(capsys, "FluxConverter", verb, "--cfg.source_path", source, "--cfg.target_path", target, *OVERWRITE)


CASES = [  # verb, source, target, refusal
    ("resplit", "run", "run/iter_0000008", "is inside the source"),
    ("resplit", "run/iter_0000008", "run", "contains the source"),
    ("resplit", "release", "run", "not the converter's to replace: it holds training iterations"),
    ("resplit", "release", "run/iter_0000008", "it is a training iteration folder"),
    ("mm_to_hf", "run", "run/hf", "is inside the source"),
    ("mm_to_hf", "run/iter_0000008", "run", "contains the source"),
    ("mm_to_hf", "release", "run", "not the converter's to replace"),
    ("hf_to_mm", "hf", "run", "not the converter's to replace"),
    ("hf_to_mm", "hf", ".", "contains the source"),
    ("hf_to_mm", "hf", "hf/mm", "is inside the source"),
]


@pytest.mark.parametrize("verb,source,target,refusal", CASES, ids=[f"{c[0]}:{c[1]}->{c[2]}" for c in CASES])
def test_a_target_that_would_destroy_a_checkpoint_is_refused(capsys, layout, verb, source, target, refusal):
    before = _snapshot(layout)
    code, _, err = _verb(capsys, verb, layout / source, layout / target)
    assert code == 1 and err.startswith("mm-convert: error: target_path ") and err.count("\n") == 1, err
    assert refusal in err, err
    assert _snapshot(layout) == before  # nothing written, nothing removed


def test_a_run_folder_with_a_lock_is_refused(capsys, layout):
    (layout / "fresh").mkdir()
    (layout / "fresh" / ".mm-grpo.lock").write_text("node7:1\n")
    code, _, err = _verb(capsys, "resplit", layout / "release", layout / "fresh")
    assert code == 1 and "it is a training run folder" in err


def test_converted_targets_are_still_replaced_with_overwrite(capsys, layout):
    assert _verb(capsys, "resplit", layout / "run", layout / "release")[0] == 0
    assert sorted(os.listdir(layout / "release")) == ["latest_checkpointed_iteration.txt", "release"]


def test_temporary_folders_of_crashed_conversions_are_removed(capsys, layout):
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = layout / f".re.tmp-{host}:{dead.pid}-abcdefgh"
    alive = layout / f".re.tmp-{host}:{os.getpid()}-abcdefgh"  # a conversion still running
    other = layout / f".release.tmp-{host}:{dead.pid}-abcdefgh"  # another target's
    for folder in (stale, alive, other):
        (folder / "release").mkdir(parents=True)
    assert _verb(capsys, "resplit", layout / "release", layout / "re")[0] == 0
    assert not stale.exists() and alive.exists() and other.exists()


SLOW_CONVERSION = """
import sys, time
from mm_grpo.checkpoint.shard_io import ShardWriter
real = ShardWriter.write
def slow(self, key, tensor):
    print("writing", flush=True)
    time.sleep(0.5)
    real(self, key, tensor)
ShardWriter.write = slow
from converters.convert_cli import main
main(sys.argv[1:])
"""


def test_sigterm_removes_the_partial_output(layout):
    import signal
    import sys
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERSION, "FluxConverter", "resplit", "--cfg.source_path",
                             str(layout / "release"), "--cfg.target_path", str(layout / "re")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore"))
    assert proc.stdout.readline() == "writing\n"  # inside the temporary folder
    assert [n for n in os.listdir(layout) if n.startswith(".re.tmp-")]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not [n for n in os.listdir(layout) if n.startswith(".re.")] and not (layout / "re").exists()
