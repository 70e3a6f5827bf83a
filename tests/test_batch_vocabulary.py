"""One batch vocabulary (mm_grpo/grpo/batch.py): K from one function that agrees with the trained
steps the schedule draws, the planner's batch fields declared by GRPOSettings, and launch scripts
that give prompts per iteration and leave K and Megatron's global batch to the entries."""
import dataclasses
import pathlib
import re

import pytest

from mm_grpo.families.flux.plan import Job
from mm_grpo.grpo.batch import GRPOBatch
from mm_grpo.grpo.draws import draw_trained_steps
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.timesteps import trained_steps_per_sample
from mm_grpo.plan.formulas import GRPOJob

ROOT = pathlib.Path(__file__).resolve().parent.parent
GRPO_SCRIPTS = ("examples/flux/grpo_flux.sh", "examples/flux/mindspeed_mm/grpo_flux.sh", "examples/wan/grpo_wan.sh")


@pytest.mark.parametrize("selection, sampler, steps, fraction, window", [
    ("random", "dance_sde", 16, 0.6, 3), ("random", "flow_sde", 10, 0.25, 3), ("ordered", "flow_sde", 10, 0.99, 3),
    ("ordered", "dance_sde", 16, 0.5, 3), ("ordered", "cps", 6, 1.0, 3), ("window", "dance_sde", 16, 0.6, 4),
    ("branch", "flow_sde", 8, 0.6, 2)])
def test_k_is_what_the_schedule_draws(selection, sampler, steps, fraction, window):
    settings = GRPOSettings(prompts_per_iteration=2, num_generations=2, num_inference_steps=steps, sampler=sampler,
                            timestep_selection=selection, timestep_fraction=fraction, window_size=window,
                            init_same_noise=selection == "branch")
    bounds = (0, window) if selection in ("window", "branch") else None
    drawn = draw_trained_steps(settings, 0, range(4), bounds)
    assert settings.trained_steps_per_sample == drawn.shape[1] == trained_steps_per_sample(
        steps, selection, fraction, window, sampler)


def test_the_batch_counts():
    batch = GRPOBatch(prompts=8, generations=12, trained_steps=9, updates=2)
    assert (batch.samples, batch.rows_per_update) == (96, 432)
    batch.check_global_batch_size(432)
    with pytest.raises(ValueError, match=r"^--global-batch-size 864 counts .* make 432: drop it"):
        batch.check_global_batch_size(864)


def test_the_planner_shares_the_trainers_declarations():
    """num_generations and friends are declared once: the planner's fields are GRPOSettings' own."""
    grpo = {f.name: f for f in dataclasses.fields(GRPOSettings)}
    for field in dataclasses.fields(GRPOJob):
        if field.name in ("num_generations", "num_inference_steps", "timestep_fraction"):
            assert (field.default, field.metadata) == (grpo[field.name].default, grpo[field.name].metadata)
    job = Job(num_inference_steps=16, timestep_fraction=0.6)
    assert job.trained_steps == GRPOSettings(num_inference_steps=16).trained_steps_per_sample == 9


@pytest.mark.parametrize("script", GRPO_SCRIPTS)
def test_no_launch_script_hard_codes_k_or_megatrons_global_batch(script):
    text = "\n".join(line.split("#")[0] for line in (ROOT / script).read_text().splitlines())  # code, not comments
    assert not re.search(r"^\s*K=|\bK=\$\{K|\$K\b|\$\{K\}", text, re.M), f"{script} computes K"
    assert "--global-batch-size" not in text, f"{script} passes --global-batch-size (the entries derive it)"
    assert "--prompts-per-iteration" in text
