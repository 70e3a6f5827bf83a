"""A reward server: any registered reward, or a weighted combination, scored over HTTP.

    python -m mm_grpo.tools.reward_server --rewards rewards.json [--host 0.0.0.0] [--port 8000] [--device cuda]

`--rewards` is a JSON list of reward configs, or a model.json whose `reward` block is used (the
same entries as in model.json; $VARS and relative paths resolved as the trainers resolve them). The protocol is mm_grpo/rewards/wire.py's; docs/rewards.md says
how to run it beside an NPU cluster. Requests are queued (a bounded queue: 503 when full) and
one thread scores them in batches of up to --max-batch images, joining requests whose images
have one size; bodies over --max-request-mb get 413, malformed ones 400, each with a one-line
{"error": ...}.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import List, Optional

import torch

from mm_grpo.files.jsonfile import load_json
from mm_grpo.rewards.base import one_line
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.rewards.wire import HEALTH_PATH, SCORE_PATH, BadRequest, decode_request, encode_response
from mm_grpo.settings import add_setting_args, from_args, setting
from mm_grpo.training.components import resolve_paths

PROG = "python -m mm_grpo.tools.reward_server"
MB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    rewards: str = setting(None, "JSON list of reward configs, or a model.json (its `reward` block)", required=True)
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = setting(8000, "port to listen on", minimum=1)
    device: str = setting("cpu", "device of the reward models (cuda, npu, cpu)")
    max_batch: int = setting(64, "images scored together, at most (requests of one image size are joined)",
                             minimum=1)
    max_queue: int = setting(256, "requests waiting, at most: more get 503", minimum=1)
    max_request_mb: float = setting(64.0, "largest request body in MiB: larger ones get 413")
    batch_wait_ms: float = setting(5.0, "how long the scorer waits for more requests to join a batch")


@dataclasses.dataclass
class _Job:
    images: torch.Tensor
    prompts: List[str]
    result: Future


class BatchScorer:
    """One thread scoring queued requests in batches; `submit` -> Future of (total, {name: values})."""

    def __init__(self, reward: CombinedReward, max_batch: int, max_queue: int, batch_wait_s: float):
        self.reward, self.max_batch, self.batch_wait_s = reward, max_batch, batch_wait_s
        self.queue = queue.Queue(maxsize=max_queue)
        self.scored_images = 0
        self._carry: Optional[_Job] = None  # a job that did not fit the last batch: first in the next
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)
        self._thread.start()

    def submit(self, images: torch.Tensor, prompts: List[str]) -> Future:
        """Raises queue.Full when --max-queue requests wait."""
        job = _Job(images, prompts, Future())
        self.queue.put_nowait(job)
        return job.result

    def close(self):
        self.queue.put(None)
        self._thread.join()

    def _next_batch(self):
        first = self._carry or self.queue.get()
        self._carry = None
        if first is None:
            return None
        batch, count, deadline = [first], len(first.prompts), time.monotonic() + self.batch_wait_s
        while count < self.max_batch:
            try:
                job = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None or job.images.shape[1:] != first.images.shape[1:] or count + len(job.prompts) > self.max_batch:
                self._carry = job
                break
            batch.append(job)
            count += len(job.prompts)
        return batch

    def _run(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                total, terms = self.reward(torch.cat([j.images for j in batch]),
                                           [p for j in batch for p in j.prompts])
            except Exception as e:  # the reward failed: every request of the batch gets the error
                for job in batch:
                    job.result.set_exception(e)
                continue
            # Counted before any request is answered: a client that has its scores sees them counted.
            self.scored_images += len(total)
            start = 0
            for job in batch:
                rows = slice(start, start + len(job.prompts))
                job.result.set_result((total[rows], {name: v[rows] for name, v in terms.items()}))
                start = rows.stop


def read_reward_configs(path: str) -> list:
    configs = resolve_paths(load_json(path, "--rewards"), os.path.dirname(os.path.abspath(path)))
    if isinstance(configs, dict):
        if "reward" not in configs:
            raise ValueError(f"--rewards {path}: a JSON object must be a model.json with a `reward` block")
        configs = configs["reward"]
    if not isinstance(configs, list) or not configs:
        raise ValueError(f"--rewards {path}: expected a non-empty list of reward configs")
    return configs


def create_app(reward: CombinedReward, settings: ServerSettings):
    """The FastAPI application serving `reward` (its scorer thread lives as long as the app runs)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.scorer = BatchScorer(reward, settings.max_batch, settings.max_queue, settings.batch_wait_ms / 1000)
        try:
            yield
        finally:
            app.state.scorer.close()

    app = FastAPI(title="mm-grpo reward server", lifespan=lifespan)
    max_bytes = int(settings.max_request_mb * MB)

    @app.get(HEALTH_PATH)
    async def health():
        return {"status": "ok", "rewards": reward.weights, "queued": app.state.scorer.queue.qsize(),
                "max_batch": settings.max_batch, "scored_images": app.state.scorer.scored_images}

    @app.post(SCORE_PATH)
    async def score(request: Request):
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            return error(411, "a Content-Length header is required")
        if int(length) > max_bytes:
            return error(413, f"the body has {int(length)} bytes, more than --max-request-mb {settings.max_request_mb:g}")
        body = await request.body()
        try:
            images, prompts = await run_in_threadpool(_parse, body, reward)
        except BadRequest as e:
            return error(400, str(e))
        try:
            result = request.app.state.scorer.submit(images, prompts)
        except queue.Full:
            return error(503, f"the queue is full ({settings.max_queue} requests): retry later")
        try:
            total, terms = await asyncio.wrap_future(result)
        except Exception as e:
            return error(500, f"the reward failed: {type(e).__name__}: {one_line(e)}")
        return encode_response(total, terms)

    return app


def _parse(body: bytes, reward: CombinedReward):
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    images, prompts = decode_request(parsed)
    try:
        reward.check_prompts(prompts)
    except ValueError as e:
        raise BadRequest(one_line(e)) from None
    return images, prompts


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, not listening yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve_app(app, sock=None):
    """Runs an ASGI app under uvicorn in a thread of this process (tests, benchmarks); yields its
    URL on 127.0.0.1 (`sock`: a bound socket, else a free port); stops it and joins the thread."""
    import uvicorn
    sock = sock or free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="reward-server")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the reward server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()



def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_setting_args(parser, ServerSettings)
    args = parser.parse_args(argv)
    try:
        settings = from_args(ServerSettings, args)
        if settings.max_request_mb <= 0 or settings.batch_wait_ms < 0:
            raise ValueError("need --max-request-mb > 0 and --batch-wait-ms >= 0")
        reward = CombinedReward.from_configs(read_reward_configs(settings.rewards), device=settings.device)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{PROG}: error: {e}\n")
    import uvicorn
    print(f"{PROG}: serving {reward.weights} on http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(reward, settings), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
