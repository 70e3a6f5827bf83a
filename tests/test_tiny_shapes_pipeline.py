"""The shipped tiny shapes FLUX (examples/flux/tiny_shapes): diffusers loads and runs it, and it
follows held-out prompts clearly above chance (docs/demo.md has the full figures)."""
from pathlib import Path

import torch

from mm_grpo.families.flux.text import load_tokenizers
from mm_grpo.rewards.compositional import reference_levels, score

PIPELINE = Path(__file__).resolve().parents[1] / "examples" / "flux" / "tiny_shapes"
EVAL = PIPELINE.parent / "shapes_prompts" / "eval.txt"


def test_diffusers_samples_the_shipped_pipeline_above_chance():
    from diffusers import FluxPipeline
    # Fast tokenizers: the folder was written under transformers 5 (see load_tokenizers), whose
    # class names diffusers would check a passed tokenizer against.
    pipe = FluxPipeline.from_pretrained(PIPELINE, torch_dtype=torch.float32, tokenizer=None, tokenizer_2=None)
    pipe.register_modules(**load_tokenizers(PIPELINE))
    prompts = EVAL.read_text().splitlines()[::4]  # 27 held-out captions of every family
    images = pipe(prompts, height=64, width=64, num_inference_steps=16, guidance_scale=3.5,
                  max_sequence_length=16, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images
    frac = score(images, prompts).fraction
    chance, _ = reference_levels(prompts, samples=4, seed=0)["chance"]
    # Measured: 0.35 for the model, 0.09 for chance (docs/demo.md): a margin far beyond the
    # spread of 27 prompts (std of the mean ~ 0.05).
    assert frac.mean().item() > chance + 0.12, (frac.mean().item(), chance)


def test_family_prompt_files_are_the_held_out_family_subsets():
    """grpo_pair / eval_pair: the pair prompts of grpo.txt / eval.txt; the background splits put each
    object on one background for GRPO and on the other for evaluation (bench/family_base_rates.py)."""
    from mm_grpo.data.shapes import PromptSpec
    folder = EVAL.parent
    read = lambda name: (folder / name).read_text().splitlines()  # noqa: E731
    for split in ("grpo", "eval"):
        assert read(f"{split}_pair.txt") == [c for c in read(f"{split}.txt") if PromptSpec.parse(c).family == "pair"]
    grpo, ev = (list(map(PromptSpec.parse, read(f"{s}_background.txt"))) for s in ("grpo", "eval"))
    assert len(grpo) == len(ev) == 15 and all(s.family == "single" and s.background for s in grpo + ev)
    assert {(s.objects, s.background) for s in grpo}.isdisjoint({(s.objects, s.background) for s in ev})
    assert sorted(s.objects[0].phrase() for s in grpo) == sorted(s.objects[0].phrase() for s in ev)
    pretrain = set(read("pretrain.txt"))
    assert not pretrain & set(read("grpo_pair.txt") + read("eval_pair.txt") + read("grpo_background.txt"))


def test_the_demo_prompt_files_split_the_single_and_count_families():
    """grpo_objects / eval_objects_tuning + eval_objects_report (the CPU demo): every single-object
    and count caption, from pretraining and the held-out splits, each in exactly one of them; the
    evaluation halves hold each family ("a", "two", "three"), colour and shape as evenly as counts allow."""
    from collections import Counter

    from mm_grpo.data.shapes import PromptSpec
    folder = EVAL.parent
    read = lambda name: (folder / name).read_text().splitlines()  # noqa: E731
    grpo, tuning, report = read("grpo_objects.txt"), read("eval_objects_tuning.txt"), read("eval_objects_report.txt")
    ev = tuning + report
    families = ("single", "count")
    every = {c for f in ("pretrain.txt", "grpo.txt", "eval.txt") for c in read(f) if PromptSpec.parse(c).family in families}
    assert not set(grpo) & set(ev) and set(grpo) | set(ev) == every and len(grpo) + len(set(ev)) == len(every) == 45
    assert len(tuning) == len(report) == 11
    for position in range(3):  # family word, colour, shape
        counts = [Counter(p.split()[position].rstrip("s") for p in half) for half in (tuning, report)]
        assert all(abs(counts[0][w] - counts[1][w]) <= 1 for w in counts[0] | counts[1]), counts
