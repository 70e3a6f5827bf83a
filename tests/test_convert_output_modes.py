"""mm-convert as a shared machine and a hostile file meet it: its output folders follow the umask like
any folder (not tempfile's private 0700), and a shard whose pickle names an operating-system call is
refused in one line that says why, without running it; a truncated shard keeps its own line."""
import os
import stat

import pytest
import torch

from tests.test_convert_cli import diffusers_folder, hf_to_mm, run, state_dict  # noqa: F401

SHARD = os.path.join("release", "mp_rank_00", "model_optim_rng.pt")


def _modes(root):
    """{path relative to root: permission bits} of root and everything under it."""
    found = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return found


@pytest.fixture
def umask():
    """Sets the process's umask for the test (restored after)."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask,folder_mode,file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)],
                         ids=["umask022", "umask077"])
def test_converted_folders_follow_the_umask(capsys, tmp_path, state_dict, umask, mask, folder_mode,  # noqa: F811
                                            file_mode):
    src = diffusers_folder(tmp_path / "hf", state_dict)
    umask(mask)
    assert hf_to_mm(capsys, src, tmp_path / "mm", "--cfg.target_parallel_config.tp_size", "2")[0] == 0
    assert run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm", "--cfg.target_path",
               tmp_path / "back")[0] == 0
    for out in ("mm", "back"):
        modes = _modes(tmp_path / out)
        folders = {p for p in modes if os.path.isdir(tmp_path / out / p)}
        assert len(folders) == (4 if out == "mm" else 1) and len(modes) > len(folders), modes  # ., release, 2 shards
        assert {p: m for p, m in modes.items() if m != (folder_mode if p in folders else file_mode)} == {}, modes


class RunsACommand:
    """Unpickled without weights_only, it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


def test_a_pickle_that_calls_the_system_is_refused_in_one_line_and_runs_nothing(capsys, tmp_path):
    source = tmp_path / "ckpt"
    (source / "release" / "mp_rank_00").mkdir(parents=True)
    (source / "latest_checkpointed_iteration.txt").write_text("release")
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "args": RunsACommand(marker)}, source / SHARD)
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", source, "--cfg.target_path",
                       tmp_path / "hf")
    assert code == 1 and err == (f"mm-convert: error: {source / SHARD}: refused: its pickle names posix.system, which "
                                 "a checkpoint never holds (loading with weights_only=True); the file is not a "
                                 "checkpoint mm-grpo wrote\n"), err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_truncated_shard_keeps_its_line(capsys, tmp_path, state_dict):  # noqa: F811
    assert hf_to_mm(capsys, diffusers_folder(tmp_path / "hf", state_dict), tmp_path / "mm")[0] == 0
    shard = tmp_path / "mm" / SHARD
    os.truncate(shard, os.path.getsize(shard) - 1000)
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm", "--cfg.target_path",
                       tmp_path / "back")
    assert code == 1 and err == (f"mm-convert: error: cannot read checkpoint shard {shard} (truncated, or not a "
                                 f"torch.save file?): no zip directory at its end ({os.path.getsize(shard)} bytes)\n")
