"""GRPO of FLUX inside MindSpeed-MM's own `pretrain` (its fork of Megatron-LM's loop).

    torchrun $DISTRIBUTED_ARGS -m mm_grpo.training.mindspeed_grpo $GPT_ARGS $MM_ARGS $GRPO_ARGS $OUTPUT_ARGS

MindSpeed-MM's `pretrain` parses Megatron's arguments (plus the GRPO group below), initializes
Megatron, builds the model through `model_provider` (the `flux` predictor of `--mm-model`,
made by MindSpeed-MM's `PredictModel`, its `from_pretrained` file loaded by MindSpeed-MM's
`load_checkpoint`), wraps it in DDP, builds the optimizer and LR schedule, loads `--load`, then
asks `train_valid_test_datasets_provider` for the data iterator and runs its training loop:
per step, Megatron's forward-backward over `get_num_microbatches()` micro-batches with
`forward_step`, the optimizer step, logging and `--save` checkpoints.

GRPO fits that loop through the data iterator (mm_grpo/training/mindspeed_adapter.py): its
micro-batches are (generation, trained step) rows; when they run out it runs the next rollout,
reward and advantages with the model `pretrain` built. Megatron's `--global-batch-size` counts
those rows per optimizer step: (generations per update) x (trained steps per sample K), so
the GRPO batch of a rollout is `--global-batch-size / K x --updates-per-rollout` generations.
`--mm-model` holds the `predictor` (MindSpeed-MM's way), `ae`, `text_encoder`, `reward` blocks
and `image_size`; `--mm-data` the prompt files (as mm-grpo's own trainer reads them). Relative
paths in them are taken from the working directory, as MindSpeed-MM takes them.

Limits: the rollout runs inside the first `forward_step` of a step, where the later pipeline
stages wait for activations, so pipeline parallelism is refused (mm-grpo's own
`train_grpo` rolls out between steps and runs it); `--load` resumes at rollout boundaries
(a multiple of --updates-per-rollout).
"""
import dataclasses
import os

import mm_grpo  # noqa: I001  (first: on Ascend, torch_npu and MindSpeed's Megatron adaptor before Megatron)
import torch
from megatron.core import mpu
from megatron.core.enums import ModelType
from megatron.training import get_args

import mm_grpo.models.registry  # noqa: F401  (`"model_id": "flux"` in MindSpeed-MM's predictor mapping)
from mm_grpo.grpo.schedule import GRPOSchedule, GRPOSettings
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.settings import add_setting_args, from_args
from mm_grpo.training import components
from mm_grpo.training.mindspeed_adapter import GRPOMicroBatches, grpo_forward_step


def add_grpo_args(parser):
    """MindSpeed-MM's --mm-data / --mm-model / --mm-tool and the GRPO group (GRPOSettings' flags;
    the batch sizes and the seed are Megatron's own)."""
    from mindspeed_mm.configs.config import mm_extra_args_provider
    add_setting_args(mm_extra_args_provider(parser).add_argument_group("grpo"), GRPOSettings)
    return parser


class GRPOInPretrain:
    """The providers and forward step that make MindSpeed-MM's `pretrain` train GRPO. The model
    `model_provider` builds (the one `pretrain` wraps and trains) is the policy the data
    iterator's rollouts run."""

    def __init__(self):
        self.policy, self.schedule = [], None

    def model_provider(self, pre_process=True, post_process=True):
        from mindspeed_mm.models.predictor.predict_model import PredictModel
        args = get_args()
        if mpu.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("GRPO inside MindSpeed-MM's pretrain rolls out within the first forward_step of a step, "
                             "which pipeline stages cannot share: use --pipeline-model-parallel-size 1, or mm-grpo's "
                             "own trainer (mm_grpo.training.train_grpo) for pipeline parallelism")
        model = PredictModel(args.mm.model.predictor).get_model()
        self.policy.append(model)
        return model

    def train_valid_test_datasets_provider(self, num_samples):
        """The GRPO data iterator, started where `--load` left off."""
        args = get_args()
        # Relative paths from the working directory, as MindSpeed-MM reads them (the predictor's too).
        model_cfg = components.resolve_paths(args.mm.model.to_dict(), os.getcwd())
        data_cfg = components.resolve_paths(args.mm.data.to_dict(), os.getcwd())
        settings = self.settings(args, model_cfg)
        device = mm_grpo.get_platform().device
        prompts, _ = components.prompt_streams(data_cfg, "--mm-data", args.seed)
        reward = CombinedReward.from_configs(components.block(model_cfg, "reward", "--mm-model"), device=device)
        text = components.block(model_cfg, "text_encoder", "--mm-model")
        components.check_prompts(text, reward, prompts.prompts)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.schedule = GRPOSchedule(
            settings, self.policy, conditioner=components.conditioner(text, device, dtype),
            decoder=components.decoder(components.block(model_cfg, "ae", "--mm-model"), device, dtype),
            reward=reward, device=device)
        if args.iteration % settings.updates_per_rollout:
            raise ValueError(f"--load: iteration {args.iteration} is inside a rollout (--updates-per-rollout "
                             f"{settings.updates_per_rollout}); resume from a checkpoint at a rollout boundary")
        rollout = args.iteration // settings.updates_per_rollout
        prompts.load_state_dict({"consumed": rollout * settings.prompts_per_iteration})
        return GRPOMicroBatches(self.schedule, prompts, start_iteration=rollout), None, None

    train_valid_test_datasets_provider.is_distributed = True  # every rank takes part in the rollout

    @staticmethod
    def settings(args, model_cfg) -> GRPOSettings:
        """GRPOSettings from the GRPO flags, Megatron's batch sizes and seed, and model.json's image size."""
        height, width = model_cfg.get("image_size", [64, 64])
        base = from_args(GRPOSettings, args, global_batch_size=args.num_generations, height=height, width=width)
        k = base.trained_steps_per_sample
        per_update, rest = divmod(args.global_batch_size, k)
        if rest:
            raise ValueError(f"--global-batch-size {args.global_batch_size} counts (generation, trained step) rows "
                             f"per optimizer step: it must be a multiple of the {k} trained steps per sample")
        settings = dataclasses.replace(base, global_batch_size=per_update * base.updates_per_rollout)
        settings.check(mpu.get_data_parallel_world_size())
        return settings

    def forward_step(self, data_iterator, model):
        return grpo_forward_step(self.schedule, data_iterator, model)


def main():
    from mindspeed_mm.training import pretrain
    grpo = GRPOInPretrain()
    pretrain(grpo.train_valid_test_datasets_provider, grpo.model_provider, ModelType.encoder_or_decoder,
             grpo.forward_step, extra_args_provider=add_grpo_args,
             args_defaults={"dataloader_type": "external"})


if __name__ == "__main__":
    main()
