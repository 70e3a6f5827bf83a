"""Clients of flow_grpo's reward servers (its `reward-server` repository): GenEval and DeQA.

The protocol, as flow_grpo's `geneval_score` / `deqa_score_remote` speak it: one POST to the
server's root per batch of at most 64 images; the body is a pickle of
    {"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata, ...], "only_strict": True}   (GenEval)
    {"images": [JPEG bytes, ...]}                                                               (DeQA)
(JPEG at PIL's default quality, 75), and the reply a pickle of a dict whose "scores" (GenEval)
or "outputs" (DeQA) list is the reward: Python floats in the authors' servers, numpy scalars
or arrays in others.

What each side trusts: the server unpickles the trainer's request (it must trust the trainer).
This client reads a reply as data: at most MAX_REPLY_BYTES, unpickled with no constructor
callable. Built-in containers, numbers and strings load as pickle builds them; numpy's
scalars and arrays are rebuilt here from their bytes as lists of Python numbers, after their
dtype (numbers and bools only) and size (at most MAX_ARRAY_ELEMENTS, exactly as many bytes as
the shape needs) are checked, before anything is allocated. Any other class or callable in a
reply is refused in one line, so a hostile server can neither run code nor ask for memory.
"""
import io
import json
import math
import pickle
import reprlib
from pathlib import Path

import numpy as np
import torch

from mm_grpo.rewards import wire
from mm_grpo.rewards.base import register_reward, uint8_pixels
from mm_grpo.rewards.remote import RemoteRefused, RemoteScored

BATCH = 64  # images per request, as flow_grpo sends them
JPEG_QUALITY = 75  # PIL's default, what flow_grpo sends
# A 64-image GenEval reply (three score lists, six groups of 64) pickles to under 10 kB; pickle's
# opcodes can build up to ~220x their size in objects, so the cap also bounds what loading takes.
MAX_REPLY_BYTES = 256 << 10
MAX_ARRAY_ELEMENTS = 1 << 16  # per numpy array or scalar list in a reply
DTYPES = frozenset(f"{kind}{size}" for kind, sizes in (("f", "248"), ("i", "1248"), ("u", "1248"), ("b", "1"))
                   for size in sizes)  # numbers and bools, as numpy names them in a pickle
BYTE_ORDERS = frozenset("<>|=")
NUMPY_CORE = ("numpy.core", "numpy._core")  # numpy 1.x and 2.x pickle under either


class _Refused(pickle.UnpicklingError):
    pass


class _DType:
    """What `numpy.dtype(code, align, copy)` in a reply stands for: a number or bool dtype only."""

    def __init__(self, code, align=False, copy=True):
        if not (isinstance(code, str) and code in DTYPES):
            raise _Refused(f"it holds a numpy dtype {str(code)[:40]!r}, not a number or bool dtype")
        self.code, self.order = code, "|"

    def __setstate__(self, state):
        # (version, byte order, subarray, names, fields, ...): a plain dtype has no subarray or fields
        if not (isinstance(state, tuple) and len(state) >= 5 and state[1] in BYTE_ORDERS
                and state[2:5] == (None, None, None)):
            raise _Refused(f"it holds a numpy {self.code} dtype with a structure, not a plain one")
        self.order = state[1]

    def numpy(self) -> np.dtype:
        return np.dtype(self.code).newbyteorder(self.order)


def _values(dtype, shape, data, fortran=False):
    """The numbers of an array of `shape` in `data` (nested lists), checked before anything is allocated."""
    if not isinstance(dtype, _DType):
        raise _Refused("it holds a numpy array without a plain dtype")
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise _Refused(f"it holds a numpy array of shape {str(shape)[:40]}")
    count = math.prod(shape)
    if count > MAX_ARRAY_ELEMENTS:
        raise _Refused(f"it holds a numpy array of {count} elements, more than {MAX_ARRAY_ELEMENTS}")
    if not (isinstance(data, (bytes, bytearray)) and len(data) == count * dtype.numpy().itemsize):
        raise _Refused(f"it holds a numpy array of shape {shape} whose bytes do not fill it")
    return np.frombuffer(data, dtype.numpy()).reshape(shape, order="F" if fortran else "C").tolist()


class _Array(list):
    """numpy's `_reconstruct(ndarray, (0,), b'b')` then BUILD (version, shape, dtype, fortran,
    bytes), as pickle protocols 2 to 4 write an array: a list of Python numbers."""

    def __setstate__(self, state):
        if self or not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
            raise _Refused("it holds a numpy array state that is not one")
        _, shape, dtype, fortran, data = state
        self.extend(_values(dtype, shape, data, fortran is True))


class _NDArrayName:
    """`numpy.ndarray` as `_reconstruct` names it; calling it (an array of any shape) is refused."""

    def __call__(self, *args, **kwargs):
        raise _Refused("it calls numpy.ndarray, which the client does not do")


_NDARRAY = _NDArrayName()


def _reconstruct(cls, shape, typecode):
    if cls is not _NDARRAY or shape != (0,) or typecode != b"b":
        raise _Refused("it calls numpy's _reconstruct with arguments numpy never writes")
    return _Array()


def _frombuffer(buffer, dtype, shape, order="C"):
    """numpy's `_frombuffer`, as pickle protocol 5 writes an array (its bytes in band)."""
    return _Array(_values(dtype, shape, buffer, order == "F"))


def _scalar(dtype, data):
    """numpy's `scalar(dtype, bytes)`: a numpy number -> the Python number."""
    return _values(dtype, (), data)


SAFE_GLOBALS = {("numpy", "dtype"): _DType, ("numpy", "ndarray"): _NDARRAY}
for _core in NUMPY_CORE:
    SAFE_GLOBALS.update({(f"{_core}.multiarray", "_reconstruct"): _reconstruct,
                         (f"{_core}.multiarray", "scalar"): _scalar,
                         (f"{_core}.numeric", "_frombuffer"): _frombuffer})


class _ReplyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in SAFE_GLOBALS:
            raise _Refused(f"it holds {module}.{name}, which the client does not load")
        return SAFE_GLOBALS[(module, name)]

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id, which the client does not load")


def load_reply(data: bytes):
    """A flow_grpo server's pickled reply as data: containers, numbers, strings; numpy values as
    Python numbers and lists. pickle.UnpicklingError (one line) for anything else."""
    try:
        return _ReplyUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a malformed stream fails in many ways (EOFError, ValueError, TypeError, ...)
        raise pickle.UnpicklingError(f"it is not a pickle this client reads ({type(e).__name__}: "
                                     f"{str(e)[:120]})") from None


def scores_of(reply, key: str, count: int) -> torch.Tensor:
    """`reply[key]` as float32 [count]: real numbers, one per image; a non-finite score becomes
    NaN, as a null does in mm-grpo's protocol. ValueError saying what is wrong."""
    if not isinstance(reply, dict) or key not in reply:
        keys = sorted(map(str, reply))[:8] if isinstance(reply, dict) else type(reply).__name__
        raise ValueError(f"it has no {key!r} (it has {keys})")
    values = reply[key]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"its {key!r} is a {type(values).__name__} ({reprlib.repr(values)}), "
                         f"not a list of {count} numbers")
    if len(values) != count:
        raise ValueError(f"its {key!r} holds {len(values)} scores for {count} images")
    numbers = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"its {key!r}[{i}] is a {type(value).__name__} ({reprlib.repr(value)}), "
                             "not a number")
        try:
            numbers.append(float(value))
        except OverflowError:
            raise ValueError(f"its {key!r}[{i}] is an integer of {value.bit_length()} bits, past any float") from None
    return torch.tensor([v if math.isfinite(v) else math.nan for v in numbers], dtype=torch.float32)


class FlowGRPOServer(RemoteScored):
    """A flow_grpo reward server: `reply_key` of its reply is the reward."""

    reply_key = None
    max_reply_bytes = MAX_REPLY_BYTES

    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        self.endpoint.check_reachable()  # its servers answer a GET with 405: reachable is enough

    def payload(self, jpegs, prompts) -> dict:
        return {"images": jpegs}

    def request(self, images, prompts):
        pixels, scores = uint8_pixels(images), []
        for start in range(0, len(prompts), BATCH):
            rows = slice(start, start + BATCH)
            jpegs = [wire.encode_image(p, "jpeg", JPEG_QUALITY) for p in pixels[rows]]
            reply = self.endpoint.request("POST", data=pickle.dumps(self.payload(jpegs, prompts[rows])))
            try:
                scores.append(scores_of(load_reply(reply.content), self.reply_key, len(jpegs)))
            except (pickle.UnpicklingError, ValueError) as e:
                raise RemoteRefused(f"reward {self.name!r}: {self.endpoint.url} sent a reply that is not "
                                    f"{len(jpegs)} scores: {e}") from None
        return torch.cat(scores)


def read_geneval_metadata(reward_name: str, path: Path) -> dict:
    """GenEval's metadata file (JSON lines, each an object with "prompt") -> {prompt: entry};
    ValueError naming the file and line for anything else."""
    metadata = {}
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"reward {reward_name!r}: {path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{where} is not JSON (nested too deeply)") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f"{where} has no \"prompt\" string")
        metadata[entry["prompt"]] = entry
    return metadata


@register_reward("geneval_server")
class GenEvalServer(FlowGRPOServer):
    """GenEval behind flow_grpo's reward server: `path` is GenEval's metadata file (JSON lines with
    "prompt" and the checks the detector runs); every prompt must have a line."""

    reply_key = "scores"

    def __init__(self, cfg, device="cpu"):
        self.metadata = read_geneval_metadata(self.name, cfg.require_path("path", "file"))
        super().__init__(cfg, device)

    def check_prompts(self, prompts):
        missing = [p for p in dict.fromkeys(prompts) if p not in self.metadata]
        if missing:
            raise ValueError(f"reward {self.name!r}: {len(missing)} prompt(s) have no GenEval metadata in "
                             f"{Path(self.cfg.path).name}, e.g. {missing[0]!r}")

    def payload(self, jpegs, prompts):
        self.check_prompts(prompts)
        return {"images": jpegs, "meta_datas": [self.metadata[p] for p in prompts], "only_strict": True}


@register_reward("deqa_server")
class DeQAServer(FlowGRPOServer):
    """DeQA-Score (image quality, prompt-free) behind flow_grpo's reward server."""

    reply_key = "outputs"
