"""Tests of Mix schedules, source exhaustion (stop / renormalize) and mixture changes on resume."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from checkpointing import assert_equal_output_after_checkpoint
from helpers import CODE, WEB, DocKey, run_batches, tagged_texts, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import CorruptStateError, FingerprintMismatchError, SpecError, StateConflictError
from zephon_flow.engine.simulate import global_digests


class Triple(beam.DoFn):  # type: ignore[misc]
    """``"web 17 ..."`` -> three samples of document 17: records whose outputs span windows."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        for sample in DocKey().process(text):
            for part in range(3):
                yield {**sample, "part": np.int64(part)}


def spec_of(
    web: str,
    code: str,
    *,
    lanes: int = 2,
    batch: int = 8,
    web_epochs: int | None = None,
    code_epochs: int | None = None,
    fn: beam.DoFn | None = None,
    **mix: Any,
) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        w = p | "web" >> ops.ReadJsonl(web, split_bytes=200, epochs=web_epochs)
        c = p | "code" >> ops.ReadJsonl(code, split_bytes=200, epochs=code_epochs)
        return (w, c) | "mix" >> ops.Mix(**mix) | "key" >> beam.ParDo(fn or DocKey())

    return zf.LoaderSpec(build, lanes=lanes, seed=5, global_batch_size=batch)


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    web = write_jsonl(tmp_path / "web.jsonl", tagged_texts("web", 30, seed=1, max_words=8))
    code = write_jsonl(tmp_path / "code.jsonl", tagged_texts("code", 20, seed=2, max_words=8))
    return web, code


def web_share(batches: Sequence[dict[str, np.ndarray]]) -> float:
    src = np.concatenate([b["src"] for b in batches])
    return float(np.mean(src == WEB))


# -- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"Mix: give either weights=\[...\] or schedule="),
        ({"weights": [1], "schedule": [(0, [1])]}, r"Mix: give either weights"),
        ({"schedule": []}, r"Mix: schedule needs at least one \(step, weights\) point"),
        (
            {"schedule": [(5, [1, 1])]},
            r"Mix: schedule steps must start at 0 and strictly increase, got \[5\]",
        ),
        (
            {"schedule": [(0, [1, 1]), (10, [1, 2]), (10, [2, 1])]},
            r"strictly increase, got \[0, 10, 10\]",
        ),
        ({"schedule": [(0, [1, 1]), (1.5, [1, 2])]}, r"Mix: schedule steps must be integers"),
        ({"schedule": [(0, [1, 1]), (9, [1, 2, 3])]}, r"as many weights, got lengths \[2, 3\]"),
        (
            {"schedule": [(0, [1, 1]), (9, [0, 0])]},
            r"Mix: schedule weights at step 9 must be non-negative, finite and not all zero",
        ),
        ({"schedule": [(0, [1, float("nan")])]}, r"schedule weights at step 0 must be non-negative"),
        ({"schedule": 3}, r"Mix: schedule must be a list of \(step, weights\) pairs"),
        ({"weights": [1, 1], "interpolation": "cubic"}, r"Mix: interpolation must be one of"),
        (
            {"weights": [1, 1], "exhausted": "ignore"},
            r"Mix: exhausted must be one of \('stop', 'renormalize'\)",
        ),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ops.Mix(**kwargs)


def test_a_schedule_for_another_number_of_inputs_is_refused(files: tuple[str, str]) -> None:
    with pytest.raises(SpecError, match=r"Mix: 3 weights for 2 inputs"):
        zf.Loader(spec_of(*files, schedule=[(0, [1, 1, 1])]))


def test_weights_at_constant_and_linear() -> None:
    points = [(0, [3.0, 1.0]), (10, [1.0, 1.0]), (30, [0.0, 2.0])]
    constant = ops.Mix(schedule=points)
    assert constant.weights_at(0) == pytest.approx([0.75, 0.25])
    assert constant.weights_at(9) == pytest.approx([0.75, 0.25])
    assert constant.weights_at(10) == pytest.approx([0.5, 0.5])
    assert constant.weights_at(10_000) == pytest.approx([0.0, 1.0])
    linear = ops.Mix(schedule=points, interpolation="linear")
    assert linear.weights_at(5) == pytest.approx([0.625, 0.375])
    assert linear.weights_at(20) == pytest.approx([0.25, 0.75])
    assert linear.weights_at(30) == pytest.approx([0.0, 1.0])
    assert linear.weights_at(99) == pytest.approx([0.0, 1.0])


# -- proportions follow the schedule -----------------------------------------------------------
def test_a_constant_schedule_switches_proportions_at_its_step(files: tuple[str, str]) -> None:
    spec = spec_of(*files, schedule=[(0, [0.9, 0.1]), (25, [0.1, 0.9])])
    batches = run_batches(spec, 50)
    # 200 records per range: one standard deviation of the share is about 0.02.
    assert web_share(batches[:25]) == pytest.approx(0.9, abs=0.08)
    assert web_share(batches[25:]) == pytest.approx(0.1, abs=0.08)


def test_a_linear_schedule_moves_proportions_step_by_step(files: tuple[str, str]) -> None:
    spec = spec_of(*files, schedule=[(0, [1, 0]), (40, [0, 1])], interpolation="linear")
    batches = run_batches(spec, 48)
    assert web_share(batches[:1]) == 1.0  # weight 0 for code at step 0
    assert web_share(batches[40:]) == 0.0  # and for web from step 40 on
    # Expected shares 1 - s/40 averaged over the range: 0.8875, 0.5125 and 0.1125.
    assert web_share(batches[:10]) == pytest.approx(0.8875, abs=0.12)
    assert web_share(batches[15:25]) == pytest.approx(0.5125, abs=0.15)
    assert web_share(batches[30:40]) == pytest.approx(0.1125, abs=0.12)


# -- determinism ---------------------------------------------------------------------------
def test_a_schedule_is_elastic_and_resumes_at_every_step(files: tuple[str, str]) -> None:
    # Three outputs per record and windows of four: records straddle windows (the third
    # record drawn, at step 1, ends in window 2), and the switch from all-web to all-code at
    # step 2 means a resume that re-drew a straddling record would take it from the wrong source.
    spec = spec_of(*files, schedule=[(0, [1, 0]), (2, [0, 1]), (6, [1, 1])], fn=Triple())
    ref = assert_equal_output_after_checkpoint(spec, 10)
    states = [zf.decode_state(s).to_plain() for s in ref.states]
    assert any(
        ls["cursor"]["skip"] > 0 and ls["cursor"]["source"] == WEB for s in states for ls in s["lane_states"]
    )
    # The record straddling into window 2 still comes from web; then code only.
    assert [int(s) for s in ref.batches[2]["src"]] == [WEB, CODE, CODE, CODE] * 2
    assert {int(s) for b in ref.batches[3:6] for s in b["src"]} == {CODE}
    assert global_digests(spec, steps=10, world_size=4, backend="threads", workers=2) == ref.digests
    assert global_digests(spec, steps=10, world_size=2, chunk_records=1, prefetch_chunks=1) == ref.digests


# -- running out ---------------------------------------------------------------------------
def test_stop_ends_the_lane_when_a_source_runs_out(files: tuple[str, str]) -> None:
    spec = spec_of(*files, lanes=1, batch=2, weights=[0.5, 0.5], web_epochs=1)
    batches = run_batches(spec, 200)
    docs = [
        int(d)
        for b in batches
        for s, d, v in zip(b["src"], b["doc"], b["valid"], strict=True)
        if v and s == WEB
    ]
    assert len(batches) < 200  # the loader ended
    assert len(docs) == len(set(docs))  # one epoch of web: no document twice


def test_renormalize_drops_the_source_and_records_it(files: tuple[str, str]) -> None:
    spec = spec_of(*files, lanes=1, batch=2, weights=[0.5, 0.5], web_epochs=1, exhausted="renormalize")
    with zf.Loader(spec) as loader:
        batches = [b for _, (_, b) in zip(range(60), loader, strict=False)]
        state = loader.state_dict()
    assert len(batches) == 60
    web = sorted(int(d) for b in batches for s, d in zip(b["src"], b["doc"], strict=True) if s == WEB)
    assert web == list(range(30))  # every web document exactly once
    tail = [int(s) for b in batches[-10:] for s in b["src"]]
    assert tail == [CODE] * 20
    assert state["lane_states"][0]["cursor"]["exhausted"] == [WEB]


def test_renormalize_ends_the_lane_when_every_source_ran_out(files: tuple[str, str]) -> None:
    spec = spec_of(
        *files, lanes=1, batch=2, weights=[0.3, 0.7], web_epochs=1, code_epochs=2, exhausted="renormalize"
    )
    batches = run_batches(spec)
    pairs = [(int(s), int(d)) for b in batches for s, d in zip(b["src"], b["doc"], strict=True)]
    assert len(pairs) == 30 + 2 * 20
    assert sorted(d for s, d in pairs if s == WEB) == list(range(30))
    assert sorted(d for s, d in pairs if s == CODE) == sorted(list(range(20)) * 2)


def test_renormalize_is_elastic_across_resume_points(files: tuple[str, str]) -> None:
    spec = spec_of(*files, lanes=2, batch=4, weights=[0.6, 0.4], web_epochs=1, exhausted="renormalize")
    ref = assert_equal_output_after_checkpoint(spec, 24, world_size=2, backend="threads", workers=2)
    final = ref.final_state
    assert all(ls["cursor"]["exhausted"] == [WEB] for ls in final["lane_states"])
    assert global_digests(spec, steps=24) == ref.digests


# -- changing the mixture on resume ----------------------------------------------------------
def run_from(spec: zf.LoaderSpec, state: Any, steps: int, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """``steps`` batches and the state after each, resumed from ``state``."""
    batches, states = [], []
    with zf.Loader(spec, state=state, **kwargs) as loader:
        for _, (_, batch) in zip(range(steps), loader, strict=False):
            batches.append(batch)
            states.append(loader.state_dict())
    return batches, states


def test_a_mixture_change_on_resume_is_refused_without_the_flag(files: tuple[str, str]) -> None:
    old = spec_of(*files, weights=[0.5, 0.5])
    _, states = run_from(old, None, 3)
    new = spec_of(*files, weights=[0.0, 1.0])
    with pytest.raises(
        FingerprintMismatchError,
        match=r"differ: operator mix; if only the Mix's weights, schedule or interpolation changed, pass "
        r"allow_mix_change=True to zf.Loader to use the new mixture from step 3 on",
    ):
        zf.Loader(new, state=states[-1])
    other = spec_of(*files, weights=[0.5, 0.5], exhausted="renormalize")
    with pytest.raises(FingerprintMismatchError, match=r"Mix: exhausted='renormalize' differs"):
        zf.Loader(other, state=states[-1], allow_mix_change=True)


def test_a_mixture_change_on_resume_is_recorded_and_replayed(files: tuple[str, str]) -> None:
    old = spec_of(*files, weights=[0.5, 0.5], fn=Triple())
    _, old_states = run_from(old, None, 3)
    new = spec_of(*files, schedule=[(0, [1.0, 0.0]), (6, [0.0, 1.0])], fn=Triple())
    changed, states = run_from(new, old_states[-1], 9, allow_mix_change=True)
    # Buffered outputs are kept: what the old run left pending comes first, then web only
    # until step 6, then code only (records straddling a window keep their source).
    src = [[int(s) for s in b["src"]] for b in changed]
    assert all(s == WEB for b in src[1:3] for s in b)
    assert all(s == CODE for b in src[5:] for s in b)
    history = states[-1]["mix_history"]
    assert [step for step, _ in history] == [0, 3]
    assert history[1][1]["schedule"] == [[0, [1.0, 0.0]], [6, [0.0, 1.0]]]
    assert states[-1]["fingerprint"] == new.fingerprint
    # A resume from a later checkpoint replays the change (no flag needed: same spec).
    for k in (0, 2, 5):
        replay, _ = run_from(new, states[k], 8 - k)
        assert [zf.batch_digest(b) for b in replay] == [zf.batch_digest(b) for b in changed[k + 1 :]]
    # The same schedule from a fresh start is another run.
    fresh, fresh_states = run_from(new, None, 6)
    assert [zf.batch_digest(b) for b in fresh[3:6]] != [zf.batch_digest(b) for b in changed[:3]]
    with pytest.raises(StateConflictError, match=r"states disagree about the mixture history"):
        zf.merge_states([fresh_states[5], states[2]])


def test_a_damaged_mixture_history_is_a_corrupt_checkpoint(files: tuple[str, str]) -> None:
    spec = spec_of(*files, weights=[0.5, 0.5])
    _, states = run_from(spec, None, 2)
    assert states[-1]["mix_history"] == [[0, spec.compile().mixer.params()]]  # type: ignore[union-attr]
    late = {**states[-1], "mix_history": [[1, states[-1]["mix_history"][0][1]]]}
    with pytest.raises(CorruptStateError, match=r"mix_history .* does not start at step 0"):
        zf.Loader(spec, state=late)
    missing = {k: v for k, v in states[-1].items() if k != "mix_history"}
    with pytest.raises(CorruptStateError, match=r"checkpoint is missing 'mix_history'"):
        zf.Loader(spec, state=missing)
    with pytest.raises(SpecError, match=r"allow_mix_change must be True or False, got 'yes'"):
        zf.Loader(spec, allow_mix_change="yes")  # type: ignore[arg-type]
