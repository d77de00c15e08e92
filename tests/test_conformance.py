"""The conformance suite: the same pipelines on every execution mode, digest for digest.

Each pipeline runs on the deterministic runner's backends (inline, threads, processes) and,
translated (``runners/beam``), on Beam's ``FnApiRunner`` through ``zephon materialize``'s
Parquet; every mode must give the same global batches as the embedded inline ``Loader``.
A mode is one entry of ``MODES`` (name -> function of the spec, the number of steps and a
scratch folder, returning the digests): adding a runner (Ray, lane owners) is one line.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import BagStateSpec, TimeDomain, TimerSpec, on_timer
from apache_beam.utils.timestamp import MAX_TIMESTAMP, Duration
from bundle_dofns import BufferedLengths, Doubled, RunningTotal
from helpers import Corpus, DocKey, run_batches, tagged_texts, write_jsonl
from vlm_helpers import vlm_spec, write_captioned_images

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.engine.materialize import materialize, read_materialized

Digests = list[str]
#: (spec, steps wanted, scratch folder) -> digests of global batches 0.. (fewer if the input ends).
Mode = Callable[[zf.LoaderSpec, int, Path], Digests]


def _loader(backend: str, workers: int = 1) -> Mode:
    def run(spec: zf.LoaderSpec, steps: int, tmp: Path) -> Digests:
        return [batch_digest(b) for b in run_batches(spec, steps, backend=backend, workers=workers)]

    return run


def _beam(runner: str, *beam_args: str) -> Mode:
    def run(spec: zf.LoaderSpec, steps: int, tmp: Path) -> Digests:
        out = tmp / f"beam-{runner}"
        with _importable_tests():
            materialize(spec, steps=steps, out=str(out), runner=runner, beam_args=beam_args, passes=PASSES)
        return [batch_digest(b) for _, b in read_materialized(str(out))]

    return run


@contextlib.contextmanager
def _importable_tests() -> Iterator[None]:
    """Beam's worker processes (multi-process mode) import this suite's DoFns by module name."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), before or ""])
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


#: Passes of endless sources the Beam modes read: more than the steps below need.
PASSES = 6


def _owners(owners: int, world_size: int) -> Mode:
    """Lanes on ``owners`` Ray lane owners, read by ``world_size`` ranks in step (as trainers
    would), their rows put back together into global batches."""

    def run(spec: zf.LoaderSpec, steps: int, tmp: Path) -> Digests:
        from zephon_flow.cluster import OwnedLoader

        out: Digests = []
        with contextlib.ExitStack() as stack:
            loaders = [
                stack.enter_context(OwnedLoader(spec, lane_owners=owners, rank=r, world_size=world_size))
                for r in range(world_size)
            ]
            iters = [iter(ld) for ld in loaders]
            for _ in range(steps):
                parts = [next(it, None) for it in iters]
                if parts[0] is None:
                    assert all(p is None for p in parts), "ranks disagree on the end"
                    break
                batches = [p[1] for p in parts if p is not None]
                out.append(batch_digest({k: np.concatenate([b[k] for b in batches]) for k in batches[0]}))
        return out

    return run


MODES: dict[str, Mode] = {
    "inline": _loader("inline"),
    "threads": _loader("threads", workers=2),
    "processes": _loader("processes", workers=2),
    "ray": _loader("ray", workers=2),
    "lane owners x2, 2 ranks": _owners(2, world_size=2),
    "beam FnApiRunner": _beam("FnApiRunner"),
    "beam FnApiRunner x2 processes": _beam(
        "FnApiRunner", "--direct_num_workers=2", "--direct_running_mode=multi_processing"
    ),
}
#: Modes that take long (Beam starts its worker processes: about 8 s a run): marked slow.
SLOW_MODES = {"beam FnApiRunner x2 processes"}


# -- the pipelines -------------------------------------------------------------------------


class GroupOfThree(beam.DoFn):  # type: ignore[misc]
    """A user's stateful DoFn with timers: holds samples and releases them, newest first, by an
    event-time timer three positions after the first of a group; the rest at the input's end."""

    HELD = BagStateSpec("held", PickleCoder())
    GROUP = TimerSpec("group", TimeDomain.WATERMARK)
    END = TimerSpec("end", TimeDomain.WATERMARK)

    def process(
        self,
        element: tuple[int, dict[str, Any]],
        position: Any = beam.DoFn.TimestampParam,
        held: Any = beam.DoFn.StateParam(HELD),
        group: Any = beam.DoFn.TimerParam(GROUP),
        end: Any = beam.DoFn.TimerParam(END),
    ) -> Iterator[dict[str, Any]]:
        lane, sample = element
        if not list(held.read()):
            group.set(position + Duration(seconds=3))
            end.set(MAX_TIMESTAMP)
        held.add({**sample, "lane": np.int64(lane), "at": np.int64(position.micros // 1_000_000)})
        yield from ()

    @on_timer(GROUP)
    def release(self, held: Any = beam.DoFn.StateParam(HELD)) -> Iterator[dict[str, Any]]:
        samples = list(held.read())
        held.clear()
        yield from reversed(samples)

    @on_timer(END)
    def finish(self, held: Any = beam.DoFn.StateParam(HELD)) -> Iterator[dict[str, Any]]:
        yield from self.release(held)


def text_mix(corpus: Corpus, tmp: Path, *, epochs: int | None, schedule: bool = False) -> zf.LoaderSpec:
    """Two sources, Mix, tokenize, Pack, Shuffle (endless, or finite with a renormalising mix;
    with ``schedule``, weights moving from mostly web to mostly code over steps 0 to 6)."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=500, epochs=epochs)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content", epochs=epochs)
        exhausted = "renormalize" if epochs else "stop"
        if schedule:
            points = [(0, [0.95, 0.05]), (6, [0.05, 0.95])]
            mix = ops.Mix(schedule=points, interpolation="linear", exhausted=exhausted)
        else:
            mix = ops.Mix(weights=[0.7, 0.3], exhausted=exhausted)
        docs = (web, code) | "mix" >> mix
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=4, seed=7, global_batch_size=8)


def vlm(corpus: Corpus, tmp: Path) -> zf.LoaderSpec:
    """Images and captions: decode, resize, tokenize the caption, multimodal packing (finite)."""
    images = write_captioned_images(tmp / "images", 24, seed=3)
    return vlm_spec(images, corpus.tokenizer_json, lanes=4, global_batch_size=4, epochs=1)


def user_timers(corpus: Corpus, tmp: Path) -> zf.LoaderSpec:
    """A stateless parse, then a user's stateful DoFn with timers (finite)."""
    jsonl = write_jsonl(tmp / "docs.jsonl", tagged_texts("web", 45, seed=5))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, split_bytes=300, epochs=2)
        keys = docs | "key" >> beam.ParDo(DocKey())
        return keys | "groups" >> beam.ParDo(GroupOfThree())

    return zf.LoaderSpec(build, lanes=3, seed=11, global_batch_size=6)


def skipping(corpus: Corpus, tmp: Path) -> zf.LoaderSpec:
    """A source with bad records that ``on_error="skip"`` drops, into Pack (finite)."""
    texts = tagged_texts("web", 40, seed=9)
    path = tmp / "bad.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write("{not json\n" if i % 7 == 3 else json.dumps({"text": text}) + "\n")
    jsonl = str(path)

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, field="text", split_bytes=300, epochs=1, on_error="skip")
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        return toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))

    return zf.LoaderSpec(build, lanes=2, seed=3, global_batch_size=4)


def bundles(corpus: Corpus, tmp: Path) -> zf.LoaderSpec:
    """DoFns that use Beam's bundle lifecycle (``bundle_dofns``): lengths buffered in process
    and flushed in finish_bundle (the front), a stateful DoFn whose finish_bundle adds a marker,
    a stateless one emitting only from finish_bundle (the back); finite."""
    jsonl = write_jsonl(tmp / "docs.jsonl", tagged_texts("web", 30, seed=4))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, field="text", split_bytes=300, epochs=1)
        lengths = docs | "lengths" >> beam.ParDo(BufferedLengths())
        totals = lengths | "total" >> beam.ParDo(RunningTotal())
        return totals | "doubled" >> beam.ParDo(Doubled())

    return zf.LoaderSpec(build, lanes=3, seed=5, global_batch_size=6)


#: name -> (build the spec in a scratch folder, steps to compare).
PIPELINES: dict[str, tuple[Callable[[Corpus, Path], zf.LoaderSpec], int]] = {
    "text mix": (lambda c, t: text_mix(c, t, epochs=None), 10),
    "text mix, finite": (lambda c, t: text_mix(c, t, epochs=1), 1000),
    "text mix with a schedule": (lambda c, t: text_mix(c, t, epochs=None, schedule=True), 12),
    "text mix with a schedule, finite": (lambda c, t: text_mix(c, t, epochs=1, schedule=True), 1000),
    "vlm": (vlm, 1000),
    "user stateful DoFn with timers": (user_timers, 1000),
    "bad records skipped": (skipping, 1000),
    "bundle lifecycle DoFns": (bundles, 1000),
}


@pytest.fixture(scope="module")
def references(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per pipeline: its spec, steps, and the digests of the embedded inline Loader."""
    out = {}
    for name, (make, steps) in PIPELINES.items():
        spec = make(corpus, tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", "")))
        out[name] = (spec, steps, MODES["inline"](spec, steps, Path()))
    return out


#: Modes that run on Ray: they share one local Ray for the module.
RAY_MODES = {"ray", "lane owners x2, 2 ranks"}


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray on loopback (2 CPUs) for the Ray modes, shut down after the module."""
    ray = pytest.importorskip("ray")
    from zephon_flow.runners.ray_env import connect

    with _importable_tests():  # Ray's workers import the suite's DoFns by module name
        started = connect("the conformance suite", None, num_cpus=2)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def test_reference_runs_are_real(references: dict[str, Any]) -> None:
    # Endless pipelines give every step asked for; finite ones end on their own, after a few.
    for name, (_, steps, digests) in references.items():
        if steps == 1000:
            assert 3 <= len(digests) < steps, name
        else:
            assert len(digests) == steps, name
        assert len(set(digests)) == len(digests), f"{name}: repeated batches"


@pytest.mark.parametrize(
    "mode",
    [pytest.param(m, marks=[pytest.mark.slow] if m in SLOW_MODES else []) for m in MODES if m != "inline"],
)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_same_batches_on_every_mode(
    pipeline: str, mode: str, references: dict[str, Any], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    spec, steps, expected = references[pipeline]
    if mode in RAY_MODES:
        request.getfixturevalue("ray_session")
    assert MODES[mode](spec, steps, tmp_path) == expected
