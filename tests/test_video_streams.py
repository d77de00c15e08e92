"""Which stream of a file is its video (a cover image is not), and the display rotations applied."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apache_beam as beam
import av
import numpy as np
import pytest
from PIL import Image
from video_helpers import make_video, picture

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators._video_index import ATTACHED_PIC, read_index
from zephon_flow.operators._video_scale import rgb


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))


def jpeg(width: int = 32, height: int = 32) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 200, np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def write_main_video(
    container: av.container.OutputContainer, frames: int, *, after_first: object = None
) -> None:
    """The main track: ``frames`` frames of ``picture`` at 64x48, 8 fps, a key frame every 8."""
    stream = container.add_stream("libx264", rate=8)
    stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
    stream.codec_context.gop_size = 8
    stream.codec_context.thread_count = 1
    for i in range(frames):
        container.mux(stream.encode(av.VideoFrame.from_ndarray(picture(i, 64, 48), format="rgb24")))
        if i == 0 and callable(after_first):
            after_first()
    container.mux(stream.encode())


def add_cover(container: Any) -> Callable[[], None]:
    """Adds a cover-art stream (one 32x32 MJPEG picture flagged attached_pic) to ``container``;
    returns what muxes its picture (called after the main video's first frame)."""
    cover = container.add_stream("mjpeg", rate=1)
    cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
    cover.disposition = av.stream.Disposition.attached_pic

    def mux_cover() -> None:
        image = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 200, np.uint8), format="rgb24")
        for packet in [*cover.encode(image), *cover.encode()]:
            container.mux(packet)

    return mux_cover


def mp4_with_cover_first(path: Path, frames: int = 32) -> Path:
    """An MP4 with cover art (``covr``, read by FFmpeg as a stream flagged attached_pic) whose
    ``udta`` box comes before the track in ``moov``, as some taggers write it: FFmpeg then lists
    the cover as the file's first video stream. PyAV's MP4 muxer writes ``udta`` after the
    tracks, so its boxes are reordered here (same bytes, so every offset stays right)."""
    with av.open(str(path), "w") as container:
        write_main_video(container, frames, after_first=add_cover(container))
    data = bytearray(path.read_bytes())

    def boxes(start: int, end: int) -> list[tuple[int, int, bytes]]:
        out, at = [], start
        while at < end:
            size, kind = struct.unpack(">I4s", data[at : at + 8])
            out.append((at, size, kind))
            at += size
        return out

    ((moov, size, _),) = [b for b in boxes(0, len(data)) if b[2] == b"moov"]
    kids = boxes(moov + 8, moov + size)
    order = sorted(kids, key=lambda k: (k[2] != b"mvhd", k[2] != b"udta"))
    assert [k[2] for k in order][:2] == [b"mvhd", b"udta"]
    data[moov + 8 : moov + size] = b"".join(bytes(data[at : at + n]) for at, n, _ in order)
    path.write_bytes(bytes(data))
    return path


def streams(path: Path) -> list[tuple[str, bool]]:
    with av.open(str(path)) as container:
        return [
            (s.codec_context.name, bool(int(s.disposition) & ATTACHED_PIC)) for s in container.streams.video
        ]


def main_track_frames(path: Path) -> dict[int, np.ndarray]:
    with av.open(str(path)) as container:
        (stream,) = [s for s in container.streams.video if s.codec_context.name == "h264"]
        stream.codec_context.thread_type = "NONE"
        return {f.pts: rgb(f).copy() for f in container.decode(stream)}


def test_a_cover_image_listed_first_is_passed_over_for_the_main_video(tmp_path: Path) -> None:
    path = mp4_with_cover_first(tmp_path / "covered.mp4")
    assert streams(path) == [("mjpeg", True), ("h264", False)]  # what FFmpeg lists first: the cover
    index = read_index(str(path), operator="t", max_pixels=10**6)
    assert (index.codec, index.width, index.height, len(index.pts)) == ("h264", 64, 48, 32)
    source = ops.ReadVideo(str(path), clip_frames=8, frames=4)
    plans = source.clips(str(path))
    assert len(plans) == 4
    whole = main_track_frames(path)
    order = sorted(whole)
    for plan in reversed(plans):  # each clip by seeking, in the main track
        frames = ops.DecodeVideo().decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts]))
        assert set(plan.pts) <= set(order[8 * plan.clip : 8 * plan.clip + 8])


def test_a_matroska_image_attachment_is_not_the_video(tmp_path: Path) -> None:
    # Matroska keeps cover art as an attachment, which FFmpeg lists after the tracks, flagged.
    path = tmp_path / "attached.mkv"
    with av.open(str(path), "w") as container:
        container.add_attachment("cover.jpg", "image/jpeg", jpeg())
        write_main_video(container, 16)
    assert streams(path) == [("h264", False), ("mjpeg", True)]
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    whole = main_track_frames(path)
    assert np.array_equal(
        ops.DecodeVideo().decode(str(path), plans[1]), np.stack([whole[p] for p in plans[1].pts])
    )


def test_a_cover_stored_as_an_ordinary_track_is_refused_naming_the_stream(tmp_path: Path) -> None:
    # FFmpeg's Matroska muxer writes a stream flagged attached_pic as an ordinary one-frame track
    # and reads it back unflagged: nothing in the file tells it from a video, so it is read (the
    # documented rule) and refused by name, not quietly taken for a one-frame video.
    path = tmp_path / "cover_track.mkv"
    with av.open(str(path), "w") as container:
        write_main_video(container, 32, after_first=add_cover(container))
    assert streams(path) == [("mjpeg", False), ("h264", False)]
    with pytest.raises(DataError) as info:
        ops.ReadVideo(str(path), clip_frames=8).splits(1)
    message = str(info.value)
    assert message.startswith(
        f"ReadVideo('ReadVideo'): {path} is truncated, or its video stream #0 is not its main video"
    )
    assert "the first video stream not flagged an attached picture is read" in message


def test_a_file_whose_only_picture_is_a_cover_has_no_video(tmp_path: Path) -> None:
    path = tmp_path / "song.mkv"
    with av.open(str(path), "w") as container:
        container.add_attachment("cover.jpg", "image/jpeg", jpeg())
        sound = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(sound.encode(frame))
        container.mux(sound.encode())
    assert streams(path) == [("mjpeg", True)]
    with pytest.raises(DataError, match=r"has no video stream but its cover image \(an attached picture"):
        ops.ReadVideo(str(path), clip_frames=8).splits(1)


# -- display rotation ----------------------------------------------------------------------------
@pytest.mark.parametrize("degrees, turns", [(90, 1), (180, 2), (-90, 3), (270, 3)])
def test_quarter_turns_are_applied_exactly(tmp_path: Path, degrees: int, turns: int) -> None:
    plain = make_video(tmp_path / "plain.mp4", 8)
    turned = make_video(tmp_path / "turned.mp4", 8, rotation=degrees)
    a, b = (ops.ReadVideo(str(p), clip_frames=8).clips(str(p))[0] for p in (plain, turned))
    stored = ops.DecodeVideo().decode(str(plain), a)
    assert np.array_equal(ops.DecodeVideo().decode(str(turned), b), np.rot90(stored, k=turns, axes=(1, 2)))


@pytest.mark.parametrize("degrees", [45, 30, 135, 2])
def test_a_rotation_not_a_multiple_of_90_degrees_is_refused_by_name(tmp_path: Path, degrees: int) -> None:
    plain = make_video(tmp_path / "plain.mp4", 16)
    path = make_video(tmp_path / "tilted.mp4", 16, rotation=degrees)
    plan = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))[1]
    with pytest.raises(DataError) as info:
        ops.DecodeVideo(size=16).decode(str(path), plan)
    message = str(info.value)
    assert message.startswith(f"DecodeVideo: {path} asks for a display transform that is not a quarter turn")
    assert f"a rotation of {float(degrees):.2f} degrees" in message
    assert "clip 1 (1.000s to 2.000s)" in message and "DecodeVideo(rotate=False)" in message
    # rotate=False: the frames as stored, the same as the file's without the matrix.
    stored = ops.DecodeVideo(rotate=False).decode(str(path), plan)
    assert np.array_equal(stored, ops.DecodeVideo().decode(str(plain), plan))


def test_a_mirrored_display_matrix_is_refused_not_turned(tmp_path: Path) -> None:
    # A front camera's mirror: PyAV reads its angle as 180, which used to turn the frames.
    path = tmp_path / "mirror.mp4"
    one = 1 << 16
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.set_display_matrix([-one, 0, 0, 0, one, 0, 0, 0, 1 << 30])
        for i in range(8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture(i, 64, 48), format="rgb24")))
        container.mux(stream.encode())
    plan = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))[0]
    with pytest.raises(DataError, match=r"not a quarter turn \(a rotation of -?180\.00 degrees, mirrored"):
        ops.DecodeVideo().decode(str(path), plan)
    assert ops.DecodeVideo(rotate=False).decode(str(path), plan).shape == (8, 48, 64, 3)


# -- choosing the stream: ReadVideo(stream=N) ------------------------------------------------------
def two_videos(path: Path) -> Path:
    """A Matroska file with two ordinary H.264 tracks of 16 frames: #0 of seed 0, #1 of seed 5."""
    with av.open(str(path), "w") as container:
        tracks = []
        for _ in range(2):
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            stream.codec_context.gop_size = 8
            stream.codec_context.thread_count = 1
            tracks.append(stream)
        for i in range(16):
            for seed, stream in zip((0, 5), tracks, strict=True):
                image = av.VideoFrame.from_ndarray(picture(i, 64, 48, seed=seed), format="rgb24")
                container.mux(stream.encode(image))
        for stream in tracks:
            container.mux(stream.encode())
    return path


def track_frames(path: Path, number: int) -> dict[int, np.ndarray]:
    with av.open(str(path)) as container:
        stream = container.streams[number]
        stream.codec_context.thread_type = "NONE"
        return {f.pts: rgb(f).copy() for f in container.decode(stream)}


def test_stream_reads_the_main_video_where_the_default_refuses_a_cover_track(tmp_path: Path) -> None:
    path = tmp_path / "cover_track.mkv"
    with av.open(str(path), "w") as container:
        write_main_video(container, 32, after_first=add_cover(container))
    assert streams(path) == [("mjpeg", False), ("h264", False)]
    with pytest.raises(DataError) as info:  # the default: stream #0, refused by name
        ops.ReadVideo(str(path), clip_frames=8).splits(1)
    assert "give ReadVideo(stream=N) to read stream #N" in str(info.value)
    assert "its streams: #0 video mjpeg, #1 video h264" in str(info.value)
    source = ops.ReadVideo(str(path), clip_frames=8, frames=4, stream=1)
    plans = source.clips(str(path))
    assert len(plans) == 4 and {p.stream for p in plans} == {1}
    whole = main_track_frames(path)
    for plan in reversed(plans):
        frames = ops.DecodeVideo().decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts]))


def test_stream_picks_the_second_of_two_videos_through_the_loader(tmp_path: Path) -> None:
    path = two_videos(tmp_path / "two.mkv")
    first, second = track_frames(path, 0), track_frames(path, 1)
    assert not np.array_equal(first[min(first)], second[min(second)])

    def spec(stream: int | None) -> zf.LoaderSpec:
        def build(p: beam.Pipeline) -> beam.PCollection:
            clips = p | "videos" >> ops.ReadVideo(str(path), clip_frames=8, stream=stream, epochs=1)
            return clips | "decode" >> beam.ParDo(ops.DecodeVideo())

        return zf.LoaderSpec(build, lanes=2, seed=0, global_batch_size=2)

    def frames(stream: int | None) -> np.ndarray:
        """The clips the loader delivers (threads, 2 workers), in clip order."""
        loader = zf.Loader(spec(stream), rank=0, world_size=1, backend="threads", workers=2)
        try:
            clips = {
                int(c): f for _, batch in loader for c, f in zip(batch["clip"], batch["frames"], strict=True)
            }
        finally:
            loader.close()
        return np.stack([clips[c] for c in sorted(clips)])

    def pts_order(whole: dict[int, np.ndarray]) -> np.ndarray:
        return np.stack([whole[p] for p in sorted(whole)]).reshape(2, 8, 48, 64, 3)

    assert np.array_equal(frames(None), pts_order(first))
    assert np.array_equal(frames(1), pts_order(second))
    assert "stream" not in ops.ReadVideo(str(path), clip_frames=8).params()  # fingerprints unchanged
    assert spec(1).fingerprint != spec(None).fingerprint


@pytest.mark.parametrize("number, what", [(2, "has no stream #2"), (0, "has audio as stream #0")])
def test_a_stream_that_is_not_a_video_is_refused_by_name(tmp_path: Path, number: int, what: str) -> None:
    path = tmp_path / "sound.mkv"
    with av.open(str(path), "w") as container:
        sound = container.add_stream("aac", rate=8000)
        write_main_video(container, 16)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(sound.encode(frame))
        container.mux(sound.encode())
    with av.open(str(path)) as container:
        assert [s.type for s in container.streams] == ["audio", "video"]
    with pytest.raises(DataError) as info:
        ops.ReadVideo(str(path), clip_frames=8, stream=number).splits(1)
    assert str(info.value).startswith(f"ReadVideo('ReadVideo'): {path} {what} (stream={number} was asked for")
    assert "its streams: #0 audio aac, #1 video h264" in str(info.value)


def test_stream_must_be_an_index() -> None:
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(SpecError, match=r"ReadVideo: stream must be a stream's index"):
            ops.ReadVideo("*.mp4", clip_frames=8, stream=bad)  # type: ignore[arg-type]
