"""Contender: zephon-flow served over gRPC, ``zephon serve`` in a subprocess read by ``zf.Client``.

Each ``open`` writes the workload to a temporary JSON file, starts ``python -m zephon_flow.cli
serve bench.served:spec --host 127.0.0.1 --port 0`` (the OS picks a free port; the server prints
it) with the pipeline ``zephon_embedded`` builds, on ``backend`` (default ``processes``) with the
task's ``workers``, and reads this rank's slices with ``zf.Client(rank, world_size)``. ``close``
stops the server by its PID (SIGTERM, then SIGKILL to its process tree if it lingers). The
measurement includes the server's start-up, its work and the loopback transfer; the harness's
CPU accounting counts the server and its workers as child processes. Options: ``engine=hf|auto``,
``backend=processes|threads|inline``. Throughput only: the served loader's checkpoints are the
server's (``Checkpoint`` RPC, ``--resume``), not part of this contender.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.contenders.harness import Batch, main
from bench.served import ENGINE_ENV, WORKLOAD_ENV
from bench.workload import TextWorkload

ROOT = Path(__file__).resolve().parent.parent.parent
LISTENING = "zephon serve: listening on "


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stops the server by its PID: SIGTERM (it closes its loader and workers), then a kill of
    whatever of its tree is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            import psutil

            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            proc.kill()
            proc.wait(timeout=30)


def _package_root() -> Path:
    """Where the server's ``zephon_flow`` comes from: the folder this contender's own package
    was imported from (a baseline's unpacked package under ``bench.speed --baseline``, whose
    ``bench`` is a link to this one), else the repository."""
    import zephon_flow

    package = Path(zephon_flow.__file__).resolve().parent.parent
    return package if (package / "bench").exists() else ROOT


class _Session:
    def __init__(
        self, w: TextWorkload, *, rank: int, world_size: int, engine: str, backend: str, workers: int
    ):
        import zephon_flow as zf

        self._dir = tempfile.TemporaryDirectory(prefix="zephon-bench-serve-")
        workload = Path(self._dir.name) / "workload.json"
        workload.write_text(w.to_json(), encoding="utf-8")
        self._log = open(Path(self._dir.name) / "server.log", "w+", encoding="utf-8")  # noqa: SIM115
        root = _package_root()
        env = {**os.environ, WORKLOAD_ENV: str(workload), ENGINE_ENV: engine, "PYTHONPATH": str(root)}
        cmd = [sys.executable, "-m", "zephon_flow.cli", "serve", "bench.served:spec"]
        cmd += ["--host", "127.0.0.1", "--port", "0", "--backend", backend, "--workers", str(workers)]
        self._proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self._client: Any = None
        try:
            assert self._proc.stdout is not None
            line = self._proc.stdout.readline()
            if not line.startswith(LISTENING):
                self._log.seek(0)
                raise RuntimeError(f"zephon serve did not start: {line!r} {self._log.read()[-1500:]}")
            address = line[len(LISTENING) :].strip()
            self._client = zf.Client(address, rank, world_size)
        except BaseException:
            self.close()
            raise

    def batches(self) -> Iterator[Batch]:
        for _step, batch in self._client:
            yield batch

    def checkpoint(self) -> bytes:
        raise NotImplementedError("zephon_service: checkpoints are the server's, not measured here")

    def close(self) -> None:
        try:
            if self._client is not None:
                self._client.close()
        finally:
            _stop(self._proc)
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._log.close()
            self._dir.cleanup()


class ZephonService:
    resumable = False

    def __init__(self, options: dict[str, str]) -> None:
        self.engine = options.get("engine", "hf")
        self.backend = options.get("backend", "processes")
        backend = "" if self.backend == "processes" else f"{self.backend}_"
        self.name = f"zephon_service_{backend}{self.engine}"

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> _Session:
        if state is not None:
            raise NotImplementedError("zephon_service: resume is not part of this contender")
        return _Session(
            workload,
            rank=rank,
            world_size=world_size,
            engine=self.engine,
            backend=self.backend,
            workers=workers,
        )


if __name__ == "__main__":
    sys.exit(main(ZephonService))
