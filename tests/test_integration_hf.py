"""ZephonTrainer: a tiny GPT-2 trained by the Hugging Face Trainer sees zephon-flow's global
batches, and a resume from a checkpoint sees the batches of the uninterrupted run: same worker
count or another, another gradient accumulation count, another world size (under torchrun).

Every run records the ``input_ids`` of each micro-step it trains (``hf_trainer_script.py``);
the tests compare their sha256 per step.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Corpus
from hf_trainer_script import GLOBAL_BATCH, RecordingTrainer, make_spec, run, tiny_gpt2, training_args

import zephon_flow as zf
from zephon_flow.integrations.hf import DATA_STATE_NAME
from zephon_flow.torch import StepMismatchWarning, ZephonDataset

SCRIPT = Path(__file__).resolve().parent / "hf_trainer_script.py"
STEPS = 20


def digests(batches: list[np.ndarray]) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for b in batches]


@pytest.fixture(scope="module")
def reference(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """The uninterrupted run (20 steps, a checkpoint at 10): its digests and its folder."""
    out = tmp_path_factory.mktemp("reference")
    return digests(run(corpus, str(out), steps=STEPS)), out


@pytest.fixture(scope="module")
def first_half(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """10 steps on threads, one worker, stopped after the checkpoint at step 10."""
    out = tmp_path_factory.mktemp("first-half")
    return digests(run(corpus, str(out), steps=10, backend="threads", workers=1)), out / "checkpoint-10"


def test_the_trainer_sees_the_loaders_global_batches_as_int64(
    corpus: Corpus, reference: tuple[list[str], Path]
) -> None:
    expected = []
    with zf.Loader(make_spec(corpus)) as loader:
        for step, batch in loader:
            expected.append(batch["input_ids"].astype(np.int64))
            if step == STEPS - 1:
                break
    assert reference[0] == digests(expected)


@pytest.mark.parametrize(("backend", "workers"), [("threads", 1), ("processes", 2)])
def test_a_resume_loads_the_trained_step_and_trains_the_same_batches(
    corpus: Corpus,
    reference: tuple[list[str], Path],
    first_half: tuple[list[str], Path],
    tmp_path: Path,
    backend: str,
    workers: int,
) -> None:
    seen, checkpoint = first_half
    assert zf.load_state(checkpoint / DATA_STATE_NAME).step == 10  # the next step to train
    resumed = run(corpus, str(tmp_path), resume=str(checkpoint), backend=backend, workers=workers)
    # 10 batches yielded in all by the resumed dataset: none replayed before step 10
    assert len(resumed) == 10
    assert seen + digests(resumed) == reference[0]
    assert zf.load_state(tmp_path / "checkpoint-20" / DATA_STATE_NAME).step == 20


def test_with_gradient_accumulation_each_micro_step_is_one_step(
    corpus: Corpus, reference: tuple[list[str], Path], tmp_path: Path
) -> None:
    seen = run(corpus, str(tmp_path / "a"), steps=5, save_steps=5, ga=2)
    checkpoint = tmp_path / "a" / "checkpoint-5"
    assert zf.load_state(checkpoint / DATA_STATE_NAME).step == 10
    # resume_from_checkpoint=True: the last checkpoint of the output folder
    resumed = run(corpus, str(tmp_path / "a"), steps=10, save_steps=5, ga=2, resume=True)
    assert digests(seen + resumed) == reference[0]
    assert zf.load_state(tmp_path / "a" / "checkpoint-10" / DATA_STATE_NAME).step == 20


def test_a_state_at_another_step_than_the_trainers_count_is_loaded_with_a_warning(
    corpus: Corpus, reference: tuple[list[str], Path], tmp_path: Path
) -> None:
    # checkpoint-10 of a run without accumulation, resumed with 2 micro-steps per step
    with pytest.warns(
        StepMismatchWarning, match="the loader state is at step 10 but the trainer resumes at step 20"
    ):
        resumed = run(corpus, str(tmp_path), steps=11, ga=2, resume=str(reference[1] / "checkpoint-10"))
    assert digests(resumed) == reference[0][10:12]


def test_a_checkpoint_without_the_loader_state_is_refused(
    corpus: Corpus, reference: tuple[list[str], Path], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoint-10"
    shutil.copytree(reference[1] / "checkpoint-10", checkpoint)
    (checkpoint / DATA_STATE_NAME).unlink()
    with pytest.raises(
        zf.StateError, match=f"{checkpoint} has no zephon_state.zfstate: it was not written by"
    ):
        run(corpus, str(tmp_path / "out"), resume=str(checkpoint))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"per_device_train_batch_size": 4},
            "per_device_train_batch_size=4 but each of the 1 rank(s) gets 8 rows of the spec's "
            "global_batch_size 8: set TrainingArguments(per_device_train_batch_size=8)",
        ),
        ({"max_steps": -1}, "set TrainingArguments(max_steps=N): the stream has no length"),
        ({"dataloader_num_workers": 2}, "dataloader_num_workers=2: each DataLoader worker would run"),
        (
            {"accelerator_config": {"split_batches": True}},
            "accelerator_config split_batches=True does not apply",
        ),
        ({"auto_find_batch_size": True}, "auto_find_batch_size=True would change the batch size"),
    ],
)
def test_wrong_arguments_are_refused_by_name(
    corpus: Corpus, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    options: dict[str, Any] = {"steps": 2, "save_steps": 2, "rows": GLOBAL_BATCH}
    options.update(change)
    if "per_device_train_batch_size" in change:
        options["rows"] = options.pop("per_device_train_batch_size")
    if "max_steps" in change:
        options["steps"] = options.pop("max_steps")
    args = training_args(str(tmp_path), **options)
    dataset = ZephonDataset.from_loader(make_spec(corpus))
    with pytest.raises(zf.SpecError, match=_literal(message)):
        RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=dataset)


def test_the_inputs_are_int64_without_provenance_unless_asked(corpus: Corpus, tmp_path: Path) -> None:
    def first_inputs(**options: Any) -> dict[str, Any]:
        remove = options.pop("remove_unused_columns", True)
        args = training_args(
            str(tmp_path), steps=2, save_steps=2, rows=GLOBAL_BATCH, remove_unused_columns=remove
        )
        dataset = ZephonDataset.from_loader(make_spec(corpus))
        trainer = RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=dataset, **options)
        inputs: dict[str, Any] = next(iter(trainer.get_train_dataloader()))
        dataset.close()
        return inputs

    plain = first_inputs()
    assert sorted(plain) == ["input_ids", "labels", "position_ids"]
    assert all(v.dtype == torch.int64 for v in plain.values())
    starts = plain["position_ids"] == 0
    assert (plain["labels"][starts] == -100).all()
    assert (plain["labels"][~starts] == plain["input_ids"][~starts]).all()
    kept = first_inputs(provenance=True, remove_unused_columns=False)
    assert sorted(kept) == [
        "documents",
        "documents_count",
        "input_ids",
        "labels",
        "position_ids",
        "segment_ids",
    ]


def test_ignore_data_skip_is_turned_off(corpus: Corpus, tmp_path: Path) -> None:
    args = training_args(str(tmp_path), steps=2, save_steps=2, rows=GLOBAL_BATCH, ignore_data_skip=True)
    dataset = ZephonDataset.from_loader(make_spec(corpus))
    RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=dataset)
    assert args.ignore_data_skip is False  # the resume loads the state: nothing to skip, RNG restored


def test_a_train_dataset_that_is_not_a_zephon_dataset_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    args = training_args(str(tmp_path), steps=2, save_steps=2, rows=GLOBAL_BATCH)
    with pytest.raises(
        zf.SpecError, match=r"train_dataset must be a zephon_flow\.torch\.ZephonDataset .*got list"
    ):
        RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=[{"input_ids": [1, 2]}])


def test_a_dataset_for_another_rank_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    args = training_args(str(tmp_path), steps=2, save_steps=2, rows=GLOBAL_BATCH)
    dataset = ZephonDataset.from_loader(make_spec(corpus), rank=1, world_size=2)
    with pytest.raises(
        zf.SpecError, match="the train_dataset is rank 1 of 2 but this Trainer process is rank 0 of 1"
    ):
        RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=dataset)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


# -- torchrun ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(corpus: Corpus, *runs: tuple[Path, Path, str]) -> list[list[str]]:
    """Two ranks on gloo, running ``runs`` (out, record, resume) in turn; per run, the global
    batches' digests (rank 0's rows, then rank 1's)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(SCRIPT),
        "--corpus",
        str(corpus.root),
    ]
    for out, record, resume in runs:
        cmd += ["--job", str(out), str(record), resume]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=runs[0][0].parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = []
    for _, record, _ in runs:
        ranks = [np.load(f"{record}.rank{r}.npy") for r in range(2)]
        found.append(digests(list(np.concatenate(ranks, axis=1))))
    return found


def test_two_ranks_under_torchrun_resume_on_one_and_one_on_two(
    corpus: Corpus, reference: tuple[list[str], Path], tmp_path: Path
) -> None:
    # 2 ranks from the start (each builds its dataset before TrainingArguments starts
    # torch.distributed), then the uninterrupted 1-rank run's checkpoint-10 resumed on 2 ranks
    two, again = torchrun(
        corpus,
        (tmp_path / "two", tmp_path / "two-record", "-"),
        (tmp_path / "again", tmp_path / "again-record", str(reference[1] / "checkpoint-10")),
    )
    assert two == reference[0]
    assert again == reference[0][10:]
    # and the 2-rank run's checkpoint-10 resumed on 1
    one = run(corpus, str(tmp_path / "one"), resume=str(tmp_path / "two" / "checkpoint-10"))
    assert digests(one) == reference[0][10:]
