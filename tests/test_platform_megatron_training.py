"""The CPU patches for Megatron-LM's training loop (megatron.training, as MindSpeed-MM's `pretrain`
runs it: mm_grpo/mindspeed_mm/grpo.py), in MindSpeed-MM's environment.

`CALLS` are the loop's CUDA-only calls the patches cover, one small real use each. Each runs in a
child process with Megatron's global arguments as MindSpeed-MM's `pretrain` sets them: on the CPU
platform (patches in force) each must work and do the right thing; on a simulated CUDA platform
(nothing patched, no GPU) each must fail, in a module the patches name (the model-parallel groups
are the exception: without a device Megatron silently skips them, which the call reports).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from mm_grpo.platform import cpu_patches
from tests.testbed import REPO, require_testbed, subprocess_env

pytestmark = pytest.mark.mindspeed_mm

TRAINING_PATCHES = ("training_cuda_device", "training_cuda_device_string", "training_model_to_device",
                    "training_nothing_to_compile")


# ---- the CUDA-only calls of the loop, one use each (run in the child) --------------------------

def call_model_parallel_groups():
    """initialize_megatron's device set-up: the model-parallel groups and the seeds."""
    from megatron.core import mpu, tensor_parallel
    from megatron.training import initialize
    mpu.destroy_model_parallel()
    initialize._initialize_distributed(None, None)
    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("no model-parallel groups: Megatron made them only for a device it could see")
    initialize._set_random_seed(1234)
    return sorted(tensor_parallel.get_cuda_rng_tracker().get_states())


def call_jit_warmup():
    from megatron.training import initialize
    initialize._warmup_jit_function()


def call_compile_dependencies():
    from megatron.training import initialize
    initialize._compile_dependencies()


def call_get_model():
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule
    from megatron.training import get_args, training
    from megatron.training.arguments import core_transformer_config_from_args

    def provider(pre_process=True, post_process=True):
        module = MegatronModule(core_transformer_config_from_args(get_args()))
        module.weight = torch.nn.Parameter(torch.ones(3))
        return module

    return [str(p.device) for chunk in training.get_model(provider, ModelType.encoder_or_decoder, False)
            for p in chunk.parameters()]


def call_data_loader_flags():
    from megatron.training import get_args, training

    def provider(num_samples):
        return [0], None, None
    provider.is_distributed = True
    args = get_args()
    args.iteration = args.consumed_train_samples = args.consumed_valid_samples = 0  # as a run without --load
    train, _, _ = training.build_train_valid_test_data_loaders(provider)
    return train, get_args().do_train


def call_checkpoint_rng_state():
    from megatron.training import checkpointing
    state = checkpointing.get_rng_state("torch")[0]
    return bool(torch.equal(state["cuda_rng_state"], torch.get_rng_state()))


def call_checkpoint_iteration(folder):
    from megatron.training import checkpointing
    path = os.path.join(folder, "latest_checkpointed_iteration.txt")
    with open(path, "w") as f:
        f.write("7")
    return checkpointing.read_metadata(path)


def call_timers():
    from megatron.core.timers import Timers
    timer = Timers(log_level=2, log_option="minmax")("step", log_level=0)
    timer.start(barrier=False)
    timer.stop(barrier=False)
    return timer.elapsed(reset=False) >= 0


def call_mindspeed_mm_training_log():
    """MindSpeed-MM's training_log sums the logged losses in tensors it makes on 'cuda'."""
    from mindspeed_mm.training import training_log
    total = {}
    training_log({"loss": torch.tensor(0.5)}, total, 1e-3, None, 1, 1.0, False, 0, 1.0, None, None)
    return float(total["loss"])


CALLS = {fn.__name__: fn for fn in (
    call_model_parallel_groups, call_jit_warmup, call_compile_dependencies, call_get_model, call_data_loader_flags,
    call_checkpoint_rng_state, call_checkpoint_iteration, call_timers, call_mindspeed_mm_training_log)}


# ---- the child: Megatron's global arguments, then each call -------------------------------------
_CHILD = """
import json, os, sys, tempfile, traceback
import torch
if sys.argv[2] == "cuda":
    torch.cuda.is_available = lambda: True
import mm_grpo
import importlib.util
spec = importlib.util.spec_from_file_location("calls", sys.argv[1])
calls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calls)
from mm_grpo.platform import cpu_patches
from tests.sora_helpers import set_megatron_args
from tests.test_platform_megatron import init_world_size_1
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "model.json"), "w") as f:
    json.dump({"predictor": {"model_id": "flux", "num_layers": 1, "num_heads": 4, "head_dim": 16}}, f)  # sizes MindSpeed-MM reads
with open(os.path.join(folder, "data.json"), "w") as f:
    json.dump({"dataset_param": {}}, f)
init_world_size_1(folder)
set_megatron_args(os.path.join(folder, "model.json"), os.path.join(folder, "data.json"),
                  extra=["--log-interval", "1000", "--distributed-backend", "gloo"])
report = {"patches": list(mm_grpo.get_platform().patches), "results": {}, "errors": {}}
from megatron.core import parallel_state
for name, call in calls.CALLS.items():
    if not parallel_state.model_parallel_is_initialized():  # a failed call may have left none
        parallel_state.initialize_model_parallel()
    try:
        args = [folder] if name == "call_checkpoint_iteration" else []
        report["results"][name] = call(*args)
        report["errors"][name] = None
    except BaseException as e:  # SystemExit too: Megatron exits when it cannot compile
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        where = [f for f in frames if "/megatron/" in f or "/mindspeed_mm/" in f]
        module = where[-1].split("/megatron/")[-1] if where else ""
        package = "mindspeed_mm." if where and "/mindspeed_mm/" in where[-1] else "megatron."
        if package == "mindspeed_mm.":
            module = where[-1].split("/mindspeed_mm/")[-1]
        report["errors"][name] = {"error": f"{type(e).__name__}: {e}",
                                  "module": package + module[:-3].replace("/", ".")}
report["applied"] = {p: list(cpu_patches.applied_targets(p)) for p in %r}
print("REPORT" + json.dumps(report, default=str))
""" % (TRAINING_PATCHES,)


def _child(platform: str) -> dict:
    env = subprocess_env(dict(os.environ, PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1"))
    env.pop("MM_GRPO_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, __file__, platform], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")]
    assert lines, f"child failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT"):])


@pytest.fixture(scope="module")
def on_cpu():
    require_testbed(needs_megatron_training=True)
    return _child("cpu")


@pytest.fixture(scope="module")
def simulated_cuda():
    require_testbed(needs_megatron_training=True)
    return _child("cuda")


def test_every_call_works_on_cpu(on_cpu):
    assert set(TRAINING_PATCHES) <= set(on_cpu["patches"])
    assert on_cpu["errors"] == {name: None for name in CALLS}
    results = on_cpu["results"]
    assert results["call_model_parallel_groups"] == ["data-parallel-rng", "expert-parallel-rng",
                                                     "model-parallel-rng"]
    assert set(results["call_get_model"]) == {"cpu"}
    assert results["call_data_loader_flags"] == [[0], 1]  # the dataset, and do_train broadcast from rank 0
    assert results["call_checkpoint_rng_state"] is True  # the device generator saved is the CPU's
    assert results["call_checkpoint_iteration"] == [7, False]
    assert results["call_timers"] is True
    assert results["call_mindspeed_mm_training_log"] == 0.5
    patches = {p.name: p for p in cpu_patches.CPU_PATCHES}
    for name, applied in on_cpu["applied"].items():  # every target the calls imported was patched
        assert set(patches[name].targets) <= set(applied), name


def test_every_call_fails_on_a_cuda_platform_without_the_patches(simulated_cuda):
    assert simulated_cuda["patches"] == []
    errors = simulated_cuda["errors"]
    worked = [name for name, err in errors.items() if err is None]
    assert not worked, f"these calls ran without the CPU patches: {worked}"
    targets = {t for p in cpu_patches.CPU_PATCHES if p.name in TRAINING_PATCHES for t in p.targets}
    assert "no model-parallel groups" in errors.pop("call_model_parallel_groups")["error"]
    assert errors.pop("call_compile_dependencies")["error"].startswith("SystemExit")  # cannot build in the tree
    for name, err in errors.items():
        assert "NVIDIA" in err["error"] or "CUDA" in err["error"], (name, err)
        assert err["module"] in targets, (name, err)


def test_method_call_replaced_where_it_is_a_method_call_only():
    def move(m):
        return m.cuda(torch.device("cpu") if torch.cuda is not None else None)

    with pytest.raises(RuntimeError):  # Module.cuda takes CUDA devices only
        move(torch.nn.Linear(1, 1))
    move.__code__ = cpu_patches._call_method_instead(move.__code__, "cuda", "to")
    module = torch.nn.Linear(1, 1)
    assert move(module) is module  # `m.cuda(...)` became `m.to(...)`
    assert "cuda" in move.__code__.co_names  # `torch.cuda` beside it kept its name
