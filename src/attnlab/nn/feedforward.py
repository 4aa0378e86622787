"""Position-wise feed-forward networks, plain and gated (Shazeer 2020, "GLU Variants Improve Transformer").

::

    plain:  FFN(x) = W₂ act(W₁ x)                 act ∈ {relu, gelu, gelu_tanh, quick_gelu, relu2}
    gated:  FFN(x) = W₂ (act(W₁ x) ⊙ W₃ x)        glu: act = sigmoid, geglu: gelu, geglu_tanh: gelu_tanh,
                                                  swiglu: silu, relu2_glu: relu2

``gelu_tanh(x) = ½x(1 + tanh(√(2/π)(x + 0.044715x³)))`` is HF's ``"gelu_new"`` (GPT-2; gated: T5 v1.1's
``"gated-gelu"``); ``quick_gelu(x) = x · σ(1.702 x)`` is OpenAI CLIP's; ``relu2(x) = max(x, 0)²`` (So et al.
2021, "Primer"; HF's ``"relu2"``, so a Llama with ``hidden_act="relu2"`` is the gated ``relu2_glu``).

Parameter names follow the formula (and Meta's LLaMA code): ``w1``, ``w2`` and, for the gated
variants, ``w3``. Mapping from other checkpoints:

- ``torch.nn.TransformerEncoderLayer``: linear1 → w1, linear2 → w2
- BERT (HF): intermediate.dense → w1, output.dense → w2
- LLaMA (HF): gate_proj → w1, up_proj → w3, down_proj → w2
- T5 v1.1 (HF, gated-gelu): wi_0 → w1, wi_1 → w3, wo → w2
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab import _native

from attnlab import _native_train
from attnlab._checks import one_of, positive_int, rate
from attnlab._limits import check_elements
from attnlab.nn.dropout import Dropout



def quick_gelu(x: Tensor) -> Tensor:
    """``x · σ(1.702 x)``, the GELU approximation OpenAI's CLIP was trained with."""
    return x * torch.sigmoid(1.702 * x)


def relu2(x: Tensor) -> Tensor:
    """``max(x, 0)²``, Primer's squared ReLU."""
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "relu2": relu2,
}
GATED_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "glu": torch.sigmoid,
    "geglu": F.gelu,
    "geglu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "swiglu": F.silu,
    "relu2_glu": relu2,
}
FFN_ACTIVATIONS = tuple(ACTIVATIONS) + tuple(GATED_ACTIVATIONS)


class _Activation(torch.autograd.Function):
    """``h = act(g) ⊙ u`` (gated) and the gradients ``∂L/∂g = ∂L/∂h ⊙ u ⊙ act'(g)``, ``∂L/∂u = ∂L/∂h ⊙ act(g)``, one
    C++ pass each (:func:`attnlab._native_train.act_train`, float32 arithmetic, one rounding to the inputs' dtype)
    instead of PyTorch's activation, its backward and three products. A plain activation (``h = act(g)``,
    :func:`_activate`: one autograd node, :func:`~attnlab._native_train.act_kept_train`) keeps ``act'(g)`` from
    its forward (:func:`~attnlab._native_train.act_with_grad`: GELU's derivative reuses the forward's e^(−g²/2), so
    the two cost about one), the backward then one product ``∂L/∂h ⊙ act'(g)``: the same bits in float32, in bf16
    ``act'(g)`` rounded once more. Training only; the call sites take it where ``benchmarks/train_passes.py``
    measures it faster than PyTorch's operations (fwd + bwd): a gated activation in float32, and in bf16 only with
    AVX-512 (bf16 is emulated without it); a plain activation in both dtypes on every ISA."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, activation: str) -> Tensor:
        ctx.activation = activation
        ctx.save_for_backward(g, u)
        return _native_train.act_train(g, u, activation)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        g, u = ctx.saved_tensors
        dg, du = _native_train.act_train_backward(grad.contiguous(), g, u, ctx.activation)
        return dg, du, None


def _activate(g: Tensor, u: Optional[Tensor], activation: str) -> Tensor:
    """The training activation by our passes (where :func:`_native_grad` says so): gated, :class:`_Activation`;
    plain, one autograd node that keeps ``act'(g)`` (:func:`attnlab._native_train.act_kept_train`)."""
    if u is None:
        return _native_train.act_kept_train(g, activation)
    return _Activation.apply(g, u, activation)


def _native_grad(h: Tensor, u: Optional[Tensor]) -> bool:
    """Whether :func:`_activate` takes this training call (the rules in :class:`_Activation`'s docstring)."""
    if not (h.requires_grad or (u is not None and u.requires_grad)) or not torch.is_grad_enabled() or not h.numel():
        return False
    if not _native.trainable(h, u):
        return False
    if h.dtype == torch.float32 or u is None:
        return True
    return _native.isa() == 2  # gated bf16: ours only where bf16 is native


class FeedForward(nn.Module):
    """``W₂ act(W₁ x)``, or gated ``W₂ (act(W₁ x) ⊙ W₃ x)`` for ``glu``/``geglu``/``swiglu``/``relu2_glu``.

    Dropout (if any) is applied to the hidden activation, before ``W₂``, as in
    ``torch.nn.TransformerEncoderLayer``.

    Args:
        dim: input and output size.
        hidden_dim: hidden size (the width of ``W₁`` and ``W₃``).
        activation: one of :data:`FFN_ACTIVATIONS`.
        dropout: dropout probability on the hidden activation.
        bias: whether the linear layers have biases.

    Parameters:
        w1: ``Linear(dim, hidden_dim)``, the activated branch.
        w2: ``Linear(hidden_dim, dim)``, the output projection.
        w3: ``Linear(dim, hidden_dim)``, the linear (gated) branch; only for gated activations.

    Raises:
        ValueError: a size is not a positive int, ``activation`` is unknown or ``dropout`` is
            outside ``[0, 1)``.
    """

    def __init__(
        self, dim: int, hidden_dim: int, *, activation: str = "relu", dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        positive_int("dim", dim)
        positive_int("hidden_dim", hidden_dim)
        one_of("activation", activation, FFN_ACTIVATIONS)
        rate("dropout", dropout)
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        check_elements(f"FeedForward(dim={dim}, hidden_dim={hidden_dim})", dim, hidden_dim, 3 if self.gated else 2)
        self.act = GATED_ACTIVATIONS[activation] if self.gated else ACTIVATIONS[activation]
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias) if self.gated else None
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.w3 is not None and not self.training:
            h = self._gated_native(x)
            if h is not None:
                return self.w2(h)
        h = self.w1(x)  # (B, L, hidden)
        u = self.w3(x) if self.w3 is not None else None
        if _native_grad(h, u):
            h = _activate(h, u, self.activation)  # training: one pass each way
        elif u is not None:
            h = self.act(h) * u
        else:
            native = self.activation in _native.FASTER_ACTIVATIONS and h.is_contiguous() and _native.usable(h)
            h = _native.activate(h, self.activation) if native else self.act(h)
        return self.w2(self.dropout(h) if self.training else h)  # (B, L, dim)

    def _gated_native(self, x: Tensor) -> Optional[Tensor]:
        """``act(W₁ x) ⊙ W₃ x`` in one C++ call (:func:`attnlab._native.gated_matvec`) where both layers are served by
        attnlab's matrix–vector kernel (inference layouts, ``optimize_for_inference`` or int8, a decoding step's
        few rows) with the same weight dtype; else None."""
        first = getattr(self.w1, "matvec_args", None)
        second = getattr(self.w3, "matvec_args", None)
        if first is None or second is None or not _native.usable(x):
            return None
        first, second = first(x), second(x)
        if first is None or second is None or first[0].dtype != second[0].dtype or first[0].shape != second[0].shape:
            return None
        return _native.gated_matvec(x.contiguous(), first, second, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
