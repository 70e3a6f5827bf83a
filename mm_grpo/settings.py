"""Settings declared once: a dataclass field made with `setting(...)` is also a command-line flag.

    @dataclasses.dataclass(frozen=True)
    class S:
        num_steps: int = setting(16, "denoising steps")         # --num-steps, type int, default 16

`add_setting_args(group, S)` adds the flags of every `setting` field (name, type, default,
help and choices come from the field; a bool is a store_true flag, or --flag / --no-flag when it
defaults to True; a tuple takes one or more values, or one value split at `sep`).
`check_bounds(args, S)` refuses a value outside a field's bounds (`minimum`, `above`, `below`) in one
line; `from_args(S, args)` builds the dataclass from the parsed namespace, field by name, and checks
it the same way. Fields made without `setting` have no flag of their own (they come from another
group of flags, or from the caller).

`accept_negative_numbers(parser)` lets a value such as -1e-4 reach its flag (then its bounds refuse
it in one line, rather than argparse reading it as an unknown option). `check_keys(block, known,
where)` refuses a key of a JSON config block that nothing reads, naming the nearest known one.
"""
import argparse
import dataclasses
import difflib
import operator
import re
import typing

# argparse takes an argument for a value only where it looks like a negative number, and its pattern
# (^-\d+$|^-\d*\.\d+$) has no exponent: "--lr -1e-4" would read -1e-4 as an option. This one has.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def setting(default, help: str, *, choices=None, flag: str = None, required: bool = False, minimum=None,
            above=None, below=None, sep: str = None):
    """A dataclass field with its command-line flag (`flag` defaults to --field-name). `required`:
    the command line must give it; `minimum`: the smallest value `check_bounds` accepts, `above` /
    `below`: bounds the value must be strictly greater / less than (a rate that must be positive:
    above=0; a decay: below=1); None, where the default is None, always passes; `sep`: a tuple
    field's flag takes one value split at `sep` (for items that hold spaces: "left of,above")."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag,
                                                        "required": required, "minimum": minimum, "above": above,
                                                        "below": below, "sep": sep})


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _value_type(annotation):
    """(int / float / str, takes several values) of a field annotation: Optional[float] -> (float,
    False), Tuple[str, ...] -> (str, True)."""
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return (args[0] if args else annotation), False


def add_setting_args(group: argparse._ArgumentGroup, cls):
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        kind, several = _value_type(f.type)
        if kind is bool:  # on by default: --flag / --no-flag
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(_flag(f), dest=f.name, action=action, default=f.default, help=f.metadata["help"])
        else:
            extra = {"required": True} if f.metadata.get("required") else {"default": f.default}
            if several and f.metadata.get("sep"):  # the dataclass checks the items
                extra["type"] = _splitter(kind, f.metadata["sep"])
            else:
                extra.update(type=kind, nargs="+" if several else None, choices=f.metadata["choices"])
            group.add_argument(_flag(f), dest=f.name, help=f.metadata["help"], **extra)
    return group


def _splitter(kind, sep):
    def split(text):
        return tuple(kind(x.strip()) for x in text.split(sep) if x.strip())
    split.__name__ = f"{sep!r}-separated list"  # argparse's "invalid ... value" names it
    return split


# metadata key -> (its relation in the error line, the test a value must pass)
BOUNDS = {"minimum": (">=", operator.ge), "above": (">", operator.gt), "below": ("<", operator.lt)}


def _bound_broken(f: dataclasses.Field, value):
    """(relation, bound) of the first bound of `f` that `value` fails (NaN fails every bound), else None."""
    for key, (relation, holds) in BOUNDS.items():
        bound = f.metadata.get(key)
        if bound is not None and not holds(value, bound):
            return relation, bound
    return None


def check_bounds(args, *classes) -> None:
    """One line for the first flag of `classes` outside its field's bounds (a count that would
    otherwise divide by zero or loop for ever deep inside a run, a negative rate); `args`: the
    parsed namespace, or an instance of the class."""
    for cls in classes:
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            broken = None if value is None else _bound_broken(f, value)
            if broken:
                raise ValueError(f"{_flag(f)} must be {broken[0]} {broken[1]}, got {value}")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` (mm-grpo's, or Megatron's handed to an extra-arguments provider) reading "-1e-4" as
    a value like "-0.0001" (NEGATIVE_NUMBER)."""
    parser._negative_number_matcher = NEGATIVE_NUMBER
    return parser


def check_keys(block, known, where: str) -> None:
    """One line for the first key of the JSON object `block` not in `known`, with the nearest known
    one: a misspelt key would otherwise be ignored and its default used without a word. `where`
    names the block (and its file), e.g. "model.json text_encoder"."""
    if not isinstance(block, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
    for key in block:
        if key not in known:
            nearest = difflib.get_close_matches(key, known, n=1)
            hint = f'did you mean "{nearest[0]}"?' if nearest else f"known: {', '.join(known)}"
            raise ValueError(f'{where}: unknown key "{key}" ({hint})')


def from_args(cls, args: argparse.Namespace, **overrides):
    """`cls` from the parsed flags of the same names; `overrides` win (fields without a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    several = {f.name for f in dataclasses.fields(cls) if f.name in values and _value_type(f.type)[1]}
    values.update({name: tuple(values[name]) for name in several})  # argparse gives a list
    built = cls(**{**values, **overrides})
    check_bounds(built, cls)
    return built
