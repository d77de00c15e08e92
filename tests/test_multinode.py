"""Lane owners on several Ray nodes: Ray's own multi-node test cluster (``ray.cluster_utils``,
several raylets on this machine), owners spread over the nodes, the rank (this process) on
none of them, whole nodes removed mid-run, and a cluster left without room for a replacement."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.cluster import OwnedLoader, OwnerLostError
from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.engine.simulate import global_digests

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

LANES, BATCH, STEPS = 6, 12, 30


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head with no CPU (the coordinator, which asks for none, lives there) and three
    one-CPU worker nodes, all on loopback: this machine's own address is not reachable, so
    Ray is told to resolve node addresses to loopback, as it does on a laptop."""
    from ray._private import ray_constants

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        made = _start_cluster()
        try:
            ray.init(address=made.address, log_to_driver=False, configure_logging=False)
            yield made
        finally:
            ray.shutdown()
            made.shutdown()


def _start_cluster() -> Any:
    """The head and three one-CPU nodes. Ray gives a raylet a fixed 30 s to register; on a
    loaded machine (two test workers, other jobs) a start can miss it, so a start that fails
    that way is shut down and made once more, as ``runners/ray_env.py`` does for ``ray.init``."""
    for attempt in (1, 2):
        made = None
        try:
            made = cluster_utils.Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
            )
            for _ in range(3):
                made.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            made.wait_for_nodes()
            return made
        except Exception as exc:
            if made is not None:
                made.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")


def test_owners_over_nodes_survive_the_loss_of_a_node_then_report_no_room(
    cluster: Any, corpus: Corpus
) -> None:
    spec = example_spec(corpus, lanes=LANES, global_batch_size=BATCH)
    reference = global_digests(spec, steps=STEPS)
    workers = {n.node_id: n for n in cluster.worker_nodes}
    got: list[tuple[int, str]] = []
    with OwnedLoader(
        spec,
        lane_owners=2,
        owner_cpus=1,
        name=f"multinode-{uuid.uuid4().hex[:8]}",
        snapshot_every=4,
        start_timeout=20,
    ) as loader:
        nodes = loader.owner_nodes()
        # The coordinator sits on this process's node (the head), not on an owner's.
        assert ray.get(loader._coordinator.node.remote()) == cluster.head_node.node_id
        assert len(set(nodes)) == 2 and set(nodes) <= set(workers)  # one owner per node, none here
        it = iter(loader)
        for _ in range(8):
            step, batch = next(it)
            got.append((step, batch_digest(batch)))

        # The node of owner 1 goes away: its owner is replaced on the spare node, same bytes.
        cluster.remove_node(workers.pop(nodes[1]))
        for _ in range(12):
            step, batch = next(it)
            got.append((step, batch_digest(batch)))
        assert loader.table.generations == (0, 1)
        moved = loader.owner_nodes()
        assert moved[0] == nodes[0] and moved[1] in workers and moved[1] != nodes[0]
        assert got == reference[:20]
        state = loader.checkpoint()

        # Now the node of owner 0 goes too: the one node left is full, and no replacement can
        # be placed. The rank is told which owner, which lanes and why, within start_timeout.
        cluster.remove_node(workers.pop(nodes[0]))
        with pytest.raises(
            OwnerLostError,
            match=r"lane owner 0 \(lanes \[0, 1, 2\]\) died at step \d+ and cannot be restarted .*did not start within 20 s \(start_timeout\): no node of the cluster has room for it \(it asks for num_cpus=1\)",
        ):
            for _ in range(STEPS):
                next(it)

    # The checkpoint taken on the cluster resumes on the embedded Loader at another world size.
    resumed = [zf.Loader(spec, rank=r, world_size=2, state=state, backend="inline") for r in range(2)]
    try:
        iters = [iter(ld) for ld in resumed]
        for _ in range(STEPS - 20):
            parts = [next(i) for i in iters]
            step = parts[0][0]
            got.append((step, batch_digest(concat([p[1] for p in parts]))))
    finally:
        for ld in resumed:
            ld.close()
    assert got == reference


RANK_1 = """
import json, sys
sys.path.insert(0, {tests!r})
import ray
from ray._private import ray_constants
from helpers import Corpus, example_spec
from zephon_flow.cluster import OwnedLoader
from zephon_flow.core.batches import batch_digest

ray_constants.ENABLE_RAY_CLUSTER = False  # as the fixture: node addresses on loopback
ray.init(address={address!r}, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
spec = example_spec(Corpus(**{corpus!r}), lanes={lanes}, global_batch_size={batch})
with OwnedLoader(spec, lane_owners=2, rank=1, world_size=2, name={name!r}) as loader:
    got = [(s, batch_digest(b)) for _, (s, b) in zip(range({steps}), loader)]
    print(json.dumps({{"coordinator": loader.coordinator_pid(), "got": got}}))
"""


def test_a_rank_in_another_process_joins_the_same_run(cluster: Any, corpus: Corpus) -> None:
    # Each Ray job has a namespace of its own unless told otherwise: a rank of another process
    # must still find the run by its name (one coordinator, one set of owners), not start its own.
    import dataclasses
    import json
    import subprocess
    import sys
    from pathlib import Path

    spec = example_spec(corpus, lanes=LANES, global_batch_size=BATCH)
    steps = 6
    expected = []
    for rank in (0, 1):
        with zf.Loader(spec, rank=rank, world_size=2, backend="inline") as embedded:
            expected.append([(s, batch_digest(b)) for _, (s, b) in zip(range(steps), embedded, strict=False)])
    name = f"multiproc-{uuid.uuid4().hex[:8]}"
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(corpus).items()}
    script = RANK_1.format(
        tests=str(Path(__file__).parent),
        address=cluster.address,
        corpus=fields,
        lanes=LANES,
        batch=BATCH,
        name=name,
        steps=steps,
    )
    with OwnedLoader(spec, lane_owners=2, rank=0, world_size=2, name=name) as loader:
        other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            got = [(s, batch_digest(b)) for _, (s, b) in zip(range(steps), loader, strict=False)]
            out, _ = other.communicate(timeout=120)
        finally:
            if other.poll() is None:
                other.kill()
                other.communicate()
        assert other.returncode == 0
        report = json.loads(out.strip().splitlines()[-1])
        assert report["coordinator"] == loader.coordinator_pid()
    assert got == expected[0]
    assert [tuple(x) for x in report["got"]] == expected[1]
