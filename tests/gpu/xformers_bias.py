"""GPU proof of the xformers_bias shim: a block-diagonal causal bias built on cuda:0 used by a query on cuda:1.

That is what happens when one process splits a model over two GPUs (``device_map="auto"``): the bias is made
once, next to the first layers, and reused by layers on the second GPU. Run on a machine with two GPUs and
xformers built for its torch:

    PYTHONPATH=src python tests/gpu/xformers_bias.py

Prints one line per check and ``PASS`` or ``FAIL``; exits 0 (pass), 1 (fail) or 2 (cannot run here: fewer than
two GPUs, or no xformers CUDA kernels). pytest does not collect it (no ``test_`` prefix).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

SEQLENS = [5, 11, 7]  # three packed sequences in one batch row
HEADS, DIM = 4, 64


def blockwise_causal_reference(q, k, v):
    """Each sequence attends causally to itself only: torch's SDPA, sequence by sequence, in fp32."""
    import torch
    import torch.nn.functional as F

    outs, start = [], 0
    for n in SEQLENS:
        qs, ks, vs = (t[:, start:start + n].transpose(1, 2).float() for t in (q, k, v))  # B, H, n, K
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1).to(q.dtype)


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print(f"SKIP: needs two GPUs, found {torch.cuda.device_count()}")
        return 2
    try:
        import xformers
        from xformers.ops import fmha
        from xformers.ops.fmha import attn_bias, common
    except Exception as exc:
        print(f"SKIP: xformers does not import ({type(exc).__name__}: {exc})")
        return 2
    from nbddp.runtime.shims import xformers_bias

    print(f"xformers {xformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)} ×2")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, sum(SEQLENS), HEADS, DIM, device="cuda:1", dtype=torch.float16) for _ in range(3))
    bias_gpu0 = attn_bias.BlockDiagonalCausalMask.from_seqlens(SEQLENS, device=torch.device("cuda:0"))
    bias_gpu1 = attn_bias.BlockDiagonalCausalMask.from_seqlens(SEQLENS, device=torch.device("cuda:1"))
    try:
        expected = fmha.memory_efficient_attention(q, k, v, attn_bias=bias_gpu1)
    except NotImplementedError as exc:
        print(f"SKIP: no xformers kernel for these inputs here: {str(exc).splitlines()[0]}")
        return 2
    checks = []

    def check(name, ok, detail=""):
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    reference = blockwise_causal_reference(q, k, v)
    check("xformers on one GPU matches a blockwise causal reference",
          torch.allclose(expected, reference, atol=2e-3, rtol=2e-3),
          f"max diff {(expected - reference).abs().max().item():.2e}")

    try:
        fmha.memory_efficient_attention(q, k, v, attn_bias=bias_gpu0)
        check("without the shim, the bias on cuda:0 is rejected", False, "no error (xformers older than 0.0.27?)")
    except ValueError as exc:
        check("without the shim, the bias on cuda:0 is rejected",
              "should be on the same device" in str(exc), str(exc).splitlines()[0])

    xformers_bias.patch(common)
    out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias_gpu0)
    check("with the shim, the bias on cuda:0 is accepted, output on cuda:1", out.device == q.device)
    check("with the shim, the output equals the one-GPU result (causality kept)",
          torch.allclose(out, expected, atol=1e-3, rtol=1e-3), f"max diff {(out - expected).abs().max().item():.2e}")
    not_causal = fmha.memory_efficient_attention(q, k, v, attn_bias=attn_bias.BlockDiagonalMask.from_seqlens(
        SEQLENS, device=torch.device("cuda:0")))
    check("a non-causal bias would give a different output (the check above can fail)",
          not torch.allclose(not_causal, expected, atol=1e-2, rtol=1e-2))
    check("the caller's bias stays on cuda:0", bias_gpu0.q_seqinfo.seqstart.device == torch.device("cuda:0"))

    print("PASS" if all(checks) else "FAIL")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
