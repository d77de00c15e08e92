"""Tests of on_error="skip": bad records are dropped the same way on every topology, and counted."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from checkpointing import assert_equal_output_after_checkpoint
from helpers import DocKey, run_batches, tagged_texts

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, StageError
from zephon_flow.engine.simulate import global_digests

BAD = {5: "{not json", 11: '{"text": "web 11 ok"', 17: "[1, 2]", 23: '"just a string"'}


def write_with_bad_lines(path: Path, n: int = 30) -> str:
    """``n`` lines of ``{"text": "web i ..."}`` with the lines in ``BAD`` replaced by broken ones."""
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(tagged_texts("web", n, seed=3, max_words=6)):
            f.write((BAD[i] if i in BAD else json.dumps({"text": text})) + "\n")
    return str(path)


class Explode(beam.DoFn):  # type: ignore[misc]
    """A bug in a stateless DoFn: not a DataError, so never skipped."""

    def process(self, text: str) -> Iterator[str]:
        if " 7 " in f" {text} ":
            raise ZeroDivisionError("a bug")
        yield text


def skip_spec(
    jsonl: str,
    *,
    on_error: str = "skip",
    lanes: int = 2,
    batch: int = 4,
    epochs: int | None = None,
    extra: beam.DoFn | None = None,
    code: str | None = None,
) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "web" >> ops.ReadJsonl(jsonl, split_bytes=120, epochs=epochs, on_error=on_error)
        if extra is not None:
            docs = docs | "extra" >> beam.ParDo(extra)
        if code is not None:
            other = p | "code" >> ops.ReadJsonl(code, split_bytes=120)
            docs = (docs, other) | "mix" >> ops.Mix(weights=[0.5, 0.5])
        return docs | "key" >> beam.ParDo(DocKey())

    return zf.LoaderSpec(build, lanes=lanes, seed=2, global_batch_size=batch)


@pytest.fixture
def bad_jsonl(tmp_path: Path) -> str:
    return write_with_bad_lines(tmp_path / "web.jsonl")


def docs_of(batches: list[dict[str, np.ndarray]]) -> list[int]:
    return [int(d) for b in batches for d in b["doc"]]


def test_bad_lines_raise_by_default_naming_file_offset_and_operator(bad_jsonl: str) -> None:
    lines = Path(bad_jsonl).read_text().splitlines(keepends=True)
    offsets = [sum(len(line) for line in lines[:i]) for i in BAD]
    with pytest.raises(DataError) as info:
        run_batches(skip_spec(bad_jsonl, on_error="raise", lanes=1, batch=1))
    message = str(info.value)
    assert message.startswith("ReadJsonl('web'): ")
    assert any(f"{bad_jsonl} at byte {offset}" in message for offset in offsets), message


def test_skipped_lines_are_counted_exactly_and_never_delivered(
    bad_jsonl: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = skip_spec(bad_jsonl, lanes=1, batch=1, epochs=2)
    with caplog.at_level(logging.WARNING, logger="zephon_flow"), zf.Loader(spec) as loader:
        batches = [b for _, b in loader]
        assert loader.skipped() == {"web": 2 * len(BAD)}
    assert sorted(docs_of(batches)) == sorted([i for i in range(30) if i not in BAD] * 2)
    warnings = [r.getMessage() for r in caplog.records if r.name == "zephon_flow"]
    assert len(warnings) == 1  # once per source per loader, with the first message
    assert "source 'web' has on_error='skip'" in warnings[0] and bad_jsonl in warnings[0]


def test_skips_are_the_same_on_every_topology_and_resume_point(bad_jsonl: str, tmp_path: Path) -> None:
    code = str(tmp_path / "code.jsonl")
    Path(code).write_text("".join(json.dumps({"text": t}) + "\n" for t in tagged_texts("code", 9, seed=4)))
    spec = skip_spec(bad_jsonl, lanes=2, batch=4, code=code)
    ref = assert_equal_output_after_checkpoint(spec, 16)
    counts = [
        sum(ls["cursor"]["skipped"][0] for ls in zf.decode_state(s).to_plain()["lane_states"])
        for s in ref.states
    ]
    assert counts == sorted(counts) and counts[-1] >= len(BAD)  # more than one epoch of web read
    for options in (
        {"world_size": 2, "backend": "threads", "workers": 2},
        {"world_size": 4, "chunk_records": 1, "prefetch_chunks": 1},
        {"world_size": 1, "backend": "processes", "workers": 2},
    ):
        final: list[dict[str, Any]] = []
        assert global_digests(spec, steps=16, final_state=final, **options) == ref.digests
        assert final[0] == ref.final_state


def test_skip_counts_survive_a_resume_exactly(bad_jsonl: str) -> None:
    spec = skip_spec(bad_jsonl, lanes=2, batch=2)
    with zf.Loader(spec) as whole:
        for _ in zip(range(24), whole, strict=False):
            pass
        expected = whole.skipped()
    assert expected["web"] > len(BAD)  # several epochs, both lanes
    with zf.Loader(spec, world_size=2, rank=0) as first, zf.Loader(spec, world_size=2, rank=1) as second:
        for _ in zip(range(9), first, second, strict=False):
            pass
        state = zf.merge_states([first.state_dict(), second.state_dict()])
        halfway = first.skipped()["web"] + second.skipped()["web"]
    assert 0 < halfway < expected["web"]
    with zf.Loader(spec, state=state) as rest:
        assert rest.skipped() == {"web": halfway}
        for _ in zip(range(24 - 9), rest, strict=False):
            pass
        assert rest.skipped() == expected


def test_a_bug_in_a_stateless_dofn_still_raises(bad_jsonl: str) -> None:
    with pytest.raises(StageError, match=r"DoFn 'extra' raised ZeroDivisionError: a bug"):
        run_batches(skip_spec(bad_jsonl, lanes=1, batch=1, extra=Explode()))


def test_a_read_error_skips_the_rest_of_its_split(tmp_path: Path) -> None:
    lines = [json.dumps({"text": t}) + "\n" for t in tagged_texts("web", 400, seed=5, max_words=6)]
    data = gzip.compress("".join(lines).encode())
    truncated = tmp_path / "web.jsonl.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"ReadJsonl\('web'\): cannot read {truncated}"):
        run_batches(skip_spec(str(truncated), on_error="raise", lanes=1, batch=1))
    spec = skip_spec(str(truncated), lanes=1, batch=1, epochs=3)
    with zf.Loader(spec) as loader:
        docs = [int(b["doc"][0]) for _, b in loader]
        # The rest of the one split, once per epoch; the state is the one after the last
        # batch, so the third epoch's skip (after its last document) is not in it.
        assert loader.skipped() == {"web": 2}
    third = len(docs) // 3
    assert 0 < third < 400 and docs == list(range(third)) * 3


def test_a_lane_that_drops_record_after_record_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every record bad: on an endless stream the lane would read pass after pass, dropping them,
    # with one warning at the first; it now warns again at DRY_WARN records in a row, then at
    # each doubling. (A finite stream here, 3 passes of 40 bad lines, so that it ends.)
    monkeypatch.setattr("zephon_flow.runners.lane.DRY_WARN", 16)
    path = tmp_path / "bad.jsonl"
    path.write_text("{not json\n" * 40)
    spec = skip_spec(str(path), lanes=1, batch=1, epochs=3)
    with caplog.at_level(logging.WARNING, logger="zephon_flow"), zf.Loader(spec) as loader:
        assert [b for _, b in loader] == []
    dry = [r.getMessage() for r in caplog.records if "without delivering one" in r.getMessage()]
    assert [m.split(" records")[0] for m in dry] == [f"lane 0 has dropped its last {n}" for n in (16, 32, 64)]
    assert "is every record bad? (source 0, pass 1; the last: ReadJsonl('web'): malformed JSON" in dry[2], (
        dry[2]
    )
