"""Load diffusers-named FLUX weights straight into a (TP-sharded, PP-staged) model.

Reads lazily: only the tensors this rank's stage needs are read from the safetensors
files, one at a time, so a rank never holds the whole checkpoint.
"""
import glob
import os
from collections.abc import Mapping

import torch
from megatron.core import parallel_state
from safetensors import safe_open

from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FluxConfig
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


def transformer_dir(path: str) -> str:
    """A diffusers transformer folder, given it or a whole pipeline folder."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such FLUX checkpoint: {path}")
    if os.path.isdir(os.path.join(path, "transformer")):
        return os.path.join(path, "transformer")
    return path


def open_diffusers_weights(path: str, backend: str = "mmap") -> SafetensorsWeights:
    """Weights of a diffusers transformer folder (sharded with an index, or not)."""
    folder = transformer_dir(path)
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


def expected_hf_shapes(config: FluxConfig) -> dict:
    """Names and shapes of diffusers' FluxTransformer2DModel for `config` (built on meta)."""
    from diffusers import FluxTransformer2DModel
    with torch.device("meta"):
        ref = FluxTransformer2DModel(**config.to_diffusers_config())
    return {name: tuple(t.shape) for name, t in ref.state_dict().items()}


def check_hf_weights(weights: Mapping, config: FluxConfig):
    """Missing, unexpected and wrong-shaped diffusers tensors, all reported by name."""
    shapes = expected_hf_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(set(weights) - set(shapes))
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if problems:
        raise ValueError("; ".join(problems))
    if hasattr(weights, "shape_of"):
        wrong = [(n, weights.shape_of(n), s) for n, s in shapes.items() if weights.shape_of(n) != s]
    else:
        wrong = [(n, tuple(weights[n].shape), s) for n, s in shapes.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ValueError("wrong shapes: " + ", ".join(
            f"{n} is {tuple(got)}, expected {want}" for n, got, want in wrong))


def load_hf_weights(model, weights, check: bool = True):
    """Copy diffusers-named weights (a mapping or a path) into `model` for this rank."""
    if isinstance(weights, (str, os.PathLike)):
        weights = open_diffusers_weights(str(weights))
    config = model.flux_config
    if check:
        check_hf_weights(weights, config)
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    unruled = sorted(set(dict(model.named_parameters())) - {r.megatron for r in rules})
    if unruled:
        raise RuntimeError(f"model parameters without a layout rule: {unruled}")
    copy_hf_weights(model, weights, rules)
    return model


def copy_hf_weights(model, weights, rules):
    """Copy the diffusers tensors of `rules` (of `model`'s stage) into this rank's TP shards."""
    config = model.flux_config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for rule in rules:
            full = layout.merge(rule, [weights[h] for h in rule.hf], config)
            local = layout.shard(rule, full, tp_rank, tp_size, config)
            param = params[rule.megatron]
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{rule.megatron}: shard shape {tuple(local.shape)} does not fit "
                                 f"the model's {tuple(param.shape)}")
            param.copy_(local)
