"""Megatron-style command line of the training entries (GRPO and flow-matching).

Names and meanings follow Megatron-LM / MindSpeed-MM so that launch scripts carry over:
parallel sizes, batch sizes, optimizer, checkpointing, logging, plus `--mm-model` /
`--mm-data` (MindSpeed-MM's JSON configs) and a GRPO group.
"""
import argparse
from typing import Optional

from mm_grpo.files.jsonfile import load_json
from mm_grpo.grpo.schedule import GRPOSettings
from mm_grpo.models.flux import lora
from mm_grpo.parallel.ulysses import ULYSSES_CP_ALGO
from mm_grpo.seeding import DEFAULT_SEED
from mm_grpo.settings import add_setting_args


def add_max_skipped_iterations(group):
    """--max-skipped-iterations (mm-grpo's trainers and mm_grpo.mindspeed_mm.grpo)."""
    group.add_argument("--max-skipped-iterations", type=int, default=10,
                       help="stop with an error after this many iterations in a row without an optimizer step "
                            "(non-finite rewards, loss or gradients); 0: never")


def add_eval_prompts(group):
    """--eval-prompts (mm-grpo's GRPO trainer and mm_grpo.mindspeed_mm.grpo)."""
    group.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation")


def _add_megatron_args(p):
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-algo", default=ULYSSES_CP_ALGO, choices=[ULYSSES_CP_ALGO])
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=int, default=30)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples (generations) per iteration over all data-parallel ranks")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=DEFAULT_SEED)
    g.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    g.add_argument("--recompute-activations", action="store_true",
                   help="activation checkpointing, one FLUX block at a time")
    add_max_skipped_iterations(g)
    g.add_argument("--compile-blocks", action="store_true",
                   help="torch.compile each FLUX block (fuses element-wise ops; the first iteration compiles)")

    g = p.add_argument_group("optimizer (AdamW)")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=1e-4)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None,
                   help="a training checkpoint to resume, or a converted `release` checkpoint to start from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-verify", action="store_true",
                   help="read checkpoint files without checking them against their sha256 files")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--save-image-interval", type=int, default=None)
    g.add_argument("--no-progress-bar", action="store_true")

    g = p.add_argument_group("mindspeed-mm")
    g.add_argument("--mm-model", required=True, help="model.json (ae, text_encoder, predictor, reward)")
    g.add_argument("--mm-data", required=True, help="data.json (dataset_param, dataloader_param)")


def _add_grpo_args(p):
    g = add_setting_args(p.add_argument_group("grpo"), GRPOSettings)
    g.add_argument("--height", type=int, default=None, help="image height (model.json default)")
    g.add_argument("--width", type=int, default=None)
    add_eval_prompts(g)
    g.add_argument("--ema-decay", type=float, default=0.0,
                   help="keep an EMA of the policy with at most this decay (0: none): it is nft's old policy "
                        "(it samples the rollouts) and the policy the held-out evaluation scores; checkpointed")
    g.add_argument("--ema-decay-ramp", type=float, default=0.001,
                   help="the EMA's decay after iteration i is min(ramp * i, --ema-decay) (DiffusionNFT's schedule)")


# flags that only shape the adapters: without --lora-target-modules they would change nothing
ADAPTER_FLAGS = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_load": None}


def _add_lora_args(parser):
    """MindSpeed-MM's LoRA arguments (mindspeed_mm/arguments.py `_add_lora_args`): LoRA is on when
    --lora-target-modules names modules. The adapter flags default to None, so that one given
    without targets is seen even at its default value; LoRAConfig holds the defaults."""
    g = parser.add_argument_group("lora")
    g.add_argument("--lora-target-modules", nargs="+", default=[], choices=sorted(lora.TARGETS),
                   help="linears that get LoRA adapters (docs/lora.md); none: full fine-tuning")
    g.add_argument("--lora-r", type=int, default=None, help=f"LoRA rank (default {lora.LoRAConfig.r})")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help=f"LoRA alpha, scale alpha / r (default {lora.LoRAConfig.alpha:g})")
    g.add_argument("--lora-dropout", type=float, default=None,
                   help=f"dropout on the adapters' input (default {lora.LoRAConfig.dropout:g}; from torch's RNG: "
                        "layout parity needs 0)")
    g.add_argument("--lora-load", default=None,
                   help="starting adapter: a diffusers / PEFT FLUX LoRA (.safetensors file or its folder)")
    return g


def _check_lora_args(args) -> None:
    """Refuses adapter flags without --lora-target-modules: the run would train the full model."""
    if args.lora_target_modules:
        return
    given = ["--" + dest.replace("_", "-") for dest in ADAPTER_FLAGS if getattr(args, dest) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} given without --lora-target-modules: add --lora-target-modules "
                         f"(e.g. {' '.join(lora.RECOMMENDED_TARGETS)}), or drop {', '.join(given)} for full fine-tuning")


def lora_config(args) -> Optional[lora.LoRAConfig]:
    """The run's LoRAConfig (LoRAConfig's defaults for the flags not given), or None without
    --lora-target-modules."""
    if not args.lora_target_modules:
        return None
    given = {field: getattr(args, dest) for dest, field in ADAPTER_FLAGS.items()
             if field is not None and getattr(args, dest) is not None}
    return lora.LoRAConfig(targets=tuple(args.lora_target_modules), **given)


def build_parser(add_args=_add_grpo_args):
    """The Megatron-style arguments, and the trainer's own group (`add_args(parser)`)."""
    p = argparse.ArgumentParser(description="mm-grpo training (Megatron-style arguments)",
                                allow_abbrev=False)
    _add_megatron_args(p)
    _add_lora_args(p)
    add_args(p)
    return p


def check_counts(args):
    """Counts and intervals that would otherwise fail deep inside (a division by zero on one rank)."""
    for name in ("log_interval", "distributed_timeout_minutes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("train_iters", "save_interval", "eval_interval", "save_image_interval", "max_skipped_iterations"):
        if (getattr(args, name) or 0) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")


def parse_args(argv=None, add_args=_add_grpo_args):
    args = build_parser(add_args).parse_args(argv)
    check_counts(args)
    _check_lora_args(args)
    args.mm_model_config = load_json(args.mm_model, "--mm-model")
    args.mm_data_config = load_json(args.mm_data, "--mm-data")
    return args
