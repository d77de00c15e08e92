"""Test-only torchtitan config registry (``--module titan_config --config zephon_tiny``).

A llama3 of one tiny layer with SDPA attention (FlexAttention has no CPU backward), a tokenizer
that reads no files (the pipeline tokenizes), and zephon-flow's dataloader over
``titan_pipeline:spec``. ``TitanDigestLoader`` records each batch's rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from titan_pipeline import GLOBAL_BATCH, SEQ_LEN, row_digest
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

from zephon_flow.integrations.torchtitan import ZephonTitanDataLoader

VOCAB = 256


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
            rows = [row_digest(i.numpy(), t.numpy()) for i, t in zip(inputs["input"], labels, strict=True)]
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
        dataloader=TitanDigestLoader.Config(spec="titan_pipeline:spec"),
        metrics=MetricsProcessor.Config(log_freq=5),
        # Data parallel by replication: FSDP scales gradients with PREMUL_SUM, which gloo lacks.
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=1),
        checkpoint=CheckpointManager.Config(enable=True, interval=10, last_save_model_only=False),
        activation_checkpoint=None,
    )
