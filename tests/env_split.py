"""Which tests MindSpeed-MM's environment runs, measured there.

    PYTHONPATH=<Megatron-LM> .venv-mindspeed-mm/bin/python -m tests.env_split [--write] [--data DIR] [pytest args]

The two test environments (shell/run_tests.sh) differ in Megatron (the megatron-core wheel against
Megatron-LM core_v0.12.1's tree), transformers and diffusers, and only MindSpeed-MM's has MindSpeed's
adaptor and the MindSpeed-MM contract tests. The default environment runs every test; MindSpeed-MM's
runs a subset that executes there every line the whole suite executes there: every function-body
line of mm_grpo, Megatron, MindSpeed, MindSpeed-MM, transformers and diffusers (lines run at import
do not count: which test imports a module first depends on the order).

This runs the whole suite in MindSpeed-MM's environment (MM_GRPO_TEST_ALL=1) under coverage of those
packages, in pytest's process and in every process it starts (trainers, converters, torchrun
workers), each test's lines under its node id and each torchrun check's under its name; a test
counts with the checks it reads. Always in both: the contract tests (marked mindspeed_mm), the
modules in ALWAYS_BOTH and the tests that failed under coverage. Of the rest, a greedy cover keeps the tests that add lines, the cheapest per
new line first; the others are listed in DEFAULT_ONLY, with the checks that only they read
(`check:NAME`), and run in the default environment only. Without --write it checks the list as it
stands and fails when what it leaves out ran a line that nothing kept runs. --data DIR keeps the
measurement in DIR and reuses it when it is there. docs/running.md#tests.
"""
import ast
import functools
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ONLY = os.path.join(REPO, "tests", "default_env_only.txt")
TEST_ID = "MM_GRPO_TEST_ID"  # the running test's node id, inherited by the processes it starts
RAN = "MM_GRPO_TESTS_RAN"  # the file where the plugin lists the tests that ran, with their seconds
FAILED = "\tfailed"  # after a test's seconds there: it failed under coverage (a process may have written none)
READS = "MM_GRPO_CHECKS_READ"  # the file where tests/distributed/conftest.py lists the checks each test reads
CHECK = "check:"  # a torchrun check: its coverage context (tests/distributed/worker.py) and its list entry

# Modules that run in both environments whatever they measure: they test what coverage does not
# see, the launch scripts' bash, the platform adaptor's choices made at import, and processes that
# are killed (which write no coverage) under torchrun's agent (torch's version differs too).
ALWAYS_BOTH = {
    "tests/test_launch_env.py": "the launch scripts' bash",
    "tests/test_run_trainer.py": "the shipped scripts' bash",
    "tests/test_platform.py": "the adaptor's patches, chosen at import",
    "tests/test_platform_install.py": "the Megatron install the adaptor finds at import",
    "tests/distributed/test_reliability_distributed.py": "killed workers under torchrun's agent",
}


@functools.lru_cache(maxsize=None)
def default_env_only() -> frozenset:
    """The node ids and `check:NAME`s listed in DEFAULT_ONLY: MindSpeed-MM's environment deselects
    those tests (tests/conftest.py) and skips those torchrun checks (tests/distributed/worker.py)."""
    if not os.path.exists(DEFAULT_ONLY):
        return frozenset()
    with open(DEFAULT_ONLY) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def left_out_here() -> frozenset:
    """The entries of DEFAULT_ONLY this environment leaves out: all of them in MindSpeed-MM's (unless
    MM_GRPO_TEST_ALL=1), none in the default one."""
    from tests.testbed import default_only_left_out
    return default_env_only() if default_only_left_out() else frozenset()


# --- the pytest plugin (-p tests.env_split) ---------------------------------------------------

_failed = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import coverage
    cov = coverage.Coverage.current()
    os.environ[TEST_ID] = item.nodeid  # subprocesses take it as their static context
    if cov is not None:
        cov.switch_context(item.nodeid)
    start = time.perf_counter()
    yield
    with open(os.environ[RAN], "a") as f:  # set-up and teardown included; failed: not measured whole
        f.write(f"{item.nodeid}\t{time.perf_counter() - start:.3f}{FAILED if item.nodeid in _failed else ''}\n")
    os.environ[TEST_ID] = ""
    if cov is not None:
        cov.switch_context("")


def pytest_runtest_logreport(report):
    if report.failed:
        _failed.add(report.nodeid)


def record_check_read(name, seconds):
    """Under the measurement, that the running test reads torchrun check `name`, which took `seconds`."""
    if os.environ.get(READS):
        with open(os.environ[READS], "a") as f:
            f.write(f"{os.environ[TEST_ID]}\t{name}\t{seconds}\n")


# --- the measurement ----------------------------------------------------------------------------

# The packages whose lines a test runs: mm-grpo's own, and those whose version differs between the
# environments, torch aside (every test runs torch): Megatron (wheel 0.16 / core_v0.12.1's tree),
# transformers (5.x / 4.57), diffusers (0.42 / 0.39), and the testbed's MindSpeed and MindSpeed-MM.
PACKAGES = ("mm_grpo", "megatron.core", "transformers", "diffusers")


def measured_folders():
    """The folders of the packages above and of the testbed's MindSpeed-MM and MindSpeed."""
    from tests.testbed import TESTBED_PATHS
    folders = []
    for name in PACKAGES:
        top = os.path.dirname(importlib.util.find_spec(name).origin)
        folders.append(os.path.dirname(top) if name == "megatron.core" else top)
    return folders + list(TESTBED_PATHS)


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


def measured_lines(data_file):
    """({node id: lines}, {check name: lines}) of the function-body lines each test and each torchrun
    check ran, a line as (file, number). A check's lines count for the check alone."""
    import coverage
    data = coverage.CoverageData(data_file)
    data.read()
    tests, checks = {}, {}
    for path in data.measured_files():
        body = function_body_lines(path)
        for line, contexts in data.contexts_by_lineno(path).items():
            if line not in body:
                continue
            for c in contexts:  # "static|dynamic": pytest's "|node id", a process it started "node id[|check:name]"
                parts = c.split("|")
                if parts[-1].startswith(CHECK):
                    checks.setdefault(parts[-1][len(CHECK):], set()).add((path, line))
                elif test := next((p for p in parts if p), None):
                    tests.setdefault(test, set()).add((path, line))
    return tests, checks


def greedy_cover(candidates, lines, cost, covered):
    """The candidates that together run every line they run beyond `covered`: repeatedly the one with
    the most new lines per second. Lines are bits of Python ints, so each step is a few big-int ops."""
    index = {}
    def bits(ls):
        n = 0
        for line in ls:
            n |= 1 << index.setdefault(line, len(index))
        return n
    covered = bits(covered)
    new = {t: bits(lines.get(t, ())) & ~covered for t in candidates}
    kept = []
    while new:
        best = max(new, key=lambda t: (new[t].bit_count() / cost.get(t, 1.0), t))
        if not new[best]:
            break
        kept.append(best)
        covered |= new.pop(best)
        new = {t: n & ~covered for t, n in new.items()}
    return kept


def collected(pytest_args, *select):
    """Node ids that pytest collects with these arguments (`-m mindspeed_mm`: the contract tests)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *select, *pytest_args], cwd=REPO, capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def measure(data_dir, pytest_args):
    """Runs the suite under coverage, unless data_dir holds a measurement; -> (data file, {node id:
    seconds}, {node id: {check: seconds}} of the torchrun checks each test read, the failed tests)."""
    data_file, ran_file, reads_file = (os.path.join(data_dir, name) for name in ("coverage", "ran", "reads"))
    if not (os.path.exists(data_file) and os.path.exists(ran_file)):
        rc = os.path.join(data_dir, "coveragerc")
        with open(rc, "w") as f:
            f.write("[run]\nparallel = true\npatch = subprocess\n"
                    f"data_file = {data_file}\ncontext = ${{{TEST_ID}}}\n"
                    "source =\n" + "".join(f"    {p}\n" for p in measured_folders()))
        env = dict(os.environ, **{TEST_ID: "", RAN: ran_file, READS: reads_file, "MM_GRPO_TEST_ALL": "1"})
        run = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest",
                              "-p", "tests.env_split", "-p", "no:cacheprovider", "-q", *pytest_args],
                             cwd=REPO, env=env)
        if run.returncode not in (0, 1):
            sys.exit(f"the measured pytest run ended with exit code {run.returncode}")
        subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=REPO, check=True)
    seconds, failed = {}, set()
    with open(ran_file) as f:
        for line in f:
            node, took, *outcome = line.rstrip("\n").split("\t")
            seconds[node] = float(took)
            if outcome:
                failed.add(node)
    reads = {}
    if os.path.exists(reads_file):
        with open(reads_file) as f:
            for line in f:
                node, name, took = line.rstrip("\n").split("\t")
                reads.setdefault(node, {})[name] = float(took)
    return data_file, seconds, reads, failed


def write_list(split, seconds):
    tmp = DEFAULT_ONLY + ".tmp"
    with open(tmp, "w") as f:
        f.write("# The tests and torchrun checks (check:NAME) that run in the default environment only: every line\n"
                "# they run in MindSpeed-MM's environment, what runs there runs too. Written by\n"
                "# `python -m tests.env_split --write` in MindSpeed-MM's environment (docs/running.md#tests):\n"
                f"# {len(split.listed)} tests ({sum(seconds[t] for t in split.listed):.0f} s under coverage), "
                f"{len(split.skipped_checks)} checks.\n")
        f.writelines(t + "\n" for t in sorted(split.listed))
        f.writelines(CHECK + c + "\n" for c in sorted(split.skipped_checks))
    os.replace(tmp, DEFAULT_ONLY)


def main(args):
    from tests.testbed import has_megatron_training
    if not has_megatron_training():
        sys.exit("tests.env_split measures MindSpeed-MM's environment: run it with .venv-mindspeed-mm's python "
                 "and Megatron-LM's tree on PYTHONPATH (shell/run_tests.sh)")
    try:
        import coverage
    except ImportError:
        sys.exit("tests.env_split needs coverage >= 7.10 (pip install coverage)")
    if tuple(int(x) for x in coverage.__version__.split(".")[:2]) < (7, 10):
        sys.exit(f"tests.env_split needs coverage >= 7.10 for subprocess measurement, found {coverage.__version__}")
    write = "--write" in args
    args = [a for a in args if a != "--write"]
    data_dir = None
    if args[:1] == ["--data"]:
        data_dir, args = os.path.abspath(args[1]), args[2:]
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = data_dir or scratch
        os.makedirs(data_dir, exist_ok=True)
        data_file, seconds, reads, failed = measure(data_dir, args)
        tests, checks = measured_lines(data_file)
    if failed:  # kept in both: a process that failed may have written no coverage (e.g. a file size limit)
        print(f"failed under coverage, kept in both: {', '.join(sorted(failed))}")
    split = Split(seconds, tests, checks, reads, collected(args, "-m", "mindspeed_mm") | failed,
                  listed=None if write else default_env_only())
    if write:
        write_list(split, seconds)
    kept = sum(t for n, t in seconds.items() if n not in split.listed)
    print(f"\n{len(seconds)} tests ran under coverage ({sum(seconds.values()):.0f} s), {len(checks)} torchrun "
          f"checks; {len(split.everything)} lines. MindSpeed-MM's environment runs {len(seconds) - len(split.listed)} "
          f"tests ({kept:.0f} s): {len(split.fixed)} always, {len(split.kept)} for their lines; "
          f"{len(split.listed)} tests ({sum(seconds[t] for t in split.listed):.0f} s) and {len(split.skipped_checks)} "
          f"checks default-only{', written to tests/default_env_only.txt' if write else ''}.")
    if split.orphans:
        sys.exit("listed checks that a test kept in MindSpeed-MM's environment reads (list the tests too, or "
                 "run --write): " + ", ".join(sorted(split.orphans)))
    if split.missed:
        sys.exit(f"{len(split.missed)} lines run only by tests left out of MindSpeed-MM's environment "
                 f"(e.g. {sorted(split.missed)[:3]}): {', '.join(split.holders())}")


class Split:
    """Which measured tests and torchrun checks MindSpeed-MM's environment runs.

    A test counts with the checks it reads (`reads`, {node id: {check: seconds}}): its lines and
    cost are its own and theirs, and a check is left out when every test reading it is. `always`: the
    tests kept whatever they ran (with ALWAYS_BOTH's modules). `listed`:
    the default-only list to check; None: choose one by greedy_cover. `missed`: the lines only what
    it leaves out runs; `orphans`: left-out checks a kept test reads."""

    def __init__(self, seconds, tests, checks, reads, always, listed=None):
        self.tests, self.checks = tests, checks
        self.fixed = {t for t in seconds if t in always or t.split("::")[0] in ALWAYS_BOTH}
        lines = {t: tests.get(t, set()).union(*(checks.get(c, set()) for c in reads.get(t, {}))) for t in seconds}
        cost = {t: took + sum(reads.get(t, {}).values()) for t, took in seconds.items()}
        candidates = sorted(set(seconds) - self.fixed)
        if listed is None:
            read = set().union(*reads.values())  # the checks no test reads always run
            covered = set().union(*(lines[t] for t in self.fixed), *(checks[c] for c in checks if c not in read))
            self.kept = set(greedy_cover(candidates, lines, cost, covered))
            self.listed = [t for t in candidates if t not in self.kept]
            self.skipped_checks = read - {c for t in seconds if t not in self.listed for c in reads.get(t, {})}
        else:
            self.listed = [t for t in candidates if t in listed]
            self.kept = set(candidates) - set(self.listed)
            self.skipped_checks = {e[len(CHECK):] for e in listed if e.startswith(CHECK)}
        runs = [t for t in seconds if t not in self.listed]
        self.orphans = {c for t in runs for c in reads.get(t, {}) if c in self.skipped_checks}
        covered = set().union(*(tests.get(t, set()) for t in runs),
                              *(ran for c, ran in checks.items() if c not in self.skipped_checks))
        self.everything = set().union(*tests.values(), *checks.values())
        self.missed = self.everything - covered

    def holders(self):
        """The listed tests and the left-out checks that ran a missed line."""
        return sorted({t for t in self.listed if self.tests.get(t, set()) & self.missed} |
                      {CHECK + c for c in self.skipped_checks if self.checks.get(c, set()) & self.missed})


if __name__ == "__main__":
    main(sys.argv[1:])
