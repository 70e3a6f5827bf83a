"""Video rewards: an image reward averaged over sampled frames, and a rule-based motion reward.

A video batch is a float tensor [B, F, 3, H, W] in [0, 1] (F frames); a video reward maps it and
one prompt per video to float32 [B], like an image reward (`base.Reward`) maps images. A
`CombinedReward` of video rewards works unchanged (an image reward in it would be handed videos:
wrap it in `frames`).

`frames` (`FrameSampled`): an image reward's mean over `num_frames` frames taken evenly over the
video, first and last included (`frame_indices`: round(linspace(0, F - 1, n)); every frame when
F <= n; the first frame when n = 1). DanceGRPO (github.com/XueZeyue/DanceGRPO) scores its
Wan-2.1 videos with HPS-v2.1 on the first frame only (fastvideo/train_grpo_wan_2_1.py,
`video_first_frame_to_pil`) and HunyuanVideo / SkyReels videos with VideoAlign, whose reader
takes frames at `torch.linspace(0, total_frames - 1, nframes).round()`
(fastvideo/models/videoalign/vision_process.py, sample_type "uniform"): the indices used here.
`frame_average` does the same for any callable reward, keeping per-component values of one
that returns (total, {name: values}) as `CombinedReward` does.

`motion` (`MotionReward`): the prompt's object must be in every frame and move the prompt's way
(`mm_grpo.data.motion`'s grammar: "a red circle moving right"); formula in its docstring.
"""
import dataclasses
from typing import List, Optional, Sequence

import torch

from mm_grpo.data.motion import DIRECTIONS, MotionSpec
from mm_grpo.rewards.base import REWARDS, Reward, RewardConfig, build_reward, register_reward
from mm_grpo.rewards.compositional import DetectorConfig, detect

FULL_CREDIT_TRAVEL = 0.25  # `motion`: displacement (fraction of the frame side) that earns full credit


def check_videos(videos, prompts, who: str = "video reward"):
    """One-line ValueError unless `videos` is a float tensor [B, F, 3, H, W] with one prompt per video."""
    if torch.is_tensor(videos) and videos.ndim == 4 and videos.shape[1] == 3:
        raise ValueError(f"{who} expects videos [B, F, 3, H, W], got an image batch [B, 3, H, W] of shape "
                         f"{tuple(videos.shape)} (one frame per video: images.unsqueeze(1))")
    if not (torch.is_tensor(videos) and videos.ndim == 5 and videos.shape[2] == 3 and videos.shape[1] >= 1
            and videos.is_floating_point()):
        shape = tuple(videos.shape) if torch.is_tensor(videos) else type(videos).__name__
        raise ValueError(f"{who} expects a float tensor [B, F, 3, H, W] in [0, 1], got {shape}")
    if isinstance(prompts, str) or len(prompts) != videos.shape[0]:
        raise ValueError(f"{who}: need one prompt per video: {videos.shape[0]} videos, prompts={prompts!r:.80}")


class VideoReward(Reward):
    """Base class of video rewards: `Reward`'s no_grad, device moves and NaN for a non-finite input,
    on videos [B, F, 3, H, W]; subclasses implement `score` on them."""

    video = True

    def check_inputs(self, videos, prompts):
        check_videos(videos, prompts, f"reward {self.name!r}")


# --- frame-averaged image rewards ----------------------------------------------------------
def frame_indices(num_video_frames: int, num_frames: int) -> List[int]:
    """`num_frames` frame indices spread evenly over a video of `num_video_frames` frames, first
    and last included: round(linspace(0, F - 1, n)) (torch rounding: half to even); all frames
    when the video has no more than `num_frames`; [0] when `num_frames` is 1."""
    if num_video_frames < 1 or num_frames < 1:
        raise ValueError(f"need >= 1 video frame and num_frames >= 1, got {num_video_frames} and {num_frames}")
    if num_video_frames <= num_frames:
        return list(range(num_video_frames))
    return torch.linspace(0, num_video_frames - 1, num_frames, dtype=torch.float64).round().long().tolist()


def frame_average(reward, videos, prompts: Sequence[str], num_frames: int):
    """Mean over `frame_indices` frames of an image reward (any callable images [N, 3, H, W],
    prompts -> values [N], or -> (total [N], {name: values [N]}) as `CombinedReward`) per video:
    [B], or (total [B], {name: [B]}). All sampled frames go to `reward` in one batch."""
    check_videos(videos, prompts, "frame_average")
    b, f = videos.shape[:2]
    index = frame_indices(f, num_frames)
    frames = videos[:, index].reshape(b * len(index), *videos.shape[2:])
    out = reward(frames, [p for p in prompts for _ in index])

    def mean(values):
        return values.reshape(b, len(index)).mean(1)

    if isinstance(out, tuple):
        total, parts = out
        return mean(total), {name: mean(values) for name, values in parts.items()}
    return mean(out)


@dataclasses.dataclass
class FrameSampledConfig(RewardConfig):
    """`frames`' config: `inner` is the image reward's config (a RewardConfig or a dict), scored on
    `num_frames` frames per video; the other fields are `frames`' own (its `weight` in a
    `CombinedReward`; the inner one's weight is not used). `RewardConfig.from_any` hands a dict
    named "frames" (model.json's `{"name": "frames", "inner": {...}, "num_frames": 4}`) to this class."""

    name: str = "frames"
    inner: Optional[RewardConfig] = None
    num_frames: int = 4

    def __post_init__(self):
        if isinstance(self.inner, dict):
            self.inner = RewardConfig.from_any(self.inner)


@register_reward("frames")
class FrameSampled(VideoReward):
    """Mean of an image reward (`cfg.inner`) over `cfg.num_frames` frames per video (see `frame_indices`).

    Its `name` (its key in a `CombinedReward`'s values and logs) is "frames_<inner name>"."""

    config_class = FrameSampledConfig

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        who = f"reward {cfg.name!r}"
        if not isinstance(cfg, FrameSampledConfig):
            raise ValueError(f"{who} needs a FrameSampledConfig (fields `inner`, `num_frames`), got a plain "
                             f"{type(cfg).__name__}: build it with FrameSampledConfig.from_any(dict)")
        if cfg.inner is None:
            raise ValueError(f"{who} needs `inner`: the config of the image reward to average over frames")
        if isinstance(cfg.num_frames, bool) or not isinstance(cfg.num_frames, int) or cfg.num_frames < 1:
            raise ValueError(f"{who}: num_frames must be an integer >= 1, got {cfg.num_frames!r}")
        inner = RewardConfig.from_any(cfg.inner)
        if inner.name not in REWARDS:
            raise ValueError(f"{who}: unknown inner reward {inner.name!r}; known: {', '.join(sorted(REWARDS))}")
        if getattr(REWARDS[inner.name], "video", False):
            raise ValueError(f"{who}: inner reward {inner.name!r} scores videos; `inner` must be an image reward")
        self.num_frames = cfg.num_frames
        self.inner = build_reward(inner, device)
        # Its key in a CombinedReward and in logs: two `frames` rewards (over HPS, over CLIP) can sit side by side.
        self.name = f"frames_{inner.name}"

    def check_prompts(self, prompts):
        self.inner.check_prompts(prompts)

    def score(self, videos, prompts):
        return frame_average(self.inner, videos, prompts, self.num_frames)


# --- motion in the shapes grammar ------------------------------------------------------------
def motion_scores(videos: torch.Tensor, prompts: Sequence[str], cfg: DetectorConfig = DetectorConfig()):
    """(presence [B], travel [B], score [B]) of `MotionReward` (float32), for scoring and logging."""
    b, f, _, h, w = videos.shape
    specs = [MotionSpec.parse(p) for p in prompts]
    objects, _ = detect(videos.reshape(b * f, 3, h, w), cfg)
    presence, travel = [], []
    for i, spec in enumerate(specs):
        centres = []
        for found in objects[i * f:(i + 1) * f]:
            mine = [o for o in found if (o.color, o.shape) == (spec.color, spec.shape)]
            if mine:
                largest = max(mine, key=lambda o: o.area)
                centres.append((largest.cx, largest.cy))
        presence.append(len(centres) / f)
        ux, uy = DIRECTIONS[spec.direction]
        if len(centres) >= 2:
            (x0, y0), (x1, y1) = centres[0], centres[-1]
            side = w if ux else h
            travel.append(min(max(((x1 - x0) * ux + (y1 - y0) * uy) / (FULL_CREDIT_TRAVEL * side), 0.0), 1.0))
        else:
            travel.append(0.0)
    presence_t = torch.tensor(presence, dtype=torch.float32)
    travel_t = torch.tensor(travel, dtype=torch.float32)
    return presence_t, travel_t, presence_t * travel_t


@register_reward("motion")
class MotionReward(VideoReward):
    """Rule-based video reward for the motion grammar ("a red circle moving right"). No weights.

    Each frame is segmented by `compositional.detect` (nearest palette colour, connected
    components, shape from fill and centroid drop); the prompt's object in a frame is the largest
    detection of its colour and shape, at its centroid c_f. With P the frames where it is found
    (in order, first p0 and last p1), u the direction's unit vector (right +x, down +y) and S the
    frame side along u (W for left/right, H for up/down):

        presence = |P| / F
        travel   = clip(((c_p1 - c_p0) . u) / (FULL_CREDIT_TRAVEL x S), 0, 1)   (0 when |P| < 2)
        motion   = presence x travel

    so the object must be present throughout (a wrong colour or shape scores 0) and move at least
    a quarter of the frame the prompt's way for full credit; no motion or the wrong way scores 0
    (motion across the axis is not looked at). A prompt's background, if named, is not checked.
    """

    def check_prompts(self, prompts):
        for prompt in dict.fromkeys(prompts):
            MotionSpec.parse(prompt)  # one-line ValueError for a prompt outside the motion grammar

    def score(self, videos, prompts):
        return motion_scores(videos, prompts)[2].to(videos.device)
