"""Conformance with Beam's own FnApiRunner: our user-state and timer semantics match Beam's.

The deterministic runner calls stateful DoFns directly with state it owns. These tests run the
same DoFns, on the same keyed input in the same order, under Beam's FnApiRunner and under our
``StatefulInvoker``, and compare what comes out (as multisets: Beam promises no output order,
but every output here depends on the order and content of what came before it). The
stateless helpers, which define zephon-flow's ``process_batch``, must run on Beam through
``process`` and give what our front segment gives.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import PickleCoder
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.combiners import CountCombineFn
from apache_beam.transforms.userstate import (
    BagStateSpec,
    CombiningValueStateSpec,
    ReadModifyWriteStateSpec,
    TimeDomain,
    TimerSpec,
    on_timer,
)
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import MAX_TIMESTAMP
from helpers import Corpus

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker, StatelessInvoker


class Ledger(beam.DoFn):
    """Uses every kind of state the runner supports, and a timer that fires at the end."""

    SEEN = BagStateSpec("seen", PickleCoder())
    COUNT = CombiningValueStateSpec("count", PickleCoder(), CountCombineFn())
    LAST = ReadModifyWriteStateSpec("last", PickleCoder())
    END = TimerSpec("end", TimeDomain.WATERMARK)

    def process(
        self,
        element: tuple[int, int],
        seen: Any = beam.DoFn.StateParam(SEEN),
        count: Any = beam.DoFn.StateParam(COUNT),
        last: Any = beam.DoFn.StateParam(LAST),
        end: Any = beam.DoFn.TimerParam(END),
    ) -> Any:
        _, value = element
        previous = last.read()
        if previous is None:
            end.set(MAX_TIMESTAMP)
        seen.add(value)
        count.add(value)
        last.write(value)
        yield ("step", count.read(), previous, value, sum(seen.read()))

    @on_timer(END)
    def finish(self, seen: Any = beam.DoFn.StateParam(SEEN), count: Any = beam.DoFn.StateParam(COUNT)) -> Any:
        yield ("end", count.read(), tuple(seen.read()))
        seen.clear()
        count.clear()


def _ours(dofn: beam.DoFn, inputs: list[Any]) -> list[Any]:
    invoker = StatefulInvoker("under test", dofn, seed=0)
    state = DoFnLaneState()
    out: list[Any] = []
    for value in inputs:
        out += invoker.process(0, value, state)
    out += invoker.fire_timers(0, state, None)
    return out


def _beams(dofn: beam.DoFn, inputs: list[Any], as_key: Any) -> None:
    # One element fans out in order inside one bundle, so the stateful DoFn sees ``inputs`` in
    # order, as our lanes guarantee.
    def fan_out(_: Any) -> list[tuple[int, Any]]:
        return [(0, v) for v in inputs]

    with beam.Pipeline(runner=FnApiRunner()) as p:
        out = p | beam.Create([None]) | beam.FlatMap(fan_out) | beam.ParDo(dofn) | beam.Map(as_key)
        assert_that(out, equal_to([as_key(x) for x in _ours(dofn, inputs)]))


def test_bag_combining_read_modify_write_and_timers_match_beam() -> None:
    inputs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    ours = _ours(Ledger(), inputs)
    assert ours[0] == ("step", 1, None, 3, 3)
    assert ours[-1] == ("end", 10, tuple(inputs))
    _beams(Ledger(), inputs, as_key=lambda x: x)


def test_pack_matches_beam() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=int(n), dtype=np.int32) for n in rng.integers(1, 40, size=50)]
    ours = _ours(ops.Pack(seq_len=16), docs)
    assert len(ours) == -(-sum(len(d) for d in docs) // 16)  # every token, the tail padded

    def as_key(sample: dict[str, np.ndarray]) -> tuple[bytes, bytes, bytes]:
        return tuple(sample[k].tobytes() for k in ("input_ids", "position_ids", "segment_ids"))  # type: ignore[return-value]

    _beams(ops.Pack(seq_len=16), docs, as_key=as_key)


def test_best_fit_pack_with_labels_matches_beam() -> None:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 100, size=int(n), dtype=np.int32) for n in rng.integers(1, 40, size=50)]

    def pack() -> ops.Pack:
        return ops.Pack(seq_len=16, strategy="best_fit", buffer=5, open_bins=3, labels=True)

    ours = _ours(pack(), docs)
    assert sum(int((s["segment_ids"] >= 0).sum()) for s in ours) == sum(len(d) for d in docs)

    def as_key(sample: dict[str, np.ndarray]) -> tuple[bytes, ...]:
        return tuple(sample[k].tobytes() for k in sorted(sample))

    _beams(pack(), docs, as_key=as_key)


def test_keyed_shuffle_runs_on_beam_with_its_own_seed() -> None:
    # Called by Beam directly, zf.SeedParam resolves to Shuffle(seed=...); each element's
    # timestamp is its position, as the deterministic runner gives it.
    inputs = list(range(40))
    ours = _ours(ops.Shuffle(buffer=6), inputs)  # _ours runs it with seed 0
    assert sorted(ours) == inputs and ours != inputs

    def positioned(_: Any) -> list[Any]:
        return [TimestampedValue((0, v), i) for i, v in enumerate(inputs)]

    with beam.Pipeline(runner=FnApiRunner()) as p:
        out = p | beam.Create([None]) | beam.FlatMap(positioned) | beam.ParDo(ops.Shuffle(buffer=6, seed=0))
        assert_that(out, equal_to(ours))


def test_a_seed_param_without_a_seed_is_refused_on_beam() -> None:
    refused = r"Shuffle: zf.SeedParam has no seed on this runner .*construct it with seed=<int>, or run the pipeline through zephon materialize"
    with pytest.raises(zf.SpecError, match=refused), beam.Pipeline(runner=FnApiRunner()) as p:
        _ = p | beam.Create([(0, 1)] * 3) | beam.ParDo(ops.Shuffle(buffer=1))
    with pytest.raises(zf.SpecError, match="Shuffle: seed must be an integer or None, got '7'"):
        ops.Shuffle(buffer=2, seed="7")  # type: ignore[arg-type]


def _words(text: str) -> list[str]:
    return text.split()


def _short(word: str) -> bool:
    return len(word) <= 4


def _upper_all(words: list[str]) -> list[str]:
    return [w.upper() for w in words]


def test_map_filter_flat_map_and_tokenize_run_on_beam_through_process(corpus: Corpus) -> None:
    # Each defines zephon-flow's process_batch (one output list per element); Beam must still
    # accept them and call process, giving what our front segment gives.
    texts = ["the quick brown fox", "jumps over", "", "the lazy dog alpha omega"]
    steps = [
        ops.FlatMap(_words),
        ops.Filter(_short),
        ops.Map(_upper_all, batched=True),
        ops.Map(str.lower),
        ops.Tokenize(corpus.tokenizer_json),
    ]
    values: list[Any] = list(texts)
    for i, dofn in enumerate(steps):
        outputs = StatelessInvoker(f"step {i}", dofn).call_batch(values)
        values = [out for outs in outputs for out in outs]
    assert 0 < len(values) < sum(len(t.split()) for t in texts)

    with beam.Pipeline(runner=FnApiRunner()) as p:
        pcoll = p | beam.Create(texts)
        for i, dofn in enumerate(steps):
            pcoll = pcoll | f"step {i}" >> beam.ParDo(dofn)
        assert_that(
            pcoll | beam.Map(lambda a: tuple(a.tolist())), equal_to([tuple(v.tolist()) for v in values])
        )
