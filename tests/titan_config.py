"""Test-only torchtitan config registry (``--module titan_config --config zephon_tiny``).

A llama3 of one tiny layer with SDPA attention (FlexAttention has no CPU backward), a tokenizer
that reads no files (the pipeline tokenizes), and zephon-flow's dataloader over a JSONL file of
``ZEPHON_TITAN_DATA`` (bytes as token ids). ``TitanDigestLoader`` records each batch's rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import apache_beam as beam
import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    model_registry,
)
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.integrations.torchtitan import ZephonTitanDataLoader

VOCAB = 256
SEQ_LEN = 16
GLOBAL_BATCH = 4
LANES = 4


def byte_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def write_data(folder: str, documents: int = 400) -> str:
    path = os.path.join(folder, "docs.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(documents):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (i % 13)}) + "\n")
    return path


def spec() -> zf.LoaderSpec:
    """The test pipeline: bytes of each document, packed to SEQ_LEN + 1, shuffled."""
    path = os.path.join(os.environ["ZEPHON_TITAN_DATA"], "docs.jsonl")

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(path, split_bytes=2000)
        ids = docs | "bytes" >> beam.ParDo(ops.Map(byte_ids))
        seqs = ids | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN + 1))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=LANES, seed=11, global_batch_size=GLOBAL_BATCH)


class TitanNullTokenizer(BaseTokenizer):  # type: ignore[misc]
    """torchtitan builds a tokenizer from files; the pipeline tokenizes, so this one is empty."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):  # type: ignore[misc]
        pass

    def __init__(self, config: Config, tokenizer_path: str = "") -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return VOCAB


class TitanDigestLoader(ZephonTitanDataLoader):
    """Appends ``{"step", "dp_rank", "rows": [sha256 of each row's input and labels]}`` per batch
    to ``$ZEPHON_TITAN_DIGESTS/rank<global rank>.jsonl``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ZephonTitanDataLoader.Config):
        pass

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = os.path.join(os.environ["ZEPHON_TITAN_DIGESTS"], f"rank{rank}.jsonl")
        for inputs, labels in super().__iter__():
            step = self.dataset.next_step - 1
            rows = [
                hashlib.sha256(i.numpy().tobytes() + b"|" + t.numpy().tobytes()).hexdigest()
                for i, t in zip(inputs["input"], labels, strict=True)
            ]
            with open(out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "dp_rank": self.dp_rank, "rows": rows}) + "\n")
            yield inputs, labels


def tiny_model() -> Llama3Model.Config:
    dim, heads = 32, 2
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            n_layers=1,
            dim=dim,
            n_heads=heads,
            hidden_dim=64,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=10000.0),
            attn_backend="flex",
        ),
    )
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model


def zephon_tiny() -> Trainer.Config:
    model_spec = replace(model_registry("debugmodel"), model=tiny_model(), flavor="zephon_tiny")
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path="",
        tokenizer=TitanNullTokenizer.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=GLOBAL_BATCH,
            seq_len=SEQ_LEN,
            steps=20,
            mixed_precision_param="float32",
            disable_cuda_graphs=True,
        ),
        dataloader=TitanDigestLoader.Config(spec="titan_config:spec"),
        metrics=MetricsProcessor.Config(log_freq=5),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=True, interval=10, last_save_model_only=False),
        activation_checkpoint=None,
    )
