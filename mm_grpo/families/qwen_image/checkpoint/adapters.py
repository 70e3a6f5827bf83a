"""LoRA adapters in a Qwen-Image training checkpoint: adapter-only shards in the weights' layout, as
FLUX's (mm_grpo/families/flux/checkpoint/adapters.py): under `model` (`model0`...) only the
`*.lora_A.weight` / `*.lora_B.weight` tensors of their TP x PP position, plus `lora` = {"config":
LoRAConfig JSON, "ranks": {base weight's diffusers name: rank} where it is not config.r, "base": the
base weights the run trained on}. Adapters reshard over TP and PP like weights (their layout rules:
mm_grpo/families/qwen_image/transformer/lora.py)."""
import os
from typing import Dict, Optional

import torch
from megatron.core import parallel_state

from mm_grpo.checkpoint.paths import iteration_dir
from mm_grpo.families.qwen_image.checkpoint.reader import MegatronCheckpoint
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer import lora

LORA_KEY = "lora"


def lora_entry(path: str) -> Optional[dict]:
    """The `lora` entry of a checkpoint (root or iteration folder), None for a full-weights one."""
    ckpt = MegatronCheckpoint(path)
    try:
        return ckpt.shard(0, 0).load(LORA_KEY) if LORA_KEY in ckpt.shard(0, 0).tree else None
    finally:
        ckpt.close()


class AdapterCheckpoint:
    """The adapter tensors of a LoRA checkpoint, whole or as any TP rank's shard, by their rule's
    diffusers names (global, so any stage of any layout finds them)."""

    def __init__(self, path: str):
        self.ckpt = MegatronCheckpoint(path)
        if LORA_KEY not in self.ckpt.shard(0, 0).tree:
            self.ckpt.close()
            raise ValueError(f"{self.ckpt.path} is not a LoRA checkpoint (no '{LORA_KEY}' entry)")
        self.entry = self.ckpt.shard(0, 0).load(LORA_KEY)
        self.config = lora.LoRAConfig.from_json(self.entry["config"])
        self.ranks: Dict[str, int] = dict(self.entry.get("ranks", {}))
        self.meta, self.qwen_config = self.ckpt.meta, self.ckpt.config
        self._where = {}
        for spec, key in self.meta.stages():
            for rule in lora.stage_adapter_rules(self.qwen_config, self.config.targets, spec.block_range,
                                                 spec.pre_process, spec.post_process):
                self._where[rule.hf] = (spec.pp_rank, key, rule)

    def rules(self):
        return [rule for _, _, rule in self._where.values()]

    def _piece(self, rule, tp_rank):
        if rule.hf not in self._where:
            raise ValueError(f"LoRA checkpoint {self.ckpt.path} has no adapter {rule.megatron} "
                             f"(its targets: {list(self.config.targets)})")
        pp_rank, key, src = self._where[rule.hf]
        shard = self.ckpt.shard(tp_rank, pp_rank)
        return shard.read(shard.get(key, src.megatron))

    def full(self, rule) -> torch.Tensor:
        ranks = [0] if rule.shard == "replicated" else range(self.meta.tp_size)
        return layout.unshard(rule, [self._piece(rule, r) for r in ranks])

    def local(self, rule, tp_rank: int, tp_size: int) -> torch.Tensor:
        if rule.shard == "replicated":
            return self._piece(rule, 0)
        if tp_size == self.meta.tp_size:
            return self._piece(rule, tp_rank)
        return layout.shard(rule, self.full(rule), tp_rank, tp_size)

    def close(self):
        self.ckpt.close()


def load_adapter_checkpoint(chunks, path: str):
    """This rank's adapters of `chunks` (bare model chunks) from a LoRA checkpoint of any TP / PP;
    returns the checkpoint's CheckpointMeta."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    source = AdapterCheckpoint(iteration_dir(path))
    try:
        with torch.no_grad():
            for chunk in chunks:
                params = dict(chunk.named_parameters())
                for rule in lora.chunk_adapter_rules(chunk, source.config.targets):
                    local = source.local(rule, tp_rank, tp_size)
                    if local.shape != params[rule.megatron].shape:
                        raise ValueError(f"{rule.megatron}: LoRA checkpoint shard {tuple(local.shape)} does not fit "
                                         f"the model's {tuple(params[rule.megatron].shape)} (another --lora-r?)")
                    params[rule.megatron].copy_(local)
        return source.meta
    finally:
        source.close()


def checkpoint_base(path: str) -> Optional[str]:
    """The base weights a LoRA checkpoint was trained on, if recorded and still there."""
    base = (lora_entry(path) or {}).get("base")
    return base if base and os.path.exists(base) else None
