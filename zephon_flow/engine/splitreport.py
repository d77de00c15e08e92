"""``zephon inspect --splits``: each source's split plan, the lanes' shares, where each lane is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.dealing import Dealing


@dataclass(frozen=True, kw_only=True)
class LanePosition:
    """Where one lane is in one source: its pass and how much of its share of it is read."""

    lane: int
    epoch: int
    shares_done: int
    shares: int
    cost_done: float  # of the lane's share of this pass, in the source's cost unit
    cost: float


@dataclass(frozen=True, kw_only=True)
class SourceSplits:
    """One source's split plan and the lanes' shares of one pass."""

    label: str
    operator: str
    splits: int
    total_cost: int
    shared_splits: int  # splits read by several lanes by stride (no finer split possible)
    share_min: float
    share_mean: float
    share_max: float
    positions: tuple[LanePosition, ...]  # empty without a state


def split_report(spec: LoaderSpec, state: Any = None, *, epoch: int = 0) -> list[SourceSplits]:
    """Per source: the split count, the lanes' shares of pass ``epoch`` (min/mean/max cost) and,
    with ``state`` (a checkpoint), each lane's place in its current pass."""
    loaded: LoaderState | None = None if state is None else to_loader_state(state)
    report = []
    for index, sp in enumerate(spec.compile().sources):
        splits = sp.source.splits(spec.lanes)
        costs = [s.cost for s in splits]
        dealing = Dealing(costs, lanes=spec.lanes, seed=spec.seed, source=sp.label)
        loads = dealing.lane_costs(epoch)
        shared = {s.split for lane in range(spec.lanes) for s in dealing.shares(lane, epoch) if s.of > 1}
        positions: list[LanePosition] = []
        if loaded is not None:
            for lane, ls in sorted(loaded.lane_states.items()):
                at = ls.cursor.sources[index]
                pass_, item = at.epoch, at.share
                shares = dealing.shares(lane, pass_)
                done = sum(costs[s.split] / s.of for s in shares[:item])
                positions.append(
                    LanePosition(
                        lane=lane,
                        epoch=pass_,
                        shares_done=item,
                        shares=len(shares),
                        cost_done=done,
                        cost=sum(costs[s.split] / s.of for s in shares),
                    )
                )
        report.append(
            SourceSplits(
                label=sp.label,
                operator=sp.source.operator_name,
                splits=len(splits),
                total_cost=sum(costs),
                shared_splits=len(shared),
                share_min=min(loads),
                share_mean=sum(loads) / len(loads),
                share_max=max(loads),
                positions=tuple(positions),
            )
        )
    return report


def render_splits(report: list[SourceSplits], *, lanes: int) -> str:
    """The report as text, one block per source."""
    lines = []
    for src in report:
        spread = src.share_max / src.share_mean if src.share_mean else 0.0
        lines.append(
            f"source {src.label!r} ({src.operator}): {src.splits} splits, total cost {src.total_cost}"
        )
        lines.append(
            f"  per-lane share of a pass ({lanes} lanes): min {src.share_min:.0f}, mean {src.share_mean:.0f}, "
            f"max {src.share_max:.0f} (max/mean {spread:.2f})"
        )
        if src.shared_splits:
            lines.append(
                f"  {src.shared_splits} split(s) shared by stride (each sharing lane reads all of it)"
            )
        for pos in src.positions:
            pct = 100.0 * pos.cost_done / pos.cost if pos.cost else 100.0
            lines.append(
                f"  lane {pos.lane}: pass {pos.epoch}, {pos.shares_done}/{pos.shares} shares done "
                f"({pct:.0f}% of its share)"
            )
    return "\n".join(lines)
