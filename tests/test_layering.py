"""One direction of dependencies: the floors table of docs/design.md, read from the doc, holds every
folder of the tree to importing only folders on lower floors (every import statement, function-level
ones included), and no module imports itself back through others."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCE_FOLDERS = ("mm_grpo", "converters", "bench")
_ROW = re.compile(r"^\| (\d+) \| `([\w/.]+)` \|", re.M)


def floors() -> dict:
    """{unit: floor} from the table: a unit is a folder ('mm_grpo/grpo') or a top-level module
    ('mm_grpo/kernels.py'; 'mm_grpo/__init__.py' is the package's own front door)."""
    return {path.rstrip("/"): int(floor) for floor, path in _ROW.findall(DESIGN.read_text())}


def unit_of(module: str) -> str:
    """The table's unit of a dotted module name: 'mm_grpo.families.flux.transformer.model' -> 'mm_grpo/families'."""
    parts = module.split(".")
    if parts[0] != "mm_grpo":
        return parts[0]
    if len(parts) == 1:
        return "mm_grpo/__init__.py"
    return f"mm_grpo/{parts[1]}" if (ROOT / "mm_grpo" / parts[1]).is_dir() else f"mm_grpo/{parts[1]}.py"


def modules() -> dict:
    """{dotted module name: path} of every source file of the tree."""
    found = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: pathlib.Path, known: dict) -> set:
    """The tree's modules one file imports. `from package import name` counts as the submodule
    `package.name` where there is one (not the package's __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known}


def unit_imports() -> dict:
    """{unit: {imported unit: first file importing it}} across units."""
    known = modules()
    found = {}
    for name, path in known.items():
        unit = unit_of(name)
        for target in imports(path, known):
            if unit_of(target) != unit:
                found.setdefault(unit, {}).setdefault(unit_of(target), str(path.relative_to(ROOT)))
    return found


def test_the_table_names_every_folder_of_the_tree():
    units = {unit_of(name) for name in modules()}
    assert units == set(floors()), {"not in the table": units - set(floors()), "gone": set(floors()) - units}


@pytest.mark.parametrize("unit", sorted(floors()))
def test_each_folder_imports_only_lower_floors(unit):
    table = floors()
    upward = {target: f"{where} (floor {table[target]})" for target, where in unit_imports().get(unit, {}).items()
              if table[target] >= table[unit]}
    assert not upward, f"{unit} (floor {table[unit]}) imports {upward}"


def test_no_module_imports_itself_back():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    state, cycle = {}, []

    def visit(name, stack):  # depth-first; a module met again on the stack closes a cycle
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle.extend(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
            if cycle:
                return
        state[name] = "done"

    for name in sorted(graph):
        if name not in state and not cycle:
            visit(name, [name])
    assert not cycle, " -> ".join(cycle)


def test_the_check_sees_imports():
    found = unit_imports()
    assert found["mm_grpo/training"].keys() >= {"mm_grpo/grpo", "mm_grpo/flow", "mm_grpo/rewards", "mm_grpo/rollout"}
    known = modules()  # a function-level import is seen (compositional.py's main: its prompt files)
    assert "mm_grpo.data.prompts" in imports(known["mm_grpo.rewards.compositional"], known)
    # an upward import would be seen: training is above grpo
    assert floors()["mm_grpo/training"] > floors()["mm_grpo/grpo"]


# What belongs to a model family: its package under mm_grpo/families (FLUX's transformer, its layout in
# the checkpoint, run-time glue, denoiser, encoders, planner and MindSpeed-MM predictor; Wan2.1's
# encoders, glue, planner and tiny pipeline), and what picks a family: the MindSpeed-MM glue and the
# tools. The GRPO core reaches a family only through the `Denoiser` it is handed.
FAMILIES = "mm_grpo/families"
FAMILY_UNITS = (FAMILIES, "mm_grpo/mindspeed_mm", "mm_grpo/tools")
CORE_UNITS = ("mm_grpo/grpo", "mm_grpo/rollout", "mm_grpo/flow")
# The shared floors every family stands on know no family package (training/ builds runs, so it may
# import them; its loop, loop.py, and whatever the loop imports, its checkpoints included, may not).
SHARED_UNITS = CORE_UNITS + ("mm_grpo/parallel", "mm_grpo/checkpoint", "mm_grpo/plan", "mm_grpo/rewards", "mm_grpo/files",
                             "mm_grpo/settings.py", "mm_grpo/seeding.py", "mm_grpo/configs.py", "mm_grpo/data",
                             "mm_grpo/kernels.py", "mm_grpo/platform", "mm_grpo/tiny", "mm_grpo/versions.py",
                             "mm_grpo/recompute.py")
SHARED_MODULES = ("mm_grpo.training.loop",)


@pytest.mark.parametrize("unit", CORE_UNITS)
def test_the_grpo_core_imports_no_model_family(unit):
    family = {target: where for target, where in unit_imports().get(unit, {}).items() if target in FAMILY_UNITS}
    assert not family, f"{unit} imports model-family code: {family}"


@pytest.mark.parametrize("unit", SHARED_UNITS)
def test_the_shared_floors_import_no_family_package(unit):
    assert unit in floors() and floors()[unit] < floors()[FAMILIES]
    where = unit_imports().get(unit, {}).get(FAMILIES)
    assert where is None, f"{unit} imports a family package ({where})"


@pytest.mark.parametrize("module", SHARED_MODULES)
def test_the_training_loop_imports_no_family_package(module):
    known = modules()
    reached, todo = {}, [module]  # module -> the module importing it, over every import path from `module`
    while todo:
        name = todo.pop()
        for target in imports(known[name], known) - reached.keys():
            reached[target] = name
            todo.append(target)
    family = sorted(f"{name} (imported by {reached[name]})" for name in reached if unit_of(name) == FAMILIES)
    assert not family, f"{module} reaches {family}"
    assert unit_of(module) != FAMILIES and "mm_grpo.training.checkpointing" in reached


def test_the_family_check_sees_family_imports():
    known = modules()
    assert any(unit_of(name) == FAMILIES for name in imports(known["mm_grpo.training.components"], known))
    assert FAMILIES in unit_imports()["mm_grpo/training"]


# --- the structure docs/design.md draws ------------------------------------------------------------
def drawn_graph() -> str:
    """The folder import graph as a mermaid flowchart: each unit with its floor, an arrow for each import
    between units that no other path already implies (`python tests/test_layering.py` prints it)."""
    edges = {unit: set(targets) for unit, targets in unit_imports().items()}

    def reach(unit, seen):
        for target in edges.get(unit, ()):
            if target not in seen:
                seen.add(target)
                reach(target, seen)
        return seen

    table = floors()
    node = lambda unit: unit.replace("mm_grpo/", "").replace("/", "_").replace(".py", "_py").replace(  # noqa: E731
        "__init___py", "init")
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'  {node(u)}["{u.replace("mm_grpo/", "")} ({table[u]})"]' for u in sorted(sorted(table), key=lambda u: -table[u])]
    for unit in sorted(edges):
        for target in sorted(edges[unit]):
            if not any(target in reach(other, set()) for other in edges[unit] - {target}):
                lines.append(f"  {node(unit)} --> {node(target)}")
    return "\n".join(lines + ["```"])


def test_the_design_draws_the_structure_of_the_imports():
    assert drawn_graph() in DESIGN.read_text(), "docs/design.md's graph is stale: python tests/test_layering.py"


def family_of(module: str):
    """The family package a dotted module belongs to ('mm_grpo.families.wan.tiny' -> 'wan'), else None."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["mm_grpo", "families"] and len(parts) > 2 else None


def test_no_family_imports_another():
    """What two families share sits on a floor below both (mm_grpo/tiny, mm_grpo/versions.py, ...),
    so each family can move, or go, alone."""
    known = modules()
    crossing = sorted(f"{name} imports {target}" for name, path in known.items() if family_of(name)
                      for target in imports(path, known) if family_of(target) not in (None, family_of(name)))
    assert not crossing, crossing


def test_the_cross_family_check_sees_a_familys_own_imports():
    known = modules()
    assert {family_of(name) for name in known} >= {"flux", "wan"}
    assert "mm_grpo.families.wan.encoders" in imports(known["mm_grpo.families.wan.tiny"], known)
    # a function-level one: parts.py imports the text encoders inside `conditioner`
    assert "mm_grpo.families.flux.text" in imports(known["mm_grpo.families.flux.parts"], known)
    assert family_of("mm_grpo.families.flux") == "flux" and family_of("mm_grpo.families") is None


if __name__ == "__main__":
    print(drawn_graph())
