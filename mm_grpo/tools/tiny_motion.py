"""The tiny "motion" Wan2.1 pipeline's command line: its builders are Wan's
(`mm_grpo.families.wan.tiny_motion`); the held-out evaluation is here, as it runs training's
`Evaluator` (examples/wan/build_tiny_motion.sh runs the whole recipe).

    python -m mm_grpo.tools.tiny_motion init --vae VAE_DIR --out DIR [--seed 0]
        a pipeline folder with the given VAE, a frozen random umT5 and a random DiT
    python -m mm_grpo.tools.tiny_motion converter-reference --init DIR --out REF_DIR
        the diffusers files `mm-convert WanConverter mm_to_hf` copies (--cfg.hf_dir): the DiT's
        config.json and a safetensors index of its weights
    python -m mm_grpo.tools.tiny_motion finish --init DIR --transformer MM_TO_HF_DIR --out FINAL
        the same folder with the trained DiT (the weights mm_to_hf wrote)
    python -m mm_grpo.tools.tiny_motion evaluate --pipeline FINAL --prompts eval.txt [--samples 32]
        held-out motion accuracy: ODE samples of the prompts scored by the `motion` reward, with
        bootstrap intervals, beside the reward's ceilings and chance level (docs/video.md);
        --references-only: the ceilings and chance level alone (the pipeline's VAE, no DiT)
    python -m mm_grpo.tools.tiny_motion check --num-frames 9 --image-size 32
        one line if Wan's VAE and DiT or the motion renderer cannot take that video size
"""
import argparse
import dataclasses
import json
import sys
import time

from mm_grpo.data.motion import MotionSpec
from mm_grpo.data.prompts import read_prompts
from mm_grpo.families.wan.encoders import UMT5Conditioner, WanVaeDecoder, component_folder
from mm_grpo.families.wan.tiny_motion import (DiffusersWanDenoiser, MotionEvaluation, build_init_pipeline,
                                              check_video, finish_pipeline, motion_breakdown, reference_levels,
                                              write_converter_reference)
from mm_grpo.files.atomic import atomic_write_text
from mm_grpo.rollout import sigma_schedule
from mm_grpo.settings import add_setting_args, from_args
from mm_grpo.tiny.pipeline import write_pipeline
from mm_grpo.training.evaluation import Evaluator

PROG = "python -m mm_grpo.tools.tiny_motion"


def evaluate(pipeline_dir, prompts, settings: MotionEvaluation = MotionEvaluation(), references_only=False):
    """{"stats": eval/<name> means with their 95% bootstrap intervals over prompts and noises,
    "references": `reference_levels`} of the pipeline's ODE samples of `prompts`: the evaluation a
    GRPO run makes of them before training (the same sampler, sigmas and noises for its eval_seed).
    `references_only`: the references alone (no stats)."""
    from diffusers import WanTransformer3DModel

    for prompt in prompts:
        MotionSpec.parse(prompt)  # one line for a prompt outside the grammar, before any model loads
    grid = check_video(settings.num_frames, settings.image_size)
    vae = WanVaeDecoder(pipeline_dir)
    report = {"references": reference_levels(prompts, settings, vae), "prompts": len(prompts),
              "samples_per_prompt": settings.samples}
    if references_only:
        return report
    transformer = WanTransformer3DModel.from_pretrained(component_folder(pipeline_dir, "transformer")).eval()
    shape = (transformer.config.in_channels, *grid)
    text = UMT5Conditioner(pipeline_dir, max_sequence_length=settings.max_sequence_length)
    evaluator = Evaluator(list(prompts), text.encode, lambda latents, height, width: vae(latents), motion_breakdown,
                          sigma_schedule(settings.num_inference_steps, settings.sigma_shift),
                          DiffusersWanDenoiser(transformer, shape), settings.image_size, settings.image_size,
                          settings.samples, seed=settings.seed, batch_size=settings.batch_size)
    return dict(report, stats=evaluator([]).stats)  # no model chunks: the denoiser holds the DiT


def summary(report) -> str:
    """One line: the motion reward and its full-credit rate with their intervals, and the references."""
    refs = (f"motion reward references ({report['prompts']} prompts x {report['samples_per_prompt']} videos): "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["references"].items()))
    if "stats" not in report:
        return refs
    stats = report["stats"]

    def value(name):
        key = f"eval/{name}"
        bounds = f" [{stats[key + '_ci_low']:.3f}, {stats[key + '_ci_high']:.3f}]" if key + "_ci_low" in stats else ""
        return f"{stats[key]:.3f}{bounds}"

    return (f"held-out motion {value('motion')}, full credit {value('full_credit')}, presence {value('presence')}, "
            f"travel {value('travel')} ({report['prompts']} prompts x {report['samples_per_prompt']} noises, 95% "
            f"bootstrap); {refs}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="pipeline with a trained VAE, a random umT5 and DiT")
    init.add_argument("--vae", required=True, help="trained VAE folder (mm_grpo.tools.train_tiny_vae --family wan)")
    init.add_argument("--seed", type=int, default=0)
    reference = sub.add_parser("converter-reference",
                               help="config.json + safetensors index for mm_to_hf's --cfg.hf_dir")
    finish = sub.add_parser("finish", help="swap in the trained DiT")
    finish.add_argument("--transformer", required=True, help="mm-convert WanConverter mm_to_hf's output folder")
    for p in (reference, finish):
        p.add_argument("--init", required=True, help="the folder `init` made")
    for p in (init, reference, finish):
        p.add_argument("--out", required=True, help="folder to create (must not exist)")
    ev = sub.add_parser("evaluate", help="held-out motion accuracy of a pipeline (ODE samples, motion reward)")
    ev.add_argument("--pipeline", required=True, help="the tiny motion pipeline folder")
    ev.add_argument("--prompts", required=True, help="prompt file (e.g. examples/wan/motion_prompts/eval.txt)")
    ev.add_argument("--out", default=None, help="also write the figures to this JSON file")
    ev.add_argument("--references-only", action="store_true", help="the ceilings and chance level alone (no DiT)")
    add_setting_args(ev, MotionEvaluation)
    check = sub.add_parser("check", help="one line if the video size is not one the tiny motion pipeline takes")
    check.add_argument("--num-frames", type=int, required=True)
    check.add_argument("--image-size", type=int, required=True)
    args = parser.parse_args(argv)
    start = time.time()
    try:
        if args.command == "init":
            print(write_pipeline(args.out, lambda: build_init_pipeline(args.vae, args.seed)))
        elif args.command == "converter-reference":
            print(write_converter_reference(args.init, args.out))
        elif args.command == "finish":
            print(finish_pipeline(args.init, args.transformer, args.out))
        elif args.command == "check":
            t, h, w = check_video(args.num_frames, args.image_size)
            print(f"{args.num_frames} frames of {args.image_size}x{args.image_size}: latents {t}x{h}x{w}")
        else:
            settings = from_args(MotionEvaluation, args)
            report = evaluate(args.pipeline, read_prompts(args.prompts), settings, args.references_only)
            if args.out:
                atomic_write_text(args.out, json.dumps(dict(report, settings=dataclasses.asdict(settings)), indent=1))
            print(f"{summary(report)}; {time.time() - start:.0f}s")
    except (ValueError, OSError) as e:  # bad input, missing or existing paths, full disk
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
