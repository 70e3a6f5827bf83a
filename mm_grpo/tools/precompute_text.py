"""Precompute FLUX text embeddings for a prompt file (as DanceGRPO does offline).

    python -m mm_grpo.tools.precompute_text --pipeline /models/FLUX.1-dev \
        --prompts prompts.txt --out text_cache.safetensors [--max-sequence-length 512] [--device cuda]

Then set `"embeddings_cache": "text_cache.safetensors"` in model.json's text_encoder block:
training reads the embeddings by prompt and never loads CLIP or T5.
"""
import argparse
import time

import torch

from mm_grpo.data import read_prompts
from mm_grpo.encoders.text import MAX_SEQUENCE_LENGTH, TextEncoders, save_text_embeddings


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipeline", required=True, help="FLUX pipeline folder (text_encoder/, tokenizer/, ...)")
    p.add_argument("--prompts", required=True, help="prompt file: .txt (one per line) or .jsonl")
    p.add_argument("--out", required=True, help="safetensors file to write (atomically)")
    p.add_argument("--max-sequence-length", type=int, default=MAX_SEQUENCE_LENGTH)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    start = time.time()
    encoders = TextEncoders(args.pipeline, device=args.device, dtype=getattr(torch, args.dtype),
                            max_sequence_length=args.max_sequence_length)
    path = save_text_embeddings(encoders, prompts, args.out, batch_size=args.batch_size)
    print(f"{len(set(prompts))} prompts -> {path} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
