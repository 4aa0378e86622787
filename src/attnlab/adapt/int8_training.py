"""Int8 products in training: a linear layer's three matrix products in int8 × int8 → int32, each operand
quantised at run time with one scale per row or column (the "int8 mixed-precision training" of torchao and
SwitchBack, Wortsman et al. 2023, with the weight gradient in int8 too). For ``Y = X Wᵀ + b`` (``X (T, in)`` the
tokens, ``W (out, in)``), writing ``q_k(A)`` for symmetric rounding to ``[−k, k]`` with the scales ``s``::

    forward        X ≈ diag(s_x) q_63(X) (a scale per token),    W ≈ diag(s_w) q_63(W) (per output row)
                   Y = diag(s_x) (q(X) q(W)ᵀ) diag(s_w) + b
    ∂L/∂X          G = ∂L/∂Y;  G W = (G diag(s_w)) q(W):  Z = G diag(s_w) ≈ diag(s_z) q_63(Z) (per token)
                   ∂L/∂X = diag(s_z) (q(Z) q(W))
    ∂L/∂W          Gᵀ X: G ≈ q_63(G) diag(s_g),  X ≈ q_63(X) diag(s_c) (a scale per column, over the tokens)
                   ∂L/∂W = diag(s_g) (q(G)ᵀ q(X)) diag(s_c),   ∂L/∂b = Σ_t G_t (float32)

Every scale sits on an index the product keeps (a row of the left operand, a column of the right), so each
product is one integer matrix product and one rescaling pass. The right operand is rounded to 7 bits (±63): on
CPUs without VNNI (AVX2, AVX-512 without VNNI) ``u8 × s8`` pairs are multiplied into 16-bit sums, which saturate at
8-bit × 8-bit (``torch._int_mm`` is wrong by up to ~10⁶ with both at ±127) and are exact at 8 × 7 bits. The
left operand is rounded to 7 bits as well (±63): then two such 16-bit sums add exactly before they are widened,
which shortens attnlab's AVX2 product (``csrc/int8_gemm.h``). The same roundings everywhere keep the result the
same on every CPU. The int32 sums are exact, so the products are: only the roundings (and the float32 rescaling)
differ from a float product.

Why: int8 products run several times the float ones' rate on a CPU (see docs/performance.md). With AVX2 and no
VNNI the products are attnlab's own (``csrc/int8_gemm.h``: the same ``u8 × s8`` arithmetic and int32 sums, the
rescaling fused, no per-call copy of the right operand; :func:`attnlab._native_train.int8_kernel`): oneDNN's int8
product there is a reference loop, slower than fp32. What it costs: the
roundings of 7-bit operands (relative error up to 1/126 of the row's or column's largest value) in every
product; ``nanogpt-cpu``'s val loss is unchanged within its seed-to-seed spread (see docs/performance.md).

Evaluation and inference are not quantised: the layer is an ``nn.Linear`` (same parameters, same state dict) whose
training forward takes this path — one autograd node (:func:`attnlab._native_train.int8_linear_train`): the
roundings, products and rescalings of each direction in one native call (``int8_linear`` and its backward op,
autograd by ``torch.library``, so ``torch.compile`` traces it); in ``eval()``
mode, or where the native kernels are not built, it is the float layer. :func:`int8_training` swaps the layers of a
model in place. A pre-norm GPT layer whose four products are such layers trains as one node in all
(:func:`attnlab._native_train.gpt_block_train`, where :func:`attnlab.backends.dispatch.plan_layer` takes it: the
norms, these products, the attention, the activation and the residuals, the same calls and bits).
"""
from __future__ import annotations

import fnmatch
from typing import Iterable

import torch
from torch import Tensor, nn

from attnlab import _native

from attnlab import _native_train

LEFT, RIGHT = 63, 63  # levels of the left and right operands of the int8 products (7 bits each: module docstring)
# the longest sum of products an int32 holds exactly (541,064 terms): past it csrc's int8_linear (same formula, from
# the levels it is given) sums the product in parts, each exact and rescaled, the parts in float32
MAX_INNER = (2 ** 31 - 1) // (LEFT * RIGHT)


class Int8TrainingLinear(nn.Linear):
    """An ``nn.Linear`` whose training forward runs its three products in int8 (module docstring); ``eval()``
    mode, inputs other than float32/bfloat16 on the CPU, or no native kernels: the float layer. Same parameters
    and state dict as ``nn.Linear``."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and torch.is_grad_enabled() and x.device.type == "cpu"
                and x.dtype in (torch.float32, torch.bfloat16) and self.weight.dtype == torch.float32
                and _native.runs_on(x)):
            return super().forward(x)
        out_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16):
            return super().forward(x)
        # one autograd node (attnlab._native_library: int8_linear's); autocast casts none of its operations
        return _native_train.int8_linear_train(x, self.weight, self.bias, left=LEFT, right=RIGHT, dtype=out_dtype)


# what the dispatcher's plan for a decoder layer reads to know these products compute exactly int8_linear_train's
_native_train.register_int8_training(Int8TrainingLinear, LEFT, RIGHT)


def int8_training(model: nn.Module, *, skip: Iterable[str] = ("*lm_head*", "*head")) -> list[str]:
    """Make every ``nn.Linear`` of ``model`` (in place) an :class:`Int8TrainingLinear`, except those whose
    qualified name matches a pattern of ``skip`` (``fnmatch``; default: the output head, whose products are a
    vocabulary's logits). Returns the names converted. The parameters and state dict do not change."""
    skip = list(skip)
    done = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not any(fnmatch.fnmatchcase(name, p) for p in skip):
            module.__class__ = Int8TrainingLinear
            done.append(name)
    return done
