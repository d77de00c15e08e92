"""The identity of user code in the fingerprint: normalised source text, bytecode as a fallback.

A function or DoFn class is identified by its parsed source (``ast``), so comments, blank
lines, indentation and docstrings do not count, and the same source gives the same digest on
every Python version (the dump below leaves out empty fields, which newer versions add).
Where no source can be found (code built at run time, a ``python -c`` one-liner) the
bytecode stands in; bytecode differs between Python minor versions, so such code refuses
checkpoints across a Python upgrade, and only such code.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import sys
import textwrap
import types
from typing import Any

#: Modules whose code is versioned with the package, not with the user's pipeline.
_LIBRARY = ("apache_beam", "zephon_flow", "builtins")


def _dump(node: Any) -> str:
    """A version-independent dump of an AST: node names and their non-empty fields."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if value is None or value == [] or name in ("type_comment", "kind"):
                continue
            fields.append(f"{name}={_dump(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_dump(v) for v in node) + "]"
    return repr(node)


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]


def _parse(text: str) -> ast.Module | None:
    text = textwrap.dedent(text)
    for candidate in (text, f"(\n{text}\n)"):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def _lambda_source(fn: types.FunctionType) -> str | None:
    """The lambdas that start on ``fn``'s line of its file (a lambda has no source of its own)."""
    linecache.checkcache(fn.__code__.co_filename)
    lines = linecache.getlines(fn.__code__.co_filename)
    if not lines:
        return None
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return None
    first = fn.__code__.co_firstlineno
    lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == first]
    arity = fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount
    same = [n for n in lambdas if len(n.args.args) + len(n.args.kwonlyargs) == arity]
    # Several lambdas on one line with the same arity: all of them count (an edit to a
    # neighbour refuses too, which is safe; accepting a changed one would not be).
    return ";".join(_dump(n) for n in same) or None


def source_digest(obj: Any) -> str | None:
    """A digest of the normalised source of a function or class, or None if it has none."""
    if isinstance(obj, types.FunctionType) and obj.__name__ == "<lambda>":
        dumped = _lambda_source(obj)
    else:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return None
        tree = _parse(text)
        if tree is None:
            return None
        _strip_docstrings(tree)
        dumped = _dump(tree)
    if dumped is None:
        return None
    return hashlib.sha256(dumped.encode("utf-8")).hexdigest()


def _stable_repr(value: Any) -> str:
    """``repr`` with sets sorted (their order depends on the hash seed)."""
    if isinstance(value, frozenset | set):
        return "{" + ",".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ",".join(_stable_repr(v) for v in value) + ")"
    return repr(value)


def bytecode_digest(code: types.CodeType) -> str:
    """The fallback: bytecode, constants and names, through nested code objects."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(_stable_repr(const).encode() + b";")

    feed(code)
    return h.hexdigest()


def function_code_digest(fn: types.FunctionType) -> str:
    """``source:<digest>`` from the function's source, else ``bytecode:<digest>``."""
    digest = source_digest(fn)
    if digest is not None:
        return f"source:{digest[:16]}"
    return f"bytecode:{bytecode_digest(fn.__code__)[:16]}"


def global_names(code: types.CodeType) -> list[str]:
    """The names a code object and its nested code use, sorted (stable across versions)."""
    names: set[str] = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(global_names(const))
    return sorted(names)


def user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that belong to the user, not to Beam, zephon-flow or Python."""
    return [c for c in cls.__mro__ if not _is_library(c.__module__)]


def _is_library(module: str) -> bool:
    top = module.split(".")[0]
    return top in _LIBRARY or top in sys.stdlib_module_names


def class_code_digest(cls: type) -> str | None:
    """The digest of a user DoFn class's code (its own and its user base classes'), or None
    for a class of Beam or zephon-flow."""
    classes = user_classes(cls)
    if not classes:
        return None
    h = hashlib.sha256()
    for c in classes:
        digest = source_digest(c)
        if digest is None:
            methods = sorted((name, v) for name, v in vars(c).items() if isinstance(v, types.FunctionType))
            digest = "bytecode:" + ",".join(f"{n}={bytecode_digest(f.__code__)}" for n, f in methods)
        h.update(f"{c.__qualname__}={digest};".encode())
    return h.hexdigest()[:16]
