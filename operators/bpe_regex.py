"""Translating an HF split pattern (Oniguruma, Ruby syntax) into the same pattern for tiktoken.

HF ``tokenizers`` runs split patterns with Oniguruma in its Ruby syntax; tiktoken runs them with
``fancy-regex`` in Rust. The two read the same text differently in a few places, and this module
rewrites a pattern so that fancy-regex matches exactly what Oniguruma matches, or refuses it:

- ``X{n,m}+`` is *not* possessive in Ruby syntax: it is ``X{n,m}`` repeated one or more times,
  so it becomes ``(?:X{n,m})+``; likewise ``X{n}?`` is ``(?:X{n})?``. Possessive ``?+ *+ ++``
  mean the same in both and are kept.
- ``^`` and ``$`` always match at line breaks in Ruby syntax: they become ``(?m:^)``, ``(?m:$)``.
- the inline flag ``m`` is "dot matches newline" in Ruby syntax: it becomes ``s``.
- ``\\p{^X}`` (Oniguruma's negated property) becomes ``\\P{X}``; ``{,m}`` becomes ``{0,m}``.
- ``\\w \\W \\b \\B \\h`` have other meanings in the two engines (Oniguruma's ``\\w`` takes
  ``²``, fancy-regex's takes U+200C), POSIX brackets and class set operations are not mapped,
  and case-insensitive text that Oniguruma folds into several characters (``ss`` matches ``ß``)
  is refused; so are backreferences and patterns that can match the empty string (tiktoken
  cannot run an empty piece).

Every literal is written as a ``\\x{..}`` escape, so no character changes meaning between the
two syntaxes. HF's ``Split(behavior="isolated")`` keeps the text between matches as pieces of
their own; tiktoken drops it, so ``split_pattern`` adds an alternative that matches those gaps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class PatternNotExpressible(ValueError):
    """The pattern uses a construct whose meaning differs between Oniguruma and fancy-regex."""


# Character escapes that mean one character, spelled as fancy-regex reads them unambiguously.
_CHAR_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "a": 0x07, "e": 0x1B}
_SET_ESCAPES = frozenset("sSdD")
_DIFFERENT = {
    "w": "\\w (word characters differ: Oniguruma takes '²', fancy-regex takes U+200C)",
    "W": "\\W (word characters differ between Oniguruma and fancy-regex)",
    "b": "\\b (word boundaries follow \\w, which differs)",
    "B": "\\B (word boundaries follow \\w, which differs)",
    "h": "\\h (a hex digit in Oniguruma, not in fancy-regex)",
    "H": "\\H (not a hex digit in Oniguruma, not in fancy-regex)",
}
_INTERVAL = re.compile(r"\{(\d*)(,?)(\d*)\}")
_PROPERTY = re.compile(r"\{(\^?)([A-Za-z0-9_ =.-]+)\}")
# Case-insensitive Oniguruma matches one character against several ("ss" matches "ß").
_MULTI_FOLDS = ("ss", "st", "ff", "fi", "fl")


@dataclass
class _Node:
    text: str
    nullable: bool


def _char(code: int) -> str:
    ch = chr(code)
    if ch.isascii() and ch.isalnum():
        return ch
    if not ch.isascii() and ch.isprintable():
        return ch
    return f"\\x{{{code:X}}}"


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def fail(self, what: str) -> PatternNotExpressible:
        return PatternNotExpressible(f"split pattern {self.p!r}: {what} (at offset {self.i})")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def alternation(self) -> _Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return _Node("|".join(b.text for b in branches), any(b.nullable for b in branches))

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified())
        return _Node("".join(n.text for n in items), all(n.nullable for n in items))

    def quantified(self) -> _Node:
        node = self.atom()
        quantified = False
        while self.peek() in ("*", "+", "?", "{"):
            if self.peek() == "{" and not _INTERVAL.match(self.p, self.i):
                break  # a literal brace, read as the next atom
            if quantified:  # Ruby syntax stacks quantifiers: X{2}+ is (?:X{2})+
                node = _Node(f"(?:{node.text})", node.nullable)
            node = self.quantifier(node)
            quantified = True
        return node

    def quantifier(self, node: _Node) -> _Node:
        c = self.peek()
        if c != "{":
            self.i += 1
            suffix = self.peek() if self.peek() in ("?", "+") else ""
            self.i += len(suffix)
            return _Node(node.text + c + suffix, node.nullable or c in "*?")
        m = _INTERVAL.match(self.p, self.i)
        assert m is not None
        lo, comma, hi = m.groups()
        if not lo and not comma:
            raise self.fail("an empty interval {}")
        self.i = m.end()
        low = int(lo) if lo else 0
        text = f"{{{low}{comma}{hi}}}"
        if comma and self.peek() == "?":  # {n,m}? is lazy; {n}? is (?:X{n})?
            self.i += 1
            text += "?"
        return _Node(node.text + text, node.nullable or low == 0)

    def atom(self) -> _Node:
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return _Node(self.char_class(), False)
        if c == "\\":
            return self.escape(in_class=False)
        if c in ("*", "+", "?"):
            raise self.fail(f"nothing to repeat before {c!r}")
        self.i += 1
        if c == ".":
            return _Node(".", False)
        if c == "^":
            return _Node("(?m:^)", True)
        if c == "$":
            return _Node("(?m:$)", True)
        return _Node(_char(ord(c)), False)

    def group(self) -> _Node:
        self.i += 1
        head = ""
        zero_width = False
        if self.peek() == "?":
            rest = self.p[self.i + 1 :]
            for prefix, out, zw in (
                ("#", None, False),
                (":", "(?:", False),
                ("=", "(?=", True),
                ("!", "(?!", True),
                ("<=", "(?<=", True),
                ("<!", "(?<!", True),
                (">", "(?>", False),
            ):
                if rest.startswith(prefix):
                    if out is None:  # a comment
                        end = self.p.find(")", self.i)
                        if end < 0:
                            raise self.fail("an unclosed comment group")
                        self.i = end + 1
                        return _Node("", True)
                    self.i += 1 + len(prefix)
                    head, zero_width = out, zw
                    break
            else:
                m = re.match(r"<([A-Za-z_]\w*)>|P<([A-Za-z_]\w*)>", rest)
                if m:  # a named group: its name does not change what matches
                    self.i += 1 + m.end()
                    head = "(?:"
                else:
                    return self.flags()
        else:
            head = "(?:"  # captures do not change what matches
        inner = self.alternation()
        if self.peek() != ")":
            raise self.fail("an unclosed group")
        self.i += 1
        return _Node(f"{head}{inner.text})", True if zero_width else inner.nullable)

    def flags(self) -> _Node:
        m = re.match(r"\?([imx]*)(?:-([imx]*))?([:)])", self.p[self.i :])
        if not m:
            raise self.fail("a group kind that fancy-regex does not share")
        on, off, end = m.group(1), m.group(2) or "", m.group(3)
        if "x" in on + off:
            raise self.fail("the extended-syntax flag x")
        self.i += m.end()

        def rust(flags: str) -> str:  # Ruby's m ("dot matches newline") is Rust's s
            return flags.replace("m", "s")

        spec = rust(on) + (f"-{rust(off)}" if off else "")
        if end == ")":  # (?i) applies to the rest of the enclosing group, in both engines
            return _Node(f"(?{spec})" if spec else "", True)
        inner = self.alternation()
        if self.peek() != ")":
            raise self.fail("an unclosed group")
        self.i += 1
        return _Node(f"(?{spec}:{inner.text})", inner.nullable)

    def escape(self, *, in_class: bool) -> _Node:
        self.i += 1
        c = self.peek()
        if not c:
            raise self.fail("a trailing backslash")
        self.i += 1
        if c in ("p", "P"):
            m = _PROPERTY.match(self.p, self.i)
            if not m:
                raise self.fail(f"a malformed \\{c}{{...}} property")
            self.i = m.end()
            negate = (c == "P") != bool(m.group(1))
            name = m.group(2)
            if name.lower().startswith("in_") or name.lower().startswith("in "):
                raise self.fail(f"the Unicode block \\p{{{name}}}, which fancy-regex lacks")
            return _Node(f"\\{'P' if negate else 'p'}{{{name}}}", False)
        if c in _SET_ESCAPES:
            return _Node(f"\\{c}", False)
        if c in _CHAR_ESCAPES:
            return _Node(_char(_CHAR_ESCAPES[c]), False)
        if c in ("x", "u"):
            return _Node(_char(self.code_point(c)), False)
        if not in_class and c in ("A", "z"):
            return _Node(f"\\{c}", True)
        if c in _DIFFERENT:
            raise self.fail(_DIFFERENT[c])
        if c.isascii() and not c.isalnum():
            return _Node(_char(ord(c)), False)
        raise self.fail(f"the escape \\{c}, which is not mapped to fancy-regex")

    def code_point(self, kind: str) -> int:
        if kind == "x" and self.peek() == "{":
            m = re.match(r"\{([0-9A-Fa-f]{1,8})\}", self.p[self.i :])
        elif kind == "x":
            m = re.match(r"([0-9A-Fa-f]{1,2})", self.p[self.i :])
        else:
            m = re.match(r"([0-9A-Fa-f]{4})", self.p[self.i :])
        if not m:
            raise self.fail(f"a malformed \\{kind} escape")
        self.i += m.end()
        code = int(m.group(1), 16)
        if code > 0x10FFFF or 0xD800 <= code < 0xE000:
            raise self.fail(f"the code point {code:#x}, which is not a character")
        return code

    def char_class(self) -> str:
        self.i += 1
        out = "["
        if self.peek() == "^":
            out += "^"
            self.i += 1
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.fail("an unclosed character class")
            if c == "]" and not first:
                self.i += 1
                return out + "]"
            first = False
            if c == "[":
                if self.peek(1) == ":":
                    raise self.fail("a POSIX bracket [:...:], whose classes differ")
                out += self.char_class()
                continue
            if c == "&" and self.peek(1) == "&":
                raise self.fail("a class intersection &&")
            low, low_set = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                high, _ = self.class_item()
                if low is None or high is None:
                    raise self.fail("a range whose end is a set, not a character")
                if high < low:
                    raise self.fail("a range out of order")
                out += f"{_char(low)}-{_char(high)}"
            else:
                out += low_set if low is None else _char(low)

    def class_item(self) -> tuple[int | None, str]:
        """One item of a class: a character (its code point, "") or a set (None, its text)."""
        c = self.peek()
        if c != "\\":
            self.i += 1
            return ord(c), ""
        node = self.escape(in_class=True)
        if node.text.startswith(("\\p", "\\P")) or node.text[1:] in _SET_ESCAPES:
            return None, node.text
        if node.text.startswith("\\x{"):
            return int(node.text[3:-1], 16), ""
        return ord(node.text), ""


def translate(pattern: str) -> str:
    """The fancy-regex pattern that matches what Oniguruma (Ruby syntax) matches for ``pattern``.

    Raises ``PatternNotExpressible`` naming the construct that has no faithful translation.
    """
    parser = _Parser(pattern)
    node = parser.alternation()
    if parser.peek() == ")":
        raise parser.fail("an unmatched ')'")
    if node.nullable:
        raise PatternNotExpressible(
            f"split pattern {pattern!r} can match the empty string, which tiktoken cannot run"
        )
    if re.search(r"\(\?[a-z]*i", pattern):
        lowered = pattern.lower()
        folds = [f for f in _MULTI_FOLDS if f in lowered]
        if folds or not pattern.isascii():
            raise PatternNotExpressible(
                f"split pattern {pattern!r}: case-insensitive text that Oniguruma folds into "
                f"other characters ({', '.join(folds) or 'non-ASCII letters'})"
            )
    return node.text


def split_pattern(pattern: str) -> str:
    """The tiktoken ``pat_str`` for HF's ``Split(pattern, behavior="isolated")``: the matches,
    and the runs of text between matches (which HF keeps as pieces and tiktoken would drop)."""
    inner = translate(pattern)
    return f"(?:{inner})|(?:(?!(?:{inner}))(?s:.))+"


def literal_pattern(text: str) -> str:
    """An Oniguruma pattern matching ``text`` literally (for ``Split`` with a string pattern)."""
    if not text:
        raise PatternNotExpressible("an empty split string")
    return "".join(f"\\x{{{ord(c):X}}}" for c in text)


__all__ = ["PatternNotExpressible", "literal_pattern", "split_pattern", "translate"]
