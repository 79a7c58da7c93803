"""Python function -> tool parameters: the pydantic model and JSON schema of a typed, documented
function's parameters, every one bounded (see `cedar.frontend.schema`); the description and the
parameter docs from its Google-style docstring."""

from __future__ import annotations

import inspect
import re
import typing
from typing import Annotated, Callable

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, create_model

from .schema import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STR, DEFAULT_NUMBER_RANGE


def function_schema(fn: Callable) -> tuple[str, type[BaseModel], dict]:
    """(description, arguments model, parameters JSON schema) of `fn`."""
    description, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn, include_extras=True)
    fields = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"{fn.__name__}: *args / **kwargs cannot be tool parameters")
        if pname not in hints:
            raise ValueError(f"{fn.__name__}: parameter {pname!r} needs a type annotation")
        default = ... if param.default is param.empty else param.default
        fields[pname] = (bounded(hints[pname]), Field(default, description=arg_docs.get(pname)))
    model = create_model(f"{fn.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
    return description or fn.__name__, model, _clean(model.model_json_schema())


def bounded(annotation):
    """`annotation` with the registry's default bounds added where it has none."""
    base, metadata = annotation, []
    if typing.get_origin(annotation) is Annotated:
        base, *metadata = typing.get_args(annotation)
    has = _constraints(metadata)
    extra = []
    if base is str and "max_length" not in has:
        extra.append(annotated_types.MaxLen(DEFAULT_MAX_STR))
    elif base in (int, float) and not has & {"ge", "gt"}:
        extra += [annotated_types.Ge(DEFAULT_NUMBER_RANGE[0]), annotated_types.Le(DEFAULT_NUMBER_RANGE[1])]
    elif typing.get_origin(base) is list:
        (item,) = typing.get_args(base) or (str,)
        base = list[bounded(item)]
        if "max_length" not in has:
            extra.append(annotated_types.MaxLen(DEFAULT_MAX_ITEMS))
    if not metadata and not extra:
        return base
    # NOTE: bounds before the caller's metadata: pydantic puts constraints that follow a
    # validator into the JSON schema under their Python names (`ge`), not as `minimum`
    return Annotated[(base, *extra, *metadata)]


def _constraints(metadata: list) -> set[str]:
    """The bound names set in `Annotated` metadata (a `Field(...)` keeps them in its own
    `metadata`, annotated_types objects carry them as attributes)."""
    names = set()
    for m in metadata:
        for item in [m, *getattr(m, "metadata", [])]:
            names |= {k for k in ("max_length", "ge", "le", "gt", "lt") if getattr(item, k, None) is not None}
    return names


def _clean(schema: dict) -> dict:
    """Drop pydantic's `title` keys (noise in every prompt) and inline nothing else."""
    if isinstance(schema, dict):
        return {k: _clean(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_clean(v) for v in schema]
    return schema


_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")
_ARG_LINE = re.compile(r"^\s+(\w+)\s*(\([^)]*\))?:\s*(.+)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {parameter: description}) from a Google-style docstring."""
    paragraph, args, section, current = [], {}, "summary", None
    for line in doc.splitlines():
        if line.strip() in _ARGS_HEADERS:
            section = "args"
        elif section == "summary":
            if line.strip():
                paragraph.append(line.strip())
            elif paragraph:
                section = "body"
        elif section == "args":
            m = _ARG_LINE.match(line)
            if m:
                current = m.group(1)
                args[current] = m.group(3).strip()
            elif line.strip() and current and line.startswith(" " * 8):
                args[current] += " " + line.strip()
            elif line.strip() and not line.startswith(" "):
                section = "body"
    return " ".join(paragraph), args
