"""Command-line flags generated from msgspec config structs: one flag per field, same name with
dashes, typed and (for Literal fields) with choices, so no CLI re-declares a config field."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import textwrap
from typing import Any

import msgspec

from engine.config import warn_renamed


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's help, from the source of `cls`: the comment at the end of the field's line, else
    the comment lines right above it (the config structs document their fields that way)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    rows = source.splitlines()
    docs: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        last = rows[node.end_lineno - 1]
        trailing = _comment(last, node.end_col_offset)
        if trailing:
            docs[node.target.id] = trailing
            continue
        above, i = [], node.lineno - 2
        while i >= 0 and rows[i].lstrip().startswith("#"):
            above.insert(0, rows[i].lstrip()[1:].strip())
            i -= 1
        if above:
            docs[node.target.id] = " ".join(above)
    return docs


def _comment(line: str, code_end: int) -> str:
    rest = line[code_end:].strip()
    return rest[1:].strip() if rest.startswith("#") else ""


def _scalar(t: msgspec.inspect.Type) -> msgspec.inspect.Type | None:
    """The one non-None member of an optional type; None for types a flag cannot carry."""
    if isinstance(t, msgspec.inspect.UnionType):
        members = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
        return _scalar(members[0]) if len(members) == 1 else None
    kinds = (msgspec.inspect.BoolType, msgspec.inspect.IntType, msgspec.inspect.FloatType,
             msgspec.inspect.StrType, msgspec.inspect.LiteralType, msgspec.inspect.DictType)
    return t if isinstance(t, kinds) else None


class _OldFlag(argparse.Action):
    """A renamed field's old flag: parsed like the new one, into the same field, with a warning."""

    def __init__(self, option_strings: list[str], dest: str, new_flag: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warn_renamed(option_string or self.option_strings[0], self.new_flag)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def parse_mapping(text: str) -> dict[str, Any]:
    """A mapping flag's value: a JSON object, or `name=value` pairs separated by commas or spaces
    (SGLang's `--lora-paths name=path` form; a value that reads as a number is one, any other is
    text: a folder named `true` stays a folder)."""
    text = text.strip()
    if text.startswith("{"):
        return msgspec.json.decode(text)
    out: dict[str, Any] = {}
    for item in text.replace(",", " ").split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected a JSON object or name=value pairs, got {item!r}")
        try:
            number = msgspec.json.decode(value)
        except msgspec.DecodeError:
            number = None
        out[name] = number if isinstance(number, (int, float)) and not isinstance(number, bool) else value
    return out


def add_struct_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = (),
                     renames: dict[str, str] | None = None, help: dict[str, str] | None = None) -> list[str]:
    """Add --field-name for each field of `cls` a flag can carry; defaults are None (unset), so
    only the flags given override the struct's own defaults. A renamed field (`cls.renamed_fields`)
    also takes its old flag, with a DeprecationWarning. Returns the fields added."""
    renames, HELP = renames or {}, help or {}
    old_names = {new: old for old, new in getattr(cls, "renamed_fields", {}).items() if old not in skip}
    added = []
    for f in msgspec.inspect.type_info(cls).fields:
        t = _scalar(f.type)
        if f.name in skip or t is None:
            continue
        if isinstance(t, msgspec.inspect.BoolType) and f.default is True:
            raise TypeError(f"{cls.__name__}.{f.name} defaults to True: a store_true flag cannot turn it off")
        flag = "--" + renames.get(f.name, f.name).replace("_", "-")
        default = f.default if f.default is not msgspec.NODEFAULT else None
        doc = HELP.get(f.name) or field_docs(cls).get(f.name, "")
        help_text = f"{doc} (default: {default})" if doc else f"default: {default}"
        if isinstance(t, msgspec.inspect.BoolType):
            parse: dict[str, Any] = {"nargs": 0, "const": True}
        elif isinstance(t, msgspec.inspect.LiteralType):
            parse = {"choices": list(t.values)}
        elif isinstance(t, msgspec.inspect.DictType):  # '{"load_weight": 0.2}' or load_weight=0.2
            parse = {"type": parse_mapping}
            help_text = HELP.get(f.name) or field_docs(cls).get(f.name, "a JSON object")
        else:
            parse = {"type": {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(t), str)}
        if "nargs" in parse:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text, **parse)
        if f.name in old_names:
            old_flag = "--" + old_names[f.name].replace("_", "-")
            parser.add_argument(old_flag, dest=f.name, action=_OldFlag, new_flag=flag, default=None,
                                help=f"deprecated: {flag}", **parse)
        added.append(f.name)
    return added


def given(args: argparse.Namespace, fields: list[str]) -> dict[str, Any]:
    """The fields whose flags were given."""
    return {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
