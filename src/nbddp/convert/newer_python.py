"""Syntax that only a newer Python reads, so a cell that does not parse here can say which Python it needs."""

from __future__ import annotations

import re
import sys

#: Syntax that a newer Python reads: PEP 695's ``type X = …`` and ``def f[T](…)``/``class C[T]:`` (3.12).
_NEWER_SYNTAX = (
    (re.compile(r"^\s*type\s+[A-Za-z_]\w*\s*(?:\[[^\]]*\])?\s*="), (3, 12), "a type alias statement"),
    (re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+[A-Za-z_]\w*\s*\["), (3, 12), "type parameters"),
)


def newer_python(body: list[str]) -> tuple[int, str] | None:
    """``(line, message)`` for the first body line holding syntax only a newer Python reads, if this one
    is older: an f-string with its own quote inside a replacement field (PEP 701, 3.12), PEP 695 syntax."""
    for number, text in enumerate(body, start=1):
        found = [(v, what) for pattern, v, what in _NEWER_SYNTAX if pattern.match(text)]
        if _nested_same_quote(text):
            found.append(((3, 12), "an f-string with its own quotes inside"))
        for version, what in found:
            if sys.version_info < version:
                needed, here = ".".join(map(str, version)), ".".join(map(str, sys.version_info[:2]))
                return number, f"needs Python {needed} or newer ({what}); this is Python {here}"
    return None


_FSTRING_START = re.compile(r"(?<![\w'\"])[rRbB]?[fF][rR]?('\'\'|\"\"\"|'|\")|(?<![\w'\"])[fF][rRbB]('\'\'|\"\"\"|'|\")")


def _nested_same_quote(text: str) -> bool:
    """Whether an f-string on this line holds its own quote inside a replacement field (``f"{d["k"]}"``)."""
    for m in _FSTRING_START.finditer(text):
        quote = m.group(1) or m.group(2)
        depth, i = 0, m.end()
        while i < len(text):
            if text.startswith("{{", i) and depth == 0:
                i += 2
                continue
            ch = text[i]
            if text.startswith(quote, i):
                if depth > 0:
                    return True
                break
            depth += ch == "{"
            depth -= ch == "}" and depth > 0
            i += 1
    return False
