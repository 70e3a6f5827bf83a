"""FLUX built by MindSpeed-MM's own `PredictModel` at TP / PP / virtual-stage layouts, loaded by
its own `load_checkpoint` from one diffusers file, against diffusers (fp32).

Imported by the worker only in MindSpeed-MM's environment (tests/testbed.py); each check builds
this rank's chunks the way MindSpeed-MM's model provider does (one `PredictModel` per virtual
stage, the virtual rank set before each), runs them through megatron-core's pipeline schedule
and reports the worst relative error of the output against diffusers over all ranks.
"""
import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from mm_grpo.models.flux import FluxConfig
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.pipeline import forward_backward
from tests.distributed.worker import check
from tests.testbed import install_standins
from tests.utils import make_inputs, random_reference, reference_output, rel_err

install_standins()
import mm_grpo.models.registry  # noqa: E402,F401  (registers flux as MindSpeed-MM imports it)
from mindspeed_mm.configs.config import ConfigReader  # noqa: E402
from mindspeed_mm.models.predictor import PredictModel  # noqa: E402

CONFIG = FluxConfig.preset("tiny").replace(num_single_layers=6)  # 8 blocks: 2 double + 6 single


def predictor_block(path, pipeline_num_layers=None):
    """model.json's predictor block, written the MindSpeed-MM way (hyperparameters inline)."""
    block = {"model_id": "flux", "from_pretrained": path, "dtype": "fp32", **CONFIG.to_diffusers_config()}
    if pipeline_num_layers is not None:  # PredictModel: num_layers == sum(pipeline_num_layers)
        flat = [n for x in pipeline_num_layers for n in (x if isinstance(x, list) else [x])]
        block.update(pipeline_num_layers=pipeline_num_layers, num_layers=sum(flat))
    return block


def predict_model_chunks(block):
    """This rank's chunks, built and loaded by MindSpeed-MM's PredictModel; and what its
    load_checkpoint printed."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks, printed = [], io.StringIO()
    for v in range(vpp or 1):
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        with contextlib.redirect_stdout(printed):
            chunks.append(PredictModel(ConfigReader(block)).get_model())
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, printed.getvalue()


def _world_max(value):
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compare(parallel, pipeline_num_layers=None):
    ref = random_reference(CONFIG, seed=5)
    micro_batches = [make_inputs(CONFIG, batch=2, height=3, width=4, txt_len=5, seed=30 + i) for i in range(4)]
    with torch.no_grad():
        ref_outs = [reference_output(ref, mb) for mb in micro_batches]
    initialize_parallel(parallel)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "diffusion_pytorch_model.safetensors")
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
        chunks, printed = predict_model_chunks(predictor_block(path, pipeline_num_layers))
    with torch.no_grad():
        results = forward_backward(chunks, micro_batches, lambda out, mb: (out.sum(), {"out": out}),
                                   forward_only=True)
    blocks = [(len(c.double_blocks), len(c.single_blocks)) for c in chunks]
    all_blocks = [None] * dist.get_world_size()
    dist.all_gather_object(all_blocks, blocks)
    return {"out_err": _world_max(max(rel_err(r["out"], o) for r, o in zip(results, ref_outs))),
            "clean_load": _world_max(printed.count("Missing keys: []") != len(chunks)
                                     or printed.count("Unexpected keys: []") != len(chunks)) == 0,
            "blocks": all_blocks}


@check(2)
def predict_model_tp2_matches_diffusers():
    return _compare(ParallelConfig(tp=2))


@check(2)
def predict_model_pp2_matches_diffusers():
    return _compare(ParallelConfig(pp=2), pipeline_num_layers=[3, 5])


@check(2)
def predict_model_pp2_vpp2_matches_diffusers():
    return _compare(ParallelConfig(pp=2, vpp=2), pipeline_num_layers=[[1, 2], [2, 3]])


@check(4)
def predict_model_tp2_pp2_matches_diffusers():
    return _compare(ParallelConfig(tp=2, pp=2), pipeline_num_layers=[4, 4])
