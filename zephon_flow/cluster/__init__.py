"""Lanes run on Ray lane owners: the owner actor, the coordinator, and the loader that reads them."""

from zephon_flow.cluster.coordinator import Coordinator, OwnerTable, plan_owners
from zephon_flow.cluster.loader import OwnedLoader
from zephon_flow.cluster.owner import LaneOwner, OwnerOptions
from zephon_flow.core.errors import CoordinatorLostError, OwnerError, OwnerLostError

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
