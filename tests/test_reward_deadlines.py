"""Remote rewards against servers that misbehave on the wire: each try has `timeout` seconds in
total (connect, send, the whole reply), every transport failure is retried and then scores the
batch NaN with one warning line (a skipped iteration), and a reply is read up to a size cap."""
import re
import time

import psutil
import pytest
import torch

from bench.bench_reward_server import shapes_batch
from mm_grpo.rewards import build_reward, wire
from mm_grpo.rewards.remote import MAX_REPLY_BYTES, Endpoint, RemoteRefused, RemoteUnavailable
from tests.hostile_http import health_then, json_reply, raw_server, reply_bytes

TRICKLE_S = 0.25  # the attack: one byte every quarter second keeps every socket read alive
BOUND_S = 3.0  # a `timeout: 1` try answers well within this, even on a loaded machine
HUGE_REPLY = 100 << 20
MiB = 1 << 20


def trickle(conn, data, stop):
    for byte in data:
        if stop.wait(TRICKLE_S):
            return
        conn.sendall(bytes([byte]))


def trickled_body(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    trickle(conn, b" " * 100000, server.stop)


def trickled_headers(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    trickle(conn, b"X-Slow: " + b"a" * 10000, server.stop)


def silent(server, conn):
    server.stop.wait(30)


def broken_mid_body(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"400\r\n{\"scores\": [")  # a chunk of 1024 bytes announced, 12 sent, then the connection closes


def unavailable(server, conn):
    conn.sendall(json_reply({"error": "queue full"}, "503 Service Unavailable"))


def _remote(url, **kw):
    return build_reward({"name": "remote", "url": url, **kw})


def _nan_line(url, tries, timeout, last):
    return (f"mm-grpo: warning: reward 'remote': {url}{wire.SCORE_PATH} failed {tries} time(s), timeout {timeout} s; "
            f"last: {last}: 2 images scored NaN (the iteration is skipped)")


@pytest.mark.parametrize("behaviour", [trickled_body, trickled_headers, silent], ids=lambda f: f.__name__)
def test_a_try_is_cut_at_its_timeout_however_the_server_stalls(behaviour, capsys, caplog):
    """Per socket read, each of these would wait for ever (11.2 s for a `timeout: 1` before)."""
    images, prompts = shapes_batch(2)
    with raw_server(health_then(behaviour)) as server:
        remote = _remote(server.url, timeout=1, retries=0)
        start = time.monotonic()
        scores = remote(images, prompts)
        elapsed = time.monotonic() - start
    assert torch.isnan(scores).all() and elapsed < BOUND_S
    assert capsys.readouterr().err.splitlines() == [_nan_line(server.url, 1, 1, "no whole reply within 1 s")]
    assert not [r for r in caplog.records if r.name.startswith("urllib3")]  # no traceback of headers cut off


@pytest.mark.parametrize("behaviour, last", [
    (broken_mid_body, r"ProtocolError: \('Connection broken: .*"),
    (unavailable, "HTTP 503 queue full")], ids=["broken_mid_body", "unavailable"])
def test_transport_failures_are_retried_then_skip_the_iteration_in_one_line(behaviour, last, capsys):
    images, prompts = shapes_batch(2)
    with raw_server(health_then(behaviour)) as server:
        remote = _remote(server.url, timeout=1, retries=2)
        start = time.monotonic()
        scores = remote(images, prompts)
        elapsed = time.monotonic() - start
        posts = server.count("POST", wire.SCORE_PATH)
    assert torch.isnan(scores).all() and posts == 3 and elapsed < BOUND_S + 1.5  # waits of 0.5 and 1 s
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(re.escape(_nan_line(server.url, 3, 1, "@")).replace("@", last), err[0])


def test_a_server_that_never_reads_a_large_request_is_cut_at_the_timeout():
    with raw_server(silent) as server:
        endpoint = Endpoint("remote", server.url, timeout=1, retries=0)
        start = time.monotonic()
        with pytest.raises(RemoteUnavailable) as failed:
            endpoint.request("POST", data=b"x" * (64 * MiB))  # far more than the socket buffers hold
        elapsed = time.monotonic() - start
    assert str(failed.value) == (f"reward 'remote': {server.url} failed 1 time(s), timeout 1 s; "
                                 "last: no whole reply within 1 s")
    assert elapsed < BOUND_S


def _huge_reply(declared):
    def answer(server, conn):
        length = f"Content-Length: {HUGE_REPLY}\r\n" if declared else ""
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
        block = b" " * MiB
        for _ in range(HUGE_REPLY // MiB):
            if server.stop.is_set():
                return
            conn.sendall(block)
    return answer


@pytest.mark.parametrize("declared, last", [
    (True, f"the reply would be {HUGE_REPLY} bytes, more than the {MAX_REPLY_BYTES} this reward reads"),
    (False, f"the reply passed the {MAX_REPLY_BYTES} bytes this reward reads")], ids=["declared", "streamed"])
def test_a_100_mb_reply_is_not_read_past_the_cap(declared, last, capsys):
    images, prompts = shapes_batch(2)
    process = psutil.Process()
    with raw_server(health_then(_huge_reply(declared))) as server:
        remote = _remote(server.url, timeout=5, retries=0)
        before = process.memory_info().rss
        scores = remote(images, prompts)
        grown = process.memory_info().rss - before
    assert torch.isnan(scores).all() and grown < 4 * MAX_REPLY_BYTES
    assert capsys.readouterr().err.splitlines() == [_nan_line(server.url, 1, 5, last)]


def test_a_reply_that_is_not_scores_stops_the_run_in_one_line():
    """Not transport: the server answered, with something trying again would not change."""
    images, prompts = shapes_batch(2)

    def nested(server, conn):
        conn.sendall(reply_bytes(b"[" * 100000))

    with raw_server(health_then(nested)) as server:
        with pytest.raises(RemoteRefused) as refused:
            _remote(server.url, timeout=1, retries=2)(images, prompts)
        assert server.count("POST") == 1
    assert str(refused.value) == f"reward 'remote': {server.url}: the reply nests too deeply to be JSON scores"


def test_a_redirect_is_not_followed_and_stops_the_launch_in_one_line():
    """requests would follow it, reading the redirect's body whole (past the size cap)."""
    def moved(server, conn):
        if server.read_request(conn):
            conn.sendall(reply_bytes(b"x" * (2 * MAX_REPLY_BYTES), "301 Moved Permanently", "text/html",
                                     "Location: https://elsewhere:8000/health\r\n"))

    with raw_server(moved) as server:
        with pytest.raises(ValueError) as redirected:
            _remote(server.url, timeout=5, retries=2)
        assert server.count("GET") == 1
    assert str(redirected.value) == (f"reward 'remote': {server.url}/health redirects (HTTP 301) to "
                                     "https://elsewhere:8000/health: set `url` to the server itself")
