"""Converted Megatron shards loaded into a TP = 2 / 4 model (one torchrun rank per TP rank)."""
import shutil
import tempfile

import torch
import torch.distributed as dist

from converters.convert_cli import main as mm_convert
from mm_grpo.checkpoint import load_megatron_checkpoint
from mm_grpo.models.flux import FluxConfig, FluxTransformer
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
