"""``JobFacts``: what the rules need to know about the whole notebook; ``Seen``: what the scan met on the way."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..code import Statement


@dataclass
class JobFacts:
    """What the rules need to know about the whole notebook, gathered by ``gather_facts``."""

    trainer_names: set[str] = field(default_factory=set)
    #: functions whose body trains (``loss.backward()``, ``trainer.train()``, or a call to another such function)
    training_functions: set[str] = field(default_factory=set)
    #: functions whose body makes a call every rank must make (training, ``trainer.evaluate()``, …)
    collective_functions: set[str] = field(default_factory=set)
    #: plain PyTorch: names whose parameters an optimizer gets (the models DDP wraps)
    ddp_models: set[str] = field(default_factory=set)
    #: plain PyTorch: a model of ``ddp_models`` → the parts of it an optimizer gets (``mask_decoder`` for
    #: ``Adam(model.mask_decoder.parameters())``): the model is wrapped whole, and ``--explain`` says why,
    #: unless the training calls the parts themselves (``part_wraps``)
    trained_parts: dict[str, set[str]] = field(default_factory=dict)
    #: plain PyTorch: a model of ``trained_parts`` whose training calls those parts and never the model
    #: (``sam_model.mask_decoder(emb)``) → each part DDP wraps instead → its wrapper's name (``parts.py``)
    part_wraps: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the top-level statements whose calls of a part of ``part_wraps`` go through its wrapper: the training
    #: statements and the definitions of the functions they call
    part_routes: set[Statement] = field(default_factory=set)
    #: plain PyTorch: names bound to an optimizer (``optimizer = torch.optim.Adam(model.parameters())``)
    optimizers: set[str] = field(default_factory=set)
    #: plain PyTorch: names bound to a DataLoader that gets a DistributedSampler
    sharded_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: names bound only to ``len(<loader>)`` of one of ``sharded_loaders`` (``n_batches =
    #: len(train_loader)``) → that loader: a count of each rank's own batches once it is sharded
    loader_lengths: dict[str, str] = field(default_factory=dict)
    #: plain PyTorch: training loaders a helper of the notebook's imports returns (``create_dataloader(…)``)
    helper_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: training loaders handed to an imported training helper (``engine.train(…,
    #: train_dataloader=train_dataloader)``), sharded as the call is made
    helper_training_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch, where ``helper_training_loaders`` is not empty: (cell position, line, column in
    #: characters) of each call to an imported training helper (``training.is_helper_training``), function
    #: bodies included: the calls whose training loaders go in sharded
    helper_trainings: set[tuple[int, int, int]] = field(default_factory=set)
    #: plain PyTorch: names bound only to a DataLoader that keeps its whole data set on every rank (evaluation)
    whole_loaders: set[str] = field(default_factory=set)
    #: plain PyTorch: names a training loop iterates (``for batch in name``): training loaders, whatever their name
    train_iterated: set[str] = field(default_factory=set)
    #: names imported from ``torch.cuda.amp`` (``autocast``, ``GradScaler``)
    cuda_amp_names: set[str] = field(default_factory=set)
    #: classes the notebook defines (not derived from a library's trainer) → their training methods
    #: (``facts/own_classes.py``); such a class named ``…Trainer`` with training methods holds no trainer of
    #: transformers' (one without, a wrapper around transformers' Trainer, is read as a trainer, as before)
    own_classes: dict[str, frozenset[str]] = field(default_factory=dict)
    #: names bound to an instance of such a class with training methods → the class
    own_instances: dict[str, str] = field(default_factory=dict)
    #: the calls running such a method (``own_classes.OwnTraining``), anywhere: refused before launch
    own_trainings: list = field(default_factory=list)
    #: running-average classes the notebook defines (``AverageMeter``) → what their ``update`` sums and derives
    #: (``facts/meters.MeterShape``)
    meters: dict = field(default_factory=dict)
    #: names bound to an instance of such a class, or of an ``AverageMeter`` the notebook imports, in any scope →
    #: the class (``meters.shape_of``)
    meter_instances: dict[str, str] = field(default_factory=dict)
    #: the notebook distributes itself (its own DistributedDataParallel)
    self_distributed: bool = False
    #: the notebook calls ``nn.DataParallel`` (by any name it binds: ``rules/data_parallel.calls_data_parallel``):
    #: its loaders' batch sizes are what one process split over every GPU, so a rank takes its part of each
    data_parallel: bool = False
    #: names bound to ``Accelerator()``, and the names handed to or bound by their ``prepare(…)``: Accelerate
    #: wraps and shards those; plain loops elsewhere in the notebook are still nbddp's
    accelerators: set[str] = field(default_factory=set)
    accelerate_prepared: set[str] = field(default_factory=set)
    #: names a plain loop trains with before a later ``prepare(…)`` gets them: nbddp distributes them for
    #: those loops, and ``prepare`` gets them as the notebook made them (``_nbddp.for_accelerate``)
    handed_to_accelerate: set[str] = field(default_factory=set)
    #: top-level ``… = accelerator.prepare(…)`` statements → the names they bind (Accelerate's from there on)
    prepare_binds: dict[Statement, set[str]] = field(default_factory=dict)
    #: the notebook trains a PEFT adapter (``get_peft_model``, a trainer's ``peft_config=``, a PEFT loader):
    #: every trainable weight takes part in each step, so DDP need not look for unused ones
    peft: bool = False
    #: a plain PyTorch loop (backward in the notebook's own code, no HF/TRL/Lightning trainer)
    plain_loop: bool = False
    #: top-level statements that train, in notebook order
    training: list[Statement] = field(default_factory=list)
    #: plain PyTorch: top-level statements that train outside function and class bodies (the training loops)
    loops: set[Statement] = field(default_factory=set)
    #: top-level statements after the first training call that run on rank 0 only
    rank0: set[Statement] = field(default_factory=set)
    #: rank-0 statements before the first training call that write files a later statement reads: the other
    #: ranks wait for them (a barrier after, or the wait in ``from_rank0`` for an assigned download, whose names
    #: are in ``rank0_sends``), a subset of ``rank0``
    shared_saves: set[Statement] = field(default_factory=set)
    #: rank-0 statements after the last training call (the tail), a subset of ``rank0``
    tail: set[Statement] = field(default_factory=set)
    #: plain PyTorch: tail statements that open a rank-0 block → the DDP models it unwraps first (the first
    #: block of the tail, and a later one where a statement since rebinds the model)
    tail_unwraps: dict[Statement, list[str]] = field(default_factory=dict)
    #: statements after training that stay on every rank, with the reason (said in --explain)
    all_ranks: dict[Statement, str] = field(default_factory=dict)
    #: in the body of a function or method that trains (not a plain loop's: ``LoopOutputRule`` prints and saves
    #: there): (cell position, line) of each statement after its training call that saves, pushes, generates,
    #: prints or plots, run on rank 0 only → the function's name
    rank0_inside: dict[tuple[int, int], str] = field(default_factory=dict)
    #: such statements that stay on every rank (a collective in them, or a name every-rank code reads) → why
    all_ranks_inside: dict[tuple[int, int], str] = field(default_factory=dict)
    #: top-level statements holding a statement of ``rank0_inside`` or ``all_ranks_inside``
    rank0_holders: set[Statement] = field(default_factory=set)
    #: names the notebook's top-level code binds (not functions' or classes' own names)
    module_names: set[str] = field(default_factory=set)
    #: top-level dataset preparation run under ``main_process_first``
    main_first: set[Statement] = field(default_factory=set)
    #: a kept job's ``%%ddp`` cell, by its position among the converted cells (``kept/cell.py``): its statements
    #: run on every rank but those that write files or push (``facts/kept.py``); None in a job's script
    kept_cell: int | None = None
    #: rank-0 statements (a subset of ``rank0``) whose names every rank needs → the names each binds, sent from
    #: rank 0 to the others as its block ends (``runtime/from_rank0.py``): a kept cell's writes, a download's path
    rank0_sends: dict[Statement, list[str]] = field(default_factory=dict)
    #: the kept cell's statements whose values may differ between ranks, or that write on every rank → what is said
    kept_notes: dict[Statement, str] = field(default_factory=dict)
    #: a kept job's own script (``%%ddp_train --keep``): its statements after the last training follow the kept
    #: cell's rule too, since later cells run on every rank
    kept_tail: bool = False
    #: a plain loop's DDP models the kept rank-0 blocks see unwrapped, wrapped again as each block ends
    kept_unwraps: list[str] = field(default_factory=list)
    #: top-level statement → model names wrapped in DDP right after it
    ddp_wrap_after: dict[Statement, list[str]] = field(default_factory=dict)
    #: plain PyTorch, inside a function or loop that builds and trains: (cell position, line of the statement
    #: that makes or moves the model) → model names wrapped in DDP right after it
    ddp_wrap_inside: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    #: top-level statements holding a statement of ``ddp_wrap_inside``
    ddp_wraps_inside: set[Statement] = field(default_factory=set)
    #: plain PyTorch, a wrapped model: (cell position, line) of each ``torch.save(model, …)`` that pickles it
    #: whole, and of each call of it (``model(…)``, ``model.generate(…)``) in a statement that runs on rank 0
    #: alone; both need a whole replica, which FSDP's shards are not (``choose_strategy.refuse_what_it_cannot_run``)
    #: every ``torch.save(model, …)`` (or ``obj=model``) of a model DDP wraps, by place (cell position, line,
    #: column in characters): the unwrap rule saves the module inside there, and under FSDP it is refused
    model_saves: set[tuple[int, int, int]] = field(default_factory=set)
    #: a notebook that trains nowhere: the top-level statements holding a prediction loop each rank takes its
    #: share of (``predicts.py``), and why any such loop cannot be split (``predicts.PredictRefusal``)
    predictions: list[Statement] = field(default_factory=list)
    predict_refusals: list = field(default_factory=list)
    #: where nothing else predicts, a pipeline's call over rows that cannot be split (not assigned on its own, a
    #: generator or dataset given, sampling): refused unless the notebook trains from a shell line or seems to
    #: train (``rules/predict.refuse_batched``); the calls that split are ``predicts.split_calls``'s
    batched_calls: list = field(default_factory=list)
    #: top-level functions whose body holds a prediction loop, split each time they are called
    predict_functions: frozenset[str] = frozenset()
    #: plain loops that train on a whole tensor at every step (no batches to share out): where each is refused,
    #: as (cell position, line of its cleaned code, the tensor names it feeds whole) (``facts/index_loops.py``)
    full_batch_loops: list = field(default_factory=list)
    #: what a rule reads across the cells of this conversion, by the rule's name (the planner asks a rule about
    #: the cells in order, so a rule can follow the names bound above a call: ``data_parallel``, ``full_batch``)
    rule_state: dict[str, object] = field(default_factory=dict)
    whole_model_saves: list[tuple[int, int]] = field(default_factory=list)
    rank0_forwards: list[tuple[int, int]] = field(default_factory=list)

    @property
    def wrapped_whole(self) -> set[str]:
        """The models of ``ddp_models`` that DDP wraps whole (not those whose parts it wraps, ``part_wraps``):
        the names saving, loading and rank-0 code unwrap."""
        return self.ddp_models - self.part_wraps.keys()

    @property
    def last_training(self) -> Statement | None:
        return self.training[-1] if self.training else None


@dataclass
class Seen:
    """What the scan met that is judged once the training functions are known."""

    #: ``DataLoader(…)`` assignments: (own sampler, shuffles, target names)
    loaders: list = field(default_factory=list)
    #: ``names = function(…)``: (target names, the call)
    assigned: list = field(default_factory=list)
    #: ``for … in name``: (name, the loop)
    fors: list = field(default_factory=list)
    #: ``targets = owner.prepare(…)``: (the call, the names it binds, the top-level statement)
    prepared: list = field(default_factory=list)
