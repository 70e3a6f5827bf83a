"""Megatron-style command line of the training entries (GRPO and flow-matching).

Names and meanings follow Megatron-LM / MindSpeed-MM so that launch scripts carry over:
parallel sizes, batch sizes, optimizer, checkpointing, logging, plus `--mm-model` /
`--mm-data` (MindSpeed-MM's JSON configs) and a GRPO group.
"""
import argparse
import dataclasses
from typing import Optional, Tuple

from mm_grpo.families.flux.transformer import lora
from mm_grpo.files.jsonfile import load_json
from mm_grpo.grpo.denoiser import NegativePrompt
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.parallel.ulysses import ULYSSES_CP_ALGO
from mm_grpo.recompute import METHODS, recompute_from_flags
from mm_grpo.seeding import DEFAULT_SEED
from mm_grpo.settings import accept_negative_numbers, add_setting_args, check_bounds, from_args, setting
from mm_grpo.training import components
from mm_grpo.training.entry import refuse_once_per_launch

# Each class is one argument group; its fields are the flags (mm_grpo/settings.py). The trainers
# read them from the parsed namespace by Megatron's names (args.lr, args.save, ...).


@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    tensor_model_parallel_size: int = setting(1, "tensor-parallel size (TP)", minimum=1)
    pipeline_model_parallel_size: int = setting(1, "pipeline-parallel size (PP)", minimum=1)
    context_parallel_size: int = setting(1, "sequence-parallel size (Ulysses; MindSpeed's context parallelism)",
                                         minimum=1)
    context_parallel_algo: str = setting(ULYSSES_CP_ALGO, "context-parallel algorithm (FLUX runs Ulysses)",
                                         choices=[ULYSSES_CP_ALGO])
    use_distributed_optimizer: bool = setting(False, "shard the optimizer state over the data-parallel ranks")
    distributed_timeout_minutes: int = setting(30, "timeout of every collective", minimum=1)


@dataclasses.dataclass(frozen=True)
class GuardArgs:
    """Shared with mm_grpo.mindspeed_mm.grpo."""
    max_skipped_iterations: int = setting(
        10, "stop with an error after this many iterations in a row without an optimizer step "
            "(non-finite rewards, loss or gradients); 0: never", minimum=0)


@dataclasses.dataclass(frozen=True)
class ExitArgs:
    """Megatron's exits for preempted and time-limited jobs (mm_grpo/training/preemption.py)."""
    exit_signal_handler: bool = setting(
        False, "on SIGTERM or SIGINT (Megatron's: SIGTERM only), finish the iteration in progress, save it "
               "(agreed by every rank) and exit 0, as Megatron does; a second signal changes nothing (the shipped "
               "scripts end the job at once on their second one); needs --save")
    exit_duration_in_mins: Optional[float] = setting(
        None, "save and exit 0 before this many minutes since the process started: after an iteration, once the "
              "elapsed time plus the longest iteration so far plus the last save's duration would pass it "
              "(Megatron's exits after the limit has passed); needs --save", above=0)


@dataclasses.dataclass(frozen=True)
class TrainingArgs:
    micro_batch_size: int = setting(1, "samples per forward/backward on one rank")
    global_batch_size: Optional[int] = setting(
        None, "samples per optimizer step over all data-parallel ranks, as in Megatron (GRPO: (sample, trained step) "
              "rows, derived from --prompts-per-iteration and checked when given; grpo/batch.py)")
    train_iters: int = setting(None, "iterations to train", required=True, minimum=0)
    seed: int = setting(DEFAULT_SEED, "seed of every random stream (Megatron's default)")
    bf16: bool = setting(False, "bf16 compute with fp32 master weights")
    recompute_granularity: Optional[str] = setting(
        None, "Megatron's activation recompute: full (whole blocks, with --recompute-method and "
              "--recompute-num-layers); selective (core attention only) is refused", choices=["full", "selective"])
    recompute_method: Optional[str] = setting(
        None, "uniform: the blocks of each pipeline stage (virtual chunk) in groups of --recompute-num-layers, each "
              "group's input kept and the group run again in the backward; block: only the first "
              "--recompute-num-layers blocks of each stage, one at a time (mm_grpo/recompute.py)",
        choices=list(METHODS))
    recompute_num_layers: Optional[int] = setting(
        None, "uniform: blocks per recomputed group (1: every block); block: blocks recomputed per stage", minimum=1)
    recompute_activations: bool = setting(False, "Megatron's selective recompute (core attention only): refused "
                                                 "in one line naming the full flags")
    compile_blocks: bool = setting(False, "torch.compile each FLUX block (fuses element-wise ops; the first "
                                          "iteration compiles)")


@dataclasses.dataclass(frozen=True)
class OptimizerArgs:
    """AdamW and its learning-rate schedule (Megatron's OptimizerConfig / OptimizerParamScheduler)."""
    lr: float = setting(1e-5, "peak learning rate", above=0)
    min_lr: float = setting(0.0, "learning rate at the end of the decay", minimum=0)
    lr_decay_style: str = setting("constant", "learning-rate decay", choices=["constant", "linear", "cosine"])
    lr_warmup_iters: int = setting(0, "linear warm-up from 0, in iterations", minimum=0)
    lr_decay_iters: Optional[int] = setting(None, "iterations of the decay (default: --train-iters)", minimum=1)
    weight_decay: float = setting(1e-4, "AdamW's decoupled weight decay", minimum=0)
    adam_beta1: float = setting(0.9, "AdamW's beta1", minimum=0, below=1)
    adam_beta2: float = setting(0.999, "AdamW's beta2", minimum=0, below=1)
    adam_eps: float = setting(1e-8, "AdamW's epsilon", above=0)
    clip_grad: float = setting(1.0, "gradient-norm clipping (over all ranks)", minimum=0)


@dataclasses.dataclass(frozen=True)
class CheckpointArgs:
    save: Optional[str] = setting(None, "folder of the training checkpoints")
    load: Optional[str] = setting(None, "a training checkpoint to resume, or a converted `release` checkpoint "
                                        "to start from")
    save_interval: Optional[int] = setting(None, "iterations between checkpoints", minimum=0)
    ckpt_step: Optional[int] = setting(None, "the iteration of --load to resume (Megatron's checkpoint step; default: "
                                             "the one its latest_checkpointed_iteration.txt names, which only the "
                                             "next save moves)", minimum=0)
    no_load_optim: bool = setting(False, "resume the weights without the optimizer state")
    no_load_rng: bool = setting(False, "resume without the random generators' states")
    no_verify: bool = setting(False, "read checkpoint files without checking them against their sha256 files")


@dataclasses.dataclass(frozen=True)
class LoggingArgs:
    log_interval: int = setting(1, "iterations between logged lines", minimum=1)
    tensorboard_dir: Optional[str] = setting(None, "TensorBoard event folder")
    eval_interval: Optional[int] = setting(None, "iterations between held-out evaluations", minimum=0)
    save_image_interval: Optional[int] = setting(None, "iterations between saved rollout images", minimum=0)
    no_progress_bar: bool = setting(False, "no progress bar (logged lines only)")


@dataclasses.dataclass(frozen=True)
class MindSpeedMMArgs:
    mm_model: str = setting(None, "model.json (ae, text_encoder, predictor, reward)", required=True)
    mm_data: str = setting(None, "data.json (dataset_param, dataloader_param)", required=True)


@dataclasses.dataclass(frozen=True)
class LoRAArgs:
    """MindSpeed-MM's LoRA arguments (mindspeed_mm/arguments.py `_add_lora_args`): LoRA is on when
    --lora-target-modules names modules. The adapter flags default to None, so that one given
    without targets is seen even at its default value; LoRAConfig holds the defaults."""
    lora_target_modules: Tuple[str, ...] = setting(
        (), "linears that get LoRA adapters (each family's: docs/lora.md, docs/qwen_image.md); none: full fine-tuning",
        choices=sorted({t for family in components.TRAINED.values() for t in family.lora.TARGETS}))
    lora_r: Optional[int] = setting(None, f"LoRA rank (default {lora.LoRAConfig.r})")
    lora_alpha: Optional[float] = setting(None, f"LoRA alpha, scale alpha / r (default {lora.LoRAConfig.alpha:g})")
    lora_dropout: Optional[float] = setting(
        None, f"dropout on the adapters' input (default {lora.LoRAConfig.dropout:g}; from torch's RNG: layout "
              "parity needs 0)")
    lora_load: Optional[str] = setting(None, "starting adapter: a diffusers / PEFT LoRA of the model (.safetensors "
                                             "file or its folder)")


# the LoRA flags that only shape the adapters (-> their LoRAConfig field): without
# --lora-target-modules they would change nothing
ADAPTER_FLAGS = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_load": None}


@dataclasses.dataclass(frozen=True)
class HeldOutArgs:
    """Shared with mm_grpo.mindspeed_mm.grpo."""
    eval_prompts: int = setting(8, "held-out prompts per evaluation", minimum=1)


@dataclasses.dataclass(frozen=True)
class GRPORunArgs:
    """mm-grpo's GRPO trainer's own flags beside GRPOSettings."""
    height: Optional[int] = setting(None, "image height (model.json default)")
    width: Optional[int] = setting(None, "image width (model.json default)")
    ema_decay: float = setting(0.0, "keep an EMA of the policy with at most this decay (0: none): it is nft's old "
                                    "policy (it samples the rollouts) and the policy the held-out evaluation "
                                    "scores; checkpointed", minimum=0, below=1)
    ema_decay_ramp: float = setting(0.001, "the EMA's decay after iteration i is min(ramp * i, --ema-decay) "
                                           "(DiffusionNFT's schedule)", above=0)


# argument group -> the classes whose flags it holds, in the order of Megatron's parser
MEGATRON_GROUPS = {"distributed": (DistributedArgs,), "training": (TrainingArgs, GuardArgs, ExitArgs),
                   "optimizer (AdamW)": (OptimizerArgs,), "checkpointing": (CheckpointArgs,),
                   "logging": (LoggingArgs,), "mindspeed-mm": (MindSpeedMMArgs,), "lora": (LoRAArgs,)}
# each trained family's guidance flags (FLUX's embedding, Qwen-Image's true CFG): `family_guidance` reads its own
GUIDANCE = tuple(dict.fromkeys(family.guidance for family in components.TRAINED.values()))
GRPO_GROUP = {"grpo": (GRPOSettings, *GUIDANCE, NegativePrompt, HeldOutArgs, GRPORunArgs)}


def family_guidance(args, family):
    """The run's guidance settings, its family's; a guidance flag of another family given is refused in
    one line (it would change nothing)."""
    for other in GUIDANCE:
        if other is family.guidance:
            continue
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(other)
                 if f.name not in {g.name for g in dataclasses.fields(family.guidance)}
                 and getattr(args, f.name) != f.default]
        if given:
            raise ValueError(f"{', '.join(given)}: the guidance of another model family; model.json's predictor is "
                             f"{family.model_id!r}, whose guidance flags are "
                             f"{', '.join('--' + f.name.replace('_', '-') for f in dataclasses.fields(family.guidance))}")
    return from_args(family.guidance, args)


def _check_lora_args(args) -> None:
    """Refuses adapter flags without --lora-target-modules: the run would train the full model."""
    if args.lora_target_modules:
        return
    given = ["--" + dest.replace("_", "-") for dest in ADAPTER_FLAGS if getattr(args, dest) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} given without --lora-target-modules: add --lora-target-modules "
                         f"(e.g. {' '.join(lora.RECOMMENDED_TARGETS)}), or drop {', '.join(given)} for full fine-tuning")


def lora_config(args, family):
    """The run's LoRAConfig, the family's (its defaults for the flags not given; a target the family's
    model does not have refused in one line), or None without --lora-target-modules."""
    if not args.lora_target_modules:
        return None
    given = {field: getattr(args, dest) for dest, field in ADAPTER_FLAGS.items()
             if field is not None and getattr(args, dest) is not None}
    return family.lora.LoRAConfig(targets=tuple(args.lora_target_modules), **given)


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusal in one line printed once per launch, exit 2, instead of its usage text on
    every rank."""

    def error(self, message):
        refuse_once_per_launch(f"{message} (--help lists the flags)")


def _groups(own_groups) -> dict:
    """Title -> settings classes of every argument group: Megatron's, then the trainer's own."""
    return {**MEGATRON_GROUPS, **own_groups}


def build_parser(own_groups=GRPO_GROUP):
    """The Megatron-style arguments and the trainer's own groups (title -> settings classes)."""
    p = accept_negative_numbers(OneLineParser(description="mm-grpo training (Megatron-style arguments)",
                                              allow_abbrev=False))
    for title, classes in _groups(own_groups).items():
        group = p.add_argument_group(title)
        for cls in classes:
            add_setting_args(group, cls)
    return p


def parse_args(argv=None, own_groups=GRPO_GROUP, dataset_keys=components.GRPO_DATASET_KEYS):
    """The trainer's arguments with --mm-model / --mm-data read and their keys checked (`dataset_keys`:
    what the trainer reads of data.json's dataset_param), every refusal one line before any work."""
    args = build_parser(own_groups).parse_args(argv)
    check_bounds(args, *(cls for classes in _groups(own_groups).values() for cls in classes))
    _check_lora_args(args)
    args.recompute = recompute_from_flags(args.recompute_granularity, args.recompute_method,
                                          args.recompute_num_layers, args.recompute_activations)
    args.mm_model_config = load_json(args.mm_model, "--mm-model")
    args.mm_data_config = load_json(args.mm_data, "--mm-data")
    components.check_model_config(args.mm_model_config, args.mm_model)
    components.check_data_config(args.mm_data_config, args.mm_data, dataset_keys)
    return args
