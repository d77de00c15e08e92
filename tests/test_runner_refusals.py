"""The deterministic runner refuses, up front and by label, every transform it cannot run."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.transforms import window
from helpers import Corpus, DocKey, run_batches

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import SpecError, UnsupportedTransformError

Build = Callable[[beam.Pipeline], beam.PCollection]


def web(corpus: Corpus, p: beam.Pipeline, label: str = "web") -> beam.PCollection:
    return p | label >> ops.ReadJsonl(corpus.web_jsonl)


def code(corpus: Corpus, p: beam.Pipeline) -> beam.PCollection:
    return p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")


def refused(build: Build) -> str:
    """The message of the UnsupportedTransformError raised when a Loader is made for ``build``."""
    spec = zf.LoaderSpec(build, lanes=2, global_batch_size=4)
    with pytest.raises(UnsupportedTransformError) as info:
        zf.Loader(spec)
    return str(info.value)


def test_create_is_refused(corpus: Corpus) -> None:
    msg = refused(lambda p: p | "make" >> beam.Create(["a", "b"]) | "key" >> beam.ParDo(DocKey()))
    assert msg.startswith(
        "transform 'make' (Create) is not a zephon-flow source; read data with ops.ReadJsonl"
    )


def test_group_by_key_is_refused(corpus: Corpus) -> None:
    msg = refused(lambda p: web(corpus, p) | "kv" >> beam.Map(lambda x: (1, x)) | "gbk" >> beam.GroupByKey())
    assert (
        msg
        == "transform 'gbk' (GroupByKey): GroupByKey is not supported; group inside a stateful DoFn (BagState)"
    )


def test_flatten_is_refused_in_favour_of_mix(corpus: Corpus) -> None:
    msg = refused(lambda p: (web(corpus, p), code(corpus, p)) | "union" >> beam.Flatten())
    assert (
        msg
        == "transform 'union' (Flatten): Flatten gives no order; combine sources with ops.Mix(weights=...)"
    )


def test_fixed_windows_are_refused(corpus: Corpus) -> None:
    msg = refused(lambda p: web(corpus, p) | "win" >> beam.WindowInto(window.FixedWindows(10)))
    assert msg.startswith("transform 'win' (WindowInto): windowing is owned by zephon-flow")
    assert "remove the WindowInto" in msg


def test_side_inputs_are_refused(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        return web(corpus, p) | "with_side" >> beam.Map(
            lambda x, side: x, beam.pvalue.AsList(code(corpus, p))
        )

    assert refused(build) == "transform 'with_side' (ParDo): side inputs are not supported"


def test_fan_out_of_a_pcollection_is_refused(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = web(corpus, p)
        _ = docs | "left" >> beam.ParDo(DocKey())
        return docs | "right" >> beam.ParDo(DocKey())

    msg = refused(build)
    assert msg.startswith("the output of 'web' is consumed by several transforms ('left', 'right')")


def test_a_stateful_dofn_before_the_mix_is_refused(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        w = web(corpus, p) | "tok_w" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        w = w | "early_pack" >> beam.ParDo(ops.Pack(seq_len=8))
        c = code(corpus, p) | "tok_c" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        return (w, c) | "mix" >> ops.Mix(weights=[1, 1])

    assert refused(build) == (
        "transform 'early_pack' (ParDo): stateful DoFns must come after the Mix of the sources"
    )


def test_multiple_outputs_are_refused(corpus: Corpus) -> None:
    msg = refused(lambda p: (web(corpus, p) | "multi" >> beam.ParDo(DocKey()).with_outputs("x", main="m")).m)
    assert "(with_outputs) are not supported" in msg and "'multi" in msg


def test_a_mix_of_a_mix_is_refused(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        inner = (web(corpus, p), code(corpus, p)) | "inner" >> ops.Mix(weights=[1, 1])
        return (inner, web(corpus, p, "web2")) | "outer" >> ops.Mix(weights=[1, 1])

    assert refused(build).startswith("transform 'inner' (Mix): a Mix feeding another Mix is not supported")


def test_a_transform_off_the_returned_path_is_refused(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        code(corpus, p)
        return web(corpus, p) | "key" >> beam.ParDo(DocKey())

    assert refused(build).startswith(
        "transform(s) 'code' do not lead to the PCollection that build(p) returned"
    )


def test_global_windows_and_reshuffle_pass_through(corpus: Corpus) -> None:
    def plain(p: beam.Pipeline) -> beam.PCollection:
        return web(corpus, p) | "key" >> beam.ParDo(DocKey())

    def decorated(p: beam.Pipeline) -> beam.PCollection:
        docs = web(corpus, p) | "gw" >> beam.WindowInto(window.GlobalWindows()) | "rs" >> beam.Reshuffle()
        return docs | "key" >> beam.ParDo(DocKey())

    a = run_batches(zf.LoaderSpec(plain, lanes=2, global_batch_size=4), 5)
    b = run_batches(zf.LoaderSpec(decorated, lanes=2, global_batch_size=4), 5)
    assert [zf.batch_digest(x) for x in a] == [zf.batch_digest(x) for x in b]


def test_build_must_return_a_pcollection() -> None:
    with pytest.raises(SpecError, match=r"build\(p\) must return a beam.PCollection, got Pipeline"):
        zf.Loader(zf.LoaderSpec(lambda p: p, lanes=1, global_batch_size=1))


def test_compiling_leaves_no_temporary_folder_behind(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam's Pipeline makes a temporary folder that only its run() removes; a spec's graph is
    compiled, never run, so a trainer start must not leave one in /tmp (nor a refused one)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = zf.LoaderSpec(
        lambda p: web(corpus, p) | "key" >> beam.ParDo(DocKey()), lanes=2, global_batch_size=4
    )
    assert spec.fingerprint["total"]
    with pytest.raises(SpecError):
        zf.Loader(zf.LoaderSpec(lambda p: p, lanes=1, global_batch_size=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_build_must_be_callable() -> None:
    with pytest.raises(SpecError, match=r"build must be a callable taking a beam.Pipeline, got 3"):
        zf.LoaderSpec(3, lanes=1, global_batch_size=1)  # type: ignore[arg-type]
