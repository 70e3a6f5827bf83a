"""Clients of flow_grpo's reward servers (its `reward-server` repository): GenEval and DeQA.

The protocol, as flow_grpo's `geneval_score` / `deqa_score_remote` speak it: one POST to the
server's root per batch of at most 64 images; the body is a pickle of
    {"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata, ...], "only_strict": True}   (GenEval)
    {"images": [JPEG bytes, ...]}                                                               (DeQA)
(JPEG at PIL's default quality, 75), and the reply a pickle of a dict whose "scores" (GenEval)
or "outputs" (DeQA) list is the reward. What each side trusts: the server unpickles the
trainer's request (it must trust the trainer), and this client unpickles the reply with an
allow-list (built-in containers, numbers and strings, numpy scalars and arrays): any other
class in a reply is refused in one line, so a hostile server cannot run code in the trainer.
"""
import io
import json
import pickle
from pathlib import Path

import torch

from mm_grpo.rewards import wire
from mm_grpo.rewards.base import register_reward, uint8_pixels
from mm_grpo.rewards.remote import RemoteRefused, RemoteScored

BATCH = 64  # images per request, as flow_grpo sends them
JPEG_QUALITY = 75  # PIL's default, what flow_grpo sends
# (module, name) pairs a reply may hold: numpy's scalars and arrays, pickled by reduction
ALLOWED_GLOBALS = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
                   for name in ("scalar", "_reconstruct")} | {("numpy", "dtype"), ("numpy", "ndarray")}


class _ReplyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"the reply holds {module}.{name}, which the client does not load")
        return super().find_class(module, name)


def load_reply(data: bytes):
    """A flow_grpo server's pickled reply, loading only ALLOWED_GLOBALS' classes."""
    return _ReplyUnpickler(io.BytesIO(data)).load()


class FlowGRPOServer(RemoteScored):
    """A flow_grpo reward server: `reply_key` of its reply is the reward."""

    reply_key = None

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.endpoint.check_reachable()  # its servers answer a GET with 405: reachable is enough

    def payload(self, jpegs, prompts) -> dict:
        return {"images": jpegs}

    def request(self, images, prompts):
        pixels, scores = uint8_pixels(images), []
        for start in range(0, len(prompts), BATCH):
            rows = slice(start, start + BATCH)
            jpegs = [wire.encode_image(p, "jpeg", JPEG_QUALITY) for p in pixels[rows]]
            body = pickle.dumps(self.payload(jpegs, prompts[rows]))
            response = self.endpoint.request("POST", data=body)
            try:
                values = load_reply(response.content)[self.reply_key]
                scores.append(torch.as_tensor([float(v) for v in values], dtype=torch.float32))
            except (pickle.UnpicklingError, KeyError, TypeError, ValueError, EOFError) as e:
                raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url} replied with no {self.reply_key!r} "
                                    f"list ({type(e).__name__}: {e})") from None
            if len(scores[-1]) != len(jpegs):
                raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url} scored {len(scores[-1])} of "
                                    f"{len(jpegs)} images")
        return torch.cat(scores)


@register_reward("geneval_server")
class GenEvalServer(FlowGRPOServer):
    """GenEval behind flow_grpo's reward server: `path` is GenEval's metadata file (JSON lines with
    "prompt" and the checks the detector runs); every prompt must have a line."""

    reply_key = "scores"

    def __init__(self, cfg, device="cpu"):
        path = cfg.require_path("path", "file")
        self.metadata = {}
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    entry = json.loads(line)
                    if "prompt" not in entry:
                        raise ValueError(f"reward {self.name!r}: {path}:{number} has no \"prompt\"")
                    self.metadata[entry["prompt"]] = entry
        super().__init__(cfg, device)

    def check_prompts(self, prompts):
        missing = [p for p in dict.fromkeys(prompts) if p not in self.metadata]
        if missing:
            raise ValueError(f"reward {self.name!r}: {len(missing)} prompt(s) have no GenEval metadata in "
                             f"{Path(self.cfg.path).name}, e.g. {missing[0]!r}")

    def payload(self, jpegs, prompts):
        self.check_prompts(prompts)
        return {"images": jpegs, "meta_datas": [self.metadata[p] for p in prompts], "only_strict": True}


@register_reward("deqa_server")
class DeQAServer(FlowGRPOServer):
    """DeQA-Score (image quality, prompt-free) behind flow_grpo's reward server."""

    reply_key = "outputs"
