"""Derived-field codecs are handed to the checkpoint codec, never registered by an import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from helpers import Corpus

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.checkpoint import blob
from zephon_flow.core.checkpoint.derived_fields import Column, DerivedCodecs, Ragged, Reduced
from zephon_flow.core.checkpoint.packed_segments import BUILTIN, PACKED_SEGMENTS
from zephon_flow.core.errors import CorruptStateError

ROOT = Path(zf.__file__).resolve().parent.parent


class Twice:
    """A codec for the test: ``twice`` is ``2 * x``, so a checkpoint keeps ``x`` only."""

    name = "test.twice/1"

    def reduce(self, columns: Mapping[str, Column]) -> Reduced | None:
        x, twice = columns.get("x"), columns.get("twice")
        if not (isinstance(x, np.ndarray) and isinstance(twice, np.ndarray)) or set(columns) != {
            "x",
            "twice",
        }:
            return None
        if twice.dtype != x.dtype or not np.array_equal(twice, 2 * x):
            return None
        return Reduced({}, ("twice",))

    def rebuild(
        self, columns: Mapping[str, Column], stored: Mapping[str, Column], names: tuple[str, ...]
    ) -> dict[str, Column]:
        x = columns["x"]
        assert not isinstance(x, Ragged)
        return {"twice": 2 * x}


TWICE = Twice()


class MakeTwice(beam.DoFn):  # type: ignore[misc]
    """A packed sequence as ``{x, twice}``; declares the codec of ``twice``."""

    derived_fields = (TWICE,)

    def process(self, element: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        ids = element["input_ids"]
        yield {"x": ids, "twice": 2 * ids}


def twice_spec(corpus: Corpus) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text")
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        pairs = seqs | "twice" >> beam.ParDo(MakeTwice())
        return pairs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=6))

    return zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)


def packed_spec(corpus: Corpus) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text")
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16, labels=True))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=6))

    return zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)


def state_after(spec: zf.LoaderSpec, steps: int) -> Any:
    with zf.Loader(spec, backend="inline") as loader:
        for step, _ in loader:
            if step == steps - 1:
                return loader.state()
    raise AssertionError("the run ended early")


def test_the_plan_collects_the_codecs_its_operators_declare(corpus: Corpus) -> None:
    assert twice_spec(corpus).compile().derived_codecs.names() == ["pack.segments/1", "test.twice/1"]
    assert packed_spec(corpus).compile().derived_codecs == BUILTIN
    with pytest.raises(ValueError, match=r"derived fields 'pack.segments/1' are declared twice"):
        BUILTIN.with_fields([type(PACKED_SEGMENTS)()])


def test_a_pipelines_codec_comes_from_its_spec(corpus: Corpus) -> None:
    spec = twice_spec(corpus)
    state = state_after(spec, 3)
    data = zf.encode_state(state)  # the loader's state carries its plan's codecs
    with pytest.raises(
        CorruptStateError,
        match=r"reduced by derived fields 'test.twice/1', which neither the checkpoint format nor the "
        r"codecs handed in \(pack.segments/1\) know; read it with the codecs of the pipeline that "
        r"wrote it \(spec.compile\(\).derived_codecs\)",
    ):
        zf.decode_state(data)
    back = zf.decode_state(data, codecs=spec.compile().derived_codecs)
    assert blob.canonical_digest(back.to_plain()) == blob.canonical_digest(state.to_plain())
    assert zf.encode_state(back) == data  # a state read with the codecs keeps them
    # Without the codec the same state is written whole (larger), and reads anywhere.
    plain = zf.encode_state(dataclasses.replace(back, codecs=BUILTIN))
    assert len(plain) > len(data)
    assert blob.canonical_digest(zf.decode_state(plain).to_plain()) == blob.canonical_digest(state.to_plain())


_FRESH = """
import sys, types
# The package without its face: only the modules the checkpoint format imports are loaded.
pkg = types.ModuleType("zephon_flow")
pkg.__path__ = [sys.argv[1] + "/zephon_flow"]
sys.modules["zephon_flow"] = pkg
from zephon_flow.core.checkpoint import blob
from zephon_flow.core.checkpoint.store import decode_state
state = decode_state(open(sys.argv[2], "rb").read())
assert not any(m.startswith("zephon_flow.operators") for m in sys.modules), sorted(sys.modules)
print(blob.canonical_digest(state.to_plain()))
"""


def test_packs_checkpoint_is_read_in_a_fresh_interpreter_without_the_operators(
    corpus: Corpus, tmp_path: Path
) -> None:
    state = state_after(packed_spec(corpus), 3)
    path = tmp_path / "packed.zfstate"
    zf.save_state(state, path)
    assert zf.decode_state(path.read_bytes()) is not None
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, str(ROOT), str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == blob.canonical_digest(state.to_plain())


def test_no_codec_is_registered_by_an_import() -> None:
    from zephon_flow.core.checkpoint import derived_fields

    assert not hasattr(derived_fields, "register") and not hasattr(derived_fields, "registered")
    assert DerivedCodecs().names() == []
