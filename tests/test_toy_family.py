"""A third model family written from the interface alone: a `Denoiser` over 4-number latents, its
conditioner, decoder and guidance, and nothing else. Two GRPO iterations run through the one
builder (training/components.grpo_schedule) and the core's schedule: rollout with log-probs,
rewards, advantages, the PPO loss on the trained steps, an optimizer step. The core never asks
what the model is."""
import dataclasses
import zlib

import torch

from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.training import components
from tests.fixtures import parallel_1proc  # noqa: F401

WIDTH = 4  # a latent is 4 numbers


class ToyVelocity(torch.nn.Module):
    """v(x, sigma, text): a two-layer MLP."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2 * WIDTH + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, WIDTH))

    def forward(self, x, sigma, text):
        return self.net(torch.cat([x, text, sigma.reshape(-1, 1).to(x)], dim=1))


@dataclasses.dataclass(frozen=True)
class ToyGuidance:
    strength: float = 1.0


@dataclasses.dataclass(frozen=True)
class ToyDenoiser(Denoiser):
    latent_shape = (WIDTH,)
    per_sample_keys = ("text",)
    shared_keys = ()

    def conditioning(self, text, rows, device):
        return {"text": (text if rows is None else text[rows]).to(device)}

    def velocity_fn(self, chunks, cond, micro_batch_size):
        return lambda x, sigma: chunks[0](x, sigma.expand(len(x)), cond["text"])

    def forward(self, model, batch):
        return model(batch["hidden_states"], batch["timestep"], batch["text"])


def toy_text(prompts):
    """A prompt's 4 numbers, from its checksum."""
    return torch.stack([torch.randn(WIDTH, generator=torch.Generator().manual_seed(zlib.crc32(p.encode())))
                        for p in prompts])


def toy_parts(model_cfg, settings, policy, device, dtype, guidance):
    decoder = lambda latents, height, width: torch.sigmoid(guidance.strength * latents).reshape(-1, 1, 2, 2)  # noqa: E731
    return toy_text, decoder, ToyDenoiser()


def brightness(images, prompts):
    score = -(images.mean(dim=(1, 2, 3)) - 0.8).abs()
    return score, {"brightness": score}


def test_a_toy_family_trains_two_grpo_iterations_through_the_one_builder(parallel_1proc):
    torch.manual_seed(0)
    model = ToyVelocity()
    before = [p.detach().clone() for p in model.parameters()]
    settings = GRPOSettings(prompts_per_iteration=2, num_generations=4, num_inference_steps=6, micro_batch_size=4,
                            noise_level=0.7, clip_range=0.2)
    settings.check(dp_size=1)
    schedule = components.grpo_schedule(settings, [model], {}, brightness, torch.device("cpu"), torch.float32,
                                        ToyGuidance(), parts=toy_parts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for iteration in range(2):
        updates, stats = schedule.prepare(iteration, ["a bright square", "a dim square"])
        assert updates is not None and torch.isfinite(torch.tensor(stats["reward/mean"]))
        (micro_batches,) = updates
        assert len(micro_batches) == settings.batch.rows_per_update // settings.micro_batch_size
        optimizer.zero_grad()
        for mb in micro_batches:
            loss, loss_stats = schedule.loss_fn(schedule.denoiser.forward(model, mb), mb)
            (loss / len(micro_batches)).backward()
        if iteration == 0:  # on policy before the first step: the rollout's own log-probs
            assert float(loss_stats["ratio_min"]) == float(loss_stats["ratio_max"]) == 1.0
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
