"""sha256 of every shard: written with it, checked on load and by mm-convert (--no-verify skips)."""
import os
import subprocess

from tests.test_convert_cli import diffusers_folder, hf_to_mm, run, state_dict  # noqa: F401

SHARD = os.path.join("release", "mp_rank_01", "model_optim_rng.pt")


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)  # inside the tensors' bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_byte_in_a_shard_is_reported_with_its_file(capsys, tmp_path, state_dict):  # noqa: F811
    src = diffusers_folder(tmp_path / "hf", state_dict)
    assert hf_to_mm(capsys, src, tmp_path / "mm", "--cfg.target_parallel_config.tp_size", "2")[0] == 0
    for tp in ("mp_rank_00", "mp_rank_01"):  # sha256sum's own format
        check = subprocess.run(["sha256sum", "-c", "model_optim_rng.pt.sha256"], cwd=tmp_path / "mm" / "release" / tp,
                               capture_output=True, text=True)
        assert check.returncode == 0 and check.stdout.strip() == "model_optim_rng.pt: OK"
    shard = tmp_path / "mm" / SHARD
    _flip_a_byte(shard)
    resplit = ("FluxConverter", "resplit", "--cfg.source_path", tmp_path / "mm")
    code, _, err = run(capsys, *resplit, "--cfg.target_path", tmp_path / "re")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"mm-convert: error: {shard} does not match its checksum"), err
    assert not (tmp_path / "re").exists()
    code, _, err = run(capsys, *resplit, "--cfg.target_path", tmp_path / "re", "--no-verify")  # read as it is
    assert code == 0, err
