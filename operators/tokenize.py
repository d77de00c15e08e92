"""``Tokenize``: text to token ids with a local HF ``tokenizer.json`` (stateless, runs in parallel)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import apache_beam as beam
import numpy as np

from zephon_flow.errors import DataError, SpecError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


def _load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:
        raise SpecError(
            f"Tokenize: {path} is not a tokenizer file that HF tokenizers can load: {exc}"
        ) from exc


class Tokenize(beam.DoFn):  # type: ignore[misc]
    """Encodes each text into an ``int32`` array of ids, with the EOS id appended if asked.

    The tokenizer file's sha256 is part of the pipeline's fingerprint, so a checkpoint never
    resumes under another vocabulary.
    """

    def __init__(
        self,
        tokenizer_json_path: str | os.PathLike[str],
        *,
        append_eos: bool = True,
        eos_token: str | None = None,
    ) -> None:
        super().__init__()
        path = os.fspath(tokenizer_json_path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise SpecError(f"Tokenize: cannot read tokenizer file {path}: {exc.strerror}") from exc
        try:
            json.loads(raw)
        except ValueError as exc:
            raise SpecError(f"Tokenize: tokenizer file {path} is not valid JSON ({exc})") from exc
        tok = _load_tokenizer(path)
        self.path = path
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.append_eos = bool(append_eos)
        self.eos_id: int | None = None
        if append_eos:
            names = (eos_token,) if eos_token else EOS_CANDIDATES
            ids = [tok.token_to_id(n) for n in names]
            found = [i for i in ids if i is not None]
            if not found:
                raise SpecError(
                    f"Tokenize: no EOS token {' or '.join(map(repr, names))} in {path}; pass "
                    f"eos_token=... naming the tokenizer's end-of-text token, or append_eos=False"
                )
            self.eos_id = int(found[0])
        self._tokenizer: Any = None

    def params(self) -> dict[str, Any]:
        return {
            "tokenizer_sha256": self.sha256,
            "append_eos": self.append_eos,
            "eos_id": self.eos_id,
        }

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None  # each process loads its own
        return state

    def setup(self) -> None:
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.path)

    def process(self, text: Any) -> Any:
        if not isinstance(text, str):
            raise DataError(f"Tokenize: expected a str document, got {type(text).__name__}")
        if self._tokenizer is None:
            self.setup()
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.eos_id is not None:
            ids.append(self.eos_id)
        yield np.asarray(ids, dtype=np.int32)
