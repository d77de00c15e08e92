"""Starting or joining Ray: one retry of a local start that hits Ray's startup timeout."""

from __future__ import annotations

from typing import Any

import pytest

from zephon_flow.runners import ray_env
from zephon_flow.runners.ray_env import RayUnavailableError, connect

TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class FakeRay:
    """``ray.init`` fails with the given errors in turn, then succeeds."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.inits: list[dict[str, Any]] = []
        self.shutdowns = 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **options: Any) -> None:
        self.inits.append(options)
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


def use(monkeypatch: pytest.MonkeyPatch, fake: FakeRay) -> None:
    monkeypatch.setattr(ray_env, "require_ray", lambda feature: fake)


def test_a_local_start_that_timed_out_is_tried_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(Exception(TIMEOUT))
    use(monkeypatch, fake)
    assert connect("the test") is True
    assert len(fake.inits) == 2 and fake.shutdowns == 1
    assert fake.inits[0]["_node_ip_address"] == "127.0.0.1"


def test_a_local_start_that_times_out_twice_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay(Exception(TIMEOUT), Exception(TIMEOUT))
    use(monkeypatch, fake)
    with pytest.raises(
        RayUnavailableError, match=r"the test could not reach a local Ray instance: .*tried twice"
    ):
        connect("the test")
    assert len(fake.inits) == 2 and fake.shutdowns == 2


@pytest.mark.parametrize(
    ("address", "error"),
    [
        ("auto", Exception(TIMEOUT)),  # joining a cluster: no retry
        (None, Exception("something else")),  # not the startup timeout
        (None, RuntimeError(TIMEOUT)),  # not Ray's bare Exception
    ],
)
def test_other_failures_are_not_retried(
    monkeypatch: pytest.MonkeyPatch, address: str | None, error: Exception
) -> None:
    fake = FakeRay(error)
    use(monkeypatch, fake)
    with pytest.raises((type(error), RayUnavailableError)):
        connect("the test", address)
    assert len(fake.inits) == 1 and fake.shutdowns == 0
