"""PyTorch Lightning: ZephonDataModule resumes exactly (same and other worker count, DDP at another
world size); a ZephonDataset given to Lightning another way is refused on resume by ZephonGuard."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Corpus
from lightning_script import EVERY, GLOBAL_BATCH, fit, make_spec
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from _zephon_flow_lightning import LazyZephonGuard
from zephon_flow.core.errors import CorruptStateError, StateError
from zephon_flow.engine.simulate import global_batches
from zephon_flow.integrations.lightning import FORMAT, ZephonDataModule
from zephon_flow.torch import StepMismatchWarning, ZephonDataset

SCRIPT = Path(__file__).resolve().parent / "lightning_script.py"

pytestmark = [
    # Lightning 2.6.6's own pytree code on torch 2.13; not about our code.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # A resumed fit checkpoints into its own folder; Lightning notes that its ModelCheckpoint's
    # bookkeeping of best models is not carried over.
    pytest.mark.filterwarnings("ignore:The dirpath has changed from:UserWarning"),
]


def digest(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()


def seen(model: Any) -> list[tuple[int, str]]:
    return [(step, digest(ids)) for step, ids in zip(model.steps, model.seen, strict=True)]


@pytest.fixture(scope="module")
def reference(corpus: Corpus) -> list[tuple[int, str]]:
    """The global batches' input_ids digests, steps 0..19, as the pipeline defines them."""
    return [(step, digest(batch["input_ids"])) for step, batch in global_batches(make_spec(corpus), steps=20)]


@pytest.fixture(scope="module")
def uninterrupted(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """20 steps in one fit, checkpointing at steps 10 and 20: the model, and the checkpoint folder."""
    out = tmp_path_factory.mktemp("uninterrupted")
    model = fit(out, steps=20, datamodule=ZephonDataModule(make_spec(corpus)))
    return model, out / "ckpt"


def test_the_fit_trains_on_the_pipelines_batches_and_saves_the_trained_step(
    uninterrupted: tuple[Any, Path], reference: list[tuple[int, str]]
) -> None:
    model, ckpt = uninterrupted
    assert seen(model) == reference
    saved = torch.load(ckpt / "step=10.ckpt", weights_only=False)
    state = saved["ZephonDataModule"]
    assert state["format"] == FORMAT and state["trained_batches"] == 10
    # The step after the last one trained, not after the batch Lightning read ahead.
    assert state["data"]["step"] == 10 and isinstance(state["data"]["loader_state"], bytes)
    assert "combined_loader" not in saved["loops"]["fit_loop"]["state_dict"]  # Lightning keeps no second copy


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_continues_exactly_at_the_same_and_another_worker_count(
    corpus: Corpus, uninterrupted: tuple[Any, Path], tmp_path: Path, workers: int
) -> None:
    model, ckpt = uninterrupted
    backend = "threads" if workers > 1 else "inline"
    data = ZephonDataModule(make_spec(corpus), backend=backend, workers=workers)
    resumed = fit(tmp_path, steps=20, datamodule=data, resume=ckpt / "step=10.ckpt")
    assert seen(resumed) == seen(model)[10:]


def run_script(corpus: Corpus, out: Path, *, devices: int, resume: Path | None = None) -> None:
    cmd = [sys.executable, str(SCRIPT), "--corpus", str(corpus.root), "--out", str(out)]
    cmd += ["--devices", str(devices), "--steps", "20"]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]


def global_digests(out: Path, ranks: int) -> list[tuple[int, str]]:
    parts = [np.load(out / f"seen.rank{r}.npz") for r in range(ranks)]
    steps = [p["steps"].tolist() for p in parts]
    assert all(s == steps[0] for s in steps), steps
    glued = np.concatenate([p["input_ids"] for p in parts], axis=1)  # rank slices, in rank order
    assert glued.shape[1] == GLOBAL_BATCH
    return [(step, digest(ids)) for step, ids in zip(steps[0], glued, strict=True)]


def test_ddp_on_two_ranks_resumes_on_one(
    corpus: Corpus, reference: list[tuple[int, str]], tmp_path: Path
) -> None:
    run_script(corpus, tmp_path, devices=2)  # Lightning's launcher starts rank 1
    assert global_digests(tmp_path, 2) == reference
    resumed = fit(
        tmp_path / "one",
        steps=20,
        datamodule=ZephonDataModule(make_spec(corpus)),
        resume=tmp_path / "ckpt" / f"step={EVERY}.ckpt",
    )
    assert seen(resumed) == reference[EVERY:]


# -- what ZephonGuard does with a ZephonDataset given to Lightning without the data module ---------
def plain_loader(corpus: Corpus) -> DataLoader[Any]:
    return DataLoader(ZephonDataset.from_loader(make_spec(corpus)), batch_size=None)


def dataset_itself(corpus: Corpus) -> ZephonDataset:
    return ZephonDataset.from_loader(make_spec(corpus))


def stateful_loader(corpus: Corpus) -> StatefulDataLoader:
    return StatefulDataLoader(ZephonDataset.from_loader(make_spec(corpus)), batch_size=None)


@pytest.mark.parametrize("make", [dataset_itself, stateful_loader])
def test_the_dataset_itself_or_in_a_stateful_dataloader_resumes_exactly(
    corpus: Corpus, reference: list[tuple[int, str]], tmp_path: Path, make: Any
) -> None:
    first = fit(tmp_path, steps=EVERY, loader=make(corpus))
    assert seen(first) == reference[:EVERY]
    resumed = fit(
        tmp_path / "again", steps=20, loader=make(corpus), resume=tmp_path / "ckpt" / "step=10.ckpt"
    )
    assert seen(resumed) == reference[EVERY:]


def test_a_plain_dataloader_is_warned_and_its_resume_refused(corpus: Corpus, tmp_path: Path) -> None:
    with pytest.warns(
        UserWarning, match="ZephonGuard: a ZephonDataset reached Lightning through a DataLoader"
    ):
        first = fit(tmp_path, steps=EVERY, loader=plain_loader(corpus))
    assert first.steps == list(range(EVERY))
    with pytest.raises(StateError) as refused:
        fit(
            tmp_path / "again",
            steps=20,
            loader=plain_loader(corpus),
            resume=tmp_path / "ckpt" / "step=10.ckpt",
        )
    assert str(refused.value) == (
        "ZephonGuard: Lightning resumes after 10 trained batches, but the ZephonDataset starts at "
        "step 0 (Lightning saved no state for it): steps 10.. would train on other batches. Train "
        "and resume with trainer.fit(model, "
        "datamodule=zephon_flow.integrations.lightning.ZephonDataModule(spec, ...))"
    )


def test_a_read_ahead_state_saved_without_the_guard_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    fit(tmp_path, steps=EVERY, loader=dataset_itself(corpus), guard=False)
    with pytest.raises(
        StateError, match="resumes after 10 trained batches, but the ZephonDataset starts at step 11:"
    ):
        fit(
            tmp_path / "again",
            steps=20,
            loader=dataset_itself(corpus),
            resume=tmp_path / "ckpt" / "step=10.ckpt",
        )


def test_every_trainer_gets_the_guard_from_the_entry_point(tmp_path: Path) -> None:
    from lightning_script import trainer

    assert sum(isinstance(cb, LazyZephonGuard) for cb in trainer(tmp_path, steps=1).callbacks) == 1


def test_the_entry_point_loads_nothing_of_zephon_flow_for_a_trainer_that_is_not_ours() -> None:
    # Every Lightning Trainer in an environment with zephon-flow calls the entry point.
    code = (
        "import sys, lightning.pytorch as pl\n"
        "pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('zephon_flow'))\n"
        "assert loaded == [], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_a_checkpoint_without_the_data_modules_state_is_refused(corpus: Corpus, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="ZephonGuard"):
        fit(tmp_path, steps=EVERY, loader=plain_loader(corpus))
    with pytest.raises(
        StateError, match="holds no ZephonDataModule state, so the data would start again at step 0"
    ):
        fit(
            tmp_path / "again",
            steps=20,
            datamodule=ZephonDataModule(make_spec(corpus)),
            resume=tmp_path / "ckpt" / f"step={EVERY}.ckpt",
        )


def test_a_data_state_from_another_save_is_loaded_with_a_warning_naming_both_steps(
    corpus: Corpus, uninterrupted: tuple[Any, Path], tmp_path: Path
) -> None:
    _, ckpt = uninterrupted
    saved = torch.load(ckpt / "step=10.ckpt", weights_only=False)
    later = torch.load(ckpt / "step=20.ckpt", weights_only=False)
    saved["ZephonDataModule"] = later["ZephonDataModule"]  # the data state of step 20 with the loops of 10
    torch.save(saved, tmp_path / "mixed.ckpt")
    with pytest.warns(
        StepMismatchWarning, match="loader state is at step 20 but the trainer resumes at step 10"
    ):
        resumed = fit(
            tmp_path, steps=12, datamodule=ZephonDataModule(make_spec(corpus)), resume=tmp_path / "mixed.ckpt"
        )
    assert resumed.steps == [20, 21]


def test_a_damaged_state_is_refused_by_name(corpus: Corpus) -> None:
    data = ZephonDataModule(make_spec(corpus))
    with pytest.raises(
        CorruptStateError, match="ZephonDataModule state is missing 'format', 'data', 'trained_batches'"
    ):
        data.load_state_dict({})
    with pytest.raises(CorruptStateError, match="has format 'other/1'; this zephon-flow reads"):
        data.load_state_dict({"format": "other/1", "data": {"step": 1}, "trained_batches": 1})
