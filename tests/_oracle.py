"""The float64 reference backend as the oracle of another attention path: values and gradients."""
import torch

from attnlab import attention


def matches_reference(run, q, k, v, *, tol: dict, extra=(), **request):
    """``run() -> (out, lse)`` equals ``attention(q, k, v, backend="reference", **request)`` within ``tol``, in
    values and in the gradients w.r.t. ``q``, ``k``, ``v`` and ``extra`` (an unused input: zero); returns
    ``(out, lse)``."""
    ref = attention(q, k, v, backend="reference", **request)
    g = torch.randn_like(ref)
    inputs = [q, k, v, *extra]
    want = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    out, lse = run()
    got = torch.autograd.grad(out, inputs, g, allow_unused=True)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(want, got):
        torch.testing.assert_close(b if b is not None else torch.zeros_like(a), a, **tol)
    return out, lse
