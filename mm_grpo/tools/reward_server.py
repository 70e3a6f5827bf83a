"""A reward server: any registered reward, or a weighted combination, scored over HTTP.

    python -m mm_grpo.tools.reward_server --rewards rewards.json [--host 0.0.0.0] [--port 8000] [--device cuda]

`--rewards` is a JSON list of reward configs, or a model.json whose `reward` block is used (the
same entries as in model.json; $VARS and relative paths resolved as the trainers resolve them).
The protocol is mm_grpo/rewards/wire.py's; docs/rewards.md says how to run it beside an NPU
cluster. Every request has a budget: its body (--max-request-mb, counted on the bytes read,
whatever the framing), its images (--max-images-per-request, counted by a scan of the body's
tokens before json builds anything) and their decoded pixels (--max-request-mpx, read from the
image headers before anything is decoded); a request over any of them gets 413. The decoded
pixels held over all requests are bounded too (--max-held-mpx: a request waits for room).
Requests are queued (a bounded queue: 503 when full) and one thread scores them in batches of up
to --max-batch images and --max-request-mpx pixels, splitting a larger request and joining
requests whose images have one size; images stay 8-bit until their batch is scored. Every
admitted request is answered: a scorer that dies, or a batch that takes longer than
--score-timeout-s, fails every waiting request with 503 and /health, and the server exits 3.
A client has --read-timeout-s to send each whole request (pipelined ones too), and
--max-connections are served at once (503 beyond, and beyond twice as many new connections are
closed as they come). With a token ($MM_GRPO_REWARD_TOKEN, or --token-env) every request needs
`Authorization: Bearer <token>`. Every refusal is a one-line {"error": ...}.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import json
import math
import os
import queue
import re
import resource
import socket
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import List, Optional

import torch

from mm_grpo.files.jsonfile import load_json
from mm_grpo.rewards import wire
from mm_grpo.rewards.base import one_line
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.rewards.wire import HEALTH_PATH, MPX, SCORE_PATH, BadRequest, RequestTooLarge, encode_response
from mm_grpo.settings import add_setting_args, from_args, setting
from mm_grpo.training.components import resolve_paths

PROG = "python -m mm_grpo.tools.reward_server"
SERVING = re.compile(re.escape(PROG) + r": serving .* on (http://\S+)$")
MB = 2 ** 20
# Open connections beyond OVERFLOW x --max-connections are closed as they are accepted; below
# that uvicorn answers a request over --max-connections with 503.
OVERFLOW = 2
# Open files a connection slot may need: OVERFLOW held, plus one accept round (the listen
# backlog is --max-connections) and the connections of the round before, still closing.
FILES_PER_CONNECTION = OVERFLOW + 2
FILES_HEADROOM = 128  # the reward's model files, threads' pipes, logs
WARN_INTERVAL_S = 10.0  # a warning about a flood of connections is repeated at most this often
READ_TIMED_OUT = "mm_grpo.read_timed_out"  # set in a request's scope when its connection was closed for it
WAIT_POLICY = "OMP_WAIT_POLICY"  # read by OpenMP once, when torch loads
SCORER_FAILED_STATUS = 3  # the exit status of a server whose scorer died or is stuck
WATCH_INTERVAL_S = 1.0  # how often the server checks that its scorer can still answer
# What a stopping server waits for the requests in flight to be answered (the rest get 503):
# SIGTERM ends it within about this, even when the reward is stuck.
GRACEFUL_SHUTDOWN_S = 10.0
SCORER_JOIN_S = 1.0  # then for its scorer's thread: nobody waits for what that still holds


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    rewards: str = setting(None, "JSON list of reward configs, or a model.json (its `reward` block)", required=True)
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface; then set a token)")
    port: int = setting(8000, "port to listen on (0: a free one, named in the `serving` line)", minimum=0,
                        below=2 ** 16)
    device: str = setting("cpu", "device of the reward models (cuda, npu, cpu)")
    max_batch: int = setting(64, "images scored together, at most (requests of one image size are joined, "
                                 "larger ones split)", minimum=1)
    max_queue: int = setting(256, "requests waiting, at most: more get 503", minimum=1)
    max_request_mb: float = setting(64.0, "largest request body in MiB, counted on the bytes read (whatever the "
                                          "framing): larger ones get 413", above=0)
    max_images_per_request: int = setting(256, "images in one request, at most: more get 413 before any is decoded",
                                          minimum=1)
    max_request_mpx: float = setting(
        16.0, "decoded pixels of one request in Mpx (2^20 pixels), at most: more get 413 before any image is "
              "decoded. 16: one 4096x4096 image, 16 of 1024x1024 or 64 of 512x512 (48 MiB as 8-bit RGB; the "
              "shipped FLUX run sends 12 of 720x720 a rank, 5.9 Mpx). A scored batch holds at most as many "
              "(192 MiB as float32, plus what the reward needs for them)", above=0)
    max_held_mpx: float = setting(64.0, "decoded pixels held at once over all requests (decoding, queued, "
                                        "scored) in Mpx: a request waits for room. 64: 192 MiB as 8-bit RGB",
                                  above=0)
    batch_wait_ms: float = setting(5.0, "how long the scorer waits for more requests to join a batch", minimum=0)
    read_timeout_s: float = setting(30.0, "seconds a client has to send a whole request, headers and body: a "
                                          "slower connection is closed (30: a 64 MiB body needs 18 Mbit/s); each "
                                          "pipelined request has its own", above=0)
    score_timeout_s: float = setting(
        600.0, "seconds one batch may take to score: a longer one means the reward is stuck, and the server "
               "answers every waiting request 503, fails /health and exits with status 3 for its supervisor to "
               "restart it (as it does when the scoring thread dies)", above=0)
    max_connections: int = setting(
        128, "open connections served at once: beyond it a request gets 503 at once, beyond twice as many a new "
             f"connection is closed as it comes. Needs {FILES_PER_CONNECTION} open files a connection: ulimit -n "
             "is raised to its hard limit when that is needed; at least the number of ranks that score here",
        minimum=1)
    token_env: str = setting(wire.TOKEN_ENV, "environment variable holding the bearer token every request must "
                                             "carry (Authorization: Bearer <token>; unset or empty: no token). The "
                                             "`remote` reward sends $MM_GRPO_REWARD_TOKEN")


def warn(message: str):
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


class _Every:
    """A warning repeated at most every `interval_s` (a flood of connections is one line, not one each)."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S):
        self.interval_s, self.last = interval_s, -float("inf")

    def warn(self, message: str):
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            warn(message)


class ScorerFailed(RuntimeError):
    """The scorer thread died or is wedged: no request can be scored until the server restarts."""


@dataclasses.dataclass
class _Job:
    images: torch.Tensor  # [B, 3, H, W]: uint8 (0..255) from the wire, or float in [0, 1]
    prompts: List[str]
    result: Future
    parts: list = dataclasses.field(default_factory=list)  # (total, terms) of the rows scored so far


@dataclasses.dataclass
class _Piece:
    """Rows of one job in a batch: a job larger than a batch is scored in pieces."""
    job: _Job
    rows: slice

    def __len__(self):
        return self.rows.stop - self.rows.start


def _as_float(images: torch.Tensor) -> torch.Tensor:
    return images.float().div_(255) if images.dtype == torch.uint8 else images.float()


def _settle(future: Future, result=None, error: Optional[BaseException] = None):
    """Sets a request's outcome unless it has one already (a request failed by `abort` while its
    batch was still being scored)."""
    try:
        future.set_exception(error) if error is not None else future.set_result(result)
    except InvalidStateError:
        pass


_CLOSED = object()  # what the queue holds once the scorer is closed


class BatchScorer:
    """One thread scoring queued requests in batches of at most `max_batch` images and
    `max_batch_pixels` pixels (a larger request is split; one image is always taken);
    `submit` -> Future of (total, {name: values}).

    Every submitted request ends answered, failed or cancelled: a request is taken off the queue
    (and marked running) exactly once, then scored piece by piece in order; a request whose client
    went away while it waited is dropped. `problem(score_timeout_s)` names a dead or wedged scorer,
    and `abort` then fails every request it holds, so that none waits for ever."""

    def __init__(self, reward, max_batch: int, max_queue: int, batch_wait_s: float,
                 max_batch_pixels: Optional[int] = None):
        self.reward, self.max_batch, self.batch_wait_s = reward, max_batch, batch_wait_s
        self.max_batch_pixels = max_batch_pixels
        self.queue = queue.Queue(maxsize=max_queue)
        self.scored_images = 0
        self.failure = None  # why the scorer stopped for good (ScorerFailed's message)
        self._carry = None  # (running job, first row not taken): first in the next batch
        self._closed = False  # _CLOSED was taken off the queue: finish the carry, then stop
        self._scoring_since = None  # time.monotonic() when the batch being scored started
        self._batch = []  # the pieces being scored (failed by `abort` when the scorer is stuck)
        self._thread = threading.Thread(target=self._run, name="reward-scorer", daemon=True)
        self._thread.start()

    def submit(self, images: torch.Tensor, prompts: List[str]) -> Future:
        """Raises queue.Full when --max-queue requests wait, ScorerFailed once the scorer is gone."""
        if self.failure:
            raise ScorerFailed(self.failure)
        job = _Job(images, prompts, Future())
        self.queue.put_nowait(job)
        return job.result

    def close(self, wait_s: float = None):
        """Stops the thread once what it holds is scored (waiting at most `wait_s`); requests still
        queued then are failed."""
        try:
            self.queue.put_nowait(_CLOSED)
        except queue.Full:  # the thread drains the queue first; the requests left are failed below
            self._closed = True
        self._thread.join(wait_s)
        self._fail_held(ScorerFailed("the server is shutting down"))

    def problem(self, score_timeout_s: float) -> Optional[str]:
        """Why no request can be scored any more (the thread died, or one batch has taken longer
        than `score_timeout_s`), else None."""
        if self.failure:
            return self.failure
        since = self._scoring_since
        if since is not None and time.monotonic() - since > score_timeout_s:
            return f"one batch has been scoring for over --score-timeout-s {score_timeout_s:g} s: the reward is stuck"
        if not self._thread.is_alive() and not self._closed:
            return "the scoring thread ended"
        return None

    def abort(self, reason: str):
        """Fails every request the scorer holds (being scored, carried, queued) with `reason`."""
        self.failure = self.failure or reason
        self._fail_held(ScorerFailed(reason))

    def _fail_held(self, error: ScorerFailed):
        jobs = [p.job for p in self._batch] + ([self._carry[0]] if self._carry else [])
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job is _CLOSED:  # left for the thread, which stops on it
                self.queue.put_nowait(_CLOSED)
            else:
                _settle(job.result, error=error)

    # --- the scorer thread --------------------------------------------------------------
    def _pull(self, timeout: Optional[float]):
        """The next queued request, marked running (a cancelled one is dropped), _CLOSED, or None
        when `timeout` passes first (None: wait for one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                job = self.queue.get(timeout=left)
            except queue.Empty:
                return None
            if job is _CLOSED or job.result.set_running_or_notify_cancel():
                return job

    def _room(self, batch: List[_Piece], job: _Job) -> int:
        """Images of `job` that fit beside `batch` (at least one in an empty batch)."""
        taken = sum(len(p) for p in batch)
        room = self.max_batch - taken
        if self.max_batch_pixels is not None:
            per_image = job.images.shape[2] * job.images.shape[3]
            room = min(room, (self.max_batch_pixels - taken * per_image) // per_image)
        return room if batch else max(room, 1)

    def _next_batch(self) -> Optional[List[_Piece]]:
        """The next batch (a list of pieces of running requests), or None once the scorer is
        closed and holds nothing."""
        if self._carry is None:
            job = None if self._closed else self._pull(timeout=None)
            if job is None or job is _CLOSED:
                self._closed = True
                return None
            self._carry = (job, 0)
        batch, deadline = [], time.monotonic() + self.batch_wait_s
        while True:
            job, start = self._carry
            if not self._joins(batch, job):
                break  # carried: the next batch starts with it
            stop = min(len(job.prompts), start + self._room(batch, job))
            if stop > start:
                batch.append(_Piece(job, slice(start, stop)))
            self._carry = (job, stop) if stop < len(job.prompts) else None
            if self._carry is not None or sum(len(p) for p in batch) >= self.max_batch or self._closed:
                break
            job = self._pull(timeout=max(0.0, deadline - time.monotonic()))
            if job is None:
                break
            if job is _CLOSED:
                self._closed = True
                break
            self._carry = (job, 0)
        return batch

    @staticmethod
    def _joins(batch: List[_Piece], job: _Job) -> bool:
        if not batch:
            return True
        first = batch[0].job.images
        return job.images.shape[1:] == first.shape[1:] and job.images.dtype == first.dtype

    def _run(self):
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                self._score([p for p in batch if not p.job.result.done()])  # the rest of a failed request
        except BaseException as e:  # a fault of the scheduler itself: fail everything rather than hang
            self.abort(f"the scoring thread died: {type(e).__name__}: {one_line(e)}")

    def _score(self, batch: List[_Piece]):
        if not batch:
            return
        self._batch, self._scoring_since = batch, time.monotonic()
        try:
            images = _as_float(torch.cat([p.job.images[p.rows] for p in batch]))  # one batch in float at a time
            total, terms = self.reward(images, [t for p in batch for t in p.job.prompts[p.rows]])
        except Exception as e:  # the reward failed: every request of the batch gets the error
            for piece in batch:
                _settle(piece.job.result, error=e)
            return
        finally:
            self._batch, self._scoring_since = [], None
        # Counted before any request is answered: a client that has its scores sees them counted.
        self.scored_images += len(total)
        start = 0
        for piece in batch:
            rows = slice(start, start + len(piece))
            piece.job.parts.append((total[rows], {name: v[rows] for name, v in terms.items()}))
            start = rows.stop
            if piece.rows.stop == len(piece.job.prompts):
                _settle(piece.job.result, _joined(piece.job.parts))


def _joined(parts):
    totals, terms = zip(*parts)
    return torch.cat(totals), {name: torch.cat([t[name] for t in terms]) for name in terms[0]}


class HeldPixels:
    """Decoded pixels the server holds over all requests (decoding, queued, scored): a request
    waits until its pixels fit. Taken in the worker thread that decodes (one hop off the event
    loop per request), given back from the event loop once the request is answered."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._changed = threading.Condition()

    def take(self, pixels: int):
        with self._changed:
            self._changed.wait_for(lambda: self.held + pixels <= self.limit)
            self.held += pixels

    def give_back(self, pixels: int):
        with self._changed:
            self.held -= pixels
            self._changed.notify_all()


def read_reward_configs(path: str) -> list:
    configs = resolve_paths(load_json(path, "--rewards"), os.path.dirname(os.path.abspath(path)), f"--rewards {path}")
    if isinstance(configs, dict):
        if "reward" not in configs:
            raise ValueError(f"--rewards {path}: a JSON object must be a model.json with a `reward` block")
        configs = configs["reward"]
    if not isinstance(configs, list) or not configs:
        raise ValueError(f"--rewards {path}: expected a non-empty list of reward configs")
    return configs


class BearerToken:
    """ASGI middleware: every request needs `Authorization: Bearer <token>` (compared in
    constant time), else 401 with a one-line error."""

    def __init__(self, app, token: str, token_env: str):
        from fastapi.responses import JSONResponse
        self.app, self.expected, self.response = app, b"Bearer " + token.encode(), JSONResponse
        self.missing = (f"this server needs a token: Authorization: Bearer <the server's ${token_env}> "
                        f"(the `remote` reward sends ${wire.TOKEN_ENV})")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                message = self.missing if given is None else "the bearer token is wrong"
                await self.response({"error": message}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _client(address) -> str:
    """A connection's peer (host, port), as the warnings name it."""
    return "{}:{}".format(*address) if address else "a client"


def create_app(reward, settings: ServerSettings, token: Optional[str] = None, on_failure=None):
    """The FastAPI application serving `reward` (its scorer thread lives as long as the app
    runs); with `token`, every request must carry it. When the scorer dies or is stuck, every
    waiting request gets 503, /health fails from then on, and `on_failure(reason)` is called (the
    server's `main` then exits with status 3)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    def error(status: int, message: str, close: bool = False):
        # close: the body was not read to its end, so the connection cannot carry another request
        return JSONResponse({"error": message}, status_code=status, headers={"Connection": "close"} if close else None)

    max_bytes = int(settings.max_request_mb * MB)
    max_images, max_pixels = settings.max_images_per_request, int(settings.max_request_mpx * MPX)

    async def watch(app):
        """Fails the server, once, when its scorer can no longer answer (dead or stuck)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            problem = app.state.scorer.problem(settings.score_timeout_s)
            if problem:
                app.state.failed = problem
                app.state.scorer.abort(problem)
                print(f"{PROG}: error: {problem}; every waiting request was answered 503, the server stops",
                      file=sys.stderr, flush=True)
                if on_failure is not None:
                    on_failure(problem)
                return

    @contextlib.asynccontextmanager
    async def lifespan(app):
        _log_out_of_files(asyncio.get_running_loop())
        app.state.failed = None
        app.state.held = HeldPixels(int(settings.max_held_mpx * MPX))
        app.state.scorer = BatchScorer(reward, settings.max_batch, settings.max_queue, settings.batch_wait_ms / 1000,
                                       max_batch_pixels=max_pixels)
        watcher = asyncio.create_task(watch(app))
        try:
            yield
        finally:
            watcher.cancel()
            app.state.scorer.close(wait_s=SCORER_JOIN_S)

    # No /docs or /openapi.json: the server answers its two paths only.
    app = FastAPI(title="mm-grpo reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def unavailable(reason: str):
        return error(503, f"the reward server cannot score: {reason}")

    @app.get(HEALTH_PATH)
    async def health():
        if app.state.failed:
            return unavailable(app.state.failed)
        return {"status": "ok", "rewards": reward.weights, "queued": app.state.scorer.queue.qsize(),
                "max_batch": settings.max_batch, "scored_images": app.state.scorer.scored_images}

    async def read_body(request: Request) -> bytearray:
        """The body, counted on the bytes read whatever the framing (RequestTooLarge past the cap)."""
        length = request.headers.get("content-length")
        if length is not None and "transfer-encoding" in request.headers:
            raise BadRequest("the request has both Content-Length and Transfer-Encoding: send one")  # RFC 9112 6.3
        if length is not None and int(length) > max_bytes:  # h11 has checked that it is a number
            raise RequestTooLarge(f"the body has {int(length)} bytes, more than --max-request-mb "
                                  f"{settings.max_request_mb:g}")
        body = bytearray()  # grown in place: the body is held once
        async for chunk in request.stream():
            if len(body) + len(chunk) > max_bytes:
                raise RequestTooLarge(f"the body has more than {max_bytes} bytes, more than --max-request-mb "
                                      f"{settings.max_request_mb:g}")
            body += chunk
        return body

    @app.post(SCORE_PATH)
    async def score(request: Request):
        if app.state.failed:
            return unavailable(app.state.failed)
        try:
            body = await read_body(request)
        except BadRequest as e:
            return error(e.status, str(e), close=True)
        except ClientDisconnect:
            if not request.scope.get(READ_TIMED_OUT):  # else the connection's own warning said why
                warn(f"{_client(request.client)} closed the connection before its request was read")
            return error(400, "the request was not read")  # nobody is there to read it
        held = request.app.state.held
        try:
            images, prompts, pixels = await run_in_threadpool(_decode, body, reward, max_images, max_pixels, held)
        except BadRequest as e:
            return error(e.status, str(e))
        except Exception as e:  # e.g. MemoryError: the server's, not the request's, fault
            return error(500, f"the request could not be decoded: {type(e).__name__}: {one_line(e)}")
        del body
        try:
            result = request.app.state.scorer.submit(images, prompts)
            del images  # the scorer holds them until they are scored
            total, terms = await asyncio.wrap_future(result)
        except queue.Full:
            return error(503, f"the queue is full ({settings.max_queue} requests): retry later")
        except ScorerFailed as e:
            return unavailable(str(e))
        except asyncio.CancelledError:  # uvicorn's graceful shutdown ran out (SIGTERM): answered, not cut
            return error(503, "the reward server is stopping: retry once it is back", close=True)
        except Exception as e:
            return error(500, f"the reward failed: {type(e).__name__}: {one_line(e)}")
        finally:
            held.give_back(pixels)
        if await request.is_disconnected():
            warn(f"{_client(request.client)} closed the connection before its {len(total)} scores were sent")
        return encode_response(total, terms)

    return BearerToken(app, token, settings.token_env) if token else app


def _decode(body: bytearray, reward, max_images: int, max_pixels: int, held: HeldPixels):
    """A /score body -> (images uint8, prompts, pixels taken from `held`), in a worker thread:
    checked against the budget from the JSON and the image headers, then decoded once its pixels
    fit beside those the server holds; BadRequest / RequestTooLarge with nothing held."""
    request = _parse(body, reward, max_images, max_pixels)
    held.take(request.pixels)
    try:
        return wire.decode_images(request), request.prompts, request.pixels
    except BaseException:
        held.give_back(request.pixels)
        raise


# A /score body's tokens: a JSON string, one structural character, or a run of anything else (a
# number, true, null, a stray quote's text). Whitespace between them is skipped.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:,]|[^\s"\[\]{}:,]+')
_STRING, _OTHER = b'"', b"?"  # the kinds of a string token and of any other run
SHAPE = 'the body is not JSON of the form {"prompts": [strings], "images": [base64 strings]}'
BODY_KEYS = 2  # "prompts" and "images"


def check_body_shape(body, max_images: int):
    """Refuses a body that is not an object of at most BODY_KEYS lists of at most `max_images`
    strings, before json.loads builds anything: under the body cap it could otherwise build
    objects of 16x its bytes (`[]` is 3 bytes, a 56-byte list) or nest 100,000 deep. Reads at most
    BODY_KEYS x (2 x max_images + 4) tokens, each a slice of the body, never a copy of it."""
    def kind(match):
        first = body[match.start():match.start() + 1]
        return first if first == _STRING or match.end() - match.start() == 1 and first in b"[]{}:," else _OTHER

    tokens = (kind(m) for m in _TOKEN.finditer(body))

    def expect(*wanted):
        token = next(tokens, None)
        if token not in wanted:
            raise BadRequest(SHAPE)
        return token

    expect(b"{")
    for _ in range(BODY_KEYS):
        expect(_STRING), expect(b":"), expect(b"[")
        token, items = expect(_STRING, b"]"), 0
        while token == _STRING:
            items += 1
            if items > max_images:
                raise RequestTooLarge(f"the request has more than {max_images} images or prompts: "
                                      f"--max-images-per-request {max_images}")
            if expect(b",", b"]") == b",":
                expect(_STRING)
            else:
                token = b"]"
        if expect(b",", b"}") == b"}":
            break
    else:
        raise BadRequest(SHAPE)
    if next(tokens, None) is not None:
        raise BadRequest(SHAPE)


def _parse(body: bytearray, reward, max_images: int, max_pixels: int) -> wire.ScoreRequest:
    check_body_shape(body, max_images)
    try:
        parsed = json.loads(body)
    except ValueError as e:  # not UTF-8, or not JSON within its shape
        raise BadRequest(f"the body is not JSON ({one_line(e)})") from None
    request = wire.parse_request(parsed, max_images, max_pixels)
    try:
        reward.check_prompts(request.prompts)
    except ValueError as e:
        raise BadRequest(one_line(e)) from None
    return request


def _log_out_of_files(loop):
    """The event loop's error for an accept that found no free file descriptor (a traceback per
    try, many a second) as one line every WARN_INTERVAL_S."""
    every = _Every()

    def handle(loop, context):
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            every.warn(f"out of open files ({exc.strerror}): new connections wait; lower --max-connections or "
                       "raise ulimit -n")
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def guarded_protocol(settings: ServerSettings):
    """uvicorn's HTTP/1.1 protocol (h11) with what uvicorn 0.54 has no option for: a deadline to
    read each request, headers and body, pipelined ones included (--read-timeout-s; uvicorn times
    out idle keep-alive connections only), and a cap on open connections (OVERFLOW x --max-connections) applied as
    a connection is accepted, before it can hold a file descriptor for long."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    read_timeout_s, most_open = settings.read_timeout_s, OVERFLOW * settings.max_connections
    request_read = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
    flood = _Every()

    class GuardedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > most_open:
                flood.warn(f"{len(self.connections) - 1} connections open, {OVERFLOW} x --max-connections "
                           f"{settings.max_connections}: new ones are closed as they come")
                transport.abort()
                return
            self._start_deadline()

        def handle_events(self):
            # Runs on every arrival of data, and when a response completes with the next request
            # already buffered (pipelined): each request's deadline runs from when it can be read.
            super().handle_events()
            if self.conn.their_state in request_read:
                self._stop_deadline()
            elif self._deadline is None and (self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]):
                self._start_deadline()

        def connection_lost(self, exc):
            self._stop_deadline()
            super().connection_lost(exc)

        def _start_deadline(self):
            self._deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _stop_deadline(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _read_timed_out(self):
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self.scope[READ_TIMED_OUT] = True
            warn(f"closed the connection from {_client(self.client)}: no whole request within --read-timeout-s "
                 f"{read_timeout_s:g}")
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, settings: ServerSettings, log_level: str = "warning"):
    import uvicorn
    return uvicorn.Config(app, http=guarded_protocol(settings), lifespan="on", log_level=log_level,
                          # uvicorn counts the connection asking: --max-connections are served
                          limit_concurrency=settings.max_connections + 1,
                          # also what asyncio accepts in one round: a burst cannot take every descriptor
                          backlog=settings.max_connections, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet); OSError `cannot listen on host:port: ...`.
    Made with getaddrinfo's protocol (IPPROTO_TCP): asyncio sets TCP_NODELAY only on the
    connections of such a socket, and without it every response waits for a delayed ACK (40 ms)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


def serving_line(weights: dict, host: str, port: int) -> str:
    """The line a started server writes to stderr; its URL names the port it listens on."""
    return f"{PROG}: serving {weights} on http://{host}:{port}"


def served_url(line: str) -> Optional[str]:
    """The URL a `serving_line` names (how a launcher learns the port of --port 0), else None."""
    found = SERVING.match(line.strip())
    return found and found.group(1)


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1, not listening yet."""
    return listen_socket("127.0.0.1", 0)


def ensure_open_files(max_connections: int):
    """Raises the soft limit on open files to what --max-connections needs (up to the hard
    limit); ValueError when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    needed += FILES_HEADROOM + FILES_PER_CONNECTION * max_connections
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ValueError(f"--max-connections {max_connections} needs {needed} open files, ulimit -n allows {hard}: "
                         "lower --max-connections or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def read_token(settings: ServerSettings) -> Optional[str]:
    token = os.environ.get(settings.token_env, "")
    if not token and settings.token_env != wire.TOKEN_ENV:
        raise ValueError(f"--token-env {settings.token_env}: ${settings.token_env} is not set")
    bad = wire.NOT_A_TOKEN.search(token)
    if bad:  # no header can carry it: every request would be refused as "wrong"
        raise ValueError(f"${settings.token_env} holds {bad.group()!r} at character {bad.start() + 1} of {len(token)}: "
                         "a bearer token is visible ASCII only, no space or line end (set it without the file's newline)")
    return token or None


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


@contextlib.contextmanager
def serve_app(app, sock=None, settings: Optional[ServerSettings] = None):
    """Runs an ASGI app under uvicorn in a thread of this process (tests, benchmarks) with the
    server's protocol (`settings`: its read timeout and connection limit); yields its URL on
    127.0.0.1 (`sock`: a bound socket, else a free port); stops it and joins the thread."""
    import uvicorn
    sock = sock or free_socket()
    server = uvicorn.Server(uvicorn_config(app, settings or ServerSettings(rewards="-"), log_level="error"))
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


def _check(settings: ServerSettings):
    """What the flags' bounds (checked as they are read) do not say: finite numbers, budgets that nest."""
    for f in dataclasses.fields(ServerSettings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
    if settings.max_held_mpx < settings.max_request_mpx:
        raise ValueError(f"--max-held-mpx {settings.max_held_mpx:g} must be >= --max-request-mpx "
                         f"{settings.max_request_mpx:g}: a request that fits its budget must fit the server's")


def unprotected_warning(host: str, token: Optional[str], token_env: str) -> Optional[str]:
    """The start-up warning for a server that anyone on the network can use, or None."""
    if token is not None or _loopback(host):
        return None
    return f"listening on {host} without a token: anyone who reaches this port can use the server (set ${token_env})"


def _openmp_spins() -> bool:
    """Whether torch's OpenMP threads spin between operators (OpenMP's default while a process has
    no more of them than cores). In this server they share the cores with the event loop and the
    decoding threads: spinning, they took the load test from 120 to 10 requests/s on 2 cores."""
    return (WAIT_POLICY not in os.environ and torch.get_num_threads() > 1
            and "OpenMP" in torch.__config__.parallel_info())


def main(argv=None, reexec: bool = False):
    """`reexec`: run as a program, restart once with OMP_WAIT_POLICY=PASSIVE (OpenMP reads it
    only when torch loads, before this module runs) when its threads would spin."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_setting_args(parser, ServerSettings)
    args = parser.parse_args(argv)
    try:
        settings = from_args(ServerSettings, args)
        _check(settings)
        token = read_token(settings)
        configs = read_reward_configs(settings.rewards)
        ensure_open_files(settings.max_connections)
        sock = listen_socket(settings.host, settings.port)  # before the models load: a port in use says so at once
    except (ValueError, OSError) as e:
        parser.exit(2, f"{PROG}: error: {e}\n")
    if reexec and _openmp_spins():
        sock.close()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, WAIT_POLICY: "PASSIVE"})
    try:
        reward = CombinedReward.from_configs(configs, device=settings.device)
    except (ValueError, OSError) as e:
        sock.close()
        parser.exit(2, f"{PROG}: error: {e}\n")
    import uvicorn
    failed = []

    def stop(reason):  # the scorer is dead or stuck: a supervisor restarts a server that exits
        failed.append(reason)
        server.should_exit = True
    server = uvicorn.Server(uvicorn_config(create_app(reward, settings, token, on_failure=stop), settings))
    warning = unprotected_warning(settings.host, token, settings.token_env)
    if warning:
        warn(warning)
    print(serving_line(reward.weights, settings.host, sock.getsockname()[1]), file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if failed:
        sys.exit(SCORER_FAILED_STATUS)  # the error line was printed when it failed


if __name__ == "__main__":
    main(reexec=True)
