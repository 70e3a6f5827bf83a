"""Prompts from a file, in a reproducible, resumable order shared by all ranks."""
import json
import os
from typing import Dict, List

import torch

from mm_grpo.files.atomic import atomic_write_text
from mm_grpo.seeding import DEFAULT_SEED


def read_prompts(path: str) -> List[str]:
    """One prompt per line (.txt) or one JSON object per line with `prompt` or `caption` (.jsonl)."""
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                         "convert it, e.g. iconv -t UTF-8") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if path.endswith(".jsonl"):
            try:
                row = json.loads(line)
                line = row.get("prompt", row.get("caption"))
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"{path}:{n}: not a JSON object") from None
            if not isinstance(line, str) or not line.strip():
                raise ValueError(f"{path}:{n}: needs a non-empty 'prompt' or 'caption'")
        prompts.append(line)
    if not prompts:
        raise ValueError(f"prompt file is empty: {path}")
    return prompts


def write_prompt_files(out_dir: str, split: Dict[str, List[str]]) -> Dict[str, str]:
    """Each list of `split` as `out_dir`/<name>.txt, one prompt per line (`read_prompts`' format),
    written atomically; returns {name: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, f"{name}.txt") for name in split}
    for name, prompts in split.items():
        atomic_write_text(paths[name], "".join(p + "\n" for p in prompts))
    return paths


class PromptStream:
    """An endless stream of prompts: a fresh permutation each epoch (from `seed`), or file order.

    Every rank holds the same stream and takes the same global batch, so the position is
    one number (`consumed`) that a checkpoint stores and `--load` restores."""

    def __init__(self, prompts: List[str], seed: int = DEFAULT_SEED, shuffle: bool = True, consumed: int = 0):
        self.prompts, self.seed, self.shuffle = list(prompts), seed, shuffle
        self.consumed = consumed

    def _order(self, epoch):
        if not self.shuffle:
            return list(range(len(self.prompts)))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self, n: int) -> List[str]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.consumed, len(self.prompts))
            take = min(n - len(out), len(self.prompts) - pos)
            order = self._order(epoch)
            out += [self.prompts[i] for i in order[pos:pos + take]]
            self.consumed += take
        return out

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = int(state["consumed"])
