"""Rewards scored by a server: mm-grpo's own reward server (`remote`), and the transport every
remote reward shares.

Every remote reward is reached before the first rollout (a one-line error naming the URL when
it is not). Each try of a request (connect, send, and read of the whole reply) has `timeout`
seconds in total: a watchdog shuts the try's sockets at its deadline, so a server that trickles
bytes, stops reading or never answers is cut there. A try that fails in transport (refused,
reset, broken mid-body, cut at the deadline, a reply over the size cap, 5xx) is tried again up
to `retries` times, and when every try fails the batch scores NaN with one warning line: the
iteration is skipped (no optimizer step), and --max-skipped-iterations such iterations in a
row stop the run. An answer the server will repeat (4xx, a redirect) or a reply that is not a
valid reply (not JSON, the wrong number of scores) stops the run at once: trying again would
not help. A reply is read as data, its fault named in one line whatever it holds: integers of
at most MAX_INT_DIGITS, scores that are numbers (not booleans) a float holds; a non-finite one,
or one past float32, is NaN as a null is. A bearer token is checked before any request.
"""
import concurrent.futures
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time

import requests
import torch
import urllib3

from mm_grpo.rewards import wire
from mm_grpo.rewards.base import Reward, one_line, register_reward

BACKOFF_S = 0.5  # first wait between tries, doubled after each
MAX_BACKOFF_S = 8.0
MAX_REPLY_BYTES = 8 << 20  # a JSON reply: scores of thousands of images fit in well under 1 MiB
READ_CHUNK_BYTES = 64 << 10
ERROR_TEXT_BYTES = 64 << 10  # read of a refusal's or failure's body: its first line is all that is shown
ERROR_TEXT_CHARS = 200  # of that line
# json reads an integer of at most Python's default digits, whatever sys.set_int_max_str_digits says:
# int() of text is quadratic in its length, and no score has more than a float's 309 digits.
MAX_INT_DIGITS = sys.int_info.default_max_str_digits
# Errors of the transport below the reply's data: each one fails the try, which is tried again.
TRANSPORT_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, OSError)


class RemoteUnavailable(RuntimeError):
    """Every try failed (unreachable, timed out, busy)."""


class RemoteRefused(ValueError):
    """The server refused the request (4xx) or its reply is not a valid reply: trying again would not help."""


class RemoteRedirected(RemoteRefused):
    """The server answers with a redirect: `url` names another address."""


class TryFailed(Exception):
    """One try failed in transport; its message is one line."""


class Reply:
    """A whole reply, read within its try's deadline and the size cap."""

    def __init__(self, status_code: int, content: bytes, location: str = ""):
        self.status_code, self.content, self.location = status_code, content, location

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self):
        """The reply parsed as JSON; ValueError (one line) when it is not JSON, or holds an
        integer of more than MAX_INT_DIGITS."""
        try:
            return json.loads(self.content, parse_int=_json_int)
        except RecursionError:  # json's parser recurses once per nested bracket
            raise ValueError("the reply nests too deeply to be JSON scores") from None


def _json_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"the reply holds an integer of {digits} digits, more than the {MAX_INT_DIGITS} "
                         "this reward reads")
    return int(text)


def bearer_header(reward_name: str, variable: str, default: str = "") -> dict:
    """{"Authorization": "Bearer <$variable, else default>"}, {} when both are empty; ValueError
    naming the variable for a token that is not visible ASCII (a newline from a file, a space):
    every request would fail in transport, or the server would strip it and refuse it."""
    token = os.environ.get(variable) or default
    if not token:
        return {}
    bad = wire.NOT_A_TOKEN.search(token)
    if bad:  # its character and place only: the token is a secret
        raise ValueError(f"reward {reward_name!r}: ${variable} holds {bad.group()!r} at character "
                         f"{bad.start() + 1} of {len(token)}: a bearer token is visible ASCII only, no "
                         "space or line end (set it without the file's newline)")
    return {"Authorization": f"Bearer {token}"}


# --- one try: a deadline, and a watchdog that shuts its connections' sockets there ----------
class Attempt:
    """One try of one or more requests (a VLM judge's batch): they share one deadline. At the
    deadline, or when `end` is called early, every connection the try is using is shut down,
    which wakes any thread blocked in connect, send or read on it."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, time.monotonic() + seconds
        self.expired = f"no whole reply within {seconds:g} s"
        self.reason = None  # why the try ended; None while it runs
        self._lock = threading.Lock()
        self._connections = {}  # thread id -> the connection that thread is using
        self._timer = threading.Timer(seconds, self.end, (self.expired,))
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        self._timer.join()  # no watchdog outlives its try

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def end(self, reason: str):
        with self._lock:
            self.reason = self.reason or reason
            for connection in self._connections.values():
                _shut(connection)

    def attach(self, connection):
        """Watch `connection` for the calling thread; shut it at once when the try has ended."""
        with self._lock:
            self._connections[threading.get_ident()] = connection
            if self.reason:
                _shut(connection)

    def detach(self):
        with self._lock:
            self._connections.pop(threading.get_ident(), None)


def _shut(connection):
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:  # the plain socket's shutdown: an SSL socket's would also drop its TLS state under the reader
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


_CURRENT = threading.local()  # .attempt: the try the calling thread's request belongs to


class _QuietWhenCut(logging.Filter):
    """Drops urllib3's warning (with a traceback) about headers cut off mid-line when the cut
    was a try's watchdog: the try's one line says what happened."""

    def filter(self, record):
        attempt = getattr(_CURRENT, "attempt", None)
        return not (attempt is not None and attempt.reason)


logging.getLogger("urllib3.connection").addFilter(_QuietWhenCut())


def _attach_current(connection):
    attempt = getattr(_CURRENT, "attempt", None)
    if attempt is not None:
        attempt.attach(connection)


class _Watched:
    """urllib3 connection mixin: each connect and each request puts the connection under the
    calling thread's try (connect first: an HTTPS handshake runs before any request)."""

    def connect(self):
        _attach_current(self)
        super().connect()
        _attach_current(self)  # the socket exists now: shut at once when the try ended meanwhile

    def request(self, *args, **kwargs):
        _attach_current(self)
        return super().request(*args, **kwargs)


class _WatchedHTTPConnection(_Watched, urllib3.connection.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, urllib3.connection.HTTPSConnection):
    pass


class _WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


WATCHED_POOLS = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


class _WatchedAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter with connections a try's watchdog can shut (proxies included; SOCKS
    proxies keep their own connections and per-read timeouts)."""

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = WATCHED_POOLS

    def proxy_manager_for(self, proxy, **proxy_kwargs):
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if manager.pool_classes_by_scheme is urllib3.poolmanager.pool_classes_by_scheme:
            manager.pool_classes_by_scheme = WATCHED_POOLS
        return manager


class Endpoint:
    """One server URL with a timeout per try, a number of further tries, a cap on a reply's size
    and a session of its own."""

    def __init__(self, reward_name: str, url: str, timeout: float, retries: int,
                 max_reply_bytes: int = MAX_REPLY_BYTES, connections: int = 1):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward {reward_name!r} needs `url` (http://host:port), got {url!r}")
        if not (timeout > 0 and retries >= 0):
            raise ValueError(f"reward {reward_name!r}: need timeout > 0 and retries >= 0, got {timeout} and {retries}")
        self.name, self.url, self.timeout, self.retries = reward_name, url.rstrip("/"), float(timeout), int(retries)
        self.max_reply_bytes, self.connections = max_reply_bytes, connections
        self.session = requests.Session()
        for scheme in ("http://", "https://"):
            self.session.mount(scheme, _WatchedAdapter(pool_maxsize=connections))
        # the reply is read as sent: a compressed one could unpack past the size cap in one read
        self.session.headers["Accept-Encoding"] = "identity"

    def request(self, method: str, path: str = "", **kwargs) -> Reply:
        """The reply of the first try that succeeds; RemoteUnavailable / RemoteRefused naming the URL."""
        return self.request_each(method, path, [kwargs])[0]

    def request_each(self, method: str, path: str, calls):
        """One reply per call (keyword arguments of `requests.request`). A try sends every call
        not answered yet, `connections` at a time, all within `timeout`; the first call that fails
        ends the try (the others are cut), and the next try sends the unanswered ones again."""
        url, replies, last = self.url + path, [None] * len(calls), None
        for attempt_index in range(self.retries + 1):
            if attempt_index:
                time.sleep(min(BACKOFF_S * 2 ** (attempt_index - 1), MAX_BACKOFF_S))
            pending = [i for i, reply in enumerate(replies) if reply is None]
            with Attempt(self.timeout) as attempt:
                try:
                    self._send_all(attempt, method, url, calls, pending, replies)
                    return replies
                except TryFailed as e:
                    last = str(e)
        raise RemoteUnavailable(f"reward {self.name!r}: {url} failed {self.retries + 1} time(s), "
                                f"timeout {self.timeout:g} s; last: {last}")

    def _send_all(self, attempt, method, url, calls, pending, replies):
        if self.connections == 1 or len(pending) == 1:
            for i in pending:
                replies[i] = self._exchange(attempt, method, url, calls[i])
            return
        with concurrent.futures.ThreadPoolExecutor(min(self.connections, len(pending))) as pool:
            futures = {pool.submit(self._exchange, attempt, method, url, calls[i]): i for i in pending}
            try:
                for future in concurrent.futures.as_completed(futures):
                    replies[futures[future]] = future.result()
            except BaseException as e:
                attempt.end(f"cut: another request of the batch failed ({one_line(e)})")
                raise

    def _exchange(self, attempt, method, url, kwargs) -> Reply:
        """One request and its whole reply within `attempt`; TryFailed (retried), RemoteRefused (4xx)."""
        if attempt.reason or attempt.remaining() <= 0:
            raise TryFailed(attempt.reason or attempt.expired)
        _CURRENT.attempt, response = attempt, None
        try:
            left = attempt.remaining()  # per-operation socket timeouts; the watchdog bounds the sum
            # not following redirects: requests would read a redirect's body whole, past the size cap
            response = self.session.request(method, url, timeout=(left, left), stream=True, allow_redirects=False,
                                            **kwargs)
            body = self._read_body(response, attempt)
            if attempt.reason:  # cut: a reply without a length (or its headers) ends where the cut fell
                raise TryFailed(attempt.reason)
            reply = Reply(response.status_code, body, response.headers.get("Location", ""))
        except TRANSPORT_ERRORS as e:
            if attempt.remaining() <= 0:  # a socket timeout that ran out with the try
                raise TryFailed(attempt.reason or attempt.expired) from None
            raise TryFailed(attempt.reason or f"{type(e).__name__}: {one_line(e)}") from None
        finally:
            attempt.detach()  # before the connection goes back to the pool: the watchdog leaves it alone
            _CURRENT.attempt = None
            if response is not None:  # closes the connection: none is reused after the server may have dropped it
                response.close()
        return self._check_status(reply, url)

    def _read_body(self, response, attempt) -> bytes:
        """A reply's body within the try; a failure's or refusal's only as far as its first line needs."""
        scores = 200 <= response.status_code < 300
        cap = self.max_reply_bytes if scores else ERROR_TEXT_BYTES
        declared = response.headers.get("Content-Length", "")
        if scores and declared.isascii() and declared.isdigit() and int(declared) > cap:
            raise TryFailed(f"the reply would be {int(declared)} bytes, more than the {cap} this reward reads")
        body = bytearray()
        for chunk in response.raw.stream(READ_CHUNK_BYTES, decode_content=False):
            body += chunk
            if len(body) > cap:
                if not scores:
                    break
                raise TryFailed(f"the reply passed the {cap} bytes this reward reads")
            if attempt.remaining() <= 0:
                raise TryFailed(attempt.expired)
        return bytes(body[:cap])

    def _check_status(self, reply: Reply, url: str) -> Reply:
        if 400 <= reply.status_code < 500:
            raise RemoteRefused(f"reward {self.name!r}: {url} refused the request: HTTP {reply.status_code} "
                                f"{_error_text(reply)}")
        if 300 <= reply.status_code < 400:
            raise RemoteRedirected(f"reward {self.name!r}: {url} redirects (HTTP {reply.status_code}) to "
                                   f"{reply.location[:200] or 'nowhere'}: set `url` to the server itself")
        if reply.status_code >= 500:  # busy (503), a proxy in front restarting (502, 504), a failed scoring (500)
            raise TryFailed(f"HTTP {reply.status_code} {_error_text(reply)}")
        return reply

    def check_reachable(self, path: str = ""):
        """Before any rollout: a one-line ConnectionError naming the URL when the server does not
        answer; the reply to a GET of `path`, or None when the server refused it (it answered)."""
        try:
            return self.request("GET", path)
        except RemoteRedirected:
            raise
        except RemoteRefused:
            return None
        except RemoteUnavailable as e:
            raise ConnectionError(f"{e} (start the server first, or fix `url` in model.json's reward block)") from None


def _error_text(reply: Reply) -> str:
    try:
        body = reply.json()
    except ValueError:
        body = None
    text = reply.text
    if isinstance(body, dict) and "error" in body:
        text = body["error"] if isinstance(body["error"], str) else wire.brief(body["error"])
    lines = text.strip().splitlines()
    return lines[0][:ERROR_TEXT_CHARS] if lines else ""


class RemoteScored(Reward):
    """A reward whose `request(images, prompts)` asks the server at `cfg.url` (its `endpoint`): an
    unavailable server scores NaN. The images are encoded on the host."""

    max_reply_bytes = MAX_REPLY_BYTES
    connections = 1  # requests of a batch sent at once

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, "cpu")
        self.endpoint = Endpoint(self.name, cfg.url, cfg.timeout, cfg.retries, self.max_reply_bytes, self.connections)

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
        # the server's bearer token: it reads the same variable by default
        self.endpoint.session.headers.update(bearer_header(self.name, wire.TOKEN_ENV))
        health = self.endpoint.check_reachable(wire.HEALTH_PATH)
        if health is None:  # refused (a missing or wrong token: 401): asked again for its one-line reason
            self.endpoint.request("GET", wire.HEALTH_PATH)
        try:
            self.served = health.json()["rewards"]
        except (AttributeError, ValueError, KeyError, TypeError):
            raise ValueError(f"reward {self.name!r}: {self.endpoint.url}{wire.HEALTH_PATH} is not an mm-grpo reward "
                             "server's health (python -m mm_grpo.tools.reward_server)") from None

    def request(self, images, prompts):
        reply = self.endpoint.request("POST", wire.SCORE_PATH, json=wire.encode_request(images, prompts))
        try:
            return wire.decode_scores(reply.json(), len(prompts))
        except ValueError as e:
            raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url}: {e}") from None
