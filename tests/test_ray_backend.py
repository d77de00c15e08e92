"""backend='ray': the stateless front on a pool of Ray actors gives the batches inline gives,
fails the way the processes backend fails, resumes its checkpoints and survives killed actors."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from helpers import Corpus, chain_spec, example_spec, run_batches, write_jsonl
from service_helpers import rank_digests
from test_backend_faults import CountingClock, wait_for

import zephon_flow as zf
from zephon_flow.cli import main
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.errors import ChunkTimeoutError, SpecError, StageError, WorkerLostError
from zephon_flow.engine.simulate import global_batches
from zephon_flow.runners.backends import BACKENDS, RayBackend
from zephon_flow.runners.ray_env import RayUnavailableError
from zephon_flow.service.server import BatchServer

ray = pytest.importorskip("ray")

TARGET = 17


class Fault(beam.DoFn):  # type: ignore[misc]
    """Passes ``{"n": n}`` through; on record ``TARGET`` misbehaves as ``mode`` says (``once-*``
    modes only the first time: a marker file in ``marker_dir`` remembers)."""

    def __init__(self, mode: str, marker_dir: str) -> None:
        self.mode, self.marker_dir = mode, marker_dir

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        n = int(text)
        if n == TARGET and self.mode != "none":
            if self.mode.startswith("once-"):
                try:
                    os.close(os.open(os.path.join(self.marker_dir, "fired"), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    yield {"n": np.int64(n)}
                    return
            if self.mode.endswith("sigkill"):
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "exit":
                os._exit(3)
            if self.mode == "raise":
                raise ValueError(f"record {n} is cursed")
            if self.mode == "hang":
                Path(self.marker_dir, "stuck").touch()
                time.sleep(3600)
        yield {"n": np.int64(n)}


class CountSetup(beam.DoFn):  # type: ignore[misc]
    """Appends its process id to ``log`` in ``setup`` (a tokenizer load, say): one line per set-up."""

    def __init__(self, log: str) -> None:
        self.log = log

    def setup(self) -> None:
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        yield {"n": np.int64(int(text))}


def _spec(tmp_path: Path, dofn: beam.DoFn, *, records: int = 40) -> zf.LoaderSpec:
    path = tmp_path / f"docs{records}.jsonl"
    if not path.exists():
        write_jsonl(path, [str(i) for i in range(records)])
    return chain_spec(str(path), ("fault", dofn), lanes=2, global_batch_size=2, epochs=1, split_bytes=64)


def _digests(batches: list[dict[str, np.ndarray]]) -> list[str]:
    return [batch_digest(b) for b in batches]


# -- without a running Ray (these run first: the fixture below connects this process) ----------
def test_ray_is_a_backend_and_its_address_goes_with_it_only(tmp_path: Path) -> None:
    assert "ray" in BACKENDS
    spec = _spec(tmp_path, Fault("none", str(tmp_path)))
    with pytest.raises(
        SpecError, match=r"ray_address='ray://h:10001' goes with backend='ray'.*backend='processes'"
    ):
        zf.Loader(spec, backend="processes", ray_address="ray://h:10001")


def test_missing_ray_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    spec = _spec(tmp_path, Fault("none", str(tmp_path)))
    with pytest.raises(
        RayUnavailableError, match=r"backend='ray' needs Ray.*pip install 'zephon-flow\[ray\]'"
    ):
        zf.Loader(spec, backend="ray")


def test_serve_refuses_a_ray_address_without_the_ray_backend(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "nowhere:spec", "--port", "0", "--ray-address", "127.0.0.1:1"])
    assert code == 2
    assert "--ray-address goes with --backend ray" in capsys.readouterr().err


def test_serve_names_an_unreachable_ray_address(tmp_path: Path) -> None:
    # Ray retries a silent address for minutes (20 tries of ~40 s); its timeouts are read from
    # the environment when Ray is first imported, so the short ones need a fresh process.
    docs = write_jsonl(tmp_path / "docs.jsonl", ["1", "2"])
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "import apache_beam as beam\nimport zephon_flow as zf\nfrom zephon_flow import operators as ops\n"
        "def build(p):\n"
        f"    return p | 'docs' >> ops.ReadJsonl({docs!r}) | 'n' >> beam.ParDo(ops.Map(len))\n"
        "spec = zf.LoaderSpec(build, lanes=1, global_batch_size=1)\n",
        encoding="utf-8",
    )
    env = {
        **os.environ,
        "RAY_gcs_server_port_wait_time_s": "1",
        "RAY_py_gcs_connect_timeout_s": "2",
        "RAY_gcs_rpc_server_connect_timeout_s": "1",
    }
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from zephon_flow.cli import main; sys.exit(main(sys.argv[1:]))",
            "serve",
            f"{pipeline}:spec",
            "--port",
            "0",
            "--backend",
            "ray",
            "--ray-address",
            "127.0.0.1:1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < 60
    assert done.returncode == 1, done.stderr
    assert "zephon: error: backend='ray' could not reach the Ray cluster at '127.0.0.1:1'" in done.stderr
    assert "Check the address (ray://HOST:10001" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_local_ray_is_started_for_the_loader_and_shut_down_at_close(tmp_path: Path) -> None:
    assert not ray.is_initialized()
    spec = _spec(tmp_path, Fault("none", str(tmp_path)))
    expected = _digests(run_batches(spec))
    with zf.Loader(spec, backend="ray", workers=1) as loader:
        assert ray.is_initialized()
        got = [batch_digest(batch) for _, batch in loader]
    assert got == expected
    assert not ray.is_initialized()


# -- on one local Ray, shared by the tests below ---------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray with 2 CPUs on loopback for this module; shut down at its end."""
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.timeout(120)
def test_text_pipeline_batches_equal_inline_and_resume_a_processes_checkpoint(
    corpus: Corpus, ray_cluster: None
) -> None:
    spec = example_spec(corpus)
    expected = _digests(run_batches(spec, steps=8))
    # Two ranks' loaders at once in this process, each with two actors, on the 2 CPUs: they share
    # the fixture's Ray (and leave it running), and neither waits for the other's actors to go.
    both = global_batches(spec, steps=8, world_size=2, backend="ray", workers=2)
    assert [batch_digest(batch) for _, batch in both] == expected
    assert ray.is_initialized()
    # A checkpoint taken under processes continues under ray, byte for byte.
    with zf.Loader(spec, backend="processes", workers=2) as loader:
        for step, _ in loader:
            if step == 3:
                state = loader.state_dict()
                break
    with zf.Loader(spec, backend="ray", workers=2, state=state) as loader:
        resumed = [(step, batch_digest(batch)) for step, batch in itertools.islice(loader, 4)]
    assert resumed == list(enumerate(expected))[4:]


@pytest.mark.timeout(120)
def test_the_server_on_ray_serves_each_rank_the_embedded_loaders_rows(
    corpus: Corpus, ray_cluster: None
) -> None:
    spec = example_spec(corpus)
    srv = BatchServer(spec, backend="ray", workers=2, ahead=4).start()
    try:
        for rank in (0, 1):
            with zf.Client(f"127.0.0.1:{srv.port}", rank, 2) as client:
                got = [(step, batch_digest(batch)) for step, batch in itertools.islice(client, 4)]
            assert got == rank_digests(spec, rank, 2, 4)
    finally:
        srv.stop(grace=None)
    assert ray.is_initialized()  # the fixture's Ray: joined, not shut down


@pytest.mark.timeout(120)
def test_a_raising_stateless_op_fails_as_under_processes(tmp_path: Path, ray_cluster: None) -> None:
    spec = _spec(tmp_path, Fault("raise", str(tmp_path)))
    messages = []
    for backend in ("processes", "ray"):
        with pytest.raises(StageError) as info:
            run_batches(spec, backend=backend, workers=2, chunk_records=4)
        messages.append(str(info.value).split("\n\n-- traceback on the worker --")[0])
        assert "ValueError: record 17 is cursed" in str(info.value)
    assert messages[0] == messages[1]
    assert "DoFn 'fault'" in messages[1] and "docs40.jsonl byte 245" in messages[1]


class Unloadable(beam.DoFn):  # type: ignore[misc]
    """Loads only in the process that made it: what a DoFn whose module a node lacks does."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state["pid"] != os.getpid():
            raise RuntimeError("this DoFn's module is not installed here")
        self.__dict__.update(state)

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        yield {"n": np.int64(int(text))}


@pytest.mark.timeout(60)
def test_an_actor_that_cannot_load_the_dofns_fails_the_loader_saying_so(
    tmp_path: Path, ray_cluster: None
) -> None:
    with pytest.raises(StageError) as info:
        run_batches(_spec(tmp_path, Unloadable()), backend="ray", workers=2)
    text = str(info.value)
    assert "a Ray actor could not load the pipeline's DoFns: this DoFn's module is not installed here" in text
    assert "RuntimeError" in text  # the actor's traceback comes with it


@pytest.mark.timeout(120)
def test_setup_runs_once_per_actor_not_per_chunk(tmp_path: Path, ray_cluster: None) -> None:
    log = tmp_path / "setups.txt"
    spec = _spec(tmp_path, CountSetup(str(log)))
    expected = _digests(run_batches(spec))
    log.unlink()
    got = _digests(run_batches(spec, backend="ray", workers=2, chunk_records=2))
    assert got == expected  # 20 chunks of 2 records
    pids = log.read_text(encoding="utf-8").split()
    assert 1 <= len(pids) <= 2 and len(set(pids)) == len(pids)
    assert str(os.getpid()) not in pids


@pytest.mark.timeout(120)
def test_actors_killed_mid_run_are_replaced_with_batches_unchanged(tmp_path: Path, ray_cluster: None) -> None:
    spec = _spec(tmp_path, Fault("none", str(tmp_path)), records=120)
    expected = _digests(run_batches(spec))
    got: list[str] = []
    with zf.Loader(spec, backend="ray", workers=2, chunk_records=4, prefetch=1, prefetch_chunks=2) as loader:
        backend = loader._backend
        assert isinstance(backend, RayBackend)
        for step, batch in loader:
            got.append(batch_digest(batch))
            if step == 5:
                victims: list[Any] = [a.handle for a in backend._actors]
                for handle in victims:
                    ray.kill(handle, no_restart=True)
        replaced = backend._numbers
    assert got == expected
    assert replaced >= 4, "the killed actors were never replaced: the test tests nothing"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_actor_that_dies_on_a_record_is_replaced_and_the_chunk_rerun(
    tmp_path: Path, ray_cluster: None
) -> None:
    expected = _digests(run_batches(_spec(tmp_path, Fault("none", str(tmp_path)))))
    got = _digests(
        run_batches(
            _spec(tmp_path, Fault("once-sigkill", str(tmp_path))), backend="ray", workers=2, chunk_records=4
        )
    )
    assert (tmp_path / "fired").exists(), "the fault never fired: the test tests nothing"
    assert got == expected


@pytest.mark.timeout(120)
def test_a_stuck_call_is_named_and_its_actor_killed(tmp_path: Path, ray_cluster: None) -> None:
    # chunk_timeout is read on the loader's clock, which the test moves past it once the call
    # is stuck (one actor: the only call running then); nothing sleeps.
    spec = _spec(tmp_path, Fault("hang", str(tmp_path)))
    clock = CountingClock()
    loader = zf.Loader(spec, backend="ray", workers=1, chunk_records=4, chunk_timeout=1000.0, clock=clock)
    failed: list[BaseException] = []

    def consume() -> None:
        try:
            with loader:
                for _ in loader:
                    pass
        except BaseException as exc:
            failed.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    wait_for((tmp_path / "stuck").exists, seconds=60)
    clock.jump(990.0)
    assert consumer.is_alive() and not failed, f"timed out before chunk_timeout: {failed}"
    clock.advance(20.0)
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the stuck call was not timed out"
    assert len(failed) == 1 and isinstance(failed[0], ChunkTimeoutError), failed
    text = str(failed[0])
    assert "chunk_timeout=1000 s in DoFn 'fault' on the record at " in text
    assert "docs40.jsonl byte 245, via ReadJsonl('src')" in text
    assert "Ray actor " in text and "was killed and replaced" in text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_record_that_kills_every_actor_fails_naming_lane_and_records(
    tmp_path: Path, ray_cluster: None
) -> None:
    with pytest.raises(WorkerLostError) as info:
        run_batches(_spec(tmp_path, Fault("exit", str(tmp_path))), backend="ray", workers=2, chunk_records=4)
    text = str(info.value)
    assert "killed 3 Ray actors in a row" in text
    assert text.count("died (") == 3
    assert "lane " in text and "docs40.jsonl byte" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_bench_measures_both_backends_on_the_same_batches(
    tmp_path: Path, ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    from bench import ray_backend as bench

    # 12 steps, not 4: the loader makes a few steps ahead, so a 4-step run could have made them
    # all before its first batch and read 0 CPU seconds in its timed window.
    spec = bench.make_spec(*bench.make_data(tmp_path, 1000))
    results = bench.measure(spec, steps=12, workers=1, chunks=[16], repeats=1)
    row = results["16"]
    assert row["digests_equal"] is True
    assert row["processes"]["docs_per_cpu_s"] > 0 and row["ray"]["docs_per_cpu_s"] > 0
    assert row["ray_over_processes"] == row["ray"]["docs_per_cpu_s"] / row["processes"]["docs_per_cpu_s"]
    assert "| 16 |" in bench.render(results, 1)
