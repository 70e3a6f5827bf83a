"""Precompute FLUX text embeddings for a prompt file (as DanceGRPO does offline).

    python -m mm_grpo.tools.precompute_text --pipeline /models/FLUX.1-dev \
        --prompts prompts.txt --out text_cache.safetensors [--max-sequence-length 512] [--device cuda]

Then set `"embeddings_cache": "text_cache.safetensors"` in model.json's text_encoder block:
training reads the embeddings by prompt and never loads CLIP or T5.
"""
import argparse
import time

from mm_grpo.data import read_prompts
from mm_grpo.families.flux.text import TextEncoders, save_text_embeddings
from mm_grpo.settings import add_setting_args, from_args
from mm_grpo.tools.encoding import EncoderSettings


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_setting_args(p, EncoderSettings)
    p.add_argument("--prompts", required=True, help="prompt file: .txt (one per line) or .jsonl")
    p.add_argument("--out", required=True, help="safetensors file to write (atomically)")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    start = time.time()
    try:
        enc = from_args(EncoderSettings, args)
        prompts = read_prompts(args.prompts)
        encoders = TextEncoders(enc.pipeline, device=enc.device, dtype=enc.torch_dtype,
                                max_sequence_length=enc.max_sequence_length)
        path = save_text_embeddings(encoders, prompts, args.out, batch_size=args.batch_size)
    except (ValueError, OSError) as e:  # bad input, missing paths, full disk
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"{len(set(prompts))} prompts -> {path} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
