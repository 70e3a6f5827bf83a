"""Rewards scored by a server: mm-grpo's own reward server (`remote`).

Every remote reward is reached before the first rollout (a one-line error naming the URL when
it is not), sends each request with `timeout` and up to `retries` further tries (connection
refused or reset, timed out, 502 / 503 / 504), and when every try fails scores the batch NaN
with one warning line: the iteration is skipped (no optimizer step), and
--max-skipped-iterations such iterations in a row stop the run. A refusal the server will
repeat (4xx) stops the run at once.
"""
import math
import sys
import time

import requests
import torch

from mm_grpo.rewards import wire
from mm_grpo.rewards.base import Reward, one_line, register_reward

RETRY_STATUS = (502, 503, 504)
BACKOFF_S = 0.5  # first wait between tries, doubled after each
MAX_BACKOFF_S = 8.0


class RemoteUnavailable(RuntimeError):
    """Every try failed (unreachable, timed out, busy)."""


class RemoteRefused(ValueError):
    """The server refused the request (4xx): trying again would not help."""


class Endpoint:
    """One server URL with a timeout, a number of further tries and a session of its own."""

    def __init__(self, reward_name: str, url: str, timeout: float, retries: int):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward {reward_name!r} needs `url` (http://host:port), got {url!r}")
        if not (timeout > 0 and retries >= 0):
            raise ValueError(f"reward {reward_name!r}: need timeout > 0 and retries >= 0, got {timeout} and {retries}")
        self.name, self.url, self.timeout, self.retries = reward_name, url.rstrip("/"), float(timeout), int(retries)
        self.session = requests.Session()

    def request(self, method: str, path: str = "", **kwargs) -> requests.Response:
        """The response of the first try that succeeds; RemoteUnavailable / RemoteRefused naming the URL."""
        url, last = self.url + path, None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                response = self.session.request(method, url, timeout=self.timeout, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {one_line(e)}"
                continue
            if response.status_code in RETRY_STATUS:
                last = f"HTTP {response.status_code} {_error_text(response)}"
                continue
            if 400 <= response.status_code < 500:
                raise RemoteRefused(f"reward {self.name!r}: {url} refused the request: HTTP {response.status_code} "
                                    f"{_error_text(response)}")
            if response.status_code >= 300:
                last = f"HTTP {response.status_code} {_error_text(response)}"
                continue
            return response
        raise RemoteUnavailable(f"reward {self.name!r}: {url} failed {self.retries + 1} time(s), "
                                f"timeout {self.timeout:g} s; last: {last}")

    def check_reachable(self, path: str = ""):
        """Before any rollout: a one-line ConnectionError naming the URL when the server does not
        answer; the response to a GET of `path`, or None when the server refused it (it answered)."""
        try:
            return self.request("GET", path)
        except RemoteRefused:
            return None
        except RemoteUnavailable as e:
            raise ConnectionError(f"{e} (start the server first, or fix `url` in model.json's reward block)") from None


def _error_text(response) -> str:
    try:
        return str(response.json().get("error", ""))[:200]
    except ValueError:
        return response.text.strip().splitlines()[0][:200] if response.text.strip() else ""


class RemoteScored(Reward):
    """A reward whose `request(images, prompts)` asks the server at `cfg.url` (its `endpoint`): an
    unavailable server scores NaN. The images are encoded on the host."""

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, "cpu")
        self.endpoint = Endpoint(self.name, cfg.url, cfg.timeout, cfg.retries)

    def score(self, images, prompts):
        try:
            return self.request(images, prompts)
        except RemoteUnavailable as e:
            print(f"mm-grpo: warning: {e}: {len(prompts)} images scored NaN (the iteration is skipped)",
                  file=sys.stderr, flush=True)
            return torch.full((len(prompts),), math.nan)

    def request(self, images, prompts) -> torch.Tensor:
        raise NotImplementedError


@register_reward("remote")
class RemoteReward(RemoteScored):
    """mm-grpo's reward server (`python -m mm_grpo.tools.reward_server`): its weighted total."""

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        health = self.endpoint.check_reachable(wire.HEALTH_PATH)
        try:
            self.served = health.json()["rewards"]
        except (AttributeError, ValueError, KeyError, TypeError):
            raise ValueError(f"reward {self.name!r}: {self.endpoint.url}{wire.HEALTH_PATH} is not an mm-grpo reward "
                             "server's health (python -m mm_grpo.tools.reward_server)") from None

    def request(self, images, prompts):
        response = self.endpoint.request("POST", wire.SCORE_PATH, json=wire.encode_request(images, prompts))
        try:
            return wire.decode_scores(response.json(), len(prompts))
        except ValueError as e:
            raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url}: {e}") from None
