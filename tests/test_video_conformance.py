"""Video in the conformance promise: the same global batches on every backend (inline, threads,
processes, Ray, lane owners), world size and resume point, including a resume in the middle of a
long video and random clip windows drawn anew in each pass.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Corpus
from video_helpers import make_video, video_spec, write_videos

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.core.checkpoint.state import SourceCursor
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.source import START, Record
from zephon_flow.engine.simulate import global_digests
from zephon_flow.runners.dealing import Dealing
from zephon_flow.runners.streams import SourceReader

LANES, BATCH, STEPS = 4, 8, 5
Digests = list[tuple[int, str]]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Three short captioned videos (3 to 5 clips of 8 frames) and a long one (20 clips)."""
    root = tmp_path_factory.mktemp("video_conformance")
    pattern = write_videos(root, 3)
    make_video(root / "v100.mp4", 160, seed=9)
    (root / "v100.txt").write_text("the long one")
    return pattern


@pytest.fixture(scope="module")
def spec(videos: str, corpus: Corpus) -> zf.LoaderSpec:
    return video_spec(videos, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def random_spec(videos: str, corpus: Corpus) -> zf.LoaderSpec:
    return video_spec(videos, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH, window="random")


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> Digests:
    ref = global_digests(spec, steps=STEPS)
    assert len({d for _, d in ref}) == STEPS
    return ref


@pytest.fixture(scope="module")
def middle(spec: zf.LoaderSpec) -> bytes:
    """The checkpoint after 2 steps of the inline run: a lane stopped inside the long video."""
    final: list[dict[str, Any]] = []
    global_digests(spec, steps=2, final_state=final)
    state = to_loader_state(final[0])
    (sp,) = spec.compile().sources
    splits = sp.source.splits(LANES)
    inside = []
    for lane, lane_state in state.lane_states.items():
        at = lane_state.cursor.sources[0]
        epoch, item, position = at.epoch, at.share, at.position
        shares = _shares(sp.source, sp.label, spec.seed, epoch)[lane]
        if item < len(shares) and position != START:
            split = splits[shares[item]]
            if split.path.endswith("v100.mp4") and split.start < position < split.stop:
                inside.append((lane, split.start, position, split.stop))
    assert inside, "no lane stopped inside a split of the long video: move the cut"
    return zf.encode_state(zf.LoaderState.from_plain(final[0]))


def _shares(source: Any, label: str, seed: int, epoch: int) -> list[list[int]]:
    """Per lane, the split indexes of its shares of pass ``epoch``."""
    dealing = Dealing([s.cost for s in source.splits(LANES)], lanes=LANES, seed=seed, source=label)
    return [[share.split for share in dealing.shares(lane, epoch)] for lane in range(LANES)]


def resumed(spec: zf.LoaderSpec, state: bytes, steps: int, **options: Any) -> Digests:
    return global_digests(spec, steps=steps, state=state, **options)


# -- without Ray -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "workers", "world_size"),
    [("threads", 2, 2), ("processes", 2, 4), ("threads", 3, 8)],
)
def test_backends_and_world_sizes_give_the_reference_batches(
    spec: zf.LoaderSpec, reference: Digests, backend: str, workers: int, world_size: int
) -> None:
    got = global_digests(spec, steps=STEPS, backend=backend, workers=workers, world_size=world_size)
    assert got == reference


def test_a_resume_inside_the_long_video_gives_the_reference_batches(
    spec: zf.LoaderSpec, reference: Digests, middle: bytes
) -> None:
    assert resumed(spec, middle, STEPS - 2, backend="processes", workers=2, world_size=2) == reference[2:]
    assert resumed(spec, middle, STEPS - 2, backend="threads", workers=2, world_size=8) == reference[2:]


def test_random_windows_are_drawn_anew_each_pass(videos: str) -> None:
    source = ops.ReadVideo(videos, clip_frames=8, frames=2, window="random", seed=5)
    n = len(source.splits(1))
    reader = SourceReader(source, "videos", lane=0, lanes=1, seed=0, cursor=SourceCursor.first())
    starts: dict[str, list[float]] = {}
    for _ in range(3 * n):  # three passes, one clip per video each
        record = reader.next()
        assert isinstance(record, Record)
        starts.setdefault(Path(record.path).name, []).append(record.payload.start)
    assert all(len(s) == 3 for s in starts.values())
    assert all(len(set(s)) > 1 for s in starts.values()), starts  # a new window per pass
    # A reader resumed at pass 2 draws what the uninterrupted one drew there.
    again = SourceReader(source, "videos", lane=0, lanes=1, seed=0, cursor=SourceCursor(2, 0, START, 0))
    third = [again.next() for _ in range(n)]
    assert sorted(r.payload.start for r in third if isinstance(r, Record)) == sorted(
        s[2] for s in starts.values()
    )
    assert source.rereads_offsets is False  # recipe state cannot re-read a pass's window by offset


def test_random_windows_give_the_same_batches_on_every_topology_and_resume(
    random_spec: zf.LoaderSpec,
) -> None:
    steps = 4  # one clip per video and pass: several passes
    ref = global_digests(random_spec, steps=steps)
    assert len({d for _, d in ref}) == steps
    assert global_digests(random_spec, steps=steps, backend="processes", workers=2, world_size=2) == ref
    final: list[dict[str, Any]] = []
    first = global_digests(
        random_spec, steps=2, backend="threads", workers=2, world_size=4, final_state=final
    )
    rest = resumed(
        random_spec,
        zf.encode_state(zf.LoaderState.from_plain(final[0])),
        2,
        backend="processes",
        workers=2,
        world_size=8,
    )
    assert first + rest == ref


# -- on Ray: one test, one local Ray -----------------------------------------------------------
@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray on loopback (2 CPUs) whose workers can import the tests' helpers, shut
    down after the module (as ``test_conformance.py``'s)."""
    ray = pytest.importorskip("ray")
    from zephon_flow.runners.ray_env import connect

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), before or ""])
    try:
        started = connect("the video conformance test", None, num_cpus=2)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def owned_digests(spec: zf.LoaderSpec, steps: int, *, state: bytes | None, world_size: int) -> Digests:
    """Global batches assembled from ``world_size`` ranks reading 2 Ray lane owners in step."""
    from zephon_flow.cluster import OwnedLoader

    out: Digests = []
    with contextlib.ExitStack() as stack:
        loaders = [
            stack.enter_context(
                OwnedLoader(spec, lane_owners=2, rank=r, world_size=world_size, state=state, owner_cpus=0.0)
            )
            for r in range(world_size)
        ]
        iters = [iter(ld) for ld in loaders]
        for _ in range(steps):
            parts = [next(it) for it in iters]
            assert len({p[0] for p in parts}) == 1
            out.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
    return out


def test_ray_backend_and_lane_owners_give_the_reference_batches(
    spec: zf.LoaderSpec, reference: Digests, middle: bytes, ray_session: None
) -> None:
    # Kept small (starting Ray's workers and actors is most of it): each resumes the inline
    # run's checkpoint from inside the long video, on the Ray backend and on two lane owners
    # read by two ranks.
    assert resumed(spec, middle, STEPS - 2, backend="ray", workers=2, world_size=2) == reference[2:]
    assert owned_digests(spec, STEPS - 2, state=middle, world_size=2) == reference[2:]
