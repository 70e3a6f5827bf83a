"""The clients of the servers the field already runs, against local stand-in servers that speak
their protocols: flow_grpo's GenEval / DeQA reward servers (pickles over HTTP) and an
OpenAI-compatible chat endpoint serving a VLM judge (vLLM / sglang)."""
import base64
import io
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from bench.bench_reward_server import shapes_batch
from mm_grpo.rewards import build_reward, flow_grpo_servers
from mm_grpo.rewards.remote import RemoteRefused
from mm_grpo.rewards.vlm_judge import UNIFIED_REWARD_QUESTION, parse_score
from mm_grpo.tools.reward_server import free_socket, serve_app
from tests.hostile_http import get_then_post, json_reply, raw_server, reply_bytes

TRICKLE_S = 0.25  # one byte every quarter second keeps every socket read alive
BOUND_S = 3.0  # a `timeout: 1` try answers well within this, even on a loaded machine
CHILD_TIMEOUT_S = 120  # a child that imports torch and reads five replies: ~10 s on the loaded machine
READ_BOUND_S = 10.0  # the slowest reply at the cap reads in ~1 s
MiB = 1 << 20


def _flow_grpo_stub(reply, seen, protocol=pickle.DEFAULT_PROTOCOL):
    """A flow_grpo reward server: POST / with a pickled batch, a pickled reply (it trusts its
    clients' pickles, as flow_grpo's servers do)."""
    from fastapi import FastAPI, Request, Response
    app = FastAPI()

    @app.post("/")
    async def score(request: Request):
        batch = pickle.loads(await request.body())
        seen.append(batch)
        return Response(pickle.dumps(reply(batch), protocol=protocol), media_type="application/octet-stream")

    return app


def _brightness(jpeg: bytes) -> float:
    return float(np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64).mean() / 255)


@pytest.fixture
def metadata(tmp_path):
    _, prompts = shapes_batch(70)
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "tag": "shapes", "k": i}) + "\n"
                            for i, p in enumerate(dict.fromkeys(prompts))))
    return path


def test_geneval_client_sends_flow_grpos_batches_and_reads_numpy_scores(metadata):
    images, prompts = shapes_batch(70)
    k = {json.loads(line)["prompt"]: json.loads(line)["k"] for line in metadata.read_text().splitlines()}
    seen = []

    def reply(batch):  # numpy float32 scalars, as a numpy-based server returns them
        scores = [np.float32(_brightness(j) + m["k"]) for j, m in zip(batch["images"], batch["meta_datas"])]
        return {"scores": scores, "rewards": np.array(scores) > 0, "strict_rewards": [], "group_rewards": {},
                "group_strict_rewards": {}}

    with serve_app(_flow_grpo_stub(reply, seen)) as url:
        reward = build_reward({"name": "geneval_server", "url": url, "path": str(metadata)})
        reward.check_prompts(prompts)
        scores = reward(images, prompts)
    assert [len(b["images"]) for b in seen] == [64, 6] and all(b["only_strict"] is True for b in seen)
    assert all(j[:2] == b"\xff\xd8" for b in seen for j in b["images"])  # JPEG
    expected = images.mean((1, 2, 3)) + torch.tensor([k[p] for p in prompts], dtype=torch.float32)
    assert (scores - expected).abs().max() < 0.01  # JPEG's loss on a mean brightness


def test_geneval_client_refuses_prompts_without_metadata_before_training(metadata):
    with serve_app(_flow_grpo_stub(lambda b: {}, [])) as url:
        reward = build_reward({"name": "geneval_server", "url": url, "path": str(metadata)})
        with pytest.raises(ValueError, match="1 prompt\\(s\\) have no GenEval metadata in evaluation_metadata.jsonl, "
                                             "e.g. 'a photo of a cat'"):
            reward.check_prompts(["a photo of a cat"])


def test_a_reply_holding_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    images, prompts = shapes_batch(2)
    with serve_app(_flow_grpo_stub(lambda b: {"outputs": [Hostile(), 1.0]}, [])) as url:
        reward = build_reward({"name": "deqa_server", "url": url})
        with pytest.raises(RemoteRefused) as refused:
            reward(images, prompts)
    assert str(refused.value) == (f"reward 'deqa_server': {url} sent a reply that is not 2 scores: it holds "
                                  "posix.system, which the client does not load")
    assert not marker.exists()


@pytest.mark.parametrize("as_sent, protocol", [
    (list, 4),  # the authors' server: Python floats (`sc.item()`), pickle's default protocol
    (lambda v: np.asarray(v, dtype=np.float32), 4),  # a numpy array, as a numpy-based server returns it
    (lambda v: np.asarray(v, dtype=">f8"), 5),  # big-endian, protocol 5 (Python 3.14's default)
    (lambda v: [np.float64(x) for x in v], 5)], ids=["floats", "float32_array", "protocol5_array", "numpy_scalars"])
def test_deqa_client_reads_outputs(as_sent, protocol):
    images, prompts = shapes_batch(3)
    reply = lambda b: {"outputs": as_sent([_brightness(j) for j in b["images"]])}  # noqa: E731
    with serve_app(_flow_grpo_stub(reply, [], protocol)) as url:
        scores = build_reward({"name": "deqa_server", "url": url})(images, prompts)
    assert (scores - images.mean((1, 2, 3))).abs().max() < 0.01


def test_numpy_1x_replies_load_as_numpy_2x_ones():
    """numpy 1.x names its reconstructors under numpy.core, 2.x under numpy._core (protocol 3
    names them in text, so the one becomes the other by replacement)."""
    reply = {"scores": np.array([0.25, 0.5], dtype=np.float32), "first": np.float64(0.75)}
    as_2x = pickle.dumps(reply, protocol=3)
    as_1x = as_2x.replace(b"numpy._core.", b"numpy.core.")
    assert as_1x != as_2x
    assert flow_grpo_servers.load_reply(as_1x) == flow_grpo_servers.load_reply(as_2x) == {
        "scores": [0.25, 0.5], "first": 0.75}


class _NumpyCall:
    """Pickles as a call of numpy's `function` with `args`: what a hostile reply can write
    without the test allocating anything."""

    def __init__(self, function, args, state=None):
        self.reduced = (function, args) if state is None else (function, args, state)

    def __reduce__(self):
        return self.reduced


RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]
TERABYTES_9 = (9 << 40) // 8
HUGE_INT = 10 ** 5000  # str() of it raises: more than Python's 4300 digits


def _nested(depth):
    value = 0.5
    for _ in range(depth):
        value = [value]
    return value


def _holding_itself():
    outputs = [0.5]
    outputs.append(outputs)
    return outputs


@pytest.mark.parametrize("outputs, problem", [
    (_NumpyCall(np.ndarray, ((TERABYTES_9,), np.dtype("f8"))), "it calls numpy.ndarray, which the client does not do"),
    (_NumpyCall(np.ndarray, ((20_000_000,), np.dtype("f8"))), "it calls numpy.ndarray, which the client does not do"),
    (_NumpyCall(RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (TERABYTES_9,), np.dtype("f8"), False, b"")),
     f"it holds a numpy array of {TERABYTES_9} elements, more than 65536"),
    (_NumpyCall(RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (2,), np.dtype("f8"), False, b"\0" * 8)),
     "it holds a numpy array of shape (2,) whose bytes do not fill it"),
    (np.array(["1.0", "2.0"]), "it holds a numpy dtype 'U3', not a number or bool dtype"),
    (np.array([1.0, None]), "it holds a numpy dtype 'O8', not a number or bool dtype"),
    ("7777", "its 'outputs' is a str ('7777'), not a list of 2 numbers"),
    ([0.5], "its 'outputs' holds 1 scores for 2 images"),
    ([0.5, 0.25, 1.0], "its 'outputs' holds 3 scores for 2 images"),
    ([True, 0.5], "its 'outputs'[0] is a bool (True), not a number"),
    (np.array([0.5, 1.0]) > 0.6, "its 'outputs'[0] is a bool (False), not a number"),
    ([0.5, "1"], "its 'outputs'[1] is a str ('1'), not a number"),
    ([[0.5], [1.0]], "its 'outputs'[0] is a list ([0.5]), not a number"),
    ([0.5, 10 ** 400], "its 'outputs'[1] is an integer of 1329 bits, past any float"),
    ({1, 2}, "its 'outputs' is a set ({1, 2}), not a list of 2 numbers"),
    (_NumpyCall(RECONSTRUCT, (np.ndarray, (0,), b"b"), (1, (HUGE_INT,), np.dtype("f8"), False, b"")),
     f"it holds a numpy array of shape (<an integer of {HUGE_INT.bit_length()} bits>,), not at most 32 sizes "
     "of an axis"),
    ([np.array(0.5), np.array(0.25)],
     "it holds a numpy array of no dimension, where a reply holds lists or numpy scalars"),
    ([0.5, {(1, 2): 0.5}], "it has a container as a dict key or set member, where a reply has strings and numbers"),
    ([0.5, _nested(40)], "it nests containers more than 32 deep"),
    (_holding_itself(), "it puts a container inside itself, or fills one already inside another"),
], ids=["ndarray_9TiB", "ndarray_2e7", "reconstruct_9TiB", "short_bytes", "str_array", "object_array", "str",
        "too_few", "too_many", "bool", "bool_array", "str_element", "nested", "huge_int", "set", "huge_shape",
        "zero_dim_arrays", "tuple_key", "nested_40_deep", "holding_itself"])
def test_a_reply_that_is_not_scores_is_refused_in_one_line_before_anything_is_allocated(outputs, problem):
    images, prompts = shapes_batch(2)
    process = psutil.Process()
    with serve_app(_flow_grpo_stub(lambda b: {"outputs": outputs}, [])) as url:
        reward = build_reward({"name": "deqa_server", "url": url, "retries": 2})
        before = process.memory_info().rss
        with pytest.raises(RemoteRefused) as refused:
            reward(images, prompts)
        grown = process.memory_info().rss - before
    assert str(refused.value) == f"reward 'deqa_server': {url} sent a reply that is not 2 scores: {problem}"
    assert grown < 32 << 20


def test_non_finite_scores_become_nan_as_in_mm_grpos_protocol():
    images, prompts = shapes_batch(3)
    with serve_app(_flow_grpo_stub(lambda b: {"outputs": [float("inf"), float("nan"), 2]}, [])) as url:
        scores = build_reward({"name": "deqa_server", "url": url})(images, prompts)
    assert scores[:2].isnan().all() and scores[2] == 2


def test_loading_a_reply_within_the_size_cap_takes_bounded_memory():
    """pickle's cheapest object per byte: an empty set (one opcode byte, ~216 bytes built), a reply
    of nothing else up to the cap."""
    bomb = b"\x80\x04(" + b"\x8f" * (flow_grpo_servers.MAX_REPLY_BYTES - 4) + b"l."
    process = psutil.Process()
    before = process.memory_info().rss
    assert len(flow_grpo_servers.load_reply(bomb)) == flow_grpo_servers.MAX_REPLY_BYTES - 4
    grown = process.memory_info().rss - before
    assert grown < 400 * flow_grpo_servers.MAX_REPLY_BYTES  # ~230 bytes built per byte (measured), with a margin


@pytest.mark.parametrize("reply, problem", [
    ({HUGE_INT: 0.5}, f"it has no 'outputs' (its keys: <an integer of {HUGE_INT.bit_length()} bits>)"),
    ([0.5, 0.25], "it is a list ([0.5, 0.25]), not a dict holding 'outputs'")], ids=["huge_int_key", "list"])
def test_a_reply_without_its_scores_is_named_in_one_line(reply, problem):
    images, prompts = shapes_batch(2)
    with serve_app(_flow_grpo_stub(lambda b: reply, [])) as url:
        with pytest.raises(RemoteRefused) as refused:
            build_reward({"name": "deqa_server", "url": url})(images, prompts)
    assert str(refused.value) == f"reward 'deqa_server': {url} sent a reply that is not 2 scores: {problem}"


# Replies that took the trainer's process down: each read in a child process, so that a regression
# fails this test (a segfault, a stall, or memory past the child's limit) rather than pytest.
HOSTILE_REPLIES = r"""
import pickle, resource, sys
import numpy as np
from mm_grpo.rewards import flow_grpo_servers

def deep_tuple(depth):  # (((...),),): one opcode a level, built by pickle without recursion
    return b")" + b"\x85" * depth

def doubling_tuple(levels):  # t = (t, t) each level: hashing it visits 2 ** levels leaves
    return b")" + b"".join(b"\x94h" + bytes([level]) + b"\x86" for level in range(levels))

SCORES = b"\x8c\x07outputs(G?\xe0\x00\x00\x00\x00\x00\x00G?\xd0\x00\x00\x00\x00\x00\x00l"
replies = {
    "tuple_key_250000": b"\x80\x04}" + deep_tuple(250_000) + b"K\x01s.",
    "tuple_key_100000": b"\x80\x04}" + deep_tuple(100_000) + b"K\x01s.",
    "tuple_value_250000": b"\x80\x04}(" + SCORES + b"\x8c\x01x" + deep_tuple(250_000) + b"u.",
    "doubling_tuple_key": b"\x80\x04}(" + SCORES + doubling_tuple(31) + b"K\x01u.",
    "zeros_65536_65536_0": pickle.dumps({"outputs": np.zeros((65536, 65536, 0))}),
}
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), hard))
for name, data in replies.items():
    try:
        print(name, "loaded", type(flow_grpo_servers.load_reply(data)).__name__, flush=True)
    except pickle.UnpicklingError as e:
        print(name, e, flush=True)
"""


def test_replies_that_crashed_or_stalled_the_process_are_refused_before_anything_is_built():
    """Before: a segfault (hashing the 250,000-deep key), a RecursionError traceback (100,000 deep),
    a stall (hashing a 31-level doubling key visits 2 ** 31 tuples), and 4.3e9 lists built."""
    limit = psutil.Process().memory_info().vms + (2 << 30)  # what this process maps, as the child will, and 2 GiB
    child = subprocess.run([sys.executable, "-c", HOSTILE_REPLIES, str(limit)], capture_output=True, text=True,
                           timeout=CHILD_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (child.returncode, child.stdout.splitlines()) == (0, [
        "tuple_key_250000 it nests containers more than 32 deep",
        "tuple_key_100000 it nests containers more than 32 deep",
        "tuple_value_250000 it nests containers more than 32 deep",
        "doubling_tuple_key it has a container as a dict key or set member, where a reply has strings and numbers",
        "zeros_65536_65536_0 it holds a numpy array of shape (65536, 65536, 0), which is 4295032832 nested lists, "
        "more than 65536"]), child.stderr[-2000:]


def test_a_reply_cannot_change_the_clients_own_functions():
    """BUILD on a global the client loads (numpy's `_frombuffer`): before, the state set its
    __defaults__ for every later reply of the process."""
    reply = (b"\x80\x02}(X\x07\x00\x00\x00outputs]q\x02(G?\xe0\x00\x00\x00\x00\x00\x00G?\xe0\x00\x00\x00"
             b"\x00\x00\x00eX\x01\x00\x00\x00xcnumpy._core.numeric\n_frombuffer\n"
             b"N}X\x0c\x00\x00\x00__defaults__X\x01\x00\x00\x00F\x85s\x86bu.")
    with pytest.raises(pickle.UnpicklingError) as refused:
        flow_grpo_servers.load_reply(reply)
    assert str(refused.value) == "it applies pickle's BUILD to what is not a container or numpy value"
    assert flow_grpo_servers._frombuffer.__defaults__ == ("C",)


def test_reading_a_reply_at_the_size_cap_takes_bounded_time():
    """The opcodes that cost the structure's first read most (an empty list appended, 2 bytes each,
    up to the cap): ~1 s measured on the loaded 2-core machine."""
    costliest = b"\x80\x04]" + b"]a" * ((flow_grpo_servers.MAX_REPLY_BYTES - 4) // 2) + b"."
    start = time.monotonic()
    assert len(flow_grpo_servers.load_reply(costliest)) == (flow_grpo_servers.MAX_REPLY_BYTES - 4) // 2
    assert time.monotonic() - start < READ_BOUND_S


def test_an_unreachable_flow_grpo_server_is_one_line():
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ConnectionError, match=f"reward 'deqa_server': {url} failed 1 time"):
        build_reward({"name": "deqa_server", "url": url, "retries": 0})
    sock.close()


# --- the VLM judge -------------------------------------------------------------------------
def _chat_stub(answers, seen):
    """An OpenAI-compatible server (the part vLLM / sglang serve): /v1/models and /v1/chat/completions."""
    from fastapi import FastAPI, Request
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "UnifiedReward-7b-v1.5", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append((body, request.headers.get("authorization")))
        image_part, text_part = body["messages"][0]["content"]
        prompt = text_part["text"].rsplit("Text Caption: [", 1)[1][:-1]
        header, data = image_part["image_url"]["url"].split(",", 1)
        size = Image.open(io.BytesIO(base64.b64decode(data))).size
        return {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": f"{answers[prompt]} (image {size[0]}x{size[1]}, {header})"}}]}

    return app


def test_vlm_judge_asks_each_image_and_reads_the_final_score(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    images, prompts = shapes_batch(4)
    prompts = ["p0", "p1", "p2", "p3"]
    answers = {"p0": "Alignment good. Final Score: 4", "p1": "Final Score:3.5", "p2": "I cannot tell.",
               "p3": "Final Score: 5.0"}
    seen = []
    with serve_app(_chat_stub(answers, seen)) as url:
        reward = build_reward({"name": "vlm_judge", "url": url + "/v1", "model": "UnifiedReward-7b-v1.5"})
        scores = reward(images, prompts)
    assert scores.tolist() == pytest.approx([0.8, 0.7, 0.0, 1.0])
    assert "1 of 4 replies name no 'Final Score: 1-5'; they score 0" in capsys.readouterr().err
    for body, auth in seen:
        assert auth == "Bearer sk-test" and body["temperature"] == 0 and body["model"] == "UnifiedReward-7b-v1.5"
        assert body["messages"][0]["content"][1]["text"].startswith("<image>\nYou are given a text caption")
    assert len(seen) == 4


def test_vlm_judge_images_are_512_png_data_urls_and_the_question_can_be_replaced(tmp_path):
    question = tmp_path / "q.txt"
    question.write_text("Rate {prompt}. Text Caption: [{prompt}]")
    images, _ = shapes_batch(1)
    seen = []
    with serve_app(_chat_stub({"p": "Final Score: 2"}, seen)) as url:
        reward = build_reward({"name": "vlm_judge", "url": url + "/v1", "model": "m", "path": str(question)})
        assert reward(images, ["p"]).tolist() == [pytest.approx(0.4)]
    body, _ = seen[0]
    assert body["messages"][0]["content"][1]["text"] == "Rate p. Text Caption: [p]"
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).format == "PNG"


@pytest.mark.parametrize("text, score", [("Final Score: 3", 0.6), ("final score: 3", None), ("Final Score: 6", None),
                                         ("Final Score: 1.25 then Final Score: 5", 0.25), ("", None)])
def test_score_parsing_follows_flow_grpos_pattern(text, score):
    assert parse_score(text) == (pytest.approx(score) if score is not None else None)


def test_an_api_key_ending_in_a_newline_is_one_line_before_any_request(monkeypatch):
    """Before: the judge was built, then every chat request failed in transport (requests refuses
    the header), each iteration skipped with a line quoting the key."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test\n")
    with raw_server(_chat_raw(lambda server, conn, prompt: conn.sendall(_completion("Final Score: 4")))) as server:
        with pytest.raises(ValueError) as refused:
            build_reward({"name": "vlm_judge", "url": server.url + "/v1", "model": "m"})
        assert server.requests == []
    assert str(refused.value) == ("reward 'vlm_judge': $OPENAI_API_KEY holds '\\n' at character 8 of 8: a bearer "
                                  "token is visible ASCII only, no space or line end (set it without the file's "
                                  "newline)")


def test_vlm_judge_config_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="needs `model`"):
        build_reward({"name": "vlm_judge", "url": "http://127.0.0.1:1/v1"})
    (tmp_path / "q.txt").write_text("no placeholder")
    with pytest.raises(ValueError, match=r"has no \{prompt\}"):
        build_reward({"name": "vlm_judge", "url": "http://127.0.0.1:1/v1", "model": "m", "path": str(tmp_path / "q.txt")})
    assert "{prompt}" in UNIFIED_REWARD_QUESTION


# --- flow_grpo's servers misbehaving on the wire ----------------------------------------------
def _flow_grpo_raw(score_answer):
    """flow_grpo's server as the wire sees it: a GET of / answers 405 (Flask's), a POST `score_answer`."""
    return get_then_post(reply_bytes(b"Method Not Allowed", "405 METHOD NOT ALLOWED", "text/html"), score_answer)


def _trickled_pickle(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    while not server.stop.wait(TRICKLE_S):
        conn.sendall(b"\x80")


def _streamed_100_mb(server, conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")
    block = b"\x8f" * MiB  # empty sets: the most memory a pickle's byte can ask for
    for _ in range(100):
        if server.stop.is_set():
            return
        conn.sendall(block)


@pytest.mark.parametrize("behaviour, last", [
    (_trickled_pickle, "no whole reply within 1 s"),
    (_streamed_100_mb, f"the reply passed the {flow_grpo_servers.MAX_REPLY_BYTES} bytes this reward reads")],
    ids=["trickled", "100_MB"])
def test_a_flow_grpo_server_stalling_or_flooding_skips_the_iteration_in_one_line(behaviour, last, capsys):
    images, prompts = shapes_batch(2)
    process = psutil.Process()
    with raw_server(_flow_grpo_raw(behaviour)) as server:
        reward = build_reward({"name": "deqa_server", "url": server.url, "timeout": 1, "retries": 1})
        before, start = process.memory_info().rss, time.monotonic()
        scores = reward(images, prompts)
        elapsed, grown = time.monotonic() - start, process.memory_info().rss - before
        posts = server.count("POST")
    assert torch.isnan(scores).all() and posts == 2 and elapsed < 2 * BOUND_S and grown < 32 * MiB
    assert capsys.readouterr().err.splitlines() == [
        f"mm-grpo: warning: reward 'deqa_server': {server.url} failed 2 time(s), timeout 1 s; last: {last}: "
        "2 images scored NaN (the iteration is skipped)"]


# --- GenEval's metadata file --------------------------------------------------------------------
@pytest.mark.parametrize("lines, problem", [
    (b'{"prompt": "a"}\n\n{"prompt": "b",\n', ":3 is not JSON (Expecting property name enclosed in double quotes "
                                              "at column 16)"),
    (b'{"prompt": "a"}\n{"prompt": "caf\xff"}\n', ":2 is not UTF-8 (byte 0xff at column 16)"),
    (b'{"prompt": "a"}\n["a"]\n', ':2 has no "prompt" string'),
    (b'{"tag": "counting"}\n', ':1 has no "prompt" string'),
    (b"[" * 100000 + b"\n", ":1 is not JSON (nested too deeply)")],
    ids=["bad_json", "not_utf8", "not_an_object", "no_prompt", "nested"])
def test_a_bad_geneval_metadata_file_is_one_line_naming_file_and_line(tmp_path, lines, problem):
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_bytes(lines)
    with pytest.raises(ValueError) as bad:  # before the server is asked anything
        build_reward({"name": "geneval_server", "url": "http://127.0.0.1:1", "path": str(path)})
    assert str(bad.value) == f"reward 'geneval_server': {path}{problem}"


# --- the VLM judge: one batch, one deadline -----------------------------------------------------
def _chat_raw(answer_prompt):
    """An OpenAI-compatible endpoint as the wire sees it; `answer_prompt(server, conn, prompt)`
    answers each chat request (the prompt is the text after "Text Caption: [")."""
    def answer(server, conn):
        request = server.read_request(conn)
        if request is None:
            return
        method, path, body = request
        if method == "GET":
            conn.sendall(json_reply({"object": "list", "data": [{"id": "m"}]}))
            return
        text = json.loads(body)["messages"][0]["content"][1]["text"]
        answer_prompt(server, conn, text.rsplit("Text Caption: [", 1)[1][:-1])
    return answer


def _completion(text):
    return json_reply({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})


def _prompts_sent(server):
    with server.lock:
        return sorted(json.loads(body)["messages"][0]["content"][1]["text"].rsplit("[", 1)[1][:-1]
                      for method, _, body in server.requests if method == "POST")


def test_one_image_request_that_hangs_cuts_the_judges_batch_at_the_timeout(capsys):
    images, _ = shapes_batch(4)
    prompts = ["p0", "p1", "p2", "p3"]

    def answer(server, conn, prompt):
        if prompt == "p2":
            server.stop.wait(30)
        conn.sendall(_completion("Final Score: 4"))

    with raw_server(_chat_raw(answer)) as server:
        judge = build_reward({"name": "vlm_judge", "url": server.url + "/v1", "model": "m", "timeout": 1,
                              "retries": 0})
        start = time.monotonic()
        scores = judge(images, prompts)
        elapsed = time.monotonic() - start
    assert torch.isnan(scores).all() and elapsed < BOUND_S
    assert capsys.readouterr().err.splitlines() == [
        f"mm-grpo: warning: reward 'vlm_judge': {server.url}/v1/chat/completions failed 1 time(s), timeout 1 s; "
        "last: no whole reply within 1 s: 4 images scored NaN (the iteration is skipped)"]


def test_a_judge_request_broken_off_is_sent_again_alone_and_the_batch_scored():
    images, _ = shapes_batch(4)
    prompts = ["p0", "p1", "p2", "p3"]

    def answer(server, conn, prompt):
        if prompt == "p2" and _prompts_sent(server).count("p2") == 1:
            while len(_prompts_sent(server)) < 4 and not server.stop.wait(0.01):
                pass  # the other three are in: break this one off, mid-reply
            conn.sendall(_completion("Final Score: 1")[:-5])
            return
        conn.sendall(_completion(f"Final Score: {int(prompt[1]) + 1}"))

    with raw_server(_chat_raw(answer)) as server:
        judge = build_reward({"name": "vlm_judge", "url": server.url + "/v1", "model": "m", "timeout": 5,
                              "retries": 1})
        scores = judge(images, prompts)
        sent = _prompts_sent(server)
    assert scores.tolist() == pytest.approx([0.2, 0.4, 0.6, 0.8]) and sent == ["p0", "p1", "p2", "p2", "p3"]
