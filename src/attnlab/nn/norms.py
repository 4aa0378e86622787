"""Normalisation layers: LayerNorm (torch's) and RMSNorm, chosen by name with :func:`make_norm`.

::

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + ε) · g + b      # Ba et al. 2016
    RMSNorm(x)   = x / sqrt(mean(x²) + ε) · g                      # Zhang & Sennrich 2019
"""
from __future__ import annotations


import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab import _native

from attnlab import _native_train
from attnlab._checks import one_of, positive_int, positive_number

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, ``x / sqrt(mean(x²) + ε) · g`` (no centring, no bias).

    Args:
        dim: size of the last dimension.
        eps: ε added to the mean square.

    Parameters:
        weight: the gain ``g`` ``(dim,)``, initialised to ones.

    Raises:
        ValueError: ``dim`` is not a positive int or ``eps`` is not a positive number.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        _check_dim_eps(dim, eps)
        self.dim = int(dim)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm expected last dim {self.dim}, got shape {tuple(x.shape)}")
        if x.dtype in (torch.float16, torch.bfloat16):
            # x² in float32 (no overflow), the gain applied after the cast back: HF Llama / T5's rounding order
            xf = x.float()
            rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            return (xf * rms).to(x.dtype) * self.weight
        if (not (torch.is_grad_enabled() and self.weight.requires_grad) and self.weight.dtype == torch.float32
                and _native.usable(x)):  # inference: one C++ call
            return _native.rms_norm(x.contiguous(), self.weight.contiguous(), self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class _RMSNormFunction(torch.autograd.Function):
    """``y = x̂ · g`` with ``x̂ = x · r``, ``r = (mean(x²) + ε)^(-1/2)``, and its backward in few passes::

        ∂L/∂g = Σ_rows ∂L/∂y ⊙ x̂
        ∂L/∂x = r · (h − x̂ · mean(h ⊙ x̂)),   h = ∂L/∂y ⊙ g

    (autograd through the forward's ops takes ~2× the time on CPU). Where attnlab's C++ kernels take ``x`` (float32
    on the CPU, eager) each direction is one pass (:func:`attnlab._native_train.rms_norm_train` and its backward, ``x̂``
    recomputed from the saved ``x`` and ``r``): fwd + bwd of a (16, 256, 256) float32 ``x``, 2 cores, 0.30× the
    time of the PyTorch operations below (``benchmarks/train_passes.py``). The same formula, its sums in another
    order (``r`` as ``1/√`` instead of ``rsqrt``): within float32's rounding of it, tested against float64;
    float32/float64 inputs (half precision goes through the plain path).
    """

    @staticmethod
    def native(x: Tensor, weight: Tensor) -> bool:
        """Whether the C++ passes take this call: float32 ``x`` and ``weight`` the kernels may read."""
        return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() > 0
                and _native.trainable(x, weight, contiguous=False))

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.native = _RMSNormFunction.native(x, weight)
        if ctx.native:
            x = x.contiguous()
            y, r = _native_train.rms_norm_train(x, weight.contiguous(), eps)
            ctx.save_for_backward(x, r, weight)
            return y
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        xhat = x * r
        ctx.save_for_backward(xhat, r, weight)
        return xhat * weight

    @staticmethod
    @once_differentiable  # a second derivative would need the graph of x̂ and r: refused, not wrong
    def backward(ctx, grad: Tensor):
        if ctx.native:
            x, r, weight = ctx.saved_tensors
            grad_x, grad_w = _native_train.rms_norm_train_backward(grad.contiguous(), x, weight, r)
            return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if ctx.needs_input_grad[1] else None), None
        xhat, r, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            h = grad * weight
            grad_x = (h - xhat * (h * xhat).mean(dim=-1, keepdim=True)).mul_(r)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


def make_norm(kind: str, dim: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """Build a norm layer by name: ``"layernorm"`` (:class:`torch.nn.LayerNorm`) or ``"rmsnorm"``.

    ``bias=False`` leaves out LayerNorm's additive ``β`` (RMSNorm has none).

    Raises:
        ValueError: ``kind`` is not one of :data:`NORMS`, or ``dim``/``eps`` are invalid.
    """
    one_of("norm", kind, NORMS)
    _check_dim_eps(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    return RMSNorm(dim, eps=eps)


def _check_dim_eps(dim: int, eps: float) -> None:
    """A norm's ``dim`` is a positive int and its ``eps`` a positive finite number."""
    positive_int("dim", dim)
    positive_number("eps", eps, finite=True)
