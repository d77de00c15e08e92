"""Video files a new user meets that the first tests did not write: open GOPs, palettes, a
soundtrack longer than the picture, a single frame."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from video_helpers import decode_failures, garble, linear, make_video

from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError

#: x264's open GOPs (its wrapper has no option of that name: x264's own parameter).
OPEN_GOP = {"bf": "3", "x264-params": "open-gop=1"}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("ext", [".mp4", ".mkv"])
def test_clips_of_an_open_gop_h264_video_equal_the_linear_decode(tmp_path: Path, ext: str) -> None:
    # x264's open GOPs: every key frame after the first is a recovery point, not an IDR frame,
    # and the frames after it list pictures before it as references (never used): decoding
    # from it under err_detect=explode failed ("cannot decode clip 5 ...: Invalid data").
    path = make_video(tmp_path / f"a{ext}", 48, gop=8, width=160, height=120, options=OPEN_GOP)
    plans = ops.ReadVideo(str(path), clip_frames=8, frames=4).clips(str(path))
    assert len({p.seek for p in plans}) > 3  # seeks to the recovery points
    whole = linear(path)
    decoder = ops.DecodeVideo()
    for plan in plans:
        frames = decoder.decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts])), plan.clip


@pytest.mark.parametrize(
    "options",
    [
        OPEN_GOP,
        {"bf": "3", "x264-params": "open-gop=1:b-pyramid=normal"},
        {"bf": "5", "x264-params": "open-gop=1:ref=6"},
    ],
    ids=["bframes", "pyramid", "refs"],
)
def test_an_open_gop_clip_is_decoded_from_a_key_frame_near_it_not_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, str]
) -> None:
    # Decoding every such clip from the stream's start cost more the later the clip: a clip
    # near the end of a long video would decode the whole video. Frames shown before the
    # clip's key frame may fail (their references are gone); a frame of the clip that fails
    # is decoded again from one key frame earlier, where its listed references exist.
    path = make_video(tmp_path / "a.mkv", 120, gop=10, width=160, height=120, options=options)
    plans = ops.ReadVideo(str(path), clip_frames=8, frames=4).clips(str(path))
    seeks: list[int | None] = []
    real = ops.DecodeVideo._pass

    def spy(
        self: ops.DecodeVideo, container: object, stream: object, seek: int | None, *rest: object
    ) -> object:
        seeks.append(seek)
        return real(self, container, stream, seek, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(ops.DecodeVideo, "_pass", spy)
    whole = linear(path)
    decoder = ops.DecodeVideo()
    for plan in plans:
        frames = decoder.decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts])), plan.clip
    assert None not in seeks
    assert len(seeks) > len(plans)  # some clips did go back a key frame


def test_damage_in_an_open_gop_is_still_refused_naming_the_clip(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.mkv", 48, gop=8, width=160, height=120, options=OPEN_GOP)
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    garble(path)
    failed = decode_failures(path, plans)
    assert failed and all(f.startswith("DecodeVideo: ") and str(path) in f for f in failed)
    assert all(re.search(r"clip \d \(\d\.000s to \d\.000s\)", f) for f in failed)


def test_a_palette_video_is_refused_by_name_not_decoded_black(tmp_path: Path) -> None:
    # QuickTime Animation in 8-bit gray decodes to pal8; the .mov demuxer sends the palette
    # with the first packet only, so after a seek every frame came out black (all zeros).
    path = make_video(tmp_path / "a.mov", 16, codec="qtrle", pix_fmt="gray")
    (plan, _) = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    with pytest.raises(DataError) as info:
        ops.DecodeVideo(size=8).decode(str(path), plan)
    assert str(info.value) == (
        f"DecodeVideo: {path} is a palette video (pal8) whose palette comes once, with its first "
        "packet, and is lost on a seek: clip 0 (0.000s to 1.000s) would decode black; convert "
        "the file (to H.264 or FFV1, say) to read it by clips"
    )


@pytest.mark.parametrize("ext", [".mp4", ".mkv"])
def test_a_soundtrack_longer_than_the_picture_is_not_a_cut(tmp_path: Path, ext: str) -> None:
    # The header's length is the audio's (3 s); the video's 16 frames end at 2 s: this was
    # refused as "truncated: its header says 3.000 s but its video frames end at 2.000 s".
    path = make_video(tmp_path / f"a{ext}", 16, audio_seconds=3.0)
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    assert [(p.start, p.end) for p in plans] == [(0.0, 1.0), (1.0, 2.0)]
    whole = linear(path)
    frames = ops.DecodeVideo().decode(str(path), plans[1])
    assert np.array_equal(frames, np.stack([whole[p] for p in plans[1].pts]))


def test_a_cut_file_with_sound_is_still_refused_as_truncated(tmp_path: Path) -> None:
    whole = make_video(tmp_path / "src" / "a.mkv", 40, audio_seconds=5.0).read_bytes()
    path = tmp_path / "a.mkv"
    path.write_bytes(whole[: len(whole) * 6 // 10])
    with pytest.raises(
        DataError, match=r"a.mkv is truncated: its header says 5\.\d{3} s but its video frames"
    ):
        ops.ReadVideo(str(path), clip_frames=8).splits(1)


def test_a_one_frame_video_is_one_clip_of_one_frame_not_a_cut(tmp_path: Path) -> None:
    # Its header says one frame's duration, and its frames had none to judge by: this was
    # refused as "truncated: its header says 0.125 s but its video frames end at 0.000 s".
    path = make_video(tmp_path / "a.mp4", 1)
    with pytest.raises(DataError, match=r"a.mp4 has 1 frames, not one whole clip of 8 frames"):
        ops.ReadVideo(str(path), clip_frames=8).splits(1)
    (plan,) = ops.ReadVideo(str(path), clip_frames=1).clips(str(path))
    frames = ops.DecodeVideo().decode(str(path), plan)
    assert np.array_equal(frames[0], next(iter(linear(path).values())))


def test_a_clip_whose_mpeg_ts_seek_lands_past_its_key_frame_is_decoded_from_the_start(
    tmp_path: Path,
) -> None:
    # MPEG-TS has no index: a seek to a key frame's time can land on a later frame, and the
    # decoder then waits for the next key frame, here past the clip: "did not give 4 of the 4
    # frames of clip 6 (1.920s to 2.240s)".
    path = make_video(tmp_path / "a.ts", 60, width=160, height=120, fps=25, gop=12, codec="libx264")
    plans = ops.ReadVideo(str(path), clip_frames=8, frames=4).clips(str(path))
    whole = linear(path)
    decoder = ops.DecodeVideo()
    for plan in plans:
        frames = decoder.decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts])), plan.clip


def test_repeated_timestamps_are_refused_at_listing(tmp_path: Path) -> None:
    # Two MPEG-TS files joined end to end: the second's timestamps start again, so two frames
    # share each pts. They were listed (one of each pair planned) and decoded as whichever the
    # seek met first, silently.
    one = make_video(tmp_path / "src" / "1.ts", 16, codec="mpeg2video").read_bytes()
    two = make_video(tmp_path / "src" / "2.ts", 16, codec="mpeg2video", seed=5).read_bytes()
    path = tmp_path / "joined.ts"
    path.write_bytes(one + two)
    with pytest.raises(DataError) as info:
        ops.ReadVideo(str(path), clip_frames=8).splits(1)
    assert re.fullmatch(
        rf"ReadVideo\('ReadVideo'\): {re.escape(str(path))} has two video frames at pts \d+: its "
        r"timestamps repeat \(files joined end to end, or a damaged stream\), so its frames cannot "
        r"be found by time; remux it with fresh timestamps",
        str(info.value),
    )
