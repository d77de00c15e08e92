"""zephon-flow: elastically deterministic data loading for foundation-model training.

The global batch sequence is a pure function of the pipeline and its data, whatever the world
size, worker count, backend or resume point. ``docs/design.md`` in the repository is the map.
"""

import zephon_flow._quiet as _quiet

_quiet.quiet_beam_import_warnings()

# zf.cluster.OwnedLoader: the lanes on Ray lane owners (Ray is imported only when used).
from zephon_flow import cluster as cluster  # noqa: E402
from zephon_flow.core.batches import batch_digest  # noqa: E402
from zephon_flow.core.checkpoint.merge import merge_states  # noqa: E402
from zephon_flow.core.checkpoint.state import LoaderState  # noqa: E402
from zephon_flow.core.checkpoint.store import decode_state, encode_state, load_state, save_state  # noqa: E402
from zephon_flow.core.errors import (  # noqa: E402
    DataError,
    ServiceError,
    SpecError,
    StateError,
    ZephonError,
)
from zephon_flow.core.markers import ProvenanceParam, SeedParam  # noqa: E402
from zephon_flow.core.schedule import BatchSchedule, Ramp  # noqa: E402
from zephon_flow.engine.balance import RankBalance, balance_rows  # noqa: E402
from zephon_flow.engine.endsync import EndSync, ThreadEndSync, TorchEndSync  # noqa: E402
from zephon_flow.engine.loader import Loader  # noqa: E402
from zephon_flow.engine.materialize import GlobalBatches, materialize, read_materialized  # noqa: E402
from zephon_flow.engine.spec import LoaderSpec  # noqa: E402
from zephon_flow.service.client import Client  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BatchSchedule",
    "Client",
    "DataError",
    "EndSync",
    "GlobalBatches",
    "Loader",
    "LoaderSpec",
    "LoaderState",
    "ProvenanceParam",
    "Ramp",
    "RankBalance",
    "SeedParam",
    "ServiceError",
    "SpecError",
    "StateError",
    "ThreadEndSync",
    "TorchEndSync",
    "ZephonError",
    "balance_rows",
    "batch_digest",
    "decode_state",
    "encode_state",
    "load_state",
    "materialize",
    "merge_states",
    "read_materialized",
    "save_state",
]
