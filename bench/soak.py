"""Soak: ``zephon serve`` for minutes under faults (worker SIGKILLs, a server SIGKILL + --resume, a
client reconnect), its RSS, fds and threads over time, and every digest against ``zephon digest``.

    python -m bench.soak                 # 20 minutes
    python -m bench.soak --minutes 5     # shortened

Two trainer ranks (world size 2) read from one server (processes backend, 2 workers) at a fixed
pace; the server writes a checkpoint every ``--checkpoint-steps`` steps (``zephon serve
--checkpoint-every``; the default is about a minute on a small machine), keeping 3. Every ``--kill-every`` seconds a worker process of the server is SIGKILLed
(the backend replaces it); at half time the server itself is SIGKILLed and restarted with
``--resume`` from its newest checkpoint on the same port (the clients reconnect by themselves);
at a quarter of the time rank 1's client process is killed and started again from the step after
its last one. Every (step, rank) digest is compared with the rank's rows of an uninterrupted
embedded run, whose global digests are checked against ``zephon digest``. Prints one JSON
report; ``--json PATH`` writes it too.

``--owners N`` soaks served lane owners instead: ``zephon serve --ray --lane-owners N
--world-size 2`` (a local Ray started by the server), clients ``zf.Client(...,
lane_owners=True)``. Its faults: every ``--kill-every`` seconds an owner actor's process
(``ray::OwnerActor``) is SIGKILLed (the coordinator replaces it); at three eighths of the time
the coordinator's process (``ray::CoordinatorActor``) is SIGKILLed (Ray restarts it and it takes
the live owners over); the client reconnect and, unless ``--no-server-restart``, the server
SIGKILL + ``--resume`` from its newest checkpoint manifest as above. RSS, fds and threads are
summed over the server's whole process tree (Ray's GCS, raylet, agents, the coordinator and the
owners) and over the clients.

    python -m bench.soak --owners 2 --minutes 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

TARGET = "zephon_flow.demo:demo_spec"
WORLD = 2


# -- the client side: one trainer rank ----------------------------------------------------------
#: Steps every rank reads after its last (re)start before the soak stops (``--settle``).
SETTLE_STEPS = 3


def client_main(address: str, rank: int, start: int, pace: float, out: str, owners: bool = False) -> int:
    import zephon_flow as zf

    with (
        open(out, "a", encoding="utf-8") as f,
        zf.Client(
            address,
            rank,
            WORLD,
            start_step=start,
            retries=40,
            backoff=0.2,
            max_backoff=2.0,
            lane_owners=owners,
        ) as client,
    ):
        for step, batch in client:
            f.write(f"{step} {zf.batch_digest(batch)}\n")
            f.flush()
            time.sleep(pace)
    return 0


def _start_client(
    address: str, rank: int, start: int, pace: float, out: Path, owners: int = 0
) -> subprocess.Popen[bytes]:
    flag = ["--owners", str(owners)] if owners else []
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.soak",
            *flag,
            "--client",
            address,
            str(rank),
            str(start),
            str(pace),
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(str(out) + ".err", "ab"),
    )


# -- the server --------------------------------------------------------------------------------
def _start_server(
    port: int, ckpt: Path, every: int, log: Path, resume: str | None, owners: int = 0
) -> tuple[subprocess.Popen[bytes], int]:
    if owners:
        # Served lane owners on a local Ray; replacements are the fault here, so never run out.
        how = [
            "--ray",
            "--lane-owners",
            str(owners),
            "--world-size",
            str(WORLD),
            "--max-replacements",
            "1000",
        ]
    else:
        how = ["--backend", "processes", "--workers", "2"]
    cmd = [
        sys.executable,
        "-m",
        "zephon_flow.cli",
        "serve",
        TARGET,
        "--port",
        str(port),
        *how,
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(every),
        "--keep-checkpoints",
        "3",
    ]
    if resume:
        cmd += ["--resume", resume]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "ab"))  # noqa: SIM115
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "listening on" not in line:
        raise RuntimeError(f"the server did not start: {line!r}; see {log}")
    return proc, int(line.rsplit(":", 1)[1])


def _workers(server: psutil.Process) -> list[psutil.Process]:
    """The server's worker processes: the children of its forkserver (one of its children)."""
    out = []
    for child in server.children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                out.extend(child.children())
        except psutil.NoSuchProcess:
            continue
    return out


def _actors(server: psutil.Process, kind: str) -> list[psutil.Process]:
    """The server's Ray actor processes of class ``kind`` (``OwnerActor``, ``CoordinatorActor``):
    Ray names a worker process ``ray::<class>`` once its actor is placed."""
    out = []
    for p in server.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if cmd.startswith("ray::") and kind in cmd and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _tree(procs: list[psutil.Process]) -> tuple[float, float, float, int]:
    """Summed RSS (MB), fds and threads of ``procs``, and how many are alive."""
    rss = fds = threads = alive = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            threads += p.num_threads()
            alive += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return rss / 1e6, float(fds), float(threads), alive


def _sample(pid: int, clients: list[int] | None = None) -> dict[str, float]:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    rss, fds, threads, alive = _tree(procs)
    out = {
        "server_rss_mb": root.memory_info().rss / 1e6,
        "tree_rss_mb": rss,
        "fds": float(root.num_fds()),
        "threads": float(root.num_threads()),
        "processes": float(alive),
        "tree_fds": fds,
        "tree_threads": threads,
    }
    if clients:
        own: list[psutil.Process] = []
        for c in clients:
            with contextlib.suppress(psutil.NoSuchProcess):
                own.append(psutil.Process(c))
        crss, cfds, cthreads, _ = _tree(own)
        out.update(clients_rss_mb=crss, clients_fds=cfds, clients_threads=cthreads)
    return out


def _newest_checkpoint(ckpt: Path) -> str:
    names = sorted(ckpt.glob("step-*.zfstate"), key=lambda p: int(p.name[5:-8]))
    if not names:
        raise RuntimeError(f"no checkpoint in {ckpt} to resume from")
    return str(names[-1])


def _read_digests(path: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                step, digest = line.split()
                out.setdefault(int(step), set()).add(digest)
    return out


def _slope_per_minute(times: list[float], values: list[float]) -> float:
    if len(times) < 3:
        return float("nan")
    slope, _ = np.polyfit(np.asarray(times), np.asarray(values), 1)
    return float(slope * 60)


def _slope_per_hour(times: list[float], values: list[float]) -> float:
    if len(times) < 3:
        return float("nan")
    slope, _ = np.polyfit(np.asarray(times), np.asarray(values), 1)
    return float(slope * 3600)


# -- the reference -------------------------------------------------------------------------------
def reference(steps: int) -> tuple[dict[int, list[str]], bool]:
    """Per step, each rank's digest from an uninterrupted embedded run; and whether its global
    digests equal ``zephon digest``'s."""
    import zephon_flow as zf
    from zephon_flow.core.lanes import RankSlice
    from zephon_flow.demo import demo_spec
    from zephon_flow.service.wire import slice_rows

    spec = demo_spec()
    cuts = [
        RankSlice(rank=r, world_size=WORLD, lanes=spec.lanes, global_batch_size=spec.global_batch_size)
        for r in range(WORLD)
    ]
    ranks: dict[int, list[str]] = {}
    whole: list[str] = []
    with zf.Loader(spec, backend="processes", workers=2) as loader:
        for step, batch in loader:
            # The server's own slicing (ragged provenance fields are cut by their counts).
            ranks[step] = [zf.batch_digest(slice_rows(batch, c.start, c.stop)) for c in cuts]
            whole.append(f"{step} {zf.batch_digest(batch)}")
            if step + 1 == steps:
                break
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "zephon_flow.cli",
            "digest",
            TARGET,
            "--steps",
            str(steps),
            "--backend",
            "processes",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return ranks, cli.stdout.split("\n")[:steps] == whole


# -- the run -----------------------------------------------------------------------------------
def soak(
    minutes: float,
    pace: float,
    kill_every: float,
    sample_every: float,
    checkpoint_steps: int,
    owners: int = 0,
    server_restart: bool = True,
    settle: float = 120.0,
) -> dict[str, Any]:
    from zephon_flow.demo_data import build_demo_data

    build_demo_data()  # the corpus is built (or found cached) before the clock starts
    work = Path(tempfile.mkdtemp(prefix="zephon-soak-"))
    ckpt = work / "ckpt"
    every = checkpoint_steps
    log = work / "server.log"
    server, port = _start_server(0, ckpt, every, log, None, owners)
    address = f"127.0.0.1:{port}"
    outs = [work / f"rank{r}.txt" for r in range(WORLD)]
    clients = [_start_client(address, r, 0, pace, outs[r], owners) for r in range(WORLD)]
    starts = [0] * WORLD  # the step each rank's client was last started from
    events: list[str] = []
    samples: list[dict[str, float]] = []
    trees: set[tuple[int, float]] = set()  # (pid, start time) of every server's tree, to reap
    duration = minutes * 60
    started = time.monotonic()
    next_kill = kill_every
    restarted = reconnected = coordinator_killed = False
    worker_kills = 0
    exits: list[int] = []
    client_exits: list[str] = []
    try:
        while (now := time.monotonic() - started) < duration:
            if server.poll() is not None:
                exits.append(server.returncode)
                events.append(f"{now:.0f}s: the server exited by itself with status {server.returncode}")
                break
            with contextlib.suppress(psutil.NoSuchProcess):
                samples.append({"t": now, **_sample(server.pid, [c.pid for c in clients])})
                trees.update(_identities(psutil.Process(server.pid).children(recursive=True)))
            for r, c in enumerate(clients):
                if (
                    c.poll() is not None
                ):  # a rank that gave up: started again, as a trainer's supervisor would
                    last = max(_read_digests(outs[r]), default=-1)
                    clients[r] = _start_client(address, r, last + 1, pace, outs[r], owners)
                    starts[r] = last + 1
                    client_exits.append(
                        f"{now:.0f}s: rank {r} exited ({c.returncode}): {_last_error(outs[r])}"
                    )
                    events.append(
                        f"{now:.0f}s: client rank {r} had exited by itself; restarted from step {last + 1}"
                    )
            if now >= next_kill:
                next_kill = now + kill_every  # not a burst of kills after a slow restart
                root = psutil.Process(server.pid)
                victims = _actors(root, "OwnerActor") if owners else _workers(root)
                if victims:
                    victim = victims[worker_kills % len(victims)] if owners else victims[0]
                    os.kill(victim.pid, signal.SIGKILL)
                    worker_kills += 1
                    what = "owner" if owners else "worker"
                    events.append(f"{now:.0f}s: SIGKILL {what} pid {victim.pid}")
            if owners and not coordinator_killed and now >= duration * 3 / 8:
                found = _actors(psutil.Process(server.pid), "CoordinatorActor")
                if found:
                    coordinator_killed = True
                    os.kill(found[0].pid, signal.SIGKILL)
                    events.append(f"{now:.0f}s: SIGKILL coordinator pid {found[0].pid}")
            if not reconnected and now >= duration / 4:
                reconnected = True
                clients[1].kill()
                clients[1].wait()
                last = max(_read_digests(outs[1]), default=-1)
                clients[1] = _start_client(address, 1, last + 1, pace, outs[1], owners)
                starts[1] = last + 1
                events.append(f"{now:.0f}s: client rank 1 killed and restarted from step {last + 1}")
            if server_restart and not restarted and now >= duration / 2 and list(ckpt.glob("step-*.zfstate")):
                restarted = True
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
                _reap(trees)
                resume = _newest_checkpoint(ckpt)
                t0 = time.monotonic()
                server, _ = _start_server(port, ckpt, every, log, resume, owners)
                events.append(
                    f"{now:.0f}s: SIGKILL server; restarted with --resume {Path(resume).name} in "
                    f"{time.monotonic() - t0:.1f} s"
                )
            time.sleep(sample_every)
        # Without more faults, until every rank has read a few steps since it was last started
        # (at most ``settle`` seconds): on a loaded machine a short run can end while a rank
        # restarted next to a coordinator's restart has read nothing yet.
        settle_until = time.monotonic() + settle
        while time.monotonic() < settle_until and server.poll() is None:
            gone = [r for r, c in enumerate(clients) if c.poll() is not None]
            for r in gone:  # reported as in the run; not started again
                now = time.monotonic() - started
                client_exits.append(
                    f"{now:.0f}s: rank {r} exited ({clients[r].returncode}): {_last_error(outs[r])}"
                )
            if gone or all(
                max(_read_digests(o), default=-1) >= s + SETTLE_STEPS - 1
                for o, s in zip(outs, starts, strict=True)
            ):
                break
            time.sleep(min(sample_every, 1.0))
    finally:
        for c in clients:
            c.kill()
            c.wait()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        left = _reap(trees)
    got = [_read_digests(o) for o in outs]
    steps = min(max(g, default=-1) for g in got) + 1
    ranks, cli_matches = reference(steps) if steps > 0 else ({}, False)  # a rank read nothing
    compared = mismatched = 0
    first_mismatch: list[tuple[int, int]] = []
    for r, g in enumerate(got):
        for step, digests in g.items():
            if step < steps:
                compared += 1
                if digests != {ranks[step][r]}:
                    mismatched += 1
                    first_mismatch.append((step, r))
    # RSS after the restart only: the new server's life is the longer steady state.
    settled = duration / 2 + 30 if restarted else 60.0
    after = [s for s in samples if s["t"] > settled] or samples
    t = [s["t"] for s in after]
    served_s = max(s["t"] for s in samples) if samples else duration
    report: dict[str, Any] = {
        "mode": f"{owners} served lane owners (zephon serve --ray)" if owners else "zephon serve",
        "minutes": minutes,
        "steps_per_second": steps / served_s,
        "pace_s": pace,
        "checkpoint_every_steps": every,
        "steps_served_per_rank": steps,
        "digests_compared": compared,
        "digests_mismatched": mismatched,
        "first_mismatches": sorted(first_mismatch)[:5],
        "reference_matches_zephon_digest": cli_matches,
        "server_exits": exits,
        "client_exits": client_exits,
        ("owner_kills" if owners else "worker_kills"): worker_kills,
        "events": events,
        "checkpoints_left": sorted(p.name for p in ckpt.glob("step-*.zfstate")),
        "processes_left_after_stop": left,
        "server_rss_mb": {"first": samples[0]["server_rss_mb"], "last": samples[-1]["server_rss_mb"]},
        "tree_rss_mb_max": max(s["tree_rss_mb"] for s in samples),
        "slopes_from_s": settled,
        "server_rss_slope_mb_per_hour": _slope_per_hour(t, [s["server_rss_mb"] for s in after]),
        "tree_rss_slope_mb_per_hour": _slope_per_hour(t, [s["tree_rss_mb"] for s in after]),
        "tree_rss_slope_mb_per_min": _slope_per_minute(t, [s["tree_rss_mb"] for s in after]),
        "clients_rss_slope_mb_per_min": _slope_per_minute(t, [s.get("clients_rss_mb", 0.0) for s in after]),
        "fds": [min(s["fds"] for s in after), max(s["fds"] for s in after)],
        "threads": [min(s["threads"] for s in after), max(s["threads"] for s in after)],
        "processes": [min(s["processes"] for s in after), max(s["processes"] for s in after)],
        "tree_fds_first_last": [after[0]["tree_fds"], after[-1]["tree_fds"]],
        "tree_threads_first_last": [after[0]["tree_threads"], after[-1]["tree_threads"]],
        "tree_fds_range": [min(s["tree_fds"] for s in after), max(s["tree_fds"] for s in after)],
        "tree_threads_range": [min(s["tree_threads"] for s in after), max(s["tree_threads"] for s in after)],
        "clients_rss_mb_first_last": [after[0].get("clients_rss_mb"), after[-1].get("clients_rss_mb")],
        "clients_fds_first_last": [after[0].get("clients_fds"), after[-1].get("clients_fds")],
        "clients_threads_first_last": [after[0].get("clients_threads"), after[-1].get("clients_threads")],
        "rss_timeline": [
            (
                round(s["t"]),
                round(s["server_rss_mb"]),
                round(s["tree_rss_mb"]),
                round(s.get("clients_rss_mb", 0)),
            )
            for s in samples[:: max(1, len(samples) // 20)]
        ],
        "work_dir": str(work),
    }
    return report


def _last_error(out: Path) -> str:
    """The last line of a client's stderr (its exception)."""
    err = Path(str(out) + ".err")
    lines = (
        [line for line in err.read_text(errors="replace").splitlines() if line.strip()]
        if err.exists()
        else []
    )
    return lines[-1][:400] if lines else "(no stderr)"


def _identities(procs: list[psutil.Process]) -> set[tuple[int, float]]:
    out = set()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.add((p.pid, p.create_time()))
    return out


def _reap(procs: set[tuple[int, float]], wait: float = 45.0) -> int:
    """Waits for the processes of a stopped or killed server's tree (Ray's own end with their
    parent), then SIGKILLs, by PID, those still there (the same process: its start time is
    checked); returns how many had to be killed."""
    deadline = time.monotonic() + wait
    alive = [p for p in procs if _running(*p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _running(*p)]
    for pid, _ in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    procs.clear()
    return len(alive)


def _running(pid: int, created: float) -> bool:
    try:
        p = psutil.Process(pid)
        return bool(p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--pace", type=float, default=0.1, help="seconds a client waits after each step")
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument(
        "--checkpoint-steps",
        type=int,
        default=60,
        help="zephon serve --checkpoint-every (about a minute at this machine's ~1-2 steps/s)",
    )
    parser.add_argument(
        "--owners", type=int, default=0, metavar="N", help="soak zephon serve --ray --lane-owners N instead"
    )
    parser.add_argument(
        "--no-server-restart", action="store_true", help="no server SIGKILL + --resume at half time"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=120.0,
        help=f"after the faults, seconds at most to wait until every rank read {SETTLE_STEPS} steps since its last start",
    )
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument(
        "--client", nargs=5, metavar=("ADDRESS", "RANK", "START", "PACE", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.client:
        address, rank, start, pace, out = args.client
        return client_main(address, int(rank), int(start), float(pace), out, owners=args.owners > 0)
    report = soak(
        args.minutes,
        args.pace,
        args.kill_every,
        args.sample_every,
        args.checkpoint_steps,
        owners=args.owners,
        server_restart=not args.no_server_restart,
        settle=args.settle,
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    ok = report["digests_mismatched"] == 0 and report["reference_matches_zephon_digest"]
    return 0 if ok and not report["server_exits"] else 1


if __name__ == "__main__":
    sys.exit(main())
