"""Checkpoints as Megatron-LM saves them (`--ckpt-format torch`), of FLUX chunks built by mm-grpo:
what mm-grpo must read without its own metadata.

Two writers:
- `real_save`: Megatron-LM's own `megatron.training.checkpointing.save_checkpoint`, in the
  environment that has Megatron-LM's tree (MindSpeed-MM's: core_v0.12.1);
- `legacy_save`: for the megatron-core wheel (0.16.1), which ships no checkpoint writer (its
  only on-disk format is dist_checkpointing): the tree Megatron-LM's `generate_state_dict`
  builds for `--ckpt-format torch` (args, checkpoint_version, iteration, model / model<N>
  from megatron-core's own `state_dict_for_save_checkpoint()`, rerun state, RNG states, FLOP
  count), `torch.save`d at Megatron's paths, the tracker written last.
`tests/test_mindspeed_mm_checkpoint.py` checks that both write the same tree.

On CPU, Megatron-LM's checkpointing module asks the CUDA generator for its state and puts the
tracker's iteration in a `device='cuda'` tensor; `cuda_on_cpu` points both at the CPU for the
call, as torch_npu's `transfer_to_npu` points them at the NPU on Ascend (megatron.training is
not in mm-grpo's CPU patch set: mm-grpo's own loop does not use it).
"""
import argparse
import contextlib
import importlib.util
import io
import os
import random
import sys
import tempfile
import types

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.checkpoint.paths import SHARD_FILE, iteration_name, shard_name, write_tracker

HAS_MEGATRON_TRAINING = importlib.util.find_spec("megatron.training") is not None


def _layout():
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size())


def megatron_args(save_dir, mm_model=None) -> argparse.Namespace:
    """Megatron-LM's parsed and validated arguments for this process's parallel layout (quietly).

    Once MindSpeed-MM is imported its patches are in force: Megatron's validate_args then needs
    MindSpeed-MM's own arguments and sets `args.mm` from `--mm-model` (model.json) as in
    pretrain_sora.py; `mm_model` is that file (without MindSpeed-MM imported, args.mm is set the
    same way here)."""
    from megatron.training.arguments import parse_args, validate_args
    tp, pp, vpp = _layout()
    argv = ["pretrain_sora.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "1", "--max-position-embeddings", "1", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-5", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--distributed-backend", "gloo", "--save", str(save_dir), "--load", str(save_dir),
            "--save-interval", "1", "--ckpt-format", "torch"]
    patched = "mindspeed_mm" in sys.modules
    extra_args_provider = None
    with tempfile.TemporaryDirectory() as tmp:
        if patched:  # MindSpeed-MM's validate_args requires a model.json
            from mindspeed_mm.configs.config import mm_extra_args_provider as extra_args_provider
            if mm_model is None:
                mm_model = os.path.join(tmp, "model.json")
                with open(mm_model, "w") as f:
                    f.write("{}")
            argv += ["--mm-model", str(mm_model)]
        saved, saved_env = sys.argv, dict(os.environ)
        sys.argv = argv
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # MindSpeed-MM's launch scripts export it
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
                args = parse_args(extra_args_provider, ignore_unknown_args=True)
                validate_args(args, {})
        finally:
            sys.argv = saved
            os.environ.clear()
            os.environ.update(saved_env)
    if mm_model is not None and not patched:
        from mindspeed_mm.configs.config import MMConfig
        args.mm = MMConfig({"model": str(mm_model)})
    return args


class _CudaOnCpu:
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device="cuda": torch.set_rng_state(state))

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    cuda = _CudaOnCpu()

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        return torch.tensor(data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def cuda_on_cpu():
    """Megatron-LM's checkpointing module with the CPU standing in for the GPU (module doc)."""
    from megatron.training import checkpointing
    saved = checkpointing.torch
    checkpointing.torch = _TorchOnCpu("torch")
    try:
        yield checkpointing
    finally:
        checkpointing.torch = saved


def real_save(save_dir, iteration, chunks, mm_model=None):
    """Megatron-LM's save_checkpoint of this rank's chunks (collective); `mm_model`: the run's
    model.json, which MindSpeed-MM keeps in args.mm."""
    from megatron.training.global_vars import set_args
    set_args(megatron_args(save_dir, mm_model))
    with cuda_on_cpu() as checkpointing, contextlib.redirect_stdout(io.StringIO()):
        checkpointing.save_checkpoint(iteration, list(chunks), None, None, 0)


def legacy_args() -> argparse.Namespace:
    """The arguments the legacy tree carries: the layout (what a reader checks) and, like Megatron's,
    objects of megatron-core's own classes."""
    from megatron.core.transformer.enums import AttnBackend
    tp, pp, vpp = _layout()
    return argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp, params_dtype=torch.float32,
                              ckpt_format="torch", attention_backend=AttnBackend.auto)


def legacy_tree(iteration, chunks, args) -> dict:
    tree = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    for i, chunk in enumerate(chunks):
        tree["model" if len(chunks) == 1 else f"model{i}"] = chunk.state_dict_for_save_checkpoint()
    tree["rerun_state_machine"] = None
    tree["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                          "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                          "rng_tracker_states": {}}]
    tree["num_floating_point_operations_so_far"] = 0
    return tree


def legacy_save(save_dir, iteration, chunks, args=None):
    """The legacy tree of this rank's chunks at Megatron's paths (collective; module doc)."""
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    path = os.path.join(save_dir, iteration_name(iteration), shard_name(tp, pp, _layout()[1]), SHARD_FILE)
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(legacy_tree(iteration, chunks, args or legacy_args()), path)
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(save_dir, iteration)
    dist.barrier()


def megatron_save(save_dir, iteration, chunks) -> str:
    """Megatron-LM's own writer where it exists, else the legacy tree; returns which."""
    if HAS_MEGATRON_TRAINING:
        real_save(save_dir, iteration, chunks)
        return "megatron.training.checkpointing.save_checkpoint"
    legacy_save(save_dir, iteration, chunks)
    return "legacy tree (megatron-core has no torch-format writer)"
