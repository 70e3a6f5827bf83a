"""What the GRPO loop does around the model, counted on the CPU (issue 48, "a lean loop"): host
syncs of a rollout and of an optimizer step, collectives without pipeline stages, and the
full-size temporaries of a sampler step. On an accelerator a host sync stalls the loop until the
device has drained its queue; here they are counted where they are asked for (a read of a value:
`.item()`, `bool()`, `float()`, `torch.equal`; bench/loop_overhead.py profiles the same)."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mm_grpo.rollout import get_sampler, rollout, sigma_schedule
from tests.fixtures import parallel_1proc  # noqa: F401

# A value read back on the host (where the accelerator would be waited for).
READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class Counter(TorchDispatchMode):
    """Counts host reads, collectives and new tensors of `numel` elements (views and in-place results
    excluded) while active, outside the model's forward and backward when `model` is marked (`outside`)."""

    def __init__(self, numel=None, host_tensors=()):
        super().__init__()
        self.numel, self.inside = numel, 0
        self.host = {t.data_ptr() for t in host_tensors}  # kept on the CPU on an accelerator too
        self.reads, self.collectives, self.full_size, self.reads_in_model = 0, 0, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            self.reads_in_model += func in READS
            return out
        self.reads += func in READS and args[0].data_ptr() not in self.host
        self.collectives += func.namespace == "c10d"
        if self.numel and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if out.untyped_storage().data_ptr() not in given:  # new memory (not a view, not in place)
                self.full_size.append(func.overloadpacket.__name__)
        return out

    @contextlib.contextmanager
    def outside(self, chunk):
        """The chunk's forward, and its backward from the output's gradient on, counted apart."""
        plain = chunk.forward

        def forward(*args, **kwargs):
            self.inside += 1
            try:
                out = plain(*args, **kwargs)
            finally:
                self.inside -= 1
            if out.requires_grad:
                def enter(grad):
                    self.inside += 1
                    torch.autograd.Variable._execution_engine.queue_callback(self._leave)
                out.register_hook(enter)
            return out

        chunk.forward = forward
        try:
            yield self
        finally:
            del chunk.forward

    def _leave(self):
        self.inside -= 1

    @contextlib.contextmanager
    def on_host(self):
        """`stochastic_steps` uncounted: its reads are of one-element CPU tensors made on the host
        (the steps' own std checks, once per step of the schedule, before the loop)."""
        from mm_grpo.rollout import trajectory
        plain = trajectory.stochastic_steps

        def probe(*args, **kwargs):
            self.inside += 1
            try:
                return plain(*args, **kwargs)
            finally:
                self.inside -= 1

        trajectory.stochastic_steps = probe
        try:
            yield self
        finally:
            trajectory.stochastic_steps = plain


B, S, C = 3, 32, 4


def _velocity(x, sigma):
    return torch.tanh(x) - sigma.view(-1, 1, 1) * x


@pytest.mark.parametrize("name", ["dance_sde", "flow_sde", "cps"])
def test_a_rollout_reads_nothing_back_per_step(name):
    """No host sync inside the loop: what a step needs from the host (whether it draws noise) is decided
    before the first step, from the schedule; the rollout's results are those of the steps called one
    by one."""
    g = torch.Generator().manual_seed(0)
    for steps in (3, 8):
        latents, noise = torch.randn(B, S, C, generator=g), torch.randn(B, steps, S, C, generator=g)
        sigmas = sigma_schedule(steps)
        with Counter() as count, count.on_host():
            traj = rollout(_velocity, latents, sigmas, name, noise=noise)
        assert count.reads == 0, (steps, count.reads)
        x = latents
        for i in range(steps):
            out = get_sampler(name)(x, _velocity(x, sigmas[i].repeat(B)), sigmas[i], sigmas[i + 1], eps=noise[:, i])
            assert torch.equal(traj.latents[:, i + 1], out.prev_sample)
            if out.log_prob is not None:
                assert torch.equal(traj.log_probs[:, i], out.log_prob)
            x = out.prev_sample
        assert traj.is_sde.tolist() == [True] * (steps - 1) + [name != "cps"]


# Full-size tensors a step makes (rollout, training forward): flow_sde's mean is c_x x + c_v v (two
# products, summed in place), the draw std * eps + mean (one product, the mean added in place), the
# difference to the sample (squared in place; out of place under autograd). dance_sde and cps keep
# their authors' mean (samplers.py: dance_sde's rewritten as c_x x + c_v v moved a Wan run's trained
# layouts apart), term by term. Before: dance_sde made 19 in the rollout and 17 in training's forward.
FULL_SIZE = {"flow_sde": (4, 4), "dance_sde": (13, 13), "cps": (9, 9)}


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_a_sampler_step_allocates_few_full_size_tensors(name):
    """The SDE step and its log-prob in few passes, and no value read back from the device."""
    g = torch.Generator().manual_seed(1)
    x, v, eps = (torch.randn(B, S, C, generator=g) for _ in range(3))
    sigmas = sigma_schedule(16)
    step = get_sampler(name)
    with torch.no_grad(), Counter(numel=x.numel()) as rolled:
        out = step(x, v, sigmas[3], sigmas[4], eps=eps, stochastic=True)
    assert len(rolled.full_size) <= FULL_SIZE[name][0], rolled.full_size
    assert rolled.reads == 0
    v = v.clone().requires_grad_()
    with Counter(numel=x.numel()) as trained:
        again = step(x, v, sigmas[3].repeat(B), sigmas[4].repeat(B), x_next=out.prev_sample, stochastic=True)
    assert len(trained.full_size) <= FULL_SIZE[name][1], trained.full_size
    assert trained.reads == 0
    assert torch.equal(again.log_prob, out.log_prob)  # the recomputation is the rollout's, bit for bit
    with Counter() as checked:  # without `stochastic` the step reads its std back (one host sync)
        step(x, v.detach(), sigmas[3], sigmas[4], eps=eps)
    assert checked.reads == 1


def _setup(steps, lora_rank=4, batch=4, micro_batch=None):
    from bench.loop_overhead import Setup, parse_args
    argv = ["--model", "tiny", "--steps", str(steps), "--batch", str(batch), "--lora-rank", str(lora_rank),
            "--size", "32", "--text-tokens", "8"]
    return Setup(parse_args(argv + (["--micro-batch", str(micro_batch)] if micro_batch else [])))


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_the_trainers_rollout_syncs_once_per_rollout_not_per_step(parallel_1proc, micro_batch):
    """The schedule's rollout on the tiny model (make_velocity_fn through megatron-core's forward-only
    schedule, the SDE steps, the noise): host reads outside the model do not grow with the steps, and
    without pipeline stages the velocity is not broadcast."""
    counts = {}
    for steps in (2, 4):
        setup = _setup(steps, micro_batch=micro_batch)
        setup.rollout()  # first call: lazy initialisation
        with Counter() as count, count.outside(setup.chunks[0]), count.on_host():
            setup.rollout()
        counts[steps] = count
    assert counts[2].reads == counts[4].reads <= 1, (counts[2].reads, counts[4].reads)
    assert counts[2].collectives == counts[4].collectives == 0


def test_an_optimizer_step_syncs_a_few_times_whatever_the_parameters_and_micro_batches(parallel_1proc):
    """forward_backward over the micro-batches, the finite check of the loss and of every gradient (one
    fused reduction), Adam: a constant number of host reads outside the model, not one per parameter
    (LoRA: 2 per adapted linear) or per statistic and micro-batch."""
    reads = {}
    for lora_rank in (0, 4):
        setup = _setup(8, lora_rank=lora_rank)
        micro_batches = setup.micro_batches(setup.rollout())
        assert len(micro_batches) == 4 and sum(p.requires_grad for p in setup.chunks[0].parameters()) > 20
        setup.optimizer_step(micro_batches[:1])  # Adam's state made
        # torch's Adam counts its steps in CPU tensors (on an accelerator too, unless capturable / fused)
        counters = [s["step"] for s in setup.optimizer.optimizer.state.values() if torch.is_tensor(s.get("step"))]
        for n in (1, len(micro_batches)):
            with Counter(host_tensors=counters) as count, count.outside(setup.chunks[0]):
                per_mb, stats = setup.optimizer_step(micro_batches[:n])
            assert stats["skipped"] == 0.0 and len(per_mb) == n
            reads[(lora_rank, n)] = count.reads
    # the finite check's flag (one for the loss and every gradient), the loss's mean over the micro-batches
    # (a CPU read once the statistics crossed, in one copy on an accelerator), megatron's grad norm (2 in its
    # fallback without apex); before: one more per trainable parameter
    assert len(set(reads.values())) == 1 and max(reads.values()) <= 4, reads


def test_the_finite_check_finds_one_bad_gradient_among_many(parallel_1proc):
    from mm_grpo.training.loop import all_finite
    setup = _setup(4)
    micro_batches = setup.micro_batches(setup.rollout())
    setup.forward_backward(micro_batches)
    assert all_finite(0.5, setup.policy)
    assert not all_finite(float("nan"), setup.policy)
    grads = [p.main_grad for p in setup.policy[0].parameters() if p.requires_grad]
    for bad in (float("inf"), float("-inf"), float("nan")):
        grads[len(grads) // 2].view(-1)[-1] = bad
        assert not all_finite(0.5, setup.policy)
        grads[len(grads) // 2].view(-1)[-1] = 0.0
    assert all_finite(0.5, setup.policy)
