"""SQL constructs that each dialect writes its own way, so that a statement built once from them
runs on either database."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BindParameter, Text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class json_array_texts(FunctionElement[Any]):
    """The strings of a JSON array (bound as text), as rows of one column, `value`: use it as
    `json_array_texts(parameter).table_valued("value")`."""

    name = "json_array_texts"
    inherit_cache = True

    def __init__(self, array: BindParameter[Any]) -> None:
        super().__init__(array)
        self.type = Text()


@compiles(json_array_texts, "sqlite")
def _json_each(element: json_array_texts, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_each({compiler.process(element.clauses, **kw)})"


@compiles(json_array_texts, "postgresql")
def _jsonb_array_elements_text(element: json_array_texts, compiler: SQLCompiler, **kw: Any) -> str:
    return f"jsonb_array_elements_text(CAST({compiler.process(element.clauses, **kw)} AS JSONB))"


class binary_order(FunctionElement[Any]):
    """A text column compared by code point, as both databases sort it: SQLite's default
    (BINARY) collation, PostgreSQL's "C"."""

    name = "binary_order"
    inherit_cache = True


@compiles(binary_order, "sqlite")
def _binary(element: binary_order, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.clauses, **kw)


@compiles(binary_order, "postgresql")
def _collate_c(element: binary_order, compiler: SQLCompiler, **kw: Any) -> str:
    return f'{compiler.process(element.clauses, **kw)} COLLATE "C"'
