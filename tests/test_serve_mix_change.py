"""Mixture changes on the served paths: ``zephon serve --resume ... --allow-mix-change`` (and on
Ray lane owners), and ``zephon mix``, which puts new weights in force on a running server from
a step on, recorded in its checkpoints. Every comparison is of digests of real batches against
the embedded ``Loader``. Servers listen on 127.0.0.1 and are stopped by the test (a subprocess
by its PID)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Corpus
from service_helpers import TESTS, ServerProcess

import zephon_flow as zf
from zephon_flow import cli
from zephon_flow import operators as ops
from zephon_flow.core.errors import FingerprintMismatchError, SpecError, StateError
from zephon_flow.service.mixing import MixChange, parse_schedule, parse_weights
from zephon_flow.service.server import BatchServer

OLD, NEW = [0.5, 0.5], [0.1, 0.9]
AT = 12  # the step a running server takes the new weights from
TOKEN = "mix-s3cret"

PIPELINE = """
import sys

import apache_beam as beam

sys.path.insert(0, {tests!r})
import zephon_flow as zf
from zephon_flow import operators as ops


def build_spec(**mix):
    def build(p):
        web = p | "web" >> ops.ReadJsonl({web!r}, field="text", split_bytes=500)
        code = p | "code" >> ops.ReadParquet({code!r}, column="content")
        docs = (web, code) | "mix" >> ops.Mix(**mix)
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize({tokenizer!r}))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=4, seed=7, global_batch_size=8)


spec = build_spec(weights={old!r})
spec_new = build_spec(weights={new!r})
spec_sched = build_spec(schedule=[(0, {old!r}), ({at}, {new!r})])
"""


@pytest.fixture(scope="module")
def pipeline(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixpipe") / "mixpipe.py"
    path.write_text(
        textwrap.dedent(
            PIPELINE.format(
                tests=str(TESTS),
                web=corpus.web_jsonl,
                code=corpus.code_parquet,
                tokenizer=corpus.tokenizer_json,
                old=OLD,
                new=NEW,
                at=AT,
            )
        )
    )
    return path


def spec_of(pipeline: Path, name: str) -> zf.LoaderSpec:
    return cli.load_spec(f"{pipeline}:{name}")


def loader_digests(spec: zf.LoaderSpec, steps: int, **kwargs: Any) -> list[str]:
    out: list[str] = []
    with zf.Loader(spec, **kwargs) as loader:
        for _, batch in loader:
            out.append(zf.batch_digest(batch))
            if len(out) == steps:
                break
    return out


def client_digests(address: str, start: int, steps: int, **kwargs: Any) -> list[str]:
    out: list[str] = []
    with zf.Client(address, 0, 1, start_step=start, retries=10, backoff=0.05, **kwargs) as client:
        for step, batch in client:
            assert step == start + len(out)
            out.append(zf.batch_digest(batch))
            if len(out) == steps:
                break
    return out


@pytest.fixture
def old_checkpoint(pipeline: Path, tmp_path: Path) -> Path:
    """The state after 4 steps of the old mixture, as a checkpoint file."""
    with zf.Loader(spec_of(pipeline, "spec")) as loader:
        for step, _ in loader:
            if step == 3:
                break
        path = tmp_path / "step-4.zfstate"
        zf.save_state(loader.state(), path)
    return path


def mix_command(*args: str) -> int:
    return cli.main(["mix", *args])


# -- zephon serve --resume ... --allow-mix-change --------------------------------------------
def test_serve_resumes_with_a_new_mixture_as_the_loader_does(
    pipeline: Path, old_checkpoint: Path, tmp_path: Path
) -> None:
    new = spec_of(pipeline, "spec_new")
    expected = loader_digests(new, 6, state=zf.load_state(old_checkpoint), allow_mix_change=True)
    assert expected != loader_digests(spec_of(pipeline, "spec"), 6, state=zf.load_state(old_checkpoint))
    server = ServerProcess(
        f"{pipeline}:spec_new",
        "--resume",
        str(old_checkpoint),
        "--allow-mix-change",
        log=tmp_path / "serve.log",
    )
    try:
        assert client_digests(server.address, 4, 6) == expected
    finally:
        server.kill()


def test_serve_refuses_a_new_mixture_without_the_flag(pipeline: Path, old_checkpoint: Path) -> None:
    with pytest.raises(
        FingerprintMismatchError, match=r"differ: operator mix; .*zephon serve: pass --allow-mix-change"
    ):
        BatchServer(spec_of(pipeline, "spec_new"), resume=str(old_checkpoint))


# -- zephon mix: a running server ------------------------------------------------------------
@pytest.fixture
def running(pipeline: Path, tmp_path: Path) -> Iterator[tuple[BatchServer, Path]]:
    server = BatchServer(
        spec_of(pipeline, "spec"), ahead=2, keep=8, token=TOKEN, checkpoint_dir=str(tmp_path / "ckpt")
    ).start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    try:
        yield server, token_file
    finally:
        server.stop()


def test_a_running_server_takes_new_weights_at_a_step(
    running: tuple[BatchServer, Path], pipeline: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    server, token_file = running
    monkeypatch.delenv("ZEPHON_TOKEN", raising=False)
    address = f"127.0.0.1:{server.port}"
    first = client_digests(address, 0, 3, token=TOKEN)
    at = ["--server", address, "--at-step"]
    # Without the token, refused before any work.
    assert mix_command(*at, str(AT), "--weights", "0.1,0.9") == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    # A step the server has produced already, refused by name.
    assert mix_command(*at, "1", "--weights", "0.1,0.9", "--token-file", str(token_file)) == 1
    err = capsys.readouterr().err
    assert "a mixture change at step 1 is refused: step 1 is already produced" in err
    # Weights for another number of inputs, refused by name.
    assert mix_command(*at, str(AT), "--weights", "1,2,3", "--token-file", str(token_file)) == 1
    assert "the new mixture has 3 weights, the pipeline's Mix has 2 inputs" in capsys.readouterr().err
    assert mix_command(*at, str(AT), "--weights", "0.1,0.9", "--token-file", str(token_file)) == 0
    assert f"mixture from step {AT} on is changed" in capsys.readouterr().out
    # The state at step 3 was taken before the change and is written after it: it records it.
    path = zf.Client(address, 0, 1, token=TOKEN).checkpoint(3)
    served = first + client_digests(address, 3, 2 * AT - 3, token=TOKEN)
    # The same batches as the embedded Loader told the same change, and as a Mix schedule.
    with zf.Loader(spec_of(pipeline, "spec")) as loader:
        loader.change_mixture(AT, weights=NEW)
        embedded = [zf.batch_digest(b) for _, (_, b) in zip(range(2 * AT), loader, strict=False)]
    assert served == embedded == loader_digests(spec_of(pipeline, "spec_sched"), 2 * AT)
    assert served[AT:] != loader_digests(spec_of(pipeline, "spec"), 2 * AT)[AT:]
    # Its checkpoint resumes identically, on the embedded Loader and on zephon serve.
    state = zf.load_state(path)
    assert [s for s, _ in state.mix_history] == [0, AT]
    assert loader_digests(spec_of(pipeline, "spec"), 2 * AT - 3, state=state) == served[3:]
    resumed = BatchServer(spec_of(pipeline, "spec"), resume=path).start()
    try:
        assert client_digests(f"127.0.0.1:{resumed.port}", 3, 2 * AT - 3) == served[3:]
    finally:
        resumed.stop()


def test_a_schedule_appended_to_the_embedded_loader(pipeline: Path) -> None:
    spec = spec_of(pipeline, "spec")
    with zf.Loader(spec) as loader:
        history = loader.change_mixture(5, schedule=[(5, OLD), (9, NEW)], interpolation="linear")
        assert [s for s, _ in history] == [0, 5]
        got = [zf.batch_digest(b) for _, (_, b) in zip(range(10), loader, strict=False)]
        with pytest.raises(StateError, match=r"step 5 is already produced .*give step \d+ or later"):
            loader.change_mixture(5, weights=NEW)
        state = loader.state_dict()
    base = loader_digests(spec, 10)
    assert got[:5] == base[:5] and got[5:] != base[5:]
    assert state["mix_history"][1][1]["interpolation"] == "linear"


def test_the_change_as_given_is_checked_by_name() -> None:
    assert parse_schedule("12:0.5,0.5; 20:0.2,0.8") == [(12, [0.5, 0.5]), (20, [0.2, 0.8])]
    change = MixChange.of(12, schedule=parse_schedule("12:1,1;20:1,3"), interpolation="linear")
    assert MixChange.from_request(change.request()) == change
    for text in ("12=0.5,0.5", "-1:1,1", "x:1,1"):
        with pytest.raises(SpecError, match=r"a schedule is STEP:W,W;STEP:W,W"):
            parse_schedule(text)
    with pytest.raises(SpecError, match=r"weights must be numbers separated by commas"):
        parse_weights("0.5;0.5")
    with pytest.raises(SpecError, match=r"a mixture change at step 12 starts with weights at that step"):
        ops.Mix.starting_at(12, [(10, [1, 1])])
    with pytest.raises(SpecError, match=r"strictly increase"):
        ops.Mix.starting_at(12, [(12, [1, 1]), (12, [1, 2])])
    assert ops.Mix.starting_at(0, [(0, [1, 3])]).weights_at(0).tolist() == [0.25, 0.75]
    assert cli.main(["mix", "--server", "127.0.0.1:1", "--at-step", "3"]) == 2  # neither given


# -- lane owners in process (the coordinator's two phases, without Ray) -----------------------
def _owners(spec: zf.LoaderSpec, owners: int) -> Any:
    from zephon_flow.cluster.coordinator import Coordinator
    from zephon_flow.cluster.owner import LaneOwner, OwnerOptions

    options = OwnerOptions(ahead=2)

    def launch(
        index: int, name: str, lanes: list[int], st: Any, readers: dict[int, int], generation: int
    ) -> LaneOwner:
        return LaneOwner(spec, lanes, state=st, readers=readers, options=options, name=name).start()

    return Coordinator(
        spec,
        owners=owners,
        world_size=1,
        state=None,
        launch=launch,
        gather=lambda owner, step: owner.snapshot(step),
        stop=lambda owner: owner.close(),
        snapshot_every=2,
    )


def _global_digest(coord: Any, spec: zf.LoaderSpec, step: int) -> str:
    from zephon_flow.core.assemble import assemble_rows

    table = coord.table()
    windows, layouts = [], []
    for owner, lanes in table.groups_for(range(spec.lanes)):
        got = table.handles[owner].rows(0, step, lanes, timeout=30)
        windows += got.windows
        layouts += list(zip(got.lanes, got.layouts, strict=True))
    batch = assemble_rows(
        step, windows, layouts, rows=slice(None), per_lane=spec.per_lane, finite=False, padding=None
    )
    coord.progress(0, step + 1)
    return zf.batch_digest(batch)


def test_in_process_owners_change_in_two_phases(pipeline: Path) -> None:
    spec = spec_of(pipeline, "spec")
    coord = _owners(spec, owners=2)

    def call(owner: Any, method: str, args: tuple[Any, ...]) -> Any:
        return getattr(owner, method)(*args)

    try:
        got = [_global_digest(coord, spec, step) for step in range(3)]
        with pytest.raises(
            StateError, match=r"step 2 is refused: step 2 is already produced \(the lane owners"
        ):
            coord.change_mixture(2, [(2, NEW)], call=call)
        with pytest.raises(SpecError, match=r"the new mixture has 3 weights"):
            coord.change_mixture(AT, [(AT, [1, 1, 1])], call=call)
        history = coord.change_mixture(AT, [(AT, NEW)], call=call)
        assert [s for s, _ in history] == [0, AT]
        got += [_global_digest(coord, spec, step) for step in range(3, 2 * AT)]  # refusals held nothing
        assert got == loader_digests(spec_of(pipeline, "spec_sched"), 2 * AT)
        state = coord.checkpoint(2 * AT - 2)
        assert [s for s, _ in state.mix_history] == [0, AT]
    finally:
        coord.shutdown()


# -- zephon serve --ray: lane owners -----------------------------------------------------------
def test_owners_resume_with_a_new_mixture_and_take_one_while_running(
    pipeline: Path, old_checkpoint: Path, tmp_path: Path, capsys: Any
) -> None:
    pytest.importorskip("ray")
    import ray

    from zephon_flow.cluster.serve import OwnersServer
    from zephon_flow.runners.ray_env import connect

    new = spec_of(pipeline, "spec_new")
    first, at, steps = 4, 16, 20  # resumed at step 4; the owners take the old weights back at 16
    with zf.Loader(new, state=zf.load_state(old_checkpoint), allow_mix_change=True) as loader:
        loader.change_mixture(at, weights=OLD)
        expected = [zf.batch_digest(b) for _, (_, b) in zip(range(steps), loader, strict=False)]
    started = connect("tests", None, num_cpus=2)
    try:
        with pytest.raises(FingerprintMismatchError, match=r"zephon serve --ray: pass --allow-mix-change"):
            OwnersServer(new, owners=2, world_size=1, resume=str(old_checkpoint))
        server = OwnersServer(
            new,
            owners=2,
            world_size=1,
            resume=str(old_checkpoint),
            allow_mix_change=True,
            ahead=2,
            checkpoint_dir=str(tmp_path / "ckpt"),
        )
        try:
            address = f"127.0.0.1:{server.port}"
            served: list[str] = []
            with zf.Client(address, 0, 1, start_step=first, lane_owners=True) as client:
                batches = iter(client)
                for _ in range(3):
                    served.append(zf.batch_digest(next(batches)[1]))
                mix = ["--server", address, "--at-step"]
                assert mix_command(*mix, str(first + 1), "--weights", "0.5,0.5") == 1
                err = capsys.readouterr().err
                assert f"a mixture change at step {first + 1} is refused: step {first + 1} is already" in err
                assert "(the lane owners have begun every step before" in err
                assert mix_command(*mix, str(at), "--weights", "0.5,0.5") == 0
                path = client.checkpoint(first + 3)  # the owners' snapshots, the new history
                while len(served) < steps:
                    served.append(zf.batch_digest(next(batches)[1]))
            assert served == expected
            state = zf.load_state(path)
            assert [s for s, _ in state.mix_history] == [0, first, at]
            assert loader_digests(new, steps - 3, state=state) == served[3:]
        finally:
            server.stop()
    finally:
        if started:
            ray.shutdown()
