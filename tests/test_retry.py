"""The one retry policy: its pauses on an injected clock, and its refused values."""

from __future__ import annotations

from typing import Any

import pytest

import zephon_flow as zf
from zephon_flow.core.clock import ManualClock
from zephon_flow.core.errors import SpecError
from zephon_flow.core.retry import Backoff


def test_pauses_double_up_to_the_maximum_on_the_clock() -> None:
    policy = Backoff(retries=5, initial=0.25, maximum=1.0)
    assert [policy.delay(a) for a in range(5)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert [policy.last(a) for a in (0, 4, 5)] == [False, False, True]
    clock = ManualClock()
    for attempt in range(3):
        policy.pause(attempt, clock)
    assert clock.now() == pytest.approx(1.75)


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"retries": -1}, "retries=-1, backoff=0.1, max_backoff=5.0"),
        ({"retries": True}, "retries=True"),
        ({"backoff": 0}, "backoff=0, max_backoff=5.0"),
        ({"backoff": 2.0, "max_backoff": 1.0}, "backoff=2.0, max_backoff=1.0"),
        ({"backoff": "1"}, "backoff='1'"),
    ],
)
def test_bad_retry_options_are_refused_by_the_client_before_connecting(
    options: dict[str, Any], shown: str
) -> None:
    with pytest.raises(
        SpecError, match=r"^Client: retries must be >= 0 and 0 < backoff <= max_backoff, got .*"
    ):
        zf.Client("127.0.0.1:1", 0, 1, **options)
    with pytest.raises(SpecError, match=shown.replace("(", r"\(")):
        zf.Client("127.0.0.1:1", 0, 1, **options)


def test_a_loop_bounded_by_time_tries_at_once_then_backs_off_to_the_deadline() -> None:
    policy = Backoff(initial=0.25, maximum=1.0)
    clock = ManualClock()
    times = [clock.now() for _ in policy.until(clock, 2.0)]
    # At once, then after 0.25, 0.5 and 1.0 s; the last pause is cut at the deadline, where
    # the last try is made.
    assert times == pytest.approx([0.0, 0.25, 0.75, 1.75, 2.0])
    assert [clock.now() for _ in policy.until(clock, 0)] == [2.0]  # no time: one try, no pause


def test_a_call_given_up_says_its_tries_the_time_they_took_and_the_knobs() -> None:
    backoff = Backoff(retries=8, initial=0.1, maximum=5.0)
    assert backoff.gave_up(8) == (
        "after 9 tries over 16.3 s (a server that takes longer to come back needs more: "
        "Client(retries=, max_backoff=); now retries=8, max_backoff=5)"
    )
    assert backoff.gave_up(0).startswith("after 1 tries over 0.0 s")
