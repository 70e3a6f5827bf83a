"""GRPO iteration benchmark: mm-grpo against a DanceGRPO-style reference and the FLOP floor.

    python -m bench.bench_grpo --preset bench [--iters 3 --warmup 1 --threads 2 --json out.json]

Both implementations run in one command on the same machine, each in its own process (so
that each has its own peak memory), taking turns iteration by iteration with the same
preset, weights, prompts, noises, trained timesteps and reward. Iteration 0 is the
warm-up; its rollout log-probs, rewards and first gradient norm are compared to show the
two do the same work. Before every round the machine's matmul throughput is measured;
FLOP floor = analytic iteration FLOPs (bench/flops.py) / median throughput, and
MFU = FLOPs / (seconds x throughput). On CPU the same is also computed from CPU time per
thread (iteration and matmul alike), which other jobs on a shared machine disturb less than
wall time. See docs/performance.md.
"""
import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from bench.flops import counted_flops, grpo_iteration_flops
from bench.grpo_setup import PRESETS, build_mm_grpo, components, default_workdir, iteration_prompts, prepare

IMPLEMENTATIONS = ("reference", "mm-grpo")


# glibc's malloc returns freed blocks above 128 kB to the OS, so every large activation is
# page-faulted in again (~160k minor faults per bench-preset iteration); these keep them.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def matmul_throughput(device, dtype, size, repeats=5):
    """Best FLOP/s of a square matmul, the machine's attainable matmul rate right now: per
    wall second, and per CPU second of this process divided by the thread count."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    sync = (lambda: None) if device.type == "cpu" else getattr(torch, device.type).synchronize
    a @ b
    wall = cpu = float("inf")
    for _ in range(repeats):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        a @ b
        sync()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    flops = 2 * size ** 3
    return flops / wall, flops / (cpu / torch.get_num_threads())


def decode_flops(preset, paths, device) -> int:
    """FLOPs of one VAE decode (convolutions and attention), counted by FlopCounterMode."""
    from mm_grpo.families.flux.transformer.latents import num_image_tokens
    _, decoder, _ = components(preset, paths, device)
    tokens = num_image_tokens(preset.height, preset.width)
    latent = torch.zeros(1, tokens, 4 * decoder.vae.config.latent_channels, device=device)
    return counted_flops(decoder, latent, preset.height, preset.width)


# --- the two implementations, each in a worker process ------------------------------------
class MMGRPORunner:
    def __init__(self, preset, paths, device, **_):
        from mm_grpo.grpo.schedule import GRPOSchedule

        class Recording(GRPOSchedule):  # keeps what the equal-work check compares
            def sample(self, *args, **kwargs):
                traj = super().sample(*args, **kwargs)
                self.last_log_probs = traj.log_probs.cpu()
                return traj

            def score(self, x0_hat, prompts):
                out = super().score(x0_hat, prompts)
                self.last_rewards = out[1].cpu()
                return out

        self.preset = preset
        self.schedule, self.step = build_mm_grpo(preset, paths, device, schedule_cls=Recording)

    def iteration(self, it):
        stats = self.step(it, iteration_prompts(self.preset, it))
        return dict(time_rollout=stats["time_rollout"], time_reward=stats["time_reward"],
                    time_train=stats["time_train"], log_probs=self.schedule.last_log_probs,
                    rewards=self.schedule.last_rewards, grad_norms=[stats["grad_norm"]])


class ReferenceRunner:
    def __init__(self, preset, paths, device, checkpointing=True):
        from bench.dance_reference import DanceGRPOReference
        conditioner, decoder, reward = components(preset, paths, device)
        self.preset = preset
        self.ref = DanceGRPOReference(preset.settings(), paths["transformer"], conditioner, decoder, reward,
                                      lr=preset.lr, accumulation=preset.batch, checkpointing=checkpointing,
                                      bf16=preset.bf16, device=device)

    def iteration(self, it):
        return self.ref.iteration(it, iteration_prompts(self.preset, it))


def _worker(conn, name, preset, paths, threads, checkpointing):
    torch.set_num_threads(threads)
    import mm_grpo
    device = mm_grpo.get_platform().device
    runner_cls = ReferenceRunner if name == "reference" else MMGRPORunner
    runner = runner_cls(preset, paths, device, checkpointing=checkpointing)
    platform = mm_grpo.get_platform()
    conn.send("ready")
    while True:
        it = conn.recv()
        if it is None:
            break
        if device.type != "cpu":
            getattr(torch, device.type).reset_peak_memory_stats(device)
        platform.synchronize()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, start_cpu = time.perf_counter(), time.process_time()
        out = runner.iteration(it)
        platform.synchronize()
        out.update(time_total=time.perf_counter() - start, cpu_total=time.process_time() - start_cpu,
                   peak_memory=platform.max_memory_allocated(),
                   page_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        conn.send(out)


class Worker:
    def __init__(self, name, *args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, name, *args), daemon=True)
        self.process.start()
        self._expect("ready")

    def _expect(self, what=None):
        if not self.conn.poll(3600):
            raise RuntimeError("benchmark worker timed out")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError("benchmark worker died (its traceback is above)") from None
        if what is not None and msg != what:
            raise RuntimeError(f"benchmark worker: expected {what!r}, got {msg!r}")
        return msg

    def run(self, it):
        self.conn.send(it)
        return self._expect()

    def close(self):
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(60)


# --- report ---------------------------------------------------------------------------------
def equal_work(ref, mm) -> dict:
    d_logp = (ref["log_probs"] - mm["log_probs"]).abs().max().item()
    d_reward = (ref["rewards"] - mm["rewards"]).abs().max().item()
    g_ref, g_mm = ref["grad_norms"][0], mm["grad_norms"][0]
    return dict(max_abs_log_prob_diff=d_logp, max_abs_reward_diff=d_reward,
                reward_range=(mm["rewards"].min().item(), mm["rewards"].max().item()),
                grad_norm_reference=g_ref, grad_norm_mm_grpo=g_mm,
                grad_norm_rel_diff=abs(g_ref - g_mm) / max(abs(g_ref), 1e-30))


def summarize(runs, flops, throughput, cpu_throughput, batch, threads) -> dict:
    timed = runs[1:] or runs  # iteration 0 is the warm-up
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    total, cpu = med("time_total"), med("cpu_total") / threads
    return dict(rollout=med("time_rollout"), decode_reward=med("time_reward"), train=med("time_train"),
                iteration=total, images_per_s=batch / total, peak_memory_mib=max(r["peak_memory"] for r in runs) / 2**20,
                mfu=flops / (total * throughput), x_floor=total * throughput / flops,
                cpu_iteration=cpu, cpu_mfu=flops / (cpu * cpu_throughput), page_faults=med("page_faults"),
                iterations=[round(r["time_total"], 3) for r in timed])


def report(preset, params, n_txt, n_img, trained, flops, throughputs, summaries, check, loads, threads, device):
    names = [n for n in IMPLEMENTATIONS if n in summaries]
    throughput = statistics.median(t for t, _ in throughputs)
    cpu_throughput = statistics.median(c for _, c in throughputs)
    throughputs = [t for t, _ in throughputs]
    lines = [
        f"preset {preset.name}: FLUX {params / 1e6:.2f}M parameters, {n_txt} text + {n_img} image tokens, "
        f"G={preset.num_generations} x {preset.prompts_per_iteration} prompt(s) = {preset.batch} images, "
        f"N={preset.num_inference_steps}, {trained} trained steps, {'bf16' if preset.bf16 else 'fp32'}, "
        f"{device}, {threads} threads; mm-grpo micro-batch {preset.micro_batch_size}"
        f"{', recompute' if preset.recompute else ''}{', compiled blocks' if preset.compile else ''}",
        f"iteration FLOPs: rollout {flops.rollout / 1e12:.3f} T, train {flops.train / 1e12:.3f} T, "
        f"VAE decode {flops.decode / 1e12:.3f} T; total {flops.total / 1e12:.3f} TFLOP",
        f"matmul throughput: median {throughput / 1e9:.1f} GFLOP/s of {len(throughputs)} "
        f"(min {min(throughputs) / 1e9:.1f}, max {max(throughputs) / 1e9:.1f}); "
        f"FLOP floor {flops.total / throughput:.2f} s; per CPU second / threads: {cpu_throughput / 1e9:.1f} GFLOP/s",
        f"load average: start {loads[0]:.2f}, end {loads[1]:.2f}", "",
        f"{'':24}" + "".join(f"{n:>12}" for n in names)]
    rows = [("rollout s", "rollout", "{:.2f}"), ("decode+reward s", "decode_reward", "{:.2f}"),
            ("train s", "train", "{:.2f}"), ("iteration s", "iteration", "{:.2f}"),
            ("images / s", "images_per_s", "{:.2f}"), ("peak memory MiB", "peak_memory_mib", "{:.0f}"),
            ("MFU", "mfu", "{:.1%}"), ("x FLOP floor", "x_floor", "{:.2f}"),
            ("CPU s / threads", "cpu_iteration", "{:.2f}"), ("MFU by CPU time", "cpu_mfu", "{:.1%}"),
            ("minor page faults", "page_faults", "{:.0f}")]
    if device.type != "cpu":
        rows = rows[:-3]
    for label, key, fmt in rows:
        lines.append(f"{label:24}" + "".join(f"{fmt.format(summaries[n][key]):>12}" for n in names))
    if check is None:
        return "\n".join(lines), None
    ratio = summaries["reference"]["iteration"] / summaries["mm-grpo"]["iteration"]
    cpu_ratio = summaries["reference"]["cpu_iteration"] / summaries["mm-grpo"]["cpu_iteration"]
    lines += ["", f"ratio reference / mm-grpo: {ratio:.2f}x (iteration time), {cpu_ratio:.2f}x (CPU time)",
              f"equal work (iteration 0): max |d log-prob| {check['max_abs_log_prob_diff']:.2e}, "
              f"max |d reward| {check['max_abs_reward_diff']:.2e} (rewards in [{check['reward_range'][0]:.3f}, "
              f"{check['reward_range'][1]:.3f}]), grad norm {check['grad_norm_reference']:.6g} vs "
              f"{check['grad_norm_mm_grpo']:.6g} (rel. diff {check['grad_norm_rel_diff']:.1e})"]
    return "\n".join(lines), ratio


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per implementation (after 1 warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--no-reference-checkpointing", action="store_true",
                   help="run the reference without DanceGRPO's per-block activation checkpointing")
    p.add_argument("--mm-micro-batch", type=int, default=None,
                   help="mm-grpo's rollout / training micro-batch (default: the preset's, a whole group)")
    p.add_argument("--mm-recompute", action="store_true", help="mm-grpo with activation checkpointing per block")
    p.add_argument("--mm-compile", action="store_true",
                   help="mm-grpo with torch.compile'd blocks (compiled during the warm-up iteration)")
    p.add_argument("--only", choices=IMPLEMENTATIONS, default=None, help="run one implementation (no comparison)")
    p.add_argument("--workdir", default=None, help="pipeline folder and text cache (default $MM_GRPO_BENCH_DIR "
                   "or /tmp/mm_grpo_bench)")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    import mm_grpo
    from mm_grpo.families.flux.transformer import FluxConfig
    from mm_grpo.families.flux.transformer.latents import num_image_tokens
    platform = mm_grpo.get_platform()
    if platform.name == "cpu":  # the workers keep freed memory, as shell/launch_env.sh sets it for CPU runs
        os.environ.update({k: os.environ.get(k, v) for k, v in CPU_MALLOC_ENV.items()})
    preset = PRESETS[args.preset]
    preset = dataclasses.replace(preset, micro_batch_size=args.mm_micro_batch or preset.micro_batch_size,
                                 recompute=args.mm_recompute or preset.recompute,
                                 compile=args.mm_compile or preset.compile)
    if preset.bf16 and platform.name == "cpu":
        raise SystemExit(f"preset {preset.name} runs in bf16 and needs an accelerator (megatron-core's linear "
                         "layers do not support bf16 autocast on CPU)")
    paths = prepare(preset, Path(args.workdir) if args.workdir else default_workdir())
    config = FluxConfig.from_diffusers_config(paths["transformer"])
    settings = preset.settings()
    n_img, n_txt = num_image_tokens(preset.height, preset.width), preset.text_tokens
    trained = settings.trained_steps_per_sample
    flops = grpo_iteration_flops(config, n_txt, n_img, preset.batch, settings.num_inference_steps, trained,
                                 decode_flops(preset, paths, platform.device))
    from diffusers import FluxTransformer2DModel
    params = sum(t.numel() for t in FluxTransformer2DModel.from_pretrained(paths["transformer"]).parameters())
    dtype, size = (torch.bfloat16, 8192) if preset.bf16 else (torch.float32, 2048)

    names = (args.only,) if args.only else IMPLEMENTATIONS
    loads = [os.getloadavg()[0]]
    workers = {name: Worker(name, preset, paths, args.threads, not args.no_reference_checkpointing)
               for name in names}
    runs, throughputs = {name: [] for name in names}, []
    try:
        for it in range(1 + args.iters):
            throughputs.append(matmul_throughput(platform.device, dtype, size))
            for name in names if it % 2 == 0 else names[::-1]:  # alternate who goes first
                runs[name].append(workers[name].run(it))
                print(f"[bench] iteration {it} {name}: {runs[name][-1]['time_total']:.2f} s", flush=True)
    finally:
        for w in workers.values():
            w.close()
    loads.append(os.getloadavg()[0])
    throughput = statistics.median(t for t, _ in throughputs)
    cpu_throughput = statistics.median(c for _, c in throughputs)
    summaries = {n: summarize(runs[n], flops.total, throughput, cpu_throughput, preset.batch, args.threads)
                 for n in names}
    check = equal_work(runs["reference"][0], runs["mm-grpo"][0]) if len(names) == 2 else None
    text, ratio = report(preset, params, n_txt, n_img, trained, flops, throughputs, summaries, check, loads,
                         args.threads, platform.device)
    print(text)
    if args.json:
        result = dict(preset=preset.name, flops=vars(flops) | {"total": flops.total}, throughput=throughputs,
                      summaries=summaries, equal_work=check, ratio=ratio, loads=loads, threads=args.threads,
                      device=str(platform.device), reference_checkpointing=not args.no_reference_checkpointing,
                      mm_micro_batch=preset.micro_batch_size, mm_recompute=preset.recompute,
                      mm_compile=preset.compile)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=float)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
