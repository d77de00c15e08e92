"""The two tokenizer engines of ``Tokenize``, and the proof that a tiktoken one says what HF says.

HF ``tokenizers`` is the reference: it runs any ``tokenizer.json``. tiktoken runs byte-level BPE
several times faster, but only when the file's vocabulary can be written as tiktoken's
*mergeable ranks* (byte string -> rank, merged lowest rank first). ``plan_tiktoken`` reads the
file and either returns a ``TiktokenPlan`` or raises ``NotExpressible`` saying why. It checks:

- the model is a byte-level BPE without dropout, prefixes or suffixes; every vocabulary entry
  decodes through the GPT-2 byte alphabet, and all 256 bytes are tokens;
- the pre-tokenizer is ByteLevel (the GPT-2 pattern) or one ``Split`` pattern then ByteLevel,
  translated from Oniguruma to fancy-regex by ``bpe_regex``; the normalizer, if any, is a
  Unicode normal form; added tokens match exactly (no ``lstrip``/``rstrip``/``single_word``);
- the merges are *rank-consistent* with rank = id. HF merges the adjacent pair listed first,
  tiktoken the pair whose concatenation has the lowest rank, both leftmost among equals. Let
  *reachable* be the tokens HF's own BPE (without ``ignore_merges``) turns their bytes into:
  this is run for every token. Then (1) any two adjacent pieces of a state both engines reach
  whose concatenation t is reachable form a listed merge, because HF's run on t's bytes alone
  passes through those two pieces (merges inside a span never depend on what lies around it),
  and ends at t; (2) that run has one two-piece state, so every merge that can fire for t uses
  the same pair; (3) so if the ids of the tokens made by merges that can fire never decrease
  down the merge list, both engines pick the same pair at every step. Unreachable tokens are
  left out of the ranks, so that tiktoken cannot make them either. With ``ignore_merges`` (which
  tiktoken always does: a piece that is a token is that token) they must stay: one that HF's
  run leaves in three or more pieces is safe (no state ever holds two pieces that join into
  it); one left in exactly two pieces is not, and the file is refused.

Post-processors and decoders never run: ids are encoded with ``add_special_tokens=False``.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import tiktoken
from tokenizers import Tokenizer

from zephon_flow.core.errors import DataError
from zephon_flow.operators.bpe_regex import (
    PatternNotExpressible,
    literal_pattern,
    split_pattern,
    translate,
)

#: HF's ByteLevel(use_regex=True) pattern, which is GPT-2's.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
NormalForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
_NORMAL_FORMS: dict[str, NormalForm] = {"NFC": "NFC", "NFD": "NFD", "NFKC": "NFKC", "NFKD": "NFKD"}


class NotExpressible(ValueError):
    """The tokenizer cannot be run by tiktoken with the same ids; the message says why."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map, in which byte-level BPE vocabularies spell their tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


_ALPHABET = frozenset(byte_alphabet().values())
_TO_LATIN1 = str.maketrans({c: chr(b) for b, c in byte_alphabet().items()})


#: The last vocabulary translated and its result: the plan, the verification sample and the
#: ranks each need it, for the same (never modified) vocabulary of a tokenizer being checked.
_LAST: list[tuple[dict[str, int], dict[int, bytes]]] = []


def vocabulary_bytes(vocab: dict[str, int]) -> dict[int, bytes]:
    """id -> the bytes each token of a byte-level vocabulary stands for (do not modify it)."""
    last = _LAST[:1]
    if last and last[0][0] is vocab:
        return last[0][1]
    out = _translate(vocab)
    _LAST[:] = [(vocab, out)]
    return out


def _translate(vocab: dict[str, int]) -> dict[int, bytes]:
    if not _ALPHABET.issuperset("".join(vocab)):
        token = next(t for t in vocab if not _ALPHABET.issuperset(t))
        raise NotExpressible(
            f"its token {token!r} is not spelled in the byte-level alphabet (not a byte-level BPE)"
        )
    out = {tid: tok.translate(_TO_LATIN1).encode("latin-1") for tok, tid in vocab.items()}
    if len(out) != len(vocab):
        raise NotExpressible("two tokens of its vocabulary have the same id")
    return out


@dataclass(frozen=True, kw_only=True)
class TiktokenPlan:
    """How to run one ``tokenizer.json`` on tiktoken (small: it travels to worker processes)."""

    pat_str: str
    #: (text, id) of added tokens matched in the raw text, then of those matched after the
    #: normal form (HF's ``normalized`` added tokens, their text normalized).
    raw_added: tuple[tuple[str, int], ...]
    normalized_added: tuple[tuple[str, int], ...]
    #: vocabulary ids left out of the mergeable ranks (tokens HF's merges never produce).
    excluded: tuple[int, ...]
    normal_forms: tuple[NormalForm, ...]
    prefix_space: bool
    #: True when added tokens, normal forms or the prefix space are applied in Python first.
    segmented: bool


def _model(doc: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]], bool]:
    model = doc.get("model")
    if not isinstance(model, dict):
        raise NotExpressible("it has no model")
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise NotExpressible(f"its model is {kind or 'of unknown type'}, not a byte-level BPE")
    if model.get("dropout"):
        raise NotExpressible("its BPE has dropout, which makes ids random")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotExpressible(f"its BPE has a {key} ({model[key]!r}); byte-level BPE has none")
    if model.get("byte_fallback"):
        raise NotExpressible("its BPE uses byte_fallback (a SentencePiece-style, not byte-level BPE)")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise NotExpressible("its BPE has no vocabulary")
    merges: list[tuple[str, str]] = []
    for m in model.get("merges") or []:
        parts = m.split(" ") if isinstance(m, str) else m
        if len(parts) != 2:
            raise NotExpressible(f"its merge {m!r} is not a pair")
        merges.append((parts[0], parts[1]))
    return vocab, merges, bool(model.get("ignore_merges", False))


def _byte_level(pre: Any, *, alone: bool) -> tuple[str, bool]:
    """The fancy-regex pattern of a ByteLevel pre-tokenizer, and its prefix-space flag."""
    use_regex = pre.get("use_regex", True)
    prefix = bool(pre.get("add_prefix_space", False))
    if not alone and (use_regex or prefix):
        raise NotExpressible("its ByteLevel after a Split also splits or adds a prefix space to every piece")
    # GPT-2's pattern covers every character, so it needs no alternative for the gaps.
    return (translate(GPT2_PATTERN) if use_regex else "(?s:.)+"), prefix


def _split(pre: Any) -> str:
    if pre.get("invert") or str(pre.get("behavior", "")).lower() != "isolated":
        raise NotExpressible(
            f"its Split has behavior={pre.get('behavior')!r}, invert={pre.get('invert')!r}; "
            f"only an isolated, non-inverted split is mapped"
        )
    pattern = pre.get("pattern") or {}
    if "Regex" in pattern:
        return str(pattern["Regex"])
    if "String" in pattern:
        return literal_pattern(str(pattern["String"]))
    raise NotExpressible(f"its Split pattern {pattern!r} is neither a Regex nor a String")


def _pre_tokenizer(doc: dict[str, Any]) -> tuple[str, bool]:
    """The tiktoken pattern and whether a space is put before each piece of text."""
    pre = doc.get("pre_tokenizer")
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    try:
        if kinds == ["ByteLevel"]:
            return _byte_level(steps[0], alone=True)
        if kinds == ["Split", "ByteLevel"]:
            _byte_level(steps[1], alone=False)
            return split_pattern(_split(steps[0])), False
    except PatternNotExpressible as exc:
        raise NotExpressible(str(exc)) from exc
    raise NotExpressible(
        f"its pre-tokenizer is {' + '.join(map(str, kinds))}; tiktoken runs ByteLevel, or one "
        f"Split followed by ByteLevel(use_regex=false)"
    )


def _normal_forms(doc: dict[str, Any]) -> tuple[NormalForm, ...]:
    norm = doc.get("normalizer")
    if norm is None:
        return ()
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    kinds = [str(s.get("type")) for s in steps]
    others = [k for k in kinds if k not in _NORMAL_FORMS]
    if others:
        raise NotExpressible(f"its normalizer {', '.join(others)} is not a Unicode normal form")
    return tuple(_NORMAL_FORMS[k] for k in kinds)


def _added(
    doc: dict[str, Any], forms: tuple[NormalForm, ...], reference: Any
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
    raw: list[tuple[str, int]] = []
    normalized: list[tuple[str, int]] = []
    for tok in doc.get("added_tokens") or []:
        content = tok["content"]
        tid = reference.token_to_id(content)  # HF renumbers ids the file leaves gaps between
        if tid is None:
            raise NotExpressible(f"HF does not give its added token {content!r} an id")
        flags = [k for k in ("lstrip", "rstrip", "single_word") if tok.get(k)]
        if flags:
            raise NotExpressible(f"its added token {content!r} has {', '.join(flags)} set")
        if not content:
            continue
        if tok.get("normalized", not tok.get("special", False)):
            normalized.append((_normalize(content, forms), tid))
        else:
            raw.append((content, tid))
    for group in (raw, normalized):
        texts = [t for t, _ in group]
        if len(set(texts)) != len(texts):
            raise NotExpressible("two of its added tokens have the same text")
    return tuple(raw), tuple(normalized)


def _prefix_free(texts: Sequence[str]) -> bool:
    ordered = sorted(texts)
    return not any(b.startswith(a) for a, b in itertools.pairwise(ordered))


def _normalize(text: str, forms: Sequence[NormalForm]) -> str:
    for form in forms:
        if not unicodedata.is_normalized(form, text):
            text = unicodedata.normalize(form, text)
    return text


def plan_tiktoken(doc: Any, raw: bytes, reference: Any) -> TiktokenPlan:
    """The tiktoken plan for a ``tokenizer.json`` (``raw``, parsed as ``doc``), or
    ``NotExpressible``. ``reference`` is HF's tokenizer of the file; its BPE is run on every
    token (on a fresh copy when ``ignore_merges`` must be turned off for that)."""
    if not isinstance(doc, dict):
        raise NotExpressible("it is not a tokenizer.json object")
    vocab, merges, ignore_merges = _model(doc)
    for key in ("truncation", "padding"):
        if doc.get(key):
            raise NotExpressible(f"it sets {key}, which tiktoken does not apply")
    pat_str, prefix_space = _pre_tokenizer(doc)
    forms = _normal_forms(doc)
    raw_added, normalized_added = _added(doc, forms, reference)
    added_ids = {tid for _, tid in (*raw_added, *normalized_added)}
    if ignore_merges:
        model = Tokenizer.from_buffer(raw).model
        model.ignore_merges = False  # HF's plain BPE, to see which tokens its merges reach
    else:
        model = reference.model
    excluded = _check_ranks(vocab, merges, ignore_merges=ignore_merges, added_ids=added_ids, model=model)
    everything = [t for t, _ in (*raw_added, *normalized_added)]
    segmented = bool(forms or prefix_space or (raw_added and normalized_added))
    return TiktokenPlan(
        pat_str=pat_str,
        raw_added=raw_added,
        normalized_added=normalized_added,
        excluded=excluded,
        normal_forms=forms,
        prefix_space=prefix_space,
        segmented=segmented or not _prefix_free(everything),
    )


def _check_ranks(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    *,
    ignore_merges: bool,
    added_ids: set[int],
    model: Any,
) -> tuple[int, ...]:
    """Checks that rank = id makes tiktoken merge as HF does; returns the ids to leave out."""
    singles = sum(len(data) == 1 for data in vocabulary_bytes(vocab).values())
    if singles != 256:
        raise NotExpressible(f"only {singles} of the 256 bytes are tokens of its vocabulary")
    reached: set[int] = set()
    stuck_at_two: list[str] = []
    excluded: list[int] = []
    for token, tid in vocab.items():
        if len(token) == 1:
            reached.add(tid)
            continue
        parts = model.tokenize(token)
        if len(parts) == 1 and parts[0].id == tid:
            reached.add(tid)
        elif tid in added_ids or not ignore_merges:
            excluded.append(tid)  # never made by HF's merges: tiktoken must not make it either
        elif len(parts) == 2:
            stuck_at_two.append(token)  # HF stops at two pieces tiktoken would join
    if stuck_at_two:
        raise NotExpressible(
            f"its merges cannot reach {len(stuck_at_two)} token(s) (e.g. {stuck_at_two[0]!r}) "
            f"that tiktoken would form from two pieces, and ignore_merges needs them whole"
        )
    _check_merge_order(vocab, merges, reached)
    return tuple(sorted(excluded))


def _check_merge_order(vocab: dict[str, int], merges: list[tuple[str, str]], reached: set[int]) -> None:
    last = -1
    for priority, (a, b) in enumerate(merges):
        ia, ib, it = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or it is None:
            raise NotExpressible(f"its merge {a!r} {b!r} names a token that is not in its vocabulary")
        if not {ia, ib, it} <= reached:
            continue  # a merge that never fires
        if it < last:
            raise NotExpressible(
                f"its merges are not rank-consistent: merge #{priority} ({a!r} {b!r}) makes id "
                f"{it} after an earlier merge made id {last}"
            )
        last = it


def mergeable_ranks(doc: dict[str, Any], plan: TiktokenPlan) -> dict[bytes, int]:
    """tiktoken's ranks for the file: each vocabulary token's bytes -> its id."""
    excluded = set(plan.excluded)
    by_id = vocabulary_bytes(doc["model"]["vocab"])
    return {data: tid for tid, data in by_id.items() if tid not in excluded}


def _surrogate_error(text: str) -> DataError:
    where = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) < 0xE000), -1)
    return DataError(
        f"Tokenize: the document holds a lone surrogate (U+{ord(text[where]):04X} at character "
        f"{where}), which is not valid Unicode"
    )


class HfEngine:
    """HF ``tokenizers``: the reference engine."""

    name = "hf"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        try:
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:
            if any(0xD800 <= ord(c) < 0xE000 for c in text):
                raise _surrogate_error(text) from None
            raise
        return ids


class TiktokenEngine:
    """tiktoken with a ``TiktokenPlan``: added tokens, normal forms and prefix spaces are
    applied as HF applies them, the BPE itself runs in tiktoken's Rust core."""

    name = "tiktoken"

    def __init__(self, name: str, plan: TiktokenPlan, ranks: dict[bytes, int]) -> None:
        specials = dict((*plan.raw_added, *plan.normalized_added))
        self.plan = plan
        self.encoding = tiktoken.Encoding(
            name, pat_str=plan.pat_str, mergeable_ranks=ranks, special_tokens=specials
        )
        # The core directly: tiktoken's wrapper would silently replace lone surrogates.
        self._core = self.encoding._core_bpe
        self._allowed = set(specials)
        self._raw = _splitter(plan.raw_added)
        self._normalized = _splitter(plan.normalized_added)
        # Ranks past int32 (no real vocabulary has them) keep the list path and its overflow error.
        self._int32 = max((*ranks.values(), *specials.values()), default=0) < 2**31

    def encode(self, text: str) -> list[int]:
        try:
            if not self.plan.segmented:
                ids: list[int] = self._core.encode(text, self._allowed)
                return ids
            return self._encode_segments(text)
        except UnicodeEncodeError:
            raise _surrogate_error(text) from None

    def encode_array(self, text: str) -> np.ndarray:
        """``encode``'s ids as an int32 array (a fresh, writable copy).

        Without segments, straight from tiktoken's buffer of u32 ranks: no Python int per
        token, about a fifth less time per document than the list and its conversion."""
        if self.plan.segmented or not self._int32:
            return np.asarray(self.encode(text), dtype=np.int32)
        try:
            ranks = np.frombuffer(self._core.encode_to_tiktoken_buffer(text, self._allowed), dtype=np.uint32)
        except UnicodeEncodeError:
            raise _surrogate_error(text) from None
        return ranks.astype(np.int32)

    def _encode_segments(self, text: str) -> list[int]:
        # HF: split on raw added tokens; normalize the rest; split on normalized added tokens;
        # then each remaining piece is pre-tokenized (with its own prefix space) and encoded.
        plan, out = self.plan, []
        for segment, sid in self._raw(text):
            if sid is not None:
                out.append(sid)
                continue
            for piece, pid in self._normalized(_normalize(segment, plan.normal_forms)):
                if pid is not None:
                    out.append(pid)
                    continue
                if plan.prefix_space and not piece.startswith(" "):
                    piece = " " + piece
                out.extend(self._core.encode_ordinary(piece))
        return out


def _splitter(added: tuple[tuple[str, int], ...]) -> Any:
    """A function splitting text into (piece, None) and (added token text, its id), leftmost
    match first and the longest one there, as HF's added-token matcher does."""
    ids = dict(added)
    if not ids:
        return lambda text: [(text, None)] if text else []
    pattern = re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True)))

    def split(text: str) -> list[tuple[str, int | None]]:
        out: list[tuple[str, int | None]] = []
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                out.append((text[pos : m.start()], None))
            out.append((m.group(), ids[m.group()]))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    return split


__all__ = [
    "GPT2_PATTERN",
    "HfEngine",
    "NotExpressible",
    "TiktokenEngine",
    "TiktokenPlan",
    "byte_alphabet",
    "mergeable_ranks",
    "plan_tiktoken",
    "vocabulary_bytes",
]
