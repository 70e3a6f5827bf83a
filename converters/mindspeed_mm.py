"""MindSpeed-MM's converter framework (its `checkpoint` package), when it is importable.

MindSpeed-MM's `mm-convert` (`checkpoint.convert_cli:main`) runs
`jsonargparse.auto_cli(Commandable.subclasses, as_positional=False)`, and `Commandable`
appends every non-abstract subclass to that list as the class is defined. FluxConverter
subclasses `Converter` when it exists, so importing `converters` registers it: MindSpeed-MM's
CLI lists it in any process that has imported mm-grpo's converters.
"""
import sys

# What a missing MindSpeed-MM looks like; any other import error inside it is reported.
_ABSENT = {"checkpoint", "checkpoint.common", "checkpoint.common.converter"}


def _import():
    try:
        from checkpoint.common import converter
    except ModuleNotFoundError as e:
        if e.name in _ABSENT:
            return None, None
        return None, f"{type(e).__name__}: {e}"
    except Exception as e:  # a broken install must not take FluxConverter down with it
        return None, f"{type(e).__name__}: {e}"
    return converter, None


_converter_module, PROBLEM = _import()  # PROBLEM: why an installed MindSpeed-MM did not import
AVAILABLE = _converter_module is not None
Converter = _converter_module.Converter if AVAILABLE else object  # FluxConverter's base class


def run_cli(args=None):
    """MindSpeed-MM's own `mm-convert` entry, on `args` (default: the command line)."""
    from checkpoint import convert_cli
    if args is None:
        return convert_cli.main()
    saved, sys.argv = sys.argv, [sys.argv[0], *args]  # its main() reads sys.argv only
    try:
        return convert_cli.main()
    finally:
        sys.argv = saved
