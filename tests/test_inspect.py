"""``zephon inspect``: the documents of each sequence of a step, from step 0 or from a state."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers import Corpus, DocKey, chain_spec, make_corpus
from tokenizers import Tokenizer
from vlm_helpers import vlm_spec, write_captioned_images

import zephon_flow as zf
from zephon_flow.cli import load_spec, main
from zephon_flow.core.batches import split_ragged
from zephon_flow.core.errors import SpecError, StateError
from zephon_flow.engine.inspection import inspect_step

PIPELINE = textwrap.dedent(
    '''
    """A pipeline whose test packer emits one document per sequence, with provenance."""
    import apache_beam as beam
    import numpy as np
    from apache_beam.coders import PickleCoder
    from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

    import zephon_flow as zf
    from zephon_flow import operators as ops

    SEQ = 12


    class OnePerSequence(beam.DoFn):
        COUNT = ReadModifyWriteStateSpec("count", PickleCoder())

        def process(self, element, count=beam.DoFn.StateParam(COUNT), doc=zf.ProvenanceParam):
            _, ids = element
            count.write((count.read() or 0) + 1)
            ids = np.asarray(ids, dtype=np.int32)[:SEQ]
            pad = SEQ - ids.size
            yield {
                "input_ids": np.concatenate([ids, np.zeros(pad, np.int32)]),
                "segment_ids": np.concatenate([np.zeros(ids.size, np.int32), np.full(pad, -1, np.int32)]),
                "documents": np.asarray([doc], dtype=np.int64),
            }


    def build(p):
        web = p | "web" >> ops.ReadJsonl(WEB, split_bytes=400)
        code = p | "code" >> ops.ReadParquet(CODE, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.5, 0.5])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(TOKENIZER))
        return toks | "pack" >> beam.ParDo(OnePerSequence())


    spec = zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)
    '''
)


@pytest.fixture()
def pipeline(tmp_path: Path) -> str:
    corpus = make_corpus(tmp_path / "corpus", n_web=30, n_code=20)
    path = tmp_path / "pipeline.py"
    header = (
        f"WEB = {corpus.web_jsonl!r}\nCODE = {corpus.code_parquet!r}\nTOKENIZER = {corpus.tokenizer_json!r}\n"
    )
    path.write_text(PIPELINE.replace('"""\nimport', '"""\n' + header + "import", 1))
    return f"{path}:spec"


def test_each_document_is_named_and_decoded(pipeline: str) -> None:
    spec = load_spec(pipeline)
    tokenizer = Tokenizer.from_file(str(spec.compile().common[0].dofn.path))
    views = inspect_step(spec, 3, rank=1, world_size=2)
    assert [v.row for v in views] == [2, 3]
    assert [v.lane for v in views] == [1, 1]
    with zf.Loader(spec, rank=1, world_size=2) as loader:
        batch = next(b for s, b in loader if s == 3)
    for v, ids, docs in zip(views, batch["input_ids"], split_ragged(batch), strict=True):
        (d,) = v.documents
        assert (d.split, d.offset) == (int(docs[0][1]), int(docs[0][2]))
        assert d.source == ("web", "code")[int(docs[0][0])]
        assert d.file == ("web.jsonl", "code.parquet")[int(docs[0][0])]
        assert d.tokens == 12 - v.padding
        assert d.excerpt == tokenizer.decode(ids[: d.tokens].tolist(), skip_special_tokens=False)


def test_a_nearby_state_gives_the_same_view(pipeline: str) -> None:
    spec = load_spec(pipeline)
    with zf.Loader(spec) as loader:
        for step, _ in loader:
            if step == 4:
                state = loader.state_dict()  # resumes at step 5
                break
    assert inspect_step(spec, 7, state=state) == inspect_step(spec, 7)
    with pytest.raises(StateError, match="the state resumes at step 5, after the requested step 2"):
        inspect_step(spec, 2, state=state)


def test_cli_prints_text_and_json(pipeline: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_file = tmp_path / "s.zfstate"
    assert main(["digest", pipeline, "--steps", "3", "--save-state", str(state_file)]) == 0
    capsys.readouterr()
    assert main(["inspect", pipeline, "--step", "4", "--state", str(state_file)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("step 4, rank 0 of 1: 4 sequences\nsequence 0 (lane 0): 1 documents")
    assert "[0] web: web.jsonl split " in text or "[0] code: code.parquet split " in text
    assert main(["inspect", pipeline, "--step", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4 and all(len(r["documents"]) == 1 for r in rows)


def test_pipelines_without_provenance_are_refused(tmp_path: Path) -> None:
    spec = chain_spec(make_corpus(tmp_path / "c", n_web=10, n_code=10).web_jsonl, ("key", DocKey()))
    with pytest.raises(SpecError, match="carry no provenance"):
        inspect_step(spec, 0)


def test_multimodal_sequences_show_image_tokens_and_captions(corpus: Corpus, tmp_path: Path) -> None:
    images = write_captioned_images(tmp_path / "imgs", 12)
    spec = vlm_spec(images, corpus.tokenizer_json, lanes=2, global_batch_size=2)
    views = inspect_step(spec, 2)
    assert views and all(v.documents for v in views)
    for v in views:
        for d in v.documents:
            number = int(d.file.split(".")[0])  # the caption of 00007.jpg is "image 7 ..."
            assert d.excerpt.startswith(f"[4 image tokens] image {number} ")
