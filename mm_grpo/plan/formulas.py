"""What every family's planner shares (FLUX's formulas: mm_grpo/families/flux/plan.py; Wan2.1's:
mm_grpo/families/wan/plan.py): a GRPO iteration's common fields (`GRPOJob`, GRPOSettings' own), the
layout, the trainable state's bytes (main gradients, Adam's states, the KL reference), a rank's memory
by phase, the iteration's seconds by part, bandwidth by group span, and a layout's row of
`mm-grpo plan`. Units: bytes and seconds.
"""
import dataclasses
from typing import Dict, List

from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.timesteps import trained_steps_per_sample
from mm_grpo.plan.devices import GB
from mm_grpo.settings import setting

ADAM_STATES = 2  # exp_avg, exp_avg_sq


def grpo_field(name: str):
    """GRPOSettings' field `name` (its default, flag, help and bounds): declared once, for the trainers
    and the planner alike."""
    field = next(f for f in dataclasses.fields(GRPOSettings) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


@dataclasses.dataclass(frozen=True)
class GRPOJob:
    """One GRPO iteration's shape, what FLUX's (`Job`) and Wan2.1's (`wan.VideoJob`) have alike: the
    group, the denoising and trained steps, the trainer's options; each adds its sample's size. Its
    fields with a help text are `mm-grpo plan`'s flags (--lora-rank: plan/flags.py, one or several)."""
    text_tokens: int = setting(512, "text tokens (FLUX: T5 max_sequence_length; Wan pads every prompt to "
                                    "umT5's text_len 512)", minimum=1)
    num_generations: int = grpo_field("num_generations")
    prompts_per_iteration: int = 1  # P: without a flag here (plan/flags.py: one prompt per data-parallel rank)
    num_inference_steps: int = grpo_field("num_inference_steps")
    timestep_fraction: float = grpo_field("timestep_fraction")
    micro_batch_size: int = setting(1, "samples per forward/backward (Wan's WanDiT: 1)", minimum=1)
    lora_rank: int = 0  # 0: full fine-tuning
    recompute: bool = setting(True, "activation recompute, one block at a time")
    distributed_optimizer: bool = setting(True, "optimizer state (Adam moments, fp32 master weights) sharded "
                                                "over the data-parallel ranks")
    param_dtype: str = setting("fp32", "fp32: fp32 parameters (mm-grpo's FLUX trainer, bf16 autocast); bf16: "
                                       "Megatron's --bf16 (bf16 parameters, fp32 master weights and main "
                                       "gradients)", choices=("fp32", "bf16"))
    kl_reference: bool = setting(False, "--kl-beta > 0: a frozen reference copy (none with LoRA)")
    text_cache: bool = setting(True, "precomputed text embeddings (else the text encoders on every rank: "
                                     "T5-XXL + CLIP-L, umT5-XXL)")

    @property
    def batch(self) -> int:
        return self.num_generations * self.prompts_per_iteration

    @property
    def trained_steps(self) -> int:
        """K of DanceGRPO's selection (grpo/timesteps.py), the planner's."""
        return trained_steps_per_sample(self.num_inference_steps, timestep_fraction=self.timestep_fraction)

    def on(self, layout: "Layout", group_per_dp_rank: bool = True) -> "GRPOJob":
        """The job a layout runs: one prompt group per data-parallel rank when `group_per_dp_rank`
        (no --prompts-per-iteration), else this one."""
        return dataclasses.replace(self, prompts_per_iteration=layout.dp) if group_per_dp_rank else self


def job_default(name: str, default):
    """GRPOJob's field `name`, its flag, help and checks, with another default: for a subclass
    whose recipe differs (a dataclass field is re-declared to change its default)."""
    field = next(x for x in dataclasses.fields(GRPOJob) if x.name == name)
    return dataclasses.field(default=default, metadata=field.metadata)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.sp * self.dp


def dtype_bytes(name: str) -> int:
    return {"fp32": 4, "bf16": 2}[name]


def trainable_params(base, lora, job):
    return lora if job.lora_rank else base


def main_grad_bytes(base, lora, job):
    """fp32 main gradients of the trainable parameters, unsharded (Megatron's DDP grad buffer,
    grad_reduce_in_fp32=True in training/optim.py)."""
    return 4 * trainable_params(base, lora, job)


def optimizer_bytes(base, lora, job, layout):
    """Adam's moments (8 bytes / trainable parameter) and, for bf16 parameters, fp32 master
    weights (4 bytes); the distributed optimizer shards them over DP x SP (Megatron: 18 bytes per
    parameter, or 6 + 12 / DP with the distributed optimizer)."""
    per_param = 4 * ADAM_STATES + (4 if job.param_dtype == "bf16" and not job.lora_rank else 0)
    shards = layout.dp * layout.sp if job.distributed_optimizer else 1
    return per_param * trainable_params(base, lora, job) / shards


def kl_reference_bytes(base, job):
    """A frozen second copy of the policy chunks (training/train_grpo.py builds one with
    `build_model_chunks` + `load_pretrained`); with LoRA the reference is the base itself."""
    return base * dtype_bytes(job.param_dtype) if job.kl_reference and not job.lora_rank else 0


# Gradients alive at the peak of a micro-batch's backward beyond the saved activations, in values
# per token of hidden size D: measured in fp32 on the whole trainer before the bf16 layout, the
# train-phase peak of the single-rank bench run less the held memory and the saved activations
# (bench/plan_validate.py, docs/scaling.md): 3.9D. Wan's formulas (families/wan/plan.py) use it; FLUX's use
# the per-block measurement (families/flux/plan.py BACKWARD_WORKING_BYTES_PER_TOKEN).
BACKWARD_WORKING_VALUES_PER_TOKEN = 4


def reward_bytes(comps):
    return comps.reward_params * comps.reward_bytes_per_param


@dataclasses.dataclass
class RankMemory:
    """Memory of one rank (one pipeline stage): the terms and the peak of each phase."""
    terms: Dict[str, float]
    phases: Dict[str, float]

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclasses.dataclass
class LayoutMemory:
    stages: List[RankMemory]

    def for_stage(self, stage: int) -> RankMemory:
        return self.stages[stage]

    @property
    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda m: m.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.worst.peak_bytes


def phase_memory(static: Dict[str, float], **working: float) -> RankMemory:
    """A rank's memory from the terms it holds throughout (`static`: weights, gradients, optimizer
    states, frozen parts) and its working sets (`working`, by name as stage_memory gives them): each
    phase's peak is the held terms and the working sets alive in it (FLUX's and Wan's alike)."""
    terms = dict(static, **working)
    held = sum(static.values())
    phases = {
        # Sampling: buffers of the whole rollout plus one micro-batch's no-grad forward.
        "rollout": held + terms["rollout_buffers"] + terms["rollout_forward"],
        # Decode + reward: the rollout's buffers are still alive (x0 is decoded).
        "decode": held + terms["rollout_buffers"] + terms["vae_decode"],
        # Training: the update's rows, the in-flight activations and one block's backward.
        "train": held + terms["rollout_buffers"] + terms["training_rows"] + terms["activations"]
        + terms["recompute_block"] + terms["backward_working"],
    }
    return RankMemory(terms, phases)


@dataclasses.dataclass
class IterationTime:
    parts: Dict[str, float]

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


COMPUTE_PARTS = ("rollout", "train", "decode_reward", "text_encode")  # the rest of IterationTime.parts: comm


def comm_seconds(parts: Dict[str, float]) -> float:
    """The communication of an iteration (`IterationTime.parts`): every part but the compute ones."""
    return sum(v for k, v in parts.items() if k not in COMPUTE_PARTS)


def bandwidth(device, span: int):
    """Bandwidth of a group whose ranks span `span` consecutive ranks (Megatron orders TP, SP
    (context), DP, PP from the innermost): within a node when the span fits one."""
    return device.intra_node_bw if span <= device.devices_per_node else device.inter_node_bw


# --- a layout's row of `mm-grpo plan` (FLUX's and Wan's) -----------------------------------------
def measured_row(row: dict, memory: LayoutMemory, time: IterationTime, device, per_sample: str) -> dict:
    """`row` (a layout's, with its `batch`) given its worst rank's memory and the iteration's seconds:
    the peak and its phase, the terms, the seconds in all, per sample (the key `per_sample`) and by
    part; whether the peak fits `device`, and if not, why: the three largest terms."""
    worst = memory.worst
    row.update(peak_bytes_per_rank=int(worst.peak_bytes), peak_phase=worst.peak_phase,
               terms_bytes={k: int(v) for k, v in worst.terms.items()},
               seconds_per_iteration=time.seconds, **{per_sample: time.seconds / row["batch"]},
               seconds=dict(time.parts))
    row["fits"] = worst.peak_bytes <= device.memory_bytes
    if not row["fits"]:
        big = sorted(((v, k) for k, v in worst.terms.items() if k != "activations_per_microbatch"),
                     reverse=True)[:3]
        row["reason"] = (f"{worst.peak_bytes / GB:.1f} GB > {device.memory_bytes / GB:.0f} GB in "
                         f"{worst.peak_phase}; largest: " + ", ".join(f"{k} {v / GB:.1f}" for v, k in big))
    return row


def ranked(rows: List[dict], per_sample: str) -> List[dict]:
    """The fitting rows by seconds per sample (the key `per_sample`), then the others by memory."""
    return sorted(rows, key=lambda r: (not r["fits"], r[per_sample] if r["fits"] else
                                       (r["peak_bytes_per_rank"] or float("inf"))))

