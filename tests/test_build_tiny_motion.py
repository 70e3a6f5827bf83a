"""examples/wan/build_tiny_motion.sh as shipped, at toy sizes through the variables it reads: every stage
runs (data, VAE, init pipeline, features, MindSpeed-MM's pretrain_sora.py on 2 processes through
examples/wan/pretrain_wan.sh, export through mm-convert WanConverter mm_to_hf, held-out evaluation), and
the folder it leaves is a diffusers Wan pipeline that samples. examples/wan/pretrain_wan.sh's own
refusal, and what examples/wan/cpu_env.sh sets. The pieces one by one: tests/test_tiny_motion.py."""
import json
import os
import sys

import pytest
import torch

from tests.ports import free_port
from tests.test_launch_env import REPO
from tests.testbed import TESTBED, require_testbed, subprocess_env

pytestmark = pytest.mark.mindspeed_mm  # pretrain_sora.py and WanConverter: MindSpeed-MM's environment
SCRIPT = os.path.join(REPO, "examples", "wan", "build_tiny_motion.sh")
PRETRAIN = os.path.join(REPO, "examples", "wan", "pretrain_wan.sh")
CPU_ENV = os.path.join(REPO, "examples", "wan", "cpu_env.sh")
STAGES = ("data", "vae", "init", "features", "pretrain", "export", "eval")
# 264 videos: the VAE's 256 held-out ones and 8 to train on; 2 DiT iterations of one video per rank
TOY = {"NUM_VIDEOS": "264", "VAE_STEPS": "2", "ITERS": "2", "GBS": "2", "WARMUP": "0", "EVAL_SAMPLES": "2"}


def _run(tmp_path, script=SCRIPT, **variables):
    import subprocess
    env = subprocess_env(dict(os.environ, MM_GRPO_PYTHON=sys.executable, MINDSPEED_MM_TESTBED=TESTBED,
                              MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), MASTER_PORT=str(free_port()), **variables))
    return subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_the_recipe_builds_a_pipeline_diffusers_samples(tmp_path):
    from diffusers import WanPipeline
    from mm_grpo.families.wan.encoders import load_tokenizer
    require_testbed(needs_megatron_training=True)
    out, work = tmp_path / "tiny_motion", tmp_path / "work"
    proc = _run(tmp_path, OUT=str(out), WORK=str(work), **TOY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [line.split()[0] for line in (work / "times.txt").read_text().splitlines()]  # "data 21 s"
    assert stages == [*STAGES, "total"], stages
    assert not (tmp_path / "tiny_motion.old").exists()
    # the pretraining stage is pretrain_wan.sh's launch of MindSpeed-MM's pretrain_sora.py, saved after ITERS
    assert "[pretrain_wan.sh] device=cpu nodes=1 x 2 CP=1 PP=1 DP=2 GBS=2" in proc.stdout
    log = (work / "pretrain" / "train.log").read_text()
    assert "MindSpeed-MM/pretrain_sora.py" in log and "successfully saved checkpoint from iteration       2" in log
    # the evaluation's one line, and its figures
    report = json.loads((work / "eval.json").read_text())
    assert report["prompts"] == 10 and report["samples_per_prompt"] == 2 and report["references"]["ceiling"] == 1
    assert any(line.startswith("held-out motion ") for line in proc.stdout.splitlines())
    pipe = WanPipeline.from_pretrained(out, tokenizer=load_tokenizer(out))
    frames = pipe("a red circle moving right", height=32, width=32, num_frames=9, num_inference_steps=2,
                  guidance_scale=1.0, max_sequence_length=16, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 9, 3, 32, 32) and torch.isfinite(frames).all()


def test_bad_settings_are_refused_in_one_line_before_any_work(tmp_path):
    require_testbed(needs_megatron_training=True)
    for variables, message in (({"FRAMES": "8"}, "num_frames 8: Wan's VAE takes 4k + 1 frames"),
                               ({"SIZE": "40"}, "video size 40x40 must be positive multiples of 16"),
                               ({"GBS": "3"}, "GBS 3 must be a positive multiple of the 2 pretraining processes")):
        proc = _run(tmp_path, WORK=str(tmp_path / "work"), **variables)
        assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
        assert not (tmp_path / "work").exists()


def test_pretrain_wan_sh_refuses_a_batch_the_ranks_do_not_split(tmp_path):
    proc = _run(tmp_path, PRETRAIN, MM_GRPO_DEVICE="cpu", GBS="3", RUN_DIR=str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("pretrain_wan.sh: GBS 3 must be a positive multiple of DP 2 "
                                                    "(one video per micro-batch)")


def test_cpu_env_sh_sets_mindspeed_mms_environment_on_the_testbed(tmp_path):
    """Sourced as the Wan scripts source it: the CPU, the testbed's MindSpeed-MM, MindSpeed-MM's Python, and
    torch_npu's stand-ins ahead of the testbed's trees and the repository on PYTHONPATH; set values are kept."""
    import subprocess
    probe = (f'REPO={REPO}; source {CPU_ENV}; '
             'echo "$MM_GRPO_DEVICE"; echo "$MINDSPEED_MM"; echo "$MM_GRPO_PYTHON"; echo "$PYTHONPATH"')
    base = {k: v for k, v in os.environ.items() if k not in ("MM_GRPO_DEVICE", "MINDSPEED_MM")}
    env = dict(base, MM_GRPO_PYTHON=sys.executable, MINDSPEED_MM_TESTBED=TESTBED, PYTHONPATH="/elsewhere")
    device, mindspeed_mm, python, path = subprocess.run(["bash", "-c", probe], env=env, capture_output=True,
                                                        text=True, check=True).stdout.splitlines()
    assert (device, mindspeed_mm, python) == ("cpu", f"{TESTBED}/MindSpeed-MM", sys.executable)
    assert path.split(":") == [f"{REPO}/tests/standins", *(f"{TESTBED}/{tree}" for tree in
                                                            ("MindSpeed-MM", "MindSpeed", "Megatron-LM")),
                               REPO, "/elsewhere"]
    env.update(MM_GRPO_DEVICE="npu", MINDSPEED_MM=str(tmp_path))
    kept = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert kept.splitlines()[:2] == ["npu", str(tmp_path)]
