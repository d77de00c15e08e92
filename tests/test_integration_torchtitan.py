"""zephon-flow as torchtitan's dataloader: batches, refusals, and resumes at another DP degree.

The end-to-end test runs torchtitan 0.3.0's own ``Trainer`` (``torchtitan.train.main``) on CPU
through ``tests/titan_launch.py`` (the shim torchtitan needs there), in 1 or 2 gloo processes
started here, with ``tests/titan_config.py``: a one-layer llama3 with SDPA attention, 20 steps,
checkpoints by torchtitan's DCP checkpointer. The loader records a digest of every row it hands
the trainer; each run's rows must equal the rows of a plain ``zf.Loader`` of the pipeline,
step by step, including after a resume (1 -> 2 data-parallel ranks, then 2 -> 1).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from titan_pipeline import GLOBAL_BATCH, LANES, SEQ_LEN, expected_rows, finite_spec, row_digest, write_data

from zephon_flow.core.errors import SpecError
from zephon_flow.integrations.torchtitan import ZephonTitanDataLoader

TESTS = Path(__file__).resolve().parent
LAUNCH = TESTS / "titan_launch.py"
RUN_TIMEOUT = 240  # seconds for one trainer run (about 20-50 s on 2 busy cores)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("titan-data")
    write_data(str(folder))
    old = os.environ.get("ZEPHON_TITAN_DATA")
    os.environ["ZEPHON_TITAN_DATA"] = str(folder)
    yield str(folder)
    if old is None:
        os.environ.pop("ZEPHON_TITAN_DATA", None)
    else:
        os.environ["ZEPHON_TITAN_DATA"] = old


def build(*, dp_world_size: int, dp_rank: int, local_batch_size: int, seq_len: int = SEQ_LEN) -> Any:
    """The dataloader as torchtitan's trainer builds it."""
    config = ZephonTitanDataLoader.Config(spec="titan_pipeline:spec")
    return config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=None,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        snapshot_every_n_steps=None,
    )


def digests(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> list[str]:
    inputs, labels = batch
    return [row_digest(i.numpy(), t.numpy()) for i, t in zip(inputs["input"], labels, strict=True)]


# -- in process -------------------------------------------------------------------------------
def test_batches_are_the_rank_rows_in_the_shape_torchtitan_trains_on(data: str) -> None:
    expected = expected_rows(3)
    loader = build(dp_world_size=2, dp_rank=1, local_batch_size=2)
    try:
        batches = [b for _, b in zip(range(3), loader, strict=False)]
    finally:
        loader.close()
    for step, (inputs, labels) in enumerate(batches):
        assert sorted(inputs) == ["input", "positions"]
        assert inputs["input"].shape == labels.shape == inputs["positions"].shape == (2, SEQ_LEN)
        assert inputs["input"].dtype == labels.dtype == torch.int64
        assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])  # labels: the input shifted by one
        assert digests((inputs, labels)) == expected[step][2:4]  # rank 1 of 2: rows 2 and 3


def test_state_has_one_key_per_lane_and_resumes_at_another_dp_degree(data: str) -> None:
    """What DCP keeps (one copy per key) from two ranks resumes one rank at the same rows."""
    expected = expected_rows(7)
    states = []
    for rank in range(2):
        loader = build(dp_world_size=2, dp_rank=rank, local_batch_size=2)
        try:
            for _, _ in zip(range(5), loader, strict=False):
                pass
            states.append(loader.state_dict())
            assert sorted(states[-1]["lane_states"]) == [str(lane) for lane in loader.lane_ids]
        finally:
            loader.close()
    assert [s["step"] for s in states] == [5, 5]
    lanes = {**states[0]["lane_states"], **states[1]["lane_states"]}
    assert sorted(lanes, key=int) == [str(lane) for lane in range(LANES)]
    union = {"step": 5, "lane_states": lanes}

    resumed = build(dp_world_size=1, dp_rank=0, local_batch_size=GLOBAL_BATCH)
    template = resumed.state_dict()  # what DCP loads into: every lane's key
    assert sorted(template["lane_states"], key=int) == [str(lane) for lane in range(LANES)]
    resumed.load_state_dict(union)
    try:
        again = [digests(b) for _, b in zip(range(2), resumed, strict=False)]
    finally:
        resumed.close()
    assert again == expected[5:7]


def test_a_batch_size_that_is_not_the_pipeline_global_batch_is_refused(data: str) -> None:
    with pytest.raises(SpecError) as info:
        build(dp_world_size=2, dp_rank=0, local_batch_size=4)
    assert str(info.value) == (
        "ZephonTitanDataLoader: torchtitan asks for 4 rows per batch (training.local_batch_size, or "
        "parallelism.pipeline_parallel_microbatch_size under pipeline parallelism) on 2 "
        "data-parallel rank(s), 8 rows in all, but the pipeline's global_batch_size is 4: make them "
        "equal (zf.LoaderSpec(global_batch_size=8), or --training.local_batch_size 2)"
    )


def test_sequences_of_another_length_than_seq_len_plus_one_are_refused(data: str) -> None:
    loader = build(dp_world_size=1, dp_rank=0, local_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN + 1)
    try:
        with pytest.raises(SpecError) as info:
            next(iter(loader))
    finally:
        loader.close()
    assert str(info.value) == (
        "ZephonTitanDataLoader: step 0's 'input_ids' is (4, 17), torchtitan needs (4, 18) (local "
        "batch size x training.seq_len + 1: the input and its labels shifted by one); pack the "
        "pipeline to Pack(seq_len=18), or set --training.seq_len 16"
    )


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("titan_pipeline", "give the pipeline as 'package.module:name'"),
        ("titan_pipeline:nothing", "module 'titan_pipeline' has no 'nothing'"),
        ("titan_pipeline:SEQ_LEN", "'SEQ_LEN' gave a int, not a zf.LoaderSpec"),
        ("no_such_module_here:spec", "cannot import 'no_such_module_here'"),
    ],
)
def test_a_spec_that_is_not_a_loader_spec_is_refused_by_name(data: str, where: str, message: str) -> None:
    with pytest.raises(SpecError, match=r"ZephonTitanDataLoader\.Config") as info:
        ZephonTitanDataLoader.Config(spec=where).build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH
        )
    assert message in str(info.value)


# -- torchtitan's trainer ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(run: Path, nproc: int, command: list[str]) -> None:
    """Runs ``python *command`` as ranks 0..nproc-1 of a gloo world on 127.0.0.1, in ``run``;
    each rank's output goes to ``run/rank<r>.log``. Ranks are ended by their PIDs on a timeout."""
    (run / "digests").mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            ZEPHON_TITAN_DIGESTS=str(run / "digests"),
        )
        log = open(run / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [sys.executable, *command], cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        procs.append((proc, log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=RUN_TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (run / f"rank{rank}.log").read_text()[-4000:]


def train(run: Path, nproc: int, *flags: str, resume_from: Path | None = None) -> dict[int, list[str]]:
    """Runs torchtitan's trainer in ``nproc`` gloo processes; the rows it trained on, by step."""
    if resume_from is not None:  # torchtitan resumes from the latest step-N of its folder
        shutil.copytree(resume_from, run / "out" / "checkpoint" / resume_from.name)
    run.mkdir(parents=True, exist_ok=True)
    args = ["--module", "titan_config", "--config", "zephon_tiny", "--dump_folder", str(run / "out")]
    launch(run, nproc, [str(LAUNCH), *args, *flags])
    return recorded(run / "digests")


def recorded(folder: Path) -> dict[int, list[str]]:
    """The global batch of each step, rows in data-parallel rank order; ranks that share a
    data-parallel rank (tensor parallel peers) must have been given the same rows."""
    slices: dict[tuple[int, int], list[str]] = {}
    for path in sorted(glob.glob(str(folder / "rank*.jsonl"))):
        for line in Path(path).read_text().splitlines():
            entry = json.loads(line)
            key = (entry["step"], entry["dp_rank"])
            assert slices.setdefault(key, entry["rows"]) == entry["rows"], key
    steps: dict[int, list[str]] = {}
    for (step, _), rows in sorted(slices.items()):
        steps.setdefault(step, []).extend(rows)
    return steps


def dataloader_keys(checkpoint: Path) -> list[str]:
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    return sorted(k for k in metadata.state_dict_metadata if k.startswith("dataloader."))


@pytest.mark.slow
def test_torchtitan_trains_on_the_same_rows_after_resuming_at_another_dp_degree(
    data: str, tmp_path: Path
) -> None:
    """About 60-140 s on 2 cores: three trainer runs of 20 steps (2, 2 and 1 processes)."""
    expected = dict(enumerate(expected_rows(20)))
    dp2 = ("--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2")

    # 1 data-parallel rank, 2 tensor-parallel ranks (the world is larger than the DP degree).
    first = train(tmp_path / "tp2", 2, "--parallelism.tensor_parallel_degree", "2")
    assert first == expected
    saved = tmp_path / "tp2" / "out" / "checkpoint" / "step-10"
    lanes = [f"dataloader.lane_states.{lane}" for lane in range(LANES)]
    assert dataloader_keys(saved) == sorted(["dataloader.step", *lanes])  # no rank in any key

    # 1 -> 2 data-parallel ranks at step 10: the next 10 steps, none replayed.
    second = train(tmp_path / "dp2", 2, *dp2, "--checkpoint.interval", "5", resume_from=saved)
    assert sorted(second) == list(range(10, 20))
    assert second == {s: expected[s] for s in range(10, 20)}

    # 2 -> 1 data-parallel rank at step 15.
    third = train(tmp_path / "dp1", 1, resume_from=tmp_path / "dp2" / "out" / "checkpoint" / "step-15")
    assert third == {s: expected[s] for s in range(15, 20)}


@pytest.mark.slow
def test_a_finite_pass_ends_at_one_step_on_every_rank_of_a_dp_by_tp_world(data: str, tmp_path: Path) -> None:
    """About 15-40 s: 4 gloo processes, 2 data-parallel x 2 tensor-parallel ranks (no trainer).
    The world (4) is larger than the data-parallel degree (2); the ranks agree on the end of
    the pass over their data-parallel group, and every rank yields as many batches as a plain
    loader (before, the loader refused a world of 4 for 2 ranks)."""
    expected = expected_rows(None, finite_spec())
    run = tmp_path / "finite"
    launch(run, 4, [str(TESTS / "titan_finite.py")])
    got = [json.loads((run / "digests" / f"finite{rank}.json").read_text()) for rank in range(4)]
    assert [g["dp_rank"] for g in got] == [0, 0, 1, 1]
    assert [g["dp_group"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # torchtitan's batch mesh
    assert got[0]["rows"] == got[1]["rows"] and got[2]["rows"] == got[3]["rows"]  # TP peers
    assert len(got[0]["rows"]) == len(got[2]["rows"]) == len(expected)
    assert [a + b for a, b in zip(got[0]["rows"], got[2]["rows"], strict=True)] == expected
