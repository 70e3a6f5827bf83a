"""What the GRPO loop costs around the model: a rollout step and a training micro-batch as the
trainer runs them, against the model call alone on the same model and inputs (issue 48, "a lean loop").

    python -m bench.loop_overhead --threads 1                      # CPU: the bench preset's widths
    python -m bench.loop_overhead --model flux-dev                 # a GPU: FLUX.1-dev, 12 x 512 px
    python -m bench.loop_overhead --profile /tmp/loop_profile.txt  # + what outside the model costs

(a) rollout step: the schedule's `sample` (the step noise drawn for the rollout, `make_velocity_fn`'s
    micro-batches through megatron-core's forward-only schedule, the sampler's SDE step and log-prob,
    the trajectory's bookkeeping) divided by its N steps, against `model(**inputs)` under no_grad on
    the same micro-batches of one step.
(b) training micro-batch: `forward_backward` of the rollout's trained micro-batches with the
    objective's loss, as `optimizer_step` runs them, per micro-batch, against the model's forward and
    a backward of its output alone on each (same inputs, recompute, DDP-held parameters and their
    gradient hooks); and a whole `optimizer_step` (zeroing, forward_backward, the finite check, Adam,
    the LR step) plus the micro-batches' building, per micro-batch.

The model is built as the trainer builds it (megatron-core DDP and optimizer, LoRA adapters of
`--lora-rank` on the recommended targets, the frozen base in bf16 under autocast with --bf16, the
default on an accelerator), with random weights and random text embeddings; the schedule is the
trainer's `GRPOSchedule`. Timings are the fastest of `--repeats` turns, the loop and the bare model
taking turns: wall time on an accelerator, the process's CPU time on a CPU (what other processes on
the machine do not inflate; run with --threads 1).

`--profile`: torch.profiler over one rollout and one optimizer step with the model's forward and
backward marked; the ops outside them by self time (CPU time on a CPU, device time on a GPU), the
host syncs (`.item()`, `bool()` of a tensor...), collectives and top-level ops (dispatches: kernel
launches on an accelerator) outside the model per rollout step / per micro-batch, and the host syncs
inside it. Issue 48's targets: a rollout step within 1.1x of the model call (LoRA included), a
training micro-batch within 1.15x of its forward + backward.
"""
import argparse
import contextlib
import json
import time
from typing import Callable, Dict, List

import torch

from mm_grpo.recompute import EVERY_BLOCK, recompute_fields

MODELS = {  # FluxConfig preset, overrides, default (image side, G = batch, text tokens, steps)
    # FLUX.1-dev at its real shapes: the measurement (one H200, 12 x 512 px, 512 text tokens)
    "flux-dev": ("flux-dev", {}, (512, 12, 512, 16)),
    # bench_grpo's `bench` preset widths (D = 256: 2 heads of 128, 2 double + 4 single blocks) with
    # FLUX.1's in / text widths: CPU matmuls near their peak, the loop's overhead in proportion
    "bench": ("flux-dev", dict(num_layers=2, num_single_layers=4, num_attention_heads=2), (256, 12, 32, 16)),
    # the tiny pipeline's transformer (D = 64): launch and Python overhead dominate
    "tiny": ("tiny", {}, (64, 8, 32, 8)),
}
MODEL_RANGE = "## model ##"  # the profiler range around each model forward and backward
# What runs on CPU tensors on an accelerator too: the rollout's per-step decisions made on the host
# (`stochastic_steps`, on one-element CPU latents: no kernel, no sync), and the reads of torch Adam's
# step counters (CPU tensors unless capturable / fused).
HOST_RANGE = "## host ##"
HOST_READ_RANGES = (HOST_RANGE, "Optimizer.step#")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench", choices=sorted(MODELS))
    p.add_argument("--depth", type=int, nargs=2, default=None, metavar=("DOUBLE", "SINGLE"),
                   help="blocks of each kind (default: the model's)")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default: the model's)")
    p.add_argument("--batch", type=int, default=None, help="G: one group per rollout (default: the model's)")
    p.add_argument("--micro-batch", type=int, default=None, help="rollout and training micro-batch (default: G)")
    p.add_argument("--text-tokens", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="N denoising steps")
    p.add_argument("--sampler", default="dance_sde")
    p.add_argument("--lora-rank", type=int, default=64, help="0: full fine-tuning")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="frozen base in bf16 under bf16 autocast (default: on an accelerator)")
    p.add_argument("--no-recompute", action="store_true", help="training without per-block recompute")
    p.add_argument("--repeats", type=int, default=None, help="timed turns (default: 3, flux-dev 2)")
    p.add_argument("--train-micro-batches", type=int, default=None,
                   help="train on the rollout's first M micro-batches only (default: all K; flux-dev 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--profile", default=None, help="write the profile's tables to this file")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Setup:
    """The trainer's model, optimizer and schedule for one group, and a rollout's inputs."""

    def __init__(self, args):
        import mm_grpo
        from bench.grpo_setup import optimizer_args
        from mm_grpo.grpo.hyperparameters import GRPOSettings
        from mm_grpo.grpo.schedule import GRPOSchedule
        from mm_grpo.families.flux.denoiser import FluxDenoiser
        from mm_grpo.families.flux.transformer import FluxConfig, lora
        from mm_grpo.parallel import ParallelConfig, initialize_parallel
        from mm_grpo.families.flux.chunks import build_model_chunks
        from mm_grpo.seeding import DEFAULT_SEED
        from mm_grpo.training.trainable import attach_lora, optimize
        self.platform = mm_grpo.get_platform()
        device = self.device = self.platform.device
        preset, overrides, (size, batch, text, steps) = MODELS[args.model]
        self.size, self.batch = args.size or size, args.batch or batch
        self.text_tokens, self.steps = args.text_tokens or text, args.steps or steps
        self.micro_batch = args.micro_batch or self.batch
        bf16 = args.bf16 if args.bf16 is not None else device.type != "cpu"
        if args.depth:
            overrides = dict(overrides, num_layers=args.depth[0], num_single_layers=args.depth[1])
        initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
        self.config = FluxConfig.preset(preset, bf16=bf16, **recompute_fields(None if args.no_recompute else EVERY_BLOCK), **overrides)
        self.chunks = [chunk.to(device) for chunk in build_model_chunks(self.config)]
        if args.lora_rank:
            attach_lora(self.chunks, lora.LoRAConfig(r=args.lora_rank, alpha=args.lora_rank), DEFAULT_SEED, bf16)
        self.policy, self.optimizer, self.scheduler = optimize(self.chunks, optimizer_args(1e-5))
        settings = GRPOSettings(prompts_per_iteration=1, micro_batch_size=self.micro_batch,
                                num_generations=self.batch, num_inference_steps=self.steps, sampler=args.sampler,
                                height=self.size, width=self.size, seed=DEFAULT_SEED)
        g = torch.Generator().manual_seed(0)
        cfg = self.config
        text = (torch.randn(1, self.text_tokens, cfg.joint_attention_dim, generator=g),
                torch.randn(1, cfg.pooled_projection_dim, generator=g), torch.zeros(self.text_tokens, 3))
        self.schedule = GRPOSchedule(settings, self.chunks, conditioner=lambda prompts: text, decoder=None,
                                     reward=None, denoiser=FluxDenoiser.of(self.chunks, self.size, self.size),
                                     device=device)
        self.prompts = ["a prompt"] * self.batch
        self.cond = self.schedule.conditioning(self.prompts)
        self.samples = self.schedule.local_samples()

    def synchronize(self):
        self.platform.synchronize()

    @property
    def clock(self):
        """Wall time on an accelerator; on a CPU the process's CPU time, which other processes on the
        machine do not inflate (run with --threads 1)."""
        return time.process_time if self.device.type == "cpu" else time.perf_counter

    # --- (a) the rollout ------------------------------------------------------------------------
    def rollout(self, iteration=0):
        return self.schedule.sample(iteration, self.prompts, self.samples, self.cond)

    def model_inputs(self, x, sigma) -> List[Dict]:
        """The forward kwargs of each micro-batch at latents x [B, S, C] and sigma [B]."""
        from mm_grpo.families.flux.chunks import PER_SAMPLE_CONDITIONING
        m, cond = self.micro_batch, self.cond
        return [dict({k: cond[k][i:i + m] for k in PER_SAMPLE_CONDITIONING if cond.get(k) is not None},
                     hidden_states=x[i:i + m], timestep=sigma[i:i + m], img_ids=cond["img_ids"],
                     txt_ids=cond["txt_ids"]) for i in range(0, self.batch, m)]

    @torch.no_grad()
    def model_calls(self, inputs: List[Dict]):
        """The model alone over a rollout step's micro-batches (what the step cannot do without)."""
        return [self.chunks[0](**mb) for mb in inputs]

    # --- (b) training ---------------------------------------------------------------------------
    def micro_batches(self, traj, iteration=0):
        from mm_grpo.grpo.draws import draw_trained_steps
        adv = torch.linspace(-1, 1, self.batch, device=self.device)
        steps = draw_trained_steps(self.schedule.s, iteration, self.samples)
        return self.schedule.micro_batches(traj, self.cond, adv, steps, list(range(self.batch)))

    def forward_backward(self, micro_batches):
        """The micro-batches through forward_backward with the loss, as optimizer_step runs them."""
        from mm_grpo.families.flux.chunks import forward_backward
        for chunk in self.policy:
            chunk.zero_grad_buffer()
        return forward_backward(self.policy, micro_batches, self.schedule.loss_fn)

    def optimizer_step(self, micro_batches):
        from mm_grpo.families.flux.chunks import forward_backward
        from mm_grpo.training.loop import optimizer_step
        return optimizer_step(self.policy, self.optimizer, self.scheduler, micro_batches, self.schedule.loss_fn,
                              forward_backward=forward_backward)

    def model_forward_backward(self, micro_batches, grads):
        """The model's forward and a backward of its output alone on each micro-batch (the same
        parameters, gradient buffers and hooks)."""
        for chunk in self.policy:
            chunk.zero_grad_buffer()
        for mb, grad in zip(micro_batches, grads):
            self.chunks[0](**forward_inputs(mb)).backward(grad)


def forward_inputs(mb: Dict) -> Dict:
    from mm_grpo.families.flux.chunks import FORWARD_KEYS
    return {k: mb[k] for k in FORWARD_KEYS if k in mb}


def timed(fn: Callable, sync: Callable, clock: Callable) -> float:
    sync()
    start = clock()
    fn()
    sync()
    return clock() - start


def take_turns(cases: Dict[str, Callable], sync, repeats: int, clock: Callable) -> Dict[str, float]:
    """Fastest seconds of each case, the cases run in turn `repeats` times (after one warm-up)."""
    runs = {name: [] for name in cases}
    for r in range(repeats + 1):
        for name, fn in cases.items():
            t = timed(fn, sync, clock)
            if r:
                runs[name].append(t)
    return {name: min(ts) for name, ts in runs.items()}


def measure(setup: Setup, repeats: int, train_micro_batches=None) -> dict:
    n = setup.steps
    traj = setup.rollout()
    # a step's inputs as the rollout has them (its latents are a contiguous step output)
    x, sigma = traj.latents[:, n // 2].contiguous(), setup.schedule.sigmas[n // 2].repeat(setup.batch)
    step_inputs = setup.model_inputs(x, sigma)
    micro_batches = setup.micro_batches(traj)[:train_micro_batches]
    k = len(micro_batches)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(mb["hidden_states"].shape, generator=g).to(setup.device) for mb in micro_batches]
    # The optimizer steps move the weights: the rollout's turns first, on the starting weights.
    rollout = take_turns({"rollout": lambda: setup.rollout(), "model_call": lambda: setup.model_calls(step_inputs),
                          "noise": lambda: setup.schedule.noise(0, setup.samples)},
                         setup.synchronize, repeats, setup.clock)
    train = take_turns({"forward_backward": lambda: setup.forward_backward(micro_batches),
                        "model_fwd_bwd": lambda: setup.model_forward_backward(micro_batches, grads),
                        "optimizer_step": lambda: setup.optimizer_step(micro_batches),
                        "build_micro_batches": lambda: setup.micro_batches(traj)},
                       setup.synchronize, repeats, setup.clock)
    out = dict(rollout_step=rollout["rollout"] / n, model_call=rollout["model_call"],
               noise_per_step=rollout["noise"] / n,
               train_micro_batch=train["forward_backward"] / k, model_fwd_bwd=train["model_fwd_bwd"] / k,
               optimizer_step_per_micro_batch=train["optimizer_step"] / k,
               build_micro_batches_per_micro_batch=train["build_micro_batches"] / k,
               model_calls_per_step=len(step_inputs), trained_micro_batches=k)
    out.update(rollout_ratio=out["rollout_step"] / out["model_call"],
               train_ratio=out["train_micro_batch"] / out["model_fwd_bwd"],
               optimizer_step_ratio=(out["optimizer_step_per_micro_batch"] + out["build_micro_batches_per_micro_batch"])
               / out["model_fwd_bwd"])
    return out


# --- profile ----------------------------------------------------------------------------------
@contextlib.contextmanager
def model_marked(chunk):
    """The chunk's forward, and the backward from its output's gradient on, inside MODEL_RANGE."""
    from torch.autograd.profiler import record_function
    plain = chunk.forward

    def forward(*args, **kwargs):
        with record_function(MODEL_RANGE):
            out = plain(*args, **kwargs)
        if out.requires_grad:
            def enter_backward(grad):
                scope = record_function(MODEL_RANGE)
                scope.__enter__()
                torch.autograd.Variable._execution_engine.queue_callback(lambda: scope.__exit__(None, None, None))
            out.register_hook(enter_backward)
        return out

    from mm_grpo.rollout import trajectory
    on_host = getattr(trajectory, "stochastic_steps", None)  # (absent before the loop decided on the host)

    def host_decisions(*args, **kwargs):
        with record_function(HOST_RANGE):
            return on_host(*args, **kwargs)

    chunk.forward = forward
    if on_host is not None:
        trajectory.stochastic_steps = host_decisions
    try:
        yield
    finally:
        del chunk.forward
        if on_host is not None:
            trajectory.stochastic_steps = on_host


# .item(), bool(), float(), int() of a tensor, torch.equal: the host waits for the device (counted once
# where one calls the other)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::equal")


def outside_model(events, device_time: bool) -> dict:
    """The profile's ops outside MODEL_RANGE: {name: self time (us)}, and totals: self time inside /
    outside the model, host syncs (SYNC_OPS, but HOST_READ_RANGES' reads of CPU tensors) and collectives
    outside it, and the number of top-level ops (an op not called by another op: one dispatch, one
    kernel launch or more on an accelerator; HOST_RANGE's excluded) outside it."""
    def under(e, names):
        while e is not None:
            if e.name.startswith(names):
                return True
            e = e.cpu_parent
        return False

    def in_model(e):
        return under(e, MODEL_RANGE)

    def top_level(e):
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", "c10d::")):
                return False
            parent = parent.cpu_parent
        return True

    key = "self_device_time_total" if device_time else "self_cpu_time_total"
    out = dict(ops={}, time_in=0.0, time_out=0.0, syncs_in=0, syncs_out=0, collectives_out=0, launches_out=0)
    for e in events:
        if e.name == MODEL_RANGE:
            continue
        t, inside = getattr(e, key, 0.0), in_model(e)
        sync = e.name in SYNC_OPS and not under(e.cpu_parent, SYNC_OPS)
        if inside:
            out["time_in"] += t
            out["syncs_in"] += sync
            continue
        out["time_out"] += t
        out["ops"][e.name] = out["ops"].get(e.name, 0.0) + t
        out["syncs_out"] += sync and not under(e, HOST_READ_RANGES)
        out["collectives_out"] += e.name.startswith("c10d::")
        out["launches_out"] += e.name.startswith("aten::") and top_level(e) and not under(e, HOST_RANGE)
    return out


def profile(setup: Setup, path: str, trained=None, rows: int = 25):
    """Tables of the ops outside the model in one rollout and one optimizer step (and their totals
    per rollout step / per micro-batch), written to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    device_time = setup.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_time else [])
    traj = setup.rollout()
    micro_batches = setup.micro_batches(traj)[:trained]
    report, summary = [], {}
    unit = "device" if device_time else "CPU"
    with model_marked(setup.chunks[0]):
        for name, per, fn in (("rollout", setup.steps, lambda: setup.rollout()),
                              ("optimizer_step", len(micro_batches), lambda: setup.optimizer_step(micro_batches))):
            with torch_profile(activities=activities) as prof:
                fn()
                setup.synchronize()
            o = outside_model(prof.events(), device_time)
            what = "rollout step" if name == "rollout" else "micro-batch"
            keys = ("time_in", "time_out", "syncs_in", "syncs_out", "collectives_out", "launches_out")
            summary[name] = {f"{k}_per_{what.replace(' ', '_').replace('-', '_')}": o[k] / per for k in keys}
            plural = "rollout steps" if name == "rollout" else "micro-batches"
            lines = [f"== {name} ({per} {plural}), per {what}: {unit} self time inside the model "
                     f"{o['time_in'] / per / 1e3:.2f} ms, outside {o['time_out'] / per / 1e3:.2f} ms "
                     f"({o['time_out'] / max(o['time_in'], 1e-9):.2%} of inside); outside: "
                     f"{o['syncs_out'] / per:.2f} host syncs, {o['collectives_out'] / per:.2f} collectives, "
                     f"{o['launches_out'] / per:.1f} top-level ops; inside: {o['syncs_in'] / per:.2f} host syncs",
                     f"{'op (outside the model), whole ' + name:<60} {'ms':>9} {'share':>7}"]
            for op, t in sorted(o["ops"].items(), key=lambda kv: -kv[1])[:rows]:
                lines.append(f"{op[:60]:<60} {t / 1e3:9.2f} {t / max(o['time_out'], 1e-9):7.1%}")
            report.append("\n".join(lines))
    text = "\n\n".join(report) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text, summary


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = Setup(args)
    result = dict(model=args.model, device=str(setup.device), size=setup.size, batch=setup.batch,
                  micro_batch=setup.micro_batch, text_tokens=setup.text_tokens, steps=setup.steps,
                  lora_rank=args.lora_rank, bf16=setup.config.bf16, recompute=setup.config.recompute is not None,
                  threads=torch.get_num_threads(), torch=torch.__version__,
                  clock="wall" if setup.clock is time.perf_counter else "process CPU time")
    full = args.model == "flux-dev"
    result.update(measure(setup, args.repeats or (2 if full else 3), args.train_micro_batches or (3 if full else None)))
    print(json.dumps(result, indent=1, default=float))
    print(f"[loop_overhead] rollout step {result['rollout_step'] * 1e3:.1f} ms (of which the noise "
          f"{result['noise_per_step'] * 1e3:.1f} ms) / model call "
          f"{result['model_call'] * 1e3:.1f} ms = {result['rollout_ratio']:.3f}x (target 1.1x); training micro-batch "
          f"{result['train_micro_batch'] * 1e3:.1f} ms / model fwd+bwd {result['model_fwd_bwd'] * 1e3:.1f} ms = "
          f"{result['train_ratio']:.3f}x (target 1.15x); optimizer step + micro-batch building per micro-batch "
          f"{result['optimizer_step_ratio']:.3f}x", flush=True)
    if args.profile:
        text, result["profile"] = profile(setup, args.profile, result["trained_micro_batches"])
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)


if __name__ == "__main__":
    main()
