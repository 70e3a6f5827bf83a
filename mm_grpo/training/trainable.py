"""The trainable model of a training run (GRPO or flow matching), of the family model.json's predictor
names (mm_grpo/families/__init__.py `Family`: FLUX or Qwen-Image): parallel layout, this rank's model
chunks with their starting weights, DDP, optimizer, LR schedule, checkpoint metadata.

Starting weights: `--load` names either a training checkpoint (`iter_*`: resume weights,
optimizer and RNG from it) or converted weights (`release`, or a diffusers folder) to start
from; without `--load`, `predictor.from_pretrained` of model.json. With --lora-target-modules
the starting weights are the frozen base of LoRA adapters (docs/lora.md); a LoRA training
checkpoint holds the adapters and names its base.
"""
import dataclasses
import os
from types import ModuleType
from typing import List, Optional

from mm_grpo import get_platform
from mm_grpo import configs
from mm_grpo.checkpoint.paths import RELEASE, is_megatron_checkpoint, iteration_dir
from mm_grpo.families import Family
from mm_grpo.families.flux.family import FAMILY as FLUX
from mm_grpo.parallel import ParallelConfig
from mm_grpo.parallel.pipeline_layout import resolve_pp_layers
from mm_grpo.recompute import recompute_fields
from mm_grpo.training import arguments, components, run_guard
from mm_grpo.training.loop import TrainingRun
from mm_grpo.training.optim import build_optimizer, build_scheduler, unwrap, wrap_ddp


@dataclasses.dataclass
class RunConfigs:
    model: dict  # model.json, paths resolved against its folder
    data: dict  # data.json, likewise
    predictor: dict  # model.json's predictor block
    family: Family  # the predictor's model family
    config: object  # the family's model config, with the run's runtime options


def run_configs(args) -> RunConfigs:
    """model.json / data.json, the model family and its architecture of a run (GRPO or flow matching);
    refuses --bf16 on CPU with TP > 1 before any work."""
    folder = lambda path: os.path.dirname(os.path.abspath(path))  # noqa: E731
    model = components.resolve_paths(args.mm_model_config, folder(args.mm_model))
    data = components.resolve_paths(args.mm_data_config, folder(args.mm_data))
    if args.bf16 and get_platform().name == "cpu" and args.tensor_model_parallel_size > 1:
        # On one TP rank the linears compute their GEMMs themselves (mm_grpo/layers.py).
        raise ValueError("--bf16 with --tensor-model-parallel-size > 1 needs an accelerator: megatron-core's "
                         "tensor-parallel linears restore CUDA autocast in their backward, so bf16 autocast fails "
                         "on CPU (train in fp32 there, or with TP 1)")
    predictor = configs.block(model, "predictor", configs.MODEL_FLAG)
    family = components.trained_family(model)
    # The flags decide, whatever model.json's predictor block says (its older recompute_blocks too).
    runtime = dict(recompute_blocks=False, **recompute_fields(args.recompute), bf16=args.bf16)
    if args.compile_blocks:
        runtime["compile_blocks"] = True
    return RunConfigs(model, data, predictor, family, family.config_from_block(dict(predictor, **runtime)))


class ConfiguredRun(TrainingRun):
    """A trainer's run with its configs read first, before anything heavy: model.json, data.json,
    the predictor block, the model family and its config (`run_configs`), and the device."""

    def __init__(self, args):
        super().__init__(args)
        configs = run_configs(args)
        self.model_cfg, self.data_cfg, self.predictor = configs.model, configs.data, configs.predictor
        self.family, self.config = configs.family, configs.config
        self.device = get_platform().device


def parallel_config(args, predictor: dict) -> ParallelConfig:
    """TP / PP / CP from the arguments; virtual stages from a nested `pipeline_num_layers`."""
    layers = predictor.get("pipeline_num_layers")
    nested = bool(layers) and all(isinstance(x, (list, tuple)) for x in layers) and len(layers) > 1
    return ParallelConfig(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                          cp=args.context_parallel_size, cp_algo=args.context_parallel_algo,
                          vpp=len(layers) if nested else None)


def is_training_checkpoint(path: str) -> bool:
    return is_megatron_checkpoint(path) and os.path.basename(iteration_dir(path)) != RELEASE


@dataclasses.dataclass
class Trainable:
    chunks: list  # this rank's DDP-wrapped model chunks
    optimizer: object
    scheduler: object
    meta: object  # the family's checkpoint metadata
    weights: ModuleType  # the family's weights in a training checkpoint (training/checkpointing.py)
    pp_layers: List[List[int]]
    initial: Optional[str]  # the starting weights (None when resuming without from_pretrained)
    resume: bool  # --load is a training checkpoint: call `load_checkpoint` after building
    lora: Optional[dict] = None  # a LoRA run's checkpoint entry (FLUX's: mm_grpo/families/flux/checkpoint/adapters.py)

    @property
    def modules(self):
        """The bare model chunks inside DDP (for no-grad forwards)."""
        return unwrap(self.chunks)


def build_trainable(args, family: Family, config, predictor: dict, parallel: ParallelConfig) -> Trainable:
    """Model chunks of the `family` with their starting weights (not yet the resumed ones), DDP, optimizer."""
    pp_layers = resolve_pp_layers(predictor.get("pipeline_num_layers"), config.num_blocks,
                                  parallel.pp, parallel.vpp or 1)
    load = None if run_guard.fresh_start(args.load, args.save) else args.load
    resume = bool(load) and is_training_checkpoint(load)
    initial = predictor.get("from_pretrained") if resume or not load else load
    if initial is None and not resume:
        raise ValueError("no starting weights: give --load or predictor.from_pretrained in --mm-model")
    chunks = family.build_model_chunks(config, pp_layers)
    lora_config = arguments.lora_config(args, family)
    entry = None
    if lora_config is not None:
        entry = add_lora(chunks, lora_config, args, initial, resume, family, config)
    elif not resume:  # a resumed run takes its weights from the training checkpoint
        family.load_pretrained(chunks, initial)
    elif family.lora_entry(args.load) is not None:
        raise ValueError(f"--load {args.load} is a LoRA checkpoint (adapters only): resume it with its "
                         "--lora-target-modules / --lora-r / --lora-alpha")
    ddp, optimizer, scheduler = optimize(chunks, args)
    meta = family.checkpoint_meta(config, tp_size=parallel.tp,
                                  pp_layers=pp_layers[0] if len(pp_layers) == 1 else pp_layers)
    return Trainable(ddp, optimizer, scheduler, meta, family.weights, pp_layers, initial, resume, entry)


def optimize(chunks, args):
    """(DDP-wrapped chunks, optimizer, LR schedule) from the Megatron optimizer arguments: every
    entry's (the trainers' and the benches') one way to make chunks trainable."""
    ddp = wrap_ddp(chunks, args.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, args)
    return ddp, optimizer, build_scheduler(optimizer, args)


def attach_lora(chunks, config, seed: int, bf16: bool, ranks: Optional[dict] = None,
                loaded: Optional[dict] = None, family: Family = FLUX):
    """Adapters (the family's `LoRAConfig` `config`) on each chunk's frozen base (`loaded`: diffusers
    adapters copied in), the base held in bf16 under `bf16`, the dtype the model computes in
    (docs/lora.md): the trainer's LoRA, and the benches'."""
    lora = family.lora
    for chunk in chunks:
        lora.add_adapters(chunk, config, seed, ranks)
        if loaded is not None:
            lora.copy_full_adapters(chunk, loaded, config)
        if bf16:
            lora.freeze_base_in_bf16(chunk)


def add_lora(chunks, config, args, initial: Optional[str], resume: bool, family: Family, model_config) -> dict:
    """The base weights (a resumed run's: those its checkpoint recorded), frozen, and adapters
    (from --lora-load, or new); returns the checkpoint entry (FLUX's: mm_grpo/families/flux/checkpoint/adapters.py)."""
    ranks = {}
    if resume:
        saved = family.lora_entry(args.load)
        if saved is None:
            raise ValueError(f"--load {args.load} is a full training checkpoint, not a LoRA one: "
                             "resume it without --lora-target-modules")
        if family.lora.LoRAConfig.from_json(saved["config"]) != config:
            raise ValueError(f"--load {args.load} was trained with LoRA {saved['config']}, not {config.to_json()}")
        initial, ranks = family.checkpoint_base(args.load) or initial, saved.get("ranks", {})
        if initial is None:
            raise ValueError(f"the base weights of {args.load} are gone: give predictor.from_pretrained in --mm-model")
    loaded = None
    if args.lora_load and not resume:  # read (and checked) before the base weights
        loaded = family.read_diffusers_lora(args.lora_load, model_config, config)
        ranks = {name: a.shape[0] for name, (a, _) in loaded.items() if a.shape[0] != config.r}
    family.load_pretrained(chunks, initial)
    attach_lora(chunks, config, args.seed, args.bf16, ranks, loaded, family)
    return {"config": config.to_json(), "ranks": ranks, "base": os.path.abspath(initial)}
