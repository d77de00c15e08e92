"""Tests of PackMultimodal: exact sequences and image slots, truncation, errors, checkpoint/resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpointing import assert_equal_output_after_checkpoint
from helpers import Corpus, chain_spec, run_batches, write_jsonl
from vlm_helpers import ParseSample, vlm_spec, write_captioned_images

from zephon_flow import operators as ops
from zephon_flow.core.batches import split_ragged
from zephon_flow.core.errors import DataError, SpecError

# key | caption ids | image fill value
HAND = ["a|5 6|10", "b|7|20", "c|8 9 10 11 12|30", "d|13|40"]


def pack(**options: Any) -> ops.PackMultimodal:
    kwargs: dict[str, Any] = {"image_token_id": 1, "tokens_per_image": 2, "max_images": 2, **options}
    return ops.PackMultimodal(kwargs.pop("seq_len", 8), **kwargs)


def hand_batches(tmp_path: Path, texts: list[str], **options: Any) -> list[dict[str, np.ndarray]]:
    path = write_jsonl(tmp_path / "hand.jsonl", texts)
    return run_batches(chain_spec(path, ("parse", ParseSample()), ("pack", pack(**options)), epochs=1))


def fills(batch: dict[str, np.ndarray]) -> list[int]:
    """The fill value of each image slot of the batch's one sequence."""
    return [int(image[0, 0, 0]) for image in batch["images"][0]]


def test_packs_hand_made_samples_greedily_without_splitting_them(tmp_path: Path) -> None:
    batches = hand_batches(tmp_path, HAND, pad_id=99)
    got = [
        (b["input_ids"][0].tolist(), b["position_ids"][0].tolist(), b["segment_ids"][0].tolist())
        for b in batches
    ]
    assert got == [
        # a and b: max_images reached, so the sequence closes with one pad token.
        ([1, 1, 5, 6, 1, 1, 7, 99], [0, 1, 2, 3, 0, 1, 2, 0], [0, 0, 0, 0, 1, 1, 1, -1]),
        # c: d (3 tokens) does not fit in the last one, so it starts the next sequence.
        ([1, 1, 8, 9, 10, 11, 12, 99], [0, 1, 2, 3, 4, 5, 6, 0], [0, 0, 0, 0, 0, 0, 0, -1]),
        # d: the end of the finite input flushes the open sequence.
        ([1, 1, 13, 99, 99, 99, 99, 99], [0, 1, 2, 0, 0, 0, 0, 0], [0, 0, 0, -1, -1, -1, -1, -1]),
    ]
    assert [fills(b) for b in batches] == [[10, 20], [30, 0], [40, 0]]
    assert [int(b["image_count"][0]) for b in batches] == [2, 1, 1]
    assert [int(b["truncated_tokens"][0]) for b in batches] == [0, 0, 0]
    # Provenance: (source 0, split 0, byte offset of the sample's JSONL line), one row per sample.
    starts = np.cumsum([0] + [len(json.dumps({"text": t})) + 1 for t in HAND]).tolist()
    assert [b["documents"].tolist() for b in batches] == [
        [[0, 0, starts[0]], [0, 0, starts[1]]],
        [[0, 0, starts[2]]],
        [[0, 0, starts[3]]],
    ]
    assert [b["documents_count"].tolist() for b in batches] == [[2], [1], [1]]
    b = batches[0]
    assert b["images"].shape == (1, 2, 2, 2, 1) and b["images"].dtype == np.uint8
    assert {k: b[k].dtype for k in ("input_ids", "position_ids", "segment_ids", "image_count")} == {
        k: np.dtype(np.int32) for k in ("input_ids", "position_ids", "segment_ids", "image_count")
    }


def test_a_sequence_filled_exactly_closes_at_once(tmp_path: Path) -> None:
    batches = hand_batches(tmp_path, ["a|5 6|1", "b|7 8|2", "c|9|3"], max_images=3)
    assert [b["input_ids"][0].tolist() for b in batches] == [
        [1, 1, 5, 6, 1, 1, 7, 8],
        [1, 1, 9, 0, 0, 0, 0, 0],
    ]
    assert [int(b["image_count"][0]) for b in batches] == [2, 1]


def test_a_caption_too_long_for_a_sequence_is_truncated_and_counted(tmp_path: Path) -> None:
    batches = hand_batches(tmp_path, ["a|5|1", "long|2 3 4 5 6 7 8 9 10 11|2", "c|9|3"])
    assert [b["input_ids"][0].tolist() for b in batches] == [
        [1, 1, 5, 0, 0, 0, 0, 0],
        [1, 1, 2, 3, 4, 5, 6, 7],
        [1, 1, 9, 0, 0, 0, 0, 0],
    ]
    assert [int(b["truncated_tokens"][0]) for b in batches] == [0, 4, 0]


def test_images_of_another_shape_are_a_data_error_naming_the_sample() -> None:
    fn = pack()
    held: dict[str, Any] = {}

    class State:
        def read(self) -> Any:
            return held.get("v")

        def write(self, v: Any) -> None:
            held["v"] = v

    class Timer:
        def set(self, _: Any) -> None:
            pass

    sample = {"__key__": "a", "text_ids": np.asarray([5]), "image": np.zeros((2, 2, 3), np.uint8)}
    assert list(fn.process((0, sample), State(), Timer())) == []
    other = {"__key__": "b", "text_ids": np.asarray([5]), "image": np.zeros((3, 2, 3), np.uint8)}
    with pytest.raises(DataError) as info:
        list(fn.process((0, other), State(), Timer()))
    assert str(info.value).startswith(
        "PackMultimodal: the image of sample 'b' is uint8[3, 2, 3] but the open sequence holds uint8[2, 2, 3]"
    )


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ("text", "PackMultimodal: expected a dict sample with 'text_ids' and 'image', got str"),
        (
            {"__key__": "k", "image": 0},
            r"PackMultimodal: sample 'k' has no field 'text_ids' \(it has \['__key__', 'image'\]\)",
        ),
        (
            {"text_ids": np.zeros(2), "image": 0},
            r"PackMultimodal: field 'text_ids' of the sample is float64\[2\]",
        ),
        (
            {"text_ids": np.zeros(2, np.int32), "image": np.zeros((2, 2))},
            r"field 'image' of the sample is float64\[2, 2\]",
        ),
    ],
)
def test_malformed_samples_are_data_errors(sample: Any, message: str) -> None:
    with pytest.raises(DataError, match=message):
        list(pack().process((0, sample), None, None))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seq_len": 0}, "PackMultimodal: seq_len must be a positive integer, got 0"),
        ({"max_images": 0}, "PackMultimodal: max_images must be a positive integer, got 0"),
        ({"tokens_per_image": 9}, "PackMultimodal: tokens_per_image=9 does not fit in seq_len=8"),
        ({"image_token_id": "<image>"}, "PackMultimodal: image_token_id must be an integer token id"),
        ({"text_field": ""}, "PackMultimodal: text_field must be a non-empty string"),
    ],
)
def test_invalid_options_are_refused_up_front(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        pack(**options)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_captioned_images(tmp_path_factory.mktemp("images"), 14, seed=3)


def test_every_image_of_a_finite_run_is_packed_once(images: str, corpus: Corpus) -> None:
    spec = vlm_spec(images, corpus.tokenizer_json, lanes=2, global_batch_size=2, epochs=1)
    batches = run_batches(spec)
    assert sum(int(b["image_count"].sum()) for b in batches) == 14
    first = batches[0]
    assert first["images"].shape == (2, 3, 8, 8, 3) and first["input_ids"].shape == (2, 24)
    # Every image file (one split each) is named by exactly one provenance row, and the image
    # slots hold exactly what DecodeImage and ResizeImage make of those files, in order.
    splits = spec.compile().sources[0].source.splits()
    decode, resize = ops.DecodeImage(draft_size=8), ops.ResizeImage(8)
    seen = []
    for b in batches:
        for i, docs in enumerate(split_ragged(b)):
            assert int(b["image_count"][i]) == len(docs)
            for slot, (source, split, offset) in enumerate(docs.tolist()):
                assert (source, offset) == (0, 0)
                seen.append(split)
                with open(splits[split].path, "rb") as f:
                    want = resize.resize(decode.decode(f.read(), "file"), "file")
                np.testing.assert_array_equal(b["images"][i, slot], want)
            assert not b["images"][i, len(docs) :].any()
    assert sorted(seen) == list(range(14))


def test_resuming_at_every_step_continues_exactly(images: str, corpus: Corpus) -> None:
    spec = vlm_spec(images, corpus.tokenizer_json, lanes=2, global_batch_size=2)
    ref = assert_equal_output_after_checkpoint(spec, 8, world_size=2)
    # The run crosses an epoch boundary (14 images, at most 3 per sequence, 16 sequences).
    assert sum(int(b["image_count"].sum()) for b in ref.batches) > 14


def test_params_are_part_of_the_fingerprint(images: str, corpus: Corpus) -> None:
    a = vlm_spec(images, corpus.tokenizer_json, max_images=3)
    b = vlm_spec(images, corpus.tokenizer_json, max_images=2)
    assert a.fingerprint["operator pack"] != b.fingerprint["operator pack"]
    assert a.fingerprint["operator decode"] == b.fingerprint["operator decode"]
