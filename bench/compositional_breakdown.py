"""Where a shapes model fails: the held-out evaluation broken down by atom, family and objects drawn.

    python -m bench.compositional_breakdown [--load RUN/ckpt/iter_0000100] [--prompts FILE]
        [-- other trainer args]

Samples the demo's evaluation (ODE, the prompts of `--prompts` x 4 fixed noises, the tiny
shapes pipeline or $PIPELINE_DIR) from the pretrained model or a GRPO checkpoint and prints
`mm_grpo.rewards.compositional.breakdown`: how often each atom is met, the prompts fully met
per family, and for two-object prompts how many of the two named objects were drawn.
See docs/demo.md ("Why prompts fully met do not follow").
"""
import argparse
import os

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "flux")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default=None, help="a GRPO checkpoint (default: the pretrained pipeline)")
    p.add_argument("--prompts", default=os.path.join(EXAMPLES, "shapes_prompts", "eval.txt"),
                   help="evaluation prompts (default: the demo's held-out eval.txt)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --: more trainer arguments")
    a = p.parse_args(argv)
    from mm_grpo.data.prompts import read_prompts
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.rewards.compositional import breakdown
    from mm_grpo.training.arguments import parse_args
    from mm_grpo.training.train_grpo import GRPORun
    os.environ.setdefault("PIPELINE_DIR", os.path.join(EXAMPLES, "tiny_shapes"))
    os.environ["PROMPT_FILE"] = os.environ["EVAL_PROMPT_FILE"] = a.prompts
    initialize_parallel(ParallelConfig())
    argv = ["--mm-model", os.path.join(EXAMPLES, "model_shapes.json"),
            "--mm-data", os.path.join(EXAMPLES, "data_shapes.json"), "--train-iters", "0", "--no-progress-bar",
            "--prompts-per-iteration", "1", "--num-generations", "8", "--micro-batch-size", "8",
            "--eval-prompts", str(len(read_prompts(a.prompts))), "--no-load-optim", "--no-load-rng"]
    argv += ["--load", a.load] if a.load else []
    run = GRPORun(parse_args(argv + [x for x in a.trainer_args if x != "--"]))
    result = run.evaluator(run.model.modules)
    print(f"[breakdown] {a.load or os.environ['PIPELINE_DIR']}: {len(result.prompts)} images of {a.prompts}")
    for name, (rate, n) in breakdown(result.images, result.prompts).items():
        print(f"  {name:32s} {rate:.3f}  (of {n})")


if __name__ == "__main__":
    main()
