"""The clients of the servers the field already runs, against local stand-in servers that speak
their protocols: flow_grpo's GenEval / DeQA reward servers (pickles over HTTP) and an
OpenAI-compatible chat endpoint serving a VLM judge (vLLM / sglang)."""
import base64
import io
import json
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from bench.bench_reward_server import shapes_batch
from mm_grpo.rewards import build_reward
from mm_grpo.rewards.remote import RemoteRefused
from mm_grpo.rewards.vlm_judge import UNIFIED_REWARD_QUESTION, parse_score
from mm_grpo.tools.reward_server import free_socket, serve_app


def _flow_grpo_stub(reply, seen):
    """A flow_grpo reward server: POST / with a pickled batch, a pickled reply (it trusts its
    clients' pickles, as flow_grpo's servers do)."""
    from fastapi import FastAPI, Request, Response
    app = FastAPI()

    @app.post("/")
    async def score(request: Request):
        batch = pickle.loads(await request.body())
        seen.append(batch)
        return Response(pickle.dumps(reply(batch)), media_type="application/octet-stream")

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
        with pytest.raises(RemoteRefused, match=r"replied with no 'outputs' list \(UnpicklingError: the reply holds "
                                                r"posix.system, which the client does not load\)"):
            reward(images, prompts)
    assert not marker.exists()


def test_deqa_client_reads_outputs():
    images, prompts = shapes_batch(3)
    with serve_app(_flow_grpo_stub(lambda b: {"outputs": [_brightness(j) for j in b["images"]]}, [])) as url:
        scores = build_reward({"name": "deqa_server", "url": url})(images, prompts)
    assert (scores - images.mean((1, 2, 3))).abs().max() < 0.01


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


def test_vlm_judge_config_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="needs `model`"):
        build_reward({"name": "vlm_judge", "url": "http://127.0.0.1:1/v1"})
    (tmp_path / "q.txt").write_text("no placeholder")
    with pytest.raises(ValueError, match=r"has no \{prompt\}"):
        build_reward({"name": "vlm_judge", "url": "http://127.0.0.1:1/v1", "model": "m", "path": str(tmp_path / "q.txt")})
    assert "{prompt}" in UNIFIED_REWARD_QUESTION
