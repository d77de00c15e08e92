"""The deterministic runner refuses, up front and by label, every transform it cannot run."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import PickleCoder
from apache_beam.transforms import window
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec
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
    assert msg == (
        "transform 'make' (Create) is not a zephon-flow source; read data with ops.ReadTextFiles "
        "(a document per file), ops.ReadJsonl (a JSON object per line), ops.ReadParquet, "
        "ops.ReadArrow or ops.ReadWebDataset, so it can be dealt to lanes and resumed"
    )


def test_a_beam_read_is_refused_by_its_own_name_pointing_to_the_sources(tmp_path: Path) -> None:
    (tmp_path / "lines.txt").write_text("a\nb\n")
    msg = refused(lambda p: p | "read" >> beam.io.ReadFromText(str(tmp_path / "lines.txt")))
    assert msg == (
        "transform 'read' (ReadFromText) reads with a Beam source, whose records the runner can "
        "neither deal to lanes nor resume; read the data with a zephon-flow source instead: "
        "ops.ReadTextFiles (a document per file), ops.ReadJsonl (a JSON object per line), "
        "ops.ReadParquet, ops.ReadArrow or ops.ReadWebDataset"
    )
    bare = refused(lambda p: p | "imp" >> beam.Impulse())
    assert bare.startswith(
        "transform 'imp' (Impulse): bare Impulse is not a zephon-flow source; use ops.ReadTextFiles"
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


# -- a keyed input to a stateful DoFn: zephon-flow keys by lane ------------------------------
class Tokens(beam.DoFn):  # type: ignore[misc]
    """A document's character codes as token ids (a stand-in for Tokenize)."""

    def process(self, text: str) -> Iterator[np.ndarray]:
        yield np.frombuffer(text.encode()[:40], dtype=np.uint8).astype(np.int32)


class KeyByHand(beam.DoFn):  # type: ignore[misc]
    """Keys like beam.Map(lambda t: (0, t)), but as a DoFn Beam infers no pair type for."""

    def process(self, tokens: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        yield 0, tokens


class CountPerKey(beam.DoFn):  # type: ignore[misc]
    """A user's stateful DoFn written for Beam: ``key, value = element``."""

    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())

    def process(
        self, element: tuple[int, object], seen: object = beam.DoFn.StateParam(SEEN)
    ) -> Iterator[dict[str, int]]:
        _lane, value = element
        yield {"pair": int(isinstance(value, tuple))}


KEYED = (
    "transform 'pack' (ParDo): its input from 'key' is (key, value) pairs, as Beam's own runners "
    "want a stateful DoFn's input; zephon-flow keys every stateful DoFn by lane itself: {name} "
    "receives (lane, value) and keeps its state per lane. Do not key: remove the keying from "
    "'key' and give {name} the values themselves"
)


@pytest.mark.parametrize(
    "key",
    [
        lambda: beam.Map(lambda t: (0, t)),
        lambda: beam.WithKeys(0),
        lambda: beam.Map(lambda t: (t, len(t))),
        lambda: beam.ParDo(ops.Map(lambda t: (0, t))),
    ],
    ids=["map-to-constant-key", "WithKeys", "any-pair-into-Pack", "ops.Map-to-constant-key"],
)
def test_a_keyed_input_to_pack_is_refused_when_the_spec_is_built(
    corpus: Corpus, key: Callable[[], beam.PTransform]
) -> None:
    msg = refused(
        lambda p: (
            web(corpus, p)
            | "tok" >> beam.ParDo(Tokens())
            | "key" >> key()
            | "pack" >> beam.ParDo(ops.Pack(32))
        )
    )
    assert msg == KEYED.format(name="Pack")


def test_a_keyed_input_to_a_users_stateful_dofn_is_refused_when_the_keying_is_plain(corpus: Corpus) -> None:
    msg = refused(
        lambda p: web(corpus, p) | "key" >> beam.WithKeys("k") | "pack" >> beam.ParDo(CountPerKey())
    )
    assert msg == KEYED.format(name="CountPerKey")
    msg = refused(
        lambda p: web(corpus, p) | "key" >> beam.Map(lambda t: ("k", t)) | "pack" >> beam.ParDo(CountPerKey())
    )
    assert msg == KEYED.format(name="CountPerKey")


def test_pairs_a_users_stateful_dofn_means_as_values_are_accepted(corpus: Corpus) -> None:
    """``(text, length)`` is a value, not a key: the DoFn receives ``(lane, (text, length))``."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        pairs = web(corpus, p) | "key" >> beam.Map(lambda t: (t, len(t)))
        return pairs | "pack" >> beam.ParDo(CountPerKey())

    batches = run_batches(zf.LoaderSpec(build, lanes=2, global_batch_size=4), 2)
    assert [b["pair"].tolist() for b in batches] == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_a_keyed_element_pack_sees_at_run_time_is_refused_by_name(corpus: Corpus) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        tokens = web(corpus, p) | "tok" >> beam.ParDo(Tokens())
        return tokens | "key" >> beam.ParDo(KeyByHand()) | "pack" >> beam.ParDo(ops.Pack(32))

    with pytest.raises(SpecError) as err:
        run_batches(zf.LoaderSpec(build, lanes=2, global_batch_size=4), 1)
    assert str(err.value) == (
        "Pack: an element is a (key, value) pair, not token ids: zephon-flow keys every stateful "
        "DoFn by lane itself (Pack receives (lane, value) and keeps its state per lane), so do not "
        "key its input: give Pack the token arrays themselves"
    )
