"""ops.Map, ops.Filter, ops.FlatMap and the batched path (``process_batch``) of the front segment."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.internal import pickler
from checkpointing import assert_equal_output_after_checkpoint
from helpers import chain_spec, run_batches, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import SpecError, StageError
from zephon_flow.core.identity import function_identity
from zephon_flow.engine.simulate import global_digests
from zephon_flow.runners.dofns import StatelessInvoker

# Records "a b | c | d e f": FlatMap splits on "|", Filter drops pieces of one token, Map parses.
RECORDS = ["1 2 3 | 4 | 5 6", "7 8 | 9 10 11 12 | 13 14", "15", "16 17 | 18 | 19 20 21", "22 | 23"] * 3


def pieces(text: str) -> list[str]:
    return [p.strip() for p in text.split("|")]


def several(piece: str) -> bool:
    return len(piece.split()) > 1


def parse(piece: str) -> np.ndarray:
    return np.asarray([int(t) for t in piece.split()], dtype=np.int32)


def pieces_batch(texts: list[str]) -> list[list[str]]:
    return [pieces(t) for t in texts]


def several_batch(ps: list[str]) -> list[bool]:
    return [several(p) for p in ps]


def parse_batch(ps: list[str]) -> list[np.ndarray]:
    return [parse(p) for p in ps]


def boom(piece: str) -> np.ndarray:
    if piece.startswith("9 "):
        raise ValueError(f"cannot parse {piece!r}")
    return parse(piece)


def boom_batch(ps: list[str]) -> list[np.ndarray]:
    return [boom(p) for p in ps]


def helpers_spec(path: str, *, batched: bool, lanes: int = 2, batch: int = 2, **kw: Any) -> zf.LoaderSpec:
    return chain_spec(
        path,
        ("split", ops.FlatMap(pieces_batch if batched else pieces, batched=batched)),
        ("keep", ops.Filter(several_batch if batched else several, batched=batched)),
        ("ids", ops.Map(parse_batch if batched else parse, batched=batched)),
        ("pack", ops.Pack(seq_len=4)),
        lanes=lanes,
        global_batch_size=batch,
        **kw,
    )


@pytest.fixture
def records(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "records.jsonl", RECORDS)


# -- the DoFns on their own -------------------------------------------------------------------
def test_map_filter_flat_map_per_element_and_per_batch() -> None:
    for dofn, element, want in (
        (ops.Map(str.upper), "ab", ["AB"]),
        (ops.Filter(several), "1 2", ["1 2"]),
        (ops.Filter(several), "1", []),
        (ops.FlatMap(pieces), "1 | 2 3", ["1", "2 3"]),
        (ops.Map(lambda xs: [x * 2 for x in xs], batched=True), 4, [8]),
        (ops.Filter(several_batch, batched=True), "1", []),
        (ops.FlatMap(pieces_batch, batched=True), "a|b", ["a", "b"]),
    ):
        assert list(dofn.process(element)) == want, dofn
        assert dofn.process_batch([element, element]) == [want, want], dofn


def test_numpy_bools_are_bools() -> None:
    kept = ops.Filter(lambda a: a.sum() > 2).process_batch([np.arange(3), np.arange(2)])
    assert [len(k) for k in kept] == [1, 0]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # Wrong types on purpose: the operators refuse them at run time.
        (lambda: ops.Map("upper"), "ops.Map: function must be callable, got str"),  # type: ignore[arg-type]
        (lambda: ops.Filter(None), "ops.Filter: predicate must be callable, got NoneType"),  # type: ignore[arg-type]
        (lambda: ops.FlatMap(pieces, batched=1), "ops.FlatMap: batched must be True or False, got 1"),  # type: ignore[arg-type]
    ],
)
def test_bad_options_are_refused(make: Any, message: str) -> None:
    with pytest.raises(SpecError, match=f"^{re.escape(message)}$"):
        make()


def test_function_errors_name_the_operator_and_the_function() -> None:
    with pytest.raises(
        Exception, match=r"^ops.Map's function test_map\.boom raised ValueError: cannot parse '9 1'$"
    ):
        list(ops.Map(boom).process("9 1"))
    with pytest.raises(Exception, match=r"ops.Filter's predicate .*<lambda> returned int \(3\), not a bool"):
        ops.Filter(lambda s: 3).process_batch(["x"])
    with pytest.raises(
        Exception, match=r"ops.FlatMap's function .*<lambda> returned str \('ab'\), not an iterable"
    ):
        list(ops.FlatMap(lambda s: s).process("ab"))
    with pytest.raises(
        Exception,
        match=r"ops.Map's batched function .*<lambda> returned 1 results for 2 elements; with "
        r"batched=True it must return one result per element",
    ):
        ops.Map(lambda xs: xs[:1], batched=True).process_batch(["a", "b"])


# -- through the loader ------------------------------------------------------------------------
def test_batched_and_per_element_helpers_give_the_same_batches(records: str) -> None:
    want = global_digests(helpers_spec(records, batched=False), steps=12)
    assert len({d for _, d in want}) > 1
    for options in ({}, {"chunk_records": 1}, {"chunk_records": 7, "backend": "threads", "workers": 2}):
        assert global_digests(helpers_spec(records, batched=True), steps=12, **options) == want, options


def test_the_helpers_compute_what_they_say(records: str) -> None:
    for batched in (False, True):
        spec = chain_spec(
            records,
            ("split", ops.FlatMap(pieces_batch if batched else pieces, batched=batched)),
            ("keep", ops.Filter(several_batch if batched else several, batched=batched)),
            ("ids", ops.Map(parse_batch if batched else parse, batched=batched)),
            epochs=1,
        )
        got = [b["data"][0].tolist() for b in run_batches(spec, chunk_records=4)]
        assert got == [parse(p).tolist() for r in RECORDS for p in pieces(r) if several(p)]


def test_resume_at_every_step_with_several_outputs_per_record_and_some_dropped(records: str) -> None:
    for batched in (False, True):
        spec = helpers_spec(records, batched=batched, lanes=2, batch=2, split_bytes=60)
        ref = assert_equal_output_after_checkpoint(spec, 16, chunk_records=3)
        skips = [
            ls["cursor"]["skip"] for s in ref.states for ls in zf.decode_state(s).to_plain()["lane_states"]
        ]
        assert max(skips) > 0  # some checkpoints fall inside a record's outputs


@pytest.mark.parametrize("batched", [False, True])
def test_a_failing_function_names_the_step_the_function_and_the_record(tmp_path: Path, batched: bool) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", RECORDS)
    offset = len(Path(path).read_text().splitlines()[0]) + 1  # "9 10 11 12" is in record 1
    spec = chain_spec(
        path,
        ("split", ops.FlatMap(pieces)),
        ("ids", ops.Map(boom_batch if batched else boom, batched=batched)),
    )
    which = "boom_batch" if batched else "boom"
    want = (
        rf"^DoFn 'ids' raised FunctionError: ops.Map's function test_map\.{which} raised ValueError: "
        rf"cannot parse '9 10 11 12' \(on the record at {re.escape(path)} byte {offset}, via ReadJsonl\('src'\)\)"
    )
    with pytest.raises(StageError, match=want):
        run_batches(spec, chunk_records=4)


def test_beam_s_own_map_filter_flat_map_give_the_same_batches(records: str) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        pcoll = p | "src" >> ops.ReadJsonl(records, split_bytes=60)
        pcoll = pcoll | "split" >> beam.FlatMap(pieces) | "keep" >> beam.Filter(several)
        return pcoll | "ids" >> beam.Map(parse) | "pack" >> beam.ParDo(ops.Pack(seq_len=4))

    beams = zf.LoaderSpec(build, lanes=2, seed=0, global_batch_size=2)
    ours = helpers_spec(records, batched=True, split_bytes=60)
    assert global_digests(beams, steps=10) == global_digests(ours, steps=10)


def test_lambdas_and_closures_survive_beam_s_pickler() -> None:
    add = 5
    for dofn in (ops.Map(lambda x: x + add), ops.FlatMap(lambda x: [x] * add), ops.Filter(lambda x: x > add)):
        copy = pickler.loads(pickler.dumps(dofn))
        assert copy.process_batch([4, 6]) == dofn.process_batch([4, 6])
        assert copy.params() == dofn.params()


@pytest.mark.slow
def test_lambdas_and_closures_run_on_the_processes_backend(records: str) -> None:
    offset = 100

    def spec(add: int) -> zf.LoaderSpec:
        return chain_spec(
            records,
            ("split", ops.FlatMap(lambda t: [p for p in t.split("|") if p.strip()])),
            ("ids", ops.Map(lambda p: np.asarray([int(x) + add for x in p.split()], dtype=np.int32))),
            ("pack", ops.Pack(seq_len=4)),
            lanes=2,
            global_batch_size=2,
        )

    want = global_digests(spec(offset), steps=6)
    assert global_digests(spec(offset), steps=6, backend="processes", workers=2) == want
    assert global_digests(spec(offset + 1), steps=6) != want


# -- process_batch contract for any DoFn ------------------------------------------------------------
class _Batched(beam.DoFn):  # type: ignore[misc]
    """What Beam needs at construction from a DoFn defining ``process_batch``: its input batch
    type (string annotations do not count) and, for ours, that it does not yield batches."""

    def get_input_batch_type(self, input_element_type: Any) -> Any:
        return typing.List[input_element_type]  # noqa: UP006


class _OnlyBatch(_Batched):
    """Defines only process_batch: doubles each int."""

    @beam.DoFn.yields_elements
    def process_batch(self, batch: list[int]) -> list[list[int]]:
        return [[x * 2] for x in batch]


class _ShortBatch(_Batched):
    @beam.DoFn.yields_elements
    def process_batch(self, batch: list[Any]) -> list[list[Any]]:
        return [[x] for x in batch[1:]]


class _BeamStyleBatch(_Batched):
    @beam.DoFn.yields_elements
    def process_batch(self, batch: list[int]) -> Iterator[np.ndarray]:
        yield np.asarray(batch) * 2


def test_a_dofn_with_only_process_batch_also_runs_per_element() -> None:
    inv = StatelessInvoker("double", _OnlyBatch())
    assert inv.batched and not inv.has_process
    assert inv(3) == [6]
    assert inv.call_batch([1, 2]) == [[2], [4]]


def test_process_batch_must_return_one_output_list_per_element() -> None:
    with pytest.raises(
        StageError,
        match=r"^DoFn 'short': process_batch returned 1 output lists for 2 elements; zephon-flow's "
        r"process_batch must return one list of outputs per element, in order$",
    ):
        StatelessInvoker("short", _ShortBatch()).call_batch(["a", "b"])
    with pytest.raises(StageError, match=r"^DoFn 'beam': process_batch returned 1 output lists for 2"):
        StatelessInvoker("beam", _BeamStyleBatch()).call_batch([1, 2])
    with pytest.raises(
        StageError, match=r"returned a ndarray for element 0; .* \(not Beam-style output batches\)"
    ):
        StatelessInvoker("beam", _BeamStyleBatch()).call_batch([1])


def test_process_batch_is_refused_in_the_stream_with_the_dofn_named(records: str) -> None:
    spec = chain_spec(records, ("short", _ShortBatch()))
    with pytest.raises(StageError, match=r"^DoFn 'short': process_batch returned"):
        run_batches(spec, chunk_records=2)


# -- fingerprint -------------------------------------------------------------------------------
def _defined(source: str, **env: Any) -> Any:
    namespace: dict[str, Any] = {"__name__": "pipeline_module", **env}
    exec(textwrap.dedent(source), namespace)
    return namespace["clean"]


CLEAN = """
    LIMIT = 5
    def clean(text):
        words = [w for w in text.split() if w not in {"a", "the", "of"}]
        return " ".join(words[:LIMIT])
"""


def test_a_function_s_identity_is_its_name_and_what_it_computes() -> None:
    first = function_identity(_defined(CLEAN))
    assert first == function_identity(_defined(CLEAN))  # recompiled (new code objects): same
    assert first["fn"] == "pipeline_module.clean"
    assert first != function_identity(_defined(CLEAN.replace("LIMIT = 5", "LIMIT = 6")))  # a global
    assert first != function_identity(_defined(CLEAN.replace('"of"', '"on"')))  # a constant
    assert first != function_identity(_defined(CLEAN.replace("split()", "split(',')")))  # code
    assert first != function_identity(_defined(CLEAN.replace("w not in", "w in")))


def test_closure_values_and_partials_count() -> None:
    def adder(k: int) -> Any:
        return lambda x: x + k

    assert function_identity(adder(1)) == function_identity(adder(1))
    assert function_identity(adder(1)) != function_identity(adder(2))
    import functools
    import operator

    assert function_identity(functools.partial(int, base=2)) != function_identity(
        functools.partial(int, base=8)
    )
    assert function_identity(operator.itemgetter("a")) != function_identity(operator.itemgetter("b"))
    assert function_identity(str.upper)["fn"] == "builtins.str.upper"


def test_the_fingerprint_names_the_function_and_changes_with_it(records: str) -> None:
    a = helpers_spec(records, batched=False).fingerprint["operator ids"]
    b = chain_spec(records, ("split", ops.FlatMap(pieces)), ("ids", ops.Map(boom))).fingerprint[
        "operator ids"
    ]
    assert a != b


@pytest.mark.slow
def test_a_function_s_identity_does_not_depend_on_the_process() -> None:
    code = (
        "import textwrap; from zephon_flow.core.identity import function_identity; ns = {'__name__': 'm'}; "
        f"exec(textwrap.dedent({CLEAN!r}), ns); print(function_identity(ns['clean']))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(seen) == 1 and "'fn': 'm.clean'" in seen.pop()


def test_beam_s_own_helpers_are_identified_by_the_user_s_function(records: str) -> None:
    def spec(step: beam.PTransform) -> zf.LoaderSpec:
        def build(p: beam.Pipeline) -> beam.PCollection:
            return p | "src" >> ops.ReadJsonl(records) | "step" >> step

        return zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1)

    parts = [
        spec(t).fingerprint["operator step"] for t in (beam.Map(parse), beam.Map(boom), beam.Filter(parse))
    ]
    assert len(set(parts)) == 3  # Beam wraps each function in the same lambda: look through it
    assert spec(beam.Map(parse)).fingerprint["operator step"] == parts[0]
