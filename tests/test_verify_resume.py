"""Self-verifying resume: a checkpoint records each lane's next window; a restore that makes
another window (a data file edited in place, a tokenizer swapped) is refused by name."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from helpers import Corpus, DocKey, chain_spec, make_corpus, tagged_texts, train_tokenizer, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.cli import main
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import FingerprintMismatchError, ResumeMismatchError, StateConflictError
from zephon_flow.engine.simulate import global_digests
from zephon_flow.engine.verify import MISMATCH, OK, UNVERIFIABLE, verify_state

STEPS, CUT = 7, 3

PIPELINE = """
import apache_beam as beam
import numpy as np
import zephon_flow as zf
from zephon_flow import operators as ops


def build(p):
    web = p | "web" >> ops.ReadJsonl({web!r}, field="text", split_bytes=400)
    code = p | "code" >> ops.ReadParquet({code!r}, column="content")
    docs = (web, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
    toks = docs | "tok" >> beam.ParDo(ops.Tokenize({tok!r}, append_eos=True))
    seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=24))
    return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=6))


spec = zf.LoaderSpec(build, lanes=4, seed=3, global_batch_size=12)
"""


def make_spec(corpus: Corpus) -> zf.LoaderSpec:
    """Two sources, mix, tokenize, pack, shuffle: the README pipeline in small (as PIPELINE)."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=400)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=24))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=6))

    return zf.LoaderSpec(build, lanes=4, seed=3, global_batch_size=12)


@pytest.fixture
def own(tmp_path: Path) -> Corpus:
    """A corpus of this test's own: the tests edit its files."""
    return make_corpus(tmp_path / "corpus")


def state_at(spec: zf.LoaderSpec, step: int, *, world_size: int = 2) -> LoaderState:
    final: list[dict[str, Any]] = []
    assert len(global_digests(spec, steps=step, final_state=final, world_size=world_size)) == step
    return LoaderState.from_plain(final[0])


def checks(state: Any) -> dict[int, str]:
    st = to_loader_state(state)
    return {lane: ls.next_window.digest for lane, ls in st.lane_states.items() if ls.next_window is not None}


def web_record_read_next(corpus: Corpus, state: Any) -> tuple[int, int]:
    """A lane whose next window reads a record of the JSONL file, and that record's offset."""
    for lane, ls in sorted(to_loader_state(state).lane_states.items()):
        assert ls.next_window is not None
        for source, _split, offset in ls.next_window.runs.tolist():
            if source == 0:  # "web", the first source
                return lane, offset
    raise AssertionError("no lane reads the JSONL file in its next window")


def edit_in_place(path: str, offset: int) -> None:
    """Changes one letter of the JSONL line at ``offset``: same name, same size, valid JSON."""
    data = bytearray(Path(path).read_bytes())
    end = data.index(b"\n", offset)
    line = data[offset:end]
    at = offset + line.rindex(b'"') - 1  # the text's last letter
    data[at] = ord("q") if data[at] != ord("q") else ord("z")
    Path(path).write_bytes(bytes(data))


def test_an_unchanged_resume_verifies_under_another_world_size(own: Corpus) -> None:
    spec = make_spec(own)
    reference = global_digests(make_spec(own), steps=STEPS)
    state = state_at(spec, CUT, world_size=2)
    recorded = checks(state)
    assert sorted(recorded) == [0, 1, 2, 3]  # every lane records its next window
    # topology-free: one rank holding every lane records the same checks
    assert checks(state_at(make_spec(own), CUT, world_size=1)) == recorded
    # through the checkpoint bytes, resumed on 3 ranks: verified, the uninterrupted batches
    data = zf.encode_state(state)
    assert checks(zf.decode_state(data)) == recorded
    resumed = global_digests(make_spec(own), steps=STEPS - CUT, state=zf.decode_state(data), world_size=3)
    assert resumed == reference[CUT:]
    assert all(v.verdict == OK for v in verify_state(make_spec(own), data))


def test_a_data_file_edited_in_place_is_refused_naming_lane_step_and_file(own: Corpus) -> None:
    state = state_at(make_spec(own), CUT)
    lane, offset = web_record_read_next(own, state)
    size = Path(own.web_jsonl).stat().st_size
    edit_in_place(own.web_jsonl, offset)
    assert Path(own.web_jsonl).stat().st_size == size
    spec = make_spec(own)
    assert spec.fingerprint == to_loader_state(state).fingerprint  # the fingerprint lets it through
    with pytest.raises(ResumeMismatchError) as caught:
        global_digests(spec, steps=2, state=state, world_size=2)
    message = str(caught.value)
    assert message.startswith(f"lane {lane}, step {CUT}: the first window after the restore is not ")
    assert f"the record at {own.web_jsonl} offset {offset} (source 'web') gives other values" in message
    assert "verify_resume=False" in message
    # knowingly accepted, it runs (on the changed stream)
    assert len(global_digests(make_spec(own), steps=2, state=state, verify_resume=False)) == 2


def test_a_swapped_tokenizer_is_refused_by_the_fingerprint_first(own: Corpus) -> None:
    state = state_at(make_spec(own), CUT)
    train_tokenizer(Path(own.tokenizer_json), vocab_size=280)  # another file, the same path
    with pytest.raises(FingerprintMismatchError, match=r"differ: operator tok$"):
        global_digests(make_spec(own), steps=1, state=state)


def test_a_tokenizer_whose_output_changed_is_refused_by_the_window_check(own: Corpus) -> None:
    """With the fingerprint accepted for the change (``allow_code_change`` does not cover
    operator parameters, so the state's fingerprint is rewritten here, as a library whose output
    changed would leave it), the lane's check still finds the other tokens."""
    state = to_loader_state(state_at(make_spec(own), CUT))
    train_tokenizer(Path(own.tokenizer_json), vocab_size=280)
    spec = make_spec(own)
    forged = dataclasses.replace(state, fingerprint=dict(spec.fingerprint))
    with pytest.raises(ResumeMismatchError, match=r"^lane \d, step 3: .* gives other values"):
        global_digests(spec, steps=1, state=forged)


def test_a_checkpoint_without_checks_still_resumes_and_says_once_it_is_not_verified(
    own: Corpus, caplog: pytest.LogCaptureFixture
) -> None:
    reference = global_digests(make_spec(own), steps=STEPS)
    plain = zf.decode_state(zf.encode_state(state_at(make_spec(own), CUT))).to_plain()
    for ls in plain["lane_states"]:
        del ls["next_window"]  # as written before zephon-flow recorded it
    with caplog.at_level(logging.WARNING, logger="zephon_flow"):
        assert global_digests(make_spec(own), steps=STEPS - CUT, state=plain, world_size=2) == reference[CUT:]
    said = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
    assert said == [
        f"the checkpoint at step {CUT} records no check of the next window of lane(s) [0, 1, 2, 3] "
        f"(written before zephon-flow recorded them, or taken before the lanes made a window): "
        f"their resume is not verified"
    ]
    assert [v.verdict for v in verify_state(make_spec(own), plain)] == [UNVERIFIABLE] * 4


def test_ranks_that_recorded_different_next_windows_are_not_merged(own: Corpus) -> None:
    state = to_loader_state(state_at(make_spec(own), CUT))
    lanes = state.lane_states
    other = dataclasses.replace(lanes[0], next_window=lanes[1].next_window)
    forged = LoaderState(state.step, state.lanes, state.fingerprint, {0: other}, state.mix_history)
    with pytest.raises(
        StateConflictError, match=r"^states disagree about the next window of lane 0 at step 3"
    ):
        zf.merge_states([state.to_plain(), forged.to_plain()])
    # a rank without the check defers to one with it
    bare = LoaderState(
        state.step,
        state.lanes,
        state.fingerprint,
        {0: dataclasses.replace(lanes[0], next_window=None)},
        state.mix_history,
    )
    assert checks(zf.merge_states([bare.to_plain(), state.to_plain()])) == checks(state)


def test_state_before_iterating_carries_the_restored_checks(own: Corpus) -> None:
    state = state_at(make_spec(own), CUT)
    with zf.Loader(make_spec(own), state=state) as loader:
        assert checks(loader.state_dict()) == checks(state)


def test_zephon_verify_exit_codes(own: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(PIPELINE.format(web=own.web_jsonl, code=own.code_parquet, tok=own.tokenizer_json))
    checkpoint = tmp_path / "step-3.zfstate"
    zf.save_state(state_at(make_spec(own), CUT), checkpoint)
    assert main(["verify", str(checkpoint), f"{pipeline}:spec"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^lane (\d): OK at step 3 \(next window [0-9a-f]{32}\)$", out, re.M) == [
        "0",
        "1",
        "2",
        "3",
    ]
    assert out.endswith("4 of 4 lane(s) resume onto the recorded stream\n")
    lane, offset = web_record_read_next(own, zf.load_state(checkpoint))
    edit_in_place(own.web_jsonl, offset)
    assert main(["verify", str(checkpoint), f"{pipeline}:spec", "--lanes", str(lane)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"lane {lane}: MISMATCH: lane {lane}, step 3: the first window after the restore")
    assert f"offset {offset} (source 'web')" in out
    assert out.endswith(f"0 of 1 lane(s) resume onto the recorded stream; not proven: lane(s) [{lane}]\n")
    assert main(["verify", str(checkpoint), "no-colon"]) == 2
    assert main(["verify", str(checkpoint), f"{pipeline}:spec", "--lanes", "x"]) == 2
    verdicts = verify_state(make_spec(own), zf.load_state(checkpoint))
    assert [v.verdict for v in verdicts].count(MISMATCH) >= 1


def test_lane_owners_record_the_loaders_checks_and_verify_their_restore(own: Corpus) -> None:
    from zephon_flow.cluster.owner import LaneOwner, OwnerError, OwnerOptions

    state = state_at(make_spec(own), CUT, world_size=1)

    def owner(lanes: list[int], start: Any, name: str) -> LaneOwner:
        return LaneOwner(
            make_spec(own), lanes, state=start, readers={0: 0}, options=OwnerOptions(), name=name
        )

    owners = [owner([0, 1], None, "owner 0").start(), owner([2, 3], None, "owner 1").start()]
    try:
        for step in range(CUT + 1):
            for o in owners:
                while o.rows(0, step, timeout=30) is None:
                    pass
        snaps = {lane: ls for o in owners for lane, ls in (o.snapshot(CUT) or {}).items()}
    finally:
        for o in owners:
            o.close()
    assert {lane: ls.next_window.digest for lane, ls in snaps.items() if ls.next_window} == checks(state)
    lane, offset = web_record_read_next(own, state)
    edit_in_place(own.web_jsonl, offset)
    restored = owner([lane], to_loader_state(state), "owner 2").start()
    try:
        with pytest.raises(OwnerError) as caught:
            while restored.rows(0, CUT, timeout=30) is None:
                pass
    finally:
        restored.close()
    assert f"ResumeMismatchError: lane {lane}, step {CUT}: the first window after the restore" in str(
        caught.value
    )
    assert f"{own.web_jsonl} offset {offset}" in str(caught.value)


def test_zephon_serve_resume_verifies_and_can_be_told_not_to(own: Corpus, tmp_path: Path) -> None:
    from zephon_flow.service.server import BatchServer

    directory = tmp_path / "ckpt"
    srv = BatchServer(
        make_spec(own), ahead=2, keep=1, checkpoint_dir=str(directory), checkpoint_every=2
    ).start()
    try:
        with zf.Client(f"{srv.host}:{srv.port}", 0, 1) as client:
            for step, _batch in client:
                if step == 6:
                    break
    finally:
        srv.stop(grace=None)
    path = sorted(directory.iterdir(), key=lambda p: int(p.stem.split("-")[1]))[-1]
    saved = zf.load_state(path)
    assert sorted(checks(saved)) == [0, 1, 2, 3]  # the server's checkpoints are verifiable
    lane, offset = web_record_read_next(own, saved)
    edit_in_place(own.web_jsonl, offset)
    srv = BatchServer(make_spec(own), ahead=2, resume=str(path)).start()
    try:
        address = f"{srv.host}:{srv.port}"
        client = zf.Client(address, 0, 1, start_step=saved.step, retries=0)
        with client, pytest.raises(zf.ServiceError) as caught:
            next(iter(client))
    finally:
        srv.stop(grace=None)
    assert f"lane {lane}, step {saved.step}: the first window after the restore" in str(caught.value)
    srv = BatchServer(make_spec(own), ahead=2, resume=str(path), verify_resume=False).start()
    try:
        with zf.Client(f"{srv.host}:{srv.port}", 0, 1, start_step=saved.step) as client:
            assert next(iter(client))[0] == saved.step
    finally:
        srv.stop(grace=None)


def test_the_end_of_a_finite_pass_is_recorded_and_verified(tmp_path: Path) -> None:
    """The last steps' next windows are short or empty (padding): their checks say so, and a
    resume there verifies and ends at the same step."""
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 9, seed=4))

    def spec() -> zf.LoaderSpec:
        return chain_spec(
            path,
            ("key", DocKey()),
            ("shuffle", ops.Shuffle(buffer=3)),
            lanes=2,
            epochs=1,
            global_batch_size=4,
        )

    reference = global_digests(spec(), steps=10)
    assert len(reference) == 3  # 9 documents over 2 lanes of 2: the last step is padded
    for cut in (2, 3):
        state = state_at(spec(), cut, world_size=1)
        found = {lane: ls.next_window for lane, ls in to_loader_state(state).lane_states.items()}
        assert all(c is not None for c in found.values())
        if cut == 3:  # past the end: empty next windows
            assert [c.samples for c in found.values() if c is not None] == [0, 0]
        assert global_digests(spec(), steps=10, state=state, world_size=2) == reference[cut:]
        assert all(v.verdict == OK for v in verify_state(spec(), state))


def test_a_recipe_checkpoint_records_and_verifies_the_same_checks(own: Corpus) -> None:
    compact = state_at(make_spec(own), CUT)
    final: list[dict[str, Any]] = []
    global_digests(make_spec(own), steps=CUT, final_state=final, state_mode="recipe")
    assert final[0]["kind"] == "zephon-flow/loader-state+recipe"
    assert checks(final[0]) == checks(compact)
    # a record read after the checkpoint (so not one the recipe re-reads) edited in place:
    # the recipe restore succeeds, the window check refuses
    lane, offset = web_record_read_next(own, compact)
    edit_in_place(own.web_jsonl, offset)
    with pytest.raises(ResumeMismatchError, match=rf"^lane {lane}, step {CUT}: "):
        global_digests(make_spec(own), steps=1, state=final[0])


def test_what_a_difference_names() -> None:
    """The words for each kind of difference, on checks made by hand."""
    from zephon_flow.core.checkpoint.window_check import GROUPS, WindowCheck, difference

    def name(doc: tuple[int, int, int]) -> str:
        return f"record {doc}"

    tokens = [np.arange(5, dtype=np.int32)]
    fed = [((0, 0, 10), tokens), ((0, 0, 20), tokens)]
    samples = [{"input_ids": np.arange(4, dtype=np.int32)}]
    base = WindowCheck.of(samples, fed)
    assert difference(base, WindowCheck.of(samples, fed), fed, name) is None
    moved = [((0, 0, 10), tokens), ((0, 1, 0), tokens)]
    assert difference(base, WindowCheck.of(samples, moved), moved, name) == (
        "the lane now reads record (0, 1, 0) where the checkpoint recorded record (0, 0, 20): "
        "records were added, removed or moved in the data before it (or a file was replaced)"
    )
    other = [((0, 0, 10), tokens), ((0, 0, 20), [np.arange(6, dtype=np.int32)])]
    differs = difference(base, WindowCheck.of(samples, other), other, name)
    assert differs is not None
    assert differs.startswith("record (0, 0, 20) gives other values than when the checkpoint was saved")
    more = [*fed, ((0, 0, 30), tokens)]
    assert "read 3 record(s) to make the window where the checkpoint recorded 2" in str(
        difference(base, WindowCheck.of(samples, more), more, name)
    )
    changed = [{"input_ids": np.arange(1, 5, dtype=np.int32)}]
    assert "the records the lane read are the same, but the window's 1 sample(s) differ" in str(
        difference(base, WindowCheck.of(changed, fed), fed, name)
    )
    # many records: runs of them, the changed one named with its run
    many = [((0, 0, i), tokens) for i in range(3 * GROUPS)]
    edited = [*many[:7], ((0, 0, 7), [np.arange(6, dtype=np.int32)]), *many[8:]]
    found = difference(WindowCheck.of(samples, many), WindowCheck.of(samples, edited), edited, name)
    assert str(found).startswith("one of the records from record (0, 0, 6) to record (0, 0, 8) (3 records)")
    # a check survives its plain form
    assert WindowCheck.from_plain(base.to_plain(), "test") == base


def test_a_change_accepted_with_allow_mix_change_is_not_refused(own: Corpus) -> None:
    state = state_at(make_spec(own), CUT)
    text = PIPELINE.format(web=own.web_jsonl, code=own.code_parquet, tok=own.tokenizer_json)
    namespace: dict[str, Any] = {}
    exec(text.replace("weights=[0.6, 0.4]", "weights=[0.2, 0.8]"), namespace)
    assert len(global_digests(namespace["spec"], steps=2, state=state, allow_mix_change=True)) == 2
