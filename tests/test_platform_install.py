"""One megatron: mm-grpo's install brings the megatron-core wheel only when asked to.

MindSpeed-MM users have Megatron-LM's `megatron/` tree on PYTHONPATH; the documented install
line for them (docs/running.md) must leave that tree the only `megatron` there is.
"""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest

import mm_grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The install line docs/running.md gives MindSpeed-MM users (run from the repository root).
INSTALL_LINE = "pip install --no-build-isolation -e ."

_REPORT = """
import importlib.metadata, json, os, sys
import mm_grpo
def has_megatron(entry):
    return os.path.isdir(os.path.join(entry or os.getcwd(), "megatron"))
try:
    wheel = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    wheel = None
print("REPORT" + json.dumps({
    "megatron_dirs": [os.path.realpath(os.path.join(e, "megatron")) for e in sys.path if e and has_megatron(e)],
    "used": mm_grpo.MEGATRON.path, "others": list(mm_grpo.MEGATRON.others), "wheel": wheel,
    "mm_grpo": os.path.dirname(mm_grpo.__file__)}))
"""


def test_megatron_core_is_an_extra_of_the_package():
    requires = importlib.metadata.requires("mm-grpo")
    megatron = [r for r in requires if r.startswith("megatron-core")]
    assert megatron and all(re.search(r'extra == "megatron"', r) for r in megatron), requires


def test_docs_give_the_install_line():
    with open(os.path.join(REPO, "docs", "running.md")) as f:
        assert INSTALL_LINE in f.read()


@pytest.mark.mindspeed_mm
def test_install_line_leaves_exactly_one_megatron(tmp_path):
    """A fresh venv that sees this environment's packages (MindSpeed-MM's, through a .pth file:
    no download) and Megatron-LM's tree on PYTHONPATH; after the install line, the tree is the
    only `megatron` importable and no megatron-core wheel is installed."""
    tree = os.path.dirname(os.path.dirname(mm_grpo.MEGATRON.path))  # <Megatron-LM>/megatron/core
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    site_packages = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site_packages, "mindspeed_mm_env.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")  # this environment's packages, read-only
    env = dict(os.environ, PYTHONPATH=tree, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONHOME", None)
    argv = [python, "-m", *INSTALL_LINE.split()]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(site_packages, "megatron"))

    proc = subprocess.run([python, "-c", _REPORT], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT"))[len("REPORT"):])
    assert report["megatron_dirs"] == [os.path.realpath(os.path.join(tree, "megatron"))]
    assert report["used"] == mm_grpo.MEGATRON.path and report["others"] == []
    assert report["wheel"] is None
    assert report["mm_grpo"] == os.path.join(REPO, "mm_grpo")  # the editable install is the one imported
