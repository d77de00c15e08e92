"""The batch service over a real loopback socket: ``zephon serve`` and trainer ranks in separate
processes, a rank killed mid-stream, a server killed with SIGKILL and resumed under another
world size. Servers bind 127.0.0.1 on free ports and are stopped by PID."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Corpus, example_spec
from service_helpers import ServerProcess, parse_digests, rank_digests, start_clients, write_pipeline

import zephon_flow as zf
from zephon_flow.core.batches import concat
from zephon_flow.engine.simulate import global_digests

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pipeline(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, zf.LoaderSpec]:
    root = tmp_path_factory.mktemp("serve")
    return f"{write_pipeline(root / 'pipeline.py', corpus)}:spec", example_spec(corpus)


@pytest.fixture
def server(pipeline: tuple[str, zf.LoaderSpec], tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(pipeline[0], log=tmp_path / "server.log")
    yield proc
    proc.kill()


def test_ranks_in_processes_get_the_embedded_loaders_slices_and_a_killed_rank_continues(
    pipeline: tuple[str, zf.LoaderSpec], server: ServerProcess
) -> None:
    spec, steps, world = pipeline[1], 8, 4
    procs = start_clients(
        server.address, [(r, world, 0, steps) for r in range(3)] + [(3, world, 0, 10**6, 0.5)]
    )
    doomed = procs[3]
    assert doomed.stdout is not None
    first = [doomed.stdout.readline() for _ in range(3)]
    os.kill(doomed.pid, signal.SIGKILL)
    rest, _ = doomed.communicate(timeout=30)
    seen = parse_digests("".join(first) + rest)
    assert [s for s, _ in seen] == list(range(len(seen)))
    assert len(seen) < steps  # killed mid-stream (it pauses 0.5 s per step)
    # The rank comes back (here, in the test's process) from the step after the last one it printed.
    resumed = []
    if len(seen) < steps:
        with zf.Client(server.address, 3, world, start_step=len(seen), fingerprint=spec.fingerprint) as again:
            for step, batch in again:
                resumed.append((step, zf.batch_digest(batch)))
                if step == steps - 1:
                    break
    got = {3: seen[:steps] + resumed}
    for rank, proc in enumerate(procs[:3]):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        got[rank] = parse_digests(out)
    for rank in range(world):
        assert got[rank] == rank_digests(spec, rank, world, steps), f"rank {rank}"


def test_server_killed_and_resumed_under_another_world_size_continues_the_sequence(
    pipeline: tuple[str, zf.LoaderSpec], tmp_path: Path
) -> None:
    target, spec = pipeline
    ckpt = tmp_path / "ckpt"
    first = ServerProcess(target, "--checkpoint-dir", str(ckpt), log=tmp_path / "first.log")
    batches: dict[int, list[dict[str, object]]] = {}
    try:
        clients = [zf.Client(first.address, r, 2, fingerprint=spec.fingerprint) for r in range(2)]
        iters = [iter(c) for c in clients]
        for _ in range(5):
            for r, it in enumerate(iters):
                step, batch = next(it)
                batches.setdefault(step, [None, None])[r] = batch  # type: ignore[list-item]
        path = clients[0].checkpoint()  # the state from which step 5 is next
        assert path == str(ckpt / "step-5.zfstate") and os.path.isfile(path)
        for c in clients:
            c.close()
    finally:
        first.kill(signal.SIGKILL)
    # A rank of the new world size connects before the new server is up: it retries with backoff.
    late = zf.Client(first.address, 0, 3, start_step=5, retries=12, backoff=0.1, max_backoff=2.0)
    second = ServerProcess(target, "--resume", path, port=first.port, log=tmp_path / "second.log")
    try:
        clients = [late] + [zf.Client(second.address, r, 3, start_step=5) for r in (1, 2)]
        iters = [iter(c) for c in clients]
        for _ in range(5):
            for r, it in enumerate(iters):
                step, batch = next(it)
                batches.setdefault(step, [None, None, None])[r] = batch  # type: ignore[list-item]
        for c in clients:
            c.close()
    finally:
        second.kill()
    got = [(step, zf.batch_digest(concat(batches[step]))) for step in sorted(batches)]  # type: ignore[arg-type]
    assert got == global_digests(spec, steps=10)
