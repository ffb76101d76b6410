"""Training nbddp does not distribute, refused before launch with what to do instead.

nbddp starts one PyTorch process per GPU with torchrun and makes a notebook's PyTorch training share the
work. Training in another framework, or in one that starts and syncs its own processes, would run whole on
every rank: each rank trains the full data set alone (TensorFlow/Keras, JAX), fails on its framework's own
terms (PyTorch Lightning), or trains with the wrong privacy accounting (Opacus without its ``DPDDP``). Each
is found in the cleaned cells' ast and refused at its cell and line (``check_frameworks``), before any
process starts:

- **TensorFlow/Keras** (``model.fit`` of a compiled Keras model, Hugging Face's ``TFTrainer``) and **JAX**
  (``jax.grad``/``value_and_grad``, a Flax ``apply_gradients``): these use every GPU from one process
  (``tf.distribute.MirroredStrategy``; ``jax.pmap`` or a ``jax.sharding.Mesh``); torchrun's ranks cannot.
- **PyTorch Lightning** (``Trainer(…)`` of ``pytorch_lightning``/``lightning``): refused, with Lightning's own
  recipe (``strategy="ddp_notebook"`` in the kernel). Under torchrun Lightning reads ``WORLD_SIZE`` and
  refuses to start unless ``devices × num_nodes`` equals it; rewriting ``devices`` would not be enough, since
  notebooks written for ``gpus=`` carry other arguments Lightning 2 removed (``progress_bar_refresh_rate``,
  ``auto_lr_find``), and Lightning already shards, wraps and logs on rank 0 itself: nbddp would only add a
  second launcher around its own.
- **Opacus** (``make_private``): run as written where the notebook wraps its model in Opacus's
  ``DifferentiallyPrivateDistributedDataParallel`` (``DPDDP``) itself, before ``make_private``: the notebook
  is then one that distributes itself, so nbddp neither wraps the model nor shards the loader that
  ``make_private`` replaces with its own distributed Poisson sampler (the facts' ``self_distributed``).
  Without ``DPDDP``, refused at ``make_private`` with that fix: nbddp's plain DDP around the
  ``GradSampleModule`` would average gradients Opacus already clipped and noised per rank, and its sampler
  would make Opacus account the privacy budget on one rank's share.

- **TPU** (a call through ``torch_xla``: ``xm.xla_device()``, ``xmp.spawn``): nbddp runs on GPUs; refused at
  that call, with the GPU accelerator to pick (an optional ``import torch_xla`` alone is no refusal, nor a call
  in a branch the notebook's device setting chooses, ``if CFG['device'] == 'TPU':``: its GPU setting runs the
  other branch).
- **fastai** (``learn.fine_tune``, ``fit_one_cycle``, a learner's ``fit``) without fastai's own
  ``distrib_ctx``: fastai's Learner builds its own loaders and loop, which nbddp's rules do not reach, so
  every rank would train alone on the whole data; refused with fastai's in-notebook recipe.
- **RapidFire AI** (``run_fit``) schedules its own runs over the GPUs; **axolotl** called in-process
  (``do_cli``, ``do_train``, ``train`` imported from ``axolotl``) starts its training where its launcher
  would have made the processes: refused with its launch line, which nbddp runs on every GPU.
- **vLLM** (its ``LLM(…)`` engine, or ``LLMEngine.from_engine_args``): not training, but an engine that takes
  every GPU it is given from one process (``tensor_parallel_size``); as DDP ranks each rank would start its own
  engine over every GPU (or, in a prediction loop, split the prompts between engines that fight over the same
  GPUs). Refused at that call with vLLM's own recipe: run the notebook as it is with
  ``tensor_parallel_size=2``, or one ``LLM`` per GPU in a process of its own. Not where the call runs after the
  notebook's last training statement as the planner finds it (a trainer's ``.train()``, ``unsloth_train``, a loop
  with ``backward``, a call of a function that trains; for a call inside a function, where it is called): code
  there runs on rank 0 alone, as TRL's notebooks try their merged model after training.

A notebook that imports none of these costs a few substring tests: the walk runs only where a cell names one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property

from .ast_helpers import dotted_name, last_name
from .clean import CleanCell
from .code import CellCode, Statement
from .facts import gather_facts
from .refusal import refuse_at

#: Words one of whose presence in a cell's text makes the check walk the notebook.
_MARKERS = ("tensorflow", "keras", "jax", "flax", "lightning", "make_private", "TFTrainer", "torch_xla", "fastai",
            "rapidfireai", "axolotl", "vllm")
_TF_MODULES = ("tensorflow", "keras", "tf_keras")
_JAX_MODULES = ("jax", "flax", "optax")
_LIGHTNING_MODULES = ("pytorch_lightning", "lightning")

_TF_FIX = ("TensorFlow/Keras training is not distributed by nbddp, which starts PyTorch processes with "
           "torchrun: every rank would train on the whole data set alone. Run this notebook in its kernel, "
           "where TensorFlow uses every GPU of one process: build and compile the model under "
           "`strategy = tf.distribute.MirroredStrategy()` with `with strategy.scope(): …`, and model.fit "
           "splits each batch across the GPUs")
_JAX_FIX = ("JAX training is not distributed by nbddp, which starts PyTorch processes with torchrun: every "
            "rank would train alone. Run this notebook in its kernel, where JAX uses every GPU of one process "
            "(jax.pmap over jax.local_devices(), or a jax.sharding.Mesh with the batch sharded over it)")
_LIGHTNING_FIX = ("PyTorch Lightning starts and syncs its own processes: under nbddp's torchrun it refuses "
                  "to start unless devices × num_nodes equals WORLD_SIZE (and `gpus=` is gone since "
                  "Lightning 2.0). Run this notebook in its kernel with Lightning's own recipe: "
                  "Trainer(accelerator=\"gpu\", devices=-1, strategy=\"ddp_notebook\"), or as a script with "
                  "strategy=\"ddp\"")
_OPACUS_FIX = ("Opacus clips and noises each rank's gradients itself, so nbddp's DDP around the private model "
               "would average them wrongly and its sampler would make Opacus count the privacy budget on one "
               "rank's share. Wrap the model in Opacus's own DDP before make_private — `from "
               "opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP`, then "
               "`model = DPDDP(model)` — and pass make_private the whole data set's loader: Opacus then "
               "samples each rank's share and accounts for the whole data, and nbddp leaves both to it")

_TPU_FIX = ("TPU notebooks are out of scope: nbddp runs PyTorch on GPUs (one torchrun process per GPU, NCCL), "
            "and torch_xla's devices and xmp.spawn do not exist there. On Kaggle pick GPU T4×2 as the accelerator, "
            "and write the device as \"cuda\" instead of xm.xla_device() (xm.optimizer_step(opt) → opt.step(), "
            "xmp.spawn(fn, …) → fn(0)); or run the notebook in its TPU kernel as it is")
_FASTAI_FIX = ("fastai's Learner builds its own loaders and training loop, which nbddp does not distribute: every "
               "rank would train alone on the whole data set. Run it in its kernel with fastai's own recipe: "
               "`from fastai.distributed import *` and `from accelerate import notebook_launcher`, then in a "
               "function `with learn.distrib_ctx(in_notebook=True): learn.fine_tune(…)`, started by "
               "`notebook_launcher(fn, num_processes=2)`")
_RAPIDFIRE_FIX = ("RapidFire AI schedules its own training runs over the GPUs from one process: under nbddp every "
                  "rank would start the whole experiment. Run this notebook in its kernel, where RapidFire uses "
                  "every GPU itself")
_AXOLOTL_FIX = ("axolotl called in-process trains in this one process: nbddp does not distribute it (every rank "
                "would train alone). Launch it as axolotl is launched, in a cell of its own: "
                "`!accelerate launch -m axolotl.cli.train cfg.yml` (or `!axolotl train cfg.yml`); nbddp runs that "
                "line on every GPU")
_VLLM_FIX = ("vLLM splits a model over the GPUs itself, from one process: as nbddp's DDP ranks each rank would "
             "start its own vLLM engine over every GPU. Run this notebook as it is, not under nbddp, with "
             "`LLM(model=…, tensor_parallel_size=2)` (or data-parallel: one `LLM` per GPU, each in its own process "
             "with CUDA_VISIBLE_DEVICES set to its GPU); a notebook that also trains: train under nbddp, then "
             "generate with vLLM in a notebook of its own")
#: fastai's Learner methods that train.
_FASTAI_FITS = ("fine_tune", "fit_one_cycle", "fit_flat_cos", "fit_sgdr")
#: fastai's own distributed training: the notebook distributes itself.
_FASTAI_DISTRIBUTED = ("distrib_ctx", "to_distributed", "parallel_ctx")
#: axolotl's in-process entry points.
_AXOLOTL_TRAINS = ("do_cli", "do_train", "train")
#: vLLM's calls that start an engine on the GPUs (``LLM(…)``, ``LLMEngine.from_engine_args(…)``).
_VLLM_ENGINES = ("LLM", "from_engine_args")


#: What a test choosing the device by configuration names (``CFG['device'] == 'TPU'``, ``if use_tpu:``).
_DEVICE_WORDS = ("tpu", "xla", "gpu", "cuda")


def _under_device_choice(tree: ast.AST):
    """The nodes in either branch of an ``if`` (or ``… if … else …``) whose test chooses the device
    (``CFG['device'] == 'TPU'``, ``torch.cuda.is_available()``): a notebook written for TPU and GPU alike, whose
    torch_xla calls its GPU configuration never makes."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and _chooses_device(node.test):
            branches = [node.body, node.orelse] if isinstance(node, ast.IfExp) else [*node.body, *node.orelse]
            for branch in branches:
                yield from ast.walk(branch)


def _chooses_device(test: ast.expr) -> bool:
    for n in ast.walk(test):
        word = (n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else
                n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else "")
        if any(w in word.lower() for w in _DEVICE_WORDS) or word == "is_available":
            return True
    return False


@dataclass(frozen=True)
class _Found:
    position: int  #: the cell's position among the cleaned cells
    line: int  #: line of the cleaned code
    message: str


def check_frameworks(cleaned: list[CleanCell], codes: list[CellCode], kept: bool = False) -> None:
    """Raise ``CellError`` at the first training nbddp does not distribute (see the module's docstring).
    ``kept``: a kept job's cells, whose code after training runs on every rank, not on rank 0 alone."""
    if not any(marker in clean.code for clean in cleaned for marker in _MARKERS):
        return
    found = _Walk(codes, kept).first()
    if found is None:
        return
    refuse_at(found.position, found.line, cleaned, found.message)


class _Walk:
    """One pass over the notebook's cells in order: the frameworks imported, then their training calls."""

    def __init__(self, codes: list[CellCode], kept: bool = False):
        self.codes = codes
        self.kept = kept  # code after training runs on every rank (a kept job): no call is rank 0's alone
        self.imported: set[str] = set()  # the top-level modules of _TF/_JAX/_LIGHTNING imported
        self.lightning: set[str] = set()  # names bound to Lightning's modules or to its Trainer
        self.jax_names: set[str] = set()  # ``grad``/``value_and_grad`` imported from jax by name
        self.keras_models: set[str] = set()  # names whose .compile(…) was called (a Keras model)
        self.dpddp = False
        self.bound: dict[str, str] = {}  # a name an import binds → the top-level module it comes from
        self.vllm_engines: set[str] = set()  # names ``from vllm import LLM [as X]`` binds
        self.learners: set[str] = set()  # names bound to a fastai learner (``vision_learner(…)``, ``Learner(…)``)
        self.fastai_distributed = False  # fastai's own ``distrib_ctx``/``to_distributed`` used

    def first(self) -> _Found | None:
        for code in self.codes:
            for node in ast.walk(code.tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    self._imports(node)
                    self._binds(node)
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    made = last_name(node.value.func) or ""
                    if made == "Learner" or made.endswith("_learner"):
                        self.learners.update(t.id for t in node.targets if isinstance(t, ast.Name))
        calls = [(code.position, node) for code in self.codes for node in ast.walk(code.tree)
                 if isinstance(node, ast.Call)]
        self.device_chosen = {id(n) for code in self.codes for n in _under_device_choice(code.tree)}
        for _, call in calls:
            self._note(call)
        found = [f for position, call in calls if (f := self._judge(position, call)) is not None]
        return min(found, key=lambda f: (f.position, f.line), default=None)

    def _imports(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                self.imported.add(top)
                if top in _LIGHTNING_MODULES:
                    self.lightning.add(alias.asname or top)
        elif node.module:
            top = node.module.split(".")[0]
            self.imported.add(top)
            if top in _LIGHTNING_MODULES:
                self.lightning.update(a.asname or a.name for a in node.names)
            if top == "jax":
                self.jax_names.update(a.asname or a.name for a in node.names if a.name in ("grad", "value_and_grad"))
            if top == "transformers" and any(a.name.startswith("TF") for a in node.names):
                self.imported.add("tensorflow")  # Hugging Face's TF classes bring TensorFlow

    def _binds(self, node: ast.Import | ast.ImportFrom) -> None:
        """The names an import binds, each with its top-level module (``xm`` → ``torch_xla``)."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.bound[alias.asname or alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif node.module:
            self.bound.update((a.asname or a.name, node.module.split(".")[0]) for a in node.names)
            if node.module.split(".")[0] == "vllm":
                self.vllm_engines.update(a.asname or a.name for a in node.names if a.name == "LLM")

    def _from(self, call: ast.Call) -> str | None:
        """The top-level module of the imported name a call starts from (``xm.xla_device()`` → ``torch_xla``)."""
        root = call.func
        while isinstance(root, ast.Attribute):
            root = root.value
        return self.bound.get(root.id) if isinstance(root, ast.Name) else None

    def _note(self, call: ast.Call) -> None:
        """What the judging needs from every call first: the Keras models compiled, Opacus's DDP used."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "compile" and isinstance(func.value, ast.Name):
            self.keras_models.add(func.value.id)
        if last_name(func) in ("DPDDP", "DifferentiallyPrivateDistributedDataParallel"):
            self.dpddp = True
        if last_name(func) in _FASTAI_DISTRIBUTED:
            self.fastai_distributed = True

    def _after_training(self, position: int, call: ast.Call) -> bool:
        """Whether the call runs on rank 0 alone: every top-level statement that runs it (the one holding it; for
        a call in a function defined at the top level, those calling the function, where any does) comes after
        the notebook's last training statement, the planner's own (``JobFacts.training``)."""
        if self.kept:
            return False
        top, last = self._planned
        if last is None:
            return False
        held = next((s for s in top if s.cell.position == position
                     and s.first <= call.lineno <= max(n.end_lineno or n.lineno for n in s.nodes)), None)
        if held is None:
            return False
        defined = {n.name for n in held.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        callers = [s for s in top if defined and any(isinstance(c.func, ast.Name) and c.func.id in defined
                                                     for c in s.calls)]
        return all(top.index(s) > last for s in callers or [held])  # Statement compares by identity

    @cached_property
    def _planned(self) -> tuple[list[Statement], int | None]:
        """The notebook's top-level statements and the index of its last training one (None: it does not train),
        from the facts the planner will gather, on a copy of the cells (gathering fills their statements in)."""
        codes = [CellCode.read(code.code, position=code.position) for code in self.codes]
        facts = gather_facts(codes)
        top = [s for code in codes for s in code.statements]
        return top, next((i for i, s in enumerate(top) if s is facts.last_training), None)

    def _judge(self, position: int, call: ast.Call) -> _Found | None:
        name, attr = dotted_name(call.func) or "", last_name(call.func)
        if self.imported.intersection(_TF_MODULES):
            owner = call.func.value if isinstance(call.func, ast.Attribute) else None
            if attr in ("TFTrainer", "apply_gradients") or (
                attr == "fit" and isinstance(owner, ast.Name) and owner.id in self.keras_models
            ):  # Keras' fit, HF's TFTrainer, a GradientTape loop's optimizer step
                return _Found(position, call.lineno, _TF_FIX)
        if self.imported.intersection(_JAX_MODULES) and (
            name in ("jax.grad", "jax.value_and_grad") or name in self.jax_names or attr == "apply_gradients"
        ):
            return _Found(position, call.lineno, _JAX_FIX)
        if self.lightning and attr == "Trainer" and (name.split(".")[0] in self.lightning):
            return _Found(position, call.lineno, _LIGHTNING_FIX)
        if attr in ("make_private", "make_private_with_epsilon") and not self.dpddp:
            return _Found(position, call.lineno, _OPACUS_FIX)
        return self._judge_others(position, call, attr)

    def _judge_others(self, position: int, call: ast.Call, attr: str | None) -> _Found | None:
        """TPU, fastai, RapidFire AI, axolotl in-process, vLLM."""
        origin = self._from(call)
        if origin == "vllm" and (attr in _VLLM_ENGINES or attr in self.vllm_engines) \
                and not self._after_training(position, call):
            return _Found(position, call.lineno, _VLLM_FIX)
        if origin == "torch_xla" and id(call) not in self.device_chosen:
            return _Found(position, call.lineno, _TPU_FIX)
        if "fastai" in self.imported and not self.fastai_distributed and isinstance(call.func, ast.Attribute) and (
            attr in _FASTAI_FITS or attr == "fit" and isinstance(call.func.value, ast.Name)
                and call.func.value.id in self.learners
        ):
            return _Found(position, call.lineno, _FASTAI_FIX)
        if "rapidfireai" in self.imported and attr == "run_fit":
            return _Found(position, call.lineno, _RAPIDFIRE_FIX)
        if origin == "axolotl" and attr in _AXOLOTL_TRAINS:
            return _Found(position, call.lineno, _AXOLOTL_FIX)
        return None
