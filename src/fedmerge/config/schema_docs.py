"""Config keys described from the pydantic schema (type, default, description) for
``fedmerge list KIND NAME``, and the nearest valid keys for a misspelt one."""

from __future__ import annotations

import difflib
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# Local-training keys shared by every algorithm whose schema carries no description yet.
_FALLBACK = {
    "lr": "client learning rate (local SGD)",
    "local_epochs": "epochs of local training per round",
    "batch_size": "minibatch size of local training",
    "momentum": "SGD momentum of local training",
    "weight_decay": "L2 weight decay of local training",
}


@dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: str
    description: str


def describe(cls: type[BaseModel], prefix: str = "") -> list[KeyDoc]:
    """One row per key (nested settings as ``parent.child``), in schema order; ``name`` is left out."""
    rows = []
    for key, field in cls.model_fields.items():
        if key == "name" and not prefix and get_origin(field.annotation) is Literal:
            continue
        nested = [m for m in _models_in(field.annotation)]
        if field.default_factory is not None:
            default = _show(field.default_factory())
        elif field.default is PydanticUndefined:
            default = "required"
        else:
            default = _show(field.default)
        text = field.description or _FALLBACK.get(key, "")
        rows.append(KeyDoc(prefix + key, type_name(field.annotation, field.metadata), default, text))
        if len(nested) == 1 and nested[0] is not cls:
            rows += describe(nested[0], f"{prefix}{key}.")
    return rows


def type_name(annotation: Any, metadata: list[Any] | None = None) -> str:
    """``int | None``, ``'a' | 'b'``, ``list['uci' | 'mnist']``, with bounds such as ``>= 1``."""
    text = _type_text(annotation)
    bounds = []
    for m in metadata or []:
        for cls, attr, op in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(m, cls):
                bounds.append(f"{op} {_show(getattr(m, attr))}")
        if isinstance(m, MinLen) and m.min_length:
            bounds.append(f"length >= {m.min_length}")
        if isinstance(m, MaxLen):
            bounds.append(f"length <= {m.max_length}")
    return ", ".join([text, *bounds])


def _type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_text(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "settings"
    return getattr(annotation, "__name__", str(annotation))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds directly (through Optional / Union / Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, types.UnionType, Annotated):
        return [m for a in get_args(annotation) for m in _models_in(a)]
    return []


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{...}"
    if isinstance(value, str):
        return repr(value) if value == "" else value
    if isinstance(value, tuple):
        value = list(value)
    return "null" if value is None else str(value).replace("True", "true").replace("False", "false")


def did_you_mean(word: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def keys_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Valid keys of the (sub)section that ``loc`` (a pydantic error location, discriminator tags
    included) points into; None when it cannot be told."""
    cls: type[BaseModel] | None = schema
    choices: dict[str, type[BaseModel]] | None = None
    for item in loc[:-1]:
        if choices is not None:  # a discriminated union: this item is the tag (the component name)
            cls, choices = choices.get(item), None
            continue
        field = cls.model_fields.get(item) if cls is not None and isinstance(item, str) else None
        if field is None:
            return None
        models = _models_in(field.annotation)
        if len(models) == 1:
            cls = models[0]
        elif models:
            choices = {m.model_fields["name"].default: m for m in models if "name" in m.model_fields}
            cls = None
        else:
            return None
    return None if cls is None else list(cls.model_fields)


def markdown_table(cls: type[BaseModel]) -> str:
    """The rows of ``describe`` as a Markdown table (the documentation site's option tables)."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for row in describe(cls):
        cells = [f"`{row.key}`", _code(row.type), _code(row.default), _cell(row.description)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _code(text: str) -> str:
    # A pipe splits a table cell even inside a code span; the HTML entity does not.
    return f"<code>{_html(text).replace('|', '&#124;')}</code>" if text else ""


def _cell(text: str) -> str:
    return _html(" ".join(text.split())).replace("|", "&#124;").replace("*", "\\*")


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
