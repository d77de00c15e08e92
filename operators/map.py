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
(``zephon_flow.core.code``: comments, blank lines, indentation and docstrings do not count; the
same on every Python version), or its bytecode where no source exists, and the plain values
(numbers, str, bytes, None, tuples of these) of its defaults, closure cells and the module
globals it names, with helper functions of the same module followed. Editing the function
(or such a constant) changes the fingerprint's ``code <label>`` part.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import apache_beam as beam
import numpy as np

from zephon_flow.core.errors import SpecError, ZephonError
from zephon_flow.core.identity import function_identity, function_name


class FunctionError(Exception):
    """A wrapped user function raised; the message names the operator and the function."""


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
