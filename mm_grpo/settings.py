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

JSON config blocks (model.json, data.json, config.json) are typed the same way, by a dataclass per
block whose field types (pydantic's constraints in `Annotated`: `Field(ge=1)`, `Literal[...]` for
names) say what each key may hold: `read_block(cls, block, where)` expands its $VARIABLES
(`expand_variables`), then checks every value strictly as JSON (a whole number is 16, not "16" nor
true; a boolean is true or false) and refuses the first wrong one in one line,
`<where>: <key> must be <what>, got <value>`.
"""
import argparse
import dataclasses
import difflib
import functools
import json
import operator
import os
import re
import reprlib
import typing

import pydantic

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


def _nearest(value: str, known):
    """The known name closest to a misspelt `value`, or None."""
    found = difflib.get_close_matches(value, list(known), n=1)
    return found[0] if found else None


def check_keys(block, known, where: str) -> None:
    """One line for the first key of the JSON object `block` not in `known`, with the nearest known
    one: a misspelt key would otherwise be ignored and its default used without a word. `where`
    names the block (and its file), e.g. "model.json text_encoder"."""
    if not isinstance(block, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
    for key in block:
        if key not in known:
            nearest = _nearest(key, known)
            hint = f'did you mean "{nearest}"?' if nearest else f"known: {', '.join(known)}"
            raise ValueError(f'{where}: unknown key "{key}" ({hint})')


def from_args(cls, args: argparse.Namespace, **overrides):
    """`cls` from the parsed flags of the same names; `overrides` win (fields without a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    several = {f.name for f in dataclasses.fields(cls) if f.name in values and _value_type(f.type)[1]}
    values.update({name: tuple(values[name]) for name in several})  # argparse gives a list
    built = cls(**{**values, **overrides})
    check_bounds(built, cls)
    return built


# --- typed JSON config blocks ------------------------------------------------------------------------
Count = typing.Annotated[int, pydantic.Field(ge=1)]  # a size or a number of things
NonNegative = typing.Annotated[int, pydantic.Field(ge=0)]
Finite = typing.Annotated[float, pydantic.Field(allow_inf_nan=False, description="a finite number")]
COMMENT = "comment"  # a note for the reader, at any level: never expanded, never read
# $NAME or ${NAME}, as os.path.expandvars reads them
VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


class Expanded(str):
    """A config string that held $VARIABLES, expanded; `written`: the text as the file has it. Where
    it was one whole variable ("$EVAL_SAMPLES") and a block wants a number or a boolean there, its
    text is read as JSON: the environment gives every value as text, while a number written in the
    file is written as one ("16" there is refused)."""

    def __new__(cls, text, written=""):
        made = super().__new__(cls, text)
        made.written = written
        return made

    @property
    def whole_variable(self) -> bool:
        return VARIABLE.fullmatch(self.written) is not None


def _expand(text: str, where: str, key) -> str:
    if isinstance(text, Expanded) or "$" not in text:
        return text
    expanded = os.path.expandvars(text)
    missing = VARIABLE.search(expanded)  # expandvars leaves an unset variable as written
    if missing:
        raise ValueError(f"{where}: {key} uses {missing.group(0)}, which is not set in the environment")
    return Expanded(expanded, text)


def _entry(key, index: int, value) -> str:
    """A list entry's name in errors: 'reward "hps"' (an entry with a name), else 'reward[0]'."""
    name = f' "{value["name"]}"' if isinstance(value, dict) and "name" in value else f"[{index}]"
    return f"{key or ''}{name}".strip()


def expand_variables(value, where: str, key=None):
    """`value` (a JSON value, `key`'s in the block `where` names) with its $VARIABLES expanded from the
    environment (into `Expanded` strings), "comment"s left as written; a variable that is not set is
    one line naming the block, the key and the variable."""
    if isinstance(value, dict):
        inner = where if key is None else f"{where} {key}"
        return {k: v if k == COMMENT else expand_variables(v, inner, k) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_variables(v, where, _entry(key, i, v) if isinstance(v, dict) else key)
                for i, v in enumerate(value)]
    return _expand(value, where, key) if isinstance(value, str) else value


@functools.lru_cache(maxsize=None)
def _schema(cls):
    """(pydantic's validator of the dataclass `cls`, the JSON schema of each of its fields)."""
    adapter = pydantic.TypeAdapter(cls)
    return adapter, adapter.json_schema()["properties"]


def _alternatives(schema: dict) -> list:
    return [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]


JSON_KINDS = {"integer": "a whole number", "number": "a number", "boolean": "true or false", "string": "a string",
              "array": "a list", "object": "a JSON object"}
JSON_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _describe(schema: dict) -> str:
    """What a field's JSON schema allows, in words: "a whole number >= 1", "one of "a", "b""."""
    if "description" in schema:
        return schema["description"]
    choices = _alternatives(schema)
    if len(choices) > 1 or "description" in choices[0]:
        return " or ".join(_describe(s) for s in choices)
    only = choices[0]
    if "enum" in only or "const" in only:
        names = [json.dumps(v) for v in only.get("enum", [only.get("const")])]
        return names[0] if len(names) == 1 else "one of " + ", ".join(names)
    bounds = [f"{relation} {only[k]}" for k, relation in JSON_BOUNDS.items() if k in only]
    return " ".join([JSON_KINDS.get(only.get("type"), "a JSON object"), " and ".join(bounds)]).strip()


def _from_variable(value, schema: dict):
    """A whole-variable text read as JSON where the field wants a number or a boolean (`Expanded`)."""
    wanted = {s.get("type") for s in _alternatives(schema)}
    if not (isinstance(value, Expanded) and value.whole_variable and wanted & {"integer", "number", "boolean"}):
        return value
    try:
        read = json.loads(value)
    except ValueError:
        return value
    return read if isinstance(read, (int, float)) else value  # bool is an int


SHOWN = reprlib.Repr()  # a value quoted in an error, shortened
SHOWN.maxstring = SHOWN.maxother = 60


def _one_line(error: dict, values: dict, properties: dict, where: str) -> str:
    if not error["loc"]:  # the dataclass's own check of its values together (its __post_init__)
        cause = (error.get("ctx") or {}).get("error")
        return f"{where}: {cause if cause is not None else error['msg']}"
    key = error["loc"][0]
    schema = properties[key]
    if key not in values:
        return f"{where}: needs {key} ({_describe(schema)})"
    value = values[key]
    shown = SHOWN.repr(str(value) if isinstance(value, Expanded) else value)
    line = f"{where}: {key} must be {_describe(schema)}, got {shown}"
    if isinstance(value, Expanded):
        line += f" (from {value.written})"
    names = [v for s in _alternatives(schema) for v in s.get("enum", [s["const"]] if "const" in s else [])]
    nearest = _nearest(value, names) if names and isinstance(value, str) else None
    return line + (f' (did you mean "{nearest}"?)' if nearest else "")


def read_block(cls, block, where: str, known=None):
    """`cls`, a dataclass whose fields are the keys of a JSON config block, from `block`: a key not in
    `known` (default: the fields; a key known but no field is another reader's) refused naming the
    nearest one (`check_keys`), $VARIABLES expanded, and every field's value checked against its type
    strictly as JSON, the first wrong one in one line naming `where`, the key, what it may hold and the
    value. A value that is not JSON (a Python object handed over in code) is checked as its text."""
    fields = [f.name for f in dataclasses.fields(cls)]
    check_keys(block, fields if known is None else known, where)
    adapter, properties = _schema(cls)
    values = expand_variables({k: v for k, v in block.items() if k in fields}, where)
    typed = {k: _from_variable(v, properties[k]) for k, v in values.items()}
    try:
        return adapter.validate_json(json.dumps(typed, default=str), strict=True)
    except pydantic.ValidationError as e:
        raise ValueError(_one_line(e.errors()[0], values, properties, where)) from None
