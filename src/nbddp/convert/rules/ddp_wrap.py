"""Plain PyTorch: the model wrapped in DDP where the facts say: the rule and where it has work."""

from __future__ import annotations

from ..cst_helpers import cst, dotted_name
from ..engine.rule import Rule

class DDPWrapRule(Rule):
    """Plain PyTorch: the model is wrapped in ``DistributedDataParallel`` once it is on its device.

    A notebook's own training loop has no Trainer to do it. Without DDP each rank would train its own copy
    on its share of the data and the copies would drift apart; wrapped, gradients are averaged in every
    backward. The wrap (``model = _nbddp.ddp(model)``) goes after the last statement that makes or moves
    the model (``model = Net().to(device)``, ``model.to(device)``) before the first training statement; the
    same inside a function or loop that builds a model and trains it (k-fold loops). Optimizers keep working:
    DDP shares the module's parameters.

    Where the optimizer trains a part and the training calls that part itself, never the model (SAM's
    ``sam_model.mask_decoder(emb)``), a wrapper around the model would never run: the part is wrapped instead,
    under a name of its own (``sam_model_mask_decoder_ddp = _nbddp.ddp(sam_model.mask_decoder)``), and the
    training's calls of the part go through it. The model keeps the plain part, so its state dict is unchanged.
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "ddp_wrap"
    on_statements = True
    _routes = False  # the walk is in a statement whose calls of a wrapped part go through its wrapper
    walks_inside = True  # it looks for the statements inside blocks that the facts chose

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return facts.plain_loop and bool(facts.ddp_models)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.ddp_wrap_after or stmt in facts.ddp_wraps_inside or stmt in facts.part_routes

    # -- what it does: libcst

    def _wrap(self, stmt: cst.BaseStatement, names: list[str]) -> list[cst.BaseStatement]:
        whole = [n for n in names if n not in self.facts.part_wraps]
        out = [cst.parse_statement(f"{n} = _nbddp.ddp({n})\n") for n in whole]
        if whole:
            self.note(stmt, f"{', '.join(whole)} wrapped in DistributedDataParallel (gradients averaged over ranks)"
                            + "".join(self._part_note(n) for n in whole))
        for name in (n for n in names if n in self.facts.part_wraps):
            for part, wrapper in self.facts.part_wraps[name].items():
                out.append(cst.parse_statement(f"{wrapper} = _nbddp.ddp({name}.{part})\n"))
                self.note(stmt, f"{name}.{part} wrapped in DistributedDataParallel as {wrapper} (gradients averaged "
                                f"over ranks): its optimizer trains {name}.{part} and the training calls it itself, "
                                f"never {name}(…), so a wrapper around {name} would never run; those calls go "
                                f"through {wrapper}, and {name} keeps its plain part and its state dict's keys; DDP "
                                f"looks for the parameters a step leaves out (find_unused_parameters=True: a head "
                                f"the loss does not read, as SAM's IoU head)")
        return out

    def _part_note(self, name: str) -> str:
        """Why a model is wrapped whole where its optimizer trains one part (SAM's ``mask_decoder``)."""
        parts = sorted(self.facts.trained_parts.get(name, ()))
        if not parts:
            return ""
        what = ", ".join(f"{name}.{p}" for p in parts)
        return (f"; whole, though its optimizer trains only {what}: the forward runs through the whole model, "
                f"and DDP looks for the parameters a step leaves out (find_unused_parameters=True)")

    # -- the training's calls of a wrapped part go through its wrapper

    def on_visit(self, node: cst.CSTNode) -> bool:
        if node in self._top:
            self._routes = self.statement(node) in self.facts.part_routes
        return super().on_visit(node)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not self._routes:
            return updated
        called = dotted_name(updated.func) or ""
        model, _, part = called.partition(".")
        wrapper = self.facts.part_wraps.get(model, {}).get(part)
        if wrapper is None:
            return updated
        self.note(original, f"{called}(…) → {wrapper}(…): through its DDP wrapper")
        return updated.with_changes(func=cst.Name(wrapper))

    def _wrap_block(self, original: list[cst.BaseStatement], updated: list[cst.BaseStatement], planned) -> list:
        out: list[cst.BaseStatement] = []
        for old, new in zip(original, updated):
            out.append(new)
            names = planned(old)
            if names:
                out += self._wrap(old, names)
        return out

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        for old, new in zip(original.body, updated.body):  # the walk rebuilt them: later rules find them still
            if (stmt := self.statement(old)) is not None:
                self.chunk.statement_of[new] = stmt
        planned = lambda s: self.facts.ddp_wrap_after.get(self.statement(s))  # noqa: E731
        return updated.with_changes(body=self._wrap_block(original.body, updated.body, planned))

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
        if not self.chunk.wraps_inside:  # the facts chose no statement in a block of this chunk
            return updated
        plan = {s: names for s in original.body if (names := self.chunk.wrap_inside(s))}
        if not plan:
            return updated
        return updated.with_changes(body=self._wrap_block(list(original.body), list(updated.body), plan.get))
