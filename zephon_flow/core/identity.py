"""A function's identity in the pipeline fingerprint: its name and a digest of what it computes
with (its code, the globals and closure values it reads, its defaults), shared by ``ops.Map``
and the runner's description of ``beam.Map`` and friends.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable
from typing import Any

from zephon_flow.core.code import function_code_digest, global_names

_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def function_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (or of a partial's function, or a callable's class)."""
    if isinstance(fn, functools.partial):
        return f"partial({function_name(fn.func)})"
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(target, "__module__", None) or getattr(
        getattr(fn, "__objclass__", None), "__module__", "?"
    )
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


def _plain_repr(value: Any) -> str | None:
    """A process-independent repr of plain data, or None for anything else."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, tuple | list):
        parts = [_plain_repr(v) for v in value]
        return None if None in parts else f"{type(value).__name__}({', '.join(p or '' for p in parts)})"
    if isinstance(value, frozenset | set):  # repr order depends on the hash seed: sort it
        parts = [_plain_repr(v) for v in value]
        return None if None in parts else "set(" + ", ".join(sorted(p or "" for p in parts)) + ")"
    return None


class _Hasher:
    """Feeds a function's code and the plain values it depends on into one sha256."""

    def __init__(self, module: str | None) -> None:
        self.h = hashlib.sha256()
        self.module = module
        self.seen: set[int] = set()

    def value(self, name: str, value: Any) -> None:
        plain = _plain_repr(value)
        if plain is not None:
            self.h.update(f"{name}={plain};".encode())
        elif isinstance(value, types.FunctionType) and value.__module__ == self.module:
            self.h.update(f"{name}=fn;".encode())
            self.function(value)
        elif not isinstance(value, types.ModuleType):
            self.h.update(f"{name}:{type(value).__module__}.{type(value).__qualname__};".encode())

    def globals_(self, fn: types.FunctionType) -> None:
        for name in global_names(fn.__code__):
            if name in fn.__globals__:
                self.value(f"global {name}", fn.__globals__[name])

    def function(self, fn: types.FunctionType) -> None:
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        self.h.update(fn.__qualname__.encode() + b"(")
        self.h.update(function_code_digest(fn).encode())
        self.globals_(fn)
        for i, default in enumerate(fn.__defaults__ or ()):
            self.value(f"default {i}", default)
        for name, default in sorted((fn.__kwdefaults__ or {}).items()):
            self.value(f"kwdefault {name}", default)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                self.value(f"closure {name}", cell.cell_contents)
            except ValueError:  # an empty cell (a name not yet bound)
                self.h.update(f"closure {name} empty;".encode())
        self.h.update(b")")


def function_identity(fn: Callable[..., Any]) -> dict[str, str]:
    """How a function enters the fingerprint: its name and a digest of what it computes with."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    hasher = _Hasher(getattr(inner, "__module__", None))
    if isinstance(fn, functools.partial):
        for i, arg in enumerate(fn.args):
            hasher.value(f"arg {i}", arg)
        for name, arg in sorted(fn.keywords.items()):
            hasher.value(f"kwarg {name}", arg)
    if isinstance(inner, types.MethodType):
        inner = inner.__func__
    if isinstance(inner, types.FunctionType):
        hasher.function(inner)
    elif " at 0x" not in repr(inner):  # e.g. operator.itemgetter('text'): its repr says it all
        hasher.h.update(repr(inner).encode())
    if not isinstance(
        inner, types.FunctionType | types.BuiltinFunctionType | types.MethodDescriptorType | type
    ):
        call = type(inner).__call__  # a callable object: its class's code
        if isinstance(call, types.FunctionType):
            hasher.function(call)
        for name, value in sorted(vars(inner).items()) if hasattr(inner, "__dict__") else ():
            hasher.value(f"attr {name}", value)
    return {"fn": function_name(fn), "code": hasher.h.hexdigest()[:16]}


def beam_function_identity(dofn: Any) -> dict[str, str]:
    """``function_identity`` of the user's function in Beam's ``beam.Map``/``Filter``/``FlatMap``.

    Beam wraps ``fn`` in a lambda of its own (``Map.<locals>.<lambda>``) for all but
    ``FlatMap``; the user's function is that lambda's closure variable ``fn``.
    """
    wrapper = dofn._fn
    code = getattr(wrapper, "__code__", None)
    if (
        code is not None
        and getattr(wrapper, "__module__", "").startswith("apache_beam.")
        and "fn" in code.co_freevars
    ):
        kind = wrapper.__qualname__.split(".")[0]
        fn = wrapper.__closure__[code.co_freevars.index("fn")].cell_contents
        return {"beam": kind, **function_identity(fn)}
    return {"beam": "FlatMap", **function_identity(wrapper)}
