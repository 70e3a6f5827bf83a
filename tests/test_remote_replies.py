"""The `remote` reward reads its server's replies as data: a reply that is not scores stops the run
in one line naming what it holds, whatever its numbers, shapes or text; the bearer token is checked
before any request."""
import math

import pytest
import torch

from bench.bench_reward_server import shapes_batch
from mm_grpo.rewards import build_reward, wire
from mm_grpo.rewards.remote import MAX_INT_DIGITS, RemoteRefused
from tests.hostile_http import health_then, json_reply, raw_server, reply_bytes

TOKEN = "secret-token"


def _scored_by(body: bytes, count: int = 2):
    """The `remote` reward's scores of `count` images from a server whose /score replies `body`."""
    images, prompts = shapes_batch(count)
    with raw_server(health_then(lambda server, conn: conn.sendall(reply_bytes(body)))) as server:
        remote = build_reward({"name": "remote", "url": server.url, "timeout": 5, "retries": 0})
        try:
            return remote(images, prompts)
        except RemoteRefused as refused:  # the line, with the address it names made constant
            raise RemoteRefused(str(refused).replace(server.url, "URL")) from None


@pytest.mark.parametrize("body, problem", [
    (b'{"scores": [0.5, ' + b"9" * 400 + b"]}",  # before: a 59-line OverflowError traceback
     "the response holds no list of 2 scores: its 'scores'[1] is an integer of 1329 bits, past any float"),
    (b'{"scores": [true, false]}',  # before: scored 1 and 0, where the flow_grpo client refuses them
     "the response holds no list of 2 scores: its 'scores'[0] is a bool (True), not a number or null"),
    (b'{"scores": [0.5, ' + b"9" * 5000 + b"]}",  # before: Python's advice to raise its digit limit
     f"the reply holds an integer of 5000 digits, more than the {MAX_INT_DIGITS} this reward reads"),
    (b'{"scores": {"0": 0.5, "1": 0.25}}',
     "the response holds no list of 2 scores: its 'scores' is a dict ({'0': 0.5, '1': 0.25}), not a list of 2 numbers"),
    (b'{"scores": [0.5, ' + b"[" * 900 + b"]" * 900 + b"]}",  # before: 120 characters of brackets quoted
     "the response holds no list of 2 scores: its 'scores'[1] is a list ([[[[[[[...]]]]]]]), not a number or null"),
    (b'[0.5, 0.25]', "the response holds no list of 2 scores: it is a list ([0.5, 0.25]), not a dict holding 'scores'"),
], ids=["int_of_400_digits", "booleans", "int_of_5000_digits", "dict", "nested_900_deep", "list"])
def test_a_reply_that_is_not_scores_stops_the_run_in_one_line(body, problem):
    with pytest.raises(RemoteRefused) as refused:
        _scored_by(body)
    assert str(refused.value) == f"reward 'remote': URL: {problem}"


def test_non_finite_scores_and_those_past_float32_are_nan_as_null_is():
    """JSON's NaN and Infinity (Python's spelling, not JSON's) and 1e300 (past float32): before, inf
    rewards; now NaN, as null: the iteration is skipped."""
    scores = _scored_by(b'{"scores": [NaN, Infinity, -Infinity, 1e300, null, 0.5]}', count=6)
    assert scores[:5].isnan().all() and scores[5] == 0.5


def test_a_content_length_of_other_digits_is_read_to_the_end():
    """`Content-Length: ²` (a digit to str.isdigit, not to int): before, a bare `invalid literal for
    int()` line naming nothing; urllib3 reads such a reply to the end of the connection."""
    images, prompts = shapes_batch(2)

    def superscript_length(server, conn):
        conn.sendall("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\nConnection: close\r\n\r\n".encode("latin-1")
                     + b'{"scores": [0.5, 0.25]}')

    with raw_server(health_then(superscript_length)) as server:
        scores = build_reward({"name": "remote", "url": server.url, "timeout": 5, "retries": 0})(images, prompts)
    assert scores.tolist() == [0.5, 0.25]


@pytest.mark.parametrize("token, problem", [
    (TOKEN + "\n", f"holds '\\n' at character {len(TOKEN) + 1} of {len(TOKEN) + 1}"),
    (" " + TOKEN, f"holds ' ' at character 1 of {len(TOKEN) + 1}"),
    (TOKEN[:3] + "é" + TOKEN[3:], f"holds 'é' at character 4 of {len(TOKEN) + 1}")],
    ids=["trailing_newline", "leading_space", "not_ascii"])
def test_a_malformed_token_is_named_before_any_request(monkeypatch, token, problem):
    """Before: every try failed in requests' header check and the launch stopped with "start the
    server first, or fix `url`", quoting the token."""
    monkeypatch.setenv(wire.TOKEN_ENV, token)
    with raw_server(health_then(lambda server, conn: None)) as server:
        with pytest.raises(ValueError) as refused:
            build_reward({"name": "remote", "url": server.url, "timeout": 5, "retries": 0})
        assert server.requests == []
    assert str(refused.value) == (f"reward 'remote': ${wire.TOKEN_ENV} {problem}: a bearer token is visible ASCII "
                                  "only, no space or line end (set it without the file's newline)")
    assert TOKEN not in str(refused.value)


def test_a_refusal_is_one_line_whatever_its_error_holds():
    """A 401 whose "error" has line breaks (before: printed as they came, a second line that could
    pass for the trainer's own), or is not a string."""
    def refuse(server, conn):
        if server.read_request(conn):
            conn.sendall(json_reply({"error": "no token\nmm-grpo: iteration 9: reward 0.9"}, "401 Unauthorized"))

    with raw_server(refuse) as server:
        with pytest.raises(RemoteRefused) as refused:
            build_reward({"name": "remote", "url": server.url, "timeout": 5, "retries": 0})
    assert str(refused.value) == f"reward 'remote': {server.url}/health refused the request: HTTP 401 no token"


def test_a_score_of_every_kind_the_protocol_allows_is_read():
    """Integers, floats and null, as any JSON writer spells them."""
    scores = _scored_by(b'{"scores": [1, -2.5e-3, null, 1E2], "terms": {}}', count=4)
    assert torch.equal(scores.isnan(), torch.tensor([False, False, True, False]))
    assert [s for s in scores.tolist() if not math.isnan(s)] == [1.0, pytest.approx(-2.5e-3), 100.0]
