"""diffusers' safetensors weights, read lazily: a transformer folder (sharded with an index, or not)
or a whole pipeline folder, as a name -> tensor mapping that reads only the tensors asked for, so a
rank never holds the whole checkpoint. Which tensors a family needs is its layout."""
import glob
import os
from collections.abc import Mapping

import torch
from safetensors import safe_open

from mm_grpo.files.jsonfile import load_json

_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# dtype names in safetensors headers
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsWeights(Mapping):
    """A read-only, lazy name -> tensor mapping over one or more safetensors files.

    `backend` is safetensors' own: "mmap" maps the files, "pread" reads each tensor with
    pread(2) so that tensors already used do not stay resident (the converter uses it)."""

    def __init__(self, files, backend="mmap"):
        self._backend = backend
        self._where = {}
        for path in files:
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        self._where[name] = path
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ValueError(f"cannot read safetensors file {path}: {e}") from None
        self._handles = {}

    def _handle(self, name):
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", backend=self._backend)
        return self._handles[path]

    def shape_of(self, name):
        return tuple(self._handle(name).get_slice(name).get_shape())

    def meta(self, name):
        """A meta tensor with the stored shape and dtype (reads no tensor bytes)."""
        info = self._handle(name).get_slice(name)
        if info.get_dtype() not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} in {self._where[name]} has unsupported dtype {info.get_dtype()}")
        return torch.empty(info.get_shape(), dtype=SAFETENSORS_DTYPES[info.get_dtype()], device="meta")

    def rows(self, name, start, stop):
        """Rows [start, stop) of a tensor, reading only their bytes (parts of a fused tensor)."""
        try:
            return self._handle(name).get_slice(name)[start:stop]
        except Exception as e:
            raise ValueError(f"cannot read tensor {name} from {self._where[name]} (truncated file?): {e}") from None

    def __getitem__(self, name):
        handle, path = self._handle(name), self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name} from {path} (truncated file?): {e}") from None

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def transformer_dir(path: str, family: str = "diffusers") -> str:
    """A diffusers transformer folder, given it or a whole pipeline folder (`family` names the model
    in the error)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such {family} checkpoint: {path}")
    if os.path.isdir(os.path.join(path, "transformer")):
        return os.path.join(path, "transformer")
    return path


def open_diffusers_weights(path: str, backend: str = "mmap", family: str = "diffusers") -> SafetensorsWeights:
    """Weights of a diffusers transformer folder (sharded with an index, or not), or a pipeline's."""
    folder = transformer_dir(path, family)
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        weight_map = load_json(index, "safetensors index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} is not a safetensors index (JSON with a 'weight_map' of shard files)")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
    else:
        files = sorted(glob.glob(os.path.join(folder, "diffusion_pytorch_model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no diffusion_pytorch_model*.safetensors in {folder}")
    return SafetensorsWeights(files, backend)


def check_weights(weights: Mapping, shapes: dict):
    """Missing, unexpected and wrong-shaped tensors of `weights` against {name: shape} (a family's
    diffusers model built on meta), all named in one line."""
    problems = []
    if missing := sorted(set(shapes) - set(weights)):
        problems.append(f"missing weights: {', '.join(missing)}")
    if unexpected := sorted(set(weights) - set(shapes)):
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if problems:
        raise ValueError("; ".join(problems))
    shape_of = weights.shape_of if hasattr(weights, "shape_of") else (lambda n: tuple(weights[n].shape))
    wrong = [(n, shape_of(n), s) for n, s in shapes.items() if tuple(shape_of(n)) != s]
    if wrong:
        raise ValueError("wrong shapes: " + ", ".join(f"{n} is {tuple(got)}, expected {want}" for n, got, want in wrong))

