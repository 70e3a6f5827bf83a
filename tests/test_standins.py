"""One list of stand-ins: tests/testbed.py's STANDINS is the only place the tests fake torch_npu,
torchair, mindspeed or CANN. Each entry says what it replaces and why that cannot be real on a CPU,
and names its files under tests/standins/; every other test source is scanned for a fake made
in place (the scanner itself is checked on the patterns it must catch and on look-alikes it must
leave alone)."""
import ast
import os
import pathlib
import re

import pytest

from tests.testbed import REPO, STANDIN_DIR, STANDINS

TESTS = pathlib.Path(REPO) / "tests"
FAKED = ("torch_npu", "torchair", "mindspeed")  # top-level modules; mindspeed_mm is real everywhere
NOT_IN_TESTBED = ("torch_npu", "torchair")  # no folder of these exists to read: any path to one is made
CANN_FILES = ("set_env.sh",)
NPU_KERNELS = ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul")  # their stand-ins: npu_kernels.py
SYS_MODULES_CHANGES = {"setitem", "delitem", "setdefault", "update", "pop", "clear", "__setitem__", "__delitem__"}
WRITES = {"write_text", "write_bytes", "write"}
MENTIONS = re.compile(r"\b(torch_npu|torchair|mindspeed)\b|set_env")
FILE_IN_FAKED_PACKAGE = re.compile(r"(torch_npu|torchair|mindspeed)(/[\w.]+)+")
STANDIN_FILE = re.compile(r"tests/standins/[\w./-]+")


def _strings(node):
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _names_faked(value):
    return value.split(".")[0] in FAKED


def _is_sys_modules(node):
    return (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _made_path(value):
    """A path component that only a fake would create: torch_npu/torchair, CANN's script."""
    parts = value.split("/")
    return parts[0] in NOT_IN_TESTBED or parts[-1] in CANN_FILES


def _fake(node):
    """What `node` does to fake torch_npu, torchair, mindspeed or CANN; None if nothing."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in NPU_KERNELS:
        return f"defines torch_npu's {node.name}"
    if isinstance(node, ast.keyword) and node.arg in NPU_KERNELS:
        return f"builds an object with torch_npu's {node.arg}"
    if isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and not isinstance(node.ctx, ast.Load):
        if any(_names_faked(s) for s in _strings(node.slice)):
            return "puts it in (or takes it out of) sys.modules"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        args = [*node.args, *(k.value for k in node.keywords)]
        strings = [s for a in args for s in _strings(a)]
        touches_sys_modules = _is_sys_modules(getattr(func, "value", None)) or any(map(_is_sys_modules, args))
        if touches_sys_modules and name in SYS_MODULES_CHANGES and any(map(_names_faked, strings)):
            return f"changes sys.modules ({name})"
        if name == "ModuleType" and node.args and any(map(_names_faked, _strings(node.args[0]))):
            return "builds a module object named after it"
        if name in WRITES and any(MENTIONS.search(s) for s in strings):
            return "writes a file that stands in for it"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        if any(_made_path(s) for side in (node.left, node.right) for s in _strings(side)):
            return "builds a path to a fake of it"
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "join":
        if any(_made_path(s) for a in node.args for s in _strings(a)):
            return "builds a path to a fake of it"
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and FILE_IN_FAKED_PACKAGE.fullmatch(node.value):
        return "names a file of a fake package"
    return None


def fakes_in(source, filename="<test>"):
    """[(line, what)] for each place `source` fakes torch_npu, torchair, mindspeed or CANN."""
    return sorted({(node.lineno, what) for node in ast.walk(ast.parse(source, filename))
                   if (what := _fake(node)) is not None})


def test_no_test_fakes_the_npu_stack_outside_the_standins():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == TESTS / "testbed.py" or pathlib.Path(STANDIN_DIR) in path.parents:
            continue
        found += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in fakes_in(path.read_text(), str(path))]
    assert not found, ("fakes of torch_npu / torchair / mindspeed / CANN outside tests/testbed.py's STANDINS "
                       "(make each a stand-in there, under tests/standins/):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    'sys.modules["torch_npu"] = fake',
    'sys.modules["mindspeed.megatron_adaptor"] = object()',
    'del sys.modules["torchair"]',
    'monkeypatch.setitem(sys.modules, "torch_npu", fake)',
    'monkeypatch.delitem(sys.modules, "mindspeed", raising=False)',
    'sys.modules.update({"torch_npu.npu": module})',
    'npu = types.ModuleType("torch_npu.npu")',
    '(tmp_path / "torch_npu").mkdir()',
    'os.makedirs(os.path.join(root, "torchair", "core"))',
    'FILES = {"torch_npu/__init__.py": "EVENTS = []", "mindspeed/megatron_adaptor.py": ""}',
    'script = ascend / set_env / "set_env.sh"',
    'script.write_text(\'case "$*" in *"import torch_npu"*) exit 0 ;; esac\')',
    'def npu_rms_norm(x, gamma, epsilon):\n    return x, None',
    'fake = types.SimpleNamespace(npu_rotary_mul=lambda x, r1, r2, rotary_mode: x)',
], ids=lambda s: s[:40])
def test_the_scan_catches_each_way_of_faking(source):
    assert fakes_in(source)


@pytest.mark.parametrize("source", [
    'assert "mindspeed.megatron_adaptor" in sys.modules',
    'torch_npu = importlib.import_module("torch_npu")',
    'module = sys.modules[torch_npu.npu_fusion_attention.__module__]',
    'out = torch_npu.npu_rms_norm(x, w, epsilon=1e-6)[0]',
    'kernel = sys.modules.get("torch_npu")',
    'assert "has neither cann/set_env.sh nor ascend-toolkit/set_env.sh" in proc.stderr',
    'source = (TESTBED / "MindSpeed" / "mindspeed" / "megatron_adaptor.py").read_text()',
    '(tmp_path / "config.json").write_text(json.dumps({"model": "mindspeed_mm"}))',
], ids=lambda s: s[:40])
def test_the_scan_leaves_real_uses_alone(source):
    assert fakes_in(source) == []


def test_every_standin_says_why_and_has_its_files():
    assert STANDINS
    for name, reason in STANDINS.items():
        files = STANDIN_FILE.findall(reason)
        assert len(reason.strip()) > len(" ".join(files)) + len(name), f"{name}: no reason given"
        assert files, f"{name}: its reason names no file under tests/standins/"
        missing = [f for f in files if not os.path.exists(os.path.join(REPO, f.rstrip(".")))]
        assert not missing, f"{name}: {missing} do not exist"
