"""Work after training (and saves a later cell reads) on rank 0 only: the rule and where it has work."""

from __future__ import annotations

from ..code import CodeError
from ..cst_helpers import cst, fixed_expression, fixed_statement
from ..engine.rule import BlockRule
from ..facts.rank0 import downloads

#: Guard for code that must run on one process only.
MAIN_PROCESS_EXPR = "_nbddp.on_rank0()"
#: The context of a kept ``%%ddp`` cell's rank-0 block: rank 0's names reach every rank as it ends.
KEPT_EXPR = "_nbddp.from_rank0"


class RankZeroRule(BlockRule):
    """Saving, pushing, generating, printing and plotting after training run on rank 0 only.

    After the last training call notebooks save, push, print statistics and generate; run by every rank
    these would write the same files at once, push twice and print once per GPU. Wrapped in
    ``if _nbddp.on_rank0():`` they happen once. What every rank must still run stays outside: a
    collective such as ``trainer.evaluate()`` or a second ``trainer.train()``, and any statement binding a
    name that such code reads. Between two training calls only the statements that save, print, push,
    generate or plot go under the guard. In a plain PyTorch notebook the tail's first rank-0 block unwraps the
    DDP model, since rank 0 alone cannot run a DDP forward (it would wait for the others); a later block does
    it again only where a statement since rebinds the model (``JobFacts.tail_unwraps``). Before training, a save
    whose files a later statement reads (``save_pretrained("base")``, then ``from_pretrained("base")``) goes
    under the guard too, followed by ``_nbddp.barrier()``: the other ranks read only complete files. A download
    before training assigned to names (``path = wget.download(url)``) goes under the guard inside
    ``with _nbddp.from_rank0(globals(), "path"):`` instead, as a kept cell's write does: the other ranks wait for
    rank 0 there and get the names it bound; so does a whole statement that downloads in a loop or through a
    function of the notebook (``for url in urls: urlretrieve(url, name)``, ``fetch()``), with the names it binds
    or grows. A download rank 0 alone cannot run (a collective beside it, an attribute it sets, a statement that
    trains) is refused before launch at its cell and line, with the fix (``facts/rank0.plan_downloads``).
    """

    # -- where it has work: Python's ast, before libcst reads anything

    name = "rank0"

    @classmethod
    def wanted(cls, cell, facts) -> bool:
        return any(cls.touches(s, facts, None) for s in cell.statements)

    @classmethod
    def touches(cls, stmt, facts, nodes) -> bool:
        return stmt in facts.rank0 or stmt in facts.all_ranks or stmt in facts.kept_notes \
            or stmt in downloads(facts).refused  # the others: a note, or a refusal

    # -- what it does: libcst

    def picks(self, stmt) -> bool:
        return stmt in self.facts.rank0

    def visit_Module(self, node: cst.Module) -> bool:
        for stmt in self.chunk.statements:  # refused before anything is rewritten, at the download's line
            if (refused := downloads(self.facts).refused.get(stmt)) is not None:
                raise CodeError(refused[1], refused[0])
        for stmt in node.body:
            if (reason := self.facts.all_ranks.get(self.statement(stmt))) is not None:
                self.note(stmt, f"stays on every rank: {reason}")
            if (said := self.facts.kept_notes.get(self.statement(stmt))) is not None:
                self.note(stmt, said)
        return False

    def block(self, run):
        if self._sends(run):
            return self._kept_block(run)
        models = self.facts.tail_unwraps.get(self.statement(run[0]), [])
        unwrap = [cst.parse_statement(f"{n} = _nbddp.unwrap({n})\n") for n in models]
        whole = [cst.parse_statement(f"{n} = _nbddp.whole_loader({n})\n") for n in self._sharded_read(run)]
        return cst.If(test=fixed_expression(MAIN_PROCESS_EXPR),
                      body=cst.IndentedBlock(body=unwrap + whole + self.inside(run)))

    def _sharded_read(self, run) -> list[str]:
        """The sharded training loaders a tail block reads (``compute_accuracy(model, train_loader)``): rank 0
        gets each back over its whole data set, as the kernel measured it, not its own share."""
        stmts = [self.statement(s) for s in run]
        if not self.facts.plain_loop or not stmts or stmts[0] not in self.facts.tail:
            return []
        reads = set().union(*(s.reads for s in stmts if s is not None))
        return sorted(reads & (self.facts.sharded_loaders | self.facts.helper_loaders))

    def after(self, run):
        if any(self.statement(s) in self.facts.shared_saves for s in run) and not self._sends(run):
            return [fixed_statement("_nbddp.barrier()  # the other ranks read what rank 0 wrote\n")]
        return []

    def _sends(self, run) -> bool:
        """A block whose names rank 0 sends as it ends (a kept cell's write, an assigned download before
        training): the other ranks wait for that answer, so it needs no barrier after."""
        return any(self.statement(s) in self.facts.rank0_sends for s in run)

    def _before_training(self, run) -> bool:
        """A block before training (``shared_saves``) that sends names: a download's, not a kept cell's."""
        return any(self.statement(s) in self.facts.shared_saves for s in run)

    def _kept_names(self, run) -> list[str]:
        return sorted({n for s in run for n in self.facts.rank0_sends.get(self.statement(s), ())})

    def _kept_block(self, run):
        """A kept ``%%ddp`` cell's write, or a download before training assigned to names: rank 0 runs it, and as
        the block ends the names it binds (or its error) reach every rank (``runtime/from_rank0.py``), so the
        next cell finds them on every rank."""
        names = self._kept_names(run)
        sent = f"; {', '.join(names)} sent to every rank" if names else ""
        guard = cst.If(test=fixed_expression(MAIN_PROCESS_EXPR), body=cst.IndentedBlock(body=self.inside(run)))
        download = self._before_training(run)
        unwraps = [] if download else self.facts.kept_unwraps  # before training nothing is wrapped yet
        context = ", ".join(["globals()", *(repr(n) for n in names)]
                            + ([f"unwrapped={tuple(unwraps)!r}"] if unwraps else []))
        what = "downloads" if download else "writes or pushes"
        header = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "),
                                        comment=cst.Comment(f"# [nbddp] it {what}: once, on rank 0{sent}"))
        return cst.With(items=[cst.WithItem(item=fixed_expression(f"{KEPT_EXPR}({context})"))],
                        body=cst.IndentedBlock(body=[guard], header=header))

    def message(self, run) -> str:
        if self._sends(run) and self._before_training(run):
            names = ", ".join(self._kept_names(run))
            how = next((h for s in run if (h := downloads(self.facts).how.get(self.statement(s)))), None)
            return (f"runs on rank 0 only, once as in the kernel{f' ({how})' if how else ''}; the other ranks wait "
                    f"for it{f', then get {names} from rank 0' if names else ''} (what it downloads is whole before "
                    "any rank goes on)")
        if self._sends(run):
            names = self._kept_names(run)
            sent = f", then {', '.join(names)} sent from rank 0 to every rank" if names else ""
            return (f"runs on rank 0 only, as it writes or pushes{sent} (in a kept job the other statements run on "
                    "every rank)")
        if any(self.statement(s) in self.facts.shared_saves for s in run):
            return "runs on rank 0 only, once as in the kernel, and every rank waits for it (what it writes, downloads " \
                   "or installs is whole before any rank goes on)"
        tail = self.statement(run[0]) in self.facts.tail
        whole = "".join(f"; {n}: its whole data set again, not rank 0's share" for n in self._sharded_read(run))
        if not self.facts.training:  # a notebook that only predicts
            return "runs on rank 0 only (after the predictions, which every rank gathered)" + whole
        return "runs on rank 0 only (" + ("after training)" if tail else "between training runs)") + whole
