"""Kernel demo on XLA:CPU: forward + backward per backend against the float64 reference.

Exits non-zero if any max abs error (out, dq, dk, dv) exceeds TOLERANCE.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported
import torch  # noqa: E402
import torch_xla  # noqa: E402

import torchattn  # noqa: E402

TOLERANCE = 1e-4  # float32 inputs


def forward_backward(attention, q, k, v, dout, **kwargs):
    """(out, dq, dk, dv) on the CPU; .cpu() is what runs the XLA graph."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal=True, **kwargs)
    out = out[0] if isinstance(out, tuple) else out  # attention_reference returns (out, lse)
    out.backward(dout.to(out.device, out.dtype))
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=["interpret", "xla"])
    parser.add_argument("--seq-len", type=int, default=200, help="q_len = kv_len")
    args = parser.parse_args()

    device = torch_xla.device()  # first: a CPU backward before this breaks XLA backwards (pytorch/xla#4174)
    torch.manual_seed(0)
    batch, q_heads, kv_heads, seq, head_dim = 2, 4, 2, args.seq_len, 64  # GQA, 2 query heads per kv head
    q = torch.randn(batch, q_heads, seq, head_dim)  # (batch, q_heads, q_len, head_dim)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim) for _ in range(2))  # (batch, kv_heads, kv_len, head_dim)
    dout = torch.randn_like(q)
    expected = forward_backward(torchattn.attention_reference, q.double(), k.double(), v.double(), dout,
                                upcast=True)

    qx, kx, vx = (t.to(device) for t in (q, k, v))
    print(f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, float32, causal, on {qx.device}")
    choice = torchattn.explain(qx, kx, vx, causal=True)
    print(f"explain: auto picks {choice.backend!r}; passed over: {choice.passed_over}")

    failed = False
    for backend in args.backends:
        seconds = []
        for _ in range(2):  # the first call traces and compiles, the second reuses the compiled graph
            start = time.perf_counter()
            got = forward_backward(torchattn.flash_attention, qx, kx, vx, dout, backend=backend)
            seconds.append(time.perf_counter() - start)
        errors = {n: (g.double() - e).abs().max().item() for n, g, e in zip(("out", "dq", "dk", "dv"), got, expected)}
        failed |= max(errors.values()) > TOLERANCE
        print(f"{backend:>9}: max abs error " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
              + f" | fwd+bwd {seconds[0]:.2f} s first call, {seconds[1]:.2f} s second"
              + (" | FAIL" if max(errors.values()) > TOLERANCE else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
