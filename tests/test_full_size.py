"""bench/full_size.py, the full-size GPU measurement, on the tiny model on CPU: the same path (model
built by Megatron's initialisation, LoRA on a frozen base, the trainer's schedule, DDP and optimizer,
the random frozen parts) end to end, each size's figures written as measured."""
import argparse
import json
import os
import subprocess
import sys
import types

import torch

from bench.flops import grpo_iteration_flops
from mm_grpo.models.flux import FluxConfig


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
