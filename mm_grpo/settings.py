"""Settings declared once: a dataclass field made with `setting(...)` is also a command-line flag.

    @dataclasses.dataclass(frozen=True)
    class S:
        num_steps: int = setting(16, "denoising steps")         # --num-steps, type int, default 16

`add_setting_args(group, S)` adds the flags of every `setting` field (name, type, default,
help and choices come from the field); `from_args(S, args)` builds the dataclass from the
parsed namespace, field by name. Fields made without `setting` have no flag of their own (they
come from another group of flags, or from the caller).
"""
import argparse
import dataclasses
import typing


def setting(default, help: str, *, choices=None, flag: str = None):
    """A dataclass field with its command-line flag (`flag` defaults to --field-name)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


def _value_type(annotation):
    """int / float / str of a field annotation (Optional[float] -> float)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_setting_args(group: argparse._ArgumentGroup, cls):
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        kind = _value_type(f.type)
        if kind is bool:
            if f.default:
                raise TypeError(f"{cls.__name__}.{f.name}: a store_true flag needs default False")
            group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f.metadata["help"],
                               choices=f.metadata["choices"])
    return group


def from_args(cls, args: argparse.Namespace, **overrides):
    """`cls` from the parsed flags of the same names; `overrides` win (fields without a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})
