"""In-process tests of the checkpoint wrapper, the DDP patch point and the grad_ckpt decision.

The DDP construction tests use a real one-process gloo group; the end-to-end runs are in test_grad_ckpt.py.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nbddp.runtime import checkpointing, ddp_patch
from nbddp.runtime.checkpointing import CheckpointFacts
from nbddp.runtime import rank, shims
from nbddp.runtime.shims import grad_ckpt


@pytest.fixture
def wrapper():
    """The checkpoint wrapper installed, and torch's function restored afterwards."""
    original = torch.utils.checkpoint.checkpoint
    yield checkpointing
    checkpointing.uninstall()
    assert torch.utils.checkpoint.checkpoint is original


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    ddp_patch.uninstall()


def counted():
    calls = []

    def fn(x, scale=1.0):
        calls.append(1)
        return torch.sin(x) * scale

    return fn, calls


def run_backward(fn, **kwargs):
    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(fn, x, **kwargs).sum().backward()
    return x.grad


# ---- the checkpoint wrapper ---------------------------------------------------------------------------


def test_checkpointing_recomputes_the_forward_in_the_backward(wrapper):
    wrapper.install(non_reentrant_default=True)
    fn, calls = counted()
    assert run_backward(fn, use_reentrant=True) is not None
    assert len(calls) == 2  # forward, and again in the backward


def test_the_escape_hatch_calls_the_function_directly(wrapper):
    wrapper.install(disabled=True)
    fn, calls = counted()
    grad = run_backward(fn, use_reentrant=False, preserve_rng_state=False, scale=2.0)
    assert len(calls) == 1
    assert grad is not None


def test_from_import_bindings_loaded_before_install_are_rebound(wrapper):
    import transformers.modeling_utils as mu

    assert mu.checkpoint is torch.utils.checkpoint.checkpoint
    wrapper.install(non_reentrant_default=True)
    assert mu.checkpoint is checkpointing.checkpoint
    assert torch.utils.checkpoint.checkpoint is checkpointing.checkpoint


def test_an_unspecified_call_runs_non_reentrant(wrapper, monkeypatch):
    seen = []
    wrapper.install(non_reentrant_default=True)
    monkeypatch.setattr(checkpointing, "_original", lambda fn, *a, use_reentrant, **k: seen.append(use_reentrant))
    checkpointing.checkpoint(torch.sin, torch.ones(1))
    checkpointing.checkpoint(torch.sin, torch.ones(1), use_reentrant=True)
    assert seen == [False, True]  # what the caller insists on is kept


def test_reentrant_inputs_get_gradients_so_the_parameters_inside_do(wrapper):
    wrapper.install(non_reentrant_default=True)
    lin = torch.nn.Linear(3, 3)
    frozen_input = torch.randn(2, 3)  # e.g. the output of a frozen embedding
    torch.utils.checkpoint.checkpoint(lin, frozen_input, use_reentrant=True).sum().backward()
    assert lin.weight.grad is not None
    assert not frozen_input.requires_grad  # the caller's tensor is left alone


# ---- reading a model's effective checkpointing -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from nbddp.demo import build_model

    return functools.partial(build_model, seed=0)


@pytest.mark.parametrize(
    "kwargs, installed, reentrant",
    [
        (None, False, False),  # transformers 5 passes use_reentrant=False itself
        ({"use_reentrant": True}, True, True),  # insisted: kept
        ({}, False, True),  # as PEFT's prepare_model_for_kbit_training passes: torch's default, reentrant
        ({}, True, False),  # … which nbddp's wrapper makes non-reentrant
    ],
)
def test_facts_follow_the_effective_reentrancy(wrapper, tiny_llama, kwargs, installed, reentrant):
    if installed:
        wrapper.install(non_reentrant_default=True)
    model = tiny_llama()
    assert not checkpointing.facts(model).active
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    facts = checkpointing.facts(model)
    assert facts.active and facts.layers >= 2
    assert facts.reentrant is reentrant, facts


def test_a_custom_checkpoint_function_counts_as_reentrant(tiny_llama):
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = lambda fn, *a: fn(*a)  # like Unsloth's offloading checkpointer
    facts = checkpointing.facts(model)
    assert facts.reentrant and "custom checkpoint function" in facts.reason


# ---- the decision ------------------------------------------------------------------------------------

NON = CheckpointFacts(layers=2, reentrant=False, source="t", reason="r")
RE = CheckpointFacts(layers=2, reentrant=True, source="t", reason="r")
NONE = CheckpointFacts()


@pytest.mark.parametrize(
    "facts, find_unused, static, accumulation, mode, expected",
    [
        (RE, True, False, 1, "auto", (False, False, True)),  # reentrant: find_unused off, input grads on
        (RE, False, True, 1, "auto", (False, True, True)),  # reentrant + static at accumulation 1: kept
        (RE, False, True, None, "auto", (False, True, True)),  # accumulation unknown: kept
        (RE, True, True, 4, "auto", (False, False, True)),  # accumulation: static off
        (NON, True, True, 1, "auto", (True, False, False)),  # non-reentrant does not need static
        (NON, True, False, 1, "auto", (True, False, False)),  # nothing to change
        (NONE, True, True, 1, "auto", (True, True, False)),  # no checkpointing: the script's choice
        (NONE, False, True, 2, "auto", (False, False, False)),  # … unless accumulation breaks it
        (NON, True, True, 4, "1", (True, True, False)),  # forced on
        (RE, False, False, 1, "1", (False, True, True)),
        (RE, False, True, 1, "0", (False, False, True)),  # forced off
    ],
)
def test_decide(facts, find_unused, static, accumulation, mode, expected):
    s = grad_ckpt.decide(facts, find_unused, static, accumulation, mode)
    assert (s.find_unused_parameters, s.static_graph, s.input_grads) == expected


def test_decide_says_what_it_did_in_plain_words():
    s = grad_ckpt.decide(RE, True, True, 2, "auto")
    assert s.messages[0].startswith("Gradient checkpointing detected")
    assert "find_unused_parameters=False" in s.messages[0]
    assert "gradient accumulation is 2 steps" in s.messages[1]
    assert grad_ckpt.decide(NONE, True, False, 1, "auto").messages == ()


@pytest.mark.parametrize("value, mode", [("", "auto"), ("auto", "auto"), ("1", "1"), ("off", "0"), ("junk", "auto")])
def test_static_graph_mode(monkeypatch, value, mode):
    monkeypatch.setenv("NBDDP_DDP_STATIC_GRAPH", value)
    assert grad_ckpt.static_graph_mode() == mode


# ---- the DDP patch point -----------------------------------------------------------------------------


def test_adjusters_see_effective_arguments_and_hooks_the_instance(process_group):
    seen, built = [], []

    def adjuster(module, kwargs):
        seen.append((module, kwargs["find_unused_parameters"], kwargs["bucket_cap_mb"]))
        return {**kwargs, "find_unused_parameters": True}

    ddp_patch.register_adjuster("test", adjuster)
    ddp_patch.register_hook("test", built.append)
    ddp_patch.register_adjuster("test", adjuster)  # registering again replaces, never stacks
    module = torch.nn.Linear(2, 2)
    wrapped = DDP(module, None, None, 0, bucket_cap_mb=10)  # positional arguments too
    assert seen == [(module, False, 10)]
    assert built == [wrapped]
    assert wrapped.find_unused_parameters is True
    ddp_patch.unregister("test")
    assert DDP(module).find_unused_parameters is False and len(seen) == 1 and len(built) == 1


def test_install_wraps_once(process_group):
    assert ddp_patch.install() is True
    assert ddp_patch.install() is False
    ddp_patch.uninstall()
    assert not hasattr(DDP.__init__, "_nbddp_original")


def test_grad_ckpt_adjusts_a_checkpointed_model_at_construction(process_group, wrapper, tiny_llama, monkeypatch):
    monkeypatch.setattr(rank, "_said", set())
    grad_ckpt.apply()
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    wrapped = DDP(model, find_unused_parameters=True, static_graph=False)
    assert wrapped.find_unused_parameters is False
    assert model._require_grads_hooks  # input gradients switched on


# ---- the escape hatch's library patches ---------------------------------------------------------------


def test_use_gradient_checkpointing_is_forced_off_however_it_is_passed():
    import inspect
    import types

    from nbddp.runtime.shims import no_checkpointing

    class FastLanguageModel:  # the shape of Unsloth's loader: static methods taking the keyword
        @staticmethod
        def get_peft_model(model, r=16, use_gradient_checkpointing="unsloth"):
            return use_gradient_checkpointing

    no_checkpointing._patch_unsloth(types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    no_checkpointing._patch_unsloth(types.SimpleNamespace(FastLanguageModel=FastLanguageModel))  # twice: wrapped once
    get = FastLanguageModel.get_peft_model
    assert get(None) is False
    assert get(None, 8, True) is False
    assert get(None, use_gradient_checkpointing="unsloth") is False
    assert isinstance(inspect.getattr_static(FastLanguageModel, "get_peft_model"), staticmethod)
    assert get.__wrapped__.__name__ == "get_peft_model" and not hasattr(get.__wrapped__, "__wrapped__")
