"""``Tokenize``: text to token ids with a local HF tokenizer (stateless, runs in parallel).

The tokenizer is a ``tokenizer.json`` file, a folder holding one (``save_pretrained``), or a
local hub cache folder (``models--org--name`` or its ``snapshots/<revision>/``); see
``_tokenizer_files``. ``add_special_tokens=True`` gives HF's ``encode(text)`` ids (with what
the post-processor adds, e.g. a BOS); the default, False, gives ``encode(text,
add_special_tokens=False)``: the text's own tokens, then the EOS if ``append_eos``.

Two engines give the same ids: HF ``tokenizers`` (the reference; any tokenizer.json) and
tiktoken (byte-level BPE only, several times faster). With ``engine="auto"`` tiktoken is used
when ``bpe_engines.plan_tiktoken`` maps the file onto it *and* both engines give the same ids
on the fixed verification sample (``bpe_sample``); otherwise HF, and the reason is logged once.
``engine="tiktoken"`` raises ``SpecError`` instead of falling back; ``engine="hf"`` never tries.
The verdict is kept on disk (``_verdict_cache``), so a file is mapped and compared once per
machine and library versions, not at every start.

Each process then re-checks its own tiktoken against the digest of HF's ids for the sample, and
encodes the first ``STREAM_CHECK_DOCS`` documents it sees with both engines, emitting HF's ids;
a disagreement there switches that process to HF (``"auto"``) or raises (``"tiktoken"``). The
engine is not part of the fingerprint: the ids are the same, so a checkpoint taken with one
engine resumes with the other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
from tokenizers import Tokenizer

from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators import _verdict_cache
from zephon_flow.operators._tokenizer_files import resolve_tokenizer_path, special_affixes
from zephon_flow.operators.bpe_engines import (
    HfEngine,
    NotExpressible,
    TiktokenEngine,
    TiktokenPlan,
    mergeable_ranks,
    plan_tiktoken,
    vocabulary_bytes,
)
from zephon_flow.operators.bpe_sample import verification_sample

logger = logging.getLogger(__name__)

ENGINES = ("auto", "hf", "tiktoken")
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
#: Documents each process encodes with both engines before it trusts tiktoken alone.
STREAM_CHECK_DOCS = 16


@dataclass(frozen=True, kw_only=True)
class _Verdict:
    """Whether a file runs on tiktoken, and the digest of HF's ids for its verification sample."""

    plan: TiktokenPlan | None
    reason: str | None
    disagreed: bool
    digest: str


# Per process, keyed by the file's sha256: HF tokenizers, verdicts (made once, where the
# pipeline is defined) and tiktoken engines checked in this process (a str: why not).
_HF: dict[str, Any] = {}
_VERDICTS: dict[str, _Verdict] = {}
_TIKTOKEN: dict[str, TiktokenEngine | str] = {}
_SAID: set[tuple[str, str]] = set()
_CACHE = threading.RLock()


def _not_a_path(tokenizer: object) -> str:
    """The refusal of a tokenizer object: what to save it with, then pass the path of."""
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
    if hasattr(tokenizer, "save_pretrained"):
        how = "tokenizer.save_pretrained(folder), then pass the folder"
    elif hasattr(tokenizer, "save") and hasattr(tokenizer, "to_str"):
        how = "tokenizer.save(path), then pass the path"
    else:
        how = "save it as a tokenizer.json and pass its path"
    return (
        f"Tokenize: pass the path of a tokenizer.json (or of a folder holding one), not a {kind} "
        f"object: {how} (the file's sha256 is part of the pipeline's fingerprint)"
    )


def _read(path: str, sha256: str | None = None) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SpecError(f"Tokenize: cannot read tokenizer file {path}: {exc.strerror}") from exc
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise SpecError(
            f"Tokenize: tokenizer file {path} changed since the pipeline was defined (its sha256 "
            f"is part of the fingerprint); define the pipeline again"
        )
    return raw


def _parse(path: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise SpecError(f"Tokenize: tokenizer file {path} is not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or "model" not in doc:
        raise SpecError(
            f"Tokenize: {path} is not a tokenizer file that HF tokenizers can load: it is JSON "
            f'without a "model" (save one with tokenizers.Tokenizer.save)'
        )
    return doc


def _check_settings(path: str, tok: Any) -> None:
    """Whatever the engine, a packing pipeline needs every token of every document, always the
    same ones: truncation, padding and BPE dropout are refused (read from HF's loaded object,
    which saves parsing the JSON a second time)."""
    for key, value, why in (
        ("truncation", tok.truncation, "would cut documents"),
        ("padding", tok.padding, "would add pad tokens"),
    ):
        if value is not None:
            raise SpecError(
                f'Tokenize: {path} sets "{key}", which {why}; save the tokenizer with '
                f"tokenizer.no_{key}() (Pack cuts documents into sequences itself)"
            )
    dropout = getattr(tok.model, "dropout", None)
    if dropout not in (None, 0, 0.0):
        raise SpecError(
            f'Tokenize: {path} sets BPE "dropout" ({dropout:g}), which makes token ids '
            f"random; save the tokenizer without dropout"
        )


def _hf_tokenizer(path: str, raw: bytes, sha256: str) -> Any:
    """HF's tokenizer for the file, loaded once per process; a file it cannot load is refused
    with the JSON's own fault when it has one (not JSON, no "model")."""
    with _CACHE:
        if sha256 not in _HF:
            try:
                tok = Tokenizer.from_buffer(raw)
            except Exception as exc:
                _parse(path, raw)
                raise SpecError(
                    f"Tokenize: {path} is not a tokenizer file that HF tokenizers can load "
                    f"(unsupported model or damaged file): {exc}"
                ) from exc
            _check_settings(path, tok)
            _HF[sha256] = tok
        return _HF[sha256]


def _say_once(sha256: str, level: int, message: str) -> None:
    with _CACHE:
        if (sha256, message) in _SAID:
            return
        _SAID.add((sha256, message))
    logger.log(level, message)


def _sample(doc: dict[str, Any], plan: TiktokenPlan) -> list[str]:
    by_id = sorted(vocabulary_bytes(doc["model"]["vocab"]).items())
    added = [t for t, _ in (*plan.raw_added, *plan.normalized_added)]
    return verification_sample([data for _, data in by_id], added)


def _attempt(engine: TiktokenEngine, text: str) -> list[int] | str:
    """tiktoken's ids, or what it raised (a Rust panic is a BaseException)."""
    try:
        return engine.encode(text)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"


def _disagreement(what: str, text: str, want: list[int], got: list[int] | str) -> str:
    if isinstance(got, str):
        return f"tiktoken raised {got} on {what} ({text[:60]!r})"
    k = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    return (
        f"tiktoken and HF disagree on {what} ({text[:60]!r}): first at token {k}, HF "
        f"{want[k : k + 4]} vs tiktoken {got[k : k + 4]}"
    )


def _digest(ids: Sequence[list[int]]) -> str:
    h = hashlib.sha256()
    for row in ids:
        h.update(np.asarray(row, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


class _Disagreement(NotExpressible):
    """tiktoken was built but does not give HF's ids."""


def _build(sha256: str, doc: dict[str, Any], plan: TiktokenPlan) -> TiktokenEngine:
    try:
        return TiktokenEngine(f"zephon-{sha256[:16]}", plan, mergeable_ranks(doc, plan))
    except ValueError as exc:  # fancy-regex refused the translated pattern
        raise NotExpressible(f"tiktoken cannot build it: {exc}") from exc


def _verdict(path: str, sha256: str, raw: bytes, hf: Any) -> _Verdict:
    with _CACHE:
        if sha256 in _VERDICTS:
            return _VERDICTS[sha256]
        verdict = _cached_verdict(path, sha256, raw)
        if verdict is None:
            verdict = _decide(sha256, _parse(path, raw), raw, hf)
            _verdict_cache.store(sha256, verdict.plan, verdict.reason, verdict.disagreed, verdict.digest)
        _VERDICTS[sha256] = verdict
        return verdict


def _cached_verdict(path: str, sha256: str, raw: bytes) -> _Verdict | None:
    """The verdict cached on disk, once this process's tiktoken reproduces its digest; None to
    decide afresh (no entry, or one this process cannot confirm). The JSON is parsed only to
    confirm a plan: a cached "HF only" needs nothing more."""
    cached = _verdict_cache.load(sha256)
    if cached is None:
        return None
    plan, reason, disagreed, digest = cached
    if plan is None:
        return _Verdict(plan=None, reason=reason, disagreed=disagreed, digest="")
    fast = _check(sha256, _parse(path, raw), plan, digest)
    if isinstance(fast, str):
        return None
    _TIKTOKEN[sha256] = fast
    return _Verdict(plan=plan, reason=None, disagreed=False, digest=digest)


def _decide(sha256: str, doc: dict[str, Any], raw: bytes, hf: Any) -> _Verdict:
    """Maps the file onto tiktoken and compares both engines on the verification sample."""
    try:
        plan = plan_tiktoken(doc, raw, hf)
        fast = _build(sha256, doc, plan)
        reference, want = HfEngine(hf), []
        for i, text in enumerate(_sample(doc, plan)):
            want.append(reference.encode(text))
            got = _attempt(fast, text)
            if got != want[-1]:
                raise _Disagreement(_disagreement(f"verification text #{i}", text, want[-1], got))
    except NotExpressible as exc:
        return _Verdict(plan=None, reason=str(exc), disagreed=isinstance(exc, _Disagreement), digest="")
    _TIKTOKEN[sha256] = fast
    return _Verdict(plan=plan, reason=None, disagreed=False, digest=_digest(want))


def _checked_tiktoken(path: str, sha256: str, plan: TiktokenPlan, digest: str) -> TiktokenEngine | str:
    """This process's tiktoken engine for the file, checked against the sample's digest."""
    with _CACHE:
        if sha256 not in _TIKTOKEN:
            _TIKTOKEN[sha256] = _check(sha256, _parse(path, _read(path, sha256)), plan, digest)
        return _TIKTOKEN[sha256]


def _check(sha256: str, doc: dict[str, Any], plan: TiktokenPlan, digest: str) -> TiktokenEngine | str:
    """A tiktoken engine built from ``plan`` that reproduces ``digest`` on the verification
    sample, or why not."""
    try:
        fast = _build(sha256, doc, plan)
    except NotExpressible as exc:
        return str(exc)
    got = [_attempt(fast, text) for text in _sample(doc, plan)]
    failed = next((g for g in got if isinstance(g, str)), None)
    if failed is not None:
        return f"tiktoken raised {failed} on the verification sample"
    if _digest([g for g in got if not isinstance(g, str)]) != digest:
        return (
            "tiktoken in this process does not reproduce HF's ids for the verification "
            "sample (another tiktoken version?)"
        )
    return fast


def _eos_id(tok: Any, path: str, eos_token: str | None) -> int:
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    found = [i for i in (tok.token_to_id(n) for n in names) if i is not None]
    if not found:
        raise SpecError(
            f"Tokenize: no EOS token {' or '.join(map(repr, names))} in {path}; pass "
            f"eos_token=... naming the tokenizer's end-of-text token, or append_eos=False"
        )
    return int(found[0])


class Tokenize(beam.DoFn):  # type: ignore[misc]
    """Encodes each text into an ``int32`` array of ids, with the EOS id appended if asked.

    ``tokenizer`` is a ``tokenizer.json``, a ``save_pretrained`` folder holding one, or a local
    hub cache folder (``models--org--name`` or ``models--org--name/snapshots/<revision>``).
    ``add_special_tokens`` has HF's meaning: True adds what the tokenizer's post-processor
    adds (a BOS, ``[CLS]``/``[SEP]``), as HF's ``encode`` does by default; **the default here
    is False** (the text's tokens only; ``append_eos`` then ends each document with the EOS,
    which is what packing for causal LM training wants).

    The tokenizer file's sha256 is part of the pipeline's fingerprint, so a checkpoint never
    resumes under another vocabulary; the path is not (a folder and its file are the same
    tokenizer). ``engine`` (``"auto"``, ``"hf"`` or ``"tiktoken"``) is not either: every
    engine gives HF's ids (see the module's doc).
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str],
        *,
        append_eos: bool = True,
        eos_token: str | None = None,
        engine: str = "auto",
        add_special_tokens: bool = False,
    ) -> None:
        super().__init__()
        if engine not in ENGINES:
            raise SpecError(
                f"Tokenize: engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}"
            )
        if not isinstance(add_special_tokens, bool):
            raise SpecError(f"Tokenize: add_special_tokens must be True or False, got {add_special_tokens!r}")
        if not isinstance(tokenizer, str | os.PathLike):
            raise SpecError(_not_a_path(tokenizer))
        path = resolve_tokenizer_path(os.fspath(tokenizer))
        raw = _read(path)
        self.path = path
        self.sha256 = hashlib.sha256(raw).hexdigest()
        tok = _hf_tokenizer(path, raw, self.sha256)
        self.append_eos = bool(append_eos)
        self.eos_id = _eos_id(tok, path, eos_token) if append_eos else None
        self.add_special_tokens = add_special_tokens
        self.prefix_ids, self.suffix_ids = special_affixes(tok, path) if add_special_tokens else ([], [])
        if self.eos_id is not None and self.suffix_ids[-1:] == [self.eos_id]:
            raise SpecError(
                f"Tokenize: with add_special_tokens=True the post-processor of {path} already ends "
                f"each text with the EOS id {self.eos_id}; pass append_eos=False"
            )
        self.engine = engine
        self.fallback_reason: str | None = None
        self._plan: TiktokenPlan | None = None
        self._digest = ""
        if engine != "hf":
            self._choose(_verdict(path, self.sha256, raw, tok))
        self._init_runtime()

    def _choose(self, verdict: _Verdict) -> None:
        if verdict.plan is None:
            assert verdict.reason is not None
            if self.engine == "tiktoken":
                raise SpecError(f"Tokenize: engine='tiktoken' cannot run {self.path}: {verdict.reason}")
            self.fallback_reason = verdict.reason
            level = logging.WARNING if verdict.disagreed else logging.INFO
            message = f"Tokenize: HF tokenizers runs {self.path}, not tiktoken: {verdict.reason}"
            _say_once(self.sha256, level, message)
        self._plan, self._digest = verdict.plan, verdict.digest

    def _init_runtime(self) -> None:
        self._tokenizer: HfEngine | TiktokenEngine | None = None
        self._unchecked = 0
        self._lock = threading.Lock()
        # What goes around a document's ids (``_finish``, ``_finish_array``): the
        # post-processor's tokens if asked, then the EOS if asked.
        specials = self.add_special_tokens
        self._head_ids: list[int] = list(self.prefix_ids) if specials else []
        eos = [] if self.eos_id is None else [self.eos_id]  # set exactly when append_eos
        self._tail_ids: list[int] = [*(self.suffix_ids if specials else []), *eos]
        self._head, self._tail = (
            np.asarray(self._head_ids, dtype=np.int32),
            np.asarray(self._tail_ids, dtype=np.int32),
        )

    @property
    def selected_engine(self) -> str:
        """The engine chosen where the pipeline was defined: ``"tiktoken"`` or ``"hf"``."""
        return "hf" if self._plan is None else "tiktoken"

    @property
    def active_engine(self) -> str | None:
        """The engine this copy runs: None before ``setup``, ``"hf"`` after a fall-back."""
        return None if self._tokenizer is None else self._tokenizer.name

    def token_decoder(self) -> Callable[[list[int]], str]:
        """Ids back to text with this tokenizer (special tokens shown), for ``zephon inspect``."""
        tokenizer = Tokenizer.from_file(os.fspath(self.path))

        def decode(ids: list[int]) -> str:
            text: str = tokenizer.decode(ids, skip_special_tokens=False)
            return text

        return decode

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "tokenizer_sha256": self.sha256,
            "append_eos": self.append_eos,
            "eos_id": self.eos_id,
        }
        if self.add_special_tokens:  # only then: pipelines without it keep their fingerprint
            params.update(add_special_tokens=True, prefix_ids=self.prefix_ids, suffix_ids=self.suffix_ids)
        return params

    def _finish(self, ids: list[int]) -> list[int]:
        """The text's ids with the post-processor's tokens (if asked) and the EOS (if asked)."""
        if self._head_ids:
            ids = [*self._head_ids, *ids]
        ids.extend(self._tail_ids)  # the engines hand out a new list per text
        return ids

    def _finish_array(self, ids: np.ndarray) -> np.ndarray:
        """``_finish`` for an int32 array of ids (the array itself if nothing is added)."""
        if not self._head.size and not self._tail.size:
            return ids
        return np.concatenate((self._head, ids, self._tail))

    def _encode(self, tokenizer: HfEngine | TiktokenEngine, text: str) -> np.ndarray:
        """One checked document's ids, finished, as an int32 array."""
        if isinstance(tokenizer, TiktokenEngine):
            return self._finish_array(tokenizer.encode_array(text))
        return np.asarray(self._finish(tokenizer.encode(text)), dtype=np.int32)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_tokenizer", "_unchecked", "_lock"):  # each process loads and checks its own
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _hf(self) -> HfEngine:
        with _CACHE:
            tok = _HF.get(self.sha256)
        return HfEngine(
            tok if tok is not None else _hf_tokenizer(self.path, _read(self.path, self.sha256), self.sha256)
        )

    def setup(self) -> None:
        with self._lock:
            if self._tokenizer is not None:
                return
            if self._plan is None:
                self._tokenizer = self._hf()
                return
            fast = _checked_tiktoken(self.path, self.sha256, self._plan, self._digest)
            if isinstance(fast, str):
                self._fall_back(fast)
            else:
                self._tokenizer, self._unchecked = fast, STREAM_CHECK_DOCS

    def _fall_back(self, reason: str) -> None:
        """Called with the lock held: HF from now on in this process, or SpecError."""
        if self.engine == "tiktoken":
            raise SpecError(f"Tokenize: engine='tiktoken' does not give HF's ids for {self.path}: {reason}")
        self.fallback_reason = reason
        _say_once(
            self.sha256, logging.WARNING, f"Tokenize: falling back to HF tokenizers for {self.path}: {reason}"
        )
        with _CACHE:
            _TIKTOKEN[self.sha256] = reason
        self._tokenizer, self._unchecked = self._hf(), 0

    def _encode_checked(self, text: str) -> list[int]:
        """One of the first documents: HF's ids, after checking that tiktoken gives the same."""
        with self._lock:
            assert self._tokenizer is not None
            if not self._unchecked or not isinstance(self._tokenizer, TiktokenEngine):
                return self._tokenizer.encode(text)
            want = self._hf().encode(text)
            got = _attempt(self._tokenizer, text)
            if got != want:
                seen = STREAM_CHECK_DOCS - self._unchecked
                self._fall_back(_disagreement(f"document #{seen} of this process", text, want, got))
            else:
                self._unchecked -= 1
            return want

    def process(self, text: Any) -> Any:
        if not isinstance(text, str):
            raise DataError(f"Tokenize: expected a str document, got {type(text).__name__}")
        if self._tokenizer is None:
            self.setup()
        assert self._tokenizer is not None
        if self._unchecked:
            yield np.asarray(self._finish(self._encode_checked(text)), dtype=np.int32)
        else:
            yield self._encode(self._tokenizer, text)

    def get_input_batch_type(self, input_element_type: Any) -> Any:
        # Only so that Beam's runners accept ``process_batch``; they call ``process``.
        return typing.List[input_element_type]  # noqa: UP006 (Beam wants a typing generic)

    @beam.DoFn.yields_elements  # type: ignore[untyped-decorator]
    def process_batch(self, texts: list[Any]) -> list[list[np.ndarray]]:
        """zephon-flow's batched path: one ``[ids]`` per text, the same ids as ``process``.

        HF encodes the list with ``encode_batch`` (in parallel on its Rust threads; ids are per
        document, so the order of work does not matter); tiktoken in a loop. The first
        documents a process sees still go one by one through the engines' cross-check.
        """
        for text in texts:
            if not isinstance(text, str):
                raise DataError(f"Tokenize: expected a str document, got {type(text).__name__}")
        if self._tokenizer is None:
            self.setup()
        tokenizer = self._tokenizer
        if self._unchecked or tokenizer is None:
            return [list(self.process(text)) for text in texts]
        if isinstance(tokenizer, TiktokenEngine):
            return [[self._encode(tokenizer, text)] for text in texts]
        rows: list[list[int]]
        try:
            rows = [e.ids for e in tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)]
        except TypeError:  # a lone surrogate: encode one by one, which names the document
            rows = [tokenizer.encode(text) for text in texts]
        return [[np.asarray(self._finish(ids), dtype=np.int32)] for ids in rows]
