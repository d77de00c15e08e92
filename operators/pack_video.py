"""``PackVideo``: captioned clips into fixed-length sequences with their frames (stateful)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators.image_decode import sample_name
from zephon_flow.operators.pack_multimodal import PackMultimodal


class PackVideo(PackMultimodal):
    """``PackMultimodal`` for clips: packs ``{text_field: ids, video_field: [T, H, W, C]}``.

    A clip contributes ``tokens_per_frame * frames`` copies of ``video_token_id`` (its frames'
    placeholders, frame after frame) followed by its caption ids; clips are packed greedily,
    in order, into sequences of exactly ``seq_len`` tokens holding at most ``max_clips`` clips,
    and a clip never straddles two sequences (see ``PackMultimodal``, whose state, padding and
    provenance it shares: ``documents`` names each clip's ``(source, split, clip)``).

    Each output has ``input_ids``, ``position_ids``, ``segment_ids``, ``truncated_tokens``,
    ``documents`` as ``PackMultimodal``'s, and ``videos`` ``[max_clips, T, H, W, C]`` (zeros
    in unused slots) with ``video_count``. Every clip must have ``frames`` frames of one shape
    (``ReadVideo(frames=...)`` or ``fps=`` with ``clip_seconds=``, and ``DecodeVideo(size=)``).
    """

    def __init__(
        self,
        seq_len: int,
        *,
        video_token_id: int,
        tokens_per_frame: int,
        frames: int,
        max_clips: int,
        text_field: str = "text_ids",
        video_field: str = "frames",
        pad_id: int = 0,
    ) -> None:
        for name, value in (("tokens_per_frame", tokens_per_frame), ("frames", frames)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"PackVideo: {name} must be a positive integer, got {value!r}")
        if tokens_per_frame * frames > seq_len:
            raise SpecError(
                f"PackVideo: a clip's {frames} x {tokens_per_frame} placeholder tokens do not fit "
                f"in seq_len={seq_len}"
            )
        super().__init__(
            seq_len,
            image_token_id=video_token_id,
            tokens_per_image=tokens_per_frame * frames,
            max_images=max_clips,
            text_field=text_field,
            image_field=video_field,
            pad_id=pad_id,
        )
        self.frames = frames
        self.tokens_per_frame = tokens_per_frame

    def params(self) -> dict[str, Any]:
        return {**super().params(), "frames": self.frames, "tokens_per_frame": self.tokens_per_frame}

    def _fields(self, sample: Any) -> tuple[np.ndarray, np.ndarray, str]:
        if isinstance(sample, dict) and self.image_field in sample:
            clip = np.asarray(sample[self.image_field])
            if clip.ndim != 4 or clip.shape[0] != self.frames:
                raise DataError(
                    f"PackVideo: field {self.image_field!r} of {sample_name(sample)} is "
                    f"{clip.dtype}{list(clip.shape)}; expected {self.frames} frames "
                    f"[{self.frames}, height, width, channels]"
                )
            flat = {**sample, self.image_field: clip.reshape(clip.shape[0] * clip.shape[1], *clip.shape[2:])}
            caption, _frames, name = super()._fields(flat)
            return caption, clip, name
        return super()._fields(sample)

    def _close(self, held: dict[str, Any]) -> dict[str, np.ndarray]:
        out = super()._close(held)
        out["videos"] = out.pop("images")
        out["video_count"] = out.pop("image_count")
        return out
