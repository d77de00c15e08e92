"""Every record exactly once per pass, whatever the file layout, lane count, world size and resume."""

from __future__ import annotations

import collections
import gzip
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.engine.simulate import global_batches
from zephon_flow.runners.dealing import Dealing, Share


class DocNumber(beam.DoFn):  # type: ignore[misc]
    """``"123 words..."`` -> ``{"doc": 123}``: a fixed-shape sample naming its document.

    It declares its padding sample, as the README asks of a pipeline's last operator when a lane
    may end without ever making a sample (tiny data, many lanes)."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        yield {"doc": np.int64(int(text.split()[0]))}

    def padding_sample(self) -> dict[str, Any]:
        return {"doc": np.int64(-1)}


def _texts(first: int, n: int) -> list[str]:
    return [f"{first + i} " + "lorem ipsum " * (1 + (first + i) % 7) for i in range(n)]


def write_file(root: Path, index: int, kind: str, n_docs: int) -> list[int]:
    """Writes file ``index`` of ``kind`` holding ``n_docs`` documents; returns their numbers."""
    first = index * 100_000
    texts = _texts(first, n_docs)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode() or b"\n"
    stem = root / f"part-{index:03d}"
    if kind == "jsonl":
        stem.with_suffix(".jsonl").write_bytes(lines)
    elif kind == "gz":
        stem.with_suffix(".jsonl.gz").write_bytes(gzip.compress(lines))
    elif kind == "zst":
        stem.with_suffix(".jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif kind == "parquet":
        pq.write_table(
            pa.table({"text": pa.array(texts, pa.string())}), stem.with_suffix(".parquet"), row_group_size=64
        )
    elif kind == "arrow":
        table = pa.table({"text": pa.array(texts, pa.string())})
        with ipc.new_file(str(stem.with_suffix(".arrow")), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=50):
                writer.write_batch(batch)
    else:
        raise AssertionError(kind)
    return [first + i for i in range(n_docs)]


def doc_spec(pattern: str, kind: str, *, lanes: int, batch: int, epochs: int | None) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        if kind in ("parquet", "arrow"):
            read = ops.ReadParquet if kind == "parquet" else ops.ReadArrow
            docs = p | "src" >> read(pattern, column="text", epochs=epochs)
        else:
            docs = p | "src" >> ops.ReadJsonl(pattern, epochs=epochs)
        return docs | "num" >> beam.ParDo(DocNumber())

    return zf.LoaderSpec(build, lanes=lanes, seed=7, global_batch_size=batch)


def delivered(spec: zf.LoaderSpec, *, steps: int = 10**6, **options: Any) -> tuple[list[int], list[str]]:
    """The document numbers of every real row, in order, and each global batch's digest."""
    docs: list[int] = []
    digests: list[str] = []
    for _, batch in global_batches(spec, steps=steps, **options):
        valid = batch["valid"] if "valid" in batch else np.ones(len(batch["doc"]), dtype=bool)
        docs += batch["doc"][valid].tolist()
        digests.append(zf.batch_digest(batch))
    return docs, digests


# -- the dealing -------------------------------------------------------------------------------------
@given(
    costs=st.lists(st.integers(1, 10_000), min_size=1, max_size=60),
    lanes=st.integers(1, 64),
    epoch=st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_the_dealing_gives_each_record_of_a_pass_to_exactly_one_lane(
    costs: list[int], lanes: int, epoch: int
) -> None:
    dealing = Dealing(costs, lanes=lanes, seed=3, source="src")
    got: collections.Counter[tuple[int, int]] = collections.Counter()
    for lane in range(lanes):
        shares = dealing.shares(lane, epoch)
        assert shares, f"lane {lane} has no share"
        for share in shares:
            for record in range(12):  # every split holds 12 records here
                if share.keeps(record):
                    got[share.split, record] += 1
    assert got == {(s, r): 1 for s in range(len(costs)) for r in range(12)}


def test_fine_splits_keep_every_lane_within_a_quarter_of_the_mean() -> None:
    rng = np.random.default_rng(0)
    for lanes in (2, 16, 64):
        costs = rng.integers(500, 1500, size=8 * lanes).tolist()
        for epoch in range(3):
            loads = Dealing(costs, lanes=lanes, seed=1, source="s").lane_costs(epoch)
            assert max(loads) <= 1.25 * float(np.mean(loads)), (lanes, epoch)


def test_a_split_heavier_than_a_share_is_shared_by_stride() -> None:
    dealing = Dealing([1000], lanes=4, seed=0, source="s")
    assert [dealing.shares(lane, 0) for lane in range(4)] == [(Share(0, 4, j),) for j in range(4)]


# -- the reproductions -----------------------------------------------------------------------
def test_one_plain_file_read_by_two_lanes_repeats_nothing_within_a_pass(tmp_path: Path) -> None:
    docs = write_file(tmp_path, 0, "jsonl", 300)
    spec = doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=2, batch=4, epochs=None)
    got, _ = delivered(spec, steps=50)  # 200 of 300 documents: all different
    assert len(got) == 200 and len(set(got)) == 200 and set(got) <= set(docs)


@pytest.mark.parametrize("epochs", [1, None])
def test_three_files_and_sixteen_lanes_deliver_a_pass_without_repeats(
    tmp_path: Path, epochs: int | None
) -> None:
    docs = write_file(tmp_path, 0, "gz", 2000) + write_file(tmp_path, 1, "zst", 2000)
    docs += write_file(tmp_path, 2, "jsonl", 2000)
    spec = doc_spec(str(tmp_path / "part-*"), "jsonl", lanes=16, batch=32, epochs=epochs)
    if epochs == 1:
        got, _ = delivered(spec, world_size=2)
        assert sorted(got) == sorted(docs)
    else:
        got, _ = delivered(spec, steps=len(docs) * 3 // 4 // 32)
        assert len(set(got)) == len(got)


def test_one_file_and_sixty_four_lanes_deliver_every_document_once(tmp_path: Path) -> None:
    docs = write_file(tmp_path, 0, "jsonl", 500)
    spec = doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=64, batch=128, epochs=1)
    one, digests = delivered(spec)
    assert sorted(one) == docs
    four, digests4 = delivered(spec, world_size=4)
    assert four == one and digests4 == digests


def test_two_passes_deliver_every_document_exactly_twice(tmp_path: Path) -> None:
    docs = write_file(tmp_path, 0, "gz", 150) + write_file(tmp_path, 1, "jsonl", 40)
    spec = doc_spec(str(tmp_path / "part-*"), "jsonl", lanes=8, batch=16, epochs=2)
    got, _ = delivered(spec)
    assert collections.Counter(got) == dict.fromkeys(docs, 2)


def test_every_rank_yields_the_same_number_of_steps_and_the_tail_is_padding(tmp_path: Path) -> None:
    write_file(tmp_path, 0, "jsonl", 97)
    spec = doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=4, batch=8, epochs=1)
    sync = zf.ThreadEndSync(2)
    loaders = [zf.Loader(spec, rank=r, world_size=2, end_sync=sync) for r in range(2)]
    results: dict[int, list[tuple[int, dict[str, np.ndarray]]]] = {}

    def consume(rank: int) -> None:  # ranks run side by side, as in training
        results[rank] = list(loaders[rank])

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for loader in loaders:
            loader.close()
    counts = [len(results[r]) for r in range(2)]
    tails = [results[r][-1][1]["valid"] for r in range(2)]
    assert counts[0] == counts[1] > 0
    assert sum(int(t.sum()) for t in tails) < 8  # the last global batch is incomplete


class Unpadded(beam.DoFn):  # type: ignore[misc]
    """Like ``DocNumber``, without a declared padding sample."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        yield {"doc": np.int64(int(text.split()[0]))}


def test_padding_without_any_sample_to_copy_names_the_lane_and_the_fix(tmp_path: Path) -> None:
    write_file(tmp_path, 0, "jsonl", 1)  # one document: the other lane never makes a sample

    def build(p: beam.Pipeline) -> beam.PCollection:
        return (
            p | "src" >> ops.ReadJsonl(str(tmp_path / "*.jsonl"), epochs=1) | "num" >> beam.ParDo(Unpadded())
        )

    spec = zf.LoaderSpec(build, lanes=2, seed=7, global_batch_size=2)
    with pytest.raises(
        zf.ZephonError, match=r"lane \d must be padded .* no sample shows the layout .*padding_sample\(\)"
    ):
        list(global_batches(spec, steps=10, world_size=2))
    # On one rank the other lane's sample shows the layout: zeros of it pad.
    (only,) = [b for _, b in global_batches(spec, steps=10)]
    assert only["valid"].tolist().count(True) == 1 and sorted(only["doc"].tolist()) == [0, 0]


def test_a_finite_pass_on_several_ranks_needs_a_way_to_agree_on_its_end(tmp_path: Path) -> None:
    write_file(tmp_path, 0, "jsonl", 20)
    spec = doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=4, batch=8, epochs=1)
    with pytest.raises(zf.SpecError, match="ranks must agree on its last step"):
        zf.Loader(spec, rank=0, world_size=2)


# -- any layout, any topology ------------------------------------------------------------------------
KINDS = ["jsonl", "gz", "zst", "parquet", "arrow"]


@given(
    kind=st.sampled_from(KINDS),
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=40),
    lanes=st.sampled_from([1, 2, 3, 4, 8, 16, 64]),
    epochs=st.sampled_from([1, 2]),
    world=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_layout_delivers_each_record_once_per_pass_at_any_world_size_and_resume(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    sizes: Sequence[int],
    lanes: int,
    epochs: int,
    world: int,
    data: st.DataObject,
) -> None:
    root = tmp_path_factory.mktemp("layout")
    if kind != "jsonl" and not any(sizes):
        sizes = [*sizes[:-1], 1]
    docs = [d for i, n in enumerate(sizes) for d in write_file(root, i, kind, n)]
    if not docs:
        docs = write_file(root, len(sizes), kind, 1)
    batch = lanes * 2
    world = world if batch % world == 0 else 1
    spec = doc_spec(str(root / "part-*"), kind, lanes=lanes, batch=batch, epochs=epochs)
    reference, digests = delivered(spec)
    assert collections.Counter(reference) == dict.fromkeys(docs, epochs)
    # Another world size, stopped at a random step and resumed from the merged state.
    cut = data.draw(st.integers(0, len(digests)), label="cut")
    final: list[dict[str, Any]] = []
    first = list(global_batches(spec, steps=cut, world_size=world, final_state=final))
    rest = list(
        global_batches(
            spec, steps=10**6, state=zf.encode_state(zf.LoaderState.from_plain(final[0])), world_size=1
        )
    )
    assert [zf.batch_digest(b) for _, b in first + rest] == digests


# -- visible progress and balance --------------------------------------------------------------------
def test_inspect_splits_prints_each_sources_plan_and_each_lanes_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_file(tmp_path, 0, "jsonl", 400)
    pipeline = tmp_path / "pipe.py"
    pipeline.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_exactly_once import doc_spec\n"
        f"spec = doc_spec({str(tmp_path / '*.jsonl')!r}, 'jsonl', lanes=4, batch=8, epochs=None)\n"
    )
    spec = doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=4, batch=8, epochs=None)
    with zf.Loader(spec) as loader:
        for step, _ in loader:
            if step == 30:
                break
        state = loader.state()
    zf.save_state(state, tmp_path / "s.zfstate")
    from zephon_flow.cli import main

    assert main(["inspect", f"{pipeline}:spec", "--splits", "--state", str(tmp_path / "s.zfstate")]) == 0
    out = capsys.readouterr().out
    assert "source 'src' (ReadJsonl('src')):" in out and "per-lane share of a pass (4 lanes): min" in out
    for lane in range(4):
        assert f"lane {lane}: pass 0," in out
    from zephon_flow.engine.splitreport import split_report

    (src,) = split_report(spec, state)
    assert src.share_max <= 1.25 * src.share_mean or src.shared_splits
    assert [p.lane for p in src.positions] == [0, 1, 2, 3]
