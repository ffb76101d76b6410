"""Running-average classes the notebook defines (``AverageMeter``): what their ``update`` adds up, and what it
derives from those sums.

Kaggle training notebooks keep an epoch's loss in an ``AverageMeter`` (PyTorch's ImageNet example's:
``update(val, n)`` does ``self.sum += val * n``, ``self.count += n``, ``self.avg = self.sum / self.count``) and
return ``losses.avg`` from their ``train_fn``. In a loop over a sharded loader each rank's meter holds its share's
average, which the notebook then prints and keeps as the epoch's: one rank's metric shown as the whole set's.
``LoopSumsRule`` makes the sums whole after the loop and derives the averages again.

An ``AverageMeter`` the notebook imports (a Kaggle utility script's ``from utils import AverageMeter``, timm's
``timm.utils.AverageMeter``) has no source here to read: it is taken to have the ImageNet example's shape
(``IMPORTED``), which timm's has too; at run time only the attributes the object has are summed, so one without
``sum`` or ``count`` is left as it is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class MeterShape:
    """What a meter class's ``update`` does to its own attributes."""

    summed: tuple[str, ...]  # ``self.sum += …``, ``self.count += …``
    derived: tuple[tuple[str, str, str], ...]  # ``self.avg = self.sum / self.count``: (avg, sum, count)


#: The name a meter the notebook imports goes by, and the shape it is taken to have.
IMPORTED_NAME = "AverageMeter"
IMPORTED = MeterShape(("sum", "count"), (("avg", "sum", "count"),))


def shape_of(cls: str, meters: dict, own_classes: dict) -> MeterShape | None:
    """The shape of the meter class ``cls`` an instance was made of: the notebook's own class's, or ``IMPORTED``
    for an ``AverageMeter`` the notebook does not define; None for any other class."""
    if cls in meters:
        return meters[cls]
    return IMPORTED if cls == IMPORTED_NAME and cls not in own_classes else None


def meter_shape(node: ast.ClassDef) -> MeterShape | None:
    """The shape of a class whose ``update`` method adds to attributes of its own (``self.sum += val * n``);
    None for any other class. Derived: an attribute ``update`` sets to one summed attribute divided by another."""
    update = next((m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "update"), None)
    if update is None:
        return None
    summed = tuple(dict.fromkeys(attr for n in ast.walk(update) if isinstance(n, ast.AugAssign)
                                 and isinstance(n.op, ast.Add) and (attr := _own(n.target)) is not None))
    if not summed:
        return None
    derived = []
    for n in ast.walk(update):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and (attr := _own(n.targets[0])) is not None and \
                isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Div):
            num, den = _own(n.value.left), _own(n.value.right)
            if num in summed and den in summed:
                derived.append((attr, num, den))
    return MeterShape(summed, tuple(derived))


def _own(node: ast.AST) -> str | None:
    """``attr`` of ``self.attr``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None
