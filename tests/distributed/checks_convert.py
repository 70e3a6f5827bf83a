"""Converted Megatron shards loaded into a TP = 2 / 4 model (one torchrun rank per TP rank); checkpoints
that Megatron saved at TP 2 x PP 2 and PP 2 x 2 virtual chunks read back without mm-grpo metadata."""
import shutil
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from converters.convert_cli import main as mm_convert
from mm_grpo.families.flux.checkpoint import load_megatron_checkpoint
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from tests.distributed.worker import check
from tests.utils import make_inputs, random_reference, reference_output, rel_err

CONFIG = FluxConfig.preset("tiny")


def _convert_on_rank0(ref, layouts):
    """Rank 0 writes the diffusers folder and one Megatron checkpoint per layout; all ranks get the paths."""
    paths = [None]
    if dist.get_rank() == 0:
        tmp = tempfile.mkdtemp(prefix="checks_convert-")
        ref.save_pretrained(f"{tmp}/hf")
        for name, (tp, pp) in layouts.items():
            mm_convert(["FluxConverter", "hf_to_mm", "--cfg.source_path", f"{tmp}/hf",
                        "--cfg.target_path", f"{tmp}/{name}", "--cfg.target_parallel_config.tp_size", str(tp),
                        "--cfg.target_parallel_config.pp_layers", str(pp)])
        paths = [tmp]
    dist.broadcast_object_list(paths, src=0)
    return paths[0]


@check(2, 4)
def converted_shards_load_at_tp():
    tp = dist.get_world_size()
    ref = random_reference(CONFIG, seed=9)
    # same TP as the run (each rank reads its own shard) and another TP (re-cut while loading)
    layouts = {"same_tp": (tp, [2, 4]), "other_tp": (4 if tp == 2 else 2, [[1, 2], [2, 1]])}
    tmp = _convert_on_rank0(ref, layouts)
    try:
        initialize_parallel(ParallelConfig(tp=tp))
        inputs = make_inputs(CONFIG, batch=2, height=3, width=5, txt_len=6)
        with torch.no_grad():
            expected = reference_output(ref, inputs)
        metrics, params = {"tp": tp}, {}
        for name in layouts:
            model = FluxTransformer(CONFIG)
            load_megatron_checkpoint(model, f"{tmp}/{name}")
            with torch.no_grad():
                metrics[f"{name}_vs_diffusers"] = rel_err(model(**inputs), expected)
            params[name] = dict(model.named_parameters())
        same = all(torch.equal(p, params["other_tp"][n]) for n, p in params["same_tp"].items())
        flag = torch.tensor([int(same)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        metrics["local_shards_identical"] = bool(flag.item())
        return metrics
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _megatron_saved(parallel, pp_layers):
    """This layout's chunks, saved as Megatron saves them (tests/megatron_save.py), read back on
    rank 0 without mm-grpo metadata: the inferred layout, and mm_to_hf (with --cfg.hf_dir, which
    gives axes_dims_rope) against the diffusers weights."""
    from mm_grpo.checkpoint import iteration_dir
    from mm_grpo.families.flux.checkpoint import CheckpointMeta
    from mm_grpo.families.flux.chunks import build_model_chunks, load_hf_weights_into_chunks
    from tests.megatron_save import megatron_save
    ref = random_reference(CONFIG, seed=13)
    paths = [tempfile.mkdtemp(prefix="checks_convert-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    tmp = paths[0]
    try:
        initialize_parallel(parallel)
        chunks = load_hf_weights_into_chunks(build_model_chunks(CONFIG, pp_layers), ref.state_dict())
        writer = megatron_save(f"{tmp}/ckpt", 9, chunks)
        if dist.get_rank() != 0:
            return {}
        meta = CheckpointMeta.load(iteration_dir(f"{tmp}/ckpt"), CONFIG)
        ref.save_pretrained(f"{tmp}/hf")
        mm_convert(["FluxConverter", "mm_to_hf", "--cfg.source_path", f"{tmp}/ckpt", "--cfg.target_path",
                    f"{tmp}/out", "--cfg.hf_dir", f"{tmp}/hf"])
        got = load_file(f"{tmp}/out/diffusion_pytorch_model.safetensors")
        exact = set(got) == set(ref.state_dict()) and all(torch.equal(got[k], t) for k, t in ref.state_dict().items())
        return {"writer": writer, "tp": meta.tp_size, "pp_layers": meta.pp_layers, "bit_exact": exact}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


@check(4)
def megatron_saved_tp2_pp2_reads():
    return _megatron_saved(ParallelConfig(tp=2, pp=2), [2, 4])


@check(2)
def megatron_saved_pp2_vpp2_reads():
    return _megatron_saved(ParallelConfig(pp=2, vpp=2), [[1, 2], [2, 1]])
