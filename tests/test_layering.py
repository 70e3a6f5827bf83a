"""One direction of dependencies (docs/design.md): the algorithm packages never import the
training loop, and each imports only the packages listed for it."""
import ast
import pathlib

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mm_grpo"
# package -> the mm_grpo packages it may import (function-level imports included)
ALLOWED = {
    "grpo": {"flow", "rollout", "parallel", "pipeline", "seeding", "settings"},
    "rollout": set(),
    "flow": {"settings"},
    "rewards": {"data", "pipeline"},
}


def imported_packages(package: str) -> dict:
    """{mm_grpo package: first file importing it} over every import statement of `package`."""
    found = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "mm_grpo" and len(parts) > 1 and parts[1] != package:
                    found.setdefault(parts[1], path.name)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_algorithm_packages_import_only_downwards(package):
    found = imported_packages(package)
    assert "training" not in found
    assert set(found) <= ALLOWED[package], {k: v for k, v in found.items() if k not in ALLOWED[package]}


def test_the_check_sees_imports():
    assert imported_packages("training").keys() >= {"grpo", "flow", "rewards", "rollout"}
