"""Write a diffusers transformer folder tensor by tensor (config.json, safetensors shards, index).

Shapes and dtypes are known before any data is read, so each safetensors header is
written first and each tensor goes straight to its place: memory holds one tensor, not
one shard. Sharding and file names are huggingface_hub's, as in diffusers' save_pretrained.
"""
import json
import os
import struct
from typing import Dict, Iterable, Optional, Tuple

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from mm_grpo.checkpoint.shard_io import write_tensor_at
from mm_grpo.files.safetensors_weights import SAFETENSORS_DTYPES
from mm_grpo.files.atomic import atomic_write_text

WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"
INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class SafetensorsWriter:
    """One safetensors file: the header from meta tensors now, each tensor's bytes when given."""

    def __init__(self, path: str, metas: Dict[str, torch.Tensor]):
        self.path, header, end = path, {}, 0
        for name, meta in metas.items():
            if meta.dtype not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {meta.dtype} cannot be written to safetensors")
            size = meta.numel() * meta.element_size()
            header[name] = {"dtype": DTYPE_NAMES[meta.dtype], "shape": list(meta.shape),
                            "data_offsets": [end, end + size]}
            end += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        base = 8 + len(raw)
        self._pending = {n: (base + h["data_offsets"][0], metas[n]) for n, h in header.items() if n in metas}
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._file.truncate(base + end)

    def write(self, name: str, tensor: torch.Tensor):
        offset, meta = self._pending[name]
        if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(f"{self.path}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the header says {tuple(meta.shape)} {meta.dtype}")
        write_tensor_at(self._file, offset, tensor)
        del self._pending[name]

    def close(self):
        self._file.close()
        if self._pending:
            raise ValueError(f"{self.path}: tensors never written: {', '.join(self._pending)}")


def write_diffusers_folder(folder: str, config: dict, metas: Dict[str, torch.Tensor],
                           tensors: Iterable[Tuple[str, torch.Tensor]], max_shard_size="10GB",
                           weight_map: Optional[Dict[str, str]] = None):
    """Write `config` and the tensors named in `metas` (in any order) into an existing `folder`,
    split by `max_shard_size`, or into the files `weight_map` (name -> file) names."""
    if weight_map is None:
        split = split_torch_state_dict_into_shards(metas, filename_pattern=WEIGHTS_PATTERN,
                                                   max_shard_size=max_shard_size)
        weight_map, sharded = split.tensor_to_filename, split.is_sharded
    else:
        if set(weight_map) != set(metas):
            missing, extra = sorted(set(metas) - set(weight_map)), sorted(set(weight_map) - set(metas))
            raise ValueError(f"the index to follow does not list the model's tensors: missing {missing[:5]}, "
                             f"unknown {extra[:5]}")
        sharded = True
    files = {}
    for name, file in weight_map.items():
        files.setdefault(file, {})[name] = metas[name]
    writers = {file: SafetensorsWriter(os.path.join(folder, file), names) for file, names in files.items()}
    for name, tensor in tensors:
        writers[weight_map[name]].write(name, tensor)
    for writer in writers.values():
        writer.close()
    if sharded:
        index = {"metadata": {"total_size": sum(m.nbytes for m in metas.values())}, "weight_map": weight_map}
        atomic_write_text(os.path.join(folder, INDEX_FILE), json.dumps(index, indent=2) + "\n")
    atomic_write_text(os.path.join(folder, "config.json"), json.dumps(config, indent=2) + "\n")
