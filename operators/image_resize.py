"""``ResizeImage``: an ``H x W x C`` uint8 image to a fixed size by center crop or padding (stateless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from PIL import Image

from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators.image_decode import DecodeImage, sample_name

MODES = ("center_crop", "pad")
RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}


def _pair(value: Any) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise SpecError(f"ResizeImage: size must be a positive int or (height, width), got {value!r}")
    return int(pair[0]), int(pair[1])


def _channels(name: str, value: Any, low: float, high: float) -> tuple[float, ...]:
    values = (value,) if isinstance(value, int | float) else tuple(value)
    if len(values) not in (1, 3) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and low <= v <= high for v in values
    ):
        raise SpecError(
            f"ResizeImage: {name} must be a number or 3 numbers (per channel) in [{low}, {high}], got {value!r}"
        )
    return tuple(float(v) for v in values)


class ResizeImage(beam.DoFn):  # type: ignore[misc]
    """Resizes ``element[field]`` to exactly ``size`` (``[h, w, C]``) and stores it under ``output``.

    ``mode="center_crop"`` scales the image so it covers ``h x w`` and keeps the centre (one
    Pillow resize of the central box, no intermediate image); ``mode="pad"`` scales it to fit
    inside ``h x w`` and centres it on a canvas of ``pad_value``. Small images are scaled up.
    The result is ``uint8``; with ``normalize=(mean, std)`` (per channel, on the 0..1 scale,
    e.g. ImageNet's) it is ``float32`` ``(x / 255 - mean) / std``, padding included.

    The pixels are a pure function of the input pixels and the options for one Pillow version
    (resampling is integer fixed-point arithmetic). The Pillow version is not part of the
    fingerprint: a checkpoint resumes after an upgrade (nothing is lost or repeated), but the
    batches are bit-identical only while the version is pinned.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        mode: str = "center_crop",
        field: str = "image",
        output: str | None = None,
        normalize: tuple[Any, Any] | None = None,
        resample: str = "bicubic",
        pad_value: int | Sequence[int] = 0,
    ) -> None:
        super().__init__()
        self.size = _pair(size)
        if mode not in MODES:
            raise SpecError(f"ResizeImage: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if resample not in RESAMPLE:
            raise SpecError(
                f"ResizeImage: resample must be one of {', '.join(map(repr, RESAMPLE))}, got {resample!r}"
            )
        output = field if output is None else output
        for name, value in (("field", field), ("output", output)):
            if not isinstance(value, str) or not value:
                raise SpecError(f"ResizeImage: {name} must be a non-empty string, got {value!r}")
        self.mode = mode
        self.field = field
        self.output = output
        self.resample = resample
        self.pad_value = tuple(int(v) for v in _channels("pad_value", pad_value, 0, 255))
        self.mean: tuple[float, ...] | None = None
        self.std: tuple[float, ...] | None = None
        if normalize is not None:
            if isinstance(normalize, str | bytes) or len(normalize) != 2:
                raise SpecError(f"ResizeImage: normalize must be (mean, std) or None, got {normalize!r}")
            self.mean = _channels("normalize mean", normalize[0], -1e6, 1e6)
            self.std = _channels("normalize std", normalize[1], 1e-12, 1e6)

    def params(self) -> dict[str, Any]:
        return {
            "size": list(self.size),
            "mode": self.mode,
            "field": self.field,
            "output": self.output,
            "resample": self.resample,
            "pad_value": list(self.pad_value),
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
        }

    def fuse_after(self, previous: Any) -> beam.DoFn | None:
        """The one DoFn doing ``previous`` then this, when ``previous`` is a ``DecodeImage``
        whose output this resizes in place (``output`` is ``field``); else None, and the
        runner's front calls them one by one."""
        if type(previous) is DecodeImage and previous.output == self.field == self.output:
            return DecodeThenResize(previous, self)
        return None

    def process(self, element: Any) -> Any:
        if isinstance(element, np.ndarray | Image.Image):
            yield self.resize(element, "the sample")
            return
        if not isinstance(element, Mapping):
            raise DataError(
                f"ResizeImage: expected a dict sample with a {self.field!r} field (or an array), "
                f"got {type(element).__name__}"
            )
        name = sample_name(element)
        if self.field not in element:
            raise DataError(
                f"ResizeImage: {name} has no field {self.field!r} (it has {sorted(element)}); "
                f"set ResizeImage(field=...)"
            )
        out = dict(element)
        out[self.output] = self.resize(element[self.field], name)
        yield out

    def resize(self, image: Any, name: str) -> np.ndarray:
        """The resized (and normalised) pixels of one ``H x W x C`` uint8 image (or of the
        ``L`` or ``RGB`` Pillow image ``DecodeImage.decode_image`` gives: see ``fuse_after``)."""
        if isinstance(image, Image.Image) and image.mode in ("L", "RGB"):
            im, channels = image, len(image.mode)
        else:
            arr = np.asarray(image)
            if arr.ndim != 3 or arr.shape[2] not in (1, 3) or arr.dtype != np.uint8 or 0 in arr.shape:
                raise DataError(
                    f"ResizeImage: field {self.field!r} of {name} is {arr.dtype}{list(arr.shape)}; "
                    f"expected uint8 [height, width, 1 or 3] (put DecodeImage before ResizeImage)"
                )
            channels = arr.shape[2]
            im = Image.fromarray(arr[:, :, 0] if channels == 1 else arr)
        out = self._crop(im) if self.mode == "center_crop" else self._pad(im, channels)
        out = out.reshape(self.size[0], self.size[1], channels)
        if self.mean is None or self.std is None:
            return out
        if len(self.mean) not in (1, channels) or len(self.std) not in (1, channels):
            raise DataError(
                f"ResizeImage: normalize has {len(self.mean)} means and {len(self.std)} stds for "
                f"the {channels}-channel image in field {self.field!r} of {name}"
            )
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        # Elementwise IEEE float32 operations: the same bits on every machine.
        return np.ascontiguousarray((out.astype(np.float32) / np.float32(255.0) - mean) / std)

    def _crop(self, im: Image.Image) -> np.ndarray:
        h, w = self.size
        src_w, src_h = im.size
        if src_w * h > src_h * w:  # wider than the target: keep the central columns
            keep = src_h * w / h
            box = ((src_w - keep) / 2, 0.0, (src_w + keep) / 2, float(src_h))
        else:  # taller (or the same shape): keep the central rows
            keep = src_w * h / w
            box = (0.0, (src_h - keep) / 2, float(src_w), (src_h + keep) / 2)
        return np.asarray(im.resize((w, h), RESAMPLE[self.resample], box=box), dtype=np.uint8)

    def _pad(self, im: Image.Image, channels: int) -> np.ndarray:
        h, w = self.size
        src_w, src_h = im.size
        scale = min(w / src_w, h / src_h)
        new_w = min(w, max(1, round(src_w * scale)))
        new_h = min(h, max(1, round(src_h * scale)))
        inner = np.asarray(im.resize((new_w, new_h), RESAMPLE[self.resample]), dtype=np.uint8)
        canvas = np.empty((h, w, channels), dtype=np.uint8)
        canvas[...] = np.asarray(self.pad_value[:channels] if len(self.pad_value) > 1 else self.pad_value)
        top, left = (h - new_h) // 2, (w - new_w) // 2
        canvas[top : top + new_h, left : left + new_w] = inner.reshape(new_h, new_w, channels)
        return canvas


class DecodeThenResize(beam.DoFn):  # type: ignore[misc]
    """``DecodeImage`` then ``ResizeImage`` in one call, with no full-size array in between.

    Apart, the decoder copies the decoded image into an array and the resizer copies it back
    into a Pillow image: two copies at the image's full size (for a 12-megapixel photo, 72
    MB), where the resized output is a few hundred KB. Here the decoder's Pillow image goes
    straight to the resize; the pixels are the same (an ``L`` or ``RGB`` image and its array
    hold the same bytes). The runner's front fuses the pair by itself (``fuse_after``); the
    spec, its fingerprint and the Beam graph keep the two operators.

    An error from the resize carries ``zephon_fused_part = 1``, so the runner names the
    resize's label, not the decoder's.
    """

    def __init__(self, decode: DecodeImage, resize: ResizeImage) -> None:
        super().__init__()
        self.decode, self.resize = decode, resize

    def setup(self) -> None:
        self.decode.setup()
        self.resize.setup()

    def process(self, element: Any) -> Any:
        for decoded in self.decode.outputs(element, self.decode.decode_image):
            try:
                outputs = list(self.resize.process(decoded))
            except Exception as exc:
                exc.zephon_fused_part = 1  # type: ignore[attr-defined]
                raise
            yield from outputs
