"""Line alignment between two versions of a piece of code, the basis of every source map.

Rewrites keep most lines and change, add or indent a few. Aligning on the stripped text maps each kept
line exactly; a changed line maps to the line it replaced; an added line maps to the kept line before it.
"""

from __future__ import annotations

import difflib


def align(before: list[str], after: list[str]) -> list[int | None]:
    """For each line of ``after``, the 0-based index of the line of ``before`` it comes from, or None."""
    out: list[int | None] = [None] * len(after)
    matcher = difflib.SequenceMatcher(a=[s.strip() for s in before], b=[s.strip() for s in after], autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(b1 - b0):
                out[b0 + k] = a0 + k
        elif tag == "replace":
            for k in range(b1 - b0):
                out[b0 + k] = min(a0 + k, a1 - 1)
        elif tag == "insert" and a0 > 0:
            for k in range(b1 - b0):
                out[b0 + k] = a0 - 1
    return out

