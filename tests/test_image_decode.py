"""Tests of DecodeImage: formats and modes to RGB, the pixel limit, JPEG draft, EXIF, error messages."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_batches
from PIL import Image
from vlm_helpers import ReadImageFolder, encode, gradient

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError


def decode(data: bytes, key: str = "k", **options: Any) -> np.ndarray:
    (out,) = ops.DecodeImage(**options).process({"__key__": key, "jpg": data})
    assert set(out) == {"__key__", "image"}
    image: np.ndarray = out["image"]
    assert image.dtype == np.uint8 and image.flags.c_contiguous
    return image


def pillow_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def test_jpeg_gives_pillows_rgb_pixels_and_keeps_the_other_fields() -> None:
    data = encode(gradient(37, 21, seed=1), "JPEG", quality=90)
    (out,) = ops.DecodeImage().process({"__key__": "a", "jpg": data, "txt": b"a cat"})
    assert sorted(out) == ["__key__", "image", "txt"] and out["txt"] == b"a cat"
    assert out["image"].shape == (21, 37, 3)
    np.testing.assert_array_equal(out["image"], pillow_rgb(data))
    (kept,) = ops.DecodeImage(field="jpg", output="pixels", keep_input=True).process({"jpg": data})
    assert sorted(kept) == ["jpg", "pixels"]
    (bare,) = ops.DecodeImage().process(data)
    np.testing.assert_array_equal(bare, out["image"])


def test_png_rgb_is_lossless() -> None:
    rgb = np.asarray(gradient(9, 7, seed=2))
    np.testing.assert_array_equal(decode(encode(Image.fromarray(rgb), "PNG")), rgb)


def test_palette_with_a_transparent_index_is_composited_over_the_background() -> None:
    im = Image.new("P", (2, 1))
    im.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    im.putdata([0, 1])
    data = encode(im, "PNG", transparency=0)
    assert decode(data).tolist() == [[[255, 255, 255], [200, 100, 50]]]
    assert decode(data, background=(0, 0, 0)).tolist() == [[[0, 0, 0], [200, 100, 50]]]


def test_rgba_and_la_alpha_is_composited_over_the_background() -> None:
    rgba = Image.fromarray(np.array([[[9, 8, 7, 0], [9, 8, 7, 255]]], dtype=np.uint8), "RGBA")
    assert decode(encode(rgba, "PNG")).tolist() == [[[255, 255, 255], [9, 8, 7]]]
    la = Image.fromarray(np.array([[[50, 0], [50, 255]]], dtype=np.uint8), "LA")
    assert decode(encode(la, "PNG"), background=(1, 2, 3)).tolist() == [[[1, 2, 3], [50, 50, 50]]]


def test_an_opaque_rgba_image_gives_what_compositing_it_gives_bit_for_bit() -> None:
    """Opaque images skip the composite (it leaves alpha-255 pixels unchanged); the pixels are
    those of the composite, whatever the background, in RGB and in L."""
    rng = np.random.default_rng(11)
    pixels = rng.integers(0, 256, size=(40, 56, 4), dtype=np.uint8)
    pixels[..., 3] = 255
    opaque = Image.fromarray(pixels, "RGBA")
    for background in ((255, 255, 255), (3, 200, 17)):
        composite = Image.alpha_composite(Image.new("RGBA", opaque.size, (*background, 255)), opaque)
        for mode in ("RGB", "L"):
            want = np.asarray(composite.convert(mode)).reshape(40, 56, -1)
            got = decode(encode(opaque, "PNG"), background=background, mode=mode)
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(decode(encode(opaque, "PNG")), pixels[..., :3])
    # One pixel short of opaque: composited as before.
    pixels[7, 9, 3] = 254
    partly = Image.fromarray(pixels, "RGBA")
    black = Image.alpha_composite(Image.new("RGBA", partly.size, (0, 0, 0, 255)), partly).convert("RGB")
    np.testing.assert_array_equal(decode(encode(partly, "PNG"), background=(0, 0, 0)), np.asarray(black))


def test_grayscale_gives_three_equal_channels_or_one_channel_in_mode_l() -> None:
    grey = np.array([[0, 128, 255]], dtype=np.uint8)
    data = encode(Image.fromarray(grey, "L"), "PNG")
    assert decode(data).tolist() == [[[0, 0, 0], [128, 128, 128], [255, 255, 255]]]
    assert decode(data, mode="L").tolist() == [[[0], [128], [255]]]


def test_sixteen_bit_grayscale_is_scaled_to_eight_bits() -> None:
    wide = np.array([[0, 65535, 257 * 100, 128]], dtype=np.uint16)
    data = encode(Image.fromarray(wide), "PNG")
    assert decode(data, mode="L")[0, :, 0].tolist() == [0, 255, 100, 0]


def test_cmyk_jpeg_gives_rgb() -> None:
    data = encode(gradient(16, 12, seed=3).convert("CMYK"), "JPEG", quality=95)
    image = decode(data)
    assert image.shape == (12, 16, 3)
    np.testing.assert_array_equal(image, pillow_rgb(data))


def test_exif_orientation_is_applied_unless_disabled() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    data = encode(gradient(40, 20), "JPEG", exif=exif.tobytes())
    assert decode(data).shape == (40, 20, 3)
    assert decode(data, exif_transpose=False).shape == (20, 40, 3)


def test_jpeg_draft_decodes_at_the_smallest_scale_still_covering_the_draft_size() -> None:
    data = encode(gradient(256, 200), "JPEG")
    assert decode(data, draft_size=64).shape == (100, 128, 3)  # 1/2: 1/4 would give 50 rows
    assert decode(data, draft_size=(50, 64)).shape == (50, 64, 3)  # 1/4
    assert decode(data, draft_size=300).shape == (200, 256, 3)  # never below full scale
    # Other formats ignore draft_size.
    assert decode(encode(gradient(256, 200), "PNG"), draft_size=64).shape == (200, 256, 3)
    assert ops.DecodeImage(draft_size=64).params() != ops.DecodeImage().params()


def test_an_image_over_the_pixel_limit_is_refused_from_its_header() -> None:
    data = encode(gradient(200, 100), "JPEG")
    assert decode(data, max_pixels=20_000).shape == (100, 200, 3)
    # The header alone decides: a truncated body is never reached.
    with pytest.raises(DataError) as info:
        decode(data[: len(data) // 2], key="big", max_pixels=19_999)
    assert str(info.value).startswith(
        "DecodeImage: the image in field 'jpg' of sample 'big' is 200x100 = 20000 pixels, over "
        "max_pixels=19999 (a decompression bomb?)"
    )


def test_a_truncated_jpeg_is_a_data_error_naming_the_sample() -> None:
    data = encode(gradient(64, 64), "JPEG")
    with pytest.raises(DataError) as info:
        decode(data[: len(data) // 2], key="000042")
    message = str(info.value)
    assert message.startswith(
        f"DecodeImage: cannot decode the image in field 'jpg' of sample '000042' ({len(data) // 2} bytes): "
    )
    assert "truncated" in message


def test_bytes_that_are_not_an_image_are_a_data_error() -> None:
    with pytest.raises(DataError) as info:
        decode(b"this is a caption, not a picture", key="x7")
    assert str(info.value).startswith(
        "DecodeImage: cannot decode the image in field 'jpg' of sample 'x7' (32 bytes): cannot identify image file"
    )


def test_only_the_allowed_formats_are_opened() -> None:
    data = encode(gradient(4, 4), "PNG")
    with pytest.raises(
        DataError,
        match=r"DecodeImage: cannot decode the image in field 'jpg' of sample 'p' \(\d+ bytes\): cannot identify image file",
    ):
        decode(data, key="p", formats=("JPEG",))
    assert decode(data, formats=("png",)).shape == (4, 4, 3)
    assert decode(encode(gradient(4, 4), "WEBP", lossless=True)).shape == (4, 4, 3)


def test_by_default_the_usual_webdataset_image_fields_are_tried() -> None:
    (out,) = ops.DecodeImage().process({"__key__": "w", "webp": encode(gradient(3, 2), "WEBP")})
    assert sorted(out) == ["__key__", "image"] and out["image"].shape == (2, 3, 3)
    with pytest.raises(
        DataError, match="DecodeImage: sample 'x' has no field 'jpg' or 'jpeg' or 'png' or 'webp'"
    ):
        list(ops.DecodeImage().process({"__key__": "x", "txt": b""}))


def test_the_first_present_of_several_fields_is_decoded() -> None:
    fn = ops.DecodeImage(field=("jpg", "png"))
    (out,) = fn.process({"__key__": "a", "png": encode(gradient(3, 2), "PNG"), "txt": b""})
    assert sorted(out) == ["__key__", "image", "txt"] and out["image"].shape == (2, 3, 3)
    with pytest.raises(DataError, match="DecodeImage: cannot decode the image in field 'png' of sample 'b'"):
        list(fn.process({"__key__": "b", "png": b"nope"}))
    with pytest.raises(
        DataError, match=r"DecodeImage: sample 'c' has no field 'jpg' or 'png' \(it has \['__key__'\]\)"
    ):
        list(fn.process({"__key__": "c"}))


def test_samples_without_the_field_or_with_the_wrong_type_are_data_errors() -> None:
    fn = ops.DecodeImage(field="png")
    with pytest.raises(
        DataError, match=r"DecodeImage: sample 'a' has no field 'png' \(it has \['__key__', 'jpg'\]\)"
    ):
        list(fn.process({"__key__": "a", "jpg": b""}))
    with pytest.raises(DataError, match="DecodeImage: field 'png' of the sample holds str, not bytes"):
        list(fn.process({"png": "text"}))
    with pytest.raises(DataError, match="DecodeImage: expected a dict sample with a 'png' field"):
        list(fn.process(3))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_pixels": 0}, "DecodeImage: max_pixels must be a positive integer, got 0"),
        ({"mode": "CMYK"}, "DecodeImage: mode must be one of 'RGB', 'L', got 'CMYK'"),
        ({"draft_size": (0, 4)}, r"DecodeImage: draft_size must be a positive int or \(height, width\)"),
        ({"field": ""}, "DecodeImage: field must be a non-empty string or strings"),
        ({"field": ()}, r"DecodeImage: field must be a non-empty string or strings, got \(\)"),
        ({"background": (0, 0)}, "DecodeImage: background must be three ints in 0..255"),
        ({"formats": "JPEG"}, "DecodeImage: formats must be a tuple of Pillow format names, got 'JPEG'"),
    ],
)
def test_invalid_options_are_refused_up_front(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ops.DecodeImage(**options)


def test_in_a_pipeline_the_error_also_names_the_file_and_the_dofn(tmp_path: Path) -> None:
    (tmp_path / "00000.jpg").write_bytes(b"not an image at all")
    (tmp_path / "00000.txt").write_text("caption")
    import apache_beam as beam

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "images" >> ReadImageFolder(str(tmp_path / "*.jpg"), epochs=1)
        return samples | "decode" >> beam.ParDo(ops.DecodeImage())

    with pytest.raises(DataError) as info:
        run_batches(zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1))
    message = str(info.value)
    assert "DecodeImage: cannot decode the image in field 'jpg' of sample '00000'" in message
    assert f"(DoFn 'decode', on the record at {tmp_path / '00000.jpg'} the whole file" in message


def test_sixteen_bit_conversion_rounds_every_value_as_before_in_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zephon_flow.operators import image_decode

    monkeypatch.setattr(image_decode, "_NARROW_BLOCK", 7)  # many blocks, a partial last one
    values = np.arange(0, 65536, 13, dtype=np.uint16)[: 61 * 81].reshape(61, 81)
    got = image_decode._narrow(Image.fromarray(values))
    expected = (values.astype(np.int64) * 255 + 32767) // 65535
    assert got.tolist() == expected.tolist()
    wild = np.array([[-5, 70000, 65535, 1]], dtype=np.int32)  # mode "I" holds anything
    assert image_decode._narrow(Image.fromarray(wild)).tolist() == [[0, 255, 255, 0]]


def test_a_large_sixteen_bit_png_costs_about_its_pixels_not_int64_copies() -> None:
    import tracemalloc

    side = 2000
    data = encode(Image.fromarray(np.full((side, side), 40000, dtype=np.uint16)), "PNG")
    assert len(data) < 100_000  # a small file that expands to 4 M pixels
    tracemalloc.start()
    try:
        image = decode(data, mode="L")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert image.shape == (side, side, 1) and int(image[0, 0, 0]) == 156
    # The 8-bit result is 1 byte per pixel; int64 intermediates cost 8 bytes each (24+ in all).
    assert peak < 4 * side * side, f"peak {peak / 1e6:.0f} MB for {side * side / 1e6:.0f} M pixels"
