"""GRPO's batch, in one vocabulary for every entry (mm-grpo's trainer, MindSpeed-MM's `pretrain`,
the planner):

    P  prompts per iteration (--prompts-per-iteration), all data-parallel ranks together
    G  generations per prompt (--num-generations): a group
    K  trained steps per generation (grpo/timesteps.py `trained_steps_per_sample`: from the
       sampler, the timestep selection and its fraction or window)
    U  optimizer updates per rollout (--updates-per-rollout)

One iteration rolls out P x G samples and trains P x G x K (sample, step) rows in U optimizer
steps: each step's P x G x K / U rows are what Megatron's --global-batch-size counts.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class GRPOBatch:
    prompts: int  # P
    generations: int  # G
    trained_steps: int  # K
    updates: int = 1  # U

    @property
    def samples(self) -> int:
        """P x G: rollouts per iteration."""
        return self.prompts * self.generations

    @property
    def rows_per_update(self) -> int:
        """P x G x K / U: (sample, trained step) rows per optimizer step, Megatron's --global-batch-size."""
        return self.samples * self.trained_steps // self.updates

    def check_global_batch_size(self, value: int) -> None:
        """One line when a given --global-batch-size is not this batch's rows per optimizer step."""
        if value != self.rows_per_update:
            raise ValueError(
                f"--global-batch-size {value} counts (sample, trained step) rows per optimizer step, which "
                f"--prompts-per-iteration {self.prompts} x --num-generations {self.generations} x {self.trained_steps} "
                f"trained steps / --updates-per-rollout {self.updates} make {self.rows_per_update}: drop it (it is "
                "derived) or give that value")
