"""Tests of ResizeImage: center crop and pad geometry, normalisation, options and error messages."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image
from vlm_helpers import gradient

from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError


def resize(image: np.ndarray, size: Any, **options: Any) -> np.ndarray:
    (out,) = ops.ResizeImage(size, **options).process({"__key__": "k", "image": image})
    assert sorted(out) == ["__key__", "image"]
    result: np.ndarray = out["image"]
    return result


def bands(width: int, height: int) -> np.ndarray:
    """Left third red, middle green, right third blue (or top/middle/bottom when tall)."""
    image = np.zeros((height, width, 3), dtype=np.uint8)
    if width >= height:
        third = width // 3
        image[:, :third, 0] = image[:, third : 2 * third, 1] = image[:, 2 * third :, 2] = 255
    else:
        third = height // 3
        image[:third, :, 0] = image[third : 2 * third, :, 1] = image[2 * third :, :, 2] = 255
    return image


def test_center_crop_of_a_wide_image_keeps_the_middle() -> None:
    out = resize(bands(90, 30), 10, resample="nearest")
    assert out.shape == (10, 10, 3) and out.dtype == np.uint8
    assert (out == [0, 255, 0]).all()  # the central 30x30 box is the green band


def test_center_crop_of_a_tall_image_keeps_the_middle_rows() -> None:
    out = resize(bands(30, 90), (6, 6), resample="nearest")
    assert (out == [0, 255, 0]).all()


def test_center_crop_equals_pillow_resizing_the_central_box() -> None:
    image = np.asarray(gradient(50, 40, seed=4))
    want = np.asarray(Image.fromarray(image).resize((16, 16), Image.Resampling.BICUBIC, box=(5, 0, 45, 40)))
    np.testing.assert_array_equal(resize(image, 16), want)


def test_an_image_of_the_target_size_is_unchanged() -> None:
    image = np.asarray(gradient(12, 12, seed=5))
    np.testing.assert_array_equal(resize(image, 12), image)


def test_pad_fits_the_whole_image_and_centres_it_on_pad_value() -> None:
    image = np.full((10, 40, 3), 200, dtype=np.uint8)
    out = resize(image, 20, mode="pad", pad_value=(1, 2, 3), resample="nearest")
    assert out.shape == (20, 20, 3)
    # 40x10 scaled to 20x5, at rows 7..11.
    assert (out[7:12] == 200).all()
    assert (out[:7] == [1, 2, 3]).all() and (out[12:] == [1, 2, 3]).all()


def test_small_images_are_scaled_up() -> None:
    tiny = np.full((2, 3, 3), 77, dtype=np.uint8)
    assert (resize(tiny, 9) == 77).all()
    out = resize(tiny, 9, mode="pad")
    assert (out[1:7] == 77).all() and (out[0] == 0).all()  # 3x2 -> 9x6 at rows 1..6


def test_a_non_square_size_is_height_then_width() -> None:
    assert resize(bands(40, 40), (8, 16)).shape == (8, 16, 3)
    assert resize(bands(40, 40), (8, 16), mode="pad").shape == (8, 16, 3)


def test_one_channel_images_stay_one_channel() -> None:
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8, 1)
    assert resize(grey, 4).shape == (4, 4, 1)
    assert resize(grey, 4, mode="pad").shape == (4, 4, 1)


def test_normalize_gives_float32_per_channel() -> None:
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    image[..., 0], image[..., 1], image[..., 2] = 0, 255, 51
    out = resize(image, 4, normalize=((0.5, 0.5, 0.2), (0.5, 0.25, 0.1)))
    assert out.dtype == np.float32
    assert out[0, 0].tolist() == pytest.approx([-1.0, 2.0, 0.0], abs=1e-6)
    # One number applies to every channel.
    assert resize(image, 4, normalize=(0.0, 1.0))[0, 0].tolist() == pytest.approx([0.0, 1.0, 0.2])


def test_the_same_input_gives_the_same_bits() -> None:
    image = np.asarray(gradient(123, 77, seed=6))
    for mode in ("center_crop", "pad"):
        a = resize(image, 32, mode=mode, normalize=((0.4, 0.4, 0.4), (0.2, 0.2, 0.2)))
        b = resize(image.copy(), 32, mode=mode, normalize=((0.4, 0.4, 0.4), (0.2, 0.2, 0.2)))
        assert a.tobytes() == b.tobytes()


def test_output_field_and_bare_arrays() -> None:
    image = bands(10, 10)
    (out,) = ops.ResizeImage(5, output="small").process({"image": image})
    assert sorted(out) == ["image", "small"] and out["image"] is image
    (bare,) = ops.ResizeImage(5).process(image)
    assert bare.shape == (5, 5, 3)


def test_bad_images_are_data_errors_naming_the_sample() -> None:
    fn = ops.ResizeImage(8)
    with pytest.raises(DataError) as info:
        list(fn.process({"__key__": "s1", "image": np.zeros((4, 4), dtype=np.uint8)}))
    assert str(info.value) == (
        "ResizeImage: field 'image' of sample 's1' is uint8[4, 4]; expected uint8 "
        "[height, width, 1 or 3] (put DecodeImage before ResizeImage)"
    )
    with pytest.raises(DataError, match=r"ResizeImage: field 'image' of the sample is float64\[2, 2, 3\]"):
        list(fn.process({"image": np.zeros((2, 2, 3))}))
    with pytest.raises(
        DataError, match=r"ResizeImage: sample 's2' has no field 'image' \(it has \['__key__', 'jpg'\]\)"
    ):
        list(fn.process({"__key__": "s2", "jpg": b""}))
    with pytest.raises(
        DataError, match="ResizeImage: normalize has 3 means and 3 stds for the 1-channel image"
    ):
        list(ops.ResizeImage(2, normalize=((0, 0, 0), (1, 1, 1))).process(np.zeros((2, 2, 1), np.uint8)))


@pytest.mark.parametrize(
    ("size", "options", "message"),
    [
        (0, {}, r"ResizeImage: size must be a positive int or \(height, width\), got 0"),
        ((4, 4, 4), {}, "ResizeImage: size must be"),
        (4, {"mode": "stretch"}, "ResizeImage: mode must be one of 'center_crop', 'pad', got 'stretch'"),
        (4, {"resample": "cubic"}, "ResizeImage: resample must be one of 'nearest', "),
        (
            4,
            {"pad_value": 300},
            r"ResizeImage: pad_value must be a number or 3 numbers \(per channel\) in \[0, 255\]",
        ),
        (4, {"normalize": (0.5,)}, r"ResizeImage: normalize must be \(mean, std\) or None"),
        (4, {"normalize": (0.5, 0)}, "ResizeImage: normalize std must be"),
    ],
)
def test_invalid_options_are_refused_up_front(size: Any, options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ops.ResizeImage(size, **options)
