"""The pieces of the tiny motion Wan pipeline (examples/wan/build_tiny_motion.sh runs them in order,
tests/test_build_tiny_motion.py): the prompt split and the moving-shape video folder, Wan's VAE
trained by train_tiny_vae, its features for MindSpeed-MM, the init pipeline, the weights back from
mm_to_hf, and the held-out motion evaluation."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mm_grpo.data.image_captions import VideoCaptionDataset, filmstrip, unstrip
from mm_grpo.data.motion import (Motion, enumerate_prompts, generate_videos, main as motion_main, pretraining_split,
                                 render_motion)
from mm_grpo.data.prompts import read_prompts
from mm_grpo.families.wan import tiny_motion
from mm_grpo.families.wan.encoders import (WAN_LATENT_CHANNELS, UMT5Conditioner, encode_video_latents, load_tokenizer,
                                           load_wan_vae)
from mm_grpo.rewards.video import motion_scores
from mm_grpo.tools import tiny_motion as tiny_motion_cli, train_tiny_vae, write_features
from mm_grpo.families.wan.tiny import build_tiny_wan
from mm_grpo.tiny.pipeline import write_pipeline
from tests.test_launch_env import REPO
from tests.test_video_rewards import one_line_error

EXAMPLES = os.path.join(REPO, "examples", "wan")
FRAMES, SIZE = 5, 32  # the smallest video the pipeline takes: 2 latent frames of 4 x 4


def refused(capsys, main, argv, match):
    """`main(argv)` ends with exit 2 and one line on stderr containing `match`."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "error:" in err[-1] and match in err[-1], err
    assert not any("Traceback" in line for line in err), err


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """A video-caption folder of 8 motion videos."""
    return generate_videos(str(tmp_path_factory.mktemp("motion") / "data"), 8, FRAMES, SIZE, seed=1)


@pytest.fixture(scope="module")
def init_pipeline(videos, tmp_path_factory):
    """(the init pipeline of a Wan VAE trained two steps on `videos`, that VAE's folder)."""
    root = tmp_path_factory.mktemp("motion_pipeline")
    data = train_tiny_vae.training_data(videos, "wan", range(8))
    vae = train_tiny_vae.train_vae(data, train_tiny_vae.VaeTraining(family="wan", steps=2, batch_size=2))
    train_tiny_vae.save_vae(vae, str(root / "vae"))
    init = write_pipeline(root / "init", lambda: tiny_motion.build_init_pipeline(root / "vae"))
    return init, root / "vae"


# --- prompts and videos --------------------------------------------------------------------------
def test_pretraining_split_partitions_the_grammar_and_is_the_shipped_one(tmp_path):
    split = pretraining_split(seed=0)
    assert {k: len(v) for k, v in split.items()} == {"pretrain": 40, "grpo": 10, "eval": 10}
    everything = [p for part in split.values() for p in part]
    assert sorted(everything) == sorted(s.caption() for s in enumerate_prompts())  # disjoint, every prompt
    assert pretraining_split(seed=0) == split and pretraining_split(seed=1)["eval"] != split["eval"]
    for name, prompts in split.items():
        assert read_prompts(os.path.join(EXAMPLES, "motion_prompts", f"{name}.txt")) == prompts
    pretrained = {tuple(p.split()[1:3]) for p in split["pretrain"]}
    assert len(pretrained) == 15  # every colour and shape pair is pretrained in some direction
    motion_main(["pretrain-split", "--out", str(tmp_path), "--held-out", "0.2"])
    assert len(read_prompts(str(tmp_path / "eval.txt"))) == 6
    one_line_error("need 2 or more", pretraining_split, held_out=0.01)


def test_filmstrips_round_trip():
    frames = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    strip = filmstrip(frames)
    assert strip.shape == (8, 24, 3)
    back = unstrip(torch.from_numpy(strip).permute(2, 0, 1))
    assert torch.equal(back, torch.from_numpy(frames).permute(0, 3, 1, 2))
    one_line_error("square frames", unstrip, torch.zeros(3, 8, 20))


def test_generated_videos_are_the_rendered_motions_of_their_captions(videos, tmp_path):
    dataset = VideoCaptionDataset(videos)
    rows = [json.loads(line) for line in open(os.path.join(videos, "metadata.jsonl"))]
    clips = dataset.videos(range(len(rows)))
    assert clips.shape == (8, FRAMES, 3, SIZE, SIZE)
    for clip, row in zip(clips, rows):
        spec = row["text"].split()
        motion = Motion(spec[1], spec[2], row["background"], row["size"], tuple(row["start"]), tuple(row["end"]))
        assert torch.equal(clip, render_motion(motion, FRAMES, SIZE))
    assert motion_scores(clips, dataset.captions)[2].tolist() == [1.0] * 8  # found in every frame, moving far enough
    # excluded prompts are never drawn; the same seed draws the same folder
    kept = ["a red circle moving left"]
    excluded = [s.caption() for s in enumerate_prompts() if s.caption() not in kept]
    only = generate_videos(str(tmp_path / "only"), 3, FRAMES, SIZE, seed=1, exclude=excluded)
    assert VideoCaptionDataset(only).captions == kept * 3
    again = generate_videos(str(tmp_path / "again"), 8, FRAMES, SIZE, seed=1)
    assert torch.equal(VideoCaptionDataset(again).videos(range(8)), clips)
    one_line_error("every prompt of the grammar is excluded", generate_videos, str(tmp_path / "x"), 1,
                   exclude=excluded + kept)
    one_line_error("num_frames must be >= 2", generate_videos, str(tmp_path / "x"), 1, num_frames=1)
    one_line_error("image_size must be >= 32", generate_videos, str(tmp_path / "x"), 1, image_size=16)
    assert not (tmp_path / "x").exists()


# --- Wan's VAE -----------------------------------------------------------------------------------
def test_cell_means_of_a_video_follow_the_causal_encoders_chunks():
    x = torch.randn(2, 3, 9, 16, 16)
    z = torch.zeros(2, 16, 3, 2, 2)  # 9 frames -> 3 latent frames: frame 0, frames 1-4, frames 5-8
    means = train_tiny_vae.cell_means(x, z)
    assert means.shape == (2, 3, 3, 2, 2)
    for t, frames in enumerate([slice(0, 1), slice(1, 5), slice(5, 9)]):
        cell = x[:, :, frames, 8:16, 0:8].mean((2, 3, 4))
        torch.testing.assert_close(means[:, :, t, 1, 0], cell)
    weights = train_tiny_vae.per_frame(lambda f: f[:, :1] * 0 + f.shape[0], x)
    assert weights.shape == (2, 1, 9, 16, 16) and bool((weights == 18).all())  # 2 videos x 9 frames at once


def test_wan_vae_normalises_its_latents_per_channel(init_pipeline, videos):
    init, _ = init_pipeline
    vae = load_wan_vae(str(init))
    assert vae.config.z_dim == WAN_LATENT_CHANNELS
    latents = encode_video_latents(vae, VideoCaptionDataset(videos).videos(range(8)))
    assert latents.shape == (8, 16, 2, SIZE // 8, SIZE // 8)
    per_channel = latents.transpose(0, 1).flatten(1)
    # zero mean, unit variance per channel on the training videos (up to the config's 4 decimals)
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(16), atol=2e-2, rtol=0)
    torch.testing.assert_close(per_channel.std(1), torch.ones(16), atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="multiple of the first"):
        train_tiny_vae.build_vae((8, 12, 16, 16), family="wan")


def test_vae_cli_refuses_a_frame_count_wans_vae_cannot_take_before_training(tmp_path, capsys):
    eight = generate_videos(str(tmp_path / "eight"), 3, 8, SIZE)
    refused(capsys, train_tiny_vae.main, ["--family", "wan", "--data", eight, "--out", str(tmp_path / "vae"),
                                          "--held-out", "1"], "num_frames 8: Wan's VAE takes 4k + 1 frames")
    refused(capsys, train_tiny_vae.main, ["--family", "wan", "--data", eight, "--out", str(tmp_path),
                                          "--held-out", "1"], "already exists")
    refused(capsys, train_tiny_vae.main, ["--data", eight, "--out", str(tmp_path / "vae"), "--latent-channels", "4"],
            "--latent-channels sets Wan's or Qwen-Image's VAE")
    refused(capsys, train_tiny_vae.main, ["--family", "wan", "--data", eight, "--out", str(tmp_path / "vae"),
                                          "--latent-channels", "3"], "--latent-channels must be >= 4")
    assert sorted(os.listdir(tmp_path)) == ["eight"]


# --- features, init pipeline, export -------------------------------------------------------------
def test_wan_features_are_the_vae_latents_and_umt5_states(videos, tmp_path, capsys):
    from diffusers import AutoencoderKLWan
    pipeline = build_tiny_wan(tmp_path / "tiny_wan")
    text_len = 12
    n, size = write_features.write_features(str(pipeline), videos, str(tmp_path / "out"), max_sequence_length=text_len,
                                            dtype=torch.float32, batch_size=3, family="wan")
    assert (n, size) == (8, (FRAMES, SIZE, SIZE))
    dataset = VideoCaptionDataset(videos)
    vae = AutoencoderKLWan.from_pretrained(pipeline / "vae").eval()
    embeds, mask = UMT5Conditioner(str(pipeline), max_sequence_length=text_len).encode_with_mask(dataset.captions)
    rows = [json.loads(line) for line in open(tmp_path / "out" / "data.jsonl")]
    for i, row in enumerate(rows):
        sample = torch.load(tmp_path / "out" / row["file"])
        assert row["text"] == dataset.captions[i] and sorted(sample) == ["prompt_ids", "prompt_mask", "video"]
        with torch.no_grad():  # WanVideoToVideoPipeline's encoding: (mode - latents_mean) * (1 / latents_std)
            x = dataset.videos([i]).transpose(1, 2) * 2 - 1
            mode = vae.encode(x).latent_dist.mode()[0]
        mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
        torch.testing.assert_close(sample["video"], (mode - mean) * (1 / torch.tensor(vae.config.latents_std)
                                                                     .view(-1, 1, 1, 1)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sample["prompt_ids"], embeds[i], rtol=1e-5, atol=1e-6)
        assert torch.equal(sample["prompt_mask"], mask[i]) and sample["prompt_ids"].shape == (text_len, 32)
    common = ["--family", "wan", "--pipeline", str(pipeline), "--out", str(tmp_path / "more")]
    refused(capsys, write_features.main, [*common, "--data", videos, "--resolution", "32"], "--resolution resizes")
    eight = generate_videos(str(tmp_path / "eight"), 1, 8, SIZE)
    refused(capsys, write_features.main, [*common, "--data", eight], "num_frames 8")
    assert not (tmp_path / "more").exists()


def test_init_pipeline_tokenizes_every_word_once_and_checks_the_vae(init_pipeline, tmp_path):
    init, _ = init_pipeline
    tokens = load_tokenizer(str(init))("a red circle moving right on a black background").input_ids
    assert len(tokens) == 9 + 1  # nine words and </s>
    with open(os.path.join(EXAMPLES, "pretrain_model_motion.json")) as f:
        predictor = json.load(f)["predictor"]
    assert {k: v for k, v in predictor.items() if k != "dtype"} == tiny_motion.PREDICTOR
    with open(init / "transformer" / "config.json") as f:
        assert {k: v for k, v in json.load(f).items() if k in tiny_motion.TRANSFORMER_CONFIG} == \
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in tiny_motion.TRANSFORMER_CONFIG.items()}
    with pytest.raises(ValueError, match="the VAE has 4 latent channels, the DiT takes 16"):
        tiny_motion.build_init_pipeline(build_tiny_wan(tmp_path / "tiny_wan") / "vae")


def test_weights_from_mm_to_hf_come_back_into_the_pipeline(init_pipeline, tmp_path):
    from diffusers import WanTransformer3DModel
    init, _ = init_pipeline
    reference = tiny_motion.write_converter_reference(str(init), str(tmp_path / "reference"))
    with open(reference / tiny_motion.INDEX) as f:
        index = json.load(f)["weight_map"]
    original = WanTransformer3DModel.from_pretrained(init / "transformer").state_dict()
    assert set(index) == set(original) and set(index.values()) == {tiny_motion.ONE_SHARD}
    # mm_to_hf's layout: the reference's config and index, the weights under its own file name
    converted = tmp_path / "converted"
    converted.mkdir()
    trained = {k: v + 1 for k, v in original.items()}
    save_file(trained, converted / "model-00001-of-00001.safetensors")
    final = tiny_motion.finish_pipeline(str(init), str(converted), str(tmp_path / "final"))
    loaded = WanTransformer3DModel.from_pretrained(final / "transformer").state_dict()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    save_file({k: v for k, v in trained.items() if k != "proj_out.bias"},
              converted / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match="1 weights missing"):
        tiny_motion.load_converted(str(init), str(converted))


# --- held-out motion accuracy -------------------------------------------------------------------
def test_evaluation_scores_ode_samples_beside_the_reference_levels(init_pipeline, tmp_path, capsys):
    init, _ = init_pipeline
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving right\na blue square moving up\n")
    argv = ["evaluate", "--pipeline", str(init), "--prompts", str(prompts), "--num-frames", str(FRAMES),
            "--samples", "2", "--num-inference-steps", "2", "--out", str(tmp_path / "eval.json")]
    tiny_motion_cli.main(argv)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("held-out motion ") and "2 prompts x 2 noises" in line and "ceiling 1.000" in line
    report = json.load(open(tmp_path / "eval.json"))
    assert set(report["references"]) == {"ceiling", "vae_ceiling", "chance"} and report["references"]["ceiling"] == 1
    stats = report["stats"]
    assert {"eval/motion", "eval/full_credit", "eval/presence", "eval/travel", "eval/motion_ci_low"} <= set(stats)
    assert stats["eval/motion"] == stats["eval/reward_mean"] and 0 <= stats["eval/motion"] <= 1
    tiny_motion_cli.main(argv[:-2] + ["--references-only"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("motion reward references (2 prompts x 2 videos)")
    prompts.write_text("a red circle\n")
    refused(capsys, tiny_motion_cli.main, argv, "not in the motion grammar")
    refused(capsys, tiny_motion_cli.main, ["check", "--num-frames", "9", "--image-size", "40"], "multiples of 16")
    refused(capsys, tiny_motion_cli.main, ["check", "--num-frames", "6", "--image-size", "32"], "4k + 1 frames")
