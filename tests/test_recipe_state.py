"""Recipe state (``state_mode="recipe"``): buffered sequences stored as their documents, rebuilt
by re-reading them; the same batches as an uninterrupted run, at every step and topology."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from checkpointing import _global_run, assert_equal_output_after_checkpoint, reference_run
from helpers import Corpus, ParseIds, chain_spec, example_spec, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core import recipe
from zephon_flow.core.checkpoint.state import RECIPE_KIND, STATE_KIND
from zephon_flow.core.checkpoint.store import to_loader_state, write_state
from zephon_flow.core.errors import (
    RecipeMismatchError,
    RecipeRefusedError,
    SpecError,
    StateConflictError,
    StateError,
)

RECIPE: dict[str, Any] = {"state_mode": "recipe"}


def run_global(
    spec: zf.LoaderSpec, steps: int, *, state: bytes, world_size: int, **kwargs: Any
) -> list[dict[str, np.ndarray]]:
    """``steps`` global batches of ``world_size`` ranks resumed from ``state``."""
    return [batch for _, batch, _ in _global_run(spec, steps, state, world_size=world_size, **kwargs)]


def long_docs_spec(
    corpus: Corpus, tmp_path: Path, pack: ops.Pack | None = None, **kwargs: Any
) -> zf.LoaderSpec:
    """Hand-made documents, some many sequences long (pieces in their middle), several per
    record (``|``), packed and shuffled."""
    rng = np.random.default_rng(5)
    lines = []
    for i in range(40):
        parts = []
        for _ in range(1 + i % 3):
            n = int(rng.integers(1, 60 if i % 5 else 200))
            parts.append(" ".join(str(int(t)) for t in rng.integers(1, 9, size=n)))  # repetitive
        lines.append(" | ".join(parts))
    path = write_jsonl(tmp_path / "ids.jsonl", lines)
    return chain_spec(
        path,
        ("parse", ParseIds()),
        ("pack", pack or ops.Pack(seq_len=16)),
        ("shuffle", ops.Shuffle(buffer=5)),
        lanes=2,
        global_batch_size=4,
        split_bytes=700,
        **kwargs,
    )


def test_recipe_resume_at_every_step_gives_the_uninterrupted_digests(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = assert_equal_output_after_checkpoint(spec, 8, **RECIPE)
    state = ref.final_state
    assert state["kind"] == RECIPE_KIND
    # Buffered sequences are recipes, not tokens; the uninterrupted run matches compact mode.
    buffer = state["lane_states"][0]["stages"]["shuffle"]["values"]["buffer"]
    assert buffer and sorted(buffer[0]) == ["digest", "docs", "head", "lengths"]
    compact = reference_run(spec, 8)
    assert compact.digests == ref.digests


def test_recipe_resume_across_world_sizes(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = reference_run(spec, 9, world_size=2, **RECIPE)
    for s in (0, 3, 5):
        for world in (1, 4):
            got = run_global(spec, 9 - s, state=ref.states[s], world_size=world, **RECIPE)
            assert [zf.batch_digest(b) for b in got] == [d for _, d in ref.digests[s:]], (s, world)


def test_recipe_restores_pieces_inside_long_documents_and_records_with_several_outputs(
    corpus: Corpus, tmp_path: Path
) -> None:
    spec = long_docs_spec(corpus, tmp_path)
    assert_equal_output_after_checkpoint(spec, 10, **RECIPE)


def test_recipe_resume_over_an_epoch_boundary_and_the_end_of_a_finite_input(
    corpus: Corpus, tmp_path: Path
) -> None:
    spec = long_docs_spec(corpus, tmp_path, epochs=2)
    ref = assert_equal_output_after_checkpoint(spec, 14, **RECIPE)
    assert len(ref.digests) == 14


def test_a_recipe_state_resumes_a_compact_loader_and_back(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = reference_run(spec, 6, **RECIPE)
    got = run_global(spec, 2, state=ref.states[4], world_size=2)
    assert [zf.batch_digest(b) for b in got] == [d for _, d in ref.digests[4:]]
    with zf.Loader(spec, state=ref.states[4]) as loader:  # compact mode, from a recipe state
        next(iter(loader))
        assert loader.state_dict()["kind"] == STATE_KIND


def random_docs_spec(tmp_path: Path, *, docs: int, seq_len: int, buffer: int) -> zf.LoaderSpec:
    """Documents of 100-400 random token ids (as incompressible as real text's ids)."""
    rng = np.random.default_rng(11)
    lines = [
        " ".join(map(str, rng.integers(0, 30000, size=int(rng.integers(100, 400))))) for _ in range(docs)
    ]
    path = write_jsonl(tmp_path / f"random{seq_len}.jsonl", lines)
    return chain_spec(
        path,
        ("parse", ParseIds()),
        ("pack", ops.Pack(seq_len=seq_len)),
        ("shuffle", ops.Shuffle(buffer=buffer)),
        lanes=2,
        global_batch_size=4,
        split_bytes=4096,
    )


def saved_size(spec: zf.LoaderSpec, mode: str, path: Path, steps: int) -> int:
    with zf.Loader(spec, state_mode=mode) as loader:
        it = iter(loader)
        for _ in range(steps):
            next(it)
        zf.save_state(loader.state(), path)
    assert zf.load_state(path).to_plain()["kind"] == (RECIPE_KIND if mode == "recipe" else STATE_KIND)
    return path.stat().st_size


def test_recipe_state_grows_with_documents_not_tokens(tmp_path: Path) -> None:
    sizes = {}
    for seq_len in (256, 1024):
        spec = random_docs_spec(tmp_path, docs=300, seq_len=seq_len, buffer=32)
        for mode in ("compact", "recipe"):
            sizes[mode, seq_len] = saved_size(spec, mode, tmp_path / f"{mode}{seq_len}.zfstate", 4)
    # 4x the tokens per sequence: compact grows with them, recipe with the documents (~2.5x).
    assert sizes["compact", 1024] > 3 * sizes["compact", 256], sizes
    assert sizes["recipe", 1024] * 10 < sizes["compact", 1024], sizes
    assert sizes["recipe", 256] * 3 < sizes["compact", 256], sizes


def test_recipe_checkpoint_round_trips_through_the_file_and_incrementally(
    corpus: Corpus, tmp_path: Path
) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = reference_run(spec, 5, **RECIPE)
    first, later = tmp_path / "a.zfstate", tmp_path / "b.zfstate"
    zf.save_state(zf.decode_state(ref.states[3]), first)
    zf.save_state(zf.decode_state(ref.states[4]), later, base=first)
    assert zf.encode_state(zf.load_state(later)) == ref.states[4]
    compact = tmp_path / "c.zfstate"
    zf.save_state(zf.decode_state(reference_run(spec, 4).states[3]), compact)
    with pytest.raises(StateError, match=r"is a compact state and this one is not; an incremental"):
        zf.save_state(zf.decode_state(ref.states[4]), tmp_path / "d.zfstate", base=compact)


def test_merge_refuses_recipe_and_compact_states_together(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    with zf.Loader(spec, rank=0, world_size=2, state_mode="recipe") as a:
        recipe_state = a.state_dict()
    with zf.Loader(spec, rank=1, world_size=2) as b:
        compact_state = b.state_dict()
    with pytest.raises(StateConflictError, match=r"cannot merge a recipe state with a compact one"):
        zf.merge_states([recipe_state, compact_state])


def test_state_mode_is_checked() -> None:
    spec = zf.LoaderSpec(lambda p: p | beam.Create([1]), lanes=1, global_batch_size=1)
    with pytest.raises(SpecError, match=r"^state_mode must be one of compact, recipe, got 'tokens'$"):
        zf.Loader(spec, state_mode="tokens")


def test_pack_without_provenance_is_refused_by_name(corpus: Corpus, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["1 2 3", "4 5"])
    spec = chain_spec(path, ("parse", ParseIds()), ("pack", ops.Pack(seq_len=4, provenance=False)))
    with pytest.raises(
        RecipeRefusedError,
        match=r"^stateful DoFn 'pack': it has provenance=False, .*; use state_mode='compact' \(the default\)$",
    ):
        zf.Loader(spec, state_mode="recipe")


@pytest.mark.parametrize("epochs", [None, 1])
def test_best_fit_waiting_pieces_and_open_bins_are_rebuilt(
    corpus: Corpus, tmp_path: Path, epochs: Any
) -> None:
    pack = ops.Pack(seq_len=16, strategy="best_fit", buffer=3, open_bins=2, labels=True)
    spec = long_docs_spec(corpus, tmp_path, pack, epochs=epochs)
    ref = assert_equal_output_after_checkpoint(spec, 12, **RECIPE)
    carry = ref.final_state["lane_states"][0]["stages"]["pack"]["values"]["carry"]
    assert sorted(carry) == ["bins", "pending"]
    parts = carry["pending"] + carry["bins"]
    assert parts and all(sorted(p) == ["digest", "docs", "head", "lengths"] for p in parts)


class _Keep(beam.DoFn):  # type: ignore[misc]
    def process(self, value: Any) -> Any:
        yield dict(value)


def test_a_stateless_dofn_between_pack_and_shuffle_is_refused_by_name(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["1 2 3", "4 5"])
    spec = chain_spec(
        path,
        ("parse", ParseIds()),
        ("pack", ops.Pack(seq_len=4)),
        ("keep", _Keep()),
        ("shuffle", ops.Shuffle(buffer=2)),
    )
    with pytest.raises(
        RecipeRefusedError,
        match=r"^stateful DoFn 'shuffle' \(Shuffle\) holds elements that a stateless DoFn after 'pack' changed",
    ):
        zf.Loader(spec, state_mode="recipe")


def test_a_stateless_dofn_after_pack_refuses_pending_outputs_at_save_time(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [" ".join(["7"] * 9)] * 4)
    spec = chain_spec(path, ("parse", ParseIds()), ("pack", ops.Pack(seq_len=4)), ("keep", _Keep()))
    with zf.Loader(spec, state_mode="recipe") as loader:
        next(iter(loader))
        with pytest.raises(
            RecipeRefusedError,
            match=r"^lane 0: its pending outputs were changed by a stateless DoFn after 'pack'",
        ):
            loader.state_dict()


class _Count(beam.DoFn):  # type: ignore[misc]
    """A stateful DoFn with no recipe declarations."""

    SEEN = beam.transforms.userstate.ReadModifyWriteStateSpec("seen", beam.coders.PickleCoder())

    def process(self, element: Any, seen: Any = beam.DoFn.StateParam(SEEN)) -> Any:
        seen.write((seen.read() or 0) + 1)
        yield element[1]


def test_an_operator_without_recipe_support_is_refused_by_name(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["1 2 3", "4 5"])
    spec = chain_spec(path, ("parse", ParseIds()), ("count", _Count()))
    with pytest.raises(RecipeRefusedError, match=r"^stateful DoFn 'count' \(_Count\) does not say how"):
        zf.Loader(spec, state_mode="recipe")


class _NoSeek(ops.ReadJsonl):
    rereads_offsets = False


def test_a_source_that_cannot_reread_is_refused_by_name(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["1 2 3", "4 5"])

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "src" >> _NoSeek(path)
        return docs | "parse" >> beam.ParDo(ParseIds()) | "pack" >> beam.ParDo(ops.Pack(seq_len=4))

    spec = zf.LoaderSpec(build, lanes=1, global_batch_size=1)
    with pytest.raises(
        RecipeRefusedError,
        match=r"^source 'src' \(_NoSeek\('src'\)\) cannot re-read a record from its offset",
    ):
        zf.Loader(spec, state_mode="recipe")


def test_changed_data_is_refused_at_restore_never_used(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    texts = [" ".join(str(1 + (i * 7 + j) % 9) for j in range(3 + i % 5)) for i in range(30)]
    write_jsonl(path, texts)
    spec = chain_spec(
        str(path), ("parse", ParseIds()), ("pack", ops.Pack(seq_len=8)), ("shuffle", ops.Shuffle(buffer=4))
    )
    ref = reference_run(spec, 3, **RECIPE)
    # Same sizes (the fingerprint's data part is unchanged), other tokens.
    write_jsonl(path, [t.replace("1", "2") for t in texts])
    with pytest.raises(
        RecipeMismatchError, match=r"does not give the saved value: the data files, the tokenizer"
    ) as refused:
        zf.Loader(spec, state=ref.states[3])
    # The documents are named by file and byte, not only by their ids.
    assert re.search(
        rf"re-reading the documents at {re.escape(str(path))} byte \d+ \(0, \d+, \d+\)", str(refused.value)
    )


def test_rebuild_finds_a_piece_in_the_middle_of_a_document() -> None:
    pack = ops.Pack(seq_len=4)
    doc = np.arange(100, 120, dtype=np.int32)
    sample = pack.recipe_value(doc[8:12], np.array([4], np.int32), np.array([[0, 0, 5]]), "sample")
    saved = recipe.encode(pack, sample, "sample", "test")
    got = recipe.rebuild(pack, saved, "sample", {(0, 0, 5): [doc]}, "test")
    assert all(np.array_equal(got[k], sample[k]) for k in sample)
    with pytest.raises(RecipeMismatchError, match=r"^test: re-reading the documents \(0, 0, 5\)"):
        recipe.rebuild(pack, saved, "sample", {(0, 0, 5): [doc * 2]}, "test")


def test_recipe_encoding_is_deterministic_bytes(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = reference_run(spec, 3, **RECIPE)
    state = to_loader_state(ref.states[3])
    assert state.recipe
    out = io.BytesIO()
    write_state(state, out)
    assert out.getvalue() == ref.states[3]


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_recipe_restore_runs_the_front_on_the_loaders_backend(corpus: Corpus, backend: str) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8, seq_len=16, buffer=6)
    ref = reference_run(spec, 5, **RECIPE)
    got = run_global(spec, 2, state=ref.states[3], world_size=2, backend=backend, workers=2, **RECIPE)
    assert [zf.batch_digest(b) for b in got] == [d for _, d in ref.digests[3:5]]


def test_the_head_hash_of_one_window_is_the_rolling_hash_at_that_start() -> None:
    tokens = np.random.default_rng(3).integers(0, 2**31 - 1, size=300).astype(np.int32)
    for width in (1, 5, recipe.HEAD):
        rolling = recipe._window_hashes(tokens, width)
        assert [recipe.head_hash(tokens[s : s + width]) for s in (0, 7, 300 - width)] == [
            int(rolling[0]),
            int(rolling[7]),
            int(rolling[300 - width]),
        ]


def test_a_state_taken_every_step_is_the_state_taken_once(corpus: Corpus, tmp_path: Path) -> None:
    """The recipe writer remembers recipes between calls: what it reuses must be exact."""
    spec = long_docs_spec(corpus, tmp_path)
    with zf.Loader(spec, state_mode="recipe") as warm, zf.Loader(spec, state_mode="recipe") as cold:
        for _ in zip(range(6), warm, cold, strict=False):  # range first: no 7th batch is taken
            every_step = zf.encode_state(warm.state())
        assert every_step == zf.encode_state(cold.state())
        assert zf.encode_state(warm.state()) == every_step  # all from memory this time


@pytest.mark.parametrize("labels", [False, True])
def test_pack_knows_the_fields_of_its_samples(labels: bool) -> None:
    pack = ops.Pack(seq_len=4, labels=labels)
    assert pack._output_keys() == set(pack.padding_sample())
