"""FluxConverter's LoRA verbs: a LoRA training checkpoint (adapters only) to a diffusers FLUX LoRA
file, and merged into its base weights (MindSpeed-MM's `merge_lora_to_base`); what they do alike for
every family is converters/lora_io.py's.

Both read mm-grpo's LoRA checkpoints (`mm_grpo/families/flux/checkpoint/adapters.py`) and those of MindSpeed-MM's
own LoRA (`--lora-target-modules` in its `pretrain`: peft's adapter names, the LoRA settings and
the flux predictor block in Megatron's saved `args`; any TP, PP 1).

    mm-convert FluxConverter lora_mm_to_hf --cfg.source_path SAVE_DIR --cfg.target_path DIR
    mm-convert FluxConverter merge_lora_to_base --cfg.source_path BASE --cfg.lora_path SAVE_DIR \\
        --cfg.target_path DIR
"""
import contextlib
import dataclasses
import os
from typing import Optional

from converters import lora_io
from converters.lora_io import PEFT_ADAPTER_SUFFIX, Adapters
from mm_grpo.checkpoint import is_megatron_checkpoint
from mm_grpo.checkpoint.paths import SHARD_FILE
from mm_grpo.checkpoint.shard_io import ShardReader
from mm_grpo.families.flux.checkpoint.adapters import LORA_KEY, AdapterCheckpoint
from mm_grpo.families.flux.predictor_block import flux_config_from_block
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer import lora as flux_lora
from mm_grpo.families.flux.transformer.lora_hf import to_diffusers


@dataclasses.dataclass
class LoraMmToHfConfig(lora_io.LoraMmToHfConfig):
    """Options of `lora_mm_to_hf`.

    Args:
        source_path: A LoRA training checkpoint (--save of a run with --lora-target-modules: mm-grpo's
            at any TP/PP, MindSpeed-MM's at any TP and PP 1), or one iteration folder of it.
        target_path: Folder to create with pytorch_lora_weights.safetensors, which
            FluxPipeline.load_lora_weights(target_path) loads.
        iteration: Iteration to convert; default: the one latest_checkpointed_iteration.txt names.
        overwrite: Replace target_path if it exists.
    """


@dataclasses.dataclass
class MergeLoraToBaseConfig:
    """Options of `merge_lora_to_base` (MindSpeed-MM's verb and option names).

    Args:
        source_path: The base weights as a Megatron checkpoint (hf_to_mm's output); any TP/PP.
        lora_path: A LoRA training checkpoint trained on that base (mm-grpo's or MindSpeed-MM's, as
            for lora_mm_to_hf), or one iteration folder of it.
        target_path: Megatron checkpoint folder to create: W + (alpha / r) B A for every adapted
            linear, in the base's layout (TP, PP stages) and dtype (computed in fp32).
        iteration: Iteration of lora_path; default: its latest.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
    """

    source_path: str
    lora_path: str
    target_path: str
    iteration: Optional[int] = None
    overwrite: bool = False


def refuse_adapter_checkpoint(ckpt):
    """A LoRA training checkpoint where whole weights are expected: one line naming the LoRA verbs."""
    lora_io.refuse_adapter_checkpoint(ckpt, LORA_KEY)


def is_mindspeed_mm_lora(tree) -> bool:
    """A shard of MindSpeed-MM's LoRA: no mm-grpo `lora` entry, peft-named adapters."""
    return lora_io.is_mindspeed_mm_lora(tree, LORA_KEY)


def mindspeed_mm_adapters(folder: str, found: dict, first: ShardReader) -> Adapters:
    """The LoRA settings and the flux block from Megatron's saved `args` (in `first`, the TP 0
    shard). peft shards the adapters over TP as mm-grpo's adapter rules do (tested at TP 2 against
    mm-grpo's LoRA: tests/distributed/checks_mindspeed_mm.py)."""
    tp, pp = (1 + max(k[i] for k in found) for i in (0, 1))
    if pp != 1 or set(found) != {(r, 0) for r in range(tp)}:
        raise ValueError(f"{folder}: a MindSpeed-MM LoRA checkpoint converts at PP 1 (this one: TP {tp}, PP {pp}, "
                         f"shards {sorted(found.values())}); its adapters' layout under PP is not verified")
    args = first.tree.get("args")
    predictor = getattr(getattr(getattr(args, "mm", None), "model", None), "predictor", None)
    if predictor is None or not getattr(args, "lora_target_modules", None):
        raise ValueError(f"{folder}: MindSpeed-MM LoRA checkpoint without the flux predictor block or "
                         "lora_target_modules in its saved args")
    block = {k: v for k, v in vars(predictor).items() if not k.startswith("_")}  # its fields, not the reader's own
    if block.get("model_id") != "flux":
        raise ValueError(f"{folder}: a LoRA checkpoint of MindSpeed-MM's {block.get('model_id')!r} predictor; "
                         "FluxConverter converts FLUX ('flux') only")
    flux_config = flux_config_from_block(block)
    config = flux_lora.LoRAConfig(r=args.lora_r, alpha=float(args.lora_alpha),
                                  targets=tuple(args.lora_target_modules), dropout=args.lora_dropout)
    others = [ShardReader(os.path.join(folder, found[(r, 0)], SHARD_FILE)) for r in range(1, tp)]
    readers = [first, *others]
    try:
        whole = {}
        for base in flux_lora.base_rules(flux_config, config.targets):
            pair = []
            for rule in flux_lora.adapter_rules(base):
                name = rule.megatron.removesuffix(".weight") + PEFT_ADAPTER_SUFFIX
                if name not in first.tree["model"]:
                    raise ValueError(f"{folder}: MindSpeed-MM LoRA checkpoint has no adapter {name} "
                                     f"(its targets: {list(config.targets)})")
                shards = readers[:1] if rule.shard == "replicated" else readers
                pair.append(layout.unshard(rule, [r.read(r.get("model", name)) for r in shards], flux_config))
            whole[base.hf[0]] = tuple(pair)
    finally:
        for reader in others:
            reader.close()
    return Adapters(flux_config, config, whole)


def _other_format(folder: str, found: dict, first: ShardReader) -> Optional[Adapters]:
    return mindspeed_mm_adapters(folder, found, first) if is_mindspeed_mm_lora(first.tree) else None


FAMILY = lora_io.LoraFamily(name="FLUX", lora=flux_lora, adapter_checkpoint=AdapterCheckpoint, lora_key=LORA_KEY,
                            to_diffusers=to_diffusers, other_format=_other_format)


def read_adapters(path: str, iteration: Optional[int]) -> Adapters:
    """The adapters of an mm-grpo or a MindSpeed-MM LoRA checkpoint."""
    return lora_io.read_adapters(FAMILY, path, iteration)


def lora_mm_to_hf(cfg: LoraMmToHfConfig):
    lora_io.lora_mm_to_hf(FAMILY, cfg)


def merge_lora_to_base(cfg: MergeLoraToBaseConfig, write_megatron, open_checkpoint, check_target):
    """`write_megatron`, `open_checkpoint`, `check_target`: converters/flux.py's writers and checks."""
    if not is_megatron_checkpoint(cfg.source_path):
        raise ValueError(f"--cfg.source_path {cfg.source_path} is not a Megatron checkpoint: convert the base with "
                         "hf_to_mm first")

    @contextlib.contextmanager
    def open_base():
        with contextlib.closing(open_checkpoint(cfg.source_path, None)) as base_ckpt:
            yield base_ckpt.config, base_ckpt.meta, lora_io.checkpoint_full(base_ckpt)

    lora_io.merge_lora_to_base(FAMILY, cfg, cfg.source_path, open_base, write_megatron, check_target)
