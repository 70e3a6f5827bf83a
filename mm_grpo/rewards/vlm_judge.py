"""A VLM judge behind an OpenAI-compatible chat endpoint (vLLM, sglang: UnifiedReward, Qwen-VL).

Each image is one chat request, as flow_grpo's `unifiedreward_score_sglang` sends it: the image
resized to 512 x 512 as a PNG data URL, then the question with the prompt filled in,
temperature 0; the reply's "Final Score: <1-5>" divided by 5 is the reward, and a reply without
one scores 0 (flow_grpo's rule; a warning line counts them). The requests of a batch run
MAX_CONCURRENT at a time, and one try of the batch (every request not answered yet) has
`timeout` seconds in total: a request that fails ends the try at once (the others are cut),
and the next try sends the unanswered ones again. `url` is the API base
(http://host:port/v1), `model` the served model's name, `path` (optional) a text file holding
another question with `{prompt}` where the prompt goes. What it trusts: only JSON comes back
(at most remote.MAX_REPLY_BYTES per image), and only the score pattern is read from it.
"""
import base64
import re
import sys

import numpy as np
import torch
from PIL import Image

from mm_grpo.rewards import wire
from mm_grpo.rewards.base import register_reward, uint8_pixels
from mm_grpo.rewards.remote import RemoteRefused, RemoteScored, bearer_header

CHAT_PATH = "/chat/completions"
MODELS_PATH = "/models"
API_KEY_ENV = "OPENAI_API_KEY"  # the key OpenAI-compatible servers take (vLLM --api-key), as OpenAI's clients read it
NO_API_KEY = "EMPTY"  # what those clients send without one
JUDGE_SIZE = (512, 512)
SCORE_PATTERN = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
MAX_SCORE = 5.0
MAX_CONCURRENT = 32
NOT_A_COMPLETION = object()
# flow_grpo's UnifiedReward question (rewards.py `unifiedreward_score_sglang`)
UNIFIED_REWARD_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")


def parse_score(text: str):
    """The reply's final score over 5, or None when it names none."""
    match = SCORE_PATTERN.search(text or "")
    return float(match.group(1)) / MAX_SCORE if match else None


@register_reward("vlm_judge")
class VLMJudge(RemoteScored):
    connections = MAX_CONCURRENT

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        if not cfg.model:
            raise ValueError(f"reward {self.name!r} needs `model`: the served model's name (vLLM --served-model-name)")
        self.question = UNIFIED_REWARD_QUESTION
        if cfg.path:
            self.question = cfg.require_path("path", "file").read_text(encoding="utf-8")
            if "{prompt}" not in self.question:
                raise ValueError(f"reward {self.name!r}: the question in {cfg.path} has no {{prompt}}")
        self.headers = bearer_header(self.name, API_KEY_ENV, NO_API_KEY)
        self.endpoint.check_reachable(MODELS_PATH)

    def message(self, pixels, prompt) -> dict:
        image = wire.encode_image(np.asarray(Image.fromarray(pixels).resize(JUDGE_SIZE)))
        data_url = "data:image;base64," + base64.b64encode(image).decode("ascii")
        return {"model": self.cfg.model, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": self.question.replace("{prompt}", prompt)}]}]}

    def read(self, reply):
        """The score in a chat completion, None when it names none; RemoteRefused when it is not one."""
        try:
            content = reply.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            content = NOT_A_COMPLETION
        if not (content is None or isinstance(content, str)):  # null: the model said nothing (scores 0)
            raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url}{CHAT_PATH} replied with no chat "
                                f"completion: {reply.text[:120]!r}")
        return parse_score(content)

    def request(self, images, prompts):
        calls = [{"json": self.message(p, prompt), "headers": self.headers}
                 for p, prompt in zip(uint8_pixels(images), prompts)]
        scores = [self.read(reply) for reply in self.endpoint.request_each("POST", CHAT_PATH, calls)]
        unparsed = sum(s is None for s in scores)
        if unparsed:
            print(f"mm-grpo: warning: reward {self.name!r}: {unparsed} of {len(scores)} replies name no "
                  "'Final Score: 1-5'; they score 0", file=sys.stderr, flush=True)
        return torch.tensor([0.0 if s is None else s for s in scores], dtype=torch.float32)

