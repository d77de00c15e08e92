"""Container and timing quirks a new user's videos have: MPEG-TS with B-frames, a Matroska file
whose frames start late, fragmented MP4, live WebM, tar members with several dots, files changed
after listing. Each decoded clip is compared with a straight decode of the whole file."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from video_helpers import clip_spec, linear, make_video

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, StageError
from zephon_flow.engine.simulate import global_digests


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))


def assert_straight(path: Path, plans: list[Any], source: Path | None = None) -> None:
    """Every clip of ``plans`` decodes to the frames a straight decode of ``source`` (default:
    ``path``) gives."""
    whole = linear(source or path)
    decoder = ops.DecodeVideo(rotate=False)
    for plan in plans:
        frames = decoder.decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts])), plan.clip


@pytest.mark.parametrize("codec", ["libx264", "libx265"])
def test_an_mpeg_ts_clip_with_b_frames_goes_back_one_key_frame_not_to_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    # MPEG-TS has no index: FFmpeg seeks it by decoding timestamp, and with B-frames a key
    # frame is decoded before its pts, so the seek to it landed past it; every clip of such a
    # file was then decoded again from the stream's start (late clips of a 60 s file cost 10x
    # the early ones). The plan now names the key frames before its own, and a seek to the
    # previous one lands early enough.
    options = {"bf": "2"} if codec == "libx264" else {"x265-params": "bframes=3:log-level=error"}
    path = make_video(tmp_path / "a.ts", 72, fps=12, gop=12, codec=codec, options=options)
    plans = ops.ReadVideo(str(path), clip_frames=8, frames=4).clips(str(path))
    starts: list[int] = []
    real = ops.DecodeVideo._pass

    def spy(self: ops.DecodeVideo, container: Any, stream: Any, seek: int | None, *rest: Any) -> Any:
        if seek is None:
            starts.append(plan.clip)
        return real(self, container, stream, seek, *rest)

    monkeypatch.setattr(ops.DecodeVideo, "_pass", spy)
    whole = linear(path)
    decoder = ops.DecodeVideo(rotate=False)
    for plan in plans:
        frames = decoder.decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts])), plan.clip
    first_gop = [p.clip for p in plans if p.seek == plans[0].seek]  # no key frame before theirs
    assert len(first_gop) < len(plans) // 3
    assert set(starts) <= set(first_gop)


def test_a_matroska_file_whose_frames_start_late_is_read_and_a_cut_one_refused(tmp_path: Path) -> None:
    # A Matroska segment's Duration counts from timestamp 0: frames from 5 s to 8 s declare
    # 8 s, and the file was refused as "truncated: its header says 8.000 s but its video frames
    # end at 3.000 s".
    src = make_video(tmp_path / "src" / "a.mkv", 48, times=[5 + i / 16 for i in range(48)])
    path = tmp_path / "a.mkv"
    path.write_bytes(src.read_bytes())
    plans = ops.ReadVideo(str(path), clip_seconds=1.0, fps=4).clips(str(path))
    assert [(p.start, p.end) for p in plans] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert_straight(path, plans)
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size * 6 // 10])
    with pytest.raises(DataError, match=r"cut.mkv is truncated: its header says 3\.\d+ s but its video"):
        ops.ReadVideo(str(cut), clip_frames=8).clips(str(cut))


FRAGMENTED = {
    "frag.mp4": {"movflags": "frag_keyframe+empty_moov+default_base_moof"},
    "frag_duration.mp4": {"movflags": "empty_moov", "frag_duration": "300000"},  # not at key frames
    "live.webm": {"live": "1"},  # no Cues
}


def test_fragmented_mp4_and_live_webm_give_the_same_batches_everywhere(tmp_path: Path) -> None:
    for name, muxer in FRAGMENTED.items():
        path = make_video(tmp_path / name, 40, gop=16, muxer=muxer)
        assert_straight(path, ops.ReadVideo(str(path), clip_frames=4, frames=2).clips(str(path)))
    spec = clip_spec(str(tmp_path / "*.*"), clip_frames=4, frames=2)
    steps = 8
    ref = global_digests(spec, steps=steps)
    assert len({d for _, d in ref}) == steps
    assert global_digests(spec, steps=steps, backend="threads", workers=2, world_size=2) == ref
    final: list[dict[str, Any]] = []
    first = global_digests(spec, steps=3, backend="threads", workers=2, world_size=2, final_state=final)
    state = zf.encode_state(zf.LoaderState.from_plain(final[0]))
    rest = global_digests(spec, steps=steps - 3, state=state, backend="processes", workers=2, world_size=2)
    assert first + rest == ref


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _captioned(plans: list[Any]) -> list[tuple[str, str]]:
    """(video member, caption member) of each clip of a shard."""
    return [(p.member.name, p.caption.name) for p in plans if p.member and p.caption]


def test_a_tar_member_named_with_several_dots_is_read_with_its_keys_caption(tmp_path: Path) -> None:
    # WebDataset's key is the name up to the first dot: "c.left.mp4" is field "left.mp4" of
    # sample "c", an MP4; it was passed over silently (its extension "left.mp4" is no video's).
    one = make_video(tmp_path / "src" / "one.mp4", 16).read_bytes()
    two = make_video(tmp_path / "src" / "two.mkv", 16, seed=3)
    shard = _tar(
        tmp_path / "s.tar",
        {
            "a.mp4": one,
            "a.txt": b"first",
            "meta.json": b"{}",
            "c.left.mkv": two.read_bytes(),
            "c.txt": b"dots",
        },
    )
    source = ops.ReadVideo(str(shard), clip_frames=8, caption_ext="txt")
    plans = source.clips(str(shard))
    assert _captioned(plans) == [("a.mp4", "a.txt")] * 2 + [("c.left.mkv", "c.txt")] * 2
    assert_straight(shard, plans[2:], source=two)


def test_a_video_replaced_after_listing_is_refused_naming_the_clip(tmp_path: Path) -> None:
    # Rewritten in place by another video of the same frame rate and time base: the planned
    # timestamps exist in it, and its clips decoded the new video's frames, silently (on a
    # running loader, which clips got which depended on when each was decoded).
    path = make_video(tmp_path / "a.mp4", 32)
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    decoder = ops.DecodeVideo()
    decoder.decode(str(path), plans[0])  # kept open by this thread: checked all the same
    other = make_video(tmp_path / "src" / "b.mp4", 40, seed=4)
    path.write_bytes(other.read_bytes())
    with pytest.raises(StageError) as info:  # not a DataError: on_error="skip" would drop it
        decoder.decode(str(path), plans[2])
    assert str(info.value) == (
        f"DecodeVideo: {path} has changed since its clips were listed ({other.stat().st_size} bytes, "
        f"listed at {plans[2].size}): refusing clip 2 (2.000s to 3.000s), planned from the file as "
        "listed (replaced, or still being written?); list the videos again (a new Loader) once the "
        "file is complete"
    )


def test_a_video_replaced_under_a_running_loader_fails_it_even_when_bad_clips_are_skipped(
    tmp_path: Path,
) -> None:
    # Skipping would drop whichever clips were decoded after the change: a stream that depends on
    # timing. The run fails instead, naming the file.
    path = make_video(tmp_path / "a.mp4", 32)
    other = make_video(tmp_path / "src" / "b.mp4", 40, seed=4)
    loader = zf.Loader(clip_spec(str(path), lanes=1, clip_frames=8, on_error="skip"), backend="inline")
    try:
        batches = iter(loader)
        next(batches)  # listed, and clip 0 decoded from the file as listed
        path.write_bytes(other.read_bytes())
        with pytest.raises(StageError, match=r"a\.mp4 has changed since its clips were listed"):
            for _ in batches:
                pass
    finally:
        loader.close()


def test_a_bad_member_of_a_shard_is_left_out_alone_when_bad_videos_are_skipped(tmp_path: Path) -> None:
    # Listing skipped by file: one damaged video left its shard's other videos out with it.
    good = make_video(tmp_path / "src" / "a.mp4", 16).read_bytes()
    later = make_video(tmp_path / "src" / "d.mkv", 16, seed=5)
    members = {"a.mp4": good, "a.txt": b"first", "b.mp4": b"not a video at all", "b.txt": b"bad"}
    members |= {"c.mp4": good, "d.mkv": later.read_bytes(), "d.txt": b"last"}  # c: no caption
    shard = _tar(tmp_path / "s.tar", members)
    with pytest.raises(DataError, match=r"s\.tar member 'b\.mp4'"):
        ops.ReadVideo(str(shard), clip_frames=8, caption_ext="txt").splits()
    source = ops.ReadVideo(str(shard), clip_frames=8, caption_ext="txt", on_error="skip")
    splits = source.splits()
    assert source.skipped_files == [f"{shard} member 'b.mp4'", f"{shard} member 'c.mp4'"]
    plans = source.clips(str(shard))
    assert _captioned(plans) == [("a.mp4", "a.txt")] * 2 + [("d.mkv", "d.txt")] * 2
    assert sum(s.stop - s.start for s in splits) == 4
    assert_straight(shard, plans[2:], source=later)
    spec = clip_spec(str(shard), clip_frames=8, caption_ext="txt", on_error="skip")
    ref = global_digests(spec, steps=2, backend="inline")
    assert global_digests(spec, steps=2, backend="threads", workers=2, world_size=2) == ref


def test_a_stream_without_a_frame_size_is_refused_as_unreadable_not_as_too_large(tmp_path: Path) -> None:
    # A bare PNG signature named .mp4: FFmpeg opens it as a png stream of 0x0 frames, which was
    # refused with "raise max_pixels=", advice that cannot help.
    path = tmp_path / "fake.mp4"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(
        DataError, match=r"fake\.mp4 has a \w+ video stream whose frame size FFmpeg cannot read"
    ) as info:
        ops.ReadVideo(str(path), clip_frames=1).splits()
    assert "max_pixels" not in str(info.value)
