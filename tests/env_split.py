"""Which test modules can differ between the two test environments, measured.

    .venv/bin/python -m tests.env_split [pytest arguments]

The environments (shell/run_tests.sh) differ in Megatron (the megatron-core wheel against
Megatron-LM core_v0.12.1's tree), transformers and diffusers, and only MindSpeed-MM's has
MindSpeed's adaptor and the MindSpeed-MM contract tests. This runs the default environment's suite
under coverage, measuring only those packages (PACKAGES and the testbed's folders), in pytest's
process and in every process it starts (trainers, converters, torchrun workers), each test's lines
under its node id. A module is *version-dependent* when one of its tests ran a line inside a
function of those packages (lines run at import do not count: which test imports a module first
depends on the order); the rest are *env-independent* and run in the default environment only,
marked `env_independent`. It prints both lists and fails when a marked module is version-dependent;
an unmarked env-independent module is only reported (it runs in both environments, which is never
wrong, only slower). torchrun checks are measured one by one (the workers switch the coverage
context per check): one registered env_independent fails the run when it ran a Megatron line that
no unmarked check ran. docs/running.md#tests.
"""
import ast
import functools
import os
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_ID = "MM_GRPO_TEST_ID"  # the running test's node id, inherited by the processes it starts
RAN = "MM_GRPO_TESTS_RAN"  # the file where the plugin lists the tests that ran


# --- the pytest plugin (-p tests.env_split) ---------------------------------------------------

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import coverage
    cov = coverage.Coverage.current()
    os.environ[TEST_ID] = item.nodeid  # subprocesses take it as their static context
    if cov is not None:
        cov.switch_context(item.nodeid)
    yield
    with open(os.environ[RAN], "a") as f:
        f.write(item.nodeid + "\n")
    os.environ[TEST_ID] = ""
    if cov is not None:
        cov.switch_context("")


# --- the measurement ----------------------------------------------------------------------------

# The packages whose version differs between the environments, torch aside (every test runs torch):
# Megatron (wheel 0.16 / core_v0.12.1's tree), MindSpeed and MindSpeed-MM (the testbed; MindSpeed-MM's
# environment only, apart from the converters the default one imports from it), transformers
# (5.x / 4.57) and diffusers (0.42 / 0.39).
PACKAGES = ("megatron.core", "transformers", "diffusers")


def measured_folders():
    """{folder: name} of the packages above and the testbed's MindSpeed-MM and MindSpeed."""
    import importlib.util
    from tests.testbed import TESTBED_PATHS
    folders = {}
    for name in PACKAGES:
        top = os.path.dirname(importlib.util.find_spec(name).origin)
        if name == "megatron.core":
            top = os.path.dirname(top)
        folders[top] = name.split(".")[0]
    folders.update({p: os.path.basename(p) for p in TESTBED_PATHS})
    return folders


@functools.lru_cache(maxsize=None)
def function_body_lines(path):
    """Line numbers inside function bodies (what runs when called, not when imported)."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return frozenset()
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            lines.update(range(body[0].lineno, node.end_lineno + 1))
    return frozenset(lines)


CHECK = "check:"  # the context of a torchrun check's lines (tests/distributed/worker.py)


def measured_lines(data_file, folders):
    """({node id: packages} of the tests that ran a function body of the measured packages,
    {check name: {(file, line)}} of the Megatron function-body lines each torchrun check ran)."""
    import coverage
    data = coverage.CoverageData(data_file)
    data.read()
    tests, checks = {}, {}
    for path in data.measured_files():
        package = next((name for top, name in folders.items() if path.startswith(top + os.sep)), None)
        body = function_body_lines(path)
        for line, contexts in data.contexts_by_lineno(path).items():
            if line not in body:
                continue
            for c in contexts:  # "static|dynamic": pytest's "|node id", a process it started "node id[|check:name]"
                parts = c.split("|")
                if test := next((p for p in parts if p and not p.startswith(CHECK)), None):
                    tests.setdefault(test, set()).add(package)
                if parts[-1].startswith(CHECK) and package == "megatron":
                    checks.setdefault(parts[-1][len(CHECK):], set()).add((path, line))
    return tests, checks


def unjustified_checks(checks):
    """{check: lines} of the checks registered env_independent that ran a Megatron line no unmarked
    check ran; every such check must have run."""
    import importlib
    from tests.distributed import worker
    for name in worker.CHECK_MODULES:
        importlib.import_module(name)
    if not checks:  # no torchrun check ran (a selection without tests/distributed/)
        return {}
    marked = {fn.__name__ for fn, _ in worker._CHECKS if fn.env_independent}
    kept = set().union(*(lines for name, lines in checks.items() if name not in marked))
    new = {name: checks.get(name, {("(did not run)", 0)}) - kept for name in marked}
    return {name: sorted(lines) for name, lines in new.items() if lines}


def collected(pytest_args, *select):
    """Node ids that pytest collects with these arguments (`-m env_independent`: the marked)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *select, *pytest_args], cwd=REPO, capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def main(pytest_args):
    try:
        import coverage
    except ImportError:
        sys.exit("tests.env_split needs coverage >= 7.10 (pip install coverage)")
    if tuple(int(x) for x in coverage.__version__.split(".")[:2]) < (7, 10):
        sys.exit(f"tests.env_split needs coverage >= 7.10 for subprocess measurement, found {coverage.__version__}")
    folders = measured_folders()
    with tempfile.TemporaryDirectory() as tmp:
        rc = os.path.join(tmp, "coveragerc")
        data_file = os.path.join(tmp, "coverage")
        with open(rc, "w") as f:
            f.write("[run]\nparallel = true\npatch = subprocess\n"
                    f"data_file = {data_file}\ncontext = ${{{TEST_ID}}}\n"
                    "source =\n" + "".join(f"    {p}\n" for p in folders))
        ran_file = os.path.join(tmp, "ran")
        env = dict(os.environ, **{TEST_ID: "", RAN: ran_file})
        run = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest",
                              "-p", "tests.env_split", "-p", "no:cacheprovider", "-q", *pytest_args],
                             cwd=REPO, env=env)
        subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, check=True)
        tests, checks = measured_lines(data_file, folders)
        with open(ran_file) as f:
            ran = {line.strip().split("::")[0] for line in f if line.strip()}
    dependent = {}
    for test, packages in tests.items():
        dependent.setdefault(test.split("::")[0], set()).update(packages)
    # The torchrun checks share one launch per world size (tests/distributed/conftest.py), measured
    # under whichever test started it; every check builds Megatron's parallel groups: all of
    # tests/distributed/ runs in both environments, whatever the attribution says.
    for module in ran:
        if module.startswith("tests/distributed/"):
            dependent.setdefault(module, set()).add("megatron (parallel layouts)")
    every, marked_ids = collected(pytest_args), collected(pytest_args, "-m", "env_independent")
    by_module = {}
    for node in every:
        by_module.setdefault(node.split("::")[0], set()).add(node)
    # A module is marked as a whole; in tests/distributed/ single tests may be marked, those of the
    # torchrun checks registered env_independent, which are measured check by check below.
    modules = {m: nodes <= marked_ids for m, nodes in sorted(by_module.items()) if m in ran}
    wrong = [m for m, free in modules.items() if free and m in dependent]
    wrong += sorted({n.split("::")[0] for n in marked_ids
                     if not modules.get(n.split("::")[0]) and not n.startswith("tests/distributed/")})
    wrong_checks = unjustified_checks(checks)
    print("\nversion-dependent (both environments):\n  " + "\n  ".join(
        f"{m}   ({', '.join(sorted(dependent[m]))})" for m in modules if m in dependent))
    print("env-independent (default environment only):\n  " + "\n  ".join(
        f"{m}{'' if free else '   (not marked env_independent: runs in both)'}"
        for m, free in modules.items() if m not in dependent))
    if run.returncode not in (0, 1):
        sys.exit(f"the measured pytest run ended with exit code {run.returncode}")
    print("torchrun checks registered env_independent (default environment only): every Megatron line they ran,"
          " an unmarked check ran too" if not wrong_checks else "")
    if wrong:
        sys.exit("marked env_independent but ran Megatron / MindSpeed / MindSpeed-MM code (or marked in part "
                 "outside tests/distributed/): " + ", ".join(wrong))
    if wrong_checks:
        sys.exit("torchrun checks registered env_independent that ran Megatron lines no unmarked check ran: " +
                 "; ".join(f"{name}: {lines[:3]}" for name, lines in wrong_checks.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
