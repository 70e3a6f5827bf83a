"""Building a tiny diffusers pipeline folder: each component's weights under its own seed, and the
folder written atomically."""
from pathlib import Path

import torch

from mm_grpo.files.atomic import atomic_dir


def seeded(seed, build):
    """`build()` under `seed`, leaving the caller's RNG as it was (one seed per component: changing
    one does not shift the others)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def write_pipeline(path, make_pipeline, then=None) -> Path:
    """`make_pipeline()` saved as the diffusers folder `path` (which must not exist), atomically; the
    pipeline is built once the folder is known to be free, and `then(folder)`, when given, edits the
    written files before the folder is renamed into place."""
    with atomic_dir(path) as tmp:
        make_pipeline().save_pretrained(tmp, safe_serialization=True)
        if then is not None:
            then(Path(tmp))
    return Path(path)


def finish_pipeline(pipeline_class, transformer_class, init_dir, transformer_dir, out, dtype=torch.float16,
                    then=None):
    """The init pipeline with its transformer replaced by the trained one, stored in `dtype` (fp16 halves
    the folder; diffusers and mm-grpo's loaders read it back as fp32); `then` as for `write_pipeline`."""
    def finished():
        transformer = transformer_class.from_pretrained(transformer_dir, torch_dtype=dtype)
        return pipeline_class.from_pretrained(init_dir, transformer=transformer)
    return write_pipeline(out, finished, then)


def init_finish_main(argv, prog, description, build_init_pipeline, finish, vae_help):
    """The command line of a shapes pipeline's recipe: `init` (a pipeline with a trained VAE and random
    encoders and transformer) and `finish` (the same with the trained transformer); one line on bad input."""
    import argparse
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="pipeline with a trained VAE, random text encoders and transformer")
    init.add_argument("--vae", required=True, help=vae_help)
    init.add_argument("--out", required=True)
    init.add_argument("--seed", type=int, default=0)
    finished = sub.add_parser("finish", help="swap in the trained transformer")
    finished.add_argument("--init", required=True, help="the folder `init` made")
    finished.add_argument("--transformer", required=True, help="trained diffusers transformer folder")
    finished.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            print(write_pipeline(args.out, lambda: build_init_pipeline(args.vae, args.seed)))
        else:
            print(finish(args.init, args.transformer, args.out))
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
