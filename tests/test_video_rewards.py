"""Video rewards: the motion grammar and its synthetic videos, the rule-based motion reward, and an
image reward averaged over sampled frames (DanceGRPO's way of scoring videos with image rewards)."""
import numpy as np
import pytest
import torch

from mm_grpo.data.motion import (DIRECTIONS, MotionSpec, enumerate_prompts, render_motion, render_video,
                                 sample_motion, split_prompts, write_prompt_split)
from mm_grpo.data.prompts import read_prompts
from mm_grpo.data.shapes import BACKGROUNDS, COLORS
from mm_grpo.rewards import CombinedReward, RewardConfig, build_reward
from mm_grpo.rewards.video import FULL_CREDIT_TRAVEL, FrameSampledConfig, frame_average, frame_indices

SIZE = 32


def one_line_error(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)


def centroid(frame, color):
    """Centre (x, y) of the pixels within 60 (RGB 0..255) of `color`; frame [3, H, W] in [0, 1]."""
    close = ((frame.permute(1, 2, 0) * 255 - torch.tensor(color, dtype=torch.float32)).norm(dim=-1) < 60)
    ys, xs = close.nonzero(as_tuple=True)
    return xs.float().mean().item() + 0.5, ys.float().mean().item() + 0.5


# --- the grammar, videos and prompt files ------------------------------------------------------
def test_motion_grammar_round_trip_and_errors():
    specs = enumerate_prompts()
    assert len(specs) == len({s.caption() for s in specs}) == 5 * 3 * 4
    assert all(MotionSpec.parse(s.caption()) == s for s in specs)
    assert MotionSpec.parse("  A Red   circle moving RIGHT ") == MotionSpec("red", "circle", "right")
    assert MotionSpec.parse("a blue triangle moving up on a black background") == \
        MotionSpec("blue", "triangle", "up", "black")
    for bad in ("a red circle", "a red circle moving sideways", "a purple circle moving left",
                "two red circles moving left", "a red circle above a blue square", ""):
        one_line_error("not in the motion grammar", MotionSpec.parse, bad)


def test_rendered_videos_move_the_way_the_prompt_says():
    video = render_video("a red circle moving right on a black background", num_frames=8, image_size=SIZE, seed=3)
    assert video.shape == (8, 3, SIZE, SIZE) and video.dtype == torch.float32
    assert 0 <= video.min() and video.max() <= 1
    assert (video[:, :, 0, 0] * 255 - torch.tensor(BACKGROUNDS["black"])).abs().max() < 1  # the prompt's background
    xs, ys = zip(*(centroid(f, COLORS["red"]) for f in video))
    assert all(b > a for a, b in zip(xs, xs[1:])) and max(ys) - min(ys) < 0.5
    assert xs[-1] - xs[0] >= 0.3 * SIZE - 0.5  # MIN_TRAVEL of the frame at least
    up = render_video("a green square moving up", num_frames=4, image_size=SIZE, seed=1)
    ys = [centroid(f, COLORS["green"])[1] for f in up]
    assert all(b < a for a, b in zip(ys, ys[1:]))
    static = render_video("a green square moving up", num_frames=4, image_size=SIZE, seed=1, travel=0)
    assert torch.equal(static[0], static[-1])
    assert torch.equal(render_video("a red circle moving right", 4, SIZE, seed=5),
                       render_video("a red circle moving right", 4, SIZE, seed=5))
    one_line_error("travel must be in", render_video, "a red circle moving right", 4, SIZE, travel=0.9)
    one_line_error("image_size must be >=", render_video, "a red circle moving right", 4, 16)


def test_prompt_split_is_disjoint_seeded_and_readable(tmp_path):
    paths = write_prompt_split(str(tmp_path / "prompts"), 40, seed=1, held_out=0.25)
    train, held = read_prompts(paths["train"]), read_prompts(paths["held_out"])
    assert (len(train), len(held)) == (30, 10) and not set(train) & set(held)
    assert all(MotionSpec.parse(p) for p in train + held)
    assert split_prompts(40, seed=1, held_out=0.25) == {"train": train, "held_out": held}
    assert split_prompts(40, seed=2, held_out=0.25)["held_out"] != held
    one_line_error("num_prompts must be in 1..60", split_prompts, 61)
    one_line_error("held_out must be a fraction", split_prompts, 10, held_out=1.0)


# --- the motion reward --------------------------------------------------------------------------
def test_motion_reward_high_for_the_prompt_low_otherwise():
    reward = build_reward({"name": "motion"})
    asked = "a red circle moving right"
    videos = torch.stack([
        render_video(asked, 8, SIZE, seed=0),
        render_video("a red circle moving left", 8, SIZE, seed=0),
        render_video(asked, 8, SIZE, seed=0, travel=0),  # static
        render_video("a blue circle moving right", 8, SIZE, seed=0),  # wrong colour
        render_video("a red square moving right", 8, SIZE, seed=0),  # wrong shape
    ])
    scores = reward(videos, [asked] * 5)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert scores[0] > 0.8
    assert scores[1] < 0.2 and scores[2] < 0.2
    assert scores[3] < 0.05 and scores[4] < 0.05


def test_motion_reward_every_shape_and_direction():
    specs = [MotionSpec(color, shape, direction) for (shape, direction), color in
             zip([(s, d) for s in ("circle", "square", "triangle") for d in DIRECTIONS], list(COLORS) * 3)]
    videos = torch.stack([render_video(s.caption(), 5, SIZE, seed=10 + i) for i, s in enumerate(specs)])
    reward = build_reward({"name": "motion"})
    assert reward(videos, [s.caption() for s in specs]).min() > 0.8
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    wrong_way = [MotionSpec(s.color, s.shape, opposite[s.direction]).caption() for s in specs]
    assert reward(videos, wrong_way).max() < 0.2


def test_motion_reward_formula_presence_times_travel():
    spec = MotionSpec("yellow", "circle", "down", "white")
    motion = sample_motion(spec, np.random.default_rng(0), SIZE, travel=0.3)
    video = render_motion(motion, 8, SIZE)
    video[4:] = video[4:, :, :1, :1]  # the object gone from the last 4 frames (background colour everywhere)
    centres = motion.centres(8)
    expected = 0.5 * min((centres[3][1] - centres[0][1]) / (FULL_CREDIT_TRAVEL * SIZE), 1.0)
    assert 0.1 < expected < 0.45  # partial credit on both factors
    score = build_reward({"name": "motion"})(video[None], [spec.caption()])
    assert score.item() == pytest.approx(expected, abs=0.03)


def test_motion_reward_checks():
    reward = build_reward({"name": "motion"})
    video = render_video("a pink triangle moving left", 4, SIZE)
    video[1, 0, 5, 5] = float("nan")
    assert torch.isnan(reward(video[None], ["a pink triangle moving left"])).all()
    one_line_error("not in the motion grammar", reward.check_prompts, ["a pink triangle moving left", "a red circle"])
    one_line_error("got an image batch", reward, video, ["a pink triangle moving left"] * 4)
    one_line_error("one prompt per video", reward, video[None], ["a", "b"])


# --- frame-averaged image rewards --------------------------------------------------------------
def test_frame_indices():
    assert frame_indices(81, 4) == [0, 27, 53, 80]  # 80/3 = 26.67 -> 27, 53.33 -> 53
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(33, 2) == [0, 32]
    assert frame_indices(81, 1) == [0]
    assert frame_indices(3, 4) == [0, 1, 2] and frame_indices(4, 4) == [0, 1, 2, 3]
    one_line_error("num_frames >= 1", frame_indices, 10, 0)


def textured_videos(b=2, f=10, size=24):
    """Frames of different detail (noise amplitude grows with the frame index): JPEG sizes differ."""
    g = torch.Generator().manual_seed(0)
    amplitude = torch.linspace(0.02, 0.5, f).view(1, f, 1, 1, 1)
    return (0.5 + amplitude * (torch.rand(b, f, 3, size, size, generator=g) - 0.5)).clamp(0, 1)


def test_frame_sampled_is_the_inner_mean_over_the_chosen_frames():
    videos, prompts = textured_videos(), ["a", "b"]
    inner = build_reward({"name": "jpeg_incompressibility"})
    reward = build_reward(FrameSampledConfig(inner={"name": "jpeg_incompressibility"}, num_frames=4))
    assert reward.name == "frames_jpeg_incompressibility"
    by_hand = torch.stack([inner(videos[:, k], prompts) for k in (0, 3, 6, 9)]).mean(0)
    got = reward(videos, prompts)
    assert got.shape == (2,) and torch.allclose(got, by_hand)
    every_frame = torch.stack([inner(videos[:, k], prompts) for k in range(10)]).mean(0)
    assert not torch.allclose(got, every_frame, rtol=1e-3)  # the sampling matters on these videos
    short = build_reward(FrameSampledConfig.from_any(
        {"name": "frames", "inner": {"name": "jpeg_incompressibility"}, "num_frames": 50}))
    assert torch.allclose(short(videos, prompts), every_frame)  # fewer frames than asked: all of them


def test_frame_average_keeps_per_component_means():
    videos, prompts = textured_videos(f=6), ["a", "b"]
    combined = CombinedReward.from_configs([{"name": "jpeg_incompressibility"},
                                            {"name": "jpeg_compressibility", "weight": 0.5}])
    total, parts = frame_average(combined, videos, prompts, 3)  # frames 0, 2 (2.5 rounds to even), 5
    per_frame = [combined(videos[:, k], prompts) for k in (0, 2, 5)]
    assert torch.allclose(total, torch.stack([t for t, _ in per_frame]).mean(0))
    assert set(parts) == {"jpeg_incompressibility", "jpeg_compressibility"}
    for name, values in parts.items():
        assert torch.allclose(values, torch.stack([p[name] for _, p in per_frame]).mean(0))


def test_frames_over_a_shapes_reward_in_a_combined_video_reward():
    videos = torch.stack([render_video("a red circle moving right", 6, SIZE, seed=s) for s in (0, 1)])
    frames = FrameSampledConfig(inner={"name": "compositional"}, num_frames=3, weight=0.0)
    reward = CombinedReward.from_configs([frames, {"name": "motion"}])
    # The motion prompts are not in the shapes grammar: the frame reward takes shapes captions.
    with pytest.raises(ValueError, match="shapes grammar"):
        reward.check_prompts(["a red circle moving right"])
    alone = build_reward(frames)
    assert torch.equal(alone(videos, ["a red circle", "a red circle"]), torch.ones(2))
    assert torch.equal(alone(videos, ["a blue circle", "a blue circle"]) < 0.5, torch.ones(2, dtype=torch.bool))
    total, values = CombinedReward.from_configs([{"name": "motion"}])(videos, ["a red circle moving right"] * 2)
    assert set(values) == {"motion"} and (total > 0.8).all()
    assert set(reward.rewards) == {"frames_compositional", "motion"}


def test_frames_config_errors():
    def frames(**kw):
        return build_reward(FrameSampledConfig(**kw))

    one_line_error("unknown inner reward 'nope'", frames, inner={"name": "nope"})
    one_line_error("num_frames must be an integer >= 1", frames, inner={"name": "jpeg_compressibility"}, num_frames=0)
    one_line_error("needs `inner`", frames)
    one_line_error("inner reward 'motion' scores videos", frames, inner={"name": "motion"})
    one_line_error("needs a FrameSampledConfig", build_reward, RewardConfig(name="frames"))
    one_line_error("needs `inner`", build_reward, {"name": "frames"})
    # model.json's dict config reaches FrameSampledConfig; a key neither class has is refused
    combined = CombinedReward.from_configs([{"name": "frames", "inner": {"name": "jpeg_compressibility"},
                                             "num_frames": 2}])
    assert set(combined.rewards) == {"frames_jpeg_compressibility"}
    one_line_error('unknown key "frames" \\(did you mean "num_frames"\\?\\)', build_reward,
                   {"name": "frames", "inner": {"name": "jpeg_compressibility"}, "frames": 2})
    reward = frames(inner={"name": "jpeg_compressibility"}, num_frames=2)
    one_line_error("expects videos \\[B, F, 3, H, W\\], got an image batch", reward, torch.rand(2, 3, 8, 8), ["a", "b"])
    one_line_error("expects videos", frame_average, reward.inner, torch.rand(2, 3, 8, 8), ["a", "b"], 2)
