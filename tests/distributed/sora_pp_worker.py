"""One torchrun launch for MindSpeed-MM's pretrain_sora.py under pipeline parallelism:

    torchrun --nproc_per_node 2 -m tests.distributed.sora_pp_worker OUT.json --use-multiparameter-pipeline-model-parallel

The flag is on the command line because MindSpeed's adaptor reads its features from there when
it is imported (first, before Megatron), as in a MindSpeed-MM launch; its multi-tensor pipeline
schedule then replaces Megatron's for the whole process, hence a launch of its own."""
import json
import os
import sys
import traceback

import torch.distributed as dist

import mm_grpo  # noqa: F401


def main(out_path):
    from mm_grpo.parallel.state import end_process_groups, init_process_group
    from tests.distributed.checks_mindspeed_mm import sora_pp2_flow_step_matches_mm_grpo
    init_process_group()
    try:
        metrics, error = sora_pp2_flow_step_matches_mm_grpo(), None
    except Exception:
        metrics, error = {}, f"rank {dist.get_rank()}: {traceback.format_exc()}"
        print(error, file=sys.stderr, flush=True)  # now: a failed stage leaves the other waiting
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if dist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"sora_pp2_flow_step_matches_mm_grpo": {"ok": not errors, "error": "\n".join(errors),
                                                              "metrics": metrics}}, f)
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    end_process_groups()


if __name__ == "__main__":
    main(sys.argv[1])
