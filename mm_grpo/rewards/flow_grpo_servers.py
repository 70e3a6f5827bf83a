"""Clients of flow_grpo's reward servers (its `reward-server` repository): GenEval and DeQA.

The protocol, as flow_grpo's `geneval_score` / `deqa_score_remote` speak it: one POST to the
server's root per batch of at most 64 images; the body is a pickle of
    {"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata, ...], "only_strict": True}   (GenEval)
    {"images": [JPEG bytes, ...]}                                                               (DeQA)
(JPEG at PIL's default quality, 75), and the reply a pickle of a dict whose "scores" (GenEval)
or "outputs" (DeQA) list is the reward: Python floats in the authors' servers, numpy scalars
or arrays in others.

What each side trusts: the server unpickles the trainer's request (it must trust the trainer).
This client reads a reply as data: at most MAX_REPLY_BYTES, its opcodes read first with nothing
built (pickletools), then unpickled with no constructor callable. The first read refuses
containers nested more than MAX_REPLY_DEPTH deep or inside themselves, and a container as a
dict key or set member: loading hashes keys, and hashing a tuple recurses through it in C, which
a 250,000-deep one overflows (a segfault, which nothing can catch). Built-in containers,
numbers and strings load as pickle builds them; numpy's scalars and arrays are rebuilt here
from their bytes as lists of Python numbers, after their dtype (numbers and bools only), shape
(at most MAX_ARRAY_DIMS sizes) and size (at most MAX_ARRAY_ELEMENTS numbers and nested lists,
exactly as many bytes as the shape needs) are checked, before anything is allocated. Any other
class or callable in a reply is refused in one line, so a hostile server can neither run code
nor ask for memory, stack or time.
"""
import io
import json
import math
import pickle
import pickletools
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
MAX_ARRAY_ELEMENTS = 1 << 16  # the numbers and nested lists one numpy array in a reply becomes
MAX_ARRAY_DIMS = 32  # numpy 1.x's own limit; a score array has one
MAX_ARRAY_SIZE = 1 << 63  # numpy's sizes are 64-bit: no array it writes is longer along an axis
# How deep a reply's containers may nest, as pickle builds them: a GenEval reply nests 6 deep (its
# dict, a dict of groups, a numpy array: a call, its arguments and state, their shape and dtype).
MAX_REPLY_DEPTH = 32
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
            raise _Refused(f"it holds a numpy dtype {wire.brief(code)}, not a number or bool dtype")
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
    if not (isinstance(shape, tuple) and len(shape) <= MAX_ARRAY_DIMS
            and all(type(n) is int and 0 <= n < MAX_ARRAY_SIZE for n in shape)):
        raise _Refused(f"it holds a numpy array of shape {wire.brief(shape)}, not at most {MAX_ARRAY_DIMS} "
                       "sizes of an axis")
    count = math.prod(shape)
    if count > MAX_ARRAY_ELEMENTS:
        raise _Refused(f"it holds a numpy array of {count} elements, more than {MAX_ARRAY_ELEMENTS}")
    # .tolist() makes a list per row of every axis but the last: (65536, 65536, 0) holds no number, 4e9 lists
    lists = sum(math.prod(shape[:axis]) for axis in range(1, len(shape)))
    if count + lists > MAX_ARRAY_ELEMENTS:
        raise _Refused(f"it holds a numpy array of shape {shape}, which is {lists} nested lists, more than "
                       f"{MAX_ARRAY_ELEMENTS}")
    if not (isinstance(data, (bytes, bytearray)) and len(data) == count * dtype.numpy().itemsize):
        raise _Refused(f"it holds a numpy array of shape {shape} whose bytes do not fill it")
    return np.frombuffer(data, dtype.numpy()).reshape(shape, order="F" if fortran else "C").tolist()


def _array_values(dtype, shape, data, fortran):
    """An array's numbers as nested lists; a 0-d array (one number) is refused: it loads as an
    _Array, a list, which its number cannot become."""
    if shape == ():
        raise _Refused("it holds a numpy array of no dimension, where a reply holds lists or numpy scalars")
    return _values(dtype, shape, data, fortran)


class _Array(list):
    """numpy's `_reconstruct(ndarray, (0,), b'b')` then BUILD (version, shape, dtype, fortran,
    bytes), as pickle protocols 2 to 4 write an array: a list of Python numbers."""

    def __setstate__(self, state):
        if self or not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1):
            raise _Refused("it holds a numpy array state that is not one")
        _, shape, dtype, fortran, data = state
        self.extend(_array_values(dtype, shape, data, fortran is True))


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
    return _Array(_array_values(dtype, shape, buffer, order == "F"))


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


# Opcodes that fill the object below their operands, which stays on the stack.
FILLERS = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
# Opcodes that hash their operands (every second one: a dict's keys; every one: a set's members).
HASHING = {"DICT": 2, "SETITEM": 2, "SETITEMS": 2, "FROZENSET": 1, "ADDITEMS": 1}
# Object builders no reply of containers, numbers and numpy values is written with.
NEVER_WRITTEN = frozenset({"INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4"})
CONTAINERS = frozenset({"list", "tuple", "dict", "set", "frozenset"})  # pickletools' names of what opcodes push
MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def _effect(op) -> tuple:
    """(pops to a mark, else how many operands it pops, pushes a result, which is a container)."""
    pushes = bool(op.stack_after)
    return (pickletools.markobject in op.stack_before, len(op.stack_before) - (op.name in FILLERS), pushes,
            pushes and op.stack_after[0].name in CONTAINERS)


EFFECTS = {op.name: _effect(op) for op in pickletools.opcodes}
# Opcodes that take no operand and push a new value (plain, or an empty container): most of a
# reply's, and all of the cheapest replies at the cap, so read without a call each.
FRESH = frozenset(name for name, (marked, pops, _, _) in EFFECTS.items() if not (marked or pops)) - (
    {"MARK"} | MEMO_PUTS | MEMO_GETS | NEVER_WRITTEN)


class _Skeleton:
    """What a reply's opcodes would build, with nothing built: each container or call a node (an
    int, its index in `depths`); a number, string or global None. Pickle's stack, marks and memo
    are followed as the unpickler follows them. A container is filled only before it is placed in
    another (as pickle writes them), so each node's depth is final when it is placed."""

    def __init__(self):
        self.depths = []  # node -> how deep containers nest in it, itself included
        self.placed = set()  # nodes held by another
        self.calls = set()  # nodes made by REDUCE: the only ones BUILD may give a state
        self.stack, self.marks, self.memo = [], [], {}

    def read(self, data: bytes):
        """The node pickle's STOP returns (None: a plain value); _Refused, or pickletools'
        ValueError for a stream that is not a pickle (one without a STOP included)."""
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in FRESH:
                _, _, pushes, container = EFFECTS[name]
                if container:
                    self.depths.append(1)
                    self.stack.append(len(self.depths) - 1)
                elif pushes:
                    self.stack.append(None)
            elif name == "STOP":
                return self.pop(1)[0]
            elif name == "MARK":
                self.marks.append(len(self.stack))
            elif name == "POP" and self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()  # pickle's POP right after a MARK drops the mark
            elif name in MEMO_PUTS:
                self.memo[len(self.memo) if name == "MEMOIZE" else arg] = self.top()
            elif name in MEMO_GETS:
                if arg not in self.memo:
                    raise _Refused(f"it is not a pickle this client reads (memo {arg} read before it is written)")
                self.stack.append(self.memo[arg])
            elif name == "DUP":
                self.stack.append(self.top())
            else:
                self.build(name)

    def build(self, name: str):
        """Any other opcode, by its operands (pickletools' stack_before) and result (stack_after)."""
        if name in NEVER_WRITTEN:
            raise _Refused(f"it builds an object with pickle's {name}, which the client does not do")
        marked, pops, pushes, container = EFFECTS[name]
        operands = self.pop_mark() if marked else self.pop(pops)
        if name in HASHING and any(key is not None for key in operands[::HASHING[name]]):
            raise _Refused("it has a container as a dict key or set member, where a reply has strings and numbers")
        nodes = [o for o in operands if o is not None]
        if name in FILLERS:
            self.fill(name, nodes)
        elif pushes:
            self.stack.append(self.node(nodes, name == "REDUCE") if nodes or container else None)

    def node(self, nodes: list, call: bool) -> int:
        self.placed.update(nodes)
        self.depths.append(self.nested(nodes))
        node = len(self.depths) - 1
        if call:
            self.calls.add(node)
        return node

    def fill(self, name: str, nodes: list):
        target = self.top()
        if target is None or (name == "BUILD" and target not in self.calls):
            raise _Refused(f"it applies pickle's {name} to what is not a container or numpy value")
        self.placed.update(nodes)
        if target in self.placed:  # itself among the nodes, or held by one already
            raise _Refused("it puts a container inside itself, or fills one already inside another")
        self.depths[target] = max(self.depths[target], self.nested(nodes))

    def nested(self, nodes: list) -> int:
        depth = 1 + max(map(self.depths.__getitem__, nodes), default=0)
        if depth > MAX_REPLY_DEPTH:
            raise _Refused(f"it nests containers more than {MAX_REPLY_DEPTH} deep")
        return depth

    def top(self):
        self.check_above_mark(1)
        return self.stack[-1]

    def pop(self, count: int) -> list:
        self.check_above_mark(count)
        cut = len(self.stack) - count
        popped = self.stack[cut:]
        del self.stack[cut:]
        return popped

    def check_above_mark(self, count: int):
        if len(self.stack) - count < (self.marks[-1] if self.marks else 0):  # as pickle's own underflow
            raise _Refused("it is not a pickle this client reads (it pops more than it pushed)")

    def pop_mark(self) -> list:
        if not self.marks:
            raise _Refused("it is not a pickle this client reads (it pops to a mark it never set)")
        start = self.marks.pop()
        popped = self.stack[start:]
        del self.stack[start:]
        return popped


def load_reply(data: bytes):
    """A flow_grpo server's pickled reply as data: containers, numbers, strings; numpy values as
    Python numbers and lists. pickle.UnpicklingError (one line) for anything else: its structure
    is read first, with nothing built (_Skeleton)."""
    try:
        _Skeleton().read(data)
        return _ReplyUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a malformed stream fails in many ways (EOFError, ValueError, TypeError, ...)
        raise pickle.UnpicklingError(f"it is not a pickle this client reads ({type(e).__name__}: "
                                     f"{str(e)[:120]})") from None


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
                scores.append(wire.reply_scores(load_reply(reply.content), self.reply_key, len(jpegs)))
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
