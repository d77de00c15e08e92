"""The ``zephon`` command line: digests across topologies and resumes, diff, errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zephon_flow.cli import main

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


@pytest.fixture(scope="module")
def pipeline_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    rng = random.Random(3)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(120):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
            f.write(json.dumps({"text": f"doc {i} {words}"}) + "\n")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(WORDS * 5, trainer)
    tok.save(str(root / "tok.json"))
    path = root / "pipeline.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import apache_beam as beam
            import zephon_flow as zf
            from zephon_flow import operators as ops

            class Shout(beam.DoFn):
                # Defined in the pipeline file: worker processes must import it from here.
                def process(self, text):
                    yield text.upper() if " seven " in text else text

            def build(p):
                docs = p | "docs" >> ops.ReadJsonl({str(root / "docs.jsonl")!r}, split_bytes=700)
                loud = docs | "shout" >> beam.ParDo(Shout())
                toks = loud | "tok" >> beam.ParDo(ops.Tokenize({str(root / "tok.json")!r}))
                seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=32))
                return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=5))

            spec = zf.LoaderSpec(build, lanes=4, seed=11, global_batch_size=8)

            def make_spec():
                return spec
            """
        )
    )
    return path


def _digests(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["digest", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines


def test_digest_is_the_same_across_topologies_and_resume(
    pipeline_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"{pipeline_file}:spec"
    ref = _digests(capsys, target, "--steps", "12")
    assert len(ref) == 12
    assert [line.split()[0] for line in ref] == [str(i) for i in range(12)]
    assert all(len(line.split()[1]) == 64 for line in ref)
    assert len({line.split()[1] for line in ref}) == 12

    wide = _digests(
        capsys, target, "--steps", "12", "--world-size", "8", "--backend", "threads", "--workers", "2"
    )
    assert wide == ref

    ck = tmp_path / "ck.zfstate"
    first = _digests(capsys, target, "--steps", "5", "--world-size", "2", "--save-state", str(ck))
    assert ck.stat().st_size > 0
    rest = _digests(
        capsys, f"{pipeline_file}:make_spec", "--steps", "7", "--world-size", "4", "--state", str(ck)
    )
    assert first + rest == ref

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(ref) + "\n")
    b.write_text("\n".join(first + rest) + "\n")
    assert main(["diff", str(a), str(b)]) == 0
    assert "identical over 12 common steps" in capsys.readouterr().out


def test_diff_names_the_first_differing_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("0 aaa\n1 bbb\n2 ccc\n3 ddd\n")
    b.write_text("0 aaa\n1 bbb\n2 xxx\n3 yyy\n")
    assert main(["diff", str(a), str(b)]) == 1
    assert capsys.readouterr().out.startswith("first difference at step 2: ccc != xxx")


def test_failures_exit_1_with_one_line(
    pipeline_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A MODULE:SPEC that names nothing is a wrong argument value: exit 2, as argparse's own.
    assert main(["digest", f"{pipeline_file}:nope", "--steps", "1"]) == 2
    assert capsys.readouterr().err == f"zephon: error: {pipeline_file} has no attribute 'nope'\n"
    assert main(["digest", f"{pipeline_file}:spec", "--steps", "1", "--world-size", "3"]) == 1
    assert "not divisible by world_size=3" in capsys.readouterr().err
    bad = tmp_path / "bad.zfstate"
    bad.write_bytes(b"not a checkpoint at all, just some bytes that are long enough" * 2)
    assert main(["digest", f"{pipeline_file}:spec", "--steps", "1", "--state", str(bad)]) == 1
    assert "not a zephon-flow checkpoint" in capsys.readouterr().err
    garbage = tmp_path / "g.txt"
    garbage.write_text("zero deadbeef\n")
    assert main(["diff", str(garbage), str(garbage)]) == 1
    assert "expected 'STEP SHA256'" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "missing.txt"), str(garbage)]) == 1
    assert (
        capsys.readouterr().err == f"zephon: error: {tmp_path / 'missing.txt'}: No such file or directory\n"
    )
    assert main(["digest", str(tmp_path / "nowhere.py") + ":spec", "--steps", "1"]) == 2
    assert capsys.readouterr().err == f"zephon: error: no such pipeline file: {tmp_path / 'nowhere.py'}\n"
    assert main(["digest", "no_such_module_here:spec", "--steps", "1"]) == 2
    assert "no module named 'no_such_module_here'" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["digest", "no_colon_here", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "zephon: error: expected MODULE:SPEC (e.g. examples/pipeline.py:spec), got 'no_colon_here'\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["digest", "x.py:spec"])
    assert exit_.value.code == 2
    assert "the following arguments are required: --steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    capsys.readouterr()
    assert main(["inspect", "x.py:spec", "--step", "0", "--rank", "2", "--world-size", "2"]) == 2
    assert (
        capsys.readouterr().err
        == "zephon: error: zephon inspect: --rank must be below --world-size (2), got 2\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Refused by the parser, by the option's name: not an empty output (digest --steps -3),
        # a run that never ends (inspect --step -1) or an error naming an internal class.
        (["digest", "x.py:spec", "--steps", "-3"], "argument --steps: must be an integer >= 0, got '-3'"),
        (
            ["digest", "x.py:spec", "--steps", "1", "--world-size", "0"],
            "argument --world-size: must be an integer >= 1, got '0'",
        ),
        (
            ["digest", "x.py:spec", "--steps", "1", "--workers", "0"],
            "argument --workers: must be an integer >= 1, got '0'",
        ),
        (["digest", "x.py:spec", "--steps", "ten"], "argument --steps: must be an integer >= 0, got 'ten'"),
        (["inspect", "x.py:spec", "--step", "-1"], "argument --step: must be an integer >= 0, got '-1'"),
        (
            ["inspect", "x.py:spec", "--step", "1", "--rank", "-1"],
            "argument --rank: must be an integer >= 0, got '-1'",
        ),
        (["demo", "--steps", "1"], "argument --steps: must be an integer >= 2, got '1'"),
        (
            ["materialize", "x.py:spec", "--steps", "0", "--out", "d"],
            "argument --steps: must be an integer >= 1, got '0'",
        ),
        (
            ["serve", "x.py:spec", "--port", "70000"],
            "argument --port: must be an integer from 0 to 65535, got '70000'",
        ),
        (
            ["serve", "x.py:spec", "--port", "0", "--ahead", "0"],
            "argument --ahead: must be an integer >= 1, got '0'",
        ),
        (
            ["serve", "x.py:spec", "--port", "0", "--keep", "-1"],
            "argument --keep: must be an integer >= 0, got '-1'",
        ),
        (
            ["serve", "x.py:spec", "--port", "0", "--chunk-timeout", "0"],
            "argument --chunk-timeout: must be a positive number of seconds, got '0'",
        ),
        (
            ["serve", "x.py:spec", "--port", "0", "--stream-timeout", "nan"],
            "argument --stream-timeout: must be a positive number of seconds, got 'nan'",
        ),
        (
            ["serve", "x.py:spec", "--port", "0", "--ray", "--lane-owners", "0"],
            "argument --lane-owners: must be an integer >= 1, got '0'",
        ),
    ],
)
def test_bad_argument_values_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zephon {argv[0]}: error: {message}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import zephon_flow

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"zephon-flow {zephon_flow.__version__}\n"


def test_a_broken_pipeline_file_is_one_line_and_v_gives_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import zephon_flow as zf\nimport no_such_package_xyz\n")
    assert main(["digest", f"{broken}:spec", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"zephon: error: pipeline file {broken} raised at {broken}:2: ModuleNotFoundError: "
        f"No module named 'no_such_package_xyz' (-v prints the traceback)\n"
    )
    assert main(["digest", f"{broken}:spec", "--steps", "1", "-v"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("ModuleNotFoundError: No module named 'no_such_package_xyz'\n")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def build(p:\n")
    assert main(["digest", f"{syntax}:spec", "--steps", "1"]) == 1
    assert f"pipeline file {syntax} raised at {syntax}:1: SyntaxError" in capsys.readouterr().err


def test_unexpected_errors_say_how_to_see_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = tmp_path / "odd.py"
    odd.write_text("def spec():\n    return {}['missing']\n")
    assert main(["digest", f"{odd}:spec", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"zephon: error: {odd}:spec() raised at {odd}:2: KeyError: 'missing' (-v prints the traceback)\n"
    )


def test_console_script_exit_codes_and_log_level(pipeline_file: Path, tmp_path: Path) -> None:
    zephon = Path(sys.executable).with_name("zephon")
    usage = subprocess.run([str(zephon), "digest"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: zephon digest")
    missing = subprocess.run(
        [str(zephon), "diff", "a.txt", "b.txt"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert (missing.returncode, missing.stderr) == (1, "zephon: error: a.txt: No such file or directory\n")
    logged = subprocess.run(
        [str(zephon), "--log-level", "debug", "digest", f"{pipeline_file}:spec", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert logged.returncode == 0, logged.stderr
    assert f" DEBUG zephon_flow.cli: loaded {pipeline_file}:spec: lanes=4, global batch 8" in logged.stderr


def test_console_script_runs(pipeline_file: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zephon_flow.cli", "digest", f"{pipeline_file}:spec", "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert len(out.stdout.strip().splitlines()) == 2
    assert "apitools" not in out.stderr


def test_digest_with_worker_processes_loads_a_pipeline_file(
    pipeline_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The DoFns of a pipeline loaded by path must import in the worker processes too.
    target = f"{pipeline_file}:spec"
    ref = _digests(capsys, target, "--steps", "6")
    procs = _digests(
        capsys, target, "--steps", "6", "--world-size", "2", "--backend", "processes", "--workers", "2"
    )
    assert procs == ref


def test_serve_logs_where_it_resumes(
    pipeline_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import zephon_flow as zf
    from zephon_flow.cli import load_spec
    from zephon_flow.service import server

    spec = load_spec(f"{pipeline_file}:spec")
    with zf.Loader(spec) as loader:
        for step, _ in loader:
            if step == 2:
                break
        ck = tmp_path / "step-3.zfstate"
        zf.save_state(loader.state(), ck)
    started: list[object] = []

    def serve_forever(srv: object) -> int:
        started.append(srv)
        return 0

    monkeypatch.setattr(server, "serve_forever", serve_forever)
    with caplog.at_level("INFO", logger="zephon_flow"):
        assert main(["serve", f"{pipeline_file}:spec", "--port", "0", "--resume", str(ck)]) == 0
    assert f"zephon serve: resuming from {ck} at step 3" in caplog.messages
    assert len(started) == 1


def test_serve_takes_ahead_held_bytes_and_the_former_window_flag(
    pipeline_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from zephon_flow.service import server

    started: list[server.BatchServer] = []

    def serve_forever(srv: server.BatchServer) -> int:
        started.append(srv)
        return 0

    monkeypatch.setattr(server, "serve_forever", serve_forever)
    target = f"{pipeline_file}:spec"
    assert main(["serve", target, "--port", "0", "--ahead", "5", "--held-bytes", "2MiB"]) == 0
    assert (started[-1]._held.ahead, started[-1]._held.max_bytes) == (5, 2 << 20)
    assert main(["serve", target, "--port", "0"]) == 0
    assert (started[-1]._held.ahead, started[-1]._held.max_bytes) == (32, None)
    for srv in started:
        srv.stop(grace=None)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", target, "--port", "0", "--held-bytes", "lots"])
    assert exit_.value.code == 2


FAILING = """
import apache_beam as beam
import zephon_flow as zf
from zephon_flow import operators as ops

class NoSevens(beam.DoFn):
    def process(self, text):
        if "7" in text:
            raise ValueError("sevens are not allowed")
        yield {{"n": len(text)}}

def build(p):
    docs = p | "docs" >> ops.ReadTextFiles({path!r})
    return docs | "nosevens" >> beam.ParDo(NoSevens())

spec = zf.LoaderSpec(build, lanes=1, seed=1, global_batch_size=1)
"""


@pytest.mark.parametrize("backend", ["inline", "processes"])
def test_a_dofn_error_is_one_line_and_v_adds_its_traceback_labelled_by_where_it_ran(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lines.txt").write_text("one\ntwo 7\n")
    pipeline = tmp_path / "failing.py"
    pipeline.write_text(FAILING.format(path=str(tmp_path / "lines.txt")))
    argv = ["digest", f"{pipeline}:spec", "--steps", "3", "--backend", backend, "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        "zephon: error: DoFn 'nosevens' raised ValueError: sevens are not allowed (on the record at "
        f"{tmp_path / 'lines.txt'} (the whole file), via ReadTextFiles('docs')) (-v prints the traceback)\n"
    )
    assert main([*argv, "-v"]) == 1
    err = capsys.readouterr().err
    label = "-- traceback on the worker --" if backend == "processes" else "-- traceback --"
    assert err.count(label) == 1 and err.count("-- traceback") == 1
    assert 'raise ValueError("sevens are not allowed")' in err
    assert err.splitlines()[-1].startswith("zephon: error: DoFn 'nosevens' raised ValueError")


def test_serve_refuses_snapshot_dir_without_ray(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "nowhere.py:spec", "--port", "0", "--snapshot-dir", str(tmp_path)]) == 2
    assert "--snapshot-dir goes with --ray" in capsys.readouterr().err
