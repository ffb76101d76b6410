"""The engine that runs the rewrite rules (``convert/rules/``) over a cleaned cell.

- ``rule.py``: the base every rule derives from (its check, asked with ``ast``; its rewrite, with libcst);
- ``plan.py``: ``plan_cell``, which rules of a list a cell runs and on which statements (no libcst);
- ``chunk.py``: the runs of statements libcst parses, with stand-ins for what no rule reads;
- ``rewrite.py``: ``rewrite``, the planned rules walked over the chunks, their notes as lines of the cell.

``rule`` and ``plan`` are imported for every conversion; ``chunk`` and ``rewrite``, which import libcst,
only for a cell some rule has work in.
"""
