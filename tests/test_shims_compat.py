"""The compatibility shims, each shown failing without its repair first, then repaired."""

import dataclasses
import importlib.util
import inspect
import sys
import textwrap
import warnings

import pytest
import torch

from nbddp.runtime import rank, shims
from nbddp.runtime import patching
from nbddp.runtime.shims import cuda_amp, peft_kwargs, precision, xformers_bias
from nbddp.runtime.shims import unsloth as unsloth_shim


def restore_after(monkeypatch, owner, *names):
    """Have monkeypatch put ``owner``'s attributes back after the test, so a shim's patch stays in it."""
    for name in names:
        if name in vars(owner):
            monkeypatch.setattr(owner, name, inspect.getattr_static(owner, name))


def apply(name):
    """Apply one shim the way ``setup()`` does; return its report."""
    lines = []
    (report,) = shims.apply_all(log=lines.append, names=(name,))
    assert report.applied, report
    assert lines == [f"nbddp: {report.message}"]
    return report


# ---------------------------------------------------------------- PEFT keyword drift


@pytest.fixture
def peft_restored(monkeypatch):
    peft = pytest.importorskip("peft")
    for obj in vars(peft).values():
        if isinstance(obj, type) and issubclass(obj, peft.PeftConfig):
            restore_after(monkeypatch, obj, "__init__")
    return peft


def test_peft_rejects_a_keyword_from_another_release_without_the_shim(peft_restored):
    # merge_weights was a LoraConfig field in PEFT 0.2; the installed PEFT has none.
    with pytest.raises(TypeError, match="unexpected keyword argument 'merge_weights'"):
        peft_restored.LoraConfig(r=8, merge_weights=True)


def test_peft_shim_drops_unknown_keywords_with_one_warning(peft_restored):
    apply("peft_kwargs")
    with pytest.warns(UserWarning) as caught:
        config = peft_restored.LoraConfig(r=8, lora_alpha=32, merge_weights=True, enable_lora=[True])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "merge_weights" in message and "enable_lora" in message and "LoraConfig" in message
    assert caught[0].filename == __file__  # points at the user's line, not at the shim
    assert (config.r, config.lora_alpha) == (8, 32)
    # every adapter config, not only LoRA; and the signature PEFT itself inspects is the real one
    with pytest.warns(UserWarning, match="merge_weights"):
        peft_restored.IA3Config(merge_weights=True)
    assert "lora_alpha" in inspect.signature(peft_restored.LoraConfig).parameters


def test_peft_shim_keeps_known_keywords_silent_and_applies_once(peft_restored):
    apply("peft_kwargs")
    assert peft_kwargs.patch(peft_restored) == 0  # a second application wraps nothing twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # ensure_weight_tying is known to the installed PEFT (it came in 0.18): passed through, no warning
        config = peft_restored.LoraConfig(r=4, ensure_weight_tying=True)
    assert config.ensure_weight_tying is True


# ---------------------------------------------------------------- torch.cuda.amp


@pytest.fixture
def amp_restored(monkeypatch):
    import torch.cuda.amp.autocast_mode
    import torch.cuda.amp.grad_scaler

    for module in (torch.cuda.amp, torch.cuda.amp.autocast_mode, torch.cuda.amp.grad_scaler):
        restore_after(monkeypatch, module, *cuda_amp.REPLACEMENTS)


def test_cuda_amp_autocast_warns_without_the_shim(amp_restored):
    assert cuda_amp.detect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(FutureWarning, match=r"torch\.cuda\.amp\.autocast"):
            torch.cuda.amp.autocast()
        with pytest.raises(FutureWarning, match=r"torch\.cuda\.amp\.GradScaler"):
            torch.cuda.amp.GradScaler()


def test_cuda_amp_shim_runs_torch_amp_cuda_without_warning(amp_restored):
    apply("cuda_amp")
    assert not cuda_amp.detect()
    from torch.cuda.amp import autocast  # the way old notebooks import it, after setup()

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ctx = autocast(dtype=torch.bfloat16)
        scaler = torch.cuda.amp.GradScaler(init_scale=128.0)

        class Double(torch.autograd.Function):
            @staticmethod
            @torch.cuda.amp.custom_fwd
            def forward(ctx_, x):
                return 2 * x

            @staticmethod
            @torch.cuda.amp.custom_bwd
            def backward(ctx_, grad):
                return 2 * grad

        x = torch.ones(3, requires_grad=True)
        Double.apply(x).sum().backward()

    assert isinstance(ctx, torch.amp.autocast) and isinstance(ctx, torch.cuda.amp.autocast)
    assert (ctx.device, ctx.fast_dtype) == ("cuda", torch.bfloat16)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


# ---------------------------------------------------------------- precision

T4 = precision.Device("cuda", "Tesla T4", 7, 5)
V100 = precision.Device("cuda", "Tesla V100-SXM2-16GB", 7, 0)
A100 = precision.Device("cuda", "NVIDIA A100-SXM4-80GB", 8, 0)
H100 = precision.Device("cuda", "NVIDIA H100 80GB HBM3", 9, 0)
CPU = precision.Device("cpu", "CPU")


@pytest.mark.parametrize(
    "device, asked, used, changed",
    [
        (T4, (True, False), (False, True), True),  # TRL's default bf16 on a T4 → fp16
        (V100, (True, False), (False, True), True),
        (T4, (False, True), (False, True), False),  # fp16 asked on a T4: fine as is
        (T4, (False, False), (False, False), False),
        (A100, (True, False), (True, False), False),  # native bf16 from Ampere on
        (H100, (True, False), (True, False), False),
        (H100, (False, True), (False, True), False),
        (CPU, (True, False), (False, False), True),  # no GPU: fp32
        (CPU, (False, True), (False, False), True),
        (CPU, (False, False), (False, False), False),
    ],
)
def test_precision_decision(device, asked, used, changed):
    choice = precision.decide(device, bf16=asked[0], fp16=asked[1])
    assert (choice.bf16, choice.fp16) == used
    assert (choice.reason is not None) == changed


def test_precision_reason_names_the_gpu():
    assert "Tesla T4 (compute capability 7.5) has no native bf16" in precision.decide(T4, True, False).reason


@pytest.fixture
def training_args_restored(monkeypatch):
    training_args = pytest.importorskip("transformers.training_args")
    restore_after(monkeypatch, training_args.TrainingArguments, "__post_init__")
    monkeypatch.setattr(rank, "_said", set())
    return training_args


def test_trl_default_bf16_fails_on_cpu_without_the_shim(training_args_restored, tmp_path):
    trl = pytest.importorskip("trl")
    assert precision.current_device() == CPU and precision.detect()
    with pytest.raises(ValueError, match="Your setup doesn't support bf16/gpu"):
        trl.SFTConfig(output_dir=str(tmp_path), report_to="none")


def test_precision_shim_trains_trl_configs_in_fp32_on_cpu(training_args_restored, tmp_path, capsys):
    trl = pytest.importorskip("trl")
    apply("precision")
    args = trl.SFTConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.bf16, args.fp16) == (False, False)
    again = training_args_restored.TrainingArguments(output_dir=str(tmp_path), fp16=True, bf16_full_eval=True)
    assert (again.fp16, again.bf16_full_eval) == (False, False)
    out = capsys.readouterr().out
    assert out.count("SFTConfig: no GPU: fp16/bf16 turned off, training in fp32 (bf16=False, fp16=False)") == 1
    assert "TrainingArguments: no GPU" in out


# ---------------------------------------------------------------- xformers attention bias

try:
    import xformers.ops.fmha as fmha
    from xformers.ops.fmha import attn_bias as xbias
    from xformers.ops.fmha.common import Inputs

    XFORMERS_ERROR = None
except Exception as exc:  # not installed, or built for another torch
    XFORMERS_ERROR = f"xformers does not import here ({type(exc).__name__}: {exc}); tests/gpu/xformers_bias.py proves it on GPUs"

needs_xformers = pytest.mark.skipif(XFORMERS_ERROR is not None, reason=str(XFORMERS_ERROR))

#: Without two GPUs here, "meta" is the second device: the query lives there, the bias was built on CPU.
SEQLENS = [3, 5]


@pytest.fixture
def xformers_restored(monkeypatch):
    restore_after(monkeypatch, Inputs, "validate_inputs")


def qkv(device):
    shape = (1, sum(SEQLENS), 2, 8)  # one packed batch of two sequences, 2 heads of 8
    return [torch.zeros(shape, device=device) for _ in range(3)]


@needs_xformers
def test_xformers_rejects_a_bias_on_another_device_without_the_shim(xformers_restored):
    bias = xbias.BlockDiagonalCausalMask.from_seqlens(SEQLENS)
    with pytest.raises(ValueError, match="Attention bias and Query/Key/Value should be on the same device"):
        fmha.memory_efficient_attention(*qkv("meta"), attn_bias=bias)


@needs_xformers
def test_xformers_shim_moves_the_bias_to_the_query_device(xformers_restored):
    apply("xformers_bias")
    bias = xbias.BlockDiagonalCausalMask.from_seqlens(SEQLENS)
    inp = Inputs(*qkv("meta"), attn_bias=bias)
    inp.validate_inputs()
    moved = inp.attn_bias
    assert type(moved) is xbias.BlockDiagonalCausalMask  # still causal
    assert moved.q_seqinfo.seqstart.device.type == moved.k_seqinfo.seqstart.device.type == "meta"
    assert moved.q_seqinfo.seqstart_py == [0, 3, 8]
    assert bias.q_seqinfo.seqstart.device.type == "cpu"  # the caller's bias is left as it was
    # through the public call, the device check now passes; what stops it is that no CPU/meta kernel exists
    with pytest.raises(NotImplementedError, match="No operator found"):
        fmha.memory_efficient_attention(*qkv("meta"), attn_bias=bias)


@needs_xformers
@pytest.mark.parametrize(
    "make",
    [
        lambda: xbias.BlockDiagonalMask.from_seqlens(SEQLENS).make_local_attention(2),
        lambda: xbias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=SEQLENS, kv_padding=8, kv_seqlen=SEQLENS),
    ],
)
def test_xformers_bias_keeps_its_class_and_settings(make):
    bias = make()
    moved = xformers_bias.on_device(bias, torch.device("meta"))
    assert type(moved) is type(bias)
    for field in dataclasses.fields(bias):
        before, after = getattr(bias, field.name), getattr(moved, field.name)
        if not dataclasses.is_dataclass(before) and not isinstance(before, torch.Tensor):
            assert after == before
    assert moved.k_seqinfo.seqstart.device.type == "meta"


# ---------------------------------------------------------------- Unsloth

FAKE_UNSLOTH = '''
"""Stands in for Unsloth's loader API: from_pretrained echoes what it was given."""

class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, max_seq_length=None, dtype=None, load_in_4bit=True,
                        token=None, device_map="sequential", **kwargs):
        return {"model_name": model_name, "device_map": device_map}


class FastModel:
    @staticmethod
    def from_pretrained(model_name, **kwargs):
        return {"model_name": model_name, "device_map": kwargs.get("device_map", "sequential")}
'''


@pytest.fixture
def fake_unsloth(tmp_path, monkeypatch):
    """An importable ``unsloth`` package on sys.path, gone after the test."""
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text(textwrap.dedent(FAKE_UNSLOTH))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    yield
    sys.modules.pop("unsloth", None)


@pytest.fixture
def rank_one_of_four(monkeypatch):
    """This process as local rank 1 of a 2×2-GPU job."""
    monkeypatch.setattr(rank, "_info", rank.RankInfo(rank=3, local_rank=1, world_size=4, backend="nccl", device="cuda:1"))


def test_unsloth_absent_is_silent():
    if importlib.util.find_spec("unsloth") is not None:
        pytest.skip("Unsloth is installed here; this test is about its absence")
    lines = []
    (report,) = shims.apply_all(log=lines.append, names=("unsloth",))
    assert (report.applied, report.reason, lines) == (False, "not needed", [])
    assert "unsloth" not in sys.modules


def test_unsloth_loads_every_rank_on_its_default_map_without_the_shim(fake_unsloth, rank_one_of_four):
    import unsloth

    assert unsloth.FastLanguageModel.from_pretrained("m")["device_map"] == "sequential"


def test_unsloth_shim_gives_loaders_the_rank_device_map(fake_unsloth, rank_one_of_four):
    apply("unsloth")  # before the notebook imports Unsloth: patched on import
    assert "unsloth" not in sys.modules
    import unsloth

    load = unsloth.FastLanguageModel.from_pretrained
    assert load("m")["device_map"] == {"": 1}
    assert load("m", device_map="auto")["device_map"] == {"": 1}
    assert load("m", 2048, None, True, None, "balanced")["device_map"] == {"": 1}  # positional too
    assert load("m", device_map={"": "cuda:0"})["device_map"] == {"": "cuda:0"}  # the notebook's own map stays
    assert load("m", device_map=torch.device("cuda", 0))["device_map"] == torch.device("cuda", 0)
    assert unsloth.FastModel.from_pretrained("m")["device_map"] == {"": 1}  # a loader taking **kwargs
    assert unsloth_shim.patch(unsloth) == 0  # idempotent


def test_unsloth_shim_leaves_a_single_process_alone(fake_unsloth, monkeypatch):
    monkeypatch.setattr(rank, "_info", rank.RankInfo(rank=0, local_rank=0, world_size=1, backend="nccl", device="cuda:0"))
    apply("unsloth")
    import unsloth

    assert unsloth.FastLanguageModel.from_pretrained("m")["device_map"] == "sequential"


# ---------------------------------------------------------------- shared helpers


def test_wrap_keeps_static_and_class_methods(monkeypatch):
    class Loader:
        @staticmethod
        def static(x):
            return x

        @classmethod
        def klass(cls, x):
            return (cls, x)

    def add_one(original):
        return lambda *a, **k: original(*a, **k)

    assert patching.wrap(Loader, "static", add_one) and patching.wrap(Loader, "klass", add_one)
    assert not patching.wrap(Loader, "static", add_one)
    assert isinstance(vars(Loader)["static"], staticmethod) and isinstance(vars(Loader)["klass"], classmethod)
    assert Loader.static(1) == 1 and Loader.klass(2) == (Loader, 2)


# That a rank's setup imports none of the notebook's libraries (Unsloth must be imported before transformers,
# TRL and PEFT) and that the notebook's import of the Trainer brings the metrics callback: checked in a real
# rank by tests/test_grad_ckpt.py's launch (tests/jobs/ckpt_cases.py prints both before its first case).


def test_precision_wrapper_turns_bf16_into_fp16_on_a_t4(monkeypatch, capsys):
    """The T4 path of the wrapped ``__post_init__``, with the device a T4 reports (no T4 here)."""
    import types

    monkeypatch.setattr(precision, "current_device", lambda use_cpu=False: CPU if use_cpu else T4)
    monkeypatch.setattr(rank, "_said", set())
    seen = []
    post_init = precision._adjusting_precision(lambda self: seen.append((self.bf16, self.fp16)))
    args = types.SimpleNamespace(bf16=True, fp16=False, bf16_full_eval=False, fp16_full_eval=False, use_cpu=False)
    post_init(args)
    assert seen == [(False, True)]  # transformers validates what the shim chose
    assert "nbddp: SimpleNamespace: Tesla T4 (compute capability 7.5) has no native bf16" in capsys.readouterr().out
    explicit_cpu = types.SimpleNamespace(bf16=True, fp16=False, use_cpu=True)
    post_init(explicit_cpu)
    assert seen[-1] == (False, False)


def test_assumed_capability_rehearses_another_gpu(monkeypatch):
    monkeypatch.delenv("NBDDP_ASSUME_CC", raising=False)
    assert precision.assumed_capability() is None
    monkeypatch.setenv("NBDDP_ASSUME_CC", "7.5")
    assert precision.assumed_capability() == (7, 5)
    t4_like = precision.Device("cuda", "H200 as if compute capability 7.5", *precision.assumed_capability())
    chosen = precision.decide(t4_like, bf16=True, fp16=False)
    assert (chosen.bf16, chosen.fp16) == (False, True)
    monkeypatch.setenv("NBDDP_ASSUME_CC", "seven")
    with pytest.raises(ValueError, match="7.5"):
        precision.assumed_capability()


def test_different_patches_of_one_function_each_apply_once():
    class Args:
        def __post_init__(self):
            self.calls = ["original"]

    def first(original):
        def run(self):
            original(self)
            self.calls.append("first")
        return run

    def second(original):
        def run(self):
            original(self)
            self.calls.append("second")
        return run

    assert patching.wrap(Args, "__post_init__", first) and patching.wrap(Args, "__post_init__", second)
    assert not patching.wrap(Args, "__post_init__", first)  # already applied beneath the second
    args = Args()
    args.__post_init__()
    assert args.calls == ["original", "first", "second"]
