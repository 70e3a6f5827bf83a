"""A rule-based compositional reward (GenEval in miniature) for the shapes grammar.

The image is segmented by colour (each pixel takes its nearest palette colour), each object
colour's mask is split into connected components, and each component large enough is an
object whose shape follows from two numbers of its pixel set: triangles have their centroid
well below the middle of their bounding box (by 1/6 of the height, upright), squares fill
their box, circles fill pi/4 of it. The prompt (parsed with `shapes.PromptSpec`) is then
checked atom by atom, as GenEval checks its tasks:

    per object group   present (>= 1 of that colour and shape), exact count
    relation           the largest instances' centres are offset the right way (GenEval's
                       lenient rule: the other axis is not looked at)
    nothing else       objects were found, and none of a colour and shape the prompt does not name
                       (so an empty image scores 0)
    background         the most frequent neutral colour, if the prompt names one

`compositional` is the fraction of atoms met (a dense reward for GRPO);
`compositional_accuracy` is 1 when all are met (GenEval's accuracy). `compositional_f1` is
the objects' F1 (named instances matched one to one by colour and shape) halved for a
missed relation or background: partial credit that extra or mis-bound objects cannot buy
(with the atom fraction, drawing more objects gains "present" atoms at the cost of one
"nothing else"). `compositional_geneval` is flow_grpo's GenEval training reward
(`geneval_score`: partial credit for counts and colours). All four are 1 when the prompt is met
(the GenEval score looks at neither unnamed objects nor the background). No weights.

    python -m mm_grpo.rewards.compositional --prompts eval.txt [--pipeline DIR]   # chance and ceilings
"""
import argparse
import collections
import os
import dataclasses
import weakref
from typing import List, NamedTuple, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from mm_grpo.data.shapes import BACKGROUNDS, COLORS, RELATIONS, PromptSpec
from mm_grpo.rewards.base import Reward, register_reward


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    max_color_distance: float = 60.0  # RGB (0..255) distance beyond which a pixel is no palette colour
    min_area: int = 24  # pixels; the smallest drawn object (a 14 px triangle) has about 98
    min_side: int = 6  # bounding-box pixels; thinner blobs are anti-aliased edges of another colour
    min_fill: float = 0.3  # area / box area below which a blob is no shape (a triangle fills 0.5)
    square_fill: float = 0.87  # area / box area at or above which a blob is a square (ideal 1.0, circle 0.785)
    triangle_drop: float = 0.07  # (centroid y - box centre y) / box height above which: triangle (ideal 1/6)
    relation_margin: float = 2.0  # pixels


@dataclasses.dataclass(frozen=True)
class Detection:
    color: str
    shape: str
    cx: float
    cy: float
    area: int


def _palette(device):
    names = list(COLORS) + list(BACKGROUNDS)
    return names, torch.tensor([*COLORS.values(), *BACKGROUNDS.values()], dtype=torch.float32, device=device)


def _grow(labels, on):
    """3x3 max of labels [N, H, W] (separable, zero padded), kept on the mask only."""
    p = F.pad(labels, (1, 1, 1, 1))
    rows = torch.maximum(torch.maximum(p[:, :-2], p[:, 1:-1]), p[:, 2:])
    return torch.maximum(torch.maximum(rows[:, :, :-2], rows[:, :, 1:-1]), rows[:, :, 2:]) * on


def _components(masks: torch.Tensor) -> torch.Tensor:
    """Connected components (8-neighbourhood) of boolean masks [N, H, W] -> labels [N, H, W]
    (0 = off; a component is labelled by its largest flat pixel index + 1).

    Label propagation: every pixel takes the largest label around it, then the label found at
    the pixel its label names (pointer jumping; that pixel is in the same component), which
    needs a logarithmic rather than linear number of rounds in the component's size."""
    n, h, w = masks.shape
    on = masks.to(torch.int32)
    labels = torch.arange(1, h * w + 1, dtype=torch.int32, device=masks.device).view(1, h, w) * on
    while True:
        flat = _grow(labels, on).view(n, h * w)
        jumped = torch.gather(flat, 1, (flat - 1).clamp(min=0).long()) * on.view(n, h * w)
        grown = torch.maximum(flat, jumped).view(n, h, w)
        if torch.equal(grown, labels):
            return labels.long()
        labels = grown


def detect(images: torch.Tensor, cfg: DetectorConfig = DetectorConfig()) -> Tuple[List[List[Detection]], List[str]]:
    """Objects and the background colour of images [B, 3, H, W] in [0, 1]."""
    b, _, h, w = images.shape
    names, palette = _palette(images.device)
    n_obj = len(COLORS)
    pixels = images.float().permute(0, 2, 3, 1) * 255  # [B, H, W, 3]
    dist = torch.cdist(pixels.reshape(b, h * w, 3), palette.expand(b, -1, -1))  # [B, HW, K]
    nearest = dist.argmin(-1).view(b, h, w)
    close = dist.min(-1).values.view(b, h, w) <= cfg.max_color_distance
    counts = F.one_hot(nearest.flatten(1), len(names)).sum(1)  # [B, K] pixels per palette colour
    backgrounds = [names[n_obj + int(i)] for i in counts[:, n_obj:].argmax(-1)]
    masks = (nearest.unsqueeze(1) == torch.arange(n_obj, device=images.device).view(1, -1, 1, 1)) & close.unsqueeze(1)
    masks = masks.view(b * n_obj, h, w)
    labels = torch.zeros(b * n_obj, h * w, dtype=torch.long, device=images.device)
    used = masks.flatten(1).any(1)  # most colours are absent from most images
    labels[used] = _components(masks[used]).view(-1, h * w)
    found: List[List[Detection]] = [[] for _ in range(b)]
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    ys, xs = ys.flatten().to(images.device), xs.flatten().to(images.device)
    rows, cols = labels.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return found, backgrounds
    keys, inverse = torch.unique(rows * (h * w + 1) + labels[rows, cols], return_inverse=True)
    k = keys.numel()
    area = torch.zeros(k, device=images.device).index_add_(0, inverse, torch.ones_like(xs[cols]))
    cx = torch.zeros(k, device=images.device).index_add_(0, inverse, xs[cols]) / area
    cy = torch.zeros(k, device=images.device).index_add_(0, inverse, ys[cols]) / area
    box = [torch.full((k,), float(init), device=images.device).scatter_reduce(0, inverse, v, op, include_self=True)
           for v, op, init in ((xs[cols], "amin", w), (xs[cols], "amax", -1), (ys[cols], "amin", h),
                               (ys[cols], "amax", -1))]
    box_w, box_h = box[1] - box[0] + 1, box[3] - box[2] + 1
    fill = area / (box_w * box_h)
    drop = (cy - (box[2] + box[3]) / 2) / box_h
    owner = (keys // (h * w + 1)).tolist()
    side = torch.minimum(box_w, box_h)
    for j, (a, x, y, f, d, m) in enumerate(zip(area.tolist(), cx.tolist(), cy.tolist(), fill.tolist(), drop.tolist(),
                                               side.tolist())):
        if a < cfg.min_area or m < cfg.min_side or f < cfg.min_fill:
            continue
        shape = "triangle" if d > cfg.triangle_drop else "square" if f >= cfg.square_fill else "circle"
        found[owner[j] // n_obj].append(Detection(names[owner[j] % n_obj], shape, x + 0.5, y + 0.5, int(a)))
    return found, backgrounds


def relation_met(a: Detection, b: Detection, relation: str, margin: float) -> bool:
    axis, sign = RELATIONS[relation]
    return sign * ((a.cx - b.cx), (a.cy - b.cy))[axis] > margin


def _instances(group, objects: Sequence[Detection]) -> List[Detection]:
    """The detections of a prompt's object group (same colour and shape)."""
    return [o for o in objects if (o.color, o.shape) == (group.color, group.shape)]


def _relation_atom(spec: PromptSpec, objects: Sequence[Detection], cfg: DetectorConfig) -> bool:
    largest = [max(_instances(g, objects), key=lambda o: o.area, default=None) for g in spec.objects]
    return None not in largest and relation_met(*largest, spec.relation, cfg.relation_margin)


def check(spec: PromptSpec, objects: Sequence[Detection], background: str,
          cfg: DetectorConfig = DetectorConfig()) -> List[bool]:
    """The prompt's atoms, each met or not (see the module docstring)."""
    atoms = []
    for group in spec.objects:
        n = len(_instances(group, objects))
        atoms += [n >= 1, n == group.count]
    if spec.relation:
        atoms.append(_relation_atom(spec, objects, cfg))
    named = {(g.color, g.shape) for g in spec.objects}
    atoms.append(bool(objects) and all((o.color, o.shape) in named for o in objects))
    if spec.background:
        atoms.append(background == spec.background)
    return atoms


def f1_score(spec: PromptSpec, objects: Sequence[Detection], atoms: Sequence[bool]) -> float:
    """F1 of the objects (2 matched / (found + named)), x 1/2 for each scene atom of `check`'s
    `atoms` (relation, background) missed."""
    matched = sum(min(group.count, len(_instances(group, objects))) for group in spec.objects)
    named = sum(group.count for group in spec.objects)
    met = dict(zip(atom_names(spec), atoms))
    missed = sum(not met[name] for name in ("relation", "background") if name in met)
    return 2 * matched / (len(objects) + named) * 0.5 ** missed


def geneval_score(spec: PromptSpec, objects: Sequence[Detection], cfg: DetectorConfig = DetectorConfig()) -> float:
    """flow_grpo's GenEval training reward (the `score` of yifan123/reward-server,
    reward_server/gen_eval.py `evaluate_reward`) with the shape as GenEval's object class and the
    colour as its colour attribute: the mean of partial credits, per object group of the prompt

        count     1 - |count - found| / count    (found: every detection of the group's shape)
        colour    1 - |count - found in the colour| / count, or 0 when the count is wrong
        relation  (on the first group, against the second, both counts and colours right)
                  1 if every pair of their objects stands in the relation, else 0 and 1: the
                  authors' code appends its 1 after a miss too

    A relation prompt's groups are taken second first, as GenEval's metadata lists them (the
    related object last, its target first). Credits can be negative (found > 2 x count); objects the
    prompt does not name and the background do not enter, as in the authors' reward."""
    groups = list(spec.objects[::-1]) if spec.relation else list(spec.objects)
    credits, matched = [], []
    for group in groups:
        found = [o for o in objects if o.shape == group.shape]
        credits.append(1 - abs(group.count - len(found)) / group.count)
        if len(found) != group.count:
            credits.append(0.0)
            matched.append(None)
            continue
        colored = sum(o.color == group.color for o in found)
        credits.append(1 - abs(group.count - colored) / group.count)
        ok = colored == group.count
        if ok and spec.relation and group is groups[-1]:
            target = matched[0]
            if target is None:
                credits.append(0.0)
                ok = False
            else:
                if not all(relation_met(a, b, spec.relation, cfg.relation_margin) for a in found for b in target):
                    credits.append(0.0)
                    ok = False
                credits.append(1.0)
        matched.append(found if ok else None)
    return sum(credits) / len(credits)


def atom_names(spec: PromptSpec) -> List[str]:
    """Names of `check`'s atoms, in its order."""
    names = ["present", "count"] * len(spec.objects) + (["relation"] if spec.relation else []) + ["nothing else"]
    return names + (["background"] if spec.background else [])


def breakdown(images: torch.Tensor, prompts: Sequence[str], cfg: DetectorConfig = DetectorConfig()):
    """{name: (rate, number of cases)}: how often each atom is met, prompts met per family, and,
    for two-object prompts, how many of the two named objects were drawn (0, 1, 2) and how
    often objects the prompt does not name were drawn too."""
    tally = collections.defaultdict(lambda: [0, 0])

    def add(name, met):
        tally[name][0] += bool(met)
        tally[name][1] += 1

    objects, backgrounds = detect(images, cfg)
    for prompt, found, background in zip(prompts, objects, backgrounds):
        spec = PromptSpec.parse(prompt)
        atoms = check(spec, found, background, cfg)
        for name, met in zip(atom_names(spec), atoms):
            add(f"atom: {name}", met)
        add(f"accuracy: {spec.family}", all(atoms))
        if len(spec.objects) == 2:
            kinds = {(o.color, o.shape) for o in found}
            drawn = sum((g.color, g.shape) in kinds for g in spec.objects)
            for n in range(3):
                add(f"two objects: {n} named drawn", drawn == n)
            add("two objects: others drawn too", len(kinds - {(g.color, g.shape) for g in spec.objects}) > 0)
    return {name: (met / n, n) for name, (met, n) in sorted(tally.items())}


class Scores(NamedTuple):
    fraction: torch.Tensor  # [B] atoms met / atoms
    accuracy: torch.Tensor  # [B] 1 if all atoms are met
    f1: torch.Tensor  # [B] `f1_score`
    geneval: torch.Tensor  # [B] `geneval_score`


def score(images: torch.Tensor, prompts: Sequence[str], cfg: DetectorConfig = DetectorConfig()) -> Scores:
    """The three scores of each image (float32)."""
    specs = [PromptSpec.parse(p) for p in prompts]
    objects, backgrounds = detect(images, cfg)
    atoms = [check(s, o, bg, cfg) for s, o, bg in zip(specs, objects, backgrounds)]
    frac = torch.tensor([sum(a) / len(a) for a in atoms], dtype=torch.float32)
    f1 = torch.tensor([f1_score(s, o, a) for s, o, a in zip(specs, objects, atoms)], dtype=torch.float32)
    geneval = torch.tensor([geneval_score(s, o, cfg) for s, o in zip(specs, objects)], dtype=torch.float32)
    return Scores(frac, torch.tensor([float(all(a)) for a in atoms]), f1, geneval)


class _LastScores:
    """`score` of the last images seen: the compositional rewards of one `CombinedReward` get the
    same tensor, and detection is the costly part. Keyed by the tensor itself (a weak
    reference, so no batch is kept alive), its in-place version counter and the prompts."""

    def __init__(self):
        self.images, self.key, self.scores = lambda: None, None, None

    def __call__(self, images, prompts) -> Scores:
        key = (images._version, tuple(prompts))
        if self.images() is not images or self.key != key:
            self.images, self.key, self.scores = weakref.ref(images), key, score(images, prompts)
        return self.scores


_last_scores = _LastScores()


class _ShapesReward(Reward):
    def check_prompts(self, prompts):
        for prompt in dict.fromkeys(prompts):
            PromptSpec.parse(prompt)  # a ValueError names a prompt outside the shapes grammar


@register_reward("compositional")
class CompositionalReward(_ShapesReward):
    """Fraction of the prompt's atoms met, in [0, 1]."""

    def score(self, images, prompts):
        return _last_scores(images, prompts).fraction


@register_reward("compositional_accuracy")
class CompositionalAccuracy(_ShapesReward):
    """1 if every atom of the prompt is met, else 0 (GenEval's per-image accuracy)."""

    def score(self, images, prompts):
        return _last_scores(images, prompts).accuracy


@register_reward("compositional_f1")
class CompositionalF1(_ShapesReward):
    """Objects' F1 against the prompt, halved per missed relation or background, in [0, 1]."""

    def score(self, images, prompts):
        return _last_scores(images, prompts).f1


@register_reward("compositional_geneval")
class CompositionalGenEval(_ShapesReward):
    """flow_grpo's GenEval training reward on the shapes detector (`geneval_score`), in [-1, 1]."""

    def score(self, images, prompts):
        return _last_scores(images, prompts).geneval


# --- reference levels ------------------------------------------------------------------
def reference_levels(prompts: Sequence[str], samples: int = 4, seed: int = 0, config=None, draw_from=None,
                     vae=None):
    """{level: (mean fraction, accuracy)} over `samples` images per prompt.

    ceiling: each prompt scored on images the generator draws for it (what the detector can
    confirm at best). vae_ceiling (with a diffusers `vae`): the same images encoded and decoded,
    what a model that makes perfect latents could reach. chance: each prompt scored on images
    drawn for a random caption of `draw_from` (default: all captions of the grammar), i.e. a
    model that draws in-distribution scenes but ignores the prompt."""
    from mm_grpo.data.shapes import CaptionSampler, ShapesConfig, render, sample_scene
    config = config or ShapesConfig()
    other = CaptionSampler(config, draw_from)
    asked = [p for p in prompts for _ in range(samples)]
    drawn = {}
    for name in ("ceiling", "chance"):
        images = []
        for i, prompt in enumerate(prompts):
            for j in range(samples):
                rng = np.random.default_rng([seed, i, j, name == "chance"])
                spec = PromptSpec.parse(prompt) if name == "ceiling" else other(rng)
                images.append(torch.from_numpy(np.array(render(sample_scene(spec, rng, config), config.image_size))))
        drawn[name] = torch.stack(images).permute(0, 3, 1, 2).float() / 255
    if vae is not None:
        with torch.no_grad():
            x = drawn["ceiling"] * 2 - 1
            drawn["vae_ceiling"] = (vae.decode(vae.encode(x).latent_dist.mode()).sample * 0.5 + 0.5).clamp(0, 1)
    out = {}
    for name in ("ceiling", "vae_ceiling", "chance"):
        if name in drawn:
            scores = score(drawn[name], asked)
            out[name] = (scores.fraction.mean().item(), scores.accuracy.mean().item())
    return out


def main(argv=None):
    from mm_grpo.data.prompts import read_prompts
    parser = argparse.ArgumentParser(prog="python -m mm_grpo.rewards.compositional",
                                     description="chance level and ceilings of the compositional reward")
    parser.add_argument("--prompts", nargs="+", required=True, help="prompt files (the evaluation prompts)")
    parser.add_argument("--samples", type=int, default=4, help="images per prompt")
    parser.add_argument("--pipeline", default=None, help="diffusers pipeline folder: also the ceiling through its VAE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    vae = None
    if args.pipeline:
        from diffusers import AutoencoderKL  # the pipeline's own VAE, whatever its family
        vae = AutoencoderKL.from_pretrained(os.path.join(args.pipeline, "vae")).eval().requires_grad_(False)
    prompts = [p for f in args.prompts for p in read_prompts(f)]
    for name, (frac, acc) in reference_levels(prompts, args.samples, args.seed, vae=vae).items():
        print(f"{name}: compositional {frac:.4f}  accuracy {acc:.4f}  ({len(prompts)} prompts x {args.samples})")


if __name__ == "__main__":
    main()
