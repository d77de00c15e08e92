"""Where Hugging Face users keep tokenizers, and what HF's ``add_special_tokens=True`` adds.

``resolve_tokenizer_path`` accepts a ``tokenizer.json`` file, a folder holding one (what
``save_pretrained`` writes), a snapshot folder of the local hub cache
(``models--org--name/snapshots/<revision>/``, whose files are links into ``blobs/``) or the
cached repository folder itself (``models--org--name``: the revision ``refs/main`` names).
Nothing is downloaded.

``special_affixes`` finds the ids the tokenizer's post-processor puts around a text (Llama's
BOS, BERT's ``[CLS]``/``[SEP]``) by encoding probe texts with and without them, and checks
that they are the same for every probe, so that any engine's ids plus the affixes equal HF's
``encode(text)`` (``add_special_tokens=True``, HF's default).
"""

from __future__ import annotations

import os
import re
from typing import Any

from zephon_flow.core.errors import SpecError

TOKENIZER_FILE = "tokenizer.json"
#: What a Hugging Face hub id looks like (``gpt2``, ``meta-llama/Llama-3.1-8B``).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_PROBES = ("a", "Hello, world!", "  two  spaces\nand a line", "0123 ünïcödé ✓", "x" * 40)


def _hub_snapshot(folder: str) -> str | None:
    """The snapshot folder ``refs/main`` names in a hub cache repository folder, else None."""
    snapshots = os.path.join(folder, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    ref = os.path.join(folder, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            revision = f.read().strip()
        candidate = os.path.join(snapshots, revision)
        if os.path.isdir(candidate):
            return candidate
    revisions = sorted(os.listdir(snapshots))
    if len(revisions) == 1:
        return os.path.join(snapshots, revisions[0])
    raise SpecError(
        f"Tokenize: {folder} is a hub cache folder with {len(revisions)} snapshots "
        f"({', '.join(revisions) or 'none'}) and no refs/main naming one; pass the snapshot folder "
        f"(snapshots/<revision>)"
    )


def resolve_tokenizer_path(path: str) -> str:
    """The ``tokenizer.json`` that ``path`` (a file, a ``save_pretrained`` folder or a hub
    cache folder) stands for; SpecError naming the folder and what it holds otherwise."""
    if not os.path.exists(path) and _HUB_ID.fullmatch(path) and not path.endswith(".json"):
        cache = "models--" + path.replace("/", "--")
        raise SpecError(
            f"Tokenize: {path!r} is not a file or folder here, and Tokenize does not download hub "
            f"ids. Fetch the tokenizer once, e.g. AutoTokenizer.from_pretrained({path!r})"
            f".save_pretrained(DIR), and pass DIR (or its tokenizer.json), or pass the local hub "
            f"cache folder ~/.cache/huggingface/hub/{cache}"
        )
    if not os.path.isdir(path):
        return path
    folder = _hub_snapshot(path) or path
    candidate = os.path.join(folder, TOKENIZER_FILE)
    if os.path.isfile(candidate):
        return candidate
    held = sorted(os.listdir(folder))
    hint = ""
    if "tokenizer.model" in held or {"vocab.json", "merges.txt"} <= set(held):
        hint = (
            "; it holds a slow tokenizer's files: write a tokenizer.json with transformers, "
            "AutoTokenizer.from_pretrained(folder).save_pretrained(folder) (a fast tokenizer)"
        )
    raise SpecError(
        f"Tokenize: no {TOKENIZER_FILE} in the folder {folder} (it holds "
        f"{', '.join(held[:8]) or 'nothing'}{', ...' if len(held) > 8 else ''}){hint}"
    )


def special_affixes(tok: Any, path: str) -> tuple[list[int], list[int]]:
    """The ids HF's post-processor puts before and after every text, checked on probe texts."""
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for text in _PROBES:
        plain = tok.encode(text, add_special_tokens=False).ids
        full = tok.encode(text, add_special_tokens=True).ids
        start = next(
            (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None
        )
        if not plain or start is None:
            raise SpecError(
                f"Tokenize: the post-processor of {path} changes the text's own ids (not only "
                f"adds tokens around them); add_special_tokens=True is not supported for it"
            )
        found.add((tuple(full[:start]), tuple(full[start + len(plain) :])))
    if len(found) != 1:
        raise SpecError(
            f"Tokenize: the post-processor of {path} adds different tokens to different texts; "
            f"add_special_tokens=True is not supported for it"
        )
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)
