"""GRPO of FLUX, or of MindSpeed-MM's own Wan2.1 DiT (`"model_id": "wandit"`, mm_grpo/families/wan/mindspeed_mm.py),
inside MindSpeed-MM's own `pretrain` (its fork of Megatron-LM's loop).

    torchrun $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.grpo $GPT_ARGS $MM_ARGS $GRPO_ARGS $OUTPUT_ARGS

(examples/flux/mindspeed_mm/grpo_flux.sh.) Before `pretrain` starts, every process checks the
command line and the files it names as `pretrain` will read them (`check_launch`): the config
blocks, prompt files and rewards, the batch sizes, `--load`'s iteration and the flags this entry
refuses. A refusal is one line per launch (`run_entry`), before Megatron is initialized.

MindSpeed-MM's `pretrain` then parses Megatron's arguments (plus the GRPO group below),
initializes Megatron, builds the model through `model_provider` (the `flux` or `wandit` predictor
of `--mm-model`, made by MindSpeed-MM's `PredictModel`, its `from_pretrained` file loaded by
MindSpeed-MM's `load_checkpoint`), wraps it in DDP, builds the optimizer and LR schedule, loads
`--load`, then asks `train_valid_test_datasets_provider` for the data iterator and runs its
training loop: per step, Megatron's forward-backward over `get_num_microbatches()` micro-batches
with `forward_step`, the optimizer step, logging and `--save` checkpoints.

GRPO fits that loop through the data iterator (mm_grpo/mindspeed_mm/adapter.py): its
micro-batches are (generation, trained step) rows; when they run out it runs the next rollout,
reward and advantages with the model `pretrain` built. Megatron's `--global-batch-size` counts
those rows per optimizer step: (generations per update) x (trained steps per sample K), so
the GRPO batch of a rollout is `--global-batch-size / K x --updates-per-rollout` generations.
`--mm-model` holds the `predictor` (MindSpeed-MM's way), `ae`, `text_encoder`, `reward` blocks
and `image_size`; `--mm-data` the prompt files (as mm-grpo's own trainer reads them). Relative
paths in them are taken from the working directory, as MindSpeed-MM takes them.

As mm-grpo's own trainer (mm_grpo/training/train_grpo.py), with its pieces: `--save` is locked
and probed before the first rollout (`run_guard.prepare_save_folder`); a rollout with non-finite
rewards is skipped, and `--max-skipped-iterations` of them in a row stop the run (exit 3, nothing
saved of them); `--kl-beta` has its frozen reference, the starting policy (under MindSpeed-MM's
own LoRA, `--lora-target-modules`, the frozen base: mm_grpo/mindspeed_mm/lora.py); with
`eval_prompt_file` in `--mm-data`, the held-out evaluation (`Evaluator`) runs before the first
step, every `--eval-interval` steps (Megatron's flag: this entry has no validation set) and at
the end.

The rollout runs before each step's forward-backward, on every rank at once
(`adapter.rollout_before_each_step`), so Wan's pipeline stages roll out together.

Megatron's `--exit-signal-handler` and `--exit-duration-in-mins` are its loop's own: after an iteration
it saves and exits 0 (`sys.exit()`) once any rank got SIGTERM, or once the minutes since its start have
passed the limit (mm-grpo's trainers stop before it). This entry makes SIGINT count as SIGTERM (as in
mm-grpo's trainers), runs both checks only after an iteration that ends a rollout (a checkpoint inside
one could not be resumed), and refuses either without `--save` (Megatron's save would fail on it).

Refused, each in one line: pipeline parallelism for FLUX (this entry gives Megatron's schedule
wandit's stage tensors only; mm-grpo's own trainer runs FLUX under PP and VPP); mm-grpo's `--ema-decay` /
`--ema-decay-ramp` (in MindSpeed's parser `--ema-decay` is its fused_ema_adamw optimizer's decay,
and Megatron's checkpoint could not hold the EMA); `--load` inside a rollout (a multiple of
--updates-per-rollout), and with --updates-per-rollout > 1 a `--save-interval` or
`--train-iters` that would end a run or save inside one.
"""
import argparse
import contextlib
import dataclasses
import io
import os
import signal
import sys
from typing import List, Optional

import mm_grpo  # noqa: I001  (first: on Ascend, torch_npu and MindSpeed's Megatron adaptor before Megatron)
import torch
from megatron.core.enums import ModelType
from megatron.training import get_args

import mm_grpo.mindspeed_mm.registry  # noqa: F401  (`"model_id": "flux"` in MindSpeed-MM's predictor mapping)
from mm_grpo import configs
from mm_grpo.checkpoint import resume
from mm_grpo.data import PromptStream
from mm_grpo.families.flux.denoiser import FluxGuidance
from mm_grpo.families.qwen_image.denoiser import QwenImageGuidance
from mm_grpo.families.wan import mindspeed_mm as wan
from mm_grpo.grpo.denoiser import NegativePrompt
from mm_grpo.files.jsonfile import load_json
from mm_grpo.files.lock import RunFolderLocked
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.mindspeed_mm import lora
from mm_grpo.mindspeed_mm.adapter import GRPOMicroBatches, grpo_forward_step, rollout_before_each_step
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.settings import accept_negative_numbers, add_setting_args, check_bounds, from_args
from mm_grpo.training import components, run_guard
from mm_grpo.training.arguments import GuardArgs, HeldOutArgs, OneLineParser, OptimizerArgs, family_guidance
from mm_grpo.training.entry import run_entry, speaks_for_launch
from mm_grpo.training.evaluation import compare, eval_settings, held_out_evaluator
from mm_grpo.training.logging_utils import is_logging_rank
from mm_grpo.training.preemption import check_exit_args

OWN_TRAINER = "mm_grpo.training.train_grpo"
MODEL_BLOCKS = ("predictor", "ae", "text_encoder", "reward")  # what --mm-model must hold
PP_REFUSAL = (
    "pipeline parallelism (--pipeline-model-parallel-size {pp}) is not supported for {model} by "
    "mm_grpo.mindspeed_mm.grpo: it gives Megatron's pipeline schedule the stage tensors of MindSpeed-MM's wandit "
    "only (docs/grpo_schedule.md section 11); use --pipeline-model-parallel-size 1, or "
    f"{OWN_TRAINER}, which runs it under PP and VPP")
EMA_REFUSAL = (
    "{flag}: mm_grpo.mindspeed_mm.grpo keeps no EMA of the policy (MindSpeed's parser reads --ema-decay as its "
    "fused_ema_adamw optimizer's decay, with --optimizer-selection fused_ema_adamw, and Megatron's checkpoint "
    f"would not hold mm-grpo's EMA): use {OWN_TRAINER} for an EMA policy (nft's old policy, the evaluated weights)")


# the GRPO group's flags beside MindSpeed-MM's own (the batch sizes and the seed are Megatron's)
OWN_SETTINGS = (GRPOSettings, FluxGuidance, wan.WanGuidance, QwenImageGuidance, NegativePrompt, GuardArgs, HeldOutArgs)


class LaunchRefused(ValueError):
    """A refusal computed from the command line and the files it names: the same on every process."""


def add_grpo_args(parser):
    """MindSpeed-MM's --mm-data / --mm-model / --mm-tool and the GRPO group (GRPOSettings' flags,
    --max-skipped-iterations, --eval-prompts; the batch sizes and the seed are Megatron's own), on
    Megatron's parser reading "-1e-4" as a value (its bounds then refuse it in one line)."""
    from mindspeed_mm.configs.config import mm_extra_args_provider
    group = mm_extra_args_provider(accept_negative_numbers(parser)).add_argument_group("grpo")
    for cls in OWN_SETTINGS:
        add_setting_args(group, cls)
    return parser


# --- the checks before `pretrain` ---------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """What the checks before `pretrain` read and built (the same on every process)."""
    args: argparse.Namespace  # Megatron's arguments as `pretrain` parses them (before its validation)
    model_cfg: dict  # --mm-model, paths resolved from the working directory
    data_cfg: dict  # --mm-data, likewise
    settings: GRPOSettings
    prompts: PromptStream
    eval_prompts: Optional[List[str]]  # the held-out prompts evaluated (--eval-prompts of eval_prompt_file)
    reward: CombinedReward
    guidance: object  # the model family's guidance settings: FluxGuidance, QwenImageGuidance or wan.WanGuidance


def parse_launch_args(argv) -> argparse.Namespace:
    """Megatron's arguments as MindSpeed-MM's `pretrain` parses them (its parser, MindSpeed's and
    MindSpeed-MM's groups, this entry's), without Megatron's validation. argparse's refusal is one
    line and its --help is printed by the launch's first process only (as `OneLineParser`'s)."""
    from megatron.training.arguments import parse_args
    from mindspeed.arguments import parse_args_wrapper
    from mindspeed_mm.arguments import extra_args_provider_decorator
    command_line, refuse = sys.argv, argparse.ArgumentParser.error
    sys.argv = [command_line[0], *argv]
    argparse.ArgumentParser.error = OneLineParser.error  # Megatron builds its parser inside parse_args
    quiet = contextlib.nullcontext() if speaks_for_launch() else contextlib.redirect_stderr(io.StringIO())
    try:
        with quiet:
            return parse_args_wrapper(parse_args)(extra_args_provider_decorator(add_grpo_args), False)
    finally:
        sys.argv, argparse.ArgumentParser.error = command_line, refuse


def grpo_settings(args, model_cfg, dp_size: int) -> GRPOSettings:
    """GRPOSettings from the GRPO flags, Megatron's micro-batch size and seed, and model.json's image
    size; Megatron's --global-batch-size, when given, checked against the batch it derives (grpo/batch.py)."""
    height, width = components.image_size(model_cfg)
    settings = from_args(GRPOSettings, args, height=height, width=width)
    settings.check(dp_size)
    if args.global_batch_size is not None:
        settings.batch.check_global_batch_size(args.global_batch_size)
    return settings


# Why Wan's --cfg-scale does not apply to a family mm-grpo builds
CFG_SCALE_REFUSALS = {
    "FLUX": "FLUX.1 is guidance-distilled and takes its guidance as an embedding (--guidance-scale); "
            "classifier-free guidance is for models without one (Wan)",
    "Qwen-Image": "Qwen-Image's classifier-free guidance is QwenImagePipeline's true CFG (--true-cfg-scale)"}


def guidance_settings(args, model_cfg):
    """The model family's guidance flags: Wan's classifier-free guidance, Qwen-Image's true CFG, or FLUX's
    embedding; another family's guidance flag is refused in one line."""
    if wan.is_wan(model_cfg):
        guidance = from_args(wan.WanGuidance, args)
        guidance.check()
        if args.true_cfg_scale != QwenImageGuidance.true_cfg_scale:
            raise ValueError("--true-cfg-scale is Qwen-Image's true CFG; Wan2.1's classifier-free guidance is "
                             "--cfg-scale")
        return guidance
    family = components.trained_family(model_cfg)
    if args.cfg_scale != wan.WanGuidance.cfg_scale:
        raise ValueError(f"--cfg-scale {args.cfg_scale}: {CFG_SCALE_REFUSALS[family.name]}")
    return family_guidance(args, family)


def resumed_iteration(args) -> int:
    """The iteration Megatron's `load_checkpoint` resumes at: 0 without --load, with --finetune or
    for a release checkpoint; else --ckpt-step, or the --load folder's tracker file."""
    if not args.load or args.finetune:
        return 0
    # Megatron reads --ckpt-step 0 as not given; a tracker that holds anything but "release" or a
    # number is refused naming the file; none: nothing saved yet (the model's own weights)
    return resume.requested_iteration(args.load, getattr(args, "ckpt_step", None) or None) or 0


def check_resume_point(args):
    """The iteration Megatron will load is intact (mm_grpo/checkpoint/resume.py) and below
    --train-iters (equal: one line saying that nothing is left to train)."""
    if not args.load or args.finetune:
        return
    point = resume.resume_point(args.load, getattr(args, "ckpt_step", None) or None)
    if point is None or args.train_iters is None:
        return
    notice = resume.check_train_iters(point, args.train_iters)
    if notice and speaks_for_launch() and os.environ.get("RANK", "0") == "0":
        print(notice, flush=True)


def check_rollout_boundary(iteration: int, updates_per_rollout: int):
    if iteration % updates_per_rollout:
        raise ValueError(f"--load: iteration {iteration} is inside a rollout (--updates-per-rollout "
                         f"{updates_per_rollout}); resume from a checkpoint at a rollout boundary")


def _check_launch(argv) -> Launch:
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if "--ema-decay-ramp" in flags:  # not in Megatron's parser: refused before argparse's usage error
        raise ValueError(EMA_REFUSAL.format(flag="--ema-decay-ramp"))
    args = parse_launch_args(argv)
    if "--ema-decay" in flags and getattr(args, "optimizer_selection", None) != "fused_ema_adamw":
        raise ValueError(EMA_REFUSAL.format(flag="--ema-decay"))
    check_bounds(args, *OWN_SETTINGS, OptimizerArgs)  # Megatron's --lr, --weight-decay... as mm-grpo's trainer
    check_exit_args(args)
    for flag, what in (("--mm-model", "model.json"), ("--mm-data", "data.json"),
                       ("--mm-tool", "MindSpeed-MM's tools.json, whose profiler settings its pretrain reads")):
        if not getattr(args, flag[2:].replace("-", "_")):
            raise ValueError(f"{flag} is required ({what})")
    cwd = os.getcwd()  # MindSpeed-MM reads relative paths from the working directory
    model_cfg, data_cfg = load_json(args.mm_model, "--mm-model"), load_json(args.mm_data, "--mm-data")
    components.check_model_config(model_cfg, args.mm_model)
    components.check_data_config(data_cfg, args.mm_data)
    model_cfg, data_cfg = components.resolve_paths(model_cfg, cwd), components.resolve_paths(data_cfg, cwd)
    for name in MODEL_BLOCKS:
        configs.block(model_cfg, name, configs.MODEL_FLAG)
    if wan.is_wan(model_cfg):
        wan.check_wan_launch(args, model_cfg)
    elif args.pipeline_model_parallel_size > 1:
        raise ValueError(PP_REFUSAL.format(pp=args.pipeline_model_parallel_size,
                                          model=components.trained_family(model_cfg).name))
    model_parallel = args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        raise ValueError(f"{args.world_size} processes do not split into tensor x context x pipeline parallel groups "
                         f"of {args.tensor_model_parallel_size} x {args.context_parallel_size} x "
                         f"{args.pipeline_model_parallel_size}")
    settings = grpo_settings(args, model_cfg, args.world_size // model_parallel)
    guidance = guidance_settings(args, model_cfg)
    u, start = settings.updates_per_rollout, resumed_iteration(args)
    check_rollout_boundary(start, u)
    for flag, value in (("--save-interval", args.save_interval), ("--train-iters", args.train_iters)):
        if value and value % u:
            raise ValueError(f"{flag} {value} must be a multiple of --updates-per-rollout {u}: a run that ends or "
                             "saves inside a rollout cannot resume it")
    if settings.kl_beta > 0 and start > 0 and not model_cfg["predictor"].get("from_pretrained"):
        raise ValueError("--kl-beta > 0 needs the starting weights: predictor.from_pretrained in --mm-model")
    check_resume_point(args)  # after the checks above, which read only the iteration's number
    prompts, eval_prompts = components.prompt_streams(data_cfg, "--mm-data", args.seed)
    eval_prompts = eval_prompts[:args.eval_prompts] if eval_prompts else None
    if eval_prompts:
        eval_settings(data_cfg["dataset_param"])
    reward = components.grpo_reward(model_cfg, prompts.prompts + (eval_prompts or []), mm_grpo.get_platform().device)
    return Launch(args, model_cfg, data_cfg, settings, prompts, eval_prompts, reward, guidance)


def check_launch(argv) -> Launch:
    """Everything about the launch that can be checked before `pretrain`; LaunchRefused (one line) otherwise."""
    try:
        return _check_launch(list(argv))
    except (ValueError, FileNotFoundError) as e:
        raise LaunchRefused(str(e)) from None


# --- inside `pretrain` ----------------------------------------------------------------------------
class GRPOInPretrain:
    """The providers and forward step that make MindSpeed-MM's `pretrain` train GRPO. The model
    `model_provider` builds (the one `pretrain` wraps and trains) is the policy the data
    iterator's rollouts run."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.policy, self.schedule, self.data = [], None, None
        self.lock = None  # rank 0's lock of --save
        self.exits = None  # RolloutEndExits, once Megatron's arguments are final
        self.evaluator, self.evaluations = None, {}  # Megatron iteration -> held-out stats
        self.first_eval = self.last_eval = None  # this launch's first and last EvalResult (the paired gain)

    def model_provider(self, pre_process=True, post_process=True):
        from mindspeed_mm.models.predictor.predict_model import PredictModel
        args = get_args()
        if args.pipeline_model_parallel_size > 1:  # wandit's stage tensors, as pretrain_sora.py gives SoRA's
            args.pipeline_tensor_shapes = wan.stage_tensor_shapes(args, self.launch.model_cfg)
        model = self.with_megatron_config(PredictModel(args.mm.model.predictor).get_model())
        self.policy.append(model)
        return model

    @staticmethod
    def with_megatron_config(model):
        """MindSpeed-MM's own DiTs (wandit) get from SoRAModel what Megatron asks of the model it trains;
        here from this entry: the config (with the stage tensors MindSpeed's multi-tensor schedule
        reads from it under PP) and no shared embedding and output weights (PP's gradient finalizing
        asks the first and last stages)."""
        from megatron.training.arguments import core_transformer_config_from_args
        args = get_args()
        if model.config is None:
            model.config = core_transformer_config_from_args(args)
            model.share_embeddings_and_output_weights = False
        if args.pipeline_model_parallel_size > 1:
            model.config.pipeline_tensor_shapes = args.pipeline_tensor_shapes
        return model

    def train_valid_test_datasets_provider(self, num_samples):
        """The GRPO data iterator, started where `--load` left off, after --save is locked and probed."""
        args, launch = get_args(), self.launch
        check_rollout_boundary(args.iteration, launch.settings.updates_per_rollout)  # what Megatron loaded
        if args.save:
            self.lock = run_guard.prepare_save_folder(args.save, run_guard.checkpoint_bytes(self.policy))
        device = mm_grpo.get_platform().device
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        parts = wan.parts if wan.is_wan(launch.model_cfg) else components.trained_family(launch.model_cfg).parts
        self.schedule = components.grpo_schedule(launch.settings, self.policy, launch.model_cfg, launch.reward,
                                                 device, dtype, launch.guidance,
                                                 ref_policy=self.reference_policy(args, device), parts=parts)
        if launch.eval_prompts:
            self.evaluator = held_out_evaluator(launch.eval_prompts, self.schedule, launch.data_cfg["dataset_param"],
                                                device)
        if args.exit_signal_handler:  # Megatron's handler, installed by now, takes SIGINT too
            signal.signal(signal.SIGINT, signal.getsignal(signal.SIGTERM))
        self.exits = RolloutEndExits(args, launch.settings.updates_per_rollout)
        rollout = args.iteration // launch.settings.updates_per_rollout
        launch.prompts.load_state_dict({"consumed": rollout * launch.settings.prompts_per_iteration})
        self.data = GRPOMicroBatches(self.schedule, launch.prompts, start_iteration=rollout,
                                     max_skipped=args.max_skipped_iterations, before_rollout=self.evaluate_if_due)
        return self.data, None, None

    train_valid_test_datasets_provider.is_distributed = True  # every rank takes part in the rollout

    def reference_policy(self, args, device):
        """The KL term's frozen reference, the starting policy (as mm-grpo's trainer takes it): at
        iteration 0 the policy as `pretrain` built and loaded it (predictor.from_pretrained, or a
        --load release checkpoint); resumed, predictor.from_pretrained, loaded as PredictModel loads it.
        Under MindSpeed-MM's LoRA, the policy's frozen base: the policy with its adapters off."""
        if not self.launch.settings.kl_beta > 0:
            return None
        if args.lora_target_modules:
            return lora.reference_policy(self.policy[0])
        from mindspeed_mm.configs.config import ConfigReader
        from mindspeed_mm.models.common.checkpoint import load_checkpoint
        from mindspeed_mm.models.predictor.predict_model import PredictModel
        policy = self.policy[0]
        block = args.mm.model.predictor.to_dict()
        ref = PredictModel(ConfigReader({k: v for k, v in block.items() if k != "from_pretrained"})).get_model()
        ref = self.with_megatron_config(ref)
        if args.iteration == 0:
            ref.load_state_dict(policy.state_dict())
        else:
            load_checkpoint(ref, block["from_pretrained"])
        ref.requires_grad_(False)
        return [ref.to(device=device, dtype=next(policy.parameters()).dtype)]

    # --- held-out evaluation ---------------------------------------------------------------
    def evaluate_if_due(self):
        """Before a rollout: before the first step, and once --eval-interval steps have passed."""
        if self.evaluator is None:
            return
        args = get_args()
        done = args.curr_iteration
        if not self.evaluations or done // args.eval_interval > max(self.evaluations) // args.eval_interval:
            self.evaluate(done)

    def evaluate(self, iteration: int):
        from megatron.training.global_vars import get_tensorboard_writer
        result = self.evaluator(self.policy)
        stats = self.evaluations[iteration] = result.stats
        self.first_eval, self.last_eval = self.first_eval or result, result
        writer = get_tensorboard_writer()  # Megatron's, on its logging rank
        if writer is not None:
            for key, value in stats.items():
                writer.add_scalar(key, value, iteration)
            writer.flush()  # the last evaluation comes after Megatron's loop flushed its writer
        if is_logging_rank():
            print(f"[mm-grpo] held-out evaluation at iteration {iteration}: "
                  + " | ".join(f"{k} {v:.5g}" for k, v in stats.items()), flush=True)

    def finish(self):
        """After `pretrain` trained: the last held-out evaluation, and the before / after line."""
        args = get_args()
        if self.evaluator is None or not self.evaluations:  # nothing trained (resumed at --train-iters)
            return
        if args.train_iters not in self.evaluations:
            self.evaluate(args.train_iters)
        first, last = min(self.evaluations), max(self.evaluations)
        before, after = self.evaluations[first], self.evaluations[last]
        if is_logging_rank():
            print(f"[mm-grpo] held-out evaluation ({len(self.evaluator.prompts)} samples, ODE, fixed noise), "
                  f"iteration {first} -> {last}: " + compare(before, after, self.first_eval, self.last_eval),
                  flush=True)

    def before_step(self):
        """Before each of Megatron's steps: its exit checks armed for this step, the rollout run if due."""
        self.exits.arm()
        self.data.fill()

    def forward_step(self, data_iterator, model):
        return grpo_forward_step(self.schedule, data_iterator, model)


class RolloutEndExits:
    """Megatron's loop checks --exit-signal-handler and --exit-duration-in-mins after every iteration
    (its `args` read each time); an exit inside a rollout would leave a checkpoint that no resume can
    continue (`check_rollout_boundary`), so `arm()`, before each step, switches both checks on only
    for a step that ends a rollout."""

    def __init__(self, args, updates_per_rollout: int):
        self.args, self.updates_per_rollout = args, updates_per_rollout
        self.given = {"exit_signal_handler": args.exit_signal_handler,
                      "exit_duration_in_mins": args.exit_duration_in_mins}

    def arm(self):
        ends_rollout = (self.args.curr_iteration + 1) % self.updates_per_rollout == 0
        for name, value in self.given.items():
            setattr(self.args, name, value if ends_rollout else None)


def main():
    launch = check_launch(sys.argv[1:])
    grpo = GRPOInPretrain(launch)
    from mindspeed_mm.training import pretrain
    try:
        with rollout_before_each_step(grpo.before_step):
            pretrain(grpo.train_valid_test_datasets_provider, grpo.model_provider, ModelType.encoder_or_decoder,
                     grpo.forward_step, extra_args_provider=add_grpo_args,
                     args_defaults={"dataloader_type": "external",
                                    "global_batch_size": launch.settings.batch.rows_per_update})
        grpo.finish()
    finally:
        if grpo.lock is not None:
            grpo.lock.release()


if __name__ == "__main__":
    # Every refusal below is the same on every process (the same command line and files, or agreed
    # by a collective): one line per launch.
    run_entry(main, agreed=(LaunchRefused, RunFolderLocked, run_guard.UnusableSaveFolder, run_guard.TrainingStopped))
