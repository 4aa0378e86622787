"""Linear attention: kernel feature maps (Katharopoulos et al. 2020, "Transformers are RNNs")
and FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers"), O(N) time and memory.

Softmax attention weighs value ``j`` by ``sim(q_i, k_j) = exp(q_iᵀk_j / sqrt(D))``. Replacing
the similarity by a kernel ``φ(q)ᵀφ(k)`` with a non-negative feature map ``φ`` lets the sums be
reordered, so no N × N matrix is ever formed::

    out_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / (Σ_j φ(q_i)ᵀφ(k_j) + eps)
          = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps),    S = Σ_j φ(k_j) v_jᵀ  (Df × Dv),   z = Σ_j φ(k_j)

Feature maps: ``"elu"`` ``φ(x) = elu(x) + 1``; ``"relu"`` ``φ(x) = relu(x)``; ``"favor+"``
positive orthogonal random features ``φ(x) = exp(W x' − ‖x'‖²/2) / sqrt(m)``, ``x' = x D^(-1/4)``,
whose expectation ``E[φ(q)ᵀφ(k)] = exp(qᵀk / sqrt(D))`` is the softmax kernel. Causal attention
(``j ≤ i``) uses chunked prefix sums: see :func:`_causal_sums`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._runtime import reuse_large_blocks
from attnlab._checks import boolean, non_negative_number, one_of, positive_int
from attnlab._limits import check_elements
from attnlab.functional.request import check_qkv

FEATURE_MAPS = ("elu", "relu", "favor+")


def default_num_features(dim: int) -> int:
    """``m = max(D, ceil(D ln D))``: the ``Θ(D log D)`` random features FAVOR+ asks for (267 at D=64)."""
    positive_int("dim", dim)
    return max(dim, math.ceil(dim * math.log(dim)))


def favor_projection(num_features: int, dim: int, *, generator: Optional[torch.Generator] = None,
                     device=None, dtype=None) -> Tensor:
    """The random matrix ``W (m, D)`` of FAVOR+'s positive orthogonal random features.

    Rows come in blocks of ``D``: each block is the ``Q`` of the QR decomposition of a ``D × D``
    Gaussian matrix (signs fixed by ``diag(R)`` so ``Q`` is Haar-distributed), so the rows within
    a block are exactly orthogonal; the last block is cut to ``m mod D`` rows. Each row is then
    scaled to the norm of an independent ``D``-dim Gaussian vector (chi with ``D`` degrees of
    freedom), so every row is marginally ``N(0, I_D)``, as the unbiased estimator needs.

    Raises:
        ValueError: ``num_features`` or ``dim`` is not a positive int.
    """
    positive_int("num_features", num_features)
    positive_int("dim", dim)
    check_elements(f"favor_projection(num_features={num_features}, dim={dim})", -(-num_features // dim) * dim, dim,
                   device=device or "cpu")
    where = generator.device if generator is not None else device
    blocks = []
    for _ in range(-(-num_features // dim)):
        g = torch.randn(dim, dim, generator=generator, device=where, dtype=dtype)
        q, r = torch.linalg.qr(g)
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # (D, D), orthonormal rows
    w = torch.cat(blocks)[:num_features]  # (m, D)
    norms = torch.randn(num_features, dim, generator=generator, device=where, dtype=dtype).norm(dim=1)
    w = w * norms[:, None]
    return w if device is None else w.to(device)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: str = "elu",
    causal: bool = False,
    num_features: Optional[int] = None,
    projection: Optional[Tensor] = None,
    key_mask: Optional[Tensor] = None,
    chunk_size: int = 64,
    eps: float = 0.0,
) -> Tensor:
    """Linear attention ``out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)``.

    Args:
        q: queries ``(B, H, Lq, D)``.
        k: keys ``(B, Hkv, Lk, D)``; ``H % Hkv == 0`` (query head ``h`` uses key/value head
            ``h // (H // Hkv)``, as in :func:`attnlab.attention`).
        v: values ``(B, Hkv, Lk, Dv)``.
        feature_map: ``"elu"`` (``elu(x) + 1``), ``"relu"`` or ``"favor+"``.
        causal: sum over ``j ≤ Lk − Lq + i`` only (bottom-right alignment, as in
            :func:`attnlab.attention`: the queries are the last ``Lq`` positions); needs
            ``Lq <= Lk``. Computed by chunked prefix sums, O(N · chunk_size) memory.
        num_features: FAVOR+'s ``m``; default ``projection.shape[0]`` or, when no projection
            is given, :func:`default_num_features` ``(D) = max(D, ceil(D ln D))``.
        projection: FAVOR+'s ``W (m, D)`` (see :func:`favor_projection`). Without it a fresh one
            is drawn from torch's global generator on every call.
        key_mask: bool ``(B, Lk)``, True = a real key, False = padding; padded keys contribute
            nothing (their ``φ(k)`` and ``v`` are zeroed).
        chunk_size: chunk length of the causal prefix sums.
        eps: added to the denominator (``>= 0``; default 0, so the result is the formula itself, to the
            dtype's round-off: every feature map here is non-negative, and a row whose denominator is
            exactly 0 — possible with ``relu`` — returns zeros). A stabiliser is the user's choice. FAVOR+ features are stabilised by factors that
            cancel in the ratio (per query row: the max over features of its exponent; keys: the
            max over a head's non-padded keys and features, or under ``causal`` the running max
            over keys ``≤ j``, so no later key touches an earlier output); ``eps`` is added to the
            stabilised denominator. A row whose denominator is 0 returns zeros, never NaN.

    Returns:
        ``out (B, H, Lq, Dv)``.

    Raises:
        TypeError: a tensor is not a floating tensor, dtypes differ, ``causal`` is not a bool.
        ValueError: shapes, ``feature_map``, ``num_features``, ``projection``, ``key_mask``,
            ``chunk_size`` or ``eps`` are invalid, or ``causal`` with ``Lq > Lk``.
    """
    check_qkv(q, k, v)
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    one_of("feature_map", feature_map, sorted(FEATURE_MAPS))
    boolean("causal", causal)
    positive_int("chunk_size", chunk_size)
    non_negative_number("eps", eps, finite=True)
    if causal and Lq > Lk:
        raise ValueError(f"causal linear attention needs Lq <= Lk (queries are the last Lq of the Lk "
                         f"positions), got Lq={Lq}, Lk={Lk}")
    keep = _check_key_mask(key_mask, B, Lk, q.device)
    reuse_large_blocks(q, k, v)  # long sequences: keep freed blocks instead of re-faulting them (see _runtime)

    q = q.unflatten(1, (Hkv, H // Hkv))  # (B, Hkv, G, Lq, D): the G query heads sharing a kv head
    k, v = k.unsqueeze(2), v.unsqueeze(2)  # (B, Hkv, 1, Lk, ·)
    if keep is not None:
        v = v.masked_fill(~keep, 0)
    logscale = None
    if feature_map == "favor+":
        w = _check_projection(projection, num_features, q)
        fq, fk, logscale = _favor_features(q, k, w, keep, causal)
    else:
        if num_features is not None or projection is not None:
            raise ValueError(f"num_features and projection are only used with feature_map='favor+' "
                             f"(feature_map={feature_map!r})")
        phi = (lambda x: F.elu(x).add_(1)) if feature_map == "elu" else F.relu
        fq, fk = phi(q), phi(k)
        if keep is not None:
            fk = fk.masked_fill(~keep, 0)

    if causal:
        num, den = _causal_sums(fq, fk, v, logscale, chunk_size)
    else:
        num = fq @ (fk.transpose(-1, -2) @ v)  # (B, Hkv, G, Lq, Dv): φ(Q) (φ(K)ᵀ V)
        den = fq @ fk.sum(-2).unsqueeze(-1)  # (B, Hkv, G, Lq, 1): φ(Q) Σ_j φ(k_j)
    den = den + eps
    out = num / torch.where(den == 0, 1, den)  # den == 0 only when every term is 0, num too
    return out.flatten(1, 2)  # (B, H, Lq, Dv)


def _check_key_mask(key_mask: Optional[Tensor], B: int, Lk: int, device) -> Optional[Tensor]:
    if key_mask is None:
        return None
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
        raise TypeError(f"key_mask must be a bool tensor (True = real key) or None, got {got}")
    if key_mask.shape != (B, Lk):
        raise ValueError(f"key_mask must be (B, Lk) = {(B, Lk)}, got {tuple(key_mask.shape)}")
    if key_mask.device != device:
        raise ValueError(f"key_mask is on {key_mask.device} but q is on {device}")
    return key_mask.view(B, 1, 1, Lk, 1)


def _check_projection(projection: Optional[Tensor], num_features: Optional[int], q: Tensor) -> Tensor:
    D = q.shape[-1]
    if num_features is not None:
        positive_int("num_features", num_features)
    if projection is None:
        m = default_num_features(D) if num_features is None else num_features
        return favor_projection(m, D, device=q.device, dtype=q.dtype)
    if not isinstance(projection, Tensor) or not projection.is_floating_point():
        raise TypeError(f"projection must be a floating-point torch.Tensor (m, D), got "
                        f"{projection.dtype if isinstance(projection, Tensor) else type(projection).__name__}")
    if projection.dim() != 2 or projection.shape[1] != D or projection.shape[0] == 0:
        raise ValueError(f"projection must be (m, D) with m >= 1 and D = {D}, got shape {tuple(projection.shape)}")
    if num_features is not None and num_features != projection.shape[0]:
        raise ValueError(f"num_features={num_features} does not match projection's {projection.shape[0]} rows")
    if projection.device != q.device:
        raise ValueError(f"projection is on {projection.device} but q is on {q.device}")
    return projection.to(q.dtype)


def _favor_features(q: Tensor, k: Tensor, w: Tensor, keep: Optional[Tensor], causal: bool):
    """``φ(x) = exp(W x' − ‖x'‖²/2 − c) / sqrt(m)``, ``x' = x D^(-1/4)``, with stabilisers ``c``
    that cancel in the ratio. Returns ``(φ(q), φ(k), logscale)``: under ``causal`` key ``j`` is
    scaled by ``exp(−M_j)``, ``M_j`` the running max (returned as ``logscale (B, Hkv, 1, Lk)``,
    non-decreasing), otherwise by one max per head and ``logscale`` is None."""
    D, m = q.shape[-1], w.shape[0]

    def exponent(x: Tensor) -> Tensor:
        x = x * D ** -0.25
        return x @ w.T - (x * x).sum(-1, keepdim=True) / 2  # (..., L, m)

    eq, ek = exponent(q), exponent(k)
    fq = torch.exp(eq - eq.amax(-1, keepdim=True)) / math.sqrt(m)
    if keep is not None:
        ek = ek.masked_fill(~keep, -math.inf)  # padding neither counts nor sets the scale
    row = ek.amax(-1)  # (B, Hkv, 1, Lk)
    scale = row.cummax(-1).values if causal else row.amax(-1, keepdim=True)
    # a prefix (or head) of padding only has no max: give it the first real one (0 if none),
    # which keeps the running max finite and non-decreasing
    first = scale.masked_fill(scale == -math.inf, math.inf).amin(-1, keepdim=True)
    first = first.masked_fill(first == math.inf, 0.0)
    scale = torch.where(scale == -math.inf, first, scale)
    fk = torch.exp(ek - scale.unsqueeze(-1)) / math.sqrt(m)
    return fq, fk, scale if causal else None


def _causal_sums(fq: Tensor, fk: Tensor, v: Tensor, logscale: Optional[Tensor], chunk: int):
    """``Σ_{j≤i} φ(q_i)ᵀφ(k_j) v_j`` and ``Σ_{j≤i} φ(q_i)ᵀφ(k_j)`` by chunked prefix sums.

    The ``Lk`` positions are cut into chunks of ``C``. Within a chunk: the ``C × C`` quadratic
    form with its causal mask. Across chunks: the states ``S_c = Σ_{j before chunk c} φ(k_j) v_jᵀ``
    ``(Df × Dv)`` and ``z_c = Σ φ(k_j)``, an exclusive prefix sum over chunks. Memory
    ``O(N·C + (N/C)·Df·Dv)``, never ``N × N``; plain autograd differentiates it.

    With a ``logscale`` ``M`` (FAVOR+ under ``causal``: ``φ(k_j)`` carries ``exp(−M_j)``), key ``j``
    enters query ``i``'s sums with the factor ``exp(M_j − M_i) ≤ 1``, and the state is carried at
    the scale of its chunk's last key, decayed chunk to chunk (as online softmax does).
    """
    Lq, Lk = fq.shape[-2], fk.shape[-2]
    C = min(chunk, Lk)
    n = -(-Lk // C)
    pad = n * C - Lk
    if Lk - Lq or pad:  # the queries sit at the last Lq positions; pad all to n chunks
        fq = F.pad(fq, (0, 0, Lk - Lq, pad))
        fk, v = F.pad(fk, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    qc, kc, vc = (t.unflatten(-2, (n, C)) for t in (fq, fk, v))  # (..., n, C, ·)
    a = qc @ kc.transpose(-1, -2)  # (..., n, C, C): φ(q_i)ᵀφ(k_j) within a chunk
    future = torch.ones(C, C, dtype=torch.bool, device=a.device).triu(1)
    if logscale is None:
        a = a.masked_fill_(future, 0)
        T = kc.transpose(-1, -2) @ vc  # (..., n, Df, Dv): each chunk's Σ φ(k_j) v_jᵀ
        t = kc.sum(-2)  # (..., n, Df)
        # exclusive prefix sums: shift by one chunk, then cumsum (no later chunk enters)
        S = torch.cat([torch.zeros_like(T[..., :1, :, :]), T[..., :-1, :, :]], -3).cumsum_(-3)
        z = torch.cat([torch.zeros_like(t[..., :1, :]), t[..., :-1, :]], -2).cumsum_(-2)
    else:
        M = torch.cat([logscale, logscale[..., -1:].expand(*logscale.shape[:-1], pad)], -1)
        M = M.unflatten(-1, (n, C))  # (..., n, C)
        a = a * torch.exp((M.unsqueeze(-2) - M.unsqueeze(-1)).masked_fill(future, -math.inf))
        last = M[..., -1:]  # (..., n, 1): the scale each chunk's sums are carried at
        kw = kc * torch.exp(M - last).unsqueeze(-1)
        T, t = kw.transpose(-1, -2) @ vc, kw.sum(-2)
        prev = torch.cat([M[..., :1, :1], last[..., :-1, :]], -2)  # (..., n, 1): scale of S_c
        decay = torch.exp(prev[..., :-1, :] - prev[..., 1:, :])  # (..., n-1, 1), <= 1
        S, z = [torch.zeros_like(T[..., 0, :, :])], [torch.zeros_like(t[..., 0, :])]
        for c in range(1, n):
            S.append(S[-1] * decay[..., c - 1, :, None] + T[..., c - 1, :, :])
            z.append(z[-1] * decay[..., c - 1, :] + t[..., c - 1, :])
        S, z = torch.stack(S, -3), torch.stack(z, -2)
        qc = qc * torch.exp(prev - M).unsqueeze(-1)  # φ(q_i) exp(M_prev − M_i), for the state
    num = (a @ vc).add_(qc @ S)  # (..., n, C, Dv)
    den = a.sum(-1, keepdim=True).add_(qc @ z.unsqueeze(-1))  # (..., n, C, 1)
    sl = slice(Lk - Lq, Lk)
    return num.flatten(-3, -2)[..., sl, :], den.flatten(-3, -2)[..., sl, :]
