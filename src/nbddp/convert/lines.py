"""Line alignment between two versions of a piece of code, the basis of every source map.

Rewrites keep most lines and change, add or indent a few. Aligning on the stripped text maps each kept
line exactly; a changed line maps to the line it replaced (not to a blank line before it, which IPython drops
at a cell's start); an added line maps to the kept line before it.
"""

from __future__ import annotations

import difflib


def align(before: list[str], after: list[str]) -> list[int | None]:
    """For each line of ``after``, the 0-based index of the line of ``before`` it comes from, or None.

    The lines both share at their start and at their end are matched first, and only the part between them is
    diffed: ``SequenceMatcher`` costs the product of the two lengths where lines repeat (a cell of 873,000
    ``x = 1`` lines took minutes for one changed line), while a rewrite changes a few lines in one place."""
    a, b = [s.strip() for s in before], [s.strip() for s in after]
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    out: list[int | None] = [*range(head), *([None] * (len(b) - head - tail)), *range(len(a) - tail, len(a))]
    matcher = difflib.SequenceMatcher(a=a[head : len(a) - tail], b=b[head : len(b) - tail], autojunk=False)
    for tag, a0, a1, b0, b1 in _shifted(matcher.get_opcodes(), head):
        if tag == "equal":
            for k in range(b1 - b0):
                out[b0 + k] = a0 + k
        elif tag == "replace":  # code replaces code: blank lines leading the old block (dropped) are skipped
            first = next((i for i in range(a0, a1) if a[i]), a0) if b[b0] else a0
            for k in range(b1 - b0):
                out[b0 + k] = min(first + k, a1 - 1)
        elif tag == "insert" and a0 > 0:
            for k in range(b1 - b0):
                out[b0 + k] = a0 - 1
    return out


def _shifted(opcodes, by: int):
    """``SequenceMatcher`` opcodes of the middle part, as indices of the whole."""
    for tag, a0, a1, b0, b1 in opcodes:
        yield tag, a0 + by, a1 + by, b0 + by, b1 + by
