"""The configuration reference (docs/configuration.md), generated from the schema in phase1a/config/schema.py.

The schema is the one place a config key is defined: its type, default, constraints and description. A
hand-written table beside it drifts the day a field is added or a default changes, so the reference is built
from `Phase1aConfig.model_fields` instead, and tests/project/test_docs.py fails when the committed page differs from
what `render()` gives. After editing the schema:

    python -m phase1a.config.reference --write     # or: make docs
    python -m phase1a.config.reference             # print it
"""
from __future__ import annotations

import argparse
import re
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from phase1a.config.schema import MOVED_KEYS, Phase1aConfig
from phase1a.core.atomic import write_atomically
from phase1a.data.records import RECORD_FORMATS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

PREAMBLE = """\
# Configuration reference

Every key of a job's YAML config with its type, default and meaning, from \
[`phase1a/config/schema.py`](../phase1a/config/schema.py).

One schema (`Phase1aConfig`, pydantic) serves the CLI, the flow and the deployments. A key it does not know is
an error, not a silently ignored setting, and every error names its field:
`method.batch_size: Input should be greater than or equal to 1`. Only `data.source` is required.

- Relative paths in a config file are relative to the file; `~` is expanded.
- Time spans are written `90s`, `30m`, `2h`; `checkpoint.interval` also counts steps, tokens and epochs
  (`500steps`, `2000000tok`, `0.5ep`) and takes several at once (`30m,500steps`: whichever comes first).
- `null` (None) means unset; the description says what unset does.

How a config reaches a run (`--set key=value`, a deployment's `config_file` and `overrides`) is in
[Running your own job](running-jobs.md).

This page is generated: edit the descriptions in `phase1a/config/schema.py`, then run
`python -m phase1a.config.reference --write` (or `make docs`).
"""

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}
# annotated-types / pydantic constraint attributes, in the order they are written
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
           ("max_length", "length <="))


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: `Section`, `Section | None` (an optional section, off while null), or each item
    of a `list[Section]`."""
    if _is_section(annotation):
        return annotation
    if get_origin(annotation) is list and _is_section(get_args(annotation)[0]):
        return get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(members) == 1 and _is_section(members[0]):
            return members[0]
    return None


def _value(value: Any) -> str:
    """A default as it would be written in YAML (flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return str(value) or '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_value(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _type(annotation: Any, key: str) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:  # a checked scalar (config.Duration): described as what it holds
        return _type(get_args(annotation)[0], key)
    if origin is Literal:
        return "one of " + ", ".join(f"`{_value(choice)}`" for choice in get_args(annotation))
    if origin in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        text = " or ".join(_type(arg, key) for arg in members)
        return text + " or `null`" if len(members) < len(get_args(annotation)) else text
    if origin is list:
        return "list of " + _type(get_args(annotation)[0], key)
    if origin is dict:
        keys, values = get_args(annotation)
        return f"mapping of {_type(keys, key)} to {_type(values, key)}"
    if _is_section(annotation):
        return f"section: [`{key}`](#{_anchor(key)})"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"{key}: no way to describe the type {annotation!r}; add it to phase1a/config/reference.py")


def _constraints(field: FieldInfo) -> list[str]:
    found = []
    for item in field.metadata:
        for name, sign in _BOUNDS:
            if getattr(item, name, None) is not None:
                found.append(f"`{sign} {_value(getattr(item, name))}`")
        if getattr(item, "pattern", None) is not None:
            found.append(f"matches `{item.pattern}`")
    return found


def _cell(text: str) -> str:
    """Markdown for a table cell: `|` escaped everywhere; outside code spans also `*` and a `<` that would
    start an HTML tag (`*.bin`, `<name>`), which would otherwise turn into emphasis or vanish."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):
        parts[index] = re.sub(r"(\*|<(?=[A-Za-z/!?]))", r"\\\1", parts[index])
    return "`".join(parts).replace("|", "\\|")


def _row(key: str, field: FieldInfo) -> str:
    kind = _type(field.annotation, key)
    bounds = _constraints(field)
    if bounds:
        kind += ", " + " and ".join(bounds)
    if field.is_required():
        default = "required"
    elif _is_section(field.annotation):
        default = "its keys' defaults"
    else:
        default = f"`{_value(field.get_default(call_default_factory=True))}`"
    return f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(field.description or '')} |"


def _table(prefix: str, fields: dict[str, FieldInfo]) -> list[str]:
    return ["| key | type | default | description |", "|---|---|---|---|",
            *(_row(prefix + name, field) for name, field in fields.items())]


def _sections(key: str, field: FieldInfo) -> list[str]:
    """A section's heading, its description, its table, then its nested sections, each the same way."""
    model = _section_model(field.annotation)
    lines = ["", f"## `{key}`", "", _cell(field.description or ""), "", *_table(key + ".", model.model_fields)]
    for name, child in model.model_fields.items():
        if _section_model(child.annotation):
            lines += _sections(f"{key}.{name}", child)
    return lines


def _record_formats() -> list[str]:
    """`data.format`'s choices, from the registry the reader uses (phase1a/data/records.py)."""
    rows = [f"| `{shape.name}` | {', '.join(f'`{field}`' for field in shape.fields)} | {_cell(shape.description)} |"
            for shape in RECORD_FORMATS.values()]
    return ["", "## Record formats", "",
            "`data.format`'s choices besides `auto`, from `RECORD_FORMATS` (`phase1a/data/records.py`). `auto` takes, "
            "per record, the first format one of whose fields the record has, in this order.", "",
            "| format | identified by | what it holds |", "|---|---|---|", *rows]


def _moved_keys() -> list[str]:
    """The keys that moved to their stage's section, from the table the loader moves them by (MOVED_KEYS)."""
    rows = [f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items()]
    return ["", "## Keys that moved", "",
            "These keys moved to the section of the stage that reads them; "
            "the old key still loads, for one release, moved to its new place with one warning line naming it (a "
            "`--set` of the old key too). Giving both is an error. `validation.promote_merged: true`, from before "
            "exports, still adds `merged` to `promotion.export`.", "",
            "| old key | new key |", "|---|---|", *rows]


def render() -> str:
    """docs/configuration.md: the preamble, the top-level keys, one table per section in schema order, the keys
    that moved, then the record formats."""
    fields = Phase1aConfig.model_fields
    top = {name: field for name, field in fields.items() if not _is_section(field.annotation)}
    lines = [PREAMBLE.rstrip("\n"), "", "## Top level", "",
             "The keys outside any section, and the sections themselves.", "",
             *_table("", {**top, **{n: f for n, f in fields.items() if n not in top}})]
    for name, field in fields.items():
        if _is_section(field.annotation):
            lines += _sections(name, field)
    return "\n".join(lines + _moved_keys() + _record_formats()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phase1a.config.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(PAGE.parents[1])}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(PAGE, text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
