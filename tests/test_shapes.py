"""The synthetic shapes data: grammar, scenes that satisfy their captions, reproducible datasets."""
import json
import numpy as np
import pytest

from mm_grpo.data import shapes
from mm_grpo.data.image_captions import ImageCaptionDataset
from mm_grpo.data.shapes import (CaptionSampler, ObjectSpec, PromptSpec, ShapesConfig, enumerate_prompts,
                                 generate_dataset, make_example, relation_holds, sample_scene, split_prompts)


def test_every_caption_of_the_grammar_parses_back():
    families = enumerate_prompts()
    sizes = {f: len(v) for f, v in families.items()}
    # 5 colours x 3 shapes = 15 kinds; counts 2..3; ordered pairs of different kinds; 4 relations.
    assert sizes == {"single": 15, "count": 30, "pair": 15 * 14, "relation": 4 * 15 * 14}
    for family, specs in families.items():
        for spec in specs:
            assert spec.family == family
            assert PromptSpec.parse(spec.caption()) == spec
    assert len({s.caption() for f in families.values() for s in f}) == sum(sizes.values())


def test_caption_examples_and_errors():
    spec = PromptSpec.parse("a red circle to the left of a blue square on a black background")
    assert spec == PromptSpec((ObjectSpec("red", "circle"), ObjectSpec("blue", "square")), "left of", "black")
    assert PromptSpec.parse("  Three   GREEN triangles ") == PromptSpec((ObjectSpec("green", "triangle", 3),))
    for bad in ("a red circles", "two red circle", "a purple circle", "a red circle near a blue square", ""):
        with pytest.raises(ValueError, match="caption"):
            PromptSpec.parse(bad)


@pytest.mark.parametrize("config", [ShapesConfig(), ShapesConfig(grid=0, min_size=14, max_size=22, gap=3)],
                         ids=["grid", "anywhere"])
def test_scenes_satisfy_their_captions_and_fit_the_canvas(config):
    sampler = CaptionSampler(config)
    families = set()
    for i in range(300):
        rng = np.random.default_rng([5, i])
        spec = sampler(rng)
        scene = sample_scene(spec, rng, config)
        families.add(spec.family)
        assert sorted((o.color, o.shape) for o in scene.objects) == sorted(
            (g.color, g.shape) for g in spec.objects for _ in range(g.count))
        for k, a in enumerate(scene.objects):
            x0, y0, x1, y1 = a.box()
            assert 0 <= x0 and 0 <= y0 and x1 <= config.image_size and y1 <= config.image_size
            assert config.min_size <= a.size <= config.max_size
            assert all(shapes._separated(a, b, config.gap) for b in scene.objects[k + 1:])
            if config.grid:  # centred in its own cell
                cell = config.image_size / config.grid
                assert (a.cx / cell) % 1 == 0.5 and (a.cy / cell) % 1 == 0.5
        if spec.relation:
            assert relation_holds(scene.objects[0], scene.objects[1], spec.relation)
    assert families == set(shapes.FAMILIES)


def test_rendered_colours_and_areas_match_the_scene():
    """Independent check of the renderer: pixels of each colour ~ the objects' ideal areas."""
    config = ShapesConfig()
    spec = PromptSpec((ObjectSpec("red", "circle"), ObjectSpec("blue", "square"), ObjectSpec("green", "triangle")))
    rng = np.random.default_rng(0)
    scene = sample_scene(spec, rng, config)
    pixels = np.asarray(shapes.render(scene, config.image_size)).astype(int)
    for obj, ideal in zip(scene.objects, (np.pi / 4, 1.0, 0.5)):
        count = (np.abs(pixels - shapes.COLORS[obj.color]).sum(-1) < 30).sum()
        assert count == pytest.approx(ideal * obj.size ** 2, rel=0.2), obj
    outside = np.ones(pixels.shape[:2], dtype=bool)  # pixels 1 away from every object's box (edges antialiased)
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.box()
        outside[max(int(y0) - 1, 0):int(y1) + 2, max(int(x0) - 1, 0):int(x1) + 2] = False
    assert outside.sum() > pixels.shape[0] * pixels.shape[1] / 2
    assert (np.abs(pixels[outside] - shapes.BACKGROUNDS[scene.background]) <= 1).all()


def test_controls_restrict_what_is_drawn():
    config = ShapesConfig(colors=("red", "blue"), shapes=("circle",), relations=("above",), max_count=2,
                          backgrounds=("white",), caption_background=True)
    sampler = CaptionSampler(config)
    for i in range(100):
        spec = sampler(np.random.default_rng([1, i]))
        assert {g.color for g in spec.objects} <= {"red", "blue"}
        assert {g.shape for g in spec.objects} == {"circle"}
        assert spec.relation in (None, "above") and max(g.count for g in spec.objects) <= 2
        assert spec.background == "white" and spec.caption().endswith("on a white background")
    with pytest.raises(ValueError, match="colors"):
        ShapesConfig(colors=("purple",))
    with pytest.raises(ValueError, match="max_size"):
        ShapesConfig(min_size=30, max_size=40)
    with pytest.raises(ValueError, match="a 4x4 grid on 64px needs cells of at least max_size"):
        ShapesConfig(max_size=15)


def test_split_is_disjoint_and_excluded_captions_are_never_drawn():
    split = split_prompts(seed=0)
    sets = {k: set(v) for k, v in split.items()}
    assert not sets["pretrain"] & sets["grpo"] and not sets["pretrain"] & sets["eval"] and not sets["grpo"] & sets["eval"]
    every = {s.caption() for f in enumerate_prompts().values() for s in f}
    assert sets["pretrain"] | sets["grpo"] | sets["eval"] == every
    assert all(PromptSpec.parse(c).family != "single" for c in sets["grpo"] | sets["eval"])
    assert len(sets["eval"]) == pytest.approx(0.1 * (len(every) - 15), abs=4)
    assert split_prompts(seed=0) == split and split_prompts(seed=1) != split
    sampler = CaptionSampler(exclude=split["grpo"] + split["eval"])
    drawn = {sampler(np.random.default_rng([2, i])).caption() for i in range(2000)}
    assert drawn <= sets["pretrain"] and len(drawn) > 500


def test_examples_depend_on_seed_and_index_only():
    sampler = CaptionSampler()
    a_img, a_row = make_example(17, 3, sampler)
    b_img, b_row = make_example(17, 3, CaptionSampler())
    assert a_row == b_row and np.array_equal(np.asarray(a_img), np.asarray(b_img))
    assert make_example(17, 4, sampler)[1] != a_row and make_example(18, 3, sampler)[1] != a_row


def test_dataset_folder_is_reproducible_and_readable(tmp_path):
    a = generate_dataset(str(tmp_path / "a"), 12, seed=9)
    b = generate_dataset(str(tmp_path / "b"), 12, seed=9)
    for name in ["metadata.jsonl"] + [f"images/{i:06d}.png" for i in range(12)]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    rows = [json.loads(line) for line in (tmp_path / "a" / "metadata.jsonl").read_text().splitlines()]
    dataset = ImageCaptionDataset(a)
    assert len(dataset) == 12 and dataset.captions == [r["text"] for r in rows]
    image, caption = dataset[3]
    assert image.shape == (3, 64, 64) and 0 <= image.min() and image.max() <= 1 and caption == rows[3]["text"]
    assert json.loads((tmp_path / "a" / "dataset.json").read_text())["seed"] == 9
    with pytest.raises(FileExistsError, match="already exists"):
        generate_dataset(b, 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_cli_split_generate_and_bad_input(tmp_path, capsys):
    shapes.main(["split", "--out", str(tmp_path / "p")])
    eval_file = tmp_path / "p" / "eval.txt"
    shapes.main(["generate", "--out", str(tmp_path / "d"), "--num-images", "5", "--prompts", str(eval_file),
                 "--colors", "red,blue,green,yellow,pink"])
    allowed = set(eval_file.read_text().split("\n"))
    assert {json.loads(l)["text"] for l in (tmp_path / "d" / "metadata.jsonl").read_text().splitlines()} <= allowed
    with pytest.raises(SystemExit) as exit_info:
        shapes.main(["generate", "--out", str(tmp_path / "e"), "--num-images", "2", "--colors", "red,purple"])
    assert exit_info.value.code == 2
    assert "error: colors: unknown 'purple'; choose from red, yellow" in capsys.readouterr().err
