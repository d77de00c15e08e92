"""Scale on paper: the lane owners' real planning and coordination code, with instant fake owners.

Run from the repository root::

    .venv/bin/python -m bench.scale_sim             # the sweep and the 1,024 / 64 / 4,096 point
    .venv/bin/python -m bench.scale_sim --quick     # a small sweep

Nothing runs a pipeline: the ``Coordinator`` (``zephon_flow/cluster/coordinator.py``) is the
real one, with owners that answer snapshot requests at once with synthetic lane states of
``--lane-state-bytes`` each; the ranks' planning is the real code (``OwnerTable.groups_for``,
``owner.share_of``); progress reports and gathers go through the real methods. Measured per
configuration (lanes L, owners N, ranks W, snapshot stride K):

- ``plan_seconds``: planning every rank's fetches of a step (which owners, which lanes, which
  rows): what each rank does once per table, again after a replacement;
- ``fetches_per_step``: rank -> owner requests per step (the data path, not the coordinator);
- ``coordinator_messages_per_step`` and ``coordinator_bytes_per_step``: progress reports and
  snapshot gathers, averaged over the run;
- ``coordinator_seconds_per_step``: the coordinator's time for them;
- ``checkpoint_seconds``, ``checkpoint_encode_seconds`` and ``checkpoint_bytes``: gathering
  every owner's snapshots at a step into one ``LoaderState``, encoding it, and its size.

The formulas these follow are in ``docs/scale.md``; ``formulas`` computes them and
``tests/test_lane_owners.py`` checks them against a small simulated run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "scale_sim.json")
#: Bytes of one progress report on the wire (AckRequest: a 64-hex fingerprint, rank, world
#: size, step) and of one snapshot request (owner call: the step).
PROGRESS_BYTES = 80
GATHER_REQUEST_BYTES = 16


@dataclass(frozen=True)
class Point:
    lanes: int
    owners: int
    ranks: int
    snapshot_every: int
    steps: int
    plan_seconds: float
    fetches_per_step: float
    coordinator_messages_per_step: float
    coordinator_bytes_per_step: float
    coordinator_seconds_per_step: float
    checkpoint_seconds: float
    checkpoint_encode_seconds: float
    checkpoint_bytes: int


def _spec(lanes: int, ranks: int, root: str) -> Any:
    import apache_beam as beam

    import zephon_flow as zf
    from zephon_flow import operators as ops

    path = os.path.join(root, "one.jsonl")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write('{"text": "x"}\n')

    def build(p: beam.Pipeline) -> beam.PCollection:
        return p | "src" >> ops.ReadJsonl(path)

    batch = int(np.lcm(lanes, ranks))
    return zf.LoaderSpec(build, lanes=lanes, seed=0, global_batch_size=batch)


class FakeOwner:
    """An owner answering at once: synthetic snapshots of its lanes, counting its calls."""

    def __init__(self, lanes: list[int], lane_state_bytes: int, sources: int) -> None:
        from zephon_flow.core.checkpoint.state import FeedCursor, LaneState, SourceCursor, StageState

        self.lanes, self.calls = lanes, 0
        # Random bytes: the encoded checkpoint cannot compress them away.
        blob = np.random.default_rng(lanes[0]).integers(0, 256, lane_state_bytes, dtype=np.uint8)
        self._states = {
            lane: LaneState(
                lane,
                FeedCursor(0, [SourceCursor(0, 0, 0, 0) for _ in range(sources)], skipped=[0] * sources),
                stages={"stage": StageState(values={"buffer": blob})},
            )
            for lane in lanes
        }

    def snapshot(self, step: int) -> dict[int, Any]:
        self.calls += 1
        return self._states


def formulas(
    *, lanes: int, owners: int, ranks: int, snapshot_every: int, lane_state_bytes: int
) -> dict[str, float]:
    """What the measurements follow (per step, averaged over a run of whole strides).

    Fetches: the (rank, owner) pairs whose rows meet; for contiguous rows cut into W ranks and
    contiguous lanes cut into N owners that is ``W + N - 1 - c``, with ``c`` the interior cut
    points the two partitions share. Coordinator: every rank reports every K steps (W/K
    messages) and, per stride, it asks each of the N owners for its lanes' snapshot (2N/K
    messages, request and reply, the replies carrying every lane's state)."""
    batch = int(np.lcm(lanes, ranks))
    owner_cuts = {(i * lanes // owners) * (batch // lanes) for i in range(1, owners)}
    rank_cuts = {r * (batch // ranks) for r in range(1, ranks)}
    shared = len(owner_cuts & rank_cuts)
    k = snapshot_every
    return {
        "fetches_per_step": ranks + owners - 1 - shared,
        "coordinator_messages_per_step": (ranks + 2 * owners) / k,
        "coordinator_bytes_per_step": (
            ranks * PROGRESS_BYTES + owners * GATHER_REQUEST_BYTES + lanes * lane_state_bytes
        )
        / k,
    }


def simulate(
    *, lanes: int, owners: int, ranks: int, snapshot_every: int, steps: int, lane_state_bytes: int, root: str
) -> Point:
    """One configuration: a run of ``steps`` steps through the real coordinator."""
    from zephon_flow.cluster.coordinator import Coordinator
    from zephon_flow.cluster.owner import share_of
    from zephon_flow.core.checkpoint.store import encode_state
    from zephon_flow.core.lanes import RankSlice

    spec = _spec(lanes, ranks, root)
    sources = len(spec.compile().sources)
    fakes: list[FakeOwner] = []

    def launch(
        index: int, name: str, group: list[int], state: Any, readers: dict[int, int], generation: int
    ) -> FakeOwner:
        fakes.append(FakeOwner(group, lane_state_bytes, sources))
        return fakes[-1]

    gathered = [0, 0]  # snapshot calls, their bytes (request and reply)

    def gather(owner: FakeOwner, step: int) -> Any:
        gathered[0] += 1
        gathered[1] += GATHER_REQUEST_BYTES + len(owner.lanes) * lane_state_bytes
        return owner.snapshot(step)

    coord = Coordinator(
        spec,
        owners=owners,
        world_size=ranks,
        state=None,
        launch=launch,
        gather=gather,
        snapshot_every=snapshot_every,
    )
    # Planning: every rank's owners, lanes and rows, as OwnedLoader and the Client's fan-in do.
    start = time.perf_counter()
    table = coord.table()
    fetches = 0
    for r in range(ranks):
        rs = RankSlice(rank=r, world_size=ranks, lanes=lanes, global_batch_size=spec.global_batch_size)
        for _owner, group in table.groups_for(rs.lane_ids):
            share_of(rs, group)
            fetches += 1
    plan_seconds = time.perf_counter() - start
    # The run: each rank reports every K steps (the loaders' progress), in rank order.
    base_messages = coord.messages
    start = time.perf_counter()
    for step in range(1, steps + 1):
        if step % snapshot_every == 0:
            for r in range(ranks):
                coord.progress(r, step)
    run_seconds = time.perf_counter() - start
    reports = coord.messages - base_messages
    messages = reports + 2 * gathered[0]
    bytes_total = reports * PROGRESS_BYTES + gathered[1]
    start = time.perf_counter()
    state = coord.checkpoint(steps)
    checkpoint_seconds = time.perf_counter() - start
    start = time.perf_counter()
    encoded = encode_state(state)
    encode_seconds = time.perf_counter() - start
    return Point(
        lanes=lanes,
        owners=owners,
        ranks=ranks,
        snapshot_every=snapshot_every,
        steps=steps,
        plan_seconds=plan_seconds,
        fetches_per_step=float(fetches),
        coordinator_messages_per_step=messages / steps,
        coordinator_bytes_per_step=bytes_total / steps,
        coordinator_seconds_per_step=run_seconds / steps,
        checkpoint_seconds=checkpoint_seconds,
        checkpoint_encode_seconds=encode_seconds,
        checkpoint_bytes=len(encoded),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--snapshot-every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--lane-state-bytes", type=int, default=4096)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    grid = [(1024, 64, 4096)]
    if args.quick:
        grid = [(64, 8, 256), (256, 16, 1024)]
    else:
        grid += [(lanes, 64, 4096) for lanes in (256, 512, 2048)]
        grid += [(1024, owners, 4096) for owners in (8, 16, 32, 128)]
        grid += [(1024, 64, ranks) for ranks in (512, 1024, 2048, 8192)]
    points = []
    with tempfile.TemporaryDirectory() as root:
        for lanes, owners, ranks in grid:
            p = simulate(
                lanes=lanes,
                owners=owners,
                ranks=ranks,
                snapshot_every=args.snapshot_every,
                steps=args.steps,
                lane_state_bytes=args.lane_state_bytes,
                root=root,
            )
            f = formulas(
                lanes=lanes,
                owners=owners,
                ranks=ranks,
                snapshot_every=args.snapshot_every,
                lane_state_bytes=args.lane_state_bytes,
            )
            points.append({"measured": asdict(p), "formula": f})
            print(
                f"L={lanes:5d} N={owners:4d} W={ranks:5d}: plan {p.plan_seconds * 1e3:8.1f} ms, "
                f"fetches/step {p.fetches_per_step:6.0f} (formula {f['fetches_per_step']:6.0f}), "
                f"coordinator {p.coordinator_messages_per_step:7.1f} msg/step (formula "
                f"{f['coordinator_messages_per_step']:7.1f}), {p.coordinator_bytes_per_step / 1e3:8.1f} kB/step, "
                f"{p.coordinator_seconds_per_step * 1e3:7.2f} ms/step, checkpoint "
                f"{p.checkpoint_seconds * 1e3:7.1f} ms + encode {p.checkpoint_encode_seconds * 1e3:7.1f} ms, "
                f"{p.checkpoint_bytes / 1e6:6.2f} MB",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump({"config": vars(args), "points": points}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
