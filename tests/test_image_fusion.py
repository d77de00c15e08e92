"""``DecodeImage`` then ``ResizeImage`` fused in the runner's front (``DecodeThenResize``): the same
outputs as the two run apart, on every kind of image the decoder converts, and errors naming the
DoFn they came from."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from helpers import run_batches
from PIL import Image
from vlm_helpers import ReadImageFolder, encode, gradient

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError
from zephon_flow.operators.image_resize import DecodeThenResize
from zephon_flow.runners.dofns import FusedInvoker, StatelessInvoker, fuse


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(gradient(40, 22, seed=4), "JPEG", exif=exif.tobytes())


def _palette_with_transparency() -> bytes:
    im = gradient(30, 17, seed=5).convert("P")
    return encode(im, "PNG", transparency=3)


#: One of each conversion DecodeImage makes, in sizes that need scaling down, up and cropping.
IMAGES = {
    "jpeg": encode(gradient(123, 77, seed=1), "JPEG", quality=85),
    "jpeg_large": encode(gradient(700, 500, seed=2), "JPEG", quality=80),
    "png_rgb": encode(gradient(41, 90, seed=3), "PNG"),
    "rgba": encode(
        Image.fromarray(np.asarray(gradient(50, 50, seed=6).convert("RGBA")) // 3 * 2, "RGBA"), "PNG"
    ),
    "la": encode(gradient(33, 19, seed=7).convert("LA"), "PNG"),
    "grey": encode(gradient(64, 48, seed=8).convert("L"), "PNG"),
    "sixteen_bit": encode(
        Image.fromarray((np.arange(24 * 20).reshape(20, 24) * 131).astype(np.uint16)), "PNG"
    ),
    "cmyk": encode(gradient(26, 18, seed=9).convert("CMYK"), "JPEG", quality=95),
    "exif_rotated": _exif_rotated(),
    "palette": _palette_with_transparency(),
    "tiny": encode(gradient(3, 2, seed=10), "PNG"),
}

OPTIONS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {"size": 32}),
    ({"draft_size": 64}, {"size": 64}),
    ({"mode": "L"}, {"size": (20, 36)}),
    ({}, {"size": 24, "mode": "pad", "pad_value": (1, 2, 3), "resample": "lanczos"}),
    ({}, {"size": 16, "normalize": ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))}),
    ({"output": "pixels", "keep_input": True}, {"size": 28, "field": "pixels"}),
]


def _apart(decode: ops.DecodeImage, resize: ops.ResizeImage, element: Any) -> list[Any]:
    return [out for decoded in decode.process(element) for out in resize.process(decoded)]


def _same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("decode_options, resize_options", OPTIONS)
def test_fused_outputs_are_the_outputs_of_the_two_apart(
    decode_options: dict[str, Any], resize_options: dict[str, Any]
) -> None:
    decode = ops.DecodeImage(**decode_options)
    size = resize_options.pop("size")
    resize = ops.ResizeImage(size, **resize_options)
    fused = resize.fuse_after(decode)
    assert isinstance(fused, DecodeThenResize)
    for name, data in IMAGES.items():
        sample = {"__key__": name, "png" if name != "jpeg" else "jpg": data, "txt": b"caption"}
        for element in (sample, data):
            expected = _apart(decode, resize, element)
            got = list(fused.process(element))
            assert len(got) == len(expected) == 1
            _same(got[0], expected[0])
            image = got[0] if isinstance(got[0], np.ndarray) else got[0][resize.output]
            assert isinstance(image, np.ndarray) and image.flags.c_contiguous


def test_only_a_decoder_whose_output_is_resized_in_place_is_fused() -> None:
    class MyDecode(ops.DecodeImage):
        pass

    decode = StatelessInvoker("decode", ops.DecodeImage())
    resize = StatelessInvoker("resize", ops.ResizeImage(8))
    (step,) = fuse([decode, resize])
    assert isinstance(step, FusedInvoker) and step.labels == ("decode", "resize")
    for second in (
        ops.ResizeImage(8, field="other"),  # resizes another field
        ops.ResizeImage(8, output="small"),  # keeps the full-size image beside the resized one
    ):
        assert [s.dofn for s in fuse([decode, StatelessInvoker("r", second)])] == [decode.dofn, second]
    subclass = StatelessInvoker("decode", MyDecode())  # may decode differently: left alone
    assert len(fuse([subclass, resize])) == 2
    # A chain of three keeps the third on its own; a resize after a fused pair is not fused again.
    again = StatelessInvoker("again", ops.ResizeImage(4))
    steps = fuse([decode, resize, again])
    assert len(steps) == 2 and steps[1] is again


def _folder(tmp_path: Path, images: dict[str, bytes]) -> str:
    for k, (name, data) in enumerate(sorted(images.items())):
        ext = "jpg" if data[:2] == b"\xff\xd8" else "png"
        (tmp_path / f"{k:05d}-{name}.{ext}").write_bytes(data)
        (tmp_path / f"{k:05d}-{name}.txt").write_text(f"caption {name}")
    return str(tmp_path / "*.*g")


class Same(beam.DoFn):  # type: ignore[misc]
    """Passes samples through: between the two operators, it keeps them apart."""

    def process(self, sample: Any) -> Any:
        yield sample


def _spec(pattern: str, *, apart: bool, resize: ops.ResizeImage) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "images" >> ReadImageFolder(pattern, epochs=1)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(draft_size=32))
        if apart:
            decoded = decoded | "same" >> beam.ParDo(Same())
        resized = decoded | "resize" >> beam.ParDo(resize)
        return resized | "pixels" >> beam.Map(lambda sample: {"image": sample["image"]})

    return zf.LoaderSpec(build, lanes=2, seed=3, global_batch_size=2)


def _digest(batches: list[dict[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            value = np.asarray(batch[key])
            h.update(key.encode() + str(value.dtype).encode() + str(value.shape).encode())
            h.update(value.tobytes() if value.dtype != object else repr(value.tolist()).encode())
    return h.hexdigest()


@pytest.mark.parametrize("backend", ["inline", "processes"])
def test_a_pipeline_gives_the_same_batches_fused_and_apart(tmp_path: Path, backend: str) -> None:
    pattern = _folder(tmp_path, IMAGES)
    resize = ops.ResizeImage(32)
    for kept_apart, labels in (
        (False, ["decode+resize", "pixels"]),
        (True, ["decode", "same", "resize", "pixels"]),
    ):
        stages = _spec(pattern, apart=kept_apart, resize=resize).compile().front_segment().stages
        assert [s.label for s in stages] == labels
    fused = run_batches(_spec(pattern, apart=False, resize=resize), backend=backend, workers=2)
    apart = run_batches(_spec(pattern, apart=True, resize=resize), backend=backend, workers=2)
    assert sum(int(np.sum(b["valid"])) for b in fused) == len(IMAGES)  # every image, once
    assert _digest(fused) == _digest(apart)


def test_errors_name_the_part_of_the_fused_pair_that_raised(tmp_path: Path) -> None:
    pattern = _folder(tmp_path, {"bad": b"not an image at all"})
    with pytest.raises(DataError) as info:
        run_batches(_spec(pattern, apart=False, resize=ops.ResizeImage(8)))
    assert "DecodeImage: cannot decode the image" in str(info.value)
    assert "(DoFn 'decode', on the record at" in str(info.value)

    # A grey image with three normalisation means: the resize refuses it, and is named.
    (tmp_path / "grey").mkdir()
    pattern = _folder(tmp_path / "grey", {"grey": IMAGES["grey"]})

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "images" >> ReadImageFolder(pattern, epochs=1)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(mode="L"))
        three = ((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
        return decoded | "resize" >> beam.ParDo(ops.ResizeImage(8, normalize=three))

    with pytest.raises(DataError) as info:
        run_batches(zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1))
    assert "ResizeImage: normalize has 3 means and 3 stds for the 1-channel image" in str(info.value)
    assert "(DoFn 'resize', on the record at" in str(info.value)
