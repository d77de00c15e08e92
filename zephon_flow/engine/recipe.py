"""Recipe state for a plan: lane states to recipes at save, and back by re-reading records at restore.

Which values are recipes follows from the plan (``core/recipe.py`` says what a recipe is):

- the first stateful DoFn of the ordered back must make its outputs from the front's documents
  (a ``RecipeMaker``: ``Pack``); its ``recipe_values`` (Pack's open sequence) are recipes;
- a later stateful DoFn that holds its inputs and emits them unchanged (``recipe_elements``:
  ``Shuffle``'s buffer) holds them as recipes of that maker's outputs;
- the lane's pending outputs, when they are still that maker's outputs, are recipes.

Anything else (a stateless DoFn after the maker, a stateful DoFn without these declarations,
a source that cannot re-read a record from its offset) is refused when the state is taken,
naming the operator or source.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zephon_flow.core import recipe
from zephon_flow.core.checkpoint.state import LaneState, LoaderState, StageState
from zephon_flow.core.errors import CorruptStateError, RecipeMismatchError, RecipeRefusedError
from zephon_flow.core.recipe import DocKey, Outputs, RecipeMaker
from zephon_flow.core.source import Record
from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.dofns import StatefulInvoker
from zephon_flow.runners.plan import Plan
from zephon_flow.runners.segment import Chunk, Skipped

#: Records whose front runs in one call on restore (a batched tokenizer gets them together).
CHUNK = 256
_USE_COMPACT = "use state_mode='compact' (the default)"
#: A backend's ``submit``: runs the front on a chunk of records, in parallel with others.
Submit = Callable[[Chunk], "Future[ChunkResult]"]


@dataclass(frozen=True)
class Layout:
    """Where a plan's lane state holds recipes: per stage label, its values that are recipes
    (one each) and those that are lists of recipes; whether pending outputs are recipes."""

    maker: RecipeMaker
    single: dict[str, tuple[str, ...]]
    lists: dict[str, tuple[str, ...]]
    pending: bool


def layout(plan: Plan) -> Layout:
    """The plan's recipe layout; refuses a plan whose state cannot be stored as recipes."""
    for sp in plan.sources:
        if not getattr(sp.source, "rereads_offsets", False):
            raise RecipeRefusedError(
                f"source {sp.label!r} ({sp.source.operator_name}) cannot re-read a record from its "
                f"offset (it does not declare rereads_offsets), so recipe state cannot rebuild its "
                f"documents; {_USE_COMPACT}"
            )
    back = plan.back
    if not back or not isinstance(back[0], StatefulInvoker):
        raise RecipeRefusedError(f"the pipeline has no stateful DoFn after its front; {_USE_COMPACT}")
    first = back[0]
    maker = first.dofn
    if not isinstance(maker, RecipeMaker):
        raise RecipeRefusedError(
            f"stateful DoFn {first.label!r} ({type(maker).__name__}) does not say how to store its "
            f"state as document recipes (it is not a RecipeMaker); {_USE_COMPACT}"
        )
    reason = maker.recipe_refusal()
    if reason is not None:
        raise RecipeRefusedError(f"stateful DoFn {first.label!r}: {reason}; {_USE_COMPACT}")
    single = {first.label: tuple(maker.recipe_values)}
    lists: dict[str, tuple[str, ...]] = {}
    passes = True  # the elements flowing here are still the maker's outputs
    for stage in back[1:]:
        if not isinstance(stage, StatefulInvoker):
            passes = False
            continue
        held = tuple(getattr(stage.dofn, "recipe_elements", ()))
        if not held or not passes:
            why = (
                "does not declare recipe_elements (which of its state values hold inputs it emits unchanged)"
                if not held
                else f"holds elements that a stateless DoFn after {first.label!r} changed"
            )
            raise RecipeRefusedError(
                f"stateful DoFn {stage.label!r} ({type(stage.dofn).__name__}) {why}, so its state "
                f"cannot be stored as document recipes; {_USE_COMPACT}"
            )
        lists[stage.label] = held
    return Layout(maker, single, lists, passes)


def to_recipes(plan: Plan, state: LoaderState) -> LoaderState:
    """``state`` with its buffered sequences as recipes (refused, by name, if it cannot be)."""
    return RecipeWriter(plan)(state)


class RecipeWriter:
    """Turns a loader's states into recipe states. It remembers each value's recipe until the
    next call (values are never changed once made, and a shuffle buffer changes by a window a
    step), so a ``state_dict()`` every step digests only the values that are new since."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._found = layout(plan)
        self._memo: dict[int, _Memo] = {}
        self._lock = threading.Lock()

    def __call__(self, state: LoaderState) -> LoaderState:
        if state.recipe:
            return state
        with self._lock:
            kept: dict[int, _Memo] = {}

            def encode(value: Any, kind: str, where: str) -> Any:
                hit = self._memo.get(id(value))
                if hit is not None and hit.matches(value, kind):
                    kept[id(value)] = hit
                    return hit.recipe
                made = recipe.encode(self._found.maker, value, kind, where)
                if all(isinstance(v, np.ndarray) for v in value.values()):  # weakly referable
                    kept[id(value)] = _Memo.of(value, kind, made)
                return made

            lanes = {
                lane: _lane_to_recipes(self._found, self._plan, ls, encode)
                for lane, ls in state.lane_states.items()
            }
            self._memo = kept
        return replace(state, lane_states=lanes, recipe=True)


@dataclass(frozen=True)
class _Memo:
    """A value's recipe, and weak references to the value's arrays: an id that a new value
    reuses (the old one freed) never matches, since the new one's arrays are other objects."""

    kind: str
    arrays: tuple[tuple[str, weakref.ref[np.ndarray]], ...]
    recipe: dict[str, np.ndarray]

    @classmethod
    def of(cls, value: Any, kind: str, made: dict[str, np.ndarray]) -> _Memo:
        return cls(kind, tuple((k, weakref.ref(v)) for k, v in value.items()), made)

    def matches(self, value: Any, kind: str) -> bool:
        return (
            kind == self.kind
            and len(value) == len(self.arrays)
            and all(k in value and value[k] is ref() for k, ref in self.arrays)
        )


def _lane_to_recipes(found: Layout, plan: Plan, ls: LaneState, encode: _Visit) -> LaneState:
    if ls.pending and not found.pending:
        raise RecipeRefusedError(
            f"lane {ls.lane}: its pending outputs were changed by a stateless DoFn after "
            f"{plan.back[0].label!r}, so they cannot be stored as document recipes; {_USE_COMPACT}"
        )
    return _walk(found, ls, encode)


def from_recipes(
    plan: Plan, state: LoaderState, lanes: int, lane_ids: list[int], submit: Submit | None = None
) -> LoaderState:
    """The lane states ``lane_ids`` of a recipe state, rebuilt: their records re-read, the
    front re-run (on ``submit``, a backend's, if given), every value checked against its saved
    digest."""
    if not state.recipe:
        return state
    try:
        found = layout(plan)
    except RecipeRefusedError as exc:
        raise RecipeRefusedError(
            f"the checkpoint is a recipe state, but this pipeline cannot rebuild it: {exc}"
        ) from exc
    wanted = [state.lane_states[lane] for lane in lane_ids]
    places: dict[DocKey, str] = {}
    documents = reread(plan, lanes, needs(found, wanted).keys, submit, places)
    hashes: recipe.WindowCache = {}  # keyed by array ids: valid while ``documents`` lives

    def rebuild(value: Any, kind: str, where: str) -> Any:
        return recipe.rebuild(found.maker, value, kind, documents, where, hashes, places)

    rebuilt = {ls.lane: _walk(found, ls, rebuild) for ls in wanted}
    return replace(state, lane_states={**state.lane_states, **rebuilt}, recipe=False)


@dataclass(frozen=True)
class Needs:
    """What rebuilding some lanes' recipes takes: the records to re-read (sorted), and the
    pieces and tokens they make up."""

    keys: list[DocKey]
    pieces: int
    tokens: int


def needs(found: Layout, lane_states: list[LaneState]) -> Needs:
    """The records (and pieces and tokens) the recipes of ``lane_states`` name."""
    keys: set[DocKey] = set()
    counts = [0, 0]

    def collect(value: Any, kind: str, where: str) -> Any:
        keys.update(recipe.doc_keys(value, where))
        lengths = value["lengths"]
        counts[0] += int(lengths.size)
        counts[1] += int(lengths.sum())
        return value

    for ls in lane_states:
        _walk(found, ls, collect)
    return Needs(sorted(keys), counts[0], counts[1])


#: Maps a recipe, its kind and where it is to its replacement.
_Visit = Callable[[Any, str, str], Any]


def _at(visit: _Visit, where: str) -> recipe.Leaf:
    def leaf(value: Any, kind: str) -> Any:
        return visit(value, kind, where)

    return leaf


def _walk(found: Layout, ls: LaneState, visit: _Visit) -> LaneState:
    """The lane state with each recipe replaced by ``visit(recipe, kind, where)``."""
    maker = found.maker
    stages = {}
    for label, st in ls.stages.items():
        values = dict(st.values)
        for name in found.single.get(label, ()):
            if values.get(name) is not None:
                where = f"lane {ls.lane}, stage {label!r}, state {name!r}"
                try:
                    values[name] = maker.recipe_state(values[name], _at(visit, where))
                except (KeyError, TypeError, IndexError) as exc:
                    raise CorruptStateError(f"{where}: its recipes are malformed ({exc!r})") from exc
        for name in found.lists.get(label, ()):
            held = values.get(name)
            if held is not None:
                where = f"lane {ls.lane}, stage {label!r}, state {name!r}"
                if not isinstance(held, list):
                    raise CorruptStateError(f"{where} should be a list of recipes")
                values[name] = [visit(v, "sample", f"{where}[{i}]") for i, v in enumerate(held)]
        stages[label] = StageState(values=values, timers=dict(st.timers), position=st.position)
    pending = [visit(v, "sample", f"lane {ls.lane}, pending output {i}") for i, v in enumerate(ls.pending)]
    return replace(ls, stages=stages, pending=pending)


def reread(
    plan: Plan,
    lanes: int,
    keys: list[DocKey],
    submit: Submit | None = None,
    places: dict[DocKey, str] | None = None,
) -> dict[DocKey, Outputs]:
    """The front's outputs for each record id, read again and run through the front (on the
    loader's backend when given: chunks in parallel); ``places``, if given, gets each record's
    file and position, for errors."""
    records = list(_read(plan, lanes, keys))
    if places is not None:
        places.update((key, f"at {record.path} {record.where}") for key, record in records)
    chunks = [records[start : start + CHUNK] for start in range(0, len(records), CHUNK)]
    front = plan.front_segment() if submit is None else None
    pending: list[Future[ChunkResult]] = []
    if submit is not None:
        pending = [submit([(key[0], record) for key, record in part]) for part in chunks]
    out: dict[DocKey, Outputs] = {}
    for i, part in enumerate(chunks):
        if front is not None:
            results = front.run_chunk([(key[0], record) for key, record in part])
        else:
            results = pending[i].result()
        if not isinstance(results, list):
            for future in pending[i:]:
                future.cancel()
            results.reraise()
        for (key, record), result in zip(part, results, strict=True):
            if isinstance(result, Skipped):
                raise RecipeMismatchError(
                    f"re-reading the record at {record.path} {record.where} for the checkpoint's "
                    f"recipe state: it is now skipped as bad data ({result.message}); the data "
                    f"changed since the checkpoint. Resume from a compact checkpoint"
                )
            out[key] = [_tokens(v) for v in result]
    return out


def _tokens(value: Any) -> np.ndarray:
    """An output as a token array (anything else gets an empty one: no piece can lie in it)."""
    array = np.asarray(value) if isinstance(value, np.ndarray | list | tuple) else np.zeros(0, np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        return np.zeros(0, dtype=np.int32)
    return array.astype(np.int32, copy=False)


def _read(plan: Plan, lanes: int, keys: list[DocKey]) -> Iterator[tuple[DocKey, Record]]:
    """The records ``keys`` (sorted): each split is read forward from its first wanted record
    through its last (reopening it costs a seek point's decompression for a compressed file,
    or the whole file when it has none)."""
    reader: Iterator[tuple[int, Record]] | None = None
    at: tuple[int, int, int] | None = None  # (source, split, position after the last record)
    try:
        for key in keys:
            source_index, split_index, offset = key
            if not 0 <= source_index < len(plan.sources):
                raise CorruptStateError(
                    f"a recipe names source index {source_index}; the pipeline has {len(plan.sources)}"
                )
            sp = plan.sources[source_index]
            splits = sp.source.splits(lanes)
            if not 0 <= split_index < len(splits):
                raise CorruptStateError(
                    f"a recipe names split {split_index} of source {sp.label!r}, which has {len(splits)}"
                )
            if reader is None or at is None or at[:2] != key[:2] or at[2] > offset:
                _close(reader)
                reader = sp.source.read_split(splits[split_index], offset)
            got = next(reader, None)
            while got is not None and got[1].offset < offset:  # read on (one pass per split)
                got = next(reader, None)
            if got is None or got[1].offset != offset:
                split = splits[split_index]
                raise RecipeMismatchError(
                    f"{sp.source.operator_name}: no record at offset {offset} of {split.path} (split "
                    f"{split_index}); the data changed since the checkpoint, which recipe state needs "
                    f"to re-read. Resume from a compact checkpoint"
                )
            at = (source_index, split_index, got[0])
            yield key, got[1]
    finally:
        _close(reader)


def _close(reader: Iterator[Any] | None) -> None:
    close = getattr(reader, "close", None)
    if callable(close):
        close()
