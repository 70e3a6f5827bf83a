"""The reward server (`python -m mm_grpo.tools.reward_server`, in its own process) under hostile
clients: decompression bombs and floods of images get a one-line 413 before anything is
decoded (its resident memory measured), slow clients are cut at the read timeout, a flood of
connections gets 503 and then closed connections instead of running out of file descriptors,
clients that go away are one warning line each, and /health answers after every attack."""
import base64
import io
import json
import os
import resource
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
import requests
from PIL import Image

from bench.bench_reward_server import start_server
from mm_grpo.rewards import wire
from mm_grpo.tools.reward_server import OVERFLOW, SHAPE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARDS = os.path.join(REPO, "examples", "rewards", "rewards_shapes.json")
READ_TIMEOUT_S = 4  # the server's --read-timeout-s here: short, with room for a loaded machine
MAX_CONNECTIONS = 16
OPEN_FILES = 256  # the server's ulimit -n: the flood below would need far more without the cap
BOMB_RSS_BOUND = 64 * 2 ** 20  # two 4096 x 4096 images decoded are 96 MiB as 8-bit RGB, 384 MiB as float
PROMPT = "a red circle"


class ServerProcess:
    """The reward server as a user starts it, its stderr collected line by line."""

    def __init__(self, *flags, open_files=None, env=None):
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))) if open_files else None
        self.proc, self.url, self.lines = start_server(
            [sys.executable, "-m", "mm_grpo.tools.reward_server", "--rewards", REWARDS, "--port", "0", *flags],
            preexec_fn=limit, env=env)
        self.port = int(self.url.rsplit(":", 1)[1])

    def wait_healthy(self, within_s: float = 30):
        deadline = time.monotonic() + within_s
        while True:
            try:
                if requests.get(self.url + wire.HEALTH_PATH, timeout=2).status_code == 200:
                    return
            except requests.RequestException:  # slow on a loaded machine
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)[-2000:]
            time.sleep(0.2)

    def log_since(self, mark: int, settle_s: float = 0.5):
        time.sleep(settle_s)  # the server's last lines reach the reader
        return self.lines[mark:]

    def peak_rss_growth(self, call):
        """(call's result, the server's peak resident memory during it minus before)."""
        process, stop = psutil.Process(self.proc.pid), threading.Event()
        before = process.memory_info().rss
        peak = [before]

        def poll():
            while not stop.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.002)
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            result = call()
        finally:
            stop.set()
            poller.join()
        return result, peak[0] - before

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    """Started as on a 2-core machine: two torch threads, no OMP_WAIT_POLICY (the server restarts
    itself with PASSIVE: spinning OpenMP threads starved its event loop)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    started = ServerProcess("--read-timeout-s", str(READ_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                            open_files=OPEN_FILES, env={**env, "OMP_NUM_THREADS": "2"})
    assert "OMP_WAIT_POLICY=PASSIVE" in open(f"/proc/{started.proc.pid}/environ").read().split("\0")
    yield started
    started.close()
    assert "Traceback" not in "".join(started.lines), "".join(started.lines)[-3000:]


def _png(side: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((side, side, 3), np.uint8)).save(buffer, format="PNG")  # black: compresses to nothing
    return base64.b64encode(buffer.getvalue()).decode()


def _post(url, body: bytes):
    return requests.post(url + wire.SCORE_PATH, data=body, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("side, copies, message", [
    (4096, 2, "the request's 2 images of 4096x4096 are 32 Mpx decoded, more than --max-request-mpx 16"),
    (64, 20_000, "the request has more than 256 images or prompts: --max-images-per-request 256"),
])
def test_a_decompression_bomb_is_one_line_413_before_decoding_and_memory_stays_flat(server, side, copies, message):
    """Two black 4096 x 4096 PNGs (130 kB), or 20,000 copies of a 64 x 64 one, in one POST /score
    with the server's default budget: it took the server from 0.8 to 5.4 GB, or 13.2 GB."""
    assert _post(server.url, json.dumps({"images": [_png(64)] * 2, "prompts": [PROMPT] * 2}).encode()).ok  # warm
    body = json.dumps({"images": [_png(side)] * copies, "prompts": [PROMPT] * copies}).encode()
    response, growth = server.peak_rss_growth(lambda: _post(server.url, body))
    assert response.status_code == 413 and response.json() == {"error": message}
    assert growth < BOMB_RSS_BOUND, f"the server grew by {growth / 2 ** 20:.0f} MiB"
    server.wait_healthy(within_s=5)


def test_json_nested_100000_deep_is_a_one_line_400(server):
    response = _post(server.url, b"[" * 100_000)
    assert response.status_code == 400
    assert response.json() == {"error": SHAPE}
    server.wait_healthy(within_s=5)


def _connect(port: int, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(first_bytes)
    return sock


def test_a_client_gone_mid_body_or_before_its_scores_is_one_warning_line(server):
    mark = len(server.lines)
    mid_body = _connect(server.port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 100000\r\n\r\n{\"images\": [")
    time.sleep(0.3)
    mid_body.close()
    body = json.dumps({"images": [_png(1024)] * 4, "prompts": [PROMPT] * 4}).encode()  # scored for a while
    early = _connect(server.port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.3)
    early.close()
    deadline = time.monotonic() + 60
    while sum("scores were sent" in line for line in server.lines[mark:]) < 1:
        assert time.monotonic() < deadline, server.lines[mark:]
        time.sleep(0.2)
    log = server.log_since(mark)
    assert len(log) == 2, log
    assert "closed the connection before its request was read" in log[0]
    assert "closed the connection before its 4 scores were sent" in log[1]
    assert all(line.startswith("python -m mm_grpo.tools.reward_server: warning: 127.0.0.1:") for line in log)
    server.wait_healthy(within_s=5)


HEADER_START = b"GET /health HTTP/1.1\r\nX-Slow: "  # then one header byte a tick
BODY_START = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
              b'{"images": ["')  # then one body byte a tick


class Tricklers:
    """Connections that send one more byte every `interval_s` and never finish a request."""

    def __init__(self, port: int, interval_s: float = 0.25):
        self.port, self.interval_s, self.open, self.closed_at, self.begun = port, interval_s, [], {}, set()
        self.first_bytes = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, count: int, first_bytes: bytes = HEADER_START):
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)  # the server's accept queue may be full: no wait here
            sock.connect_ex(("127.0.0.1", self.port))
            self.first_bytes[sock] = first_bytes
            self.open.append((sock, time.monotonic()))

    def _run(self):
        while not self._stop.wait(self.interval_s):
            for sock, opened in list(self.open):
                if sock in self.closed_at:
                    continue
                try:
                    if sock.recv(1, socket.MSG_DONTWAIT) == b"":  # the server closed it
                        self.closed_at[sock] = time.monotonic() - opened
                        continue
                except BlockingIOError:
                    pass
                except OSError:  # reset: closed as it was accepted
                    self.closed_at[sock] = time.monotonic() - opened
                    continue
                try:
                    sock.send(b"a" if sock in self.begun else self.first_bytes[sock])
                    self.begun.add(sock)
                except BlockingIOError:  # not connected yet
                    pass
                except OSError:
                    self.closed_at[sock] = time.monotonic() - opened

    def all_closed(self):
        return len(self.closed_at) == len(self.open)

    def stop(self):
        self._stop.set()
        self._thread.join()
        for sock, _ in self.open:
            sock.close()


def test_slow_clients_are_cut_at_the_read_timeout_and_a_flood_of_them_gets_503_not_out_of_files(server):
    """Connections sending one header or body byte every 0.25 s: below --max-connections /health
    keeps answering; beyond it a request gets 503 at once; beyond twice as many, new connections
    are closed as they come (100 of them under ulimit -n 256: no 'Too many open files'); every one
    is closed within the read timeout with one line, and /health answers again."""
    mark, process = len(server.lines), psutil.Process(server.proc.pid)
    tricklers = Tricklers(server.port)
    try:
        tricklers.add(MAX_CONNECTIONS // 2)
        tricklers.add(MAX_CONNECTIONS // 2 - 4, BODY_START)
        time.sleep(0.5)
        assert requests.get(server.url + wire.HEALTH_PATH, timeout=5).status_code == 200
        tricklers.add(10)  # now beyond --max-connections
        time.sleep(0.5)
        start = time.monotonic()
        assert requests.get(server.url + wire.HEALTH_PATH, timeout=5).status_code == 503
        assert time.monotonic() - start < 2
        tricklers.add(100 - len(tricklers.open))  # beyond 2 x --max-connections
        most_files, deadline = 0, time.monotonic() + READ_TIMEOUT_S + 30
        while not tricklers.all_closed():
            most_files = max(most_files, process.num_fds())
            assert time.monotonic() < deadline, f"{len(tricklers.closed_at)} of {len(tricklers.open)} closed"
            time.sleep(0.1)
        assert max(tricklers.closed_at.values()) < READ_TIMEOUT_S + 20
    finally:
        tricklers.stop()
    server.wait_healthy(within_s=5)
    log = server.log_since(mark)
    timed_out = [line for line in log if f"no whole request within --read-timeout-s {READ_TIMEOUT_S}" in line]
    assert MAX_CONNECTIONS + 6 <= len(timed_out) <= len(tricklers.open)  # the 22 held at least, each once
    flood = [line for line in log if f"{OVERFLOW} x --max-connections {MAX_CONNECTIONS}: new ones are closed" in line]
    assert 1 <= len(flood) <= 3  # one line every 10 s at most, not one per connection
    assert most_files < OPEN_FILES and not any("open files" in line for line in log)
    assert not [line for line in log if line not in timed_out + flood and "Exceeded concurrency limit" not in line], log


def _status_and_body(sock: socket.socket, within_s: float = 30) -> tuple:
    """(status code, body) of the one response on `sock`, read until the server closes it."""
    sock.settimeout(within_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_a_pipelined_request_has_its_own_read_deadline(server):
    """Six connections each sending a whole GET /health pipelined with the start of a POST /score,
    then nothing (before: never cut, 6 of 6 open at 60 s with --read-timeout-s 3; --max-connections
    of them held /health at 503): each gets its /health answer, then is closed at the deadline of
    the request it left unfinished, with one line."""
    mark = len(server.lines)
    pipelined = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + BODY_START)
    connections = [_connect(server.port, pipelined) for _ in range(6)]
    start = time.monotonic()
    try:
        for sock in connections:
            sock.settimeout(READ_TIMEOUT_S + 30)
            received = b""
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                received += chunk
            assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1") == 1, received[:200]
        assert time.monotonic() - start < READ_TIMEOUT_S + 20
    finally:
        for sock in connections:
            sock.close()
    log = server.log_since(mark)
    assert len([line for line in log if f"no whole request within --read-timeout-s {READ_TIMEOUT_S}" in line]) == 6, log
    server.wait_healthy(within_s=5)


def _send_chunked(sock: socket.socket, total: int, sent: list):
    """Sends `total` bytes of chunked body, 1 MiB a chunk, until the server closes the connection;
    `sent` gets the body bytes sent."""
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
    count = 0
    try:
        while count < total:
            sock.sendall(chunk)
            count += 1 << 20
    except OSError:  # the server closed it: what a refusal does
        pass
    sent.append(count)


@pytest.mark.parametrize("headers, status, message", [
    (b"Content-Length: 100\r\nTransfer-Encoding: chunked\r\n", 400,
     "the request has both Content-Length and Transfer-Encoding: send one"),
    (b"Transfer-Encoding: chunked\r\n", 413, "the body has more than 67108864 bytes, more than --max-request-mb 64"),
])
def test_the_body_cap_is_counted_on_the_bytes_read_whatever_the_framing(server, headers, status, message):
    """`Content-Length: 100` with `Transfer-Encoding: chunked` and a 300 MiB body (before: read
    whole, 823 -> 1,691 MiB), or a chunked body past the cap: refused, the connection closed
    before the body's end, and the server's memory grows by less than the cap."""
    sock = _connect(server.port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 + headers + b"\r\n")
    sent = []
    sender = threading.Thread(target=_send_chunked, args=(sock, 300 << 20, sent))
    try:
        (code, body), growth = server.peak_rss_growth(lambda: (sender.start(), _status_and_body(sock))[1])
        sender.join(30)
    finally:
        sock.close()
    assert code == status and json.loads(body) == {"error": message}
    assert sent[0] < 200 << 20 and growth < 64 * 2 ** 20 + BOMB_RSS_BOUND, (sent, growth / 2 ** 20)
    server.wait_healthy(within_s=5)


def test_bodies_of_empty_lists_under_the_cap_are_refused_before_any_list_is_built(server):
    """Three concurrent 63 MiB bodies of `{"prompts": [[], [], ...]}` (before: the server went from 768
    to 4,003 MiB and stayed at 3,950; json.loads makes a 56-byte list of every 3-byte `[],`): each a
    one-line 400 from a scan of its tokens that stops at the first list inside a list."""
    body = b'{"prompts": [' + b"[], " * (63 * 2 ** 20 // 4) + b'[]], "images": []}'

    def three():
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda _: _post(server.url, body), range(3)))
    responses, growth = server.peak_rss_growth(three)
    assert [r.status_code for r in responses] == [400] * 3 and all(r.json() == {"error": SHAPE} for r in responses)
    assert growth < 3 * 2 * len(body), f"the server grew by {growth / 2 ** 20:.0f} MiB"  # the bodies, held as read
    server.wait_healthy(within_s=5)
