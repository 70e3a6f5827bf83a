"""Synthetic compositional image-caption data: coloured shapes on plain backgrounds.

Captions follow a small grammar (GenEval in miniature) with four families:

    single     "a red circle"
    count      "three blue squares"
    pair       "a red circle and a blue square"
    relation   "a red circle above a blue square" (below, to the left of, to the right of)

optionally followed by "on a white background". A caption parses back into a `PromptSpec`,
which is what the compositional reward checks an image against. Every image is drawn from
its own generator seeded by (seed, index), so a dataset is reproducible image by image.

    python -m mm_grpo.data.shapes split --out PROMPTS_DIR [--seed 0]
    python -m mm_grpo.data.shapes generate --out DATA_DIR --num-images 20000 [--exclude FILE ...]
"""
import argparse
import dataclasses
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_grpo.data.image_captions import write_caption_folder
from mm_grpo.data.prompts import write_prompt_files
from mm_grpo.settings import add_setting_args, from_args, setting

# Five hues around the colour wheel and two neutral backgrounds: any two of the seven are at
# least 150 apart in RGB, so nearest-colour classification survives a lossy tiny VAE (with a
# sixth hue, cyan, and a gray background, the tiny VAE mixed up the blue-green hues).
COLORS = {"red": (220, 40, 40), "yellow": (235, 200, 30), "green": (40, 170, 60), "blue": (45, 70, 220),
          "pink": (230, 60, 190)}
BACKGROUNDS = {"white": (240, 240, 240), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
# relation -> (axis, sign): "A above B" means A's centre is above B's (smaller y).
RELATIONS = {"above": (1, -1), "below": (1, 1), "left of": (0, -1), "right of": (0, 1)}
RELATION_PHRASES = {"above": "above", "below": "below", "left of": "to the left of", "right of": "to the right of"}
NUMBERS = {1: "a", 2: "two", 3: "three", 4: "four"}
FAMILIES = ("single", "count", "pair", "relation")


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
    """What the generator may draw (plain data; its fields are `python -m mm_grpo.data.shapes`'s flags)."""

    image_size: int = setting(64, "side of the square images in pixels")
    colors: Tuple[str, ...] = setting(tuple(COLORS), "comma-separated, from " + ",".join(COLORS), sep=",")
    shapes: Tuple[str, ...] = setting(SHAPES, "comma-separated, from " + ",".join(SHAPES), sep=",")
    backgrounds: Tuple[str, ...] = setting(tuple(BACKGROUNDS), "comma-separated, from " + ",".join(BACKGROUNDS),
                                           sep=",")
    relations: Tuple[str, ...] = setting(tuple(RELATIONS), "comma-separated, from " + ",".join(RELATIONS), sep=",")
    max_count: int = setting(3, "the count family uses 2..max-count objects")
    grid: int = setting(4, "objects centred in cells of a grid x grid partition (0: anywhere)")
    min_size: int = setting(12, "object side / diameter in pixels, at least")
    max_size: int = setting(14, "object side / diameter in pixels, at most")
    family_weights: Tuple[float, ...] = setting((1.0, 1.0, 1.0, 2.0), "weights of " + ",".join(FAMILIES), sep=",")
    caption_background: bool = setting(False, 'add "on a <background> background" to captions')
    gap: int = 2  # pixels between the bounding boxes of two objects

    def __post_init__(self):
        for field, known in (("colors", COLORS), ("backgrounds", BACKGROUNDS), ("shapes", SHAPES),
                             ("relations", RELATIONS)):
            values = getattr(self, field)
            object.__setattr__(self, field, tuple(values))
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "none given"
                raise ValueError(f"{field}: {what}; choose from {', '.join(known)}")
        if not 1 <= self.max_count <= max(NUMBERS):
            raise ValueError(f"max_count must be in 1..{max(NUMBERS)}, got {self.max_count}")
        if not 4 <= self.min_size <= self.max_size <= self.image_size // 2:
            raise ValueError(f"need 4 <= min_size <= max_size <= image_size / 2, got {self.min_size}, "
                             f"{self.max_size} for image_size {self.image_size}")
        if self.grid and (self.grid ** 2 < self.max_count + 1 or self.max_size + self.gap > self.image_size / self.grid):
            raise ValueError(f"a {self.grid}x{self.grid} grid on {self.image_size}px needs cells of at least max_size "
                             f"+ gap = {self.max_size + self.gap}px and room for max_count {self.max_count} objects")
        if len(self.family_weights) != len(FAMILIES) or min(self.family_weights) < 0 or not any(self.family_weights):
            raise ValueError(f"family_weights needs {len(FAMILIES)} weights >= 0 ({', '.join(FAMILIES)}), "
                             f"not all 0, got {self.family_weights}")
        object.__setattr__(self, "family_weights", tuple(float(w) for w in self.family_weights))


# --- captions ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ObjectSpec:
    color: str
    shape: str
    count: int = 1

    def phrase(self) -> str:
        return f"{NUMBERS[self.count]} {self.color} {self.shape}{'s' if self.count > 1 else ''}"


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """What a caption asks for: one or two object groups, a relation between them, a background."""

    objects: Tuple[ObjectSpec, ...]
    relation: Optional[str] = None  # a key of RELATIONS, between objects[0] and objects[1]
    background: Optional[str] = None

    @property
    def family(self) -> str:
        if len(self.objects) == 2:
            return "relation" if self.relation else "pair"
        return "count" if self.objects[0].count > 1 else "single"

    def caption(self) -> str:
        text = self.objects[0].phrase()
        if len(self.objects) == 2:
            link = RELATION_PHRASES[self.relation] if self.relation else "and"
            text += f" {link} {self.objects[1].phrase()}"
        if self.background:
            text += f" on a {self.background} background"
        return text

    @classmethod
    def parse(cls, caption: str) -> "PromptSpec":
        """The inverse of `caption`; a caption outside the grammar is a ValueError."""
        match = _CAPTION.fullmatch(" ".join(caption.lower().split()))
        if not match:
            raise ValueError(f"caption {caption!r} is not in the shapes grammar (e.g. 'a red circle above "
                             f"a blue square', 'two green triangles')")
        objects = [_parse_object(match["first"], caption)]
        relation = None
        if match["second"]:
            objects.append(_parse_object(match["second"], caption))
            if match["link"] != "and":
                relation = {v: k for k, v in RELATION_PHRASES.items()}[match["link"]]
        return cls(tuple(objects), relation, match["background"])


_WORD = {v: k for k, v in NUMBERS.items()}
_WORD["an"] = 1
_OBJECT = rf"(?:{'|'.join(_WORD)}) (?:{'|'.join(COLORS)}) (?:{'|'.join(SHAPES)})s?"
_CAPTION = re.compile(
    rf"(?P<first>{_OBJECT})(?: (?P<link>and|{'|'.join(RELATION_PHRASES.values())}) (?P<second>{_OBJECT}))?"
    rf"(?: on an? (?P<background>{'|'.join(BACKGROUNDS)}) background)?")


def _parse_object(phrase: str, caption: str) -> ObjectSpec:
    number, color, shape = phrase.split()
    count = _WORD[number]
    if (count > 1) != shape.endswith("s"):
        raise ValueError(f"caption {caption!r}: number and plural disagree in {phrase!r}")
    return ObjectSpec(color, shape.rstrip("s") if count > 1 else shape, count)


def enumerate_prompts(config: ShapesConfig = ShapesConfig()) -> Dict[str, List[PromptSpec]]:
    """Every caption the grammar allows under `config`, by family (backgrounds left out)."""
    kinds = [ObjectSpec(c, s) for c in config.colors for s in config.shapes]
    pairs = [(a, b) for a in kinds for b in kinds if a != b]
    return {
        "single": [PromptSpec((k,)) for k in kinds],
        "count": [PromptSpec((ObjectSpec(k.color, k.shape, n),)) for n in range(2, config.max_count + 1) for k in kinds],
        "pair": [PromptSpec(p) for p in pairs],
        "relation": [PromptSpec(p, r) for r in config.relations for p in pairs],
    }


def grammar_corpus(config: ShapesConfig = ShapesConfig()):
    """Every caption of the grammar, and each once with every background phrase."""
    captions = [s.caption() for family in enumerate_prompts(config).values() for s in family]
    return captions + [f"a red circle on a {b} background" for b in BACKGROUNDS]


def split_prompts(config: ShapesConfig = ShapesConfig(), seed: int = 0, held_out: float = 0.2,
                  families: Sequence[str] = ("count", "pair", "relation")) -> Dict[str, List[str]]:
    """Captions split into `pretrain`, `grpo` and `eval`: in each family of `families` a random
    `held_out` fraction is kept out of pretraining and halved between GRPO training and evaluation."""
    rng = np.random.default_rng(seed)
    out = {"pretrain": [], "grpo": [], "eval": []}
    for family, specs in enumerate_prompts(config).items():
        captions = [s.caption() for s in specs]
        order = rng.permutation(len(captions))
        n_out = int(round(held_out * len(captions))) if family in families else 0
        n_eval = n_out // 2
        out["eval"] += [captions[i] for i in order[:n_eval]]
        out["grpo"] += [captions[i] for i in order[n_eval:n_out]]
        out["pretrain"] += [captions[i] for i in sorted(order[n_out:])]
    return out


# --- scenes ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlacedObject:
    color: str
    shape: str
    cx: float  # centre, pixels
    cy: float
    size: int  # side of the bounding box, pixels

    def box(self):
        h = self.size / 2
        return self.cx - h, self.cy - h, self.cx + h, self.cy + h


@dataclasses.dataclass(frozen=True)
class Scene:
    background: str
    objects: Tuple[PlacedObject, ...]


def _separated(a: PlacedObject, b: PlacedObject, gap: float) -> bool:
    ax0, ay0, ax1, ay1 = a.box()
    bx0, by0, bx1, by1 = b.box()
    return ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0


def relation_holds(a, b, relation: str, margin: float = 0.0) -> bool:
    """Centre of `a` is `relation` of the centre of `b` by more than `margin` pixels, along that
    relation's axis, which is also the larger of the two offsets."""
    axis, sign = RELATIONS[relation]
    offsets = (a.cx - b.cx, a.cy - b.cy)
    return sign * offsets[axis] > margin and abs(offsets[axis]) >= abs(offsets[1 - axis])


def sample_scene(spec: PromptSpec, rng: np.random.Generator, config: ShapesConfig = ShapesConfig(),
                 max_tries: int = 1000) -> Scene:
    """A random layout that satisfies `spec`: non-touching objects inside the canvas, each in
    its own grid cell (`config.grid`) or anywhere."""
    background = spec.background or config.backgrounds[rng.integers(len(config.backgrounds))]
    wanted = [(o.color, o.shape) for o in spec.objects for _ in range(o.count)]
    cell = config.image_size / config.grid if config.grid else None
    for _ in range(max_tries):
        placed = []
        cells = rng.permutation(config.grid ** 2)[:len(wanted)] if cell else [None] * len(wanted)
        for (color, shape), c in zip(wanted, cells):
            size = int(rng.integers(config.min_size, config.max_size + 1))
            if cell:
                x, y = (c % config.grid + 0.5) * cell, (c // config.grid + 0.5) * cell
            else:
                lo, hi = size / 2 + 1, config.image_size - size / 2 - 1
                x, y = rng.uniform(lo, hi), rng.uniform(lo, hi)
            placed.append(PlacedObject(color, shape, float(x), float(y), size))
        apart = all(_separated(a, b, config.gap) for i, a in enumerate(placed) for b in placed[i + 1:])
        if apart and (spec.relation is None or relation_holds(placed[0], placed[1], spec.relation)):
            return Scene(background, tuple(placed))
    raise ValueError(f"could not place {spec.caption()!r} on a {config.image_size}px canvas in {max_tries} tries: "
                     "use smaller objects or fewer of them")


def render(scene: Scene, image_size: int = 64, supersample: int = 4):
    """A PIL RGB image of the scene, anti-aliased by drawing at `supersample` x and averaging down."""
    from PIL import Image, ImageDraw

    big = image_size * supersample
    image = Image.new("RGB", (big, big), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        x0, y0, x1, y1 = (v * supersample for v in obj.box())
        fill = COLORS[obj.color]
        if obj.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:  # upright isosceles triangle filling its box: half the box's area
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image.resize((image_size, image_size), Image.BOX)


# --- datasets --------------------------------------------------------------------------
class CaptionSampler:
    """Draws captions: a family by `config.family_weights`, then a caption of it uniformly;
    from `prompts` only, if given, and never one in `exclude`."""

    def __init__(self, config: ShapesConfig = ShapesConfig(), prompts: Optional[Sequence[str]] = None,
                 exclude: Sequence[str] = ()):
        self.config = config
        excluded = {PromptSpec.parse(c).caption() for c in exclude}
        specs = ([PromptSpec.parse(p) for p in prompts] if prompts is not None
                 else [s for family in enumerate_prompts(config).values() for s in family])
        by_family = {f: [] for f in FAMILIES}
        for s in specs:
            if s.caption() not in excluded:
                by_family[s.family].append(s)
        weights = np.array([w if by_family[f] else 0.0 for f, w in zip(FAMILIES, config.family_weights)])
        if not weights.any():
            raise ValueError("no captions left to draw (all families empty or excluded)")
        self.families = [by_family[f] for f in FAMILIES]
        self.weights = weights / weights.sum()

    def __call__(self, rng: np.random.Generator) -> PromptSpec:
        family = self.families[rng.choice(len(FAMILIES), p=self.weights)]
        spec = family[rng.integers(len(family))]
        if self.config.caption_background and spec.background is None:
            spec = dataclasses.replace(spec, background=self.config.backgrounds[rng.integers(len(self.config.backgrounds))])
        return spec


def make_example(index: int, seed: int, sampler: CaptionSampler):
    """(PIL image, metadata row) of example `index`: depends on (seed, index) only."""
    rng = np.random.default_rng([seed, index])
    spec = sampler(rng)
    scene = sample_scene(spec, rng, sampler.config)
    row = {"text": spec.caption(), "background": scene.background,
           "objects": [dataclasses.asdict(o) for o in scene.objects]}
    return render(scene, sampler.config.image_size), row


def generate_dataset(out: str, num_images: int, seed: int = 0, config: ShapesConfig = ShapesConfig(),
                     prompts: Optional[Sequence[str]] = None, exclude: Sequence[str] = ()) -> str:
    """Write `out`/images/*.png and `out`/metadata.jsonl ({"file_name", "text", ...} per line,
    the layout of diffusers' image-folder datasets) and `out`/dataset.json (how it was made).
    Built in a temporary sibling folder and renamed, so `out` is never half-written."""
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    sampler = CaptionSampler(config, prompts, exclude)
    info = {"generator": "mm_grpo.data.shapes", "num_images": num_images, "seed": seed,
            "config": dataclasses.asdict(config), "num_excluded": len(exclude), "prompts_given": prompts is not None}
    return write_caption_folder(out, (make_example(i, seed, sampler) for i in range(num_images)), info)


def _read_lines(paths):
    lines = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt file not found: {path}")
        with open(path) as f:
            lines += [line.strip() for line in f if line.strip()]
    return lines


# --- command line ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SplitSettings:
    """`split`'s own flags."""
    held_out: float = setting(0.2, "fraction of each held-out family")
    held_out_families: Tuple[str, ...] = setting(("count", "pair", "relation"),
                                                 "comma-separated, from " + ",".join(FAMILIES), sep=",")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mm_grpo.data.shapes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write an image-caption dataset folder")
    gen.add_argument("--out", required=True, help="dataset folder to create (must not exist)")
    gen.add_argument("--num-images", type=int, required=True)
    gen.add_argument("--prompts", nargs="*", default=None, help="draw captions only from these prompt files")
    gen.add_argument("--exclude", nargs="*", default=(), help="never draw a caption listed in these files")
    split = sub.add_parser("split", help="write pretrain.txt, grpo.txt, eval.txt (disjoint captions)")
    split.add_argument("--out", required=True, help="folder for the three prompt files")
    add_setting_args(split, SplitSettings)
    for p in (gen, split):
        p.add_argument("--seed", type=int, default=0)
        add_setting_args(p, ShapesConfig)
    args = parser.parse_args(argv)
    try:
        config = from_args(ShapesConfig, args)
        if args.command == "generate":
            prompts = _read_lines(args.prompts) if args.prompts is not None else None
            print(generate_dataset(args.out, args.num_images, args.seed, config, prompts, _read_lines(args.exclude)))
        else:
            split = split_prompts(config, args.seed, args.held_out, args.held_out_families)
            for name in write_prompt_files(args.out, split):
                print(f"{name}: {len(split[name])} captions")
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
