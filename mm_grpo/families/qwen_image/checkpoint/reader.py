"""Read a Megatron-layout Qwen-Image checkpoint lazily: any weight, whole or as any TP rank's shard."""
import os

import torch

from mm_grpo.checkpoint.metadata import CHUNK_KEY, EXTRA_STATE, shard_extras
from mm_grpo.checkpoint.paths import EMA_KEY, SHARD_FILE, iteration_dir, shard_folders
from mm_grpo.checkpoint.shard_io import ShardReader
from mm_grpo.families.qwen_image.checkpoint.metadata import read_meta
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.hf_weights import expected_hf_shapes

WEIGHTS = ("policy", "ema")


def expected_full_shapes(config) -> dict:
    """rule.hf -> shape of the whole Megatron tensor, for every weight of `config`."""
    hf = expected_hf_shapes(config)
    return {r.hf: tuple(layout.merge(r, [torch.empty(hf[h], device="meta") for h in r.hf], config).shape)
            for r in layout.stage_rules(config)}


class MegatronCheckpoint:
    """Weights are looked up by their layout rule's diffusers names (global, unlike the local Megatron
    names), so a rule from any stage of any target layout finds its source.

    `weights`: "policy" (the model chunks) or "ema" (a training checkpoint's EMA of them, same layout)."""

    def __init__(self, path: str, iteration=None, weights: str = "policy"):
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        self.weights = weights
        self.path = iteration_dir(path, iteration)
        self._folders = shard_folders(self.path)
        self._readers = {}
        try:
            self.meta = read_meta(self.path, self.shard)
            if weights == "ema" and EMA_KEY not in self.shard(0, 0).tree:
                raise ValueError(f"{self.path} holds no EMA of the policy (saved without --ema-decay)")
        except BaseException:
            self.close()
            raise
        self.config = self.meta.config
        self._where = {}  # rule.hf -> (pp_rank, model key, source rule)
        for spec, key in self.meta.stages():
            for rule in self.meta.rules(spec):
                self._where[rule.hf] = (spec.pp_rank, key, rule)

    def shard(self, tp_rank: int, pp_rank: int) -> ShardReader:
        if (tp_rank, pp_rank) not in self._readers:
            path = os.path.join(self.path, self._folders[(tp_rank, pp_rank)], SHARD_FILE)
            self._readers[(tp_rank, pp_rank)] = ShardReader(path)
        return self._readers[(tp_rank, pp_rank)]

    def _chunk(self, key: str) -> tuple:
        """Key path of a model chunk's weights in a shard: the policy's model / modelN, or its EMA's entry."""
        return (key,) if self.weights == "policy" else (EMA_KEY, int(CHUNK_KEY.fullmatch(key)[1] or 0))

    def _piece(self, rule, tp_rank, read):
        if rule.hf not in self._where:
            raise ValueError(f"checkpoint {self.path} has no weight for {rule.megatron} ({', '.join(rule.hf)}): "
                             "another Qwen-Image architecture?")
        pp_rank, key, src = self._where[rule.hf]
        shard = self.shard(tp_rank, pp_rank)
        meta = shard.get(*self._chunk(key), src.megatron)
        return shard.read(meta) if read else meta

    def _full(self, rule, read):
        ranks = [0] if rule.shard == "replicated" else range(self.meta.tp_size)
        return layout.unshard(rule, [self._piece(rule, r, read) for r in ranks])

    def full_meta(self, rule) -> torch.Tensor:
        """The whole (unsharded) tensor of `rule` as a meta tensor: no bytes read."""
        return self._full(rule, read=False)

    def full(self, rule) -> torch.Tensor:
        return self._full(rule, read=True)

    def local(self, rule, tp_rank: int, tp_size: int) -> torch.Tensor:
        """`rule`'s shard for rank `tp_rank` of `tp_size`; read straight from the file when the checkpoint
        has the same TP size (or the tensor is replicated), else cut from the whole tensor."""
        if rule.shard == "replicated":
            return self._piece(rule, 0, read=True)
        if tp_size == self.meta.tp_size:
            return self._piece(rule, tp_rank, read=True)
        return layout.shard(rule, self.full(rule), tp_rank, tp_size)

    def extras(self, tp_rank: int, pp_rank: int) -> dict:
        """A shard's entries other than the model chunks and mm-grpo's metadata (optimizer, rng states,
        iteration...), read."""
        return shard_extras(self.shard(tp_rank, pp_rank))

    def check(self):
        """Every shard holds exactly its stage's weights, at the shapes the layout gives; all problems in
        one line."""
        expected = expected_full_shapes(self.config)
        problems = []
        for spec, key in self.meta.stages():
            rules = self.meta.rules(spec)
            names = {r.megatron for r in rules}
            for tp in range(self.meta.tp_size):
                shard = self.shard(tp, spec.pp_rank)
                held = shard.get(*self._chunk(key))
                where = f"{shard.path} [{'/'.join(map(str, self._chunk(key)))}]"
                weights = {n for n in held if not n.endswith(EXTRA_STATE)}
                if missing := sorted(names - weights):
                    problems.append(f"{where} misses {', '.join(missing)}")
                if unexpected := sorted(weights - names):
                    problems.append(f"{where} has unexpected {', '.join(unexpected)}")
                for r in rules:
                    if r.megatron not in held:
                        continue
                    want = tuple(layout.shard(r, torch.empty(expected[r.hf], device="meta"), tp,
                                              self.meta.tp_size).shape)
                    if tuple(held[r.megatron].shape) != want:
                        problems.append(f"{where} {r.megatron} is {tuple(held[r.megatron].shape)}, expected {want}")
        if problems:
            raise ValueError("checkpoint does not match its layout: " + "; ".join(problems))

    def close(self):
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
