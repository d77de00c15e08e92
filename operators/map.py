"""``Map``, ``Filter`` and ``FlatMap``: stateless DoFns wrapping plain functions, per element or batched.

Apply them with ``beam.ParDo``: ``docs | "clean" >> beam.ParDo(ops.Map(clean))``. With
``batched=True`` the function takes a list of elements and returns one result per element
(``Map``: the outputs; ``Filter``: bools; ``FlatMap``: iterables of outputs), so per-element
overhead is paid once per chunk.

The batched path: each of these DoFns defines ``process_batch(batch)``, which zephon-flow's
front segment calls once per chunk and stage with every value at that stage. Unlike Beam's
``process_batch`` (which yields output *batches*, converted by a ``BatchConverter``), ours
returns **one list of outputs per input element**, in input order (``list[list[Y]]``), because a
lane's resume cursor counts outputs per record. On Beam's own runners these DoFns run through
``process`` (``process_batch`` is declared ``yields_elements``, so Beam never hands them batches
unless an upstream DoFn produces batches, which is not supported).

A function's identity in the pipeline fingerprint (``function_identity``) is its module and
qualified name plus a digest of its code: its source, parsed and normalised
(``zephon_flow.code``: comments, blank lines, indentation and docstrings do not count; the
same on every Python version), or its bytecode where no source exists, and the plain values
(numbers, str, bytes, None, tuples of these) of its defaults, closure cells and the module
globals it names, with helper functions of the same module followed. Editing the function
(or such a constant) changes the fingerprint's ``code <label>`` part.
"""

from __future__ import annotations

import functools
import hashlib
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import apache_beam as beam
import numpy as np

from zephon_flow.code import function_code_digest, global_names
from zephon_flow.errors import SpecError, ZephonError

_PLAIN = (int, float, complex, str, bytes, bool, type(None))


class FunctionError(Exception):
    """A wrapped user function raised; the message names the operator and the function."""


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


class _FunctionDoFn(beam.DoFn):  # type: ignore[misc]
    """Shared by Map, Filter and FlatMap: validation, naming, fingerprint, both paths."""

    kind: ClassVar[str]
    what: ClassVar[str]  # what the function is called in messages

    def __init__(self, fn: Callable[..., Any], *, batched: bool = False) -> None:
        super().__init__()
        if not callable(fn):
            raise SpecError(f"ops.{self.kind}: {self.what} must be callable, got {type(fn).__name__}")
        if not isinstance(batched, bool):
            raise SpecError(f"ops.{self.kind}: batched must be True or False, got {batched!r}")
        self.fn = fn
        self.batched = batched
        self.fn_name = function_name(fn)

    def __repr__(self) -> str:
        flag = ", batched=True" if self.batched else ""
        return f"ops.{self.kind}({self.fn_name}{flag})"

    def params(self) -> dict[str, Any]:
        return {"operator": self.kind, **function_identity(self.fn), "batched": self.batched}

    def get_input_batch_type(self, input_element_type: Any) -> Any:
        # Only so that Beam's runners accept the DoFn; they call ``process``.
        return typing.List[input_element_type]  # noqa: UP006 (Beam wants a typing generic)

    def _call(self, arg: Any) -> Any:
        try:
            return self.fn(arg)
        except ZephonError:
            raise
        except Exception as exc:
            raise FunctionError(
                f"ops.{self.kind}'s {self.what} {self.fn_name} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _results(self, batch: list[Any]) -> list[Any]:
        """The batched function's results, one per element (checked)."""
        got = self._call(batch)
        results = list(got) if isinstance(got, Iterable) and not isinstance(got, str | bytes) else None
        if results is None or len(results) != len(batch):
            size = f"{len(results)} results" if results is not None else type(got).__name__
            raise FunctionError(
                f"ops.{self.kind}'s batched {self.what} {self.fn_name} returned {size} for "
                f"{len(batch)} elements; with batched=True it must return one result per element"
            )
        return results

    def _outputs(self, element: Any, result: Any) -> list[Any]:
        """One element's outputs, given the function's result for it."""
        raise NotImplementedError

    def process(self, element: Any) -> Iterable[Any]:
        result = self._results([element])[0] if self.batched else self._call(element)
        return self._outputs(element, result)

    @beam.DoFn.yields_elements  # type: ignore[untyped-decorator]
    def process_batch(self, batch: list[Any]) -> list[list[Any]]:
        """zephon-flow's batched path: one list of outputs per element of ``batch``."""
        if self.batched:
            return [self._outputs(x, r) for x, r in zip(batch, self._results(batch), strict=True)]
        return [self._outputs(x, self._call(x)) for x in batch]


class Map(_FunctionDoFn):
    """One output per element: ``fn(element)``; with ``batched=True``, ``fn(list) -> list``."""

    kind, what = "Map", "function"

    def _outputs(self, element: Any, result: Any) -> list[Any]:
        return [result]


class Filter(_FunctionDoFn):
    """Keeps the elements for which ``predicate(element)`` is True (a bool, else an error);
    with ``batched=True``, ``predicate(list) -> list of bools``."""

    kind, what = "Filter", "predicate"

    def _outputs(self, element: Any, result: Any) -> list[Any]:
        if not isinstance(result, bool | np.bool_):
            raise FunctionError(
                f"ops.Filter's predicate {self.fn_name} returned {type(result).__name__} "
                f"{_short(result)}, not a bool; return True to keep the element, False to drop it"
            )
        return [element] if result else []


class FlatMap(_FunctionDoFn):
    """Zero or more outputs per element: the items of the iterable ``fn(element)``; with
    ``batched=True``, ``fn(list) -> list of iterables``."""

    kind, what = "FlatMap", "function"

    def _outputs(self, element: Any, result: Any) -> list[Any]:
        if isinstance(result, str | bytes | dict) or not isinstance(result, Iterable):
            raise FunctionError(
                f"ops.FlatMap's function {self.fn_name} returned {type(result).__name__} "
                f"{_short(result)}, not an iterable of outputs; return a list (e.g. [value], or [] "
                f"for none)"
            )
        return list(result)


def _short(value: Any) -> str:
    text = repr(value)
    return f"({text[:40]}...)" if len(text) > 40 else f"({text})"
