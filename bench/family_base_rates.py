"""The pretrained shapes model's full-prompt accuracy per prompt family: which families GRPO can learn from.

    python -m bench.family_base_rates [--noises 8] [--load CKPT] [--prompts FILE ...]

For every prompt family of the shapes grammar (mm_grpo/data/shapes.py; count and relation split
by number and by relation word), samples each prompt of the given files (default: the demo's
held-out grpo.txt and eval.txt, and the single-object captions of pretrain.txt, which are never
held out) with ODE from `--noises` fixed noises (the evaluation's seeded draws), scores them with
the compositional reward and prints a markdown table: prompts, images, full-prompt accuracy
(GenEval's), atoms met, and the share of prompts whose accuracy lies in [0.2, 0.6] and whose
group of `--noises` images holds at least one success (what a GRPO group needs).
See docs/demo.md ("Base rate per family").
"""
import argparse
import collections
import os
import time

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "flux")
PROMPTS = os.path.join(EXAMPLES, "shapes_prompts")


def family_key(spec) -> str:
    """count 2 / count 3, pair, relation above / below / left of / right of, single."""
    if spec.family == "count":
        return f"count {spec.objects[0].count}"
    if spec.family == "relation":
        return f"relation {spec.relation}"
    return spec.family


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--noises", type=int, default=8, help="fixed noises (images) per prompt")
    p.add_argument("--load", default=None, help="a GRPO checkpoint (default: the shipped pretrained model)")
    p.add_argument("--prompts", nargs="+", default=[os.path.join(PROMPTS, f) for f in ("grpo.txt", "eval.txt")])
    p.add_argument("--no-singles", action="store_true", help="leave out pretrain.txt's single-object captions")
    a = p.parse_args(argv)
    import torch
    from mm_grpo.data.prompts import read_prompts
    from mm_grpo.data.shapes import PromptSpec
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.rewards.compositional import score
    from mm_grpo.training.arguments import parse_args
    from mm_grpo.training.evaluation import Evaluator
    from mm_grpo.training.train_grpo import GRPORun
    os.environ.setdefault("PIPELINE_DIR", os.path.join(EXAMPLES, "tiny_shapes"))
    sources = {os.path.basename(f): read_prompts(f) for f in a.prompts}
    if not a.no_singles:
        sources["pretrain.txt (single)"] = [c for c in read_prompts(os.path.join(PROMPTS, "pretrain.txt"))
                                           if PromptSpec.parse(c).family == "single"]
    os.environ["PROMPT_FILE"] = os.environ["EVAL_PROMPT_FILE"] = a.prompts[0]
    initialize_parallel(ParallelConfig())
    argv = ["--mm-model", os.path.join(EXAMPLES, "model_shapes.json"),
            "--mm-data", os.path.join(EXAMPLES, "data_shapes.json"), "--train-iters", "0", "--no-progress-bar",
            "--prompts-per-iteration", "1", "--num-generations", "8", "--micro-batch-size", "8",
            "--no-load-optim", "--no-load-rng"] + (["--load", a.load] if a.load else [])
    run = GRPORun(parse_args(argv))
    s = run.schedule
    start = time.time()
    rows = collections.defaultdict(lambda: collections.defaultdict(list))  # family -> source -> per-prompt rates
    atoms = collections.defaultdict(list)
    for source, prompts in sources.items():
        ev = Evaluator(prompts, s.conditioner, s.decoder, s.reward, s.sigmas, s.denoiser, s.s.height, s.s.width,
                       a.noises, seed=0, device=s.device)
        result = ev(run.model.modules)
        scores = score(result.images, result.prompts)
        acc = scores.accuracy.view(len(prompts), a.noises)
        for i, prompt in enumerate(prompts):
            key = family_key(PromptSpec.parse(prompt))
            rows[key][source].append(acc[i])
            atoms[(key, source)].append(scores.fraction.view(len(prompts), a.noises)[i].mean().item())
    print(f"[family_base_rates] {a.load or os.environ['PIPELINE_DIR']}: ODE, {a.noises} fixed noises per prompt, "
          f"{time.time() - start:.0f} s")
    print("| family | prompts from | prompts | images | accuracy (prompts fully met) | atoms met | "
          "prompts with accuracy in [0.2, 0.6] | prompts with >= 1 success in the group |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(rows):
        for source, per_prompt in rows[key].items():
            acc = torch.stack(per_prompt)  # [prompts, noises]
            rate = acc.mean(1)
            in_band = ((rate >= 0.2) & (rate <= 0.6)).float().mean().item()
            any_success = (rate > 0).float().mean().item()
            print(f"| {key} | {source} | {len(per_prompt)} | {acc.numel()} | {acc.mean().item():.3f} | "
                  f"{sum(atoms[(key, source)]) / len(per_prompt):.3f} | "
                  f"{in_band:.2f} | {any_success:.2f} |")


if __name__ == "__main__":
    main()
