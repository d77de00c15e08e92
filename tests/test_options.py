"""The option groups: frozen, keyword-only, checked once, and the same checks at every entry point."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers import Corpus, example_spec, run_batches

import zephon_flow as zf
from zephon_flow.options import (
    CheckpointOptions,
    EndpointOptions,
    HoldOptions,
    OwnerOptions,
    ResumeOptions,
    StateOptions,
    TopologyOptions,
    WorkOptions,
)
from zephon_flow.service.server import BatchServer

GROUPS = [
    TopologyOptions,
    WorkOptions,
    ResumeOptions,
    StateOptions,
    HoldOptions,
    CheckpointOptions,
    EndpointOptions,
    OwnerOptions,
]


@pytest.mark.parametrize("group", GROUPS)
def test_a_group_is_frozen_and_keyword_only(group: Any) -> None:
    options = group()
    field = dataclasses.fields(options)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(options, field, getattr(options, field))
    with pytest.raises(TypeError):
        group(getattr(options, field))
    # kwargs() gives back what builds an equal group; whose it is (owner) is not part of it.
    assert group(**options.kwargs(), owner="zephon serve") == options
    assert "owner" not in options.kwargs()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TopologyOptions(rank=4, world_size=4), r"^rank must be in \[0, 4\), got 4$"),
        (lambda: TopologyOptions(world_size=0), r"^world_size must be a positive integer, got 0$"),
        (lambda: WorkOptions(workers=True), r"^workers must be a positive integer, got True$"),
        (lambda: WorkOptions(backend="gpu"), r"^unknown backend 'gpu'; choose one of inline, threads"),
        (lambda: WorkOptions(chunk_timeout=float("nan")), r"^chunk_timeout must be a positive number"),
        (lambda: WorkOptions(ray_address="h:6379"), r"^ray_address='h:6379' goes with backend='ray'"),
        (
            lambda: ResumeOptions(verify_resume=1),  # type: ignore[arg-type]
            r"^verify_resume must be True or False, got 1$",
        ),
        (lambda: StateOptions(state_mode="tokens"), r"^state_mode must be one of compact, recipe"),
        (lambda: StateOptions(keep_states=0), r"^keep_states must be a positive integer, got 0$"),
        (lambda: HoldOptions(keep=-1), r"^keep must be an integer >= 0, got -1$"),
        (lambda: HoldOptions(held_bytes=0), r"^held_bytes must be a positive integer, got 0$"),
        (lambda: CheckpointOptions(checkpoint_every=2), r"^checkpoint_every needs checkpoint_dir"),
        (lambda: EndpointOptions(port=65536), r"^port must be in \[0, 65535\], got 65536$"),
        (lambda: EndpointOptions(stream_timeout=0), r"^stream_timeout must be a positive number of seconds"),
        # A lane owner's options are checked by the groups they are made of, and its own.
        (lambda: OwnerOptions(ahead=0), r"^lane owners: ahead must be a positive integer, got 0$"),
        (lambda: OwnerOptions(backend="gpu"), r"^lane owners: unknown backend 'gpu'; choose one of"),
        (lambda: OwnerOptions(prefetch_chunks=0), r"^lane owners: prefetch_chunks must be a positive"),
        (lambda: OwnerOptions(allow_code_change=1), r"^lane owners: allow_code_change must be True or"),  # type: ignore[arg-type]
        (lambda: OwnerOptions(orphan_timeout=0), r"^lane owners: orphan_timeout must be a positive number"),
        (lambda: OwnerOptions(snapshot_dir=""), r"^lane owners: snapshot_dir must be a folder every node"),
        (
            lambda: OwnerOptions.of(
                work=WorkOptions(), hold=HoldOptions(held_bytes=1 << 20), resume=ResumeOptions()
            ),
            r"^lane owners: held_bytes does not go with lane owners: each owner holds ahead steps",
        ),
        # A command's options are named by its flags; an entry point's by its name.
        (lambda: HoldOptions(ahead=0, owner="zephon serve"), r"^zephon serve: --ahead must be a positive"),
        (
            lambda: CheckpointOptions(checkpoint_every=2, owner="zephon serve"),
            r"^zephon serve: --checkpoint-every needs --checkpoint-dir \(where to write them\)$",
        ),
        (
            lambda: TopologyOptions(rank=-1, world_size=2, owner="Client"),
            r"^Client: rank must be in \[0, 2\)",
        ),
    ],
)
def test_a_value_out_of_range_is_refused_by_name(build: Any, message: str) -> None:
    with pytest.raises(zf.SpecError, match=message):
        build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ahead": 0}, r"^zephon serve: --ahead must be a positive integer, got 0$"),
        ({"held_bytes": 0}, r"^zephon serve: --held-bytes must be a positive integer, got 0$"),
        ({"workers": 0}, r"^zephon serve: --workers must be a positive integer, got 0$"),
        ({"verify_resume": "no"}, r"^zephon serve: --verify-resume must be True or False, got 'no'$"),
        ({"port": -1}, r"^zephon serve: --port must be in \[0, 65535\], got -1$"),
        ({"max_streams": 0}, r"^zephon serve: --max-streams must be a positive integer, got 0$"),
    ],
)
def test_the_server_refuses_through_the_same_groups(
    corpus: Corpus, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(zf.SpecError, match=message):
        BatchServer(example_spec(corpus), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2}, r"^Client: rank must be in \[0, 2\), got 2$"),
        ({"world_size": 0}, r"^Client: world_size must be a positive integer, got 0$"),
        ({"start_step": -1}, r"^Client: start_step must be an integer >= 0, got -1$"),
        ({"timeout": 0}, r"^Client: timeout must be a positive number of seconds, got 0$"),
    ],
)
def test_the_client_refuses_through_the_same_checks(kwargs: dict[str, Any], message: str) -> None:
    position = {"rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(zf.SpecError, match=message):
        zf.Client("127.0.0.1:1", **position)


def test_one_group_handed_to_a_loader_gives_its_batches(corpus: Corpus) -> None:
    spec = example_spec(corpus)
    work = WorkOptions(backend="threads", workers=2, prefetch=1, prefetch_chunks=2)
    grouped = run_batches(spec, 3, **work.kwargs(), **ResumeOptions().kwargs())
    plain = run_batches(spec, 3)
    assert len(grouped) == len(plain) == 3
    for a, b in zip(grouped, plain, strict=True):
        assert zf.batch_digest(a) == zf.batch_digest(b)


def test_a_lane_owners_options_are_made_of_the_shared_groups() -> None:
    work = WorkOptions(backend="threads", workers=3, chunk_records=16, prefetch_chunks=2)
    hold, resume = HoldOptions(ahead=6, keep=2), ResumeOptions(allow_mix_change=True)
    options = OwnerOptions.of(work=work, hold=hold, resume=resume, orphan_timeout=5.0)
    assert options == OwnerOptions(
        backend="threads",
        workers=3,
        chunk_records=16,
        prefetch_chunks=2,
        ahead=6,
        keep=2,
        allow_mix_change=True,
        orphan_timeout=5.0,
    )
    # ...and gives them back (a reader's prefetch is not the owner's: left at its default).
    assert (options.work, options.hold, options.resume) == (
        dataclasses.replace(work, prefetch=WorkOptions().prefetch),
        hold,
        resume,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ahead": 0}, r"^zephon serve: --ahead must be a positive integer, got 0$"),
        ({"workers": 0}, r"^zephon serve: --workers must be a positive integer, got 0$"),
        ({"keep": -1}, r"^zephon serve: --keep must be an integer >= 0, got -1$"),
    ],
)
def test_the_owners_server_refuses_through_the_same_groups_before_ray_starts(
    corpus: Corpus, kwargs: dict[str, Any], message: str
) -> None:
    pytest.importorskip("ray")
    from zephon_flow.cluster.serve import OwnersServer

    with pytest.raises(zf.SpecError, match=message):
        OwnersServer(example_spec(corpus), owners=2, world_size=2, **kwargs)
