"""``PackMultimodal``: image-caption samples into fixed-length sequences with their images (stateful)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import (
    ReadModifyWriteStateSpec,
    TimeDomain,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import MAX_TIMESTAMP

from zephon_flow.core.checkpoint.packed_segments import PACKED_SEGMENTS
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.markers import ProvenanceParam
from zephon_flow.operators.image_decode import sample_name

_EMPTY = np.zeros(0, dtype=np.int32)
_NO_DOCS = np.zeros((0, 3), dtype=np.int64)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"PackMultimodal: {name} must be a positive integer, got {value!r}")
    return value


def _empty() -> dict[str, Any]:
    return {"ids": _EMPTY, "pos": _EMPTY, "seg": _EMPTY, "images": [], "docs": _NO_DOCS, "truncated": 0}


class PackMultimodal(beam.DoFn):  # type: ignore[misc]
    """Packs samples ``{text_field: ids, image_field: [H, W, C] image}`` into sequences.

    A sample contributes ``tokens_per_image`` copies of ``image_token_id`` (where the trainer
    puts the image's embeddings) followed by its caption ids. Samples are packed greedily, in
    order, into sequences of exactly ``seq_len`` tokens holding at most ``max_images`` images;
    a sample never straddles two sequences: when it does not fit, the open sequence is closed
    and padded (``pad_id``, position 0, segment -1) and the sample starts the next one. A
    caption longer than ``seq_len - tokens_per_image`` is truncated to fit, and the number of
    caption tokens dropped is reported in the output's ``truncated_tokens``.

    Each output is a dict: ``input_ids``, ``position_ids`` (restarting at 0 at each sample),
    ``segment_ids`` (0, 1, ... per sample; -1 on padding), all int32 ``[seq_len]``;
    ``images`` ``[max_images, H, W, C]`` (the images in order of their placeholders, zeros in
    unused slots, the images' dtype); ``image_count`` and ``truncated_tokens`` (int32
    scalars); and ``documents`` (int64 ``[k, 3]``: per sample, in order, the
    ``(source, split, offset)`` id of its source record, from ``zf.ProvenanceParam``).
    Every image must have the same shape and dtype (put ``ResizeImage`` first). At the end of
    a finite input the last open sequence is padded and emitted. The open sequence is the
    lane state.
    """

    OPEN = ReadModifyWriteStateSpec("open", PickleCoder())
    FLUSH = TimerSpec("flush", TimeDomain.WATERMARK)
    #: The checkpoint codecs of its outputs' derived fields (the plan collects them).
    derived_fields = (PACKED_SEGMENTS,)

    def __init__(
        self,
        seq_len: int,
        *,
        image_token_id: int,
        tokens_per_image: int,
        max_images: int,
        text_field: str = "text_ids",
        image_field: str = "image",
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = _positive("seq_len", seq_len)
        self.tokens_per_image = _positive("tokens_per_image", tokens_per_image)
        self.max_images = _positive("max_images", max_images)
        if self.tokens_per_image > self.seq_len:
            raise SpecError(
                f"PackMultimodal: tokens_per_image={tokens_per_image} does not fit in seq_len={seq_len}"
            )
        for name, token in (("image_token_id", image_token_id), ("pad_id", pad_id)):
            if isinstance(token, bool) or not isinstance(token, int | np.integer):
                raise SpecError(f"PackMultimodal: {name} must be an integer token id, got {token!r}")
        for name, text in (("text_field", text_field), ("image_field", image_field)):
            if not isinstance(text, str) or not text:
                raise SpecError(f"PackMultimodal: {name} must be a non-empty string, got {text!r}")
        self.image_token_id = int(image_token_id)
        self.pad_id = int(pad_id)
        self.text_field = text_field
        self.image_field = image_field

    def placeholder_tokens(self) -> set[int]:
        """Ids that stand for images in its sequences (``zephon inspect`` counts them apart)."""
        return {self.image_token_id}

    def params(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "image_token_id": self.image_token_id,
            "tokens_per_image": self.tokens_per_image,
            "max_images": self.max_images,
            "text_field": self.text_field,
            "image_field": self.image_field,
            "pad_id": self.pad_id,
        }

    def process(
        self,
        element: tuple[int, Any],
        open_: Any = beam.DoFn.StateParam(OPEN),
        flush: Any = beam.DoFn.TimerParam(FLUSH),
        doc: Any = ProvenanceParam,
    ) -> Any:
        _lane, sample = element
        caption, image, name = self._fields(sample)
        # The sample's source record, (source, split, offset); -1s when called outside the runner.
        row = np.asarray([doc if isinstance(doc, tuple) else (-1, -1, -1)], dtype=np.int64).reshape(1, 3)
        held = open_.read()
        if held is None:
            flush.set(MAX_TIMESTAMP)
            held = _empty()
        elif held["images"]:
            first = held["images"][0]
            if image.shape != first.shape or image.dtype != first.dtype:
                raise DataError(
                    f"PackMultimodal: the image of {name} is {image.dtype}{list(image.shape)} but "
                    f"the open sequence holds {first.dtype}{list(first.shape)}; every image must have "
                    f"one shape (put ResizeImage before PackMultimodal)"
                )
        room = self.seq_len - self.tokens_per_image
        truncated = max(0, caption.size - room)
        ids = np.concatenate(
            [np.full(self.tokens_per_image, self.image_token_id, dtype=np.int32), caption[:room]]
        )
        if held["ids"].size + ids.size > self.seq_len:
            yield self._close(held)
            held = _empty()
        held = {
            "ids": np.concatenate([held["ids"], ids]),
            "pos": np.concatenate([held["pos"], np.arange(ids.size, dtype=np.int32)]),
            "seg": np.concatenate([held["seg"], np.full(ids.size, len(held["images"]), dtype=np.int32)]),
            "images": [*held["images"], image],
            "docs": np.concatenate([held["docs"], row]),
            "truncated": held["truncated"] + truncated,
        }
        if held["ids"].size == self.seq_len or len(held["images"]) == self.max_images:
            yield self._close(held)
            held = _empty()
        open_.write(held)

    @on_timer(FLUSH)
    def flush_tail(self, open_: Any = beam.DoFn.StateParam(OPEN)) -> Any:
        held = open_.read()
        open_.clear()
        if held is not None and held["images"]:
            yield self._close(held)

    def _fields(self, sample: Any) -> tuple[np.ndarray, np.ndarray, str]:
        """The caption ids (int32) and the image of one sample, checked."""
        if not isinstance(sample, Mapping):
            raise DataError(
                f"PackMultimodal: expected a dict sample with {self.text_field!r} and "
                f"{self.image_field!r}, got {type(sample).__name__}"
            )
        name = sample_name(sample)
        for field in (self.text_field, self.image_field):
            if field not in sample:
                raise DataError(
                    f"PackMultimodal: {name} has no field {field!r} (it has {sorted(sample)}); "
                    f"set PackMultimodal(text_field=..., image_field=...)"
                )
        caption = np.asarray(sample[self.text_field])
        if caption.ndim != 1 or caption.dtype.kind not in "iu":
            raise DataError(
                f"PackMultimodal: field {self.text_field!r} of {name} is {caption.dtype}"
                f"{list(caption.shape)}; expected a 1-d integer array of token ids"
            )
        image = np.asarray(sample[self.image_field])
        if image.ndim != 3:
            raise DataError(
                f"PackMultimodal: field {self.image_field!r} of {name} is {image.dtype}"
                f"{list(image.shape)}; expected an image [height, width, channels]"
            )
        return caption.astype(np.int32, copy=False), image, name

    def _close(self, held: dict[str, Any]) -> dict[str, np.ndarray]:
        """The padded output of an open sequence."""
        pad = self.seq_len - held["ids"].size
        first, count = held["images"][0], len(held["images"])
        # Each image copied once into place (assigning the list would stack it into a temporary
        # first), and only the unused slots zeroed.
        images = np.empty((self.max_images, *first.shape), dtype=first.dtype)
        for slot, image in enumerate(held["images"]):
            images[slot] = image
        images[count:] = 0
        return {
            "input_ids": np.concatenate([held["ids"], np.full(pad, self.pad_id, dtype=np.int32)]),
            "position_ids": np.concatenate([held["pos"], np.zeros(pad, dtype=np.int32)]),
            "segment_ids": np.concatenate([held["seg"], np.full(pad, -1, dtype=np.int32)]),
            "images": images,
            "image_count": np.asarray(count, dtype=np.int32),
            "truncated_tokens": np.asarray(held["truncated"], dtype=np.int32),
            "documents": held["docs"],
        }
