"""Synthetic motion videos in the shapes grammar: one coloured shape moving in a straight line.

A prompt names a colour and a shape of the shapes grammar (`mm_grpo.data.shapes`) and a direction,
optionally followed by a background as there:

    "a red circle moving right"        "a blue triangle moving up on a black background"

(directions: left, right, up, down; "up" is towards the top row). A prompt parses into a
`MotionSpec`; `sample_motion` draws a straight-line path that satisfies it and `render_motion`
draws it as a video [F, 3, H, W] in [0, 1] (the shapes renderer, frame by frame), for tests of
the motion reward (`mm_grpo.rewards.video`) and for pretraining a tiny video model.

    python -m mm_grpo.data.motion split --out PROMPTS_DIR --num-prompts 60 [--seed 0] [--held-out 0.2]
    python -m mm_grpo.data.motion pretrain-split --out PROMPTS_DIR [--seed 0] [--held-out 0.333]
    python -m mm_grpo.data.motion generate --out DATA_DIR --num-videos 6000 [--num-frames 9 --image-size 32]
        [--exclude PROMPT_FILE ...]

`pretrain-split` keeps a fraction of the grammar's prompts out of pretraining and halves it between
GRPO training and evaluation (pretrain.txt, grpo.txt, eval.txt); `generate` writes a video-caption
folder (`mm_grpo.data.image_captions`: each video a filmstrip PNG) for pretraining a tiny video model.
"""
import argparse
import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mm_grpo.data.image_captions import filmstrip, write_caption_folder
from mm_grpo.data.prompts import read_prompts, write_prompt_files
from mm_grpo.data.shapes import BACKGROUNDS, COLORS, SHAPES, PlacedObject, Scene, render

# direction -> unit vector (dx, dy) in image coordinates (y grows downwards)
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MIN_IMAGE_SIZE = 32  # below this an object large enough to detect has no room to move
MIN_TRAVEL = 0.3  # `sample_motion` moves the object by at least this fraction of the frame side
# `pretraining_split`: a third of the 60 prompts (20) kept out of pretraining, 10 for GRPO and 10 for
# evaluation; with seed 0 the 40 left hold every colour-shape pair in at least one direction.
PRETRAIN_HELD_OUT = 1 / 3


@dataclasses.dataclass(frozen=True)
class MotionSpec:
    """What a motion prompt asks for: one object of a colour and shape moving one way."""

    color: str
    shape: str
    direction: str
    background: Optional[str] = None

    def caption(self) -> str:
        text = f"a {self.color} {self.shape} moving {self.direction}"
        return text + (f" on a {self.background} background" if self.background else "")

    @classmethod
    def parse(cls, prompt: str) -> "MotionSpec":
        """The inverse of `caption`; a prompt outside the grammar is a one-line ValueError."""
        match = _PROMPT.fullmatch(" ".join(str(prompt).lower().split()))
        if not match:
            raise ValueError(f"prompt {prompt!r:.80} is not in the motion grammar: 'a <colour> <shape> moving "
                             f"<direction>' with colours {'/'.join(COLORS)}, shapes {'/'.join(SHAPES)}, "
                             f"directions {'/'.join(DIRECTIONS)} (e.g. 'a red circle moving right')")
        return cls(match["color"], match["shape"], match["direction"], match["background"])


_PROMPT = re.compile(rf"an? (?P<color>{'|'.join(COLORS)}) (?P<shape>{'|'.join(SHAPES)}) moving "
                     rf"(?P<direction>{'|'.join(DIRECTIONS)})(?: on an? (?P<background>{'|'.join(BACKGROUNDS)}) "
                     rf"background)?")


def enumerate_prompts(colors: Sequence[str] = tuple(COLORS), shapes: Sequence[str] = SHAPES,
                      directions: Sequence[str] = tuple(DIRECTIONS)) -> List[MotionSpec]:
    """Every prompt of the grammar (without backgrounds): 5 colours x 3 shapes x 4 directions = 60."""
    return [MotionSpec(c, s, d) for c in colors for s in shapes for d in directions]


def split_prompts(num_prompts: int, seed: int = 0, held_out: float = 0.2) -> Dict[str, List[str]]:
    """`num_prompts` distinct prompts drawn at random (seeded), split into `train` and `held_out`
    (a `held_out` fraction, rounded, at least one when the fraction is > 0): disjoint, so held-out
    prompts are (colour, shape, direction) combinations never trained on."""
    everything = [s.caption() for s in enumerate_prompts()]
    if not 1 <= num_prompts <= len(everything):
        raise ValueError(f"num_prompts must be in 1..{len(everything)} (the motion grammar's distinct prompts), "
                         f"got {num_prompts}")
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out must be a fraction in [0, 1), got {held_out}")
    order = np.random.default_rng(seed).permutation(len(everything))[:num_prompts]
    n_out = max(1, int(round(held_out * num_prompts))) if held_out > 0 else 0
    if n_out >= num_prompts:
        raise ValueError(f"held_out {held_out} of {num_prompts} prompts leaves none to train on")
    return {"train": [everything[i] for i in sorted(order[n_out:])],
            "held_out": [everything[i] for i in sorted(order[:n_out])]}


def write_prompt_split(out_dir: str, num_prompts: int, seed: int = 0, held_out: float = 0.2) -> Dict[str, str]:
    """Write `split_prompts` as `out_dir`/train.txt and `out_dir`/held_out.txt (one prompt per line,
    `mm_grpo.data.prompts.read_prompts`'s format); returns {split: path}."""
    return write_prompt_files(out_dir, split_prompts(num_prompts, seed, held_out))


def pretraining_split(seed: int = 0, held_out: float = PRETRAIN_HELD_OUT) -> Dict[str, List[str]]:
    """Every prompt of the grammar in one of `pretrain`, `grpo` and `eval`: `split_prompts`' held-out
    share (never pretrained on) halved at random (seeded) between GRPO training and evaluation, so
    both are (colour, shape, direction) combinations the pretrained model has not seen."""
    split = split_prompts(len(enumerate_prompts()), seed, held_out)
    kept_out = split["held_out"]
    if len(kept_out) < 2:
        raise ValueError(f"held_out {held_out} keeps {len(kept_out)} prompt out of pretraining: "
                         "need 2 or more (one for GRPO, one for evaluation)")
    order = np.random.default_rng([seed, len(kept_out)]).permutation(len(kept_out))
    half = len(kept_out) // 2
    return {"pretrain": split["train"], "grpo": sorted(kept_out[i] for i in order[:half]),
            "eval": sorted(kept_out[i] for i in order[half:])}


# --- videos ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Motion:
    """A straight-line path: the object's centre goes from `start` to `end` (pixels) at constant speed."""

    color: str
    shape: str
    background: str
    size: int  # side of the object's bounding box, pixels
    start: Tuple[float, float]
    end: Tuple[float, float]

    def centres(self, num_frames: int) -> List[Tuple[float, float]]:
        """Centre in each frame: `start` in the first, `end` in the last."""
        t = np.linspace(0.0, 1.0, num_frames) if num_frames > 1 else np.zeros(1)
        (x0, y0), (x1, y1) = self.start, self.end
        return [(float(x0 + (x1 - x0) * s), float(y0 + (y1 - y0) * s)) for s in t]


def default_sizes(image_size: int) -> Tuple[int, int]:
    """(min, max) object side: 3/8 of the frame and 2 px more (12..14 px at 32 px, the shapes data's
    sizes; at 10 px the compositional detector takes some anti-aliased circles for squares)."""
    low = round(0.375 * image_size)
    return low, low + 2


def sample_motion(spec: MotionSpec, rng: np.random.Generator, image_size: int = 32, travel: Optional[float] = None,
                  background: Optional[str] = None) -> Motion:
    """A random path that satisfies `spec` inside the frame: the object (side from `default_sizes`)
    moves along the prompt's direction by `travel` x the frame side, or, if None, a random
    distance from `MIN_TRAVEL` x side to as far as the frame allows (0: a static object). The
    background is the prompt's, else `background`, else drawn at random."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} pixels, got {image_size}")
    if background is not None and background not in BACKGROUNDS:
        raise ValueError(f"background must be one of {', '.join(BACKGROUNDS)}, got {background!r}")
    low, high = default_sizes(image_size)
    size = int(rng.integers(low, high + 1))
    lo, hi = size / 2 + 1, image_size - size / 2 - 1  # centre range that keeps the object inside
    room = hi - lo
    if travel is None:
        distance = float(rng.uniform(MIN_TRAVEL * image_size, room))
    elif 0 <= travel * image_size <= room:
        distance = float(travel * image_size)
    else:
        raise ValueError(f"travel must be in [0, {room / image_size:.3f}] of the frame for {image_size} px, "
                         f"got {travel}")
    ux, uy = DIRECTIONS[spec.direction]
    along = float(rng.uniform(lo, hi - distance))  # start coordinate on the moving axis, before orienting
    across = float(rng.uniform(lo, hi))
    a0, a1 = (along, along + distance) if ux + uy > 0 else (hi - (along - lo), hi - (along - lo) - distance)
    start, end = ((a0, across), (a1, across)) if ux else ((across, a0), (across, a1))
    background = spec.background or background or list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    return Motion(spec.color, spec.shape, background, size, start, end)


def motion_frames(motion: Motion, num_frames: int = 16, image_size: int = 32, supersample: int = 4) -> np.ndarray:
    """The frames of `motion`: uint8 [num_frames, image_size, image_size, 3], each drawn by the
    shapes renderer (anti-aliased)."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    frames = []
    for cx, cy in motion.centres(num_frames):
        scene = Scene(motion.background, (PlacedObject(motion.color, motion.shape, cx, cy, motion.size),))
        frames.append(np.asarray(render(scene, image_size, supersample)))
    return np.stack(frames)


def render_motion(motion: Motion, num_frames: int = 16, image_size: int = 32, supersample: int = 4) -> torch.Tensor:
    """The video of `motion`: float32 [num_frames, 3, image_size, image_size] in [0, 1]."""
    frames = motion_frames(motion, num_frames, image_size, supersample)
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255


def render_video(prompt: str, num_frames: int = 16, image_size: int = 32, seed: int = 0,
                 travel: Optional[float] = None, background: Optional[str] = None) -> torch.Tensor:
    """A video [F, 3, H, W] of `prompt` (a path from `sample_motion`, seeded by `seed`)."""
    spec = MotionSpec.parse(prompt)
    motion = sample_motion(spec, np.random.default_rng(seed), image_size, travel, background)
    return render_motion(motion, num_frames, image_size)


# --- a video-caption dataset ---------------------------------------------------------------
def make_video_example(index: int, seed: int, prompts: Sequence[str], num_frames: int, image_size: int):
    """(filmstrip PIL image, metadata row) of video `index`: a prompt drawn from `prompts` and a
    path from `sample_motion`; depends on (seed, index) only."""
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    spec = MotionSpec.parse(prompts[rng.integers(len(prompts))])
    motion = sample_motion(spec, rng, image_size)
    row = {"text": spec.caption(), "num_frames": num_frames, "background": motion.background, "size": motion.size,
           "start": list(motion.start), "end": list(motion.end)}
    return Image.fromarray(filmstrip(motion_frames(motion, num_frames, image_size))), row


def generate_videos(out: str, num_videos: int, num_frames: int = 9, image_size: int = 32, seed: int = 0,
                    exclude: Sequence[str] = ()) -> str:
    """A video-caption folder (`mm_grpo.data.image_captions`: `out`/videos/*.png filmstrips,
    metadata.jsonl, dataset.json) of `num_videos` motion videos whose captions are the grammar's
    prompts (a random background each) other than those in `exclude`, drawn uniformly."""
    if num_videos < 1:
        raise ValueError(f"num_videos must be >= 1, got {num_videos}")
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2 (motion needs two frames), got {num_frames}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIZE} pixels, got {image_size}")
    excluded = {MotionSpec.parse(p).caption() for p in exclude}
    prompts = [s.caption() for s in enumerate_prompts() if s.caption() not in excluded]
    if not prompts:
        raise ValueError("no motion prompts left to draw: every prompt of the grammar is excluded")
    info = {"generator": "mm_grpo.data.motion", "num_videos": num_videos, "num_frames": num_frames,
            "image_size": image_size, "seed": seed, "num_excluded": len(excluded), "prompts": prompts}
    examples = (make_video_example(i, seed, prompts, num_frames, image_size) for i in range(num_videos))
    return write_caption_folder(out, examples, info, subfolder="videos")


# --- command line ------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mm_grpo.data.motion", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    split = sub.add_parser("split", help="write train.txt and held_out.txt (disjoint motion prompts)")
    split.add_argument("--num-prompts", type=int, default=len(enumerate_prompts()))
    split.add_argument("--held-out", type=float, default=0.2, help="fraction of the prompts held out")
    pretrain = sub.add_parser("pretrain-split", help="write pretrain.txt, grpo.txt and eval.txt (every prompt, "
                                                     "disjoint)")
    pretrain.add_argument("--held-out", type=float, default=PRETRAIN_HELD_OUT,
                          help="fraction kept out of pretraining, halved between GRPO and evaluation")
    for p in (split, pretrain):
        p.add_argument("--out", required=True, help="folder for the prompt files")
    generate = sub.add_parser("generate", help="write a video-caption folder (filmstrip PNGs)")
    generate.add_argument("--out", required=True, help="dataset folder to create (must not exist)")
    generate.add_argument("--num-videos", type=int, required=True)
    generate.add_argument("--num-frames", type=int, default=9)
    generate.add_argument("--image-size", type=int, default=32)
    generate.add_argument("--exclude", nargs="*", default=(), help="never draw a prompt listed in these files")
    for p in (split, pretrain, generate):
        p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            exclude = [prompt for path in args.exclude for prompt in read_prompts(path)]
            print(generate_videos(args.out, args.num_videos, args.num_frames, args.image_size, args.seed, exclude))
            return
        if args.command == "split":
            split = split_prompts(args.num_prompts, args.seed, args.held_out)
        else:
            split = pretraining_split(args.seed, args.held_out)
        for name, path in write_prompt_files(args.out, split).items():
            print(f"{name}: {len(split[name])} prompts -> {path}")
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
