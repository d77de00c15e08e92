"""``zephon materialize``: Parquet that reads back as the Loader's batches, from the command line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import Corpus, run_batches

from zephon_flow.cli import load_spec, main
from zephon_flow.core.batches import batch_digest, stack, with_valid
from zephon_flow.core.errors import DataError
from zephon_flow.engine.materialize import batch_table, read_materialized, step_file, table_batch


def test_parquet_keeps_every_field_exactly() -> None:
    rng = np.random.default_rng(0)
    samples = [
        {
            "input_ids": rng.integers(0, 1000, size=6, dtype=np.int32),
            "image": rng.integers(0, 255, size=(2, 3, 3), dtype=np.uint8),
            "score": np.float64(rng.random()),
            "documents": rng.integers(0, 9, size=(int(n), 3), dtype=np.int64),
        }
        for n in (2, 0, 3)
    ]
    batch = with_valid(stack(samples, where="test"), np.array([True, True, False]), where="test")
    table = batch_table(7, batch)
    assert table.column_names[:2] == ["step", "row"]
    assert table.column("step").to_pylist() == [7, 7, 7]
    assert table.column("documents").to_pylist()[1] == []  # the ragged field, one list per row
    back = table_batch(table, where="test")
    assert sorted(back) == sorted(batch)
    for name in batch:
        assert back[name].dtype == batch[name].dtype and back[name].shape == batch[name].shape, name
    assert batch_digest(back) == batch_digest(batch)


def test_a_foreign_parquet_file_is_refused_by_name(tmp_path: Path) -> None:
    import pyarrow as pa

    pq.write_table(pa.table({"x": [1]}), tmp_path / "step-00000000.parquet")
    with pytest.raises(
        DataError,
        match=r"step-00000000.parquet: no 'zephon.fields' metadata; not written by zephon materialize",
    ):
        read_materialized(str(tmp_path))


@pytest.fixture(scope="module")
def pipeline_file(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("materialize") / "pipeline.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import apache_beam as beam
            import zephon_flow as zf
            from zephon_flow import operators as ops

            class Shout(beam.DoFn):
                # Defined in the pipeline file: Beam's workers find it by this module's name.
                def process(self, text):
                    yield text.upper() if "7" in text else text

            def build(p):
                web = p | "web" >> ops.ReadJsonl({corpus.web_jsonl!r}, field="text", split_bytes=400)
                code = p | "code" >> ops.ReadParquet({corpus.code_parquet!r}, column="content", epochs=1)
                docs = (web, code) | "mix" >> ops.Mix(weights=[0.5, 0.5])
                loud = docs | "shout" >> beam.ParDo(Shout())
                toks = loud | "tok" >> beam.ParDo(ops.Tokenize({corpus.tokenizer_json!r}, append_eos=True))
                seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
                return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=3))

            spec = zf.LoaderSpec(build, lanes=4, seed=5, global_batch_size=8)
            """
        )
    )
    return path


def test_cli_writes_the_loaders_batches(
    pipeline_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    target = f"{pipeline_file}:spec"
    out = tmp_path / "out"
    # Anything materialize does not know is a Beam pipeline option.
    argv = [
        "materialize",
        target,
        "--steps",
        "1000",
        "--out",
        str(out),
        "--passes",
        "4",
        "--direct_num_workers=1",
    ]
    assert main(argv) == 0
    written = read_materialized(str(out))
    expected = [batch_digest(b) for b in run_batches(load_spec(target), 1000)]
    assert 3 <= len(expected) < 1000  # the code source has one pass: the stream ends
    assert [batch_digest(b) for _, b in written] == expected
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [f"{step} {digest}" for step, digest in enumerate(expected)]
    assert f"wrote steps 0..{len(expected) - 1} to {out} (the finite input ended)" in caplog.text
    last = pq.read_table(step_file(str(out), len(expected) - 1))
    assert last.column_names[:2] == ["step", "row"] and "valid" in last.column_names


def test_cli_errors(pipeline_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "step-00000003.parquet").write_bytes(b"")
    assert main(["materialize", f"{pipeline_file}:spec", "--steps", "2", "--out", str(out)]) == 1
    assert "already holds step files (step-00000003.parquet, ...)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # other commands still refuse unknown options
        main(["digest", f"{pipeline_file}:spec", "--steps", "1", "--direct_num_workers=2"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --direct_num_workers=2" in capsys.readouterr().err
