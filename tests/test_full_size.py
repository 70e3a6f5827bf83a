"""bench/full_size.py, the full-size GPU measurement, on the tiny model on CPU: the same path (model
built by Megatron's initialisation, LoRA on a frozen base, the trainer's schedule, DDP and optimizer,
the random frozen parts) end to end, each size's figures written as measured; and its per-call
anchors (diffusers' bf16 model beside mm-grpo's, eager and compiled, the same weights in both)."""
import argparse
import json
import os
import subprocess
import sys
import statistics
import types

import pytest
import torch

from bench.flops import grpo_iteration_flops
from mm_grpo.families.flux.transformer import FluxConfig


def test_full_size_bench_runs_the_trainers_lora_iteration_at_two_micro_batches(tmp_path):
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-m", "bench.full_size", "--model", "tiny", "--no-bf16", "--sizes", "64:12", "64:4",
                    "--iters", "1", "--num-inference-steps", "4", "--text-tokens", "32", "--lora-rank", "4",
                    "--workdir", str(tmp_path / "work"), "--json", str(out)],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert list(result["sizes"]) == ["64px m=12", "64px m=4"]
    assert 0 < result["trainable_parameters"] < result["parameters"]
    config = FluxConfig.preset("tiny")
    expected = grpo_iteration_flops(config, 32, 16, 12, 4, 1, lora_rank=4)
    for key, row in result["sizes"].items():
        assert row["all_finite"] and row["trained_steps"] == 1
        assert row["transformer_tflop"] * 1e12 == expected.rollout + expected.train
        # on-policy: the training recomputation equals the rollout's log-probs on the first micro-batch
        assert all(it["ratio_first_mb_min"] == it["ratio_first_mb_max"] == 1.0 for it in row["iterations"])
    assert len(result["sizes"]["64px m=12"]["iterations"]) == 2  # the warm-up, then the timed one
    assert len(result["sizes"]["64px m=4"]["iterations"]) == 1


def test_a_micro_batch_that_runs_out_of_memory_is_retried_at_the_next_divisor_of_g(monkeypatch):
    """1024 px at micro-batch 12 ran out of an H100's memory: the bench records it and goes on at 6,
    then 4, ... (divisors of G), stopping at the first that fits."""
    from bench import full_size
    tried = []

    def run_size(run, size, micro_batch, iteration, warmup, profile):
        tried.append(micro_batch)
        if micro_batch > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return iteration + 1

    monkeypatch.setattr(full_size, "run_size", run_size)
    run = types.SimpleNamespace(args=argparse.Namespace(num_generations=12), result={"sizes": {}},
                                platform=types.SimpleNamespace(name="cuda"))
    assert full_size.run_fitting(run, 1024, 12, 3, warmup=False, profile=False) == 4
    assert tried == [12, 6, 4]
    assert run.result["sizes"]["out_of_memory"] == ["1024:12: CUDA out of memory. Tried to allocate 9.00 GiB",
                                                    "1024:6: CUDA out of memory. Tried to allocate 9.00 GiB"]


def test_anchors_time_both_models_eager_and_compiled_on_the_same_weights(tmp_path):
    """Every figure of issue 48's per-call table and its ratios, at tiny size: dynamo captures each
    block kind of both models whole (fullgraph), inductor left out for a CPU test's time (the GPU
    run compiles with it). The two models hold the same weights: their fp32 velocities agree."""
    from bench import full_size, full_size_summary
    out = tmp_path / "anchors.json"
    subprocess.run([sys.executable, "-m", "bench.full_size", "--anchors", "--model", "tiny", "--sizes", "64:4",
                    "--text-tokens", "32", "--lora-rank", "4", "--anchor-calls", "3", "--compile-backend", "eager",
                    "--json", str(out)],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert result["call"] == dict(batch=4, height=64, width=64, image_tokens=16, text_tokens=32)
    assert set(result["seconds"]) == set(full_size.ANCHOR_ROWS)
    for row, columns in result["seconds"].items():
        assert set(columns) == set(full_size.ANCHOR_COLUMNS)
        for column, seconds in columns.items():
            calls = result["calls_s"][row][column]
            assert len(calls["timed"]) == 3 and seconds == statistics.median(calls["timed"]) > 0
            assert len(calls["warmup"]) == 1  # a compiled row's: the call that compiled
    assert set(result["ratios"]) == set(full_size.ANCHOR_RATIOS)
    for key, (a, b) in full_size.ANCHOR_RATIOS.items():
        for column in full_size.ANCHOR_COLUMNS:
            assert result["ratios"][key][column] == pytest.approx(
                result["seconds"][a][column] / result["seconds"][b][column], rel=1e-12)
    assert result["compile"]["diffusers_bf16_compiled"]["fullgraph"] is True
    assert result["compile_backend"] == "eager"
    # the same weights: fp32 forwards of both models agree; each bf16 path stays near its fp32 velocity
    assert result["same_weights"]
    velocity = result["bf16_velocity"]
    assert velocity["fp32_mm_grpo_vs_diffusers"]["rel_l2"] < 1e-5
    for name in ("diffusers_bf16", "mm_grpo"):
        assert velocity[name]["finite"] and 0 < velocity[name]["rel_l2"] < 0.1
    assert 0 < result["trainable_parameters"] < result["parameters"]
    assert result["model_tflop"]["forward_backward"] > result["model_tflop"]["forward"] > 0

    full_size_summary.main([str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    table = summary.split("GRPO iteration")[0]
    assert full_size_summary.MISSING not in table
    assert "mm-grpo compiled blocks" in table and "mm_grpo/diffusers_bf16" in table


def test_anchor_ratios_are_the_rows_seconds_divided_where_both_were_measured():
    from bench.full_size import anchor_ratios
    seconds = {"diffusers_bf16": {"forward": 2.0, "forward_backward": 8.0}, "mm_grpo": {"forward": 1.0},
               "mm_grpo_compiled": {"forward": 0.5, "forward_backward": 2.0}}
    assert anchor_ratios(seconds) == {
        "mm_grpo/diffusers_bf16": {"forward": 0.5},
        "mm_grpo_compiled/diffusers_bf16": {"forward": 0.25, "forward_backward": 0.25},
        "mm_grpo_compiled/mm_grpo": {"forward": 0.5}}
