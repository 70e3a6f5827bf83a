"""Settings declared once: a dataclass field made with `setting(...)` is also a command-line flag.

    @dataclasses.dataclass(frozen=True)
    class S:
        num_steps: int = setting(16, "denoising steps")         # --num-steps, type int, default 16

`add_setting_args(group, S)` adds the flags of every `setting` field (name, type, default,
help and choices come from the field; a bool is a store_true flag, or --flag / --no-flag when it
defaults to True; a tuple takes one or more values, or one value split at `sep`).
`check_minimums(args, S)` refuses a value below a field's `minimum` in one line; `from_args(S,
args)` builds the dataclass from the parsed namespace, field by name, and checks it the same way.
Fields made without `setting` have no flag of their own (they come from another group of flags,
or from the caller).
"""
import argparse
import dataclasses
import typing


def setting(default, help: str, *, choices=None, flag: str = None, required: bool = False, minimum=None,
            sep: str = None):
    """A dataclass field with its command-line flag (`flag` defaults to --field-name). `required`:
    the command line must give it; `minimum`: the smallest value `check_minimums` accepts (None,
    where the default is None, always passes); `sep`: a tuple field's flag takes one value split
    at `sep` (for items that hold spaces: "left of,above")."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag,
                                                        "required": required, "minimum": minimum, "sep": sep})


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


def check_minimums(args, *classes) -> None:
    """One line for the first flag of `classes` below its field's `minimum` (a count that would
    otherwise divide by zero or loop for ever deep inside a run); `args`: the parsed namespace, or
    an instance of the class."""
    for cls in classes:
        for f in dataclasses.fields(cls):
            minimum, value = f.metadata.get("minimum"), getattr(args, f.name, None)
            if minimum is not None and value is not None and value < minimum:
                raise ValueError(f"{_flag(f)} must be >= {minimum}, got {value}")


def from_args(cls, args: argparse.Namespace, **overrides):
    """`cls` from the parsed flags of the same names; `overrides` win (fields without a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    several = {f.name for f in dataclasses.fields(cls) if f.name in values and _value_type(f.type)[1]}
    values.update({name: tuple(values[name]) for name in several})  # argparse gives a list
    built = cls(**{**values, **overrides})
    check_minimums(built, cls)
    return built
