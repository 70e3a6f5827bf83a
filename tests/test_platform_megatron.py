"""megatron-core on CPU with the platform's patch set, in one process (gloo, world size 1).

`CALLS` are the CUDA-only Megatron calls the patches cover, one small real use each.
Here (CPU platform, patches in force) each must work and do the right thing; in a
subprocess that simulates a CUDA platform (no patches, no GPU) each must fail: that
shows both that the patch is what makes the call work and that nothing is patched on CUDA.
Then DDP + get_megatron_optimizer (plain and distributed) + the no-pipelining schedule
take two steps that must equal a hand-written AdamW with grad clipping.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.nn import init

import mm_grpo  # noqa: F401  (platform first: patches megatron on import)
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.pipeline_parallel import get_forward_backward_func, p2p_communication, schedules
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.utils import GlobalMemoryBuffer

from mm_grpo.platform import cpu_patches

SEED = 1234
HIDDEN, FFN = 8, 16
MP_SEED_OFFSET = 2718  # megatron: tensor-model-parallel seed = seed + 2718 + tp_rank


def transformer_config(**overrides):
    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True,
                  pipeline_dtype=torch.float32)
    return TransformerConfig(**{**kwargs, **overrides})


class TinyMLP(MegatronModule):
    """Column -> ReLU -> Row: megatron's tensor-parallel MLP pattern, one pipeline stage."""

    def __init__(self, config):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=init.normal_, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=init.normal_, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def set_input_tensor(self, tensor):
        """Nothing arrives from a previous stage without pipelining."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)[0]))[0]


def mse_forward_step(data_iterator, model):
    out = model(next(data_iterator))
    loss_fn = lambda o: (o.pow(2).mean(), {"loss": o.pow(2).mean().detach()})  # noqa: E731
    return out, loss_fn


def run_forward_backward(model, batches, forward_only=False):
    return get_forward_backward_func()(
        forward_step_func=mse_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=batches[0].shape[0],
        micro_batch_size=batches[0].shape[0], forward_only=forward_only)


def init_world_size_1(tmp_dir) -> bool:
    """gloo with one process and megatron's groups; reuses a process group an earlier test left
    up. Returns whether it started the process group."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_dir, 'store')}",
                                rank=0, world_size=1)
    assert dist.get_world_size() == 1
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    return started


def destroy_world(started: bool):
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


# ---- the CUDA-only calls, one use each ------------------------------------------------------

def call_model_parallel_seed():
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    return tensor_parallel.get_cuda_rng_tracker().get_states()


def call_rng_fork():
    """Draws inside two forks and outside them."""
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(4)
    outside = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    return first, outside, second


def call_activation_checkpoint():
    """Dropout in the model-parallel RNG region under megatron's activation checkpointing."""
    def block(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x * 2.0, p=0.5).sum(dim=1)

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    x = torch.linspace(1.0, 2.0, 32).reshape(4, 8).requires_grad_()
    out = tensor_parallel.checkpoint(block, False, x)
    out.sum().backward()
    return out.detach(), x.grad


def call_gpu_weight_init():
    """use_cpu_initialization=False: weights made on the 'current device' under the TP RNG fork."""
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = transformer_config(use_cpu_initialization=False)
    return tensor_parallel.ColumnParallelLinear(
        HIDDEN, FFN, config=config, init_method=init.normal_, bias=False).weight.detach()


def call_ddp():
    config = transformer_config()
    return DistributedDataParallel(config, DistributedDataParallelConfig(), TinyMLP(config))


def call_ddp_offload():
    """Free the grad buffers (e.g. during rollout) and get them back, zeroed."""
    ddp = call_ddp()
    for param in ddp.module.parameters():
        param.main_grad.fill_(1.0)
    ddp.offload_grad_buffers()
    offloaded_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in ddp.buffers)
    ddp.restore_grad_buffers()
    return offloaded_bytes, [p.main_grad for p in ddp.module.parameters()]


def call_distrib_optimizer_load_state():
    """A fresh distributed optimizer (no state yet) loads the state of one that took a step."""
    def build(lr):
        config = transformer_config()
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True), TinyMLP(config))
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, use_distributed_optimizer=True), [ddp])
        return ddp, opt

    ddp, trained = build(lr=0.01)
    run_forward_backward(ddp, [torch.randn(4, HIDDEN)])
    ddp.finish_grad_sync()
    trained.step()
    _, fresh = build(lr=0.5)
    fresh.load_state_dict(trained.state_dict())
    return fresh


def call_forward_backward():
    model = TinyMLP(transformer_config())
    batch = torch.randn(4, HIDDEN)
    losses = run_forward_backward(model, [batch])
    return batch, model, losses


def call_pipelined_schedule():
    """The 1F1B schedule itself (one stage here): its token count is the CUDA-only call."""
    model = TinyMLP(transformer_config())
    batches = [torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)]
    losses = schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=mse_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=4, micro_batch_size=4)
    return batches, model, losses


def call_grad_norm():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    return get_grad_norm_fp32(grads)


def call_clip_grads():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1, 1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=5.0)
    return [p.grad for p in params]


def call_grad_scaler():
    scaler = DynamicGradScaler(initial_scale=2.0**8, min_scale=1.0, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=1, hysteresis=1)
    scaler.update(found_inf=True)
    return scaler.scale


def call_p2p_shapes():
    if not hasattr(p2p_communication, "P2PCommunicator"):  # megatron-core 0.12: module functions
        return p2p_communication._communicate_shapes(None, None, recv_prev=False, recv_next=False,
                                                     config=transformer_config())
    comm = p2p_communication.P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(),
                                             transformer_config())
    return comm._communicate_shapes(None, None, recv_prev=False, recv_next=False)


def call_global_memory_buffer():
    return GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")


def call_split_1d_chunks():
    x = torch.arange(6.0)
    chunk = tensor_parallel.split_tensor_into_1d_equal_chunks(x, new_buffer=True)
    return x, chunk, tensor_parallel.gather_split_1d_tensor(chunk)


def call_dist_checkpoint():
    """Save a layer's sharded state (torch_dist), zero it, load it back."""
    layer = tensor_parallel.ColumnParallelLinear(
        HIDDEN, FFN, config=transformer_config(), init_method=init.normal_, bias=True)
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    with tempfile.TemporaryDirectory() as ckpt_dir:
        dist_checkpointing.save(layer.sharded_state_dict(metadata=meta), ckpt_dir)
        saved = layer.weight.detach().clone()
        with torch.no_grad():
            layer.weight.zero_()
        loaded = dist_checkpointing.load(layer.sharded_state_dict(metadata=meta), ckpt_dir)
    return saved, loaded["weight"]


# megatron-core 0.12 has no grad-buffer offload.
HAS_GRAD_BUFFER_OFFLOAD = hasattr(DistributedDataParallel, "offload_grad_buffers")
CALLS = {fn.__name__: fn for fn in (
    call_model_parallel_seed, call_rng_fork, call_activation_checkpoint, call_gpu_weight_init,
    call_ddp, *([call_ddp_offload] if HAS_GRAD_BUFFER_OFFLOAD else []), call_distrib_optimizer_load_state,
    call_forward_backward, call_pipelined_schedule, call_grad_norm, call_clip_grads, call_grad_scaler, call_p2p_shapes,
    call_global_memory_buffer, call_split_1d_chunks, call_dist_checkpoint)}


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    started = init_world_size_1(str(tmp_path_factory.mktemp("gloo")))
    yield
    destroy_world(started)


# The subprocess: a CUDA platform simulated on this GPU-less machine; then each call, unpatched.
_SIMULATED_CUDA = """
import json, sys, tempfile, torch, traceback
torch.cuda.is_available = lambda: True
import mm_grpo, megatron.core  # megatron imported after the platform, as in real runs
import importlib.util
spec = importlib.util.spec_from_file_location("calls", sys.argv[1])
calls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calls)
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.optimizer import clip_grads
p = mm_grpo.get_platform()
report = {"name": p.name, "device": str(p.device), "backend": p.dist_backend, "patches": list(p.patches),
          "hooked": any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path),
          "p2p_torch_is_torch": p2p_communication.torch is torch,
          "clip_code_mentions_cuda_type": "torch.cuda.FloatTensor" in
              repr(clip_grads.clip_grad_by_total_norm_fp32.__code__.co_consts),
          "errors": {}}
started = calls.init_world_size_1(tempfile.mkdtemp())
for name, call in calls.CALLS.items():
    try:
        call()
        report["errors"][name] = None
    except Exception as e:
        # where it failed: the innermost megatron-core frame, as a module name
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)
                  if "/megatron/core/" in f.filename]
        where = frames[-1].split("/megatron/core/")[-1][:-3].replace("/", ".") if frames else None
        report["errors"][name] = {"error": f"{type(e).__name__}: {e}",
                                  "module": "megatron.core." + str(where)}
calls.destroy_world(started)
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def simulated_cuda():
    env = dict(os.environ, LOCAL_RANK="1", PYTHONWARNINGS="ignore")
    env.pop("MM_GRPO_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _SIMULATED_CUDA, __file__], capture_output=True,
                          text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")]
    assert lines, f"subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT"):])


# ---- CUDA: nothing patched, and every call fails without the patches ------------------------

def test_simulated_cuda_platform_applies_no_patch(simulated_cuda):
    assert simulated_cuda["name"] == "cuda"
    assert simulated_cuda["device"] == "cuda:1"
    assert simulated_cuda["backend"] == "nccl"
    assert simulated_cuda["patches"] == []
    assert not simulated_cuda["hooked"]
    assert simulated_cuda["p2p_torch_is_torch"]
    assert simulated_cuda["clip_code_mentions_cuda_type"]


def test_every_call_fails_without_the_patches(simulated_cuda):
    errors = simulated_cuda["errors"]
    assert set(errors) == set(CALLS)
    worked = [name for name, err in errors.items() if err is None]
    assert not worked, f"these calls ran without the CPU patches: {worked}"
    targets = {t for patch in cpu_patches.CPU_PATCHES for t in patch.targets}
    for name, err in errors.items():
        # each failure is the missing GPU (CUDA init, or a CUDA tensor-type assert) in a patched module
        assert "NVIDIA" in err["error"] or err["error"].startswith("AssertionError"), (name, err)
        assert err["module"] in targets, (name, err)


# ---- CPU: every call works, on CPU, and does the right thing --------------------------------

def test_model_parallel_seed_tracks_cpu_generator_states(world):
    states = call_model_parallel_seed()
    assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    expected = torch.Generator().manual_seed(SEED + MP_SEED_OFFSET).get_state()
    assert torch.equal(states["model-parallel-rng"], expected)
    assert torch.equal(states["data-parallel-rng"], torch.Generator().manual_seed(SEED).get_state())


def test_rng_fork_uses_tracker_stream_and_restores_default(world):
    first, outside, second = call_rng_fork()
    tp_stream = torch.rand(8, generator=torch.Generator().manual_seed(SEED + MP_SEED_OFFSET))
    # inside the forks: one continuing stream seeded with the tensor-parallel seed
    torch.testing.assert_close(torch.cat([first, second]), tp_stream, rtol=0, atol=0)
    # outside: the default (data-parallel) stream, untouched by the forks
    torch.testing.assert_close(outside, torch.rand(4, generator=torch.Generator().manual_seed(SEED)),
                               rtol=0, atol=0)


def test_activation_checkpoint_replays_dropout_mask(world):
    out, grad = call_activation_checkpoint()
    # reference: the first dropout mask of the tensor-parallel stream, no checkpointing
    with torch.random.fork_rng():
        torch.manual_seed(SEED + MP_SEED_OFFSET)
        keep = torch.nn.functional.dropout(torch.ones(4, 8), p=0.5) / 2.0
    x = torch.linspace(1.0, 2.0, 32).reshape(4, 8)
    torch.testing.assert_close(out, (x * 2.0 * keep * 2.0).sum(dim=1))
    torch.testing.assert_close(grad, 2.0 * keep * 2.0)  # recompute saw the forward's mask


def test_gpu_weight_init_runs_on_cpu_from_tp_stream(world):
    weight = call_gpu_weight_init()
    assert weight.device.type == "cpu"
    tp_stream = torch.Generator().manual_seed(SEED + MP_SEED_OFFSET)
    expected = torch.empty(FFN, HIDDEN).normal_(generator=tp_stream)
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)


def test_ddp_buffers_are_cpu(world):
    ddp = call_ddp()
    tensors = [b.grad_data for b in ddp.buffers] + [p.main_grad for p in ddp.module.parameters()]
    assert len(tensors) == 5 and all(t.device.type == "cpu" for t in tensors)


@pytest.mark.skipif(not HAS_GRAD_BUFFER_OFFLOAD, reason="megatron-core 0.12 has no grad-buffer offload")
def test_ddp_grad_buffers_offload_and_restore(world):
    offloaded_bytes, grads = call_ddp_offload()
    assert offloaded_bytes == 0
    assert all(g.device.type == "cpu" and g.numel() > 0 and not g.any() for g in grads)


def test_fresh_distrib_optimizer_loads_state(world):
    fresh = call_distrib_optimizer_load_state()
    assert fresh.param_groups[0]["lr"] == 0.01
    optimizer = fresh.chained_optimizers[0].optimizer
    state = list(optimizer.state.values())
    assert len(state) == 4  # placeholders for exp_avg/exp_avg_sq, filled by load_parameter_state
    assert all(s["exp_avg"].device.type == "cpu" for s in state)
    # torch's AdamW counts steps per parameter; an Apex-style Adam (MindSpeed's AdamW, which its
    # adaptor makes Megatron's Adam) per parameter group.
    steps = [s["step"] for s in state] if isinstance(optimizer, torch.optim.AdamW) else \
        [g["step"] for g in optimizer.param_groups]
    assert steps and all(int(step) == 1 for step in steps)


def test_forward_backward_no_pipelining_matches_autograd(world):
    batch, model, losses = call_forward_backward()
    ref = model.fc2.weight.detach().clone().requires_grad_()
    hidden = torch.relu(batch @ model.fc1.weight.detach().T + model.fc1.bias.detach())
    ref_loss = (hidden @ ref.T + model.fc2.bias.detach()).pow(2).mean()
    ref_loss.backward()
    torch.testing.assert_close(losses[0]["loss"], ref_loss.detach())
    torch.testing.assert_close(model.fc2.weight.grad, ref.grad)


def test_pipelined_schedule_matches_autograd(world):
    batches, model, losses = call_pipelined_schedule()
    ref = model.fc2.weight.detach().clone().requires_grad_()
    hidden = [torch.relu(x @ model.fc1.weight.detach().T + model.fc1.bias.detach()) for x in batches]
    ref_losses = [(h @ ref.T + model.fc2.bias.detach()).pow(2).mean() for h in hidden]
    (sum(ref_losses) / len(ref_losses)).backward()  # megatron averages over micro-batches
    torch.testing.assert_close(torch.stack([r["loss"] for r in losses]), torch.stack(ref_losses).detach())
    torch.testing.assert_close(model.fc2.weight.grad, ref.grad)


def test_grad_norm_and_clip_on_cpu_fp32(world):
    norm = call_grad_norm()
    assert norm == pytest.approx(5.0)
    clipped = call_clip_grads()  # max_norm 1 / total 5: every grad scaled by 1 / (5 + 1e-6)
    torch.testing.assert_close(clipped[0], torch.tensor([3.0, 0.0]) / (5.0 + 1e-6))
    torch.testing.assert_close(clipped[1], torch.tensor([[4.0]]) / (5.0 + 1e-6))


def test_grad_scaler_state_on_cpu(world):
    scale = call_grad_scaler()
    assert scale.device.type == "cpu" and scale.item() == 2.0**7  # backed off once


def test_p2p_shape_exchange_without_peers(world):
    assert call_p2p_shapes() == ([0, 0, 0], [0, 0, 0])


def test_tp_buffers_on_cpu(world):
    assert call_global_memory_buffer().device.type == "cpu"
    x, chunk, gathered = call_split_1d_chunks()
    assert chunk.device.type == "cpu" and gathered.device.type == "cpu"
    torch.testing.assert_close(gathered, x, rtol=0, atol=0)


def test_dist_checkpoint_round_trip(world):
    saved, loaded = call_dist_checkpoint()
    torch.testing.assert_close(loaded, saved, rtol=0, atol=0)


# ---- end to end: DDP + megatron optimizer + schedule vs a hand-written AdamW -----------------

LR, WD, BETAS, EPS, CLIP = 0.05, 0.1, (0.9, 0.99), 1e-8, 0.5
PARAM_NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def hand_written_adamw_step(params, grads, moments, t):
    """Clip by global norm, then one decoupled-weight-decay Adam step, in place; no decay on
    biases (megatron's default param groups). Returns the pre-clip norm."""
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    coef = min(1.0, CLIP / (norm + 1e-6))
    for p, g, (m, v) in zip(params, grads, moments):
        g = g * coef
        m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
        decay = WD if p.dim() > 1 else 0.0
        p.mul_(1 - LR * decay).sub_(LR * m_hat / (v_hat.sqrt() + EPS))
    return norm


def mlp_loss(params, batches):
    w1, b1, w2, b2 = params
    return sum((torch.relu(x @ w1.T + b1) @ w2.T + b2).pow(2).mean() for x in batches) / len(batches)


def build_trainer(distributed_optimizer, bf16=False):
    torch.manual_seed(0)
    config = transformer_config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    module = TinyMLP(config)
    with torch.no_grad():  # non-zero biases, so their updates show
        module.fc1.bias.normal_()
        module.fc2.bias.normal_()
    if bf16:
        module = Float16Module(config, module)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=bf16), module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, adam_beta1=BETAS[0],
                        adam_beta2=BETAS[1], adam_eps=EPS, clip_grad=CLIP, bf16=bf16,
                        use_distributed_optimizer=distributed_optimizer),
        [ddp])
    for group in optimizer.param_groups:  # what megatron's OptimizerParamScheduler does each step
        group["weight_decay"] = WD * group["wd_mult"]
    named = dict(ddp.named_parameters())
    params = [next(p for n, p in named.items() if n.endswith(name)) for name in PARAM_NAMES]
    return ddp, optimizer, params


def train_step(ddp, optimizer, batches):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_forward_backward(ddp, batches)
    ddp.finish_grad_sync()
    ok, norm, _ = optimizer.step()
    assert ok
    return norm


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distrib_optimizer"])
def test_fp32_steps_match_hand_written_adamw(world, distributed_optimizer):
    ddp, optimizer, params = build_trainer(distributed_optimizer)
    ref = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    batches = [torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)]
    for t in (1, 2):
        norm = train_step(ddp, optimizer, batches)
        leaves = [p.clone().requires_grad_() for p in ref]
        grads = torch.autograd.grad(mlp_loss(leaves, batches), leaves)  # plain autograd, no megatron
        ref_norm = hand_written_adamw_step(ref, grads, moments, t)
        assert ref_norm > CLIP  # clipping is active
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    for name, param, want in zip(PARAM_NAMES, params, ref):
        assert param.device.type == "cpu"
        torch.testing.assert_close(param.detach(), want, rtol=1e-5, atol=1e-6, msg=name)


_WITHOUT_TRANSFORMER_ENGINE = """
import sys, tempfile
import mm_grpo
from megatron.core import fp8_utils
from tests import test_platform_megatron as t
assert not fp8_utils.HAVE_TE, "this process was to have no Transformer Engine"
started = t.init_world_size_1(tempfile.mkdtemp())
t.test_fp32_steps_match_hand_written_adamw(None, distributed_optimizer=True)
t.destroy_world(started)
print("STEPPED")
"""


def test_distributed_optimizer_steps_without_transformer_engine():
    """A process with no Transformer Engine at all (this one may hold MindSpeed's stand-in for
    it): the distributed optimizer's two steps still equal the hand-written AdamW."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("MM_GRPO_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TRANSFORMER_ENGINE], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and "STEPPED" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distrib_optimizer"])
def test_bf16_step_updates_fp32_main_params(world, distributed_optimizer):
    """bf16 params, fp32 main params and grads: megatron's mixed-precision optimizer path."""
    ddp, optimizer, params = build_trainer(distributed_optimizer, bf16=True)
    main = [p.detach().float() for p in params]  # the fp32 copies the optimizer starts from
    batches = [torch.randn(4, HIDDEN).bfloat16(), torch.randn(4, HIDDEN).bfloat16()]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_forward_backward(ddp, batches)
    ddp.finish_grad_sync()
    grads = [p.main_grad.clone() for p in params]
    assert all(g.dtype == torch.float32 for g in grads)
    ok, norm, _ = optimizer.step()
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in main]
    ref_norm = hand_written_adamw_step(main, grads, moments, 1)
    assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
    for name, param, want in zip(PARAM_NAMES, params, main):
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param.detach(), want.bfloat16(), rtol=0, atol=0, msg=name)

