"""``DecodeImage``: encoded image bytes to an ``H x W x C`` uint8 array with Pillow (stateless)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np
from PIL import ExifTags, Image, ImageOps

from zephon_flow.core.errors import DataError, SpecError

#: Output modes: ``"RGB"`` gives ``H x W x 3``, ``"L"`` (grey) gives ``H x W x 1``.
MODES = ("RGB", "L")
#: Formats opened by default: the common raster formats whose decoders are built into Pillow
#: (never, e.g., EPS, which Pillow hands to Ghostscript).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
#: The fields read by default: WebDataset's usual image extensions, the first one present.
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
#: Pillow modes holding 16 (or more) bits per sample: scaled to 8 bits as ``v * 255 / 65535``.
_WIDE = ("I", "I;16", "I;16B", "I;16L", "I;16N")


#: Pixels converted at a time from 16 to 8 bits: the temporaries stay a few MiB whatever the image.
_NARROW_BLOCK = 1 << 20


def _narrow(im: Image.Image) -> np.ndarray:
    """A 16-bit (or 32-bit integer) grey image as 8-bit grey, ``round(v * 255 / 65535)`` after
    clipping to 0..65535, a block of rows at a time in uint32 (``65535 * 255 + 32767`` fits):
    no full-size copy in a wider type, so a large image costs its decoded pixels and one byte
    per pixel more, not ten times that."""
    width, height = im.size
    out = np.empty((height, width), dtype=np.uint8)
    rows = max(1, _NARROW_BLOCK // max(width, 1))
    for top in range(0, height, rows):
        bottom = min(height, top + rows)
        block = np.asarray(im.crop((0, top, width, bottom)))
        if block.dtype != np.uint16:  # mode "I" (int32): may hold anything
            block = np.clip(block, 0, 65535)
        wide = block.astype(np.uint32)
        wide *= 255
        wide += 32767
        wide //= 65535
        out[top:bottom] = wide
    return out


def sample_name(element: Any) -> str:
    """How errors name a sample: its ``__key__`` when it has one."""
    if isinstance(element, Mapping) and "__key__" in element:
        return f"sample {element['__key__']!r}"
    return "the sample"


def _size_option(name: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair):
        raise SpecError(f"DecodeImage: {name} must be a positive int or (height, width), got {value!r}")
    return int(pair[0]), int(pair[1])


def _any_case(element: Mapping[Any, Any], fields: tuple[str, ...], name: str) -> str | None:
    """The key of ``element`` equal to one of ``fields`` but for case (the first field that has
    one), None if none; two such keys for one field are refused by name."""
    for f in fields:
        keys = sorted(k for k in element if isinstance(k, str) and k.lower() == f.lower())
        if len(keys) > 1:
            raise DataError(
                f"DecodeImage: {name} has fields {keys}, which differ only in case; which is {f!r}?"
            )
        if keys:
            return keys[0]
    return None


class DecodeImage(beam.DoFn):  # type: ignore[misc]
    """Decodes ``element[field]`` (bytes) and stores the pixels under ``element[output]``.

    ``field`` may list several names (by default ``IMAGE_FIELDS``: ``"jpg"``, ``"jpeg"``,
    ``"png"``, ``"webp"``): the first one the sample has is decoded. A name the sample lacks is
    also looked up whatever its case (``"jpg"`` finds a WebDataset sample's ``"JPG"``); two
    keys that differ only in case are refused by name.

    The element is a dict (e.g. a WebDataset sample ``{"__key__", "jpg", "txt"}``); the output
    is a new dict without ``field`` (unless ``keep_input``) and with ``output`` holding a
    C-contiguous ``uint8`` array ``[H, W, 3]`` (``mode="RGB"``) or ``[H, W, 1]`` (``"L"``).
    A bare ``bytes`` element gives the bare array.

    Conversion is fixed, so the same bytes always give the same pixels (for one Pillow
    version): EXIF orientation is applied (``exif_transpose``); images with transparency
    (``RGBA``, ``LA``, palettes with a transparent index) are composited over ``background``;
    16-bit images are scaled to 8 bits (``round(v * 255 / 65535)``); CMYK, YCbCr, palette and
    1-bit images go through Pillow's own conversion.

    ``max_pixels`` guards against decompression bombs: the size is read from the header and
    an image with more pixels is refused (``DataError``) before any pixel is decoded.
    Pillow's global ``MAX_IMAGE_PIXELS`` is left alone.

    ``draft_size=(h, w)`` (or an int) lets the JPEG decoder work at 1/2, 1/4 or 1/8 scale, the
    smallest scale that still gives at least ``h x w`` pixels: several times faster when a
    ``ResizeImage`` to that size follows (pass it the same size). It changes the pixels, so
    it is part of the fingerprint; other formats ignore it.

    Only ``formats`` are opened (Pillow's names; by default ``FORMATS``); anything else is a
    ``DataError`` like bytes that are not an image. Of an animated image, the first frame.
    """

    def __init__(
        self,
        *,
        field: str | Sequence[str] = IMAGE_FIELDS,
        output: str = "image",
        max_pixels: int = 64_000_000,
        draft_size: int | tuple[int, int] | None = None,
        mode: str = "RGB",
        exif_transpose: bool = True,
        background: tuple[int, int, int] = (255, 255, 255),
        keep_input: bool = False,
        formats: tuple[str, ...] = FORMATS,
    ) -> None:
        super().__init__()
        fields = (field,) if isinstance(field, str) else tuple(field)
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise SpecError(f"DecodeImage: field must be a non-empty string or strings, got {field!r}")
        if not isinstance(output, str) or not output:
            raise SpecError(f"DecodeImage: output must be a non-empty string, got {output!r}")
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
            raise SpecError(f"DecodeImage: max_pixels must be a positive integer, got {max_pixels!r}")
        if mode not in MODES:
            raise SpecError(f"DecodeImage: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        bg = tuple(background)
        if len(bg) != 3 or not all(isinstance(v, int) and 0 <= v <= 255 for v in bg):
            raise SpecError(f"DecodeImage: background must be three ints in 0..255, got {background!r}")
        if isinstance(formats, str) or not formats or not all(isinstance(f, str) and f for f in formats):
            raise SpecError(f"DecodeImage: formats must be a tuple of Pillow format names, got {formats!r}")
        self.formats = tuple(f.upper() for f in formats)
        self.fields = fields
        self.output = output
        self.max_pixels = max_pixels
        self.draft_size = _size_option("draft_size", draft_size)
        self.mode = mode
        self.exif_transpose = bool(exif_transpose)
        self.background = (int(bg[0]), int(bg[1]), int(bg[2]))
        self.keep_input = bool(keep_input)

    def params(self) -> dict[str, Any]:
        return {
            "field": list(self.fields),
            "output": self.output,
            "max_pixels": self.max_pixels,
            "draft_size": None if self.draft_size is None else list(self.draft_size),
            "mode": self.mode,
            "exif_transpose": self.exif_transpose,
            "background": list(self.background),
            "keep_input": self.keep_input,
            "formats": list(self.formats),
        }

    def process(self, element: Any) -> Any:
        return self.outputs(element, self.decode)

    def outputs(self, element: Any, decode: Callable[[bytes, str, str | None], Any]) -> Iterator[Any]:
        """``process`` with the pixels made by ``decode`` (``self.decode``, or ``self.decode_image``
        when a following ``ResizeImage`` takes the Pillow image as it is)."""
        if isinstance(element, bytes | bytearray | memoryview):
            yield decode(bytes(element), "the sample", None)
            return
        wanted = " or ".join(map(repr, self.fields))
        if not isinstance(element, Mapping):
            raise DataError(
                f"DecodeImage: expected a dict sample with a {wanted} field (or bytes), "
                f"got {type(element).__name__}"
            )
        name = sample_name(element)
        field = next((f for f in self.fields if f in element), None) or _any_case(element, self.fields, name)
        if field is None:
            raise DataError(
                f"DecodeImage: {name} has no field {wanted} (it has {sorted(element)}); "
                f"set DecodeImage(field=...)"
            )
        data = element[field]
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DataError(f"DecodeImage: field {field!r} of {name} holds {type(data).__name__}, not bytes")
        out = {k: v for k, v in element.items() if self.keep_input or k != field}
        out[self.output] = decode(bytes(data), name, field)
        yield out

    def decode(self, data: bytes, name: str, field: str | None = None) -> np.ndarray:
        """The pixels of one encoded image; ``name`` and ``field`` say where in errors."""
        arr = np.asarray(self.decode_image(data, name, field), dtype=np.uint8)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return np.ascontiguousarray(arr)

    def decode_image(self, data: bytes, name: str, field: str | None = None) -> Image.Image:
        """``decode``'s pixels as a loaded Pillow image in ``self.mode``, before they are copied
        into an array. It is read from memory, so there is no file to close."""
        where = f"field {field or self.fields[0]!r} of {name}"
        try:
            im = Image.open(io.BytesIO(data), formats=self.formats)
            pixels = im.size[0] * im.size[1]
            if pixels > self.max_pixels:
                raise DataError(
                    f"DecodeImage: the image in {where} is {im.size[0]}x{im.size[1]} = {pixels} "
                    f"pixels, over max_pixels={self.max_pixels} (a decompression bomb?); raise "
                    f"DecodeImage(max_pixels=...) if such images are expected"
                )
            if self.draft_size is not None and im.format == "JPEG":
                h, w = self.draft_size
                im.draft(im.mode, (w, h))
            im.load()
            return self._convert(im, where)
        except DataError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise DataError(f"DecodeImage: Pillow refuses the image in {where}: {exc}") from exc
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            # UnidentifiedImageError is an OSError; truncated data raises OSError or SyntaxError.
            raise DataError(
                f"DecodeImage: cannot decode the image in {where} ({len(data)} bytes): {exc}"
            ) from exc

    def _convert(self, im: Image.Image, where: str) -> Image.Image:
        # exif_transpose copies the image even when there is nothing to turn: ask first.
        if self.exif_transpose and im.getexif().get(ExifTags.Base.Orientation, 1) in range(2, 9):
            im = ImageOps.exif_transpose(im)
        if im.mode in _WIDE:
            im = Image.fromarray(_narrow(im))
        elif im.mode == "F":
            raise DataError(
                f"DecodeImage: the image in {where} holds floating-point pixels (Pillow mode 'F'), "
                f"which have no fixed 8-bit meaning; convert such images before the pipeline"
            )
        if im.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in im.info:
            rgba = im if im.mode == "RGBA" else im.convert("RGBA")  # convert() would copy it
            # Compositing leaves opaque pixels exactly as they are (Pillow's integer formula
            # gives src for alpha 255), so a wholly opaque image skips it: photos saved as RGBA.
            if rgba.getchannel("A").getextrema() == (255, 255):
                im = rgba
            else:
                base = Image.new("RGBA", rgba.size, (*self.background, 255))
                im = Image.alpha_composite(base, rgba)
        if im.mode != self.mode:
            im = im.convert(self.mode)
        return im
