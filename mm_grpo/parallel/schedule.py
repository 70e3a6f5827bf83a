"""A rank's model chunks through megatron-core's pipeline schedules, for any family's transformer whose
stages exchange one tensor per micro-batch (FLUX's and Qwen-Image's: the joint sequence and silu(temb)):
the schedule call, the interleaved schedule's rule on the number of micro-batches, and the results
brought to the host in few copies. Which forward keyword arguments a micro-batch holds and how long
the stage tensor is are the family's (its `chunks.py`)."""
from typing import Callable, Dict, List, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mm_grpo.parallel.state import is_last_stage, tensor_from_last_stage


def check_num_microbatches(num_microbatches: int, model_chunks):
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(model_chunks) > 1 and num_microbatches % pp:
        # megatron-core's interleaved schedule runs micro-batches in groups of pp per chunk.
        raise ValueError(f"the interleaved (virtual-stage) schedule needs a number of micro-batches "
                         f"divisible by the pipeline size {pp}, got {num_microbatches}")


def keyword_call(forward_keys) -> Callable:
    """forward(model, micro_batch): the model called with the micro-batch's `forward_keys` (the others
    are for the loss)."""
    return lambda model, batch: model(**{k: batch[k] for k in forward_keys if k in batch})


def run_schedule(model_chunks, micro_batches: Sequence[Dict], forward: Callable, loss_func, seq_length: int,
                 micro_batch_size: int, forward_only: bool, collect_non_loss_data: bool = False):
    """megatron-core's schedule over `micro_batches` (each chunk sees every one; `forward(model,
    micro_batch)` calls the model: `keyword_call`, or a denoiser's forward); `seq_length` and
    `micro_batch_size` give Megatron's p2p shape (seq_length // CP, micro_batch_size, D). Returns the
    last stage's forward data."""
    check_num_microbatches(len(micro_batches), model_chunks)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return forward(model, batch), lambda out, non_loss_data=False: loss_func(out, batch)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(micro_batches) for _ in model_chunks],
        model=list(model_chunks), num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only, collect_non_loss_data=collect_non_loss_data)


def forward_only(model_chunks, micro_batches: Sequence[Dict], forward_keys, seq_length: int, micro_batch_size: int,
                 out_shape, dtype, device) -> torch.Tensor:
    """The outputs of `micro_batches` (in flight together through every stage: megatron-core's
    forward-only schedule), concatenated on the last stage and broadcast over the pipeline group, so
    that every PP / SP / TP rank can step a sampler identically: a tensor `out_shape` in `dtype`. The
    interleaved schedule takes micro-batches in groups of PP: they are padded with repeats of the last
    one (in what would otherwise be the pipeline bubble), whose outputs are dropped."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    padding = (-len(micro_batches)) % pp if len(model_chunks) > 1 else 0
    with torch.no_grad():
        outs = run_schedule(model_chunks, list(micro_batches) + list(micro_batches[-1:]) * padding,
                            keyword_call(forward_keys),
                            lambda out, batch: out, seq_length, micro_batch_size, forward_only=True,
                            collect_non_loss_data=True)
    # One contiguous tensor (a model output is a transposed view): the broadcast to the other pipeline
    # stages sends its storage as laid out.
    out = torch.cat(outs[:len(micro_batches)]).to(dtype) if is_last_stage() else None
    return tensor_from_last_stage(out, out_shape, dtype, device)


def results_to_host(results: Sequence[Dict]) -> List[Dict]:
    """The micro-batches' {name: value} with their tensors detached and on the CPU. The scalars of a
    dtype and device cross in one copy (one host sync, not one per statistic and micro-batch)."""
    out = [dict(r) for r in results]
    groups: Dict[tuple, list] = {}
    for i, r in enumerate(out):
        for k, v in r.items():
            if torch.is_tensor(v):
                if v.ndim == 0 and v.device.type != "cpu":
                    groups.setdefault((v.dtype, v.device), []).append((i, k))
                else:
                    r[k] = v.detach().cpu()
    for places in groups.values():
        values = torch.stack([out[i][k].detach() for i, k in places]).cpu()
        for (i, k), value in zip(places, values.unbind()):
            out[i][k] = value
    return out
