"""Predicted (mm_grpo.plan) against measured peak memory per rank of real GRPO trainer runs.

    torchrun --nproc_per_node N bench/plan_validate.py [--json out.json] [--layouts dp2 tp2 ...]
    python bench/plan_validate.py --report --json out.json     # the table, with the predictions
    python bench/plan_validate.py --probe-vae                   # the VAE decode constants
    python bench/plan_validate.py --time                        # the time model against GPU iterations

Each layout that fits the world size runs the trainer (`GRPORun`, two iterations: the second
has Adam's states) at the bench preset of bench/grpo_setup.py (D = 256, 2 + 4 blocks, 256 x 256
images: 256 image + 32 text tokens, G = 12, N = 16, fp32), one layout after another in the same
processes. Measured: the peak over the run of the bytes of all live tensor storages of the rank,
counted at every allocation by a dispatch mode (`LiveTensorMeter`: what an allocator's
`max_memory_allocated` reports, without the allocator's caching and fragmentation; the process
baseline, imports and libraries, is not in it). Predicted: `mm_grpo.families.flux.plan.rank_memory`
for the same model, components, batch and layout; the table shows the worst rank of each.
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mm_grpo  # noqa: E402,F401  (platform first)
from bench.grpo_setup import PRESETS, PROMPTS, default_workdir, prepare  # noqa: E402
from mm_grpo.recompute import EVERY_BLOCK_FLAGS  # noqa: E402

MiB = 2 ** 20
LORA_RANK = 8
# LoRA on the attention and MLP linears of every block (docs/lora.md's recommended targets).
LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out",
        "--lora-r", str(LORA_RANK)]
# name: (tp, pp, sp, extra trainer flags). dp = world size / (tp pp sp).
LAYOUTS = {
    "single": (1, 1, 1, []), "single-recompute": (1, 1, 1, [*EVERY_BLOCK_FLAGS]),
    "dp2": (1, 1, 1, []), "tp2": (2, 1, 1, []), "sp2": (1, 1, 2, []), "pp2": (1, 2, 1, []),
    "dp2-distopt": (1, 1, 1, ["--use-distributed-optimizer"]),
    "dp4": (1, 1, 1, []), "tp2xdp2": (2, 1, 1, []), "sp2xdp2": (1, 1, 2, []), "tp2xpp2": (2, 2, 1, []),
    "pp2xsp2": (1, 2, 2, []), "pp2xdp2-recompute": (1, 2, 1, [*EVERY_BLOCK_FLAGS]),
    "single-lora": (1, 1, 1, LORA), "single-lora-kl": (1, 1, 1, LORA + ["--kl-beta", "0.01"]),
    "dp2-lora": (1, 1, 1, LORA), "tp2-lora": (2, 1, 1, LORA),
    # --bf16 (the model computes in bf16; with LoRA the frozen base is held in bf16)
    "single-bf16": (1, 1, 1, ["--bf16"]), "single-bf16-recompute": (1, 1, 1, ["--bf16", *EVERY_BLOCK_FLAGS]),
    "single-lora-bf16": (1, 1, 1, LORA + ["--bf16"]),
    "single-lora-bf16-recompute": (1, 1, 1, LORA + ["--bf16", *EVERY_BLOCK_FLAGS]),
}
WORLD = {"single": 1, "single-recompute": 1, "dp2": 2, "tp2": 2, "sp2": 2, "pp2": 2, "dp2-distopt": 2,
         "single-lora": 1, "single-lora-kl": 1, "dp2-lora": 2, "tp2-lora": 2, "single-bf16": 1,
         "single-bf16-recompute": 1, "single-lora-bf16": 1, "single-lora-bf16-recompute": 1}


class LiveTensorMeter(TorchDispatchMode):
    """Bytes of the tensor storages allocated while active and still alive; their peak.

    Every op's outputs are seen here (backward ops too: CPU autograd runs them on this thread
    with this mode); a storage counts once however many views it has, and stops counting when
    it is freed (a weakref finaliser on the storage)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.phase, self.peak_phase = "build", "build"
        self.phase_peaks = {}
        self._seen = {}

    def _free(self, key, nbytes):
        self.live -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._seen:
                    n = storage.nbytes()
                    self._seen[key] = weakref.finalize(storage, self._free, key, n)
                    self.live += n
                    if self.live > self.peak:
                        self.peak, self.peak_phase = self.live, self.phase
                    if self.live > self.phase_peaks.get(self.phase, 0):
                        self.phase_peaks[self.phase] = self.live
        return out


def write_configs(folder, paths, preset):
    model = {"ae": {"from_pretrained": paths["pipeline"]},
             "text_encoder": {"from_pretrained": paths["pipeline"], "max_sequence_length": preset.text_tokens,
                              "embeddings_cache": paths["cache"]},
             "predictor": {"model_id": "flux", "from_pretrained": paths["transformer"]},
             "reward": [{"name": preset.reward, "weight": 1.0}],
             "image_size": [preset.height, preset.width]}
    with open(os.path.join(folder, "prompts.txt"), "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    data = {"dataset_param": {"prompt_file": "prompts.txt"}, "dataloader_param": {"shuffle": True, "seed": 7}}
    out = []
    for name, cfg in (("model.json", model), ("data.json", data)):
        out.append(os.path.join(folder, name))
        with open(out[-1], "w") as f:
            json.dump(cfg, f)
    return out


def trainer_argv(model_json, data_json, preset, layout, mbs, iters, steps):
    tp, pp, sp, extra = LAYOUTS[layout]
    return ["--mm-model", model_json, "--mm-data", data_json, "--train-iters", str(iters),
            "--prompts-per-iteration", str(preset.prompts_per_iteration), "--num-generations", str(preset.num_generations),
            "--micro-batch-size", str(mbs), "--num-inference-steps", str(steps),
            "--timestep-fraction", str(preset.timestep_fraction), "--lr", str(preset.lr),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", str(sp), "--no-progress-bar", "--log-interval", "1000", *extra]


def measure(argv):
    """(peak bytes, phase of the peak, bytes after building, peak of each phase) of one trainer run
    on this rank."""
    from mm_grpo.parallel import destroy_parallel
    from mm_grpo.training import train_grpo
    from mm_grpo.training.arguments import parse_args
    gc.collect()
    meter = LiveTensorMeter()
    step = train_grpo.optimizer_step

    def labelled(fn, phase):
        def run(*a, **k):
            meter.phase = phase
            try:
                return fn(*a, **k)
            finally:
                meter.phase = "other"
        return run

    train_grpo.optimizer_step = labelled(step, "train")
    try:
        with meter:
            run = train_grpo.GRPORun(parse_args(argv))
            built = meter.live
            run.schedule.prepare = labelled(run.schedule.prepare, "rollout")
            run.train()
            del run
            gc.collect()
    finally:
        train_grpo.optimizer_step = step
    destroy_parallel()
    return meter.peak, meter.peak_phase, built, meter.phase_peaks


def job_of(preset, steps, mbs, extra):
    from mm_grpo.families.flux.plan import Job
    return Job(height=preset.height, width=preset.width, text_tokens=preset.text_tokens,
               num_generations=preset.num_generations, prompts_per_iteration=preset.prompts_per_iteration,
               num_inference_steps=steps, timestep_fraction=preset.timestep_fraction, micro_batch_size=mbs,
               recompute=EVERY_BLOCK_FLAGS[0] in extra, lora_rank=LORA_RANK if "--lora-r" in extra else 0,
               kl_reference="--kl-beta" in extra,
               distributed_optimizer="--use-distributed-optimizer" in extra, bf16="--bf16" in extra,
               param_dtype="fp32")


def predict(row, paths):
    """The plan's prediction for every rank of a measured row: the worst rank's breakdown."""
    from mm_grpo.families.flux.plan import components_of_pipeline
    from mm_grpo.families.flux.plan import model_of, rank_memory
    from mm_grpo.plan.formulas import Layout
    tp, pp, sp, extra = LAYOUTS[row["layout"]]
    job = job_of(PRESETS["bench"], row["steps"], row["mbs"], extra)
    comps = components_of_pipeline(paths["pipeline"], reward=PRESETS["bench"].reward, text_cache=True)
    return rank_memory(model_of(paths["transformer"]), comps, job, Layout(tp=tp, pp=pp, sp=sp, dp=row["dp"]))


def run_measurements(args):
    from mm_grpo.parallel.state import init_process_group
    init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    preset = PRESETS["bench"]
    box = [prepare(preset, default_workdir()) if rank == 0 else None]
    dist.broadcast_object_list(box)
    paths = box[0]
    names = args.layouts or [n for n, (tp, pp, sp, _) in LAYOUTS.items()
                             if WORLD.get(n, 4) == world and world % (tp * pp * sp) == 0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, f"rank{rank}")
        os.makedirs(folder)
        model_json, data_json = write_configs(folder, paths, preset)
        for name in names:
            tp, pp, sp, _ = LAYOUTS[name]
            start = time.time()
            argv = trainer_argv(model_json, data_json, preset, name, args.micro_batch_size, args.iters, args.steps)
            peak, phase, built, phase_peaks = measure(argv)
            mine = dict(rank=rank, measured=peak, phase=phase, built=built, phase_peaks=phase_peaks,
                        seconds=round(time.time() - start, 1))
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            rows.append(dict(layout=name, world=world, tp=tp, pp=pp, sp=sp, dp=world // (tp * pp * sp),
                             steps=args.steps, mbs=args.micro_batch_size, paths=paths, per_rank=everyone))
            if rank == 0:
                print(f"{name}: measured {[round(r['measured'] / MiB, 1) for r in everyone]} MiB per rank "
                      f"({mine['seconds']} s, under others' load)", flush=True)
                append_json(args.json, rows[-1:])
    dist.destroy_process_group()


def append_json(path, rows):
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    with open(path + ".tmp", "w") as f:
        json.dump(old + rows, f, indent=1)
    os.replace(path + ".tmp", path)


def report(path):
    """The validation table: each layout's worst rank, measured vs predicted, for the whole run
    and for its two phases (rollout + decode + reward; training)."""
    with open(path) as f:
        rows = json.load(f)
    print("| layout | ranks | TP | PP | SP | DP | peak measured MiB | predicted | error "
          "| train phase measured | predicted | error | rollout + decode measured | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    for row in rows:
        stages = predict(row, row["paths"]).stages
        measured = {"peak": max(r["measured"] for r in row["per_rank"]),
                    "train": max(r["phase_peaks"]["train"] for r in row["per_rank"]),
                    "rollout": max(r["phase_peaks"]["rollout"] for r in row["per_rank"])}
        predicted = {"peak": max(s.peak_bytes for s in stages),
                     "train": max(s.phases["train"] for s in stages),
                     "rollout": max(max(s.phases["rollout"], s.phases["decode"]) for s in stages)}
        cells = []
        for key in ("peak", "train", "rollout"):
            error = predicted[key] / measured[key] - 1
            worst_error = max(worst_error, abs(error))
            cells.append(f"{measured[key] / MiB:.1f} | {predicted[key] / MiB:.1f} | {100 * error:+.1f}%")
        print(f"| {row['layout']} | {row['world']} | {row['tp']} | {row['pp']} | {row['sp']} | {row['dp']} | "
              + " | ".join(cells) + " |")
    print(f"largest error {100 * worst_error:.1f}%")
    return worst_error


def probe_vae():
    """Values per output pixel of one image's no-grad decode (families/flux/plan.py's constants): the
    FLUX.1 VAE architecture (random weights; the slope between 64 and 128 px, where the full-resolution
    levels dominate) and the bench pipeline's tiny VAE at 256 px, both fp32."""
    from diffusers import AutoencoderKL
    from mm_grpo.families.flux.vae import VaeDecoder
    torch.manual_seed(0)
    flux = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                         up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                         layers_per_block=2, latent_channels=16, norm_num_groups=32).eval().requires_grad_(False)
    peaks = {}
    for size in (64, 128):
        meter = LiveTensorMeter()
        latents = torch.randn(1, 16, size // 8, size // 8)
        with meter, torch.no_grad():
            flux.decode(latents, return_dict=False)
        peaks[size] = meter.peak
    slope = (peaks[128] - peaks[64]) / (128 ** 2 - 64 ** 2) / 4
    print(f"FLUX.1 VAE decode: {slope:.1f} values per pixel (fp32 peak {peaks[64] / MiB:.1f} MiB at 64 px, "
          f"{peaks[128] / MiB:.1f} MiB at 128 px)")
    decoder = VaeDecoder(prepare(PRESETS["bench"], default_workdir())["pipeline"])
    meter = LiveTensorMeter()
    with meter:
        decoder(torch.randn(1, 256, 16), 256, 256)
    print(f"tiny pipeline VAE decode: {meter.peak / 256 ** 2 / 4:.1f} values per pixel at 256 px")


# Measured GRPO iterations at FLUX.1-dev's width on one GPU (bench/full_size.py, random weights, G = 12
# at 512 px, jpeg reward, LoRA 64 on the recommended targets unless full), all on the fp32-residual
# layout (bf16 autocast over fp32 parameters): (name, profile, measured matmul TFLOP/s, block
# overrides of flux-dev, Job fields, --compile-blocks, measured (rollout, train, decode + reward) s,
# source). The first two are the time model's calibration (mm_grpo/families/flux/calibration.py).
TIME_RUNS = [
    ("H200 eager (calibration)", "h200", 785.6, {}, dict(height=512, micro_batch_size=12, lora_rank=64), False,
     (9.590, 18.963, 0.492), "docs/measurements/h200_2026-11-28/grpo.json"),
    ("H200 compiled (calibration)", "h200", 785.6, {}, dict(height=512, micro_batch_size=12, lora_rank=64), True,
     (8.353, 15.086, 0.494), "docs/measurements/h200_2026-11-28/grpo_compiled.json"),
    # The runs below were measured on the earlier fp32-residual autocast layout: the plan (calibrated
    # on the bf16 layout) is expected to be faster than them.
    ("H100 eager, the same job", "h100", 731.8, {}, dict(height=512, micro_batch_size=12, lora_rank=64), False,
     (15.657, 29.525, 0.264), "docs/measurements/h100_2026-11-27/flux_dev.json"),
    ("H100 eager, 1024 px, m = 6, N = 4", "h100", 769.0, {},
     dict(height=1024, micro_batch_size=6, lora_rank=64, num_inference_steps=4), False, (14.1, 12.4, 1.7),
     "docs/performance.md (the process's first iteration)"),
    ("H200 eager, FLUX width, full", "h200", 794.1, dict(num_layers=2, num_single_layers=4),
     dict(height=512, micro_batch_size=12, text_tokens=128, recompute=False), False, (1.035, 1.617, 0.213),
     "docs/measurements/h200_2026-11-27/width.json"),
    ("H200 compiled, FLUX width, full", "h200", 769.5, dict(num_layers=2, num_single_layers=4),
     dict(height=512, micro_batch_size=12, text_tokens=128, recompute=False), True, (0.861, 1.193, 0.228),
     "docs/measurements/h200_2026-11-27/compiled.json"),
    ("H100 eager, FLUX width, full", "h100", 747.3, dict(num_layers=2, num_single_layers=4),
     dict(height=512, micro_batch_size=12, text_tokens=128, recompute=False), False, (1.147, 1.896, 0.249),
     "docs/measurements/h100_2026-11-27/flux_width.json"),
    ("H200 eager, 7 + 14 blocks, full, m = 1", "h200", 747.8, dict(num_layers=7, num_single_layers=14),
     dict(height=512, micro_batch_size=1), False, (7.681, 25.860, 0.235),
     "docs/measurements/h200_2026-11-27/depth_7_14.json"),
    ("H200 eager, 8 + 16 blocks, full, m = 1", "h200", 765.4, dict(num_layers=8, num_single_layers=16),
     dict(height=512, micro_batch_size=1), False, (9.048, 29.446, 0.238),
     "docs/measurements/h200_2026-11-27/depth_8_16.json"),
]


def time_report():
    """The plan's seconds for each of TIME_RUNS (its card at the matmul rate measured with it) against the measured."""
    from mm_grpo.families.flux.transformer import FluxConfig
    from mm_grpo.plan import devices
    from mm_grpo.families.flux import plan as f
    from mm_grpo.plan.formulas import Layout
    from mm_grpo.families.flux.plan import components
    comps = components(reward="jpeg_compressibility")
    print("| run | measured s (rollout / train / decode) | predicted | iteration error | rollout | train |")
    print("|---|---|---|---|---|---|")
    for name, card, tflops, arch, fields, compiled, measured, source in TIME_RUNS:
        job = f.Job(width=fields["height"], num_generations=12, bf16=True, compile_blocks=compiled, **fields)
        parts = f.iteration_time(FluxConfig.preset("flux-dev", **arch), comps, job, Layout(),
                                 devices.device(card, matmul_tflops=tflops)).parts
        planned = [parts[k] for k in ("rollout", "train", "decode_reward")]
        err = lambda a, b: f"{a / b - 1:+.1%}"  # noqa: E731
        print(f"| {name} | {sum(measured):.2f} ({' / '.join(f'{x:.2f}' for x in measured)}) | {sum(planned):.2f} "
              f"({' / '.join(f'{x:.2f}' for x in planned)}) | {err(sum(planned), sum(measured))} | "
              f"{err(planned[0], measured[0])} | {err(planned[1], measured[1])} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=None, help="default: every layout of this world size")
    p.add_argument("--micro-batch-size", type=int, default=3, help="rollout and training micro-batch (3: DP4 divides)")
    p.add_argument("--steps", type=int, default=PRESETS["bench"].num_inference_steps, help="denoising steps N")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json", default="plan_validation.json", help="measurements are appended here")
    p.add_argument("--report", action="store_true", help="print the table of --json with the predictions")
    p.add_argument("--probe-vae", action="store_true", help="measure the VAE decode constants instead")
    p.add_argument("--time", action="store_true", help="the time model against the measured GPU iterations (TIME_RUNS)")
    args = p.parse_args()
    if args.time:
        time_report()
    elif args.probe_vae:
        probe_vae()
    elif args.report:
        report(args.json)
    else:
        run_measurements(args)


if __name__ == "__main__":
    main()
