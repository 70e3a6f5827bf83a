"""mm-grpo's reward server and the `remote` reward: the same scores as in process, batching and
splitting, the bounded queue, body size and image budget, one-line refusals, the bearer token,
the port checked before serving, and a server that is down or dies. Hostile clients against the
server in its own process: tests/test_reward_server_limits.py."""
import base64
import concurrent.futures
import contextlib
import errno
import json
import math
import os
import socket
import threading
import time

import pytest
import requests
import torch

from bench.bench_reward_server import shapes_batch, start_server
from mm_grpo.rewards import CombinedReward, build_reward, wire
from mm_grpo.rewards.remote import RemoteRefused
from mm_grpo.tools.reward_server import (PROG, BatchScorer, HeldPixels, ServerSettings, create_app, free_socket, main,
                                         serve_app, served_url, serving_line, unprotected_warning)
from tests.fixtures import parallel_1proc  # noqa: F401

CONFIGS = [{"name": "compositional"}, {"name": "jpeg_compressibility", "weight": 0.5}]
TOKEN = "s3cret-token"


def _png(side: int) -> str:
    return base64.b64encode(wire.encode_image(torch.zeros(side, side, 3, dtype=torch.uint8).numpy())).decode()


PNG_8, PNG_16 = _png(8), _png(16)


@contextlib.contextmanager
def reward_server(configs, token=None, **settings):
    """mm-grpo's reward server for `configs` on localhost, in a thread: (url, the reward it serves)."""
    reward = CombinedReward.from_configs(configs)
    settings = ServerSettings(rewards="-", **settings)
    with serve_app(create_app(reward, settings, token), settings=settings) as url:
        yield url, reward


def _remote(url, **kw):
    return build_reward({"name": "remote", "url": url, **kw})


def test_remote_scores_equal_the_in_process_reward():
    images, prompts = shapes_batch(12)
    with reward_server(CONFIGS, max_batch=5) as (url, served):
        remote = _remote(url)
        assert remote.served == {"compositional": 1.0, "jpeg_compressibility": 0.5}
        got = remote(images, prompts)
        in_process, terms = CombinedReward.from_configs(CONFIGS)(images, prompts)
    assert torch.equal(got, in_process)
    assert len(set(terms["compositional"].tolist())) >= 3  # the scores spread


def test_concurrent_requests_are_batched_and_each_gets_its_own_scores():
    images, prompts = shapes_batch(16, seed=1)
    expected, _ = CombinedReward.from_configs(CONFIGS)(images, prompts)
    with reward_server(CONFIGS, max_batch=8, batch_wait_ms=200) as (url, _):
        def ask(i):
            rows = slice(2 * i, 2 * i + 2)
            response = requests.post(url + wire.SCORE_PATH, json=wire.encode_request(images[rows], prompts[rows]))
            return rows, wire.decode_scores(response.json(), 2)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for rows, scores in pool.map(ask, range(8)):
                assert torch.equal(scores, expected[rows])
        assert requests.get(url + wire.HEALTH_PATH).json()["scored_images"] == 16


class _Slow:
    """A reward that blocks until released: fills the queue."""
    def __init__(self):
        self.release, self.weights = threading.Event(), {"slow": 1.0}

    def check_prompts(self, prompts):
        pass

    def __call__(self, images, prompts):
        self.release.wait(30)
        return torch.zeros(len(prompts)), {"slow": torch.zeros(len(prompts))}


def test_a_full_queue_is_refused_and_the_scorer_thread_stops_with_the_server():
    slow = _Slow()
    scorer = BatchScorer(slow, max_batch=1, max_queue=2, batch_wait_s=0)
    one = torch.zeros(1, 3, 8, 8)
    first = scorer.submit(one, ["a"])  # taken by the scorer thread, which blocks
    time.sleep(0.2)
    scorer.submit(one, ["b"])
    scorer.submit(one, ["c"])
    with pytest.raises(Exception) as full:
        scorer.submit(one, ["d"])
    assert type(full.value).__name__ == "Full"
    slow.release.set()
    assert first.result(10)[0].tolist() == [0.0]
    scorer.close()
    assert not scorer._thread.is_alive()


@pytest.mark.parametrize("body, status, message", [
    (b"not json", 400, "the body is not JSON"),
    (json.dumps({"images": []}).encode(), 400, 'keys "images" and "prompts"'),
    (json.dumps({"images": ["eA=="], "prompts": ["a red circle"]}).encode(), 400, "image 0 does not decode"),
    (json.dumps({"images": ["***"], "prompts": ["a red circle"]}).encode(), 400, "image 0 is not valid base64"),
    (json.dumps({"images": [], "prompts": []}).encode(), 400, "at least one image"),
    (b"x" * 200_000, 413, "the body has 200000 bytes, more than --max-request-mb 0.143051"),
    (json.dumps({"images": [PNG_8] * 3, "prompts": ["a"] * 3}).encode(), 413,
     "the request has more than 2 images or prompts: --max-images-per-request 2"),
    (json.dumps({"images": [PNG_16] * 2, "prompts": ["a"] * 2}).encode(), 413,
     "the request's 2 images of 16x16 are 0.000488281 Mpx decoded, more than --max-request-mpx 0.000305176"),
    (b'{"prompts": [' + b"9" * 5000 + b'], "images": []}', 400, "the body is not JSON of the form"),  # was a 500
    (b'{"prompts": [[], [], []], "images": []}', 400, "the body is not JSON of the form"),
    (b'{"prompts": ["a"], "images": ["b"], "more": ["c"]}', 400, "the body is not JSON of the form"),
    (b"[" * 100_000, 400, 'the body is not JSON of the form {"prompts": [strings], "images": [base64 strings]}'),
])
def test_malformed_or_oversized_requests_get_a_one_line_error(body, status, message):
    limits = {"max_request_mb": 150_000 / 2 ** 20, "max_images_per_request": 2, "max_request_mpx": 320 / wire.MPX}
    with reward_server(CONFIGS, **limits) as (url, _):
        response = requests.post(url + wire.SCORE_PATH, data=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error and "\n" not in error


def test_a_prompt_the_reward_cannot_score_is_refused_and_stops_the_run_in_one_line():
    images, _ = shapes_batch(2)
    with reward_server(CONFIGS) as (url, _):
        remote = _remote(url)
        with pytest.raises(RemoteRefused, match=r"refused the request: HTTP 400 .*a photo of a cat") as e:
            remote(images, ["a photo of a cat", "a red circle"])
    assert "\n" not in str(e.value)


def test_mixed_image_sizes_in_one_request_are_refused_before_decoding():
    with pytest.raises(wire.BadRequest, match=r"one size, got \[\(8, 8\), \(16, 16\)\]"):
        wire.parse_request({"images": [PNG_8, PNG_16], "prompts": ["a", "b"]})
    images = wire.decode_images(wire.parse_request({"images": [PNG_8, PNG_8], "prompts": ["a", "b"]}))
    assert images.dtype == torch.uint8 and images.shape == (2, 3, 8, 8)  # floats are made a batch at a time


class _Recording:
    """A reward that records the size and dtype of each batch it scores: the mean pixel."""
    def __init__(self):
        self.batches, self.weights = [], {"mean": 1.0}

    def __call__(self, images, prompts):
        self.batches.append((len(prompts), images.dtype))
        values = images.mean((1, 2, 3))
        return values, {"mean": values}


@pytest.mark.parametrize("max_batch, max_batch_pixels, sizes", [(4, None, [4, 4, 2]), (64, 3 * 8 * 8, [3, 3, 3, 1])])
def test_a_request_larger_than_a_batch_is_scored_in_pieces_each_made_float_alone(max_batch, max_batch_pixels, sizes):
    images = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    recording = _Recording()
    scorer = BatchScorer(recording, max_batch, max_queue=4, batch_wait_s=0, max_batch_pixels=max_batch_pixels)
    total, terms = scorer.submit(images, list("abcdefghij")).result(10)
    scorer.close()
    assert recording.batches == [(n, torch.float32) for n in sizes]
    assert torch.equal(total, images.float().div(255).mean((1, 2, 3))) and torch.equal(terms["mean"], total)


def test_a_request_whose_client_went_away_before_scoring_is_dropped_and_the_scorer_goes_on():
    slow, one = _Slow(), torch.zeros(1, 3, 8, 8)
    scorer = BatchScorer(slow, max_batch=1, max_queue=4, batch_wait_s=0)
    scorer.submit(one, ["a"])  # taken by the scorer thread, which blocks
    time.sleep(0.2)
    gone = scorer.submit(one, ["b"])
    assert gone.cancel()  # what asyncio does to it when the request's task is cancelled
    after = scorer.submit(one, ["c"])
    slow.release.set()
    assert after.result(10)[0].tolist() == [0.0] and gone.cancelled()
    scorer.close()


def test_decoded_pixels_held_over_all_requests_wait_for_room():
    held, order = HeldPixels(limit=100), []

    def request(name, pixels, hold_s):
        held.take(pixels)
        order.append(f"{name} in")
        time.sleep(hold_s)
        order.append(f"{name} out")
        held.give_back(pixels)
    a = threading.Thread(target=request, args=("a", 60, 1.0))
    a.start()
    time.sleep(0.1)
    waiting = [threading.Thread(target=request, args=args) for args in (("b", 60, 0), ("c", 40, 0))]
    for thread in waiting:
        thread.start()
    for thread in (a, *waiting):
        thread.join(10)
    assert order.index("c in") < order.index("a out") < order.index("b in") and held.held == 0  # c fits beside a


def test_a_server_with_a_token_refuses_requests_without_it_in_one_line_before_any_rollout(monkeypatch):
    images, prompts = shapes_batch(2)
    body = wire.encode_request(images, prompts)
    missing = ("this server needs a token: Authorization: Bearer <the server's $MM_GRPO_REWARD_TOKEN> "
               "(the `remote` reward sends $MM_GRPO_REWARD_TOKEN)")
    with reward_server(CONFIGS, token=TOKEN) as (url, served):
        wrong = {"Authorization": "Bearer " + TOKEN[:-1] + "X"}  # as long as the token: only the content differs
        for headers, message in [({}, missing), (wrong, "the bearer token is wrong")]:
            for response in (requests.get(url + wire.HEALTH_PATH, headers=headers),
                             requests.post(url + wire.SCORE_PATH, json=body, headers=headers)):
                assert response.status_code == 401 and response.json() == {"error": message}
        monkeypatch.delenv(wire.TOKEN_ENV, raising=False)
        with pytest.raises(RemoteRefused) as refused:
            _remote(url)
        assert str(refused.value) == f"reward 'remote': {url}/health refused the request: HTTP 401 {missing}"
        monkeypatch.setenv(wire.TOKEN_ENV, TOKEN)
        assert torch.equal(_remote(url)(images, prompts), served(images, prompts)[0])


def test_listening_beyond_localhost_without_a_token_is_one_warning_line():
    assert unprotected_warning("0.0.0.0", None, wire.TOKEN_ENV) == (
        "listening on 0.0.0.0 without a token: anyone who reaches this port can use the server "
        "(set $MM_GRPO_REWARD_TOKEN)")
    assert unprotected_warning("0.0.0.0", TOKEN, wire.TOKEN_ENV) is None
    assert all(unprotected_warning(host, None, wire.TOKEN_ENV) is None for host in ("127.0.0.1", "localhost", "::1"))


def test_the_serving_line_names_the_url_a_launcher_reads():
    line = serving_line({"compositional_accuracy": 1.0}, "0.0.0.0", 41234)
    assert served_url(line + "\n") == "http://0.0.0.0:41234"
    assert served_url(f"{PROG}: error: cannot listen on 127.0.0.1:8000") is None
    assert served_url("INFO: serving on http://127.0.0.1:1") is None  # another program's line


def test_a_port_in_use_is_one_line_and_nothing_says_serving(tmp_path, capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    path = tmp_path / "rewards.json"
    path.write_text(json.dumps(CONFIGS))
    with pytest.raises(SystemExit) as exit_:
        main(["--rewards", str(path), "--port", str(port)])
    busy.close()
    in_use = f"[Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"{PROG}: error: cannot listen on 127.0.0.1:{port}: {in_use}\n"


def test_an_unreachable_server_is_one_line_naming_the_url_before_any_rollout():
    sock = free_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"reward 'remote': {url}/health failed 2 time") as e:
        _remote(url, retries=1, timeout=2)
    sock.close()
    assert "\n" not in str(e.value) and time.monotonic() - start < 10
    with pytest.raises(ValueError, match="needs `url`"):
        build_reward({"name": "remote"})


def test_a_server_that_dies_scores_nan_after_its_retries_without_hanging(capsys):
    """The iteration is then skipped (non-finite rewards): tests/test_run_guard.py counts those."""
    images, prompts = shapes_batch(4)
    with reward_server(CONFIGS) as (url, _):
        remote = _remote(url, retries=1, timeout=2)
        assert torch.isfinite(remote(images, prompts)).all()
    start = time.monotonic()
    scores = remote(images, prompts)  # the server is gone
    assert torch.isnan(scores).all() and time.monotonic() - start < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mm-grpo: warning: reward 'remote'") and "scored NaN" in err[0]


def test_a_server_that_hangs_is_cut_at_the_timeout():
    from fastapi import FastAPI
    app = FastAPI()
    stop = threading.Event()

    @app.get(wire.HEALTH_PATH)
    def health():
        return {"status": "ok", "rewards": {}}

    @app.post(wire.SCORE_PATH)
    def hang():
        stop.wait(20)
        return {}

    images, prompts = shapes_batch(2)
    with serve_app(app) as url:
        remote = _remote(url, retries=0, timeout=0.5)
        start = time.monotonic()
        assert torch.isnan(remote(images, prompts)).all()
        assert time.monotonic() - start < 5
        stop.set()


def test_non_finite_scores_travel_as_null():
    body = wire.encode_response(torch.tensor([1.0, math.nan, math.inf]), {})
    assert body["scores"] == [1.0, None, None]
    assert wire.decode_scores(json.loads(json.dumps(body)), 3)[1:].isnan().all()
    with pytest.raises(ValueError, match="no list of 2 scores"):
        wire.decode_scores(body, 2)


def test_the_shipped_launch_script_serves_the_shapes_rewards(tmp_path):
    """examples/rewards/reward_server.sh as shipped (the port and the Python through its variables;
    PORT=0: the server picks a free port and its `serving` line names it)."""
    import signal
    import sys
    env = dict(os.environ, PORT="0", HOST="127.0.0.1", MM_GRPO_DEVICE="cpu", MM_GRPO_PYTHON=sys.executable)
    proc, url, lines = start_server(["bash", "examples/rewards/reward_server.sh"], env=env)
    try:
        served = requests.get(url + wire.HEALTH_PATH, timeout=30).json()["rewards"]
        assert served == {"compositional_accuracy": 1.0, "compositional": 0.0}
        images, prompts = shapes_batch(6)
        expected, _ = CombinedReward.from_configs([{"name": "compositional_accuracy"}])(images, prompts)
        assert torch.equal(_remote(url)(images, prompts), expected)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    err = "".join(lines)
    assert proc.returncode in (0, -signal.SIGTERM), err  # uvicorn shuts down, then re-raises the signal
    assert "Traceback" not in err and serving_line(served, "127.0.0.1", int(url.rsplit(":", 1)[1])) in err


@pytest.mark.parametrize("case, message", [
    ("missing", "--rewards"), ("unknown", "unknown reward 'nope'"), ("no list", "expected a non-empty list"),
    ("port", "--port must be >= 0, got -1"), ("token", "--token-env MY_REWARD_TOKEN: $MY_REWARD_TOKEN is not set"),
    ("budget", "--max-held-mpx 8 must be >= --max-request-mpx 16"),
    # before: port 70000 served on 4464 (mod 2^16), nan a traceback after the models loaded, or every connection cut
    ("port 70000", "--port must be < 65536, got 70000"), ("mb nan", "--max-request-mb must be > 0, got nan"),
    ("timeout nan", "--read-timeout-s must be > 0, got nan"),
    ("timeout inf", "--read-timeout-s must be a finite number, got inf"),
    ("token newline", "$MM_GRPO_REWARD_TOKEN holds '\\n' at character 7 of 7: a bearer token is visible ASCII only")])
def test_server_bad_input_is_one_line_before_anything_listens(tmp_path, capsys, monkeypatch, case, message):
    path = tmp_path / "rewards.json"
    if case != "missing":
        path.write_text(json.dumps({"unknown": [{"name": "nope"}], "no list": {"reward": []}}.get(case, CONFIGS)))
    sock = free_socket()  # a free port
    port = sock.getsockname()[1]
    sock.close()
    monkeypatch.delenv("MY_REWARD_TOKEN", raising=False)
    if case == "token newline":  # a token read with its file's newline
        monkeypatch.setenv(wire.TOKEN_ENV, "secret\n")
    flags = {"port": ["--port", "-1"], "token": ["--token-env", "MY_REWARD_TOKEN"], "budget": ["--max-held-mpx", "8"],
             "port 70000": ["--port", "70000"], "mb nan": ["--max-request-mb", "nan"],
             "timeout nan": ["--read-timeout-s", "nan"], "timeout inf": ["--read-timeout-s", "inf"]}
    with pytest.raises(SystemExit) as exit_:
        main(["--rewards", str(path), "--port", str(port), *flags.get(case, [])])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_the_benchmarks_run_at_a_small_size(parallel_1proc, capsys):
    """bench/bench_reward_server.py (a server process, concurrent clients) and
    bench/bench_reward_overlap.py (overlapped scoring in the GRPO schedule) as shipped, small."""
    from bench import bench_reward_overlap, bench_reward_server
    bench_reward_server.main(["--clients", "2", "--requests", "2", "--images", "2"])
    out = capsys.readouterr().out
    assert "responses: 4 of 4, 0 with other scores than in process; server scored 8 images of 8 sent" in out
    bench_reward_overlap.main(["--iters", "1", "--delay-ms-per-image", "1"])
    assert "overlapped / reference = " in capsys.readouterr().out


class _HangsAfter:
    """jpeg_compressibility that stops answering in time after `answered` batches."""
    def __init__(self, answered):
        self.reward = CombinedReward.from_configs([{"name": "jpeg_compressibility"}])
        self.weights, self.answered, self.release = self.reward.weights, answered, threading.Event()

    def check_prompts(self, prompts):
        pass

    def __call__(self, images, prompts):
        if self.answered == 0:
            self.release.wait(30)
        self.answered -= 1
        return self.reward(images, prompts)


def test_a_server_that_stops_answering_mid_run_skips_then_stops_the_run_in_one_line(
        parallel_1proc, tiny_pipeline_dir, tmp_path, capsys):
    """Through mm-grpo's trainer: the first iteration is scored and saved, the next one's scores
    time out (no retry): NaN, a skipped iteration, and --max-skipped-iterations 1 stops the run
    with nothing saved after the last completed iteration."""
    from mm_grpo.training.run_guard import TrainingStopped
    from tests.grpo_helpers import grpo_argv, run_grpo, write_configs
    served = _HangsAfter(answered=1)
    with serve_app(create_app(served, ServerSettings(rewards="-"))) as url:
        configs = write_configs(tmp_path / "cfg", tiny_pipeline_dir,
                                reward=[{"name": "remote", "url": url, "timeout": 1, "retries": 0}])
        start = time.monotonic()
        with pytest.raises(TrainingStopped) as stopped:
            run_grpo(grpo_argv(*configs, iters=3, extra=["--max-skipped-iterations", "1", "--save",
                                                          str(tmp_path / "ckpt"), "--save-interval", "1"]))
        served.release.set()
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("1 iterations in a row skipped (up to iteration 2: ")
    assert "nothing saved since the last completed iteration" in message and time.monotonic() - start < 120
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mm-grpo: warning: reward")]
    assert len(warning) == 1 and f"{url}/score failed 1 time(s), timeout 1 s" in warning[0]


# --- the scheduler under any interleaving ----------------------------------------------------
class _Means:
    """A reward scoring each image by its mean pixel, recording every batch and checking it keeps
    the scorer's limits; fails the batches `fail_every` names (every k-th)."""
    def __init__(self, max_batch, max_batch_pixels, fail_every=0):
        self.max_batch, self.max_batch_pixels, self.fail_every = max_batch, max_batch_pixels, fail_every
        self.batches, self.broken, self.weights = 0, [], {"mean": 1.0}

    def __call__(self, images, prompts):
        self.batches += 1
        pixels = images.shape[0] * images.shape[2] * images.shape[3]
        if len(prompts) > self.max_batch or (self.max_batch_pixels and len(prompts) > 1
                                             and pixels > self.max_batch_pixels):
            self.broken.append((len(prompts), tuple(images.shape)))
        if self.fail_every and self.batches % self.fail_every == 0:
            raise RuntimeError("the reward failed on purpose")
        values = images.mean((1, 2, 3))
        return values, {"mean": values}


def _job_images(rng, side):
    return torch.randint(0, 256, (int(rng.integers(1, 13)), 3, side, side), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))


@pytest.mark.parametrize("seed", range(24))
def test_every_request_is_answered_under_any_interleaving(seed):
    """Requests of mixed sizes and image shapes from 4 threads at random moments, some cancelled
    as a client that went away cancels them, batch limits by count and by pixels, a reward that
    sometimes fails: every request ends answered with its own scores, failed with the reward's
    error, or cancelled, and no batch breaks a limit (the scheduler set a joined request running
    twice and its thread died, leaving every later request waiting for ever)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    max_batch = int(rng.integers(1, 17))
    max_batch_pixels = None if seed % 3 == 0 else int(rng.integers(1, 17)) * 16 * 16
    reward = _Means(max_batch, max_batch_pixels, fail_every=int(rng.integers(0, 6)))
    scorer = BatchScorer(reward, max_batch, max_queue=64, batch_wait_s=float(rng.uniform(0, 0.02)),
                         max_batch_pixels=max_batch_pixels)
    sent, lock = [], threading.Lock()

    def client(client_seed):
        crng = np.random.default_rng([seed, client_seed])
        for _ in range(6):
            images = _job_images(crng, side=int(crng.choice([8, 16])))
            future = scorer.submit(images, ["p"] * len(images))
            cancelled = crng.random() < 0.2 and future.cancel()
            with lock:
                sent.append((images, future, cancelled))
            time.sleep(float(crng.uniform(0, 0.004)))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for images, future, cancelled in sent:
        if cancelled:
            assert future.cancelled()
            continue
        error = future.exception(timeout=10)  # TimeoutError here: a request nobody answers
        if error is None:
            total, terms = future.result()
            assert torch.equal(total, images.float().div(255).mean((1, 2, 3))) and torch.equal(terms["mean"], total)
        else:
            assert str(error) == "the reward failed on purpose"
    scorer.close(wait_s=10)
    assert not scorer._thread.is_alive() and scorer.failure is None
    assert reward.broken == []


def test_a_request_joining_a_batch_its_predecessor_filled_to_the_pixel_budget_is_answered():
    """The issue's reproduction through the HTTP server: with --batch-wait-ms 3000, a request of
    16 images filling --max-request-mpx, then, while the batch waits, one of a single image, and 10
    more: each answered with its own scores (before: the first was answered, the scorer thread died
    with 'Future in unexpected state', the others waited for ever)."""
    images, prompts = shapes_batch(16, seed=3)
    expected, _ = CombinedReward.from_configs(CONFIGS)(images, prompts)
    budget = {"max_request_mpx": 16 * 64 * 64 / wire.MPX, "max_held_mpx": 4 * 16 * 64 * 64 / wire.MPX}
    with reward_server(CONFIGS, batch_wait_ms=3000, **budget) as (url, _):
        def ask(rows, delay_s):
            time.sleep(delay_s)
            body = wire.encode_request(images[rows], prompts[rows])
            response = requests.post(url + wire.SCORE_PATH, json=body, timeout=60)
            return rows, wire.decode_scores(response.json(), rows.stop - rows.start)
        asks = [(slice(0, 16), 0.0), (slice(3, 4), 1.0)] + [(slice(i, i + 1), 1.5) for i in range(10)]
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            for rows, scores in pool.map(lambda a: ask(*a), asks):
                assert torch.equal(scores, expected[rows])
        assert requests.get(url + wire.HEALTH_PATH).json()["scored_images"] == 16 + 1 + 10


def test_a_dead_scorer_fails_every_waiting_request_and_health_and_calls_on_failure(monkeypatch):
    """A fault of the scheduler itself (here: its room count raises) ends its thread: the request
    in it and the queued ones get 503 at once, /health fails from then on, and the server's
    on_failure hook runs (`main` then exits 3) instead of every request waiting for ever."""
    from mm_grpo.tools import reward_server
    failures = []
    monkeypatch.setattr(reward_server, "WATCH_INTERVAL_S", 0.1)
    monkeypatch.setattr(BatchScorer, "_room", lambda self, batch, job: 1 // 0)
    reward = CombinedReward.from_configs(CONFIGS)
    settings = ServerSettings(rewards="-")
    images, prompts = shapes_batch(2)
    with serve_app(create_app(reward, settings, on_failure=failures.append), settings=settings) as url:
        response = requests.post(url + wire.SCORE_PATH, json=wire.encode_request(images, prompts), timeout=30)
        reason = "the scoring thread died: ZeroDivisionError: integer division or modulo by zero"
        assert response.status_code == 503 and response.json() == {"error": f"the reward server cannot score: {reason}"}
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = requests.get(url + wire.HEALTH_PATH, timeout=10)
        assert health.status_code == 503 and reason in health.json()["error"] and failures == [reason]


def test_a_stuck_reward_fails_health_and_main_exits_3_and_a_stop_answers_the_waiting(tmp_path, monkeypatch, capsys):
    """A reward that never returns: with --score-timeout-s the waiting request gets 503 in one line,
    /health fails and the server's `main` exits 3 for its supervisor to restart it; a server told to
    stop (what SIGTERM does in uvicorn) answers a request still waiting 503 within its graceful bound
    (before: the request and every later one hung, /health answered ok and SIGTERM was ignored)."""
    from mm_grpo.tools import reward_server
    monkeypatch.setattr(reward_server, "WATCH_INTERVAL_S", 0.1)
    monkeypatch.setattr(reward_server, "GRACEFUL_SHUTDOWN_S", 1.0)
    stuck = _Slow()
    monkeypatch.setattr(reward_server.CombinedReward, "from_configs", lambda configs, device: stuck)
    rewards = tmp_path / "rewards.json"
    rewards.write_text(json.dumps(CONFIGS))
    sock = free_socket()
    listen_socket = reward_server.listen_socket
    monkeypatch.setattr(reward_server, "listen_socket", lambda host, port: sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    exits = []

    def run():
        try:
            main(["--rewards", str(rewards), "--score-timeout-s", "0.5"])
        except SystemExit as e:
            exits.append(e.code)
    server = threading.Thread(target=run)
    server.start()
    body = wire.encode_request(*shapes_batch(2))
    deadline = time.monotonic() + 30
    while True:
        try:
            response = requests.post(url + wire.SCORE_PATH, json=body, timeout=30)
            break
        except requests.ConnectionError:  # not listening yet
            assert time.monotonic() < deadline
            time.sleep(0.05)
    reason = "one batch has been scoring for over --score-timeout-s 0.5 s: the reward is stuck"
    assert response.status_code == 503 and response.json() == {"error": f"the reward server cannot score: {reason}"}
    server.join(30)
    assert exits == [3] and not server.is_alive()
    assert f"{PROG}: error: {reason}; every waiting request was answered 503, the server stops\n" in capsys.readouterr().err
    stuck.release.set()

    monkeypatch.setattr(reward_server, "listen_socket", listen_socket)
    stuck = _Slow()
    settings = ServerSettings(rewards="-")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with serve_app(create_app(stuck, settings), settings=settings) as url:
            waiting = pool.submit(requests.post, url + wire.SCORE_PATH, json=body, timeout=30)
            time.sleep(0.5)
            start = time.monotonic()
        assert time.monotonic() - start < reward_server.GRACEFUL_SHUTDOWN_S + 5
        assert waiting.result(10).json() == {"error": "the reward server is stopping: retry once it is back"}
    stuck.release.set()
