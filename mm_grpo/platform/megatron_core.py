"""Which megatron-core this process uses, found without importing it.

Two installs exist: the `megatron-core` wheel (`pip install -e ".[megatron]"`), and Megatron-LM's
source tree on PYTHONPATH, which is how MindSpeed-MM users have it (core_v0.12.1). Both ship
`megatron` as a namespace package, so when both are present `megatron.core` comes from the first
on `sys.path` while the other copy stays importable beside it; `find_megatron_core` says so.
Reading `package_info.py` instead of importing keeps the CPU patches' import hook in front of
every Megatron module.
"""
import dataclasses
import importlib.util
import os
import re
import sys

SUPPORTED = ((0, 12), (0, 16))  # oldest and newest (major, minor): 0.12.x is MindSpeed's pin
INSTALL_HINT = ('pip install -e ".[megatron]" brings the megatron-core wheel; MindSpeed-MM users put '
                "Megatron-LM's tree on PYTHONPATH instead (docs/running.md)")


@dataclasses.dataclass(frozen=True)
class MegatronCore:
    path: str  # the folder of `megatron.core`
    version: tuple[int, int, int]
    others: tuple[str, ...] = ()  # further `megatron/core` folders on sys.path, shadowed by `path`

    @property
    def version_string(self) -> str:
        return ".".join(map(str, self.version))

    def __str__(self):
        return f"megatron.core {self.version_string} at {self.path}"


def _read_version(core_dir: str) -> tuple[int, int, int]:
    with open(os.path.join(core_dir, "package_info.py")) as f:
        text = f.read()
    return tuple(int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))


def _core_dirs_on_path() -> list[str]:
    found = (os.path.join(p or os.getcwd(), "megatron", "core") for p in sys.path)
    return list(dict.fromkeys(os.path.realpath(d) for d in found
                              if os.path.isfile(os.path.join(d, "__init__.py"))))


def find_megatron_core() -> MegatronCore | None:
    """The megatron.core that `import megatron.core` would load, or None if there is none."""
    if importlib.util.find_spec("megatron") is None:
        return None
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.realpath(spec.submodule_search_locations[0])
    others = tuple(d for d in _core_dirs_on_path() if d != path)
    return MegatronCore(path, _read_version(path), others)


def check_megatron_core() -> MegatronCore:
    """The megatron.core in use, or ImportError in one line: none found, or a version mm-grpo
    does not support."""
    core = find_megatron_core()
    if core is None:
        raise ImportError(f"mm_grpo needs megatron.core and none is importable: {INSTALL_HINT}")
    (low, high) = SUPPORTED
    if not low <= core.version[:2] <= high:
        raise ImportError(f"{core} is not supported: mm_grpo runs on megatron-core "
                          f"{'.'.join(map(str, low))}.x to {'.'.join(map(str, high))}.x")
    return core
