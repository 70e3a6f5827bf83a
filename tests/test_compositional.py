"""The rule-based compositional reward against the generator's ground truth and crafted scenes."""
import collections
import math

import numpy as np
import pytest
import torch

from mm_grpo.data import shapes
from mm_grpo.data.shapes import CaptionSampler, PlacedObject, PromptSpec, Scene, render, sample_scene
from mm_grpo.rewards import CombinedReward, build_reward, compositional
from mm_grpo.rewards.compositional import _components, atom_names, breakdown, check, detect, reference_levels, score


def _pixels(*scenes):
    return torch.stack([torch.from_numpy(np.array(render(s))) for s in scenes]).permute(0, 3, 1, 2).float() / 255


def _bfs_partition(mask):
    """Reference: 8-connected components by breadth-first search -> set of frozensets of pixels."""
    h, w = mask.shape
    seen, parts = set(), set()
    for start in zip(*np.nonzero(mask)):
        if start in seen:
            continue
        queue, part = collections.deque([start]), set()
        seen.add(start)
        while queue:
            y, x = queue.popleft()
            part.add((y, x))
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    n = (y + dy, x + dx)
                    if 0 <= n[0] < h and 0 <= n[1] < w and mask[n] and n not in seen:
                        seen.add(n)
                        queue.append(n)
        parts.add(frozenset(part))
    return parts


def test_connected_components_match_breadth_first_search():
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(6, 24, 24, generator=g) < torch.tensor([0.2, 0.4, 0.5, 0.6, 0.0, 1.0]).view(6, 1, 1)
    labels = _components(masks)
    for mask, lab in zip(masks.numpy(), labels.numpy()):
        ours = {frozenset(zip(*np.nonzero(lab == v))) for v in np.unique(lab) if v}
        assert ours == _bfs_partition(mask)
        assert ((lab > 0) == mask).all()


def test_detector_recovers_every_object_of_generated_scenes():
    config = shapes.ShapesConfig()
    sampler = CaptionSampler(config)
    scenes, captions = [], []
    for i in range(200):
        rng = np.random.default_rng([11, i])
        spec = sampler(rng)
        scenes.append(sample_scene(spec, rng, config))
        captions.append(spec.caption())
    found, backgrounds = detect(_pixels(*scenes))
    for scene, objects, background in zip(scenes, found, backgrounds):
        assert background == scene.background
        assert len(objects) == len(scene.objects)
        for truth in scene.objects:
            match = min(objects, key=lambda o: (o.cx - truth.cx) ** 2 + (o.cy - truth.cy) ** 2)
            assert (match.color, match.shape) == (truth.color, truth.shape)
            # a triangle's centroid lies a sixth of its height below its box centre
            cy = truth.cy + (truth.size / 6 if truth.shape == "triangle" else 0)
            assert math.hypot(match.cx - truth.cx, match.cy - cy) < 1.0
    scores = score(_pixels(*scenes), captions)
    assert scores.fraction.tolist() == scores.accuracy.tolist() == scores.f1.tolist() == [1.0] * 200


def _scene(*objects, background="white"):
    return Scene(background, tuple(PlacedObject(c, s, x, y, 16) for c, s, x, y in objects))


PROMPT = "a red circle above a blue square"
CASES = [  # (scene, atoms: present/count red circle, present/count blue square, relation, nothing else; F1 score)
    (_scene(("red", "circle", 30, 12), ("blue", "square", 30, 45)), [True] * 6, 1.0),
    (_scene(("red", "circle", 30, 45), ("blue", "square", 30, 12)), [True] * 4 + [False, True], 0.5),  # below
    (_scene(("green", "circle", 30, 12), ("blue", "square", 30, 45)), [False, False, True, True, False, False],
     0.25),  # F1 1/2, relation missed
    (_scene(("red", "square", 30, 12), ("blue", "circle", 30, 45)), [False, False, False, False, False, False], 0.0),
    (_scene(("red", "circle", 12, 12), ("red", "circle", 50, 12), ("blue", "square", 30, 45)),
     [True, False, True, True, True, True], 0.8),  # two red circles: 2 matched of 3 found, 2 named
    (_scene(("red", "circle", 30, 12), ("blue", "square", 30, 45), ("yellow", "triangle", 52, 52)),
     [True] * 5 + [False], 0.8),  # an extra object
    (_scene(), [False] * 6, 0.0),  # nothing drawn scores 0
]
# flow_grpo's GenEval score of each case, by hand (square first, then the circle with the relation):
# met; relation missed (1, 1 | 1, 1, 0, 1); circle's colour wrong (1, 1 | 1, 0); both colours wrong;
# two circles for one (1, 1 | 0, 0); an extra object does not count; nothing drawn
GENEVAL_OF_CASES = [1.0, 5 / 6, 3 / 4, 1 / 2, 1 / 2, 1.0, 0.0]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_atoms_of_crafted_scenes(case):
    scene, expected, expected_f1 = CASES[case]
    objects, backgrounds = detect(_pixels(scene))
    assert check(PromptSpec.parse(PROMPT), objects[0], backgrounds[0]) == expected
    frac, acc, f1, geneval = score(_pixels(scene), [PROMPT])
    assert frac.item() == pytest.approx(sum(expected) / len(expected)) and acc.item() == float(all(expected))
    assert f1.item() == pytest.approx(expected_f1)
    assert geneval.item() == pytest.approx(GENEVAL_OF_CASES[case])


def test_breakdown_tallies_atoms_families_and_drawn_objects():
    stats = breakdown(_pixels(*(c[0] for c in CASES)), [PROMPT] * len(CASES))
    names = atom_names(PromptSpec.parse(PROMPT))
    for name in set(names):
        met = [m for _, atoms, _ in CASES for n, m in zip(names, atoms) if n == name]
        assert stats[f"atom: {name}"] == (pytest.approx(sum(met) / len(met)), len(met))
    assert stats["accuracy: relation"] == (pytest.approx(1 / 7), 7)
    drawn = [stats[f"two objects: {n} named drawn"][0] for n in range(3)]
    assert drawn == pytest.approx([2 / 7, 1 / 7, 4 / 7])  # empty + swapped; green circle; the rest
    assert stats["two objects: others drawn too"][0] == pytest.approx(3 / 7)


def test_counts_and_background_atoms():
    three = _scene(("yellow", "triangle", 12, 20), ("yellow", "triangle", 32, 20), ("yellow", "triangle", 52, 20),
                   background="black")
    frac, acc, f1, geneval = score(_pixels(three, three, three), ["three yellow triangles", "two yellow triangles",
                                                                  "three yellow triangles on a white background"])
    assert frac.tolist() == pytest.approx([1.0, 2 / 3, 3 / 4]) and acc.tolist() == [1.0, 0.0, 0.0]
    assert f1.tolist() == pytest.approx([1.0, 0.8, 0.5])  # 2 of 3 matched; background missed
    assert geneval.tolist() == pytest.approx([1.0, 0.25, 1.0])  # count 1 - 1/2, colour 0; no background


def test_registered_rewards_and_their_interface(monkeypatch):
    pixels = _pixels(*(c[0] for c in CASES))
    prompts = [PROMPT] * len(CASES)
    combined = CombinedReward.from_configs([{"name": "compositional"},
                                            {"name": "compositional_accuracy", "weight": 0.0},
                                            {"name": "compositional_f1", "weight": 0.0},
                                            {"name": "compositional_geneval", "weight": 0.0}])
    calls = []
    monkeypatch.setattr(compositional, "detect", lambda *a: calls.append(1) or detect(*a))
    total, values = combined(pixels, prompts)
    assert len(calls) == 1  # the four rewards share one detection of the same images
    pixels[0] = pixels[1]  # changed in place: detected again, and scored as the new image
    assert combined(pixels, prompts)[1]["compositional_accuracy"][0] == 0.0 and len(calls) == 2
    pixels = _pixels(*(c[0] for c in CASES))
    expected = torch.tensor([sum(e) / len(e) for _, e, _ in CASES])
    assert torch.allclose(total, expected) and torch.allclose(values["compositional"], expected)
    assert values["compositional_accuracy"].tolist() == [1.0] + [0.0] * (len(CASES) - 1)
    assert values["compositional_f1"].tolist() == pytest.approx([f1 for _, _, f1 in CASES])
    assert values["compositional_geneval"].tolist() == pytest.approx(GENEVAL_OF_CASES)
    reward = build_reward({"name": "compositional"})
    pixels[1, 0, 0, 0] = float("nan")
    assert math.isnan(reward(pixels[:2], prompts[:2])[1].item())
    with pytest.raises(ValueError, match="not in the shapes grammar"):
        reward(pixels[:1], ["a photo of a cat"])


def test_reference_levels_ceiling_and_chance():
    prompts = [s.caption() for s in shapes.enumerate_prompts()["relation"][::20]]
    levels = reference_levels(prompts, samples=4, seed=0)
    assert levels["ceiling"] == (1.0, 1.0)
    frac, acc = levels["chance"]
    assert 0.0 < frac < 0.25 and acc < 0.05  # a prompt-blind generator rarely meets a relation prompt


# --- flow_grpo's GenEval training reward ----------------------------------------------------
def _geneval_metadata(spec):
    """The prompt as GenEval's metadata: the shape is the object class, the colour its attribute; a
    relation prompt lists its target first and puts [relation, 0] on the related object."""
    include = [{"class": g.shape, "count": g.count, "color": g.color} for g in spec.objects]
    if spec.relation:
        include = [include[1], dict(include[0], position=(spec.relation, 0))]
    return {"include": include}


def _authors_reward(detected, metadata, color_of, related):
    """A float64 transcription of yifan123/reward-server reward_server/gen_eval.py `evaluate_reward`
    (its reward; the correctness flag and reasons left out). detected: {class: [objects]},
    color_of(object) -> colour, related(obj, target, relation) -> bool."""
    rewards, matched_groups = [], []
    for req in metadata["include"]:
        found = detected.get(req["class"], [])
        matched = True
        rewards.append(1 - abs(req["count"] - len(found)) / req["count"])
        if len(found) != req["count"]:
            matched = False
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                n = [color_of(o) for o in found].count(req["color"])
                rewards.append(1 - abs(req["count"] - n) / req["count"])
                if n != req["count"]:
                    matched = False
            if "position" in req and matched:
                relation, target = req["position"]
                if matched_groups[target] is None:
                    matched = False
                    rewards.append(0.0)
                else:
                    for obj in found:
                        for target_obj in matched_groups[target]:
                            if not related(obj, target_obj, relation):
                                matched = False
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)
        matched_groups.append(found if matched else None)
    return sum(rewards) / len(rewards) if rewards else 0.0


def _objects(*items):
    return [compositional.Detection(color, shape, x, y, 100) for color, shape, x, y in items]


GENEVAL_CASES = [
    ("three green triangles", [("green", "triangle", 10, 10), ("green", "triangle", 30, 10)]),  # 2 of 3
    ("three green triangles", [("green", "triangle", 10, 10), ("red", "triangle", 30, 10), ("green", "triangle", 50, 10)]),
    ("three green triangles", []),  # nothing drawn
    ("a red circle", [("red", "circle", 10, 10), ("red", "circle", 30, 10), ("red", "circle", 50, 10)]),  # negative
    ("a red circle", [("red", "circle", 10, 10), ("blue", "square", 30, 10)]),  # other objects do not count
    ("two blue squares", [("blue", "square", 10, 10), ("blue", "square", 30, 10)]),
    ("a red circle and a blue square", [("red", "circle", 10, 10), ("green", "square", 30, 10)]),
    ("a red circle above a blue square", [("red", "circle", 30, 10), ("blue", "square", 30, 40)]),  # met
    ("a red circle above a blue square", [("red", "circle", 30, 40), ("blue", "square", 30, 10)]),  # relation missed
    ("a red circle above a blue square", [("red", "circle", 30, 10), ("pink", "square", 30, 40)]),  # no target
    ("a red circle below a blue square", [("blue", "circle", 30, 10), ("blue", "square", 30, 40)]),
    ("two red circles to the left of a blue square",
     [("red", "circle", 5, 10), ("red", "circle", 8, 30), ("blue", "square", 40, 20)]),
]


@pytest.mark.parametrize("prompt, items", GENEVAL_CASES)
def test_geneval_score_equals_the_authors_reward(prompt, items):
    spec = PromptSpec.parse(prompt)
    objects = _objects(*items)
    detected = collections.defaultdict(list)
    for o in objects:
        detected[o.shape].append(o)
    cfg = compositional.DetectorConfig()
    expected = _authors_reward(detected, _geneval_metadata(spec), lambda o: o.color,
                               lambda a, b, rel: compositional.relation_met(a, b, rel, cfg.relation_margin))
    assert compositional.geneval_score(spec, objects, cfg) == pytest.approx(expected, abs=1e-12)


def test_geneval_score_values_by_hand():
    """The partial credits that make it a dense reward for counts: 2 of 3 triangles earn 1/3 (count 2/3,
    colour 0 as the count is wrong), 3 with 2 in the colour 5/6, three circles for one -1/2; a missed
    relation adds a 0 and then a 1 (the authors' code), so one object above another scores 5/6 when
    the relation is missed."""
    score = compositional.geneval_score
    assert score(PromptSpec.parse(GENEVAL_CASES[0][0]), _objects(*GENEVAL_CASES[0][1])) == pytest.approx(1 / 3)
    assert score(PromptSpec.parse(GENEVAL_CASES[1][0]), _objects(*GENEVAL_CASES[1][1])) == pytest.approx(5 / 6)
    assert score(PromptSpec.parse(GENEVAL_CASES[3][0]), _objects(*GENEVAL_CASES[3][1])) == pytest.approx(-1 / 2)
    assert score(PromptSpec.parse(GENEVAL_CASES[7][0]), _objects(*GENEVAL_CASES[7][1])) == 1.0
    assert score(PromptSpec.parse(GENEVAL_CASES[8][0]), _objects(*GENEVAL_CASES[8][1])) == pytest.approx(5 / 6)
