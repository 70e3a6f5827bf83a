"""Write one iteration of a Megatron-layout checkpoint: shards first, then rename, then the tracker."""
import os
import shutil

from mm_grpo.checkpoint.paths import CHECKPOINT_VERSION, META_KEY, RELEASE, SHARD_FILE, iteration_name, write_tracker
from mm_grpo.checkpoint.shard_io import ShardWriter, write_shard
from mm_grpo.files.atomic import replace_dir


def temp_dir(root: str, iteration=RELEASE) -> str:
    """Where the shards of `iteration` are written before the rename (one name for all ranks)."""
    return os.path.join(root, f".{iteration_name(iteration)}.tmp")


def clear_stale(root: str, iteration=RELEASE):
    """Remove what a crashed save of `iteration` left (maybe shards of another layout); call on
    one rank before any rank opens a writer."""
    shutil.rmtree(temp_dir(root, iteration), ignore_errors=True)


class CheckpointWriter:
    """Shards go to `<root>/.<iter>.tmp/`; `commit()` renames the folder to `<root>/<iter>/` and
    points `latest_checkpointed_iteration.txt` at it.

    Each shard tree holds `model` (or `model0`, `model1`, ... per virtual chunk) plus any
    extra entries (optimizer, scheduler, rng states...); `checkpoint_version`, mm-grpo's
    metadata (`META_KEY`) and, for a numbered iteration, `iteration` are added. In a PP > 1
    shard without virtual chunks `model0` names the `model` dict too: MindSpeed-MM's
    `load_from_mm` reads only `model<N>` entries from PP shards, Megatron's `--load` reads
    `model`, and one object under two keys is stored once. The temporary name is fixed, so
    every rank of a job can write its own shards into it; one rank commits after a barrier.

    `meta` is the family's metadata (FLUX's: families/flux/checkpoint/metadata.CheckpointMeta): its
    `to_json()`, `shard_name(tp, pp)`, `pp_size` and `vpp_size` are what the writer reads.
    """

    def __init__(self, root: str, meta, iteration=RELEASE):
        self.root, self.meta, self.iteration = root, meta, iteration
        self.name = iteration_name(iteration)
        self.tmp = temp_dir(root, iteration)
        os.makedirs(self.tmp, exist_ok=True)

    def shard_path(self, tp_rank: int, pp_rank: int) -> str:
        return os.path.join(self.tmp, self.meta.shard_name(tp_rank, pp_rank), SHARD_FILE)

    def _full_tree(self, tree: dict) -> dict:
        header = {"checkpoint_version": CHECKPOINT_VERSION, META_KEY: self.meta.to_json()}
        if self.iteration != RELEASE:
            header["iteration"] = self.iteration
        if self.meta.pp_size > 1 and self.meta.vpp_size == 1:
            header["model0"] = tree["model"]  # an alias for MindSpeed-MM (class docstring)
        return {**tree, **header}

    def open_shard(self, tp_rank: int, pp_rank: int, tree: dict) -> ShardWriter:
        """A streaming writer for one shard; `tree` may hold meta tensors (shapes only)."""
        return ShardWriter(self.shard_path(tp_rank, pp_rank), self._full_tree(tree))

    def write_shard(self, tp_rank: int, pp_rank: int, tree: dict):
        write_shard(self.shard_path(tp_rank, pp_rank), self._full_tree(tree))

    def commit(self) -> str:
        final = os.path.join(self.root, self.name)
        replace_dir(self.tmp, final)
        write_tracker(self.root, self.iteration)
        return final
