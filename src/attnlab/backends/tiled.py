"""The tiled backend: FlashAttention's algorithm (Dao et al. 2022, FlashAttention-2 2023) in PyTorch.

Forward, for each query block ``i`` and each visible key chunk ``r`` (online softmax)::

    S   = κ Q_i K_rᵀ  → score_mod → mask (-inf)              # (B, H, Bq, Bk), one block at a time
    m'  = max(m, rowmax S);   α = e^(m - m')
    l   = α l + rowsum e^(S - m');   acc = α acc + e^(S - m') V_r;   m = m'
    O_i = acc / l;   LSE_i = m + log l

Backward recomputes each block's scores from ``(Q, K, V, O, LSE)`` — nothing ``O(N²)`` is saved::

    P = e^(S - LSE);  D_i = rowsum(dO_i ∘ O_i)
    dV_r += Pᵀ dO_i;  dP = dO_i V_rᵀ;  dS = P ∘ (dP - D_i)  (→ back through score_mod)
    dQ_i += κ dS K_r;  dK_r += κ dSᵀ Q_i

Float32/bf16/fp16 requests on the CPU whose mask is intervals of keys per query (causal, a sliding window, a
``mask_mod`` with ``key_spans``: packed documents, prefix-LM) or BigBird's block layout and whose ``score_mod`` is none,
ALiBi or softcap (with no tensor needing a gradient) run both passes as one C++ call each
(:mod:`attnlab.backends.flash_native`, ``csrc/flash_*.cpp``: the same algorithm, the block products in a register-tiled
kernel of its own (AVX-512) or the BLAS torch uses, the element-wise passes fused and vectorised); everything else
runs the PyTorch loop below.

Blocks the mask empties are never computed: causal and sliding-window limits are known in closed
form; a ``mask_mod`` or dense boolean mask is evaluated per chunk in the forward pass and the
empty chunks are dropped from the plan the backward pass replays. Time and memory are
``O(N · visible keys)`` and ``O(N)``. GQA folds the query heads of a group into the rows of one
matrix product (no copies of K, V). bf16/fp16 inputs are computed in float32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from attnlab import _native
from attnlab._runtime import reuse_large_blocks
from attnlab.backends import reference
from attnlab.backends.flash_native import NativeFlash, native_applies, native_blocks, native_request
from attnlab.functional.masks import (additive_without_grads, call_mask_mod, call_score_mod, captured_tensors,
                                     derivative_without_grads)

BLOCK_Q = 128     # query rows per block
BLOCK_K = 128     # key chunk when an element-wise mask must be evaluated to find empty chunks
MAX_CHUNK = 1024  # key chunk for causal / window / unmasked ranges (bounds the per-block memory)


def unsupported(q, k, v, *, normalize, dropout_p, return_weights, **_) -> str:
    if normalize != "softmax":
        return f"normalize={normalize!r} (tiled computes softmax only)"
    if dropout_p > 0:
        return "dropout_p > 0 (tiled does not replay dropout masks in backward)"
    if return_weights:
        return "return_weights=True (use attnlab.attention_weights, which recovers them from the log-sum-exp)"
    return ""


DENSE_WINDOW_LIMIT = 2048 * 2048  # Lq·Lk up to which a wide window goes to SDPA with a dense mask under auto
# From this many queries and keys the C++ kernel beats SDPA's CPU flash kernel on a dense float32 request: with
# AVX-512 (its own block products) every such request; else (the BLAS's products) a causal one or one that wants
# gradients; with the BLAS's products a bidirectional forward stays SDPA's (see docs/performance.md).
NATIVE_DENSE_MIN = 256


def auto_when(q, k, v, *, window=None, causal=False, mask=None, mask_mod=None, score_mod=None, **_) -> bool:
    """``auto`` takes ``tiled`` for a dense request (no window, mask_mod or score_mod: :data:`AUTO_ORDER`, where it
    comes before ``sdpa``) where the C++ kernel is faster: float32, no mask tensor, at least
    :data:`NATIVE_DENSE_MIN` queries and keys, and (unless its products are its own, AVX-512) causal or wanting
    gradients. For every sparse request
    (:data:`SPARSE_ORDER`) except a window too wide to save work (:func:`window_saves_work`) on a sequence short
    enough for a dense mask (``Lq·Lk ≤ DENSE_WINDOW_LIMIT``): measured, SDPA's fused kernel with the mask is faster
    there."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    if window is None and mask_mod is None and score_mod is None:
        wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return (mask is None and q.dtype == torch.float32 and min(Lq, Lk) >= NATIVE_DENSE_MIN
                and (causal or wants_grad or _native.own_products()) and native_applies(q))
    if mask is not None or mask_mod is not None or score_mod is not None:
        return True
    return window_saves_work(Lq, Lk, window, causal) or Lq * Lk > DENSE_WINDOW_LIMIT


WINDOW_BLOCK = 32  # the query rows of a tile whose key span window_saves_work counts


def window_saves_work(Lq: int, Lk: int, window: Optional[int], causal: bool) -> bool:
    """Whether a sliding window skips at least half of dense attention's work, counted in tiles of
    :data:`WINDOW_BLOCK` queries: each tile's span of ``S`` keys (its rows and the window behind them, and ahead when
    not causal, in whole tiles) against ``Lk / 2`` keys per query on average if causal, else ``Lk``; and the sequence
    at least two spans long. Where it does not, a fused dense kernel with a mask is faster."""
    if window is None or window >= Lk:
        return False
    span = -(-(WINDOW_BLOCK + (window - 1) * (1 if causal else 2)) // WINDOW_BLOCK)  # in tiles
    dense = Lk / 2 if causal else Lk
    return -(-Lq // WINDOW_BLOCK) >= 2 * (span - 1) and 2 * span * WINDOW_BLOCK <= dense


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
              top_k, return_weights):
    out, _ = tiled_attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                             score_mod=score_mod, mask_mod=mask_mod)
    return out, None


def attention_lse(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, **_) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a softmax request (the registry's ``lse`` entry): :func:`tiled_attention`."""
    return tiled_attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale, score_mod=score_mod,
                           mask_mod=mask_mod)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Optional[Tensor] = None, causal: bool = False,
                    window: Optional[int] = None, scale: float, score_mod=None, mask_mod=None,
                    block_q: int = BLOCK_Q, block_k: int = BLOCK_K, max_chunk: int = MAX_CHUNK
                    ) -> tuple[Tensor, Tensor]:
    """``(out (B, H, Lq, Dv), lse (B, H, Lq))``; ``lse = log Σ_j e^(s_ij)``, ``-inf`` on empty rows.

    Arguments are those of :func:`attnlab.attention`, already validated (4-D masks).
    """
    reuse_large_blocks(q, k, v)  # long sequences: keep freed blocks instead of re-faulting them (see _runtime)
    captured = captured_tensors(score_mod) if score_mod is not None else []
    native = native_request(q, k, score_mod, mask_mod, captured) if mask is None and native_applies(q) else None
    if native is not None:
        return NativeFlash.apply(q, k, v, scale, causal, window, native_blocks(window, native), native)
    cfg = _Config(causal=causal, window=window, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                  bool_mask=mask if mask is not None and mask.dtype == torch.bool else None,
                  block_q=block_q, block_k=block_k, max_chunk=max_chunk)
    bias = mask if mask is not None and mask.dtype != torch.bool else None
    return _TiledAttention.apply(cfg, q, k, v, bias, *captured)


# ---- plan: which key chunks each query block visits ----------------------------------------

@dataclass
class _Config:
    causal: bool
    window: Optional[int]
    scale: float
    score_mod: object
    mask_mod: object
    bool_mask: Optional[Tensor]
    block_q: int
    block_k: int
    max_chunk: int
    plan: list = field(default_factory=list)  # [(qs, qe, [(ks, ke, needs_mask), ...]), ...]


def _key_range(cfg: _Config, p0: int, p1: int, Lk: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that causal/window allow for query positions ``p0..p1``."""
    lo, hi = 0, Lk
    if cfg.causal:
        hi = min(Lk, p1 + 1)
    if cfg.window is not None:
        lo = max(0, p0 - cfg.window + 1)
        if not cfg.causal:
            hi = min(Lk, p1 + cfg.window)
    return lo, hi


def _full_range(cfg: _Config, p0: int, p1: int, lo: int, hi: int) -> tuple[int, int]:
    """Keys in ``[lo, hi)`` that causal/window allow for *every* query position ``p0..p1``."""
    flo, fhi = lo, hi
    if cfg.causal:
        fhi = min(fhi, p0 + 1)
    if cfg.window is not None:
        flo = max(flo, p1 - cfg.window + 1)
        if not cfg.causal:
            fhi = min(fhi, p0 + cfg.window)
    return flo, max(flo, fhi)


def _chunks(cfg: _Config, B: int, H: int, qs: int, qe: int, Lq: int, Lk: int, device):
    """``(ks, ke, needs_mask, grids, allowed)`` for each key range the queries ``qs..qe`` visit in the forward pass.

    With an element-wise mask (``mask_mod`` or a dense boolean mask) the mask is evaluated once over the keys
    causal/window allow, its empty ``block_k``-wide chunks are dropped, and neighbouring non-empty chunks are
    merged (up to ``max_chunk`` keys): one product per range. Otherwise :func:`_initial_chunks`.
    """
    if cfg.mask_mod is None and cfg.bool_mask is None:
        for ks, ke, needs_mask in _initial_chunks(cfg, qs, qe, Lq, Lk):
            grids = _block_grids(B, H, qs, qe, ks, ke, Lk - Lq, device)
            yield ks, ke, needs_mask, grids, (_allowed(cfg, grids, None) if needs_mask else None)
        return
    off = Lk - Lq
    lo, hi = _key_range(cfg, off + qs, off + qe - 1, Lk)
    if hi <= lo:
        return
    allowed = _allowed(cfg, _block_grids(B, H, qs, qe, lo, hi, off, device), _bool_block(cfg, qs, qe, lo, hi))
    cols = allowed.flatten(0, -2).any(dim=0).expand(hi - lo)               # key columns anyone sees
    n = -(-(hi - lo) // cfg.block_k)
    flags = torch.nn.functional.pad(cols, (0, n * cfg.block_k - (hi - lo))).view(n, cfg.block_k).any(dim=1)
    for c0, c1 in true_runs(flags):
        for ks in range(lo + c0 * cfg.block_k, min(lo + c1 * cfg.block_k, hi), cfg.max_chunk):
            ke = min(ks + cfg.max_chunk, lo + c1 * cfg.block_k, hi)
            part = allowed if allowed.shape[-1] == 1 else allowed[..., ks - lo:ke - lo]
            yield ks, ke, True, _block_grids(B, H, qs, qe, ks, ke, off, device), part


def true_runs(flags: Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in a 1-D bool tensor."""
    padded = torch.cat([flags.new_zeros(1), flags, flags.new_zeros(1)]).to(torch.int8)
    change = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return list(zip(change[0::2], change[1::2]))


def _initial_chunks(cfg: _Config, qs: int, qe: int, Lq: int, Lk: int) -> list[tuple[int, int, bool]]:
    """``[(ks, ke, needs_mask)]`` covering the keys causal/window allow for queries ``qs..qe`` (no element-wise
    mask): the fully visible middle is cut into ``max_chunk`` pieces computed without a mask, and the ragged
    edges get a mask; a short middle is merged with its edges (one larger product beats three small ones).
    """
    off = Lk - Lq
    p0, p1 = off + qs, off + qe - 1
    lo, hi = _key_range(cfg, p0, p1, Lk)
    if hi <= lo:
        return []
    flo, fhi = _full_range(cfg, p0, p1, lo, hi)
    if fhi - flo < cfg.block_k:  # little to gain from splitting: one masked range
        flo = fhi = hi
    chunks = [(lo, flo, True)] if flo > lo else []
    chunks += [(ks, min(ks + cfg.max_chunk, fhi), False) for ks in range(flo, fhi, cfg.max_chunk)]
    if hi > fhi:
        chunks.append((fhi, hi, True))
    return chunks


# ---- one block of scores ---------------------------------------------------------------------

def _slice_mask(m: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """Block ``[qs:qe, ks:ke]`` of a 4-D mask whose last two dims may be broadcast (size 1)."""
    m = m if m.shape[-2] == 1 else m[..., qs:qe, :]
    return m if m.shape[-1] == 1 else m[..., ks:ke]


def _grids(B: int, heads: Tensor, q_pos: Tensor, kv_pos: Tensor):
    """Broadcastable ``(b, h, q_idx, kv_idx)`` for score_mod / mask_mod calls."""
    return (torch.arange(B, device=q_pos.device).view(B, 1, 1, 1), heads.view(1, -1, 1, 1),
            q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))


def _block_grids(B: int, H: int, qs: int, qe: int, ks: int, ke: int, off: int, device):
    ar = functools.partial(torch.arange, device=device)
    return _grids(B, ar(H), ar(off + qs, off + qe), ar(ks, ke))


def _allowed(cfg: _Config, grids, mask_block: Optional[Tensor]) -> Optional[Tensor]:
    """Element mask of one block (True = may attend), or None when nothing is masked.

    ``mask_block`` is the dense boolean mask already cut to the block (or None).
    """
    b, h, q_idx, kv_idx = grids
    parts = []
    d = q_idx - kv_idx
    if cfg.causal:
        parts.append(d >= 0)
    if cfg.window is not None:
        parts.append(d < cfg.window if cfg.causal else d.abs() < cfg.window)
    if mask_block is not None:
        parts.append(mask_block)
    if cfg.mask_mod is not None:
        parts.append(call_mask_mod(cfg.mask_mod, b, h, q_idx, kv_idx))
    return functools.reduce(torch.logical_and, parts) if parts else None


def _fold(x: Tensor, Hkv: int) -> Tensor:
    """``(B, H, R, ·) -> (B, Hkv, G·R, ·)``: the G query heads of a kv group become rows."""
    B, H, R, C = x.shape
    return x.reshape(B, Hkv, (H // Hkv) * R, C)


def _unfold(x: Tensor, H: int) -> Tensor:
    B, Hkv, GR, C = x.shape
    return x.view(B, H, GR // (H // Hkv), C)


def _raw_scores(q_blk: Tensor, k_chunk: Tensor, scale: float) -> Tensor:
    """``κ Q_i K_rᵀ`` as ``(B, H, Bq, Bk)``, in the compute dtype."""
    H, Hkv = q_blk.shape[1], k_chunk.shape[1]
    return _unfold(torch.matmul(_fold(q_blk, Hkv), k_chunk.transpose(-2, -1)), H) * scale


def _finish_scores(s: Tensor, bias_block: Optional[Tensor], allowed: Optional[Tensor]) -> Tensor:
    """Add the bias and mask the block, in place (``s`` is a fresh block this module owns)."""
    if bias_block is not None:
        s.add_(bias_block.to(s.dtype))
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    return s


def _bool_block(cfg: _Config, qs, qe, ks, ke) -> Optional[Tensor]:
    return None if cfg.bool_mask is None else _slice_mask(cfg.bool_mask, qs, qe, ks, ke)


def _bias_block(bias: Optional[Tensor], qs, qe, ks, ke) -> Optional[Tensor]:
    return None if bias is None else _slice_mask(bias, qs, qe, ks, ke)


# ---- autograd ---------------------------------------------------------------------------------

class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: _Config, q, k, v, bias, *captured):
        B, H, Lq, _ = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
        cdt = _compute_dtype(q.dtype)
        qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
        out = torch.zeros(B, H, Lq, Dv, dtype=cdt, device=q.device)
        lse = torch.full((B, H, Lq), float("-inf"), dtype=cdt, device=q.device)
        cfg.plan = []
        for qs in range(0, Lq, cfg.block_q):
            qe = min(qs + cfg.block_q, Lq)
            q_blk = qc[:, :, qs:qe]
            m = torch.full((B, H, qe - qs, 1), float("-inf"), dtype=cdt, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(B, H, qe - qs, Dv, dtype=cdt, device=q.device)
            kept = []
            for ks, ke, needs_mask, grids, allowed in _chunks(cfg, B, H, qs, qe, Lq, Lk, q.device):
                kept.append((ks, ke, needs_mask))
                s = _raw_scores(q_blk, kc[:, :, ks:ke], cfg.scale)
                if cfg.score_mod is not None:
                    s = call_score_mod(cfg.score_mod, s, *grids)
                s = _finish_scores(s, _bias_block(bias, qs, qe, ks, ke), allowed)
                m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = s.sub_(m_safe).exp_()  # in place: one block-sized buffer per step
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(dim=-1, keepdim=True)
                acc = acc * alpha + _unfold(torch.matmul(_fold(p, Hkv), vc[:, :, ks:ke]), H)
                m = m_new
            cfg.plan.append((qs, qe, kept))
            nonempty = l > 0
            out[:, :, qs:qe] = acc / torch.where(nonempty, l, torch.ones_like(l))
            lse[:, :, qs:qe] = torch.where(nonempty, m + torch.log(l), torch.full_like(l, float("-inf"))).squeeze(-1)
        out = out.to(q.dtype)
        ctx.cfg = cfg
        ctx.n_captured = len(captured)
        ctx.save_for_backward(q, k, v, out, lse, bias, *captured)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        cfg: _Config = ctx.cfg
        q, k, v, out, lse, bias, *captured = ctx.saved_tensors
        B, H, Lq, _ = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        cdt = _compute_dtype(q.dtype)
        if torch.is_grad_enabled():  # create_graph=True: gradients differentiable again, from the formula
            return (None, *reference.formula_grads(
                d_out, q, k, v, (bias, *captured), ctx.needs_input_grad[1:], compute_dtype=cdt,
                mask=bias if bias is not None else cfg.bool_mask, causal=cfg.causal, window=cfg.window,
                scale=cfg.scale, score_mod=cfg.score_mod, mask_mod=cfg.mask_mod))
        qc, kc, vc, do = q.to(cdt), k.to(cdt), v.to(cdt), d_out.to(cdt)
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        want_bias = bias is not None and ctx.needs_input_grad[4]
        dbias = torch.zeros(bias.shape, dtype=cdt, device=q.device) if want_bias else None
        dcaptured = [torch.zeros_like(t) for t in captured]
        lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).unsqueeze(-1)
        derivative = derivative_without_grads(cfg.score_mod, captured)  # dS_raw = dS ∘ mod'(s), e.g. softcap
        closed_form = derivative is not None or additive_without_grads(cfg.score_mod, captured)
        for qs, qe, chunks in cfg.plan:
            q_blk, do_blk = qc[:, :, qs:qe], do[:, :, qs:qe]
            delta = (do_blk * out[:, :, qs:qe].to(cdt)).sum(dim=-1, keepdim=True)  # D_i = rowsum(dO ∘ O)
            dq_blk = torch.zeros_like(q_blk)
            for ks, ke, needs_mask in chunks:
                grids = _block_grids(B, H, qs, qe, ks, ke, Lk - Lq, q.device)
                allowed = _allowed(cfg, grids, _bool_block(cfg, qs, qe, ks, ke)) if needs_mask else None
                raw = _raw_scores(q_blk, kc[:, :, ks:ke], cfg.scale)
                scale_ds = None
                if closed_form:  # score + bias: dS passes through unchanged; else scaled by the mod's derivative
                    s = call_score_mod(cfg.score_mod, raw, *grids)
                    scale_ds = None if derivative is None else derivative(s)  # before the mask: finite
                elif cfg.score_mod is not None:
                    with torch.enable_grad():
                        leaf = raw.detach().requires_grad_()
                        modded = call_score_mod(cfg.score_mod, leaf, *grids)
                    s = modded.detach().clone()  # the mod's graph may have saved its output
                else:
                    s = raw
                s = _finish_scores(s, _bias_block(bias, qs, qe, ks, ke), allowed)
                p = s.sub_(lse_safe[:, :, qs:qe]).exp_()  # P = e^(S - LSE): (B, H, Bq, Bk)
                dv[:, :, ks:ke] += torch.matmul(_fold(p, Hkv).transpose(-2, -1), _fold(do_blk, Hkv))
                dp = _unfold(torch.matmul(_fold(do_blk, Hkv), vc[:, :, ks:ke].transpose(-2, -1)), H)
                ds = dp.sub_(delta).mul_(p)  # dS = P ∘ (dP - D_i), w.r.t. modded scores
                if dbias is not None:
                    _accumulate_block(dbias, ds, qs, qe, ks, ke)
                if scale_ds is not None:
                    ds.mul_(scale_ds)
                elif cfg.score_mod is not None and not closed_form:
                    grads = torch.autograd.grad(modded, [leaf, *captured], ds, allow_unused=True)
                    ds = grads[0]
                    for acc, g in zip(dcaptured, grads[1:]):
                        if g is not None:
                            acc += g
                ds.mul_(cfg.scale)
                dq_blk += _unfold(torch.matmul(_fold(ds, Hkv), kc[:, :, ks:ke]), H)
                dk[:, :, ks:ke] += torch.matmul(_fold(ds, Hkv).transpose(-2, -1), _fold(q_blk, Hkv))
            dq[:, :, qs:qe] = dq_blk
        grads_captured = [g if ctx.needs_input_grad[5 + i] else None for i, g in enumerate(dcaptured)]
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if dbias is None else dbias.to(bias.dtype), *grads_captured)


@torch.no_grad()
def recover_weights(q: Tensor, k: Tensor, lse: Tensor, *, heads: Tensor, rows: Tensor,
                    mask: Optional[Tensor], causal: bool, window: Optional[int], scale: float,
                    score_mod=None, mask_mod=None) -> Tensor:
    """Exact weights ``w_ij = e^(s_ij - LSE_i)`` for the chosen ``heads`` and query ``rows``.

    Costs ``O(len(heads) · len(rows) · Lk)``: only the requested part of the matrix is formed.
    The result is for inspection: it carries no gradient.
    """
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    cfg = _Config(causal=causal, window=window, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                  bool_mask=None, block_q=0, block_k=0, max_chunk=0)
    qs = q[:, heads][:, :, rows].to(cdt)                                  # (B, h, R, D)
    ks = k[:, heads // (H // Hkv)].to(cdt)                                # (B, h, Lk, D)
    s = torch.matmul(qs, ks.transpose(-2, -1)) * scale                    # (B, h, R, Lk)
    grids = _grids(B, heads, Lk - Lq + rows, torch.arange(Lk, device=q.device))
    if score_mod is not None:
        s = call_score_mod(cfg.score_mod, s, *grids)

    def pick(m):  # the chosen heads / rows of a (possibly broadcast) 4-D mask
        m = m if m.shape[1] == 1 else m[:, heads]
        return m if m.shape[2] == 1 else m[:, :, rows]

    is_bool = mask is not None and mask.dtype == torch.bool
    allowed = _allowed(cfg, grids, pick(mask) if is_bool else None)
    s = _finish_scores(s, pick(mask) if mask is not None and not is_bool else None, allowed)
    lse_sel = lse[:, heads][:, :, rows].unsqueeze(-1).to(cdt)
    lse_sel = torch.where(torch.isinf(lse_sel), torch.full_like(lse_sel, float("inf")), lse_sel)
    return torch.exp(s - lse_sel).to(q.dtype)


def _accumulate_block(dbias: Tensor, ds: Tensor, qs, qe, ks, ke) -> None:
    """Add a block's score gradient into a (possibly broadcast) bias gradient."""
    dims = [i for i in range(4) if dbias.shape[i] == 1 and ds.shape[i] != 1]
    g = ds.sum(dim=dims, keepdim=True) if dims else ds
    _slice_mask(dbias, qs, qe, ks, ke).add_(g)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
