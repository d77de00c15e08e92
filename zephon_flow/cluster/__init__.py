"""Lanes run on Ray lane owners: the owner actor, the coordinator, and the loader that reads them."""

from zephon_flow.cluster.coordinator import Coordinator, OwnerLostError, OwnerTable, plan_owners
from zephon_flow.cluster.loader import CoordinatorLostError, OwnedLoader
from zephon_flow.cluster.owner import LaneOwner, OwnerError, OwnerOptions

__all__ = [
    "Coordinator",
    "CoordinatorLostError",
    "LaneOwner",
    "OwnedLoader",
    "OwnerError",
    "OwnerLostError",
    "OwnerOptions",
    "OwnerTable",
    "plan_owners",
]
