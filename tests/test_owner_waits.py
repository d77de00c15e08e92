"""Lane owners' waits read an injected clock: a ``ManualClock`` drives an owner's waits for a
step, its served streams' ``--stream-timeout``, the fan-in's wait for a step and an owner's
watch for its coordinator, so these tests move the clock instead of sleeping (each would wait
30 s or more on the system's clock). ``OwnedLoader``'s own polls: ``tests/test_lane_owners.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import cast

import grpc
import pytest
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.cluster import LaneOwner, OwnerOptions
from zephon_flow.cluster.actors import await_orphaned
from zephon_flow.cluster.serving import OwnerServer, Serving, _Acks
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.clock import ManualClock, wait_for_arrival, wait_until
from zephon_flow.core.lanes import RankSlice
from zephon_flow.service._proto import lane_owners_pb2 as lo
from zephon_flow.service.fanin import ACKS_METADATA
from zephon_flow.service.rpc import unary_handler
from zephon_flow.service.wire import encode_step

LANES, BATCH = 4, 8
_M = "/zephon.v1.LaneOwners/"


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH)


def _owner(spec: zf.LoaderSpec, clock: ManualClock) -> LaneOwner:
    """An owner of every lane, not started: nothing is produced and no other thread moves the
    clock, so each wait below runs to its deadline and the clock shows exactly how long."""
    return LaneOwner(
        spec, list(range(LANES)), state=None, readers={0: 0, 1: 0}, options=OwnerOptions(), clock=clock
    )


def test_wait_until_reads_the_clock_and_its_predicate() -> None:
    clock, cond = ManualClock(), threading.Condition()
    with cond:
        assert not wait_until(clock, cond, lambda: False, 30)
        assert clock.waited == pytest.approx(30)  # in pauses of at most 0.2 s: no real sleep
        looks = iter([False, False, True])
        assert wait_until(clock, cond, lambda: next(looks), None)
        assert clock.waited == pytest.approx(30.4)
        empty: dict[int, bool] = {}
        with pytest.raises(KeyError):  # a predicate that raises ends the wait
            wait_until(clock, cond, lambda: empty[0], 5)


def _advance_until_done(clock: ManualClock, waiter: threading.Thread, step: float) -> None:
    """Moves the clock on while ``waiter`` waits (it does not move it itself)."""
    while waiter.is_alive():
        clock.advance(step)
        waiter.join(0.05)


def test_a_wait_for_an_arrival_does_not_move_the_clock_and_ends_when_it_is_moved() -> None:
    clock, cond = ManualClock(), threading.Condition()
    arrived: list[str] = []
    results: list[bool] = []

    def wait() -> None:
        with cond:
            results.append(wait_for_arrival(clock, cond, lambda: bool(arrived), 30))

    waiter = threading.Thread(target=wait)
    waiter.start()
    with cond:
        arrived.append("message")
        cond.notify_all()
    waiter.join(60)
    assert results == [True] and clock.waited == 0  # the wait itself did not move the clock
    arrived.clear()
    waiter = threading.Thread(target=wait)
    waiter.start()
    _advance_until_done(clock, waiter, 10)
    assert results == [True, False] and clock.now() >= 30


def test_an_owners_waits_for_a_step_read_its_clock(spec: zf.LoaderSpec) -> None:
    clock = ManualClock()
    owner = _owner(spec, clock)
    rs = RankSlice(rank=0, world_size=2, lanes=LANES, global_batch_size=BATCH)
    try:
        assert owner.rows(0, 0, timeout=30) is None
        assert clock.waited == pytest.approx(30)
        assert owner.share(rs, 0, timeout=15) is None
        assert owner.shares(rs, 0, 3, timeout=15) is None
        assert owner.live(0, timeout=45) is None
        assert clock.waited == pytest.approx(105)
        # The snapshot of the start is there at once; the check of its next window (known only
        # once that window is made) is waited for, then left out.
        snaps = owner.snapshot(0, timeout=20)
        assert snaps is not None and sorted(snaps) == list(range(LANES))
        assert clock.waited == pytest.approx(125)
        # A reader's call that ends stops its wait (served streams pass context.is_active).
        assert owner.share(rs, 0, timeout=1e6, active=lambda: False) is None
        assert owner.live(0, timeout=1e6, active=lambda: False) is None
        assert clock.waited == pytest.approx(125)
    finally:
        owner.close()


def test_served_calls_give_up_after_the_stream_timeout_on_the_owners_clock(spec: zf.LoaderSpec) -> None:
    """A stream waiting for a step its owner does not make, and ``Live`` of that step, end after
    ``--stream-timeout`` (30 s on the owner's clock) with DEADLINE_EXCEEDED naming the flag."""
    clock = ManualClock()
    owner = _owner(spec, clock)
    server = OwnerServer(owner, Serving(world_size=2, stream_timeout=30.0))
    try:
        with grpc.insecure_channel(server.address) as channel:
            rows = channel.unary_stream(
                _M + "StreamRows", request_serializer=lo.RowsRequest.SerializeToString
            )
            with pytest.raises(grpc.RpcError) as info:
                list(rows(lo.RowsRequest(rank=0, world_size=2, start_step=0), timeout=600))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "did not make step 0 within 30 s (--stream-timeout)" in str(info.value.details())
            live = channel.unary_unary(
                _M + "Live",
                request_serializer=lo.LiveRequest.SerializeToString,
                response_deserializer=lo.LiveReply.FromString,
            )
            with pytest.raises(grpc.RpcError) as info:
                live(lo.LiveRequest(step=0), timeout=600)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "did not reach step 0 within 30 s (--stream-timeout)" in str(info.value.details())
        assert clock.waited == pytest.approx(60)
    finally:
        server.stop()
        owner.close()


class _Active:
    def is_active(self) -> bool:
        return True


def test_a_stream_without_acknowledgements_gives_up_on_the_clock() -> None:
    """A paced stream (window 2, from step 5) may send steps 5 and 6 at once; step 7 waits for
    an acknowledgement, for ``--stream-timeout`` on the clock."""
    clock, hold = ManualClock(), threading.Event()

    def requests() -> Iterator[lo.RowsRequest]:
        hold.wait(600)  # acknowledges nothing
        yield from ()

    acks, call = _Acks(requests(), 2, 5, clock), cast(grpc.ServicerContext, _Active())
    try:
        assert acks.wait_for(6, call, 30) and clock.waited == 0
        assert not acks.wait_for(7, call, 30)
        assert clock.waited == pytest.approx(30)
    finally:
        hold.set()
        acks.close()


def test_the_fan_in_waits_for_a_step_with_its_deadline_on_the_clients_clock(spec: zf.LoaderSpec) -> None:
    """An owner that sends the first step and then nothing: the client's wait for the next one
    ends once its clock is past ``Client(timeout=)``, with the project's error naming step and
    owner (the wait itself does not move the clock: the step may be on its way)."""
    with zf.Loader(spec) as loader:
        first = next(iter(loader))[1]
    hold = threading.Event()

    def stream(requests: Iterator[lo.RowsRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        first_request = next(requests)
        context.send_initial_metadata(((ACKS_METADATA, "1"),))  # one long call, acknowledged
        yield from encode_step(int(first_request.start_step), first, ahead=4)
        hold.wait(600)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"

    def table(request: lo.TableRequest, context: grpc.ServicerContext) -> lo.TableReply:
        owner = lo.OwnerEntry(lanes=list(range(LANES)), address=address, generation=0)
        return lo.TableReply(lanes=LANES, global_batch_size=BATCH, finite=False, owners=[owner])

    handlers = {
        "Table": unary_handler(table, lo.TableRequest, lo.TableReply),
        "StreamRows": grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=lo.RowsRequest.FromString
        ),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("zephon.v1.LaneOwners", handlers)])
    server.start()
    clock = ManualClock()
    errors: list[BaseException] = []
    try:
        with zf.Client(address, 0, 1, lane_owners=True, clock=clock, timeout=90.0) as client:
            it = iter(client)
            step, batch = next(it)
            assert (step, batch_digest(batch)) == (0, batch_digest(first)) and clock.waited == 0

            def second() -> None:
                try:
                    next(it)
                except BaseException as exc:
                    errors.append(exc)

            waiter = threading.Thread(target=second)
            waiter.start()
            _advance_until_done(clock, waiter, 30)
        assert len(errors) == 1 and isinstance(errors[0], zf.ServiceError), errors
        assert errors[0].code == "DEADLINE_EXCEEDED"
        assert str(errors[0]).startswith(
            "rank 0 waited more than 90 s (Client(timeout=)) for step 1 from lane owner 0"
        ), errors[0]
        assert clock.now() >= 90
    finally:
        hold.set()
        server.stop(None)


def test_an_owner_ends_once_its_coordinator_was_missing_at_every_look_for_orphan_timeout() -> None:
    clock = ManualClock()
    # Found, missing twice, unknown (Ray unreachable: neither counts), found again (the wait
    # starts over), then missing for good: it ends at the look 2.5 s after the first of those.
    looks = iter([True, False, False, None, True, False, False, False, False, False])
    await_orphaned(lambda: next(looks), 2.5, clock, every=1.0)
    assert clock.now() == pytest.approx(9.0)
