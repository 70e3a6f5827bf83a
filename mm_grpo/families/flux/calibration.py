"""The measured iterations `mm-grpo plan`'s time model is calibrated on (families/flux/plan.py `iteration_time`).

The model: a phase's seconds are the FLOPs it executes (families/flux/plan.py `phase_flops`: matrix products and
attention, bench/flops.py's count, the recompute forward included) divided by the device's bf16
matmul rate times the phase's efficiency, plus the bytes its weights move (families/flux/plan.py
weight_traffic_bytes: casts, gradients, a hand count) at the device's HBM bandwidth. The
efficiencies are not typed in: families/flux/plan.py `efficiency` derives each from a measured phase below, the
FLOPs the measured job executes in it / ((its seconds less its weight traffic) x the matmul rate
measured in the same process). So the plan reproduces the measured phases of the measured job, and
scales them for any other job by its FLOPs and for another device by its matmul rate (devices.py);
the element-wise work, the loop around the model and the launch overheads are assumed to scale with
the FLOPs (one constant per phase and path).

Recalibrating from a new run of `bench/full_size.sh` (its `grpo` and `grpo_compiled` steps; the same
figures print with `python -m bench.full_size --model flux-dev --sizes 512:12 --iters 1 [--compile]`):
in each step's JSON, `sizes["512px m=12"]` holds `rollout`, `train` and `decode_reward` (seconds,
medians of the timed iterations) and the run holds `matmul_bf16_flops`. Replace, below:
  EAGER_ROLLOUT, EAGER_TRAIN            <- the grpo step's rollout and train, its matmul_bf16_flops / 1e12
  COMPILED_ROLLOUT, COMPILED_TRAIN      <- the grpo_compiled step's
  DECODE_REWARD                         <- either step's decode_reward (jpeg reward: no reward model)
  the `source` strings (card, date, command), CALIBRATION_DEVICE if the card differs, and, if the
  job differs, CALIBRATION_JOB;
and the measured card's rate in devices.py (`matmul_bf16_flops`) if it is a new figure for that card.
Then the same figures in tests/test_plan.py's MEASURED_ITERATIONS (with each run's iteration
seconds; it checks the plan within 10% of them; its H100 row was measured on the fp32-residual
layout: drop it, or replace it, when recalibrating on another layout), bench/plan_validate.py's
TIME_RUNS (`--time`: the table) and docs/scaling.md ("The time model": the constants and their
sources).
"""
import dataclasses

# The job every figure below was measured on: FLUX.1-dev (`CALIBRATION_MODEL`, random weights at its
# real shapes), one GPU, G = 12 images of one prompt at 512 px (1024 image tokens), 512 text tokens,
# micro-batch 12, N = 16 steps, K = 9 trained (timestep fraction 0.6), LoRA 64 on the recommended
# targets over a frozen bf16 base, bf16, recompute, jpeg_compressibility reward, text-embedding
# cache: bench/full_size.py's defaults (families/flux/plan.py `Job`'s fields).
CALIBRATION_MODEL = "flux-dev"
CALIBRATION_DEVICE = "h200"  # devices.py's profile of the measured card (its HBM bandwidth)
CALIBRATION_JOB = dict(height=512, width=512, text_tokens=512, num_generations=12, prompts_per_iteration=1,
                       micro_batch_size=12, num_inference_steps=16, timestep_fraction=0.6, lora_rank=64,
                       recompute=True, bf16=True)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One phase of one measured iteration: its seconds, the bf16 matmul rate measured in the same
    process (bench/bench_grpo.matmul_throughput: 8192^3, median of 3), and where it comes from."""
    seconds: float
    matmul_tflops: float
    source: str


_RUN = ("one NVIDIA H200, 2026-11-28, the bf16 layout: `STEPS=\"grpo grpo_compiled\" bash bench/full_size.sh` "
        "(docs/measurements/h200_2026-11-28/{})")
EAGER_ROLLOUT = Measured(9.590, 785.6, _RUN.format("grpo.json"))
EAGER_TRAIN = Measured(18.963, 785.6, _RUN.format("grpo.json"))
COMPILED_ROLLOUT = Measured(8.353, 785.6, _RUN.format("grpo_compiled.json"))
COMPILED_TRAIN = Measured(15.086, 785.6, _RUN.format("grpo_compiled.json"))
# Decode of the 12 images (FLUX.1's VAE in bf16) and the jpeg reward, the same run's eager iteration
# (0.494 s in the compiled one).
DECODE_REWARD = Measured(0.492, 785.6, _RUN.format("grpo.json"))

# The measured phases by path: `compiled` is the trainer's --compile-blocks (mm-grpo plan
# --compile-blocks), `eager` everything else.
PHASES = {"eager": {"rollout": EAGER_ROLLOUT, "train": EAGER_TRAIN, "decode_reward": DECODE_REWARD},
          "compiled": {"rollout": COMPILED_ROLLOUT, "train": COMPILED_TRAIN, "decode_reward": DECODE_REWARD}}
