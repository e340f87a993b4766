"""Backslash escapes in stop strings, so `job.stop=['\\n']` on the command line means a newline.

Hydra's override grammar keeps a backslash as it is (`'\\n'` arrives as a backslash and an `n`),
while a double-quoted YAML string has already turned it into a newline. Decoding the usual
escapes in `job.stop` makes both spellings mean the same; `\\\\` is a literal backslash. Unknown
escapes are kept as written.
"""
from __future__ import annotations

import re

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)", re.DOTALL)


def unescape(text: str) -> str:
    r"""'a\nb' (backslash, n) -> 'a' newline 'b'; '\\n' -> backslash, n; '\u00e9' -> 'é'."""

    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        if e[0] in "ux" and len(e) > 1:
            return chr(int(e[1:], 16))
        return _SIMPLE.get(e, m.group(0))

    return _ESCAPE.sub(one, text)
