"""Reward registry, config errors, CombinedReward and the JPEG rewards (no model weights needed)."""
import io

import pytest
import torch
from PIL import Image

from mm_grpo.rewards import REWARDS, CombinedReward, Reward, RewardConfig, build_reward
from tests.utils import assert_one_line_error


def _flat_and_noisy(size=64):
    g = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, size, size), 0.5)
    noisy = torch.rand(1, 3, size, size, generator=g)
    return torch.cat([flat, noisy])


def _pil_jpeg_kb(image):
    # DDPO's jpeg reward, written out independently.
    array = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def test_registry_names():
    names = {"hps", "clip_score", "pickscore", "aesthetic", "jpeg_compressibility", "jpeg_incompressibility"}
    assert names <= set(REWARDS)


@pytest.mark.parametrize(
    "cfg,error,match",
    [
        ({"name": "imagereward"}, ValueError, "unknown reward 'imagereward'; known: aesthetic, clip_score"),
        ({"name": "hps", "pth": "x"}, ValueError,
         r'^reward config "hps": unknown key "pth" \(did you mean "path"\?\)$'),
        ({"path": "x"}, ValueError, "needs a 'name'"),
        ({"name": "hps"}, ValueError, "reward 'hps' needs `path`"),
        ({"name": "hps", "path": "/nonexistent/hps.pt"}, FileNotFoundError, "hps.pt is not an existing file"),
        ({"name": "clip_score", "path": "/nonexistent"}, ValueError, "needs `arch`"),
        ({"name": "pickscore", "path": "/nonexistent"}, FileNotFoundError, "is not an existing folder"),
        ({"name": "aesthetic", "path": "/nonexistent.pth"}, FileNotFoundError, "path /nonexistent.pth"),
        ({"name": "jpeg_compressibility", "dtype": "fp8"}, ValueError, "dtype must be one of"),
        ({"name": "mine", "module": "no_such_reward_module"}, ValueError,
         r'^reward config "mine": module \'no_such_reward_module\' cannot be imported \(ModuleNotFoundError: '),
        ({"name": "mine", "module": "json"}, ValueError,
         r"^unknown reward 'mine' \(module 'json' registers none by that name\); known: aesthetic"),
        ({"name": "mine", "module": 3}, ValueError, r'^reward config "mine": module must be a Python module name'),
    ],
)
def test_config_errors_are_one_line(cfg, error, match, monkeypatch):
    import open_clip

    # Errors must come before any model is built.
    monkeypatch.setattr(open_clip, "create_model", lambda *a, **k: pytest.fail("model built before the check"))
    assert_one_line_error(lambda: build_reward(cfg), match, error)


USER_REWARD = """
import torch
from mm_grpo.rewards import Reward, register_reward

@register_reward("user_brightness")
class Brightness(Reward):
    def score(self, images, prompts):
        return images.mean((1, 2, 3))
"""


def test_a_reward_of_your_own_registers_from_its_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('a bug in the module\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(REWARDS, "user_brightness", raising=False)
    images = _flat_and_noisy()
    combined = CombinedReward.from_configs([{"name": "user_brightness", "module": "my_rewards", "weight": 2.0},
                                            {"name": "jpeg_compressibility", "weight": 0.0}])
    values = combined.rewards["user_brightness"](images, ["a", "b"])
    torch.testing.assert_close(values, images.mean((1, 2, 3)), rtol=0, atol=0)
    assert_one_line_error(lambda: build_reward({"name": "x", "module": "broken_rewards"}),
                          r"^reward config \"x\": module 'broken_rewards' cannot be imported \(RuntimeError: "
                          r"a bug in the module\); it must be importable in every process", ValueError)
    monkeypatch.delitem(REWARDS, "user_brightness")


def test_jpeg_rewards_sign_and_values():
    images = _flat_and_noisy()
    incompressibility = build_reward({"name": "jpeg_incompressibility"})(images, ["a", "b"])
    compressibility = build_reward(RewardConfig("jpeg_compressibility"))(images, ["a", "b"])
    assert incompressibility.dtype == torch.float32 and incompressibility.shape == (2,)
    expected = torch.tensor([_pil_jpeg_kb(im) for im in images])
    torch.testing.assert_close(incompressibility, expected, rtol=0, atol=0)
    torch.testing.assert_close(compressibility, -expected, rtol=0, atol=0)
    # A noisy image is far less compressible than a flat one.
    assert incompressibility[1] > 5 * incompressibility[0] and compressibility[1] < compressibility[0] < 0


def test_jpeg_size_grows_with_noise():
    g = torch.Generator().manual_seed(1)
    base, noise = torch.full((1, 3, 64, 64), 0.5), torch.rand(1, 3, 64, 64, generator=g) - 0.5
    images = torch.cat([(base + a * noise).clamp(0, 1) for a in (0.0, 0.05, 0.2, 0.5, 1.0)])
    sizes = build_reward({"name": "jpeg_incompressibility"})(images, [""] * 5)
    assert torch.all(sizes[1:] > sizes[:-1]), sizes


def test_reward_input_checks_and_nonfinite():
    reward = build_reward({"name": "jpeg_incompressibility"})
    with pytest.raises(ValueError, match=r"float tensor \[B, 3, H, W\]"):
        reward(torch.rand(2, 4, 8, 8), ["a", "b"])
    with pytest.raises(ValueError, match="one prompt per image: 2 images"):
        reward(torch.rand(2, 3, 8, 8), ["a"])
    images = torch.rand(3, 3, 16, 16)
    images[1, 0, 3, 3] = float("nan")
    images[2, 2, 0, 0] = float("inf")
    values = reward(images, ["a", "b", "c"])
    assert torch.isfinite(values[0]) and values[1:].isnan().all()


class _Constant(Reward):
    """A stand-in reward with known values (not registered)."""

    def __init__(self, name, values):
        super().__init__(RewardConfig(name))
        self.name, self.values = name, torch.tensor(values)

    def score(self, images, prompts):
        return self.values


def test_combined_reward_weights_and_logging():
    images = _flat_and_noisy()
    jpeg = build_reward({"name": "jpeg_incompressibility"})
    rewards = [jpeg, _Constant("const", [1.0, -2.0]), _Constant("logged", [float("nan"), 3.0])]
    combined = CombinedReward(rewards, [0.5, 2.0, 0.0])
    total, values = combined(images, ["a", "b"])
    assert list(values) == ["jpeg_incompressibility", "const", "logged"]
    size = jpeg(images, ["a", "b"])
    torch.testing.assert_close(values["jpeg_incompressibility"], size)
    torch.testing.assert_close(total, 0.5 * size + 2.0 * torch.tensor([1.0, -2.0]))  # weight 0: logged only
    assert values["logged"][0].isnan() and torch.isfinite(total).all()


def test_combined_reward_from_configs_and_errors():
    combined = CombinedReward.from_configs(
        [{"name": "jpeg_incompressibility", "weight": 1.0}, {"name": "jpeg_compressibility", "weight": 3.0}]
    )
    images = _flat_and_noisy()
    total, values = combined(images, ["a", "b"])
    torch.testing.assert_close(total, -2.0 * values["jpeg_incompressibility"])
    with pytest.raises(ValueError, match="listed twice"):
        CombinedReward.from_configs([{"name": "jpeg_compressibility"}, {"name": "jpeg_compressibility"}])
    with pytest.raises(ValueError, match="at least one reward"):
        CombinedReward.from_configs([])
    with pytest.raises(ValueError, match="finite weight"):
        CombinedReward.from_configs([{"name": "jpeg_compressibility", "weight": float("inf")}])
