"""DDP × gradient checkpointing cases, run one after another in one launch (tests/test_grad_ckpt.py).

CASES: the case names, comma-separated, in order. Each case builds its own model and DDP wrapper, prints
``CASE <name>`` before it starts and ``CASE <name> OK`` or ``CASE <name> ERROR: <message>`` after it. Every
rank fails a failing case at the same point, so the ranks go on to the next case together. The last case's
error is not caught: it ends the job, so its error record is the launcher's (as a single-case job's would be).

Loop cases: a hand-written DDP loop over the tiny Llama with LoRA (frozen base), 4 steps; trainer cases: the HF
Trainer on it (a PeftModel, so the Trainer picks find_unused_parameters=True), checkpointing on, 3 steps.
"""

import contextlib
import functools
import gc
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nbddp.runtime as rt

device = rt.setup().device
# Unsloth must be imported before transformers, TRL and PEFT: nbddp's setup imports none of them
# (tests/test_grad_ckpt.py holds it for tests/test_shims_compat.py), and the metrics callback comes with the
# notebook's own import of the Trainer.
import sys  # noqa: E402

rt.print0("imported by setup:", sorted(m for m in ("transformers", "trl", "peft", "xformers", "unsloth")
                                       if m in sys.modules), flush=True)
import transformers.trainer  # noqa: E402

rt.print0("metrics callback:", any(getattr(cb, "_nbddp", False) for cb in transformers.trainer.DEFAULT_CALLBACKS),
          flush=True)

from peft import LoraConfig, get_peft_model  # noqa: E402
from tiny_lora import tokenizer_model_data  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from nbddp import demo  # noqa: E402
from nbddp.runtime import settings  # noqa: E402


def say_ddp(ddp):
    rt.print0(f"ddp: find_unused_parameters={ddp.find_unused_parameters} static_graph={ddp.static_graph}", flush=True)


def loop(ckpt, reentrant=False, find_unused=False, static=False, vary=False, accum=1, steps=4):
    """ckpt: "hf" (transformers' default), "empty" (an empty kwargs dict, as PEFT's
    prepare_model_for_kbit_training passes: torch's default, reentrant), "direct" (the layers wrapped by hand in
    torch.utils.checkpoint, with use_reentrant=True if ``reentrant``, else without it). ``vary``: one layer's
    adapter is skipped on odd steps, so the parameters used change between steps."""
    model = AutoModelForCausalLM.from_pretrained(demo.tiny_model(), dtype=torch.float32).to(device)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    if ckpt in ("hf", "empty"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"hf": None, "empty": {}}[ckpt])
        model.enable_input_require_grads()
    elif ckpt == "direct":
        from torch.utils.checkpoint import checkpoint

        kwargs = {"use_reentrant": True} if reentrant else {}

        def checkpointed(forward):
            return lambda *args, **kw: checkpoint(functools.partial(forward, **kw), *args, **kwargs)

        for layer in model.base_model.model.model.layers:
            layer.forward = checkpointed(layer.forward)
        model.enable_input_require_grads()
    model.train()
    ddp = DDP(model, find_unused_parameters=find_unused, static_graph=static)
    say_ddp(ddp)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    varying = model.base_model.model.model.layers[1].self_attn.q_proj
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for step in range(steps):
        if vary:
            varying._disable_adapters = step % 2 == 1
        for micro in range(accum):
            ids = torch.randint(4, 40, (2, 12), generator=gen).to(device)
            with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = ddp(input_ids=ids, labels=ids).loss / accum
                loss.backward()
        opt.step()
        opt.zero_grad()
        rt.print0(f"step {step} loss {loss.item():.4f}", flush=True)


def trainer(reentrant=False, static=None, accum=1):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    tokenizer, model, data = tokenizer_model_data()
    args = TrainingArguments(
        output_dir="out", max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=accum,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None,
        ddp_static_graph=static, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    job = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    job.train()
    say_ddp(job.model_wrapped)


def forced_static():
    """NBDDP_DDP_STATIC_GRAPH=1 as the rank reads it at setup (the record read again with it set)."""
    os.environ["NBDDP_DDP_STATIC_GRAPH"] = "1"
    settings.load()
    try:
        trainer(reentrant=True)
    finally:
        del os.environ["NBDDP_DDP_STATIC_GRAPH"]
        settings.load()


CASES = {
    "trainer_reentrant": lambda: trainer(reentrant=True),
    "loop_empty": lambda: loop("empty", find_unused=True),
    "loop_direct": lambda: loop("direct", find_unused=True),
    "loop_direct_reentrant": lambda: loop("direct", reentrant=True, find_unused=True),
    "loop_vary_static": lambda: loop("hf", find_unused=True, static=True, vary=True),
    "trainer_static_accum": lambda: trainer(reentrant=True, static=True, accum=2),
    "trainer_forced_static": forced_static,
}

names = os.environ["CASES"].split(",")
for i, name in enumerate(names):
    rt.print0(f"CASE {name}", flush=True)
    try:
        CASES[name]()
    except Exception as error:
        if i == len(names) - 1:
            raise
        rt.print0(f"CASE {name} ERROR: {error}", flush=True)
    else:
        rt.print0(f"CASE {name} OK", flush=True)
    gc.collect()  # this case's DDP wrapper gone before the next (the shim's checks look at the live ones)
rt.print0("JOB OK", flush=True)
rt.cleanup()
