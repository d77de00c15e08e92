"""ReadVideo, DecodeVideo, PackVideo: clip plans, seeking decodes, sampling, rotation, resume, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from video_helpers import decode_failures, garble, linear, make_video

from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START
from zephon_flow.operators import _video_index
from zephon_flow.operators._video_index import read_index
from zephon_flow.operators._video_scale import rgb
from zephon_flow.operators.video_source import ClipPlan


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))


def elements(source: ops.ReadVideo, lanes: int = 1, position: int = START) -> list[dict[str, Any]]:
    out = []
    for split in source.splits(lanes):
        for _, record in source.read_split(split, position):
            out.extend(source.decode(record, source.operator_name))
    return out


@pytest.mark.parametrize("ext", [".mp4", ".mkv", ".webm", ".mov"])
def test_each_clip_decoded_by_seeking_equals_the_linear_decode(tmp_path: Path, ext: str) -> None:
    path = make_video(tmp_path / f"a{ext}", 40)
    source = ops.ReadVideo(str(path), clip_frames=8)
    clips = elements(source)
    assert [c["clip"] for c in clips] == [0, 1, 2, 3, 4]
    assert [(c["start"], c["end"]) for c in clips] == [(i * 1.0, i * 1.0 + 1.0) for i in range(5)]
    whole = linear(path)
    order = sorted(whole)
    for c in reversed(clips):  # any order: each clip from its own key frame
        frames = next(ops.DecodeVideo().process(c))["frames"]
        assert frames.shape == (8, 48, 64, 3) and frames.dtype == np.uint8
        expected = np.stack([whole[p] for p in order[8 * c["clip"] : 8 * c["clip"] + 8]])
        assert np.array_equal(frames, expected)


def test_a_kept_container_gives_the_bytes_of_a_fresh_one_in_any_clip_order(tmp_path: Path) -> None:
    a, b = make_video(tmp_path / "a.mp4", 40), make_video(tmp_path / "b.webm", 24, seed=3)
    plans = {p: ops.ReadVideo(str(p), clip_frames=8, frames=5).clips(str(p)) for p in (a, b)}
    kept = ops.DecodeVideo(size=16)
    for path, clip in [(a, 3), (a, 0), (a, 4), (b, 2), (a, 1), (a, 1), (b, 0), (a, 2)]:
        fresh = ops.DecodeVideo(size=16).decode(str(path), plans[path][clip])
        assert np.array_equal(kept.decode(str(path), plans[path][clip]), fresh), (path, clip)
    kept.teardown()


def test_a_thread_keeps_more_containers_of_small_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zephon_flow.operators import video_decode

    paths = [make_video(tmp_path / f"v{i}.mp4", 16, seed=i) for i in range(6)]
    plans = {p: ops.ReadVideo(str(p), clip_frames=8).clips(str(p)) for p in paths}
    opened: list[str] = []
    real = _video_index.open_container  # the function video_decode opens containers with

    def counted(path: str, *args: Any) -> Any:
        opened.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(video_decode, "open_container", counted)
    for budget, opens in [(video_decode.KEPT_PIXELS, 6), (64 * 48 * 3, 12)]:  # 64x48 frames
        monkeypatch.setattr(video_decode, "KEPT_PIXELS", budget)
        opened.clear()
        kept = ops.DecodeVideo(size=16)
        for clip in (0, 1):  # six videos in turn, twice: all six stay open, or the last four
            for p in paths:
                fresh = ops.DecodeVideo(size=16).decode(str(p), plans[p][clip])
                assert np.array_equal(kept.decode(str(p), plans[p][clip]), fresh)
        assert len(opened) == opens + 12  # and the fresh decoders' 12
        assert len(kept._held.videos) == (6 if opens == 6 else video_decode.KEPT_CONTAINERS)
        kept.teardown()


@pytest.mark.parametrize("ext", [".mp4", ".webm"])
def test_ffmpeg_decoder_threads_give_the_single_threaded_bytes(tmp_path: Path, ext: str) -> None:
    # Why DecodeVideo's one decoder thread is a choice, not a necessity, on valid streams: frame
    # and slice threading give the same frames (H.264, VP9), so no byte depends on it.
    path = make_video(tmp_path / f"a{ext}", 40)
    single = linear(path)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_type = "AUTO"
        stream.codec_context.thread_count = 3
        threaded = {f.pts: rgb(f).copy() for f in container.decode(stream)}
    assert sorted(threaded) == sorted(single)
    assert all(np.array_equal(threaded[p], single[p]) for p in single)


def test_uniform_sampling_by_index_and_resize_per_frame(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.mp4", 24)
    source = ops.ReadVideo(str(path), clip_frames=8, frames=3)
    pts = read_index(str(path), operator="t", max_pixels=10**6).pts
    clips = elements(source)
    assert [c["clip_plan"].pts for c in clips] == [tuple(pts[8 * k + i] for i in (1, 4, 6)) for k in range(3)]
    out = next(ops.DecodeVideo(size=(16, 12), mode="pad").process(clips[1]))
    assert out["frames"].shape == (3, 16, 12, 3)
    assert "clip_plan" not in out and out["__key__"] == "a.mp4#1"
    # 64x48 fits 12 columns: 12x9 by swscale, rows 3 to 12 of a zero canvas.
    with av.open(str(path)) as container:
        small = {f.pts: rgb(f, width=12, height=9).copy() for f in container.decode(video=0)}
    expected = np.zeros((3, 16, 12, 3), np.uint8)
    expected[:, 3:12] = np.stack([small[p] for p in clips[1]["clip_plan"].pts])
    assert np.array_equal(out["frames"], expected)
    # center_crop: 64x48 covers 24x24 at 32x24, the central 24 columns; Pillow's for hamming.
    crop = next(ops.DecodeVideo(size=24).process(clips[1]))["frames"]
    with av.open(str(path)) as container:
        cover = {f.pts: rgb(f, width=32, height=24)[:, 4:28].copy() for f in container.decode(video=0)}
    assert np.array_equal(crop, np.stack([cover[p] for p in clips[1]["clip_plan"].pts]))
    hamming = next(ops.DecodeVideo(size=24, resample="hamming").process(clips[1]))["frames"]
    resize = ops.ResizeImage(24, resample="hamming")
    whole = linear(path)
    assert np.array_equal(
        hamming, np.stack([resize.resize(whole[p], "x") for p in clips[1]["clip_plan"].pts])
    )


def test_fps_sampling_follows_the_timestamps_of_a_variable_frame_rate(tmp_path: Path) -> None:
    times = [0, 0.1, 0.15, 0.5, 0.55, 0.6, 1.0, 1.01, 1.3, 1.9, 2.0, 2.1]
    path = make_video(tmp_path / "vfr.mkv", len(times), times=times)
    source = ops.ReadVideo(str(path), clip_seconds=1.0, fps=4)
    plans = [c["clip_plan"] for c in elements(source)]
    # The frame on screen at each quarter second: 0 -> 0, .25 -> .15, .5 -> .5, .75 -> .6, ...
    assert [p.pts for p in plans] == [(0, 150, 500, 600), (1000, 1010, 1300, 1300)]
    frames = ops.DecodeVideo().decode(str(path), plans[1])
    assert np.array_equal(frames[2], frames[3]) and not np.array_equal(frames[0], frames[1])


def trimmed(source: Path, path: Path, cut: int) -> Path:
    """``source``'s packets remuxed with ``cut`` time-base units moved before zero, as a trim
    without re-encoding (a phone's editor, ``ffmpeg -ss -c copy``) writes them: the muxer puts
    an edit list in, and the frames before it are decoded for those after, never shown."""
    with av.open(str(source)) as src, av.open(str(path), "w") as out:
        stream = src.streams.video[0]
        copy = out.add_stream_from_template(stream)
        for packet in src.demux(stream):
            if packet.size == 0:
                continue
            packet.pts, packet.dts = packet.pts - cut, packet.dts - cut
            packet.stream = copy
            out.mux(packet)
    return path


@pytest.mark.parametrize("ext", [".mp4", ".mov"])
def test_frames_an_edit_list_cuts_are_not_planned(tmp_path: Path, ext: str) -> None:
    # Found trying a trimmed file: the frames before the edit list's start were planned as
    # clip 0's first frames, which the decoder never gives, so the file was refused as damaged.
    source = make_video(tmp_path / "src" / "a.mp4", 40, gop=16)
    tb = read_index(str(source), operator="t", max_pixels=10**6).time_base
    path = trimmed(source, tmp_path / f"trim{ext}", 3 * tb[1] // (8 * tb[0]))  # 3 frames at 8 fps
    whole = linear(path)
    assert len(whole) == 37 and min(whole) == 0
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    assert len(plans) == 4 and plans[0].pts == tuple(sorted(whole)[:8]) and plans[0].seek < 0
    for plan in plans:
        frames = ops.DecodeVideo().decode(str(path), plan)
        assert np.array_equal(frames, np.stack([whole[p] for p in plan.pts]))


def test_clip_seconds_with_a_stride_overlaps_clips(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.webm", 24)  # 3 s at 8 fps
    source = ops.ReadVideo(str(path), clip_seconds=1.0, stride=0.5, frames=2)
    clips = elements(source)
    assert [(c["start"], c["end"]) for c in clips] == [(k / 2, k / 2 + 1) for k in range(5)]


def test_rotation_metadata_turns_frames_upright(tmp_path: Path) -> None:
    plain = make_video(tmp_path / "plain.mp4", 8)
    turned = make_video(tmp_path / "turned.mp4", 8, rotation=90)
    a, b = (elements(ops.ReadVideo(str(p), clip_frames=8))[0] for p in (plain, turned))
    upright = next(ops.DecodeVideo().process(b))["frames"]
    assert upright.shape == (8, 64, 48, 3)
    assert np.array_equal(upright, np.rot90(next(ops.DecodeVideo().process(a))["frames"], k=1, axes=(1, 2)))
    assert next(ops.DecodeVideo(rotate=False).process(b))["frames"].shape == (8, 48, 64, 3)
    # Resized, the rotated frame's geometry: 16 rows x 12 columns upright, 12 x 16 as stored.
    small = next(ops.DecodeVideo(size=(16, 12)).process(b))["frames"]
    stored = next(ops.DecodeVideo(size=(12, 16)).process(a))["frames"]
    assert small.shape == (8, 16, 12, 3) and np.array_equal(small, np.rot90(stored, k=1, axes=(1, 2)))


def test_resume_inside_a_long_video_reads_from_the_clip(tmp_path: Path) -> None:
    path = make_video(tmp_path / "long.mkv", 96)
    source = ops.ReadVideo(str(path), clip_frames=8, clips_per_split=12)
    (split,) = source.splits(1)
    records = list(source.read_split(split, 7))
    assert [(pos, r.offset) for pos, r in records] == [(k + 1, k) for k in range(7, 12)]
    assert records[0][1].where == "clip 7 (7.000s to 8.000s)"
    fresh = elements(source)[7]
    resumed = source.decode(records[0][1], source.operator_name)[0]
    decode = ops.DecodeVideo(size=8)
    assert np.array_equal(next(decode.process(fresh))["frames"], next(decode.process(resumed))["frames"])
    with pytest.raises(DataError, match=r"cannot resume clips \[0, 12\) of .*long.mkv at clip 13"):
        list(source.read_split(split, 13))


def test_splits_are_runs_of_clips_and_the_index_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(3):
        make_video(tmp_path / f"v{i}.mp4", 16 + 16 * i)
    source = ops.ReadVideo(str(tmp_path / "*.mp4"), clip_frames=8)
    splits = source.splits(2)
    assert [(Path(s.path).name, s.start, s.stop) for s in splits] == [
        ("v0.mp4", 0, 2), ("v1.mp4", 0, 4), ("v2.mp4", 0, 3), ("v2.mp4", 3, 6)
    ]  # fmt: skip
    assert [s.weight for s in splits] == [16, 32, 24, 24]  # frames decoded

    def no_demux(*args: Any) -> Any:
        raise AssertionError("demuxed again")

    monkeypatch.setattr(_video_index, "_demux", no_demux)
    again = ops.ReadVideo(str(tmp_path / "*.mp4"), clip_frames=8)
    assert again.splits(2) == splits


def test_an_unchanged_file_is_listed_again_from_its_stat_and_a_replaced_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from zephon_flow.operators import _file_cache

    path, other = make_video(tmp_path / "v.mp4", 24), make_video(tmp_path / "src" / "w.mp4", 16, seed=5)
    pattern = str(tmp_path / "*.mp4")

    def clips() -> int:
        _video_index._KEYS.clear()  # as a new process
        return sum(s.stop - s.start for s in ops.ReadVideo(pattern, clip_frames=8).splits(1))

    assert clips() == 3
    notes = list((tmp_path / "cache").glob("video-stat-*.json"))
    assert notes == []  # written under RACY_SECONDS ago: hashed at every listing
    monkeypatch.setattr(_file_cache, "RACY_SECONDS", -1.0)  # as if written long ago
    assert clips() == 3 and len(list((tmp_path / "cache").glob("video-stat-*.json"))) == 1
    hashed: list[str] = []
    real_key = _file_cache.key

    def counted_key(path: str, *args: Any, **kwargs: Any) -> Any:
        hashed.append(path)
        return real_key(path, *args, **kwargs)

    monkeypatch.setattr(_file_cache, "key", counted_key)
    assert clips() == 3 and hashed == []  # from the note: no byte of the video read

    # Another video, padded to the same size (bytes after an .mp4's end are ignored) and given
    # the old mtime: rewritten in place, then renamed over it. Each time its stat differs, so
    # it is hashed and demuxed again: its 2 clips, not the 3 of the index cached for the old one.
    info = path.stat()
    body = other.read_bytes()
    assert len(body) < info.st_size
    body += bytes(info.st_size - len(body))
    path.write_bytes(body)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert clips() == 2 and hashed == [str(path)]
    path.write_bytes(path.read_bytes())  # the same bytes again: hashed, the same key and index
    assert clips() == 2 and len(hashed) == 2
    replacement = tmp_path / "src" / "new.mp4"
    replacement.write_bytes(make_video(tmp_path / "src" / "x.mp4", 40, seed=7).read_bytes())
    os.utime(replacement, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.replace(replacement, path)
    assert clips() == 5 and len(hashed) == 3


def test_pack_video_lays_out_placeholders_then_caption(tmp_path: Path) -> None:
    pack = ops.PackVideo(16, video_token_id=1, tokens_per_frame=2, frames=2, max_clips=2)
    clip = {
        "__key__": "k",
        "text_ids": np.asarray([7, 8], np.int32),
        "frames": np.ones((2, 4, 4, 3), np.uint8),
    }

    class State:
        value: Any = None

        def read(self) -> Any:
            return self.value

        def write(self, v: Any) -> None:
            self.value = v

    class Timer:
        def set(self, _: Any) -> None:
            pass

    state = State()
    assert list(pack.process((0, clip), state, Timer(), None)) == []
    (out,) = list(pack.process((0, clip), state, Timer(), None))
    assert out["input_ids"].tolist() == [1, 1, 1, 1, 7, 8] * 2 + [0] * 4
    assert out["segment_ids"].tolist() == [0] * 6 + [1] * 6 + [-1] * 4
    assert out["videos"].shape == (2, 2, 4, 4, 3) and int(out["video_count"]) == 2
    bad = {**clip, "frames": np.ones((3, 4, 4, 3), np.uint8)}
    with pytest.raises(
        DataError, match=r"PackVideo: field 'frames' of sample 'k' is uint8\[3, 4, 4, 3\]; expected 2 frames"
    ):
        list(pack.process((0, bad), State(), Timer(), None))
    with pytest.raises(SpecError, match="do not fit in seq_len=4"):
        ops.PackVideo(4, video_token_id=1, tokens_per_frame=2, frames=4, max_clips=1)


# -- bad input -------------------------------------------------------------------------------
def audio_only(path: Path) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def unknown_codec(mkv: bytes, path: Path) -> Path:
    """A Matroska file whose video track names a codec FFmpeg does not know."""
    assert mkv.count(b"V_MPEG4/ISO/AVC") == 1
    path.write_bytes(mkv.replace(b"V_MPEG4/ISO/AVC", b"V_ZEPHON/NONE!!"))  # same length
    return path


def test_bad_files_are_refused_by_name_at_listing(tmp_path: Path) -> None:
    good = make_video(tmp_path / "good.mkv", 40).read_bytes()
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "text.mp4").write_bytes(b"not a video at all\n" * 20)
    (tmp_path / "cut.mkv").write_bytes(good[: len(good) * 6 // 10])
    mp4 = make_video(tmp_path / "src" / "whole.mp4", 40).read_bytes()
    (tmp_path / "cut.mp4").write_bytes(mp4[: len(mp4) * 6 // 10])  # its index (moov) is at the end
    unknown_codec(good, tmp_path / "unknown.mkv")
    audio_only(tmp_path / "sound.mkv")
    make_video(tmp_path / "short.mp4", 4)
    make_video(tmp_path / "huge.mp4", 8, width=64, height=64)
    expected = {
        "empty.mp4": "is empty (0 bytes), not a video; remove it or narrow the glob",
        "text.mp4": "is not a video container FFmpeg can read (truncated or damaged?): Invalid data found",
        "cut.mkv": "is truncated: its header says 5.000 s but its video frames end at",
        "cut.mp4": "is not a video container FFmpeg can read (truncated or damaged?)",
        "unknown.mkv": "has a video stream in a codec FFmpeg cannot decode",
        "sound.mkv": "has no video stream (it has audio)",
        "short.mp4": "has 4 frames, not one whole clip of 8 frames; remove it or shorten the clips",
        "huge.mp4": "has 64x64 frames, outside 1..max_pixels=4000 pixels; raise max_pixels=",
    }
    for name, message in expected.items():
        source = ops.ReadVideo(str(tmp_path / name), clip_frames=8, max_pixels=4000)
        with pytest.raises(DataError) as info:
            source.splits(1)
        assert str(info.value).startswith(f"ReadVideo('ReadVideo'): {tmp_path / name} ")
        assert message in str(info.value)
    skipping = ops.ReadVideo(str(tmp_path / "*.m*"), clip_frames=8, max_pixels=4000, on_error="skip")
    assert {Path(s.path).name for s in skipping.splits(1)} == {"good.mkv"}
    assert sorted(Path(p).name for p in skipping.skipped_files) == sorted(expected)


def test_damage_inside_a_clip_is_a_data_error_naming_file_and_clip(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.mkv", 40)
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    garble(path)  # damaged after listing
    failed = decode_failures(path, plans)
    assert failed and all(f.startswith("DecodeVideo: ") and str(path) in f for f in failed)
    assert any("clip 2 (2.000s to 3.000s)" in f for f in failed)


def test_a_file_changed_after_listing_is_refused_at_decode_naming_file_and_clip(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.mkv", 24)
    good = path.read_bytes()
    plan = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))[2]
    clip = r"DecodeVideo \[clip 2 \(2.000s to 3.000s\)\]: "
    changes = {
        "is not a video container FFmpeg can read": b"",
        "has a video stream in a codec FFmpeg cannot decode": unknown_codec(
            good, tmp_path / "u.mkv"
        ).read_bytes(),
        "has no video stream": audio_only(tmp_path / "s.mkv").read_bytes(),
        r"did not give \d of the 8 frames of clip 2 \(2.000s to 3.000s\)": good[: len(good) * 9 // 10],
    }
    for message, data in changes.items():
        path.write_bytes(data)
        where = clip if "did not" not in message else "DecodeVideo: "
        with pytest.raises(DataError, match=f"{where}.*{message}") as info:
            ops.DecodeVideo().decode(str(path), plan)
        assert str(path) in str(info.value)


def test_a_plan_the_file_does_not_have_is_refused(tmp_path: Path) -> None:
    path = make_video(tmp_path / "a.mp4", 16)
    plan = ClipPlan(0, 0, (0, 999_999), (1, 16384), 0.0, 1.0)
    with pytest.raises(DataError, match=r"did not give 1 of the 2 frames of clip 0 \(0.000s to 1.000s\)"):
        ops.DecodeVideo().decode(str(path), plan)


def test_options_are_checked() -> None:
    with pytest.raises(SpecError, match="give exactly one of clip_frames= and clip_seconds="):
        ops.ReadVideo("x/*.mp4")
    with pytest.raises(SpecError, match="at most one of frames="):
        ops.ReadVideo("x/*.mp4", clip_frames=8, frames=2, fps=2)
    with pytest.raises(SpecError, match="clip_frames must be a positive int"):
        ops.ReadVideo("x/*.mp4", clip_frames=0)


def test_a_random_window_per_video_is_a_pure_function_of_seed_and_name(tmp_path: Path) -> None:
    for i in range(4):
        make_video(tmp_path / f"v{i}.mkv", 40, seed=i)
    pattern = str(tmp_path / "*.mkv")

    def starts(seed: int, **clip: Any) -> list[tuple[str, float]]:
        source = ops.ReadVideo(pattern, window="random", seed=seed, frames=2, **clip)
        return [(c["__key__"], c["start"]) for c in elements(source, lanes=3)]

    first = starts(7, clip_frames=8)
    assert [k for k, _ in first] == [f"v{i}.mkv#0" for i in range(4)]  # one clip per video
    assert all(0 <= s <= 4.0 for _, s in first) and len({s for _, s in first}) > 1
    assert starts(7, clip_frames=8) == first and starts(8, clip_frames=8) != first
    timed = starts(7, clip_seconds=1.5)
    assert all(0 <= s <= 3.5 for _, s in timed) and timed == starts(7, clip_seconds=1.5)
    with pytest.raises(SpecError, match="window must be one of"):
        ops.ReadVideo(pattern, clip_frames=8, window="middle")


def test_files_opened_through_beam_filesystems_decode_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_video(tmp_path / "a.mkv", 24)
    direct = [
        ops.DecodeVideo(size=8).decode(str(path), p)
        for p in ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    ]
    from zephon_flow.core import files

    monkeypatch.setattr(files, "is_local", lambda _: False)  # as for gs:// or s3://: a file object
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "other-cache"))
    plans = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))
    remote = [ops.DecodeVideo(size=8).decode(str(path), p) for p in plans]
    assert len(remote) == 3 and all(np.array_equal(a, b) for a, b in zip(direct, remote, strict=True))


def test_video_members_of_webdataset_shards_are_read_in_place(tmp_path: Path) -> None:
    import tarfile

    a, b = make_video(tmp_path / "src" / "v0.mp4", 24), make_video(tmp_path / "src" / "v1.mkv", 16, seed=2)
    (tmp_path / "src" / "v0.txt").write_text("first")
    (tmp_path / "src" / "v1.txt").write_text("second")
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("v0.mp4", "v0.txt", "v1.txt", "v1.mkv"):
            tar.add(tmp_path / "src" / name, arcname=f"clips/{name}")
    source = ops.ReadVideo(str(tmp_path / "*.tar"), clip_frames=8, caption_ext="txt")
    clips = elements(source)
    assert [(c["__key__"], c["member"], c["txt"]) for c in clips] == [
        ("shard-000.tar/clips/v0.mp4#0", "clips/v0.mp4", "first"),
        ("shard-000.tar/clips/v0.mp4#1", "clips/v0.mp4", "first"),
        ("shard-000.tar/clips/v0.mp4#2", "clips/v0.mp4", "first"),
        ("shard-000.tar/clips/v1.mkv#0", "clips/v1.mkv", "second"),
        ("shard-000.tar/clips/v1.mkv#1", "clips/v1.mkv", "second"),
    ]
    decode = ops.DecodeVideo()
    for c in clips:  # the same frames as the files themselves
        path = a if c["member"].endswith("mp4") else b
        plan = ops.ReadVideo(str(path), clip_frames=8).clips(str(path))[c["clip"]]
        assert np.array_equal(next(decode.process(c))["frames"], ops.DecodeVideo().decode(str(path), plan))
    with tarfile.open(tmp_path / "none.tar", "w") as tar:
        tar.add(tmp_path / "src" / "v0.txt", arcname="v0.txt")
    with pytest.raises(DataError, match=r"none.tar has no video members \(mp4, mkv, webm, mov\)"):
        ops.ReadVideo(str(tmp_path / "none.tar"), clip_frames=8).splits(1)
