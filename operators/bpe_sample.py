"""The fixed verification sample on which tiktoken must give HF's ids before ``Tokenize`` uses it.

The texts aim at the places where two BPE engines drift apart: the split pattern (contractions,
whitespace runs before and after line breaks, digit runs, punctuation runs, letters of many
scripts, marks, emoji sequences), Unicode forms (composed and decomposed, ligatures, full-width),
added tokens inside text, runs of one character (where merges overlap), and text made of the
vocabulary's own tokens. It is a pure function of the tokenizer file, so every process builds
the same sample and the HF ids of it can be checked by digest.
"""

from __future__ import annotations

from collections.abc import Sequence

_PROSE = [
    "Hello, world! It's a test: we're here, they've gone, I'm sure you'll see, he'd know.",
    "IT'S LOUD. WE'RE HERE. THEY'VE GONE. I'M SURE. YOU'LL SEE. HE'D KNOW. ſt 'ſ 'S 'K",
    "Don\u2019t use curly \u2018quotes\u2019 \u201clike this\u201d \u2014 or do\u2026 'tis 'twas o'clock rock'n'roll",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX. tHe QuIcK.",
    "Straße, STRASSE, ﬁnance, ﬂow, ﬀ, ﬃ, ﬆ, İstanbul, ǰ, ŉ, K (kelvin), Å (angstrom), Ω (ohm)",
    "Voilà déjà vu: naïve café, crème brûlée, Ærøskøbing, Łódź, Dvořák, São Paulo, Zürich.",
    "decomposed: e\u0301 a\u0300 o\u0308 n\u0303 c\u0327 A\u030a; composed: é à ö ñ ç Å; ≯ >\u0338 ≠ =\u0338",
    "Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Українська: Ґанок, їжак. Ԁԁ",
    "עברית: שלום עולם. العربية: مرحبا بالعالم ١٢٣٤٥٦٧٨٩٠. فارسی: سلام ۱۲۳",
    "हिन्दी: नमस्ते दुनिया १२३. বাংলা: হ্যালো. தமிழ்: வணக்கம். ไทย: สวัสดีชาวโลก ๑๒๓",
    "中文：你好，世界！这是一个测试。日本語：こんにちは世界、カタカナ、ｶﾀｶﾅ。한국어: 안녕하세요 세계",
    "𠀀𠀁𪚥 𝕳𝖊𝖑𝖑𝖔 𝓦𝓸𝓻𝓵𝓭 ℌℑℜ ⅰⅱⅲ Ⅻ ① ⑴ ⒈ ¹²³ ½ ¾ ₀₁₂ 𝟘𝟙𝟚",
    "emoji: 😀😃😄 👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳\ufe0f\u200d🌈 🇫🇷🇯🇵 ❤\ufe0f ✌🏿 🧑\u200d💻 #\ufe0f\u20e3 1\ufe0f\u20e3",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３ ＜｜ｅｎｄｏｆｔｅｘｔ｜＞ \u3000ideographic space\u3000",
]

_NUMBERS = [
    "0 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 12345678901234567890",
    "3.14159 -2.5e-10 1,000,000 1_000_000 0x1F 0b1010 0o777 1e9 10% $5.99 €4,50 ¥100 #42 v1.2.3",
    "2024-01-31T23:59:59Z 192.168.0.1 +1 (555) 123-4567 3/4 1:30pm 99.9% ¹⁄₂ ٣٫١٤ ۳٫۱۴",
]

_WHITESPACE = [
    "a  b   c    d     e      f",
    "trailing spaces   \nand tabs\t\t\nmixed \t \t\n\n\n\nblank lines\r\n\r\nwindows\rold mac",
    "    indented\n        more\n\tand tab\n \n  \n   \nend   ",
    "   leading",
    "nbsp\u00a0here\u00a0\u00a0twice, thin\u2009space, zwsp\u200bhere, nel\x85line, ls\u2028ps\u2029end",
    "\n",
    " ",
    "\t\n \r\n\x0b\x0c",
    "x \n",
    "x  \n  y",
]

_CODE = [
    'def f(x: int) -> str:\n    """Doc."""\n    return f"{x!r:>10} → ünïcode"  # comment\n',
    "class A(B, metaclass=M):\n    __slots__ = ('a', 'b')\n\n    async def g(self, *args, **kw):\n"
    "        await h(*args, **kw)\n        yield from range(10)\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] << 2 | c[i] >> 3; } // C\n#include <stdio.h>\n",
    "const re = /^[a-z]+(?:\\d{2,3})?$/gi; let s = `${a}-${b}`; x ??= y?.z ?? 0; a !== b && c",
    '{"key": "value", "n": [1, 2.5, -3e4, true, null], "nested": {"a": {"b": []}}}',
    "SELECT id, COUNT(*) FROM t WHERE x >= 10 AND y <> 'z' GROUP BY id HAVING COUNT(*) > 1;",
    '<html><body class="x"><p>Hi&nbsp;&amp;&lt;there&gt;</p><!-- c --></body></html>',
    "$ ls -la | grep '^d' > out.txt 2>&1 && echo \"done\" || exit 1\nC:\\Users\\me\\file.txt",
    "x=1;y=2;z=x+y*3/4-5%6**7//8@9^10&11|12~13 ::: ... --- +++ === !== <=> >>= <<= ->",
    "https://example.com/path?q=1&r=%20x#frag mailto:a.b+c@d.e ../../etc/passwd ~/.bashrc",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f \ufeffBOM \ufffd replacement \U0010ffff \ue000 private",
]


def _runs() -> list[str]:
    """Runs of one character and of short periodic strings, where merges overlap."""
    chars = [" ", "\n", "\t", "-", "=", "*", "#", "_", ".", "/", "a", "e", "0", "9", "中", "😀"]
    out = []
    for c in chars:
        out.append("|".join(c * n for n in range(1, 41)))
        out.append(f"x{c * 17}y {c * 33} {c * 64}z")
    out.extend(unit * n for unit in ("ab", "aab", "ab ", " a", "\n ", "=-", "abc") for n in (7, 20))
    return out


def _all_bytes_text() -> str:
    """Every code point below U+0800 (all one- and two-byte UTF-8), in blocks of 48."""
    chars = [chr(c) for c in range(0x800)]
    return " ".join("".join(chars[i : i + 48]) for i in range(0, len(chars), 48))


def verification_sample(
    vocabulary: Sequence[bytes], added: Sequence[str], *, stride_tokens: int = 1500
) -> list[str]:
    """The fixed texts both engines must agree on, for a vocabulary (token bytes, in id order)
    and the texts of its added tokens."""
    texts = [*_PROSE, *_NUMBERS, *_WHITESPACE, *_CODE, *_runs(), _all_bytes_text()]
    for tok in sorted(added)[:64]:
        texts.append(f"{tok}start and end{tok}, twice {tok}{tok}, spaced {tok} x\n{tok}\n")
        texts.append(f"{tok[:-1]} broken {tok[1:]} {tok.upper()} {tok.lower()}")
    if added:
        texts.append("".join(sorted(added)[:64]))
    # Text made of the vocabulary's own tokens: every `step`-th one, in groups of 24.
    step = max(1, len(vocabulary) // stride_tokens)
    chosen = [t for t in vocabulary[::step] if t]
    for i in range(0, len(chosen), 24):
        group = chosen[i : i + 24]
        texts.append(b"".join(group).decode("utf-8", errors="replace"))
        texts.append(b" ".join(group).decode("utf-8", errors="replace"))
    return texts


__all__ = ["verification_sample"]
