"""The on-disk cache of tiktoken verdicts: a tokenizer file is mapped and checked once per machine.

Deciding whether a ``tokenizer.json`` runs on tiktoken with HF's ids (``bpe_engines.plan_tiktoken``
and the verification sample) takes about a quarter of a second for GPT-2's vocabulary, paid by
every ``Tokenize`` built in a new process, so by every start of a trainer. The verdict is a pure
function of the file's bytes, the versions of ``tokenizers`` and ``tiktoken``, and the code that
decides it, so it is kept on disk under that key (``$ZEPHON_CACHE_DIR``, the seek indexes'
folder, default ``~/.cache/zephon-flow/index``), as ``verdict-<key>.json``.

Nothing is trusted blindly: a cached plan is still built and checked against the cached digest
of HF's ids for the verification sample in every process (as a plan made in the same process
is), and an entry that cannot be read, parsed or checked is ignored and decided afresh.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from importlib import metadata
from typing import Any

from zephon_flow.operators import _file_cache, bpe_engines, bpe_regex, bpe_sample
from zephon_flow.operators.bpe_engines import NormalForm, TiktokenPlan

#: Bumped when what a verdict means changes in a way the code digest would not show.
VERDICT_FORMAT = 1
_NORMAL_FORMS: dict[str, NormalForm] = {"NFC": "NFC", "NFD": "NFD", "NFKC": "NFKC", "NFKD": "NFKD"}
_code_digest: str | None = None


def _code() -> str:
    """A digest of the modules whose code decides a verdict: editing them invalidates the cache."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256()
        for module in (bpe_engines, bpe_regex, bpe_sample):
            try:
                with open(module.__file__ or "", "rb") as f:
                    h.update(f.read())
            except OSError:  # no source to read (a zipped or compiled install): the version
                h.update(f"{module.__name__} {_version('zephon-flow')}".encode())
        _code_digest = h.hexdigest()
    return _code_digest


def key(sha256: str) -> str:
    """The cache key of a tokenizer file's verdict on this machine's libraries and code."""
    parts = [str(VERDICT_FORMAT), sha256, _version("tokenizers"), _version("tiktoken"), _code()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:40]


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def name_of(sha256: str) -> str:
    """The entry's file name in the cache folder."""
    return f"verdict-{key(sha256)}.json"


def load(sha256: str) -> tuple[TiktokenPlan | None, str | None, bool, str] | None:
    """``(plan, reason, disagreed, digest)`` cached for the file, or None (absent or unreadable)."""
    entry = _file_cache.load_json(name_of(sha256))
    if entry is None:
        return None
    try:
        return _parse(entry)
    except (ValueError, KeyError, TypeError):
        return None


def store(sha256: str, plan: TiktokenPlan | None, reason: str | None, disagreed: bool, digest: str) -> None:
    """Writes the verdict (all or nothing); a cache that cannot be written only costs a new check."""
    entry = {
        "plan": None if plan is None else asdict(plan),
        "reason": reason,
        "disagreed": disagreed,
        "digest": digest,
    }
    _file_cache.store_json(name_of(sha256), entry)


def _parse(entry: Any) -> tuple[TiktokenPlan | None, str | None, bool, str]:
    """The entry's fields, checked for type; raises ``ValueError`` on anything else."""
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    reason, disagreed, digest = entry["reason"], entry["disagreed"], entry["digest"]
    if not (reason is None or isinstance(reason, str)) or not isinstance(disagreed, bool):
        raise ValueError("bad reason or disagreed")
    if not isinstance(digest, str):
        raise ValueError("bad digest")
    raw = entry["plan"]
    if raw is None:
        if reason is None:
            raise ValueError("neither a plan nor a reason")
        return None, reason, disagreed, digest
    if reason is not None or len(digest) != 64:
        raise ValueError("a plan needs a digest and no reason")
    plan = TiktokenPlan(
        pat_str=_str(raw["pat_str"]),
        raw_added=_pairs(raw["raw_added"]),
        normalized_added=_pairs(raw["normalized_added"]),
        excluded=tuple(_int(i) for i in raw["excluded"]),
        normal_forms=tuple(_NORMAL_FORMS[_str(f)] for f in raw["normal_forms"]),
        prefix_space=_bool(raw["prefix_space"]),
        segmented=_bool(raw["segmented"]),
    )
    return plan, None, disagreed, digest


def _pairs(value: Any) -> tuple[tuple[str, int], ...]:
    return tuple((_str(text), _int(i)) for text, i in value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError("not an integer")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("not a boolean")
    return value
