"""Sliding-window attention as a few large batched products: the ``tiled`` backend's path for a narrow band.

With a window ``w`` every query block of ``b`` rows sees the same number of keys, so all blocks of all
heads are computed by *one* batched matrix product instead of a Python loop over blocks. The keys are
laid out once, per head, in a buffer whose row ``ρ`` holds key position ``ρ - P`` (``P = w - 1 - (Lk -
Lq)``; rows outside ``[0, Lk)`` are zero); query block ``i`` then reads rows ``[i·b, i·b + S)``, a view
of that buffer (overlapping, no copy) with ``S = ⌈(b + w - 1) / b⌉·b`` (``b + 2w - 2`` for a
bidirectional window). In block coordinates the band is the same for every block::

    d = (query position) - (key position) = t - s + w - 1      (row t, column s of a block)
    causal: 0 <= d < w          bidirectional: |d| < w          and  0 <= key position < Lk

Forward, per group of blocks (a few MiB of scores, so the element-wise passes stay in cache)::

    S = (κ Q_blk) K_spanᵀ  → score_mod → mask;   m = rowmax S;   P = e^(S - m);   l = rowsum P
    O_blk = P V_span / l;   LSE = m + log l                                 (l = 0: O = 0, LSE = -inf)

Backward reuses the forward's ``e^(S - m)`` and ``1/l`` when they fit in :data:`KEEP_ELEMENTS` and the
score_mod, if any, is additive with no gradient to return
(:func:`~attnlab.functional.masks.additive_without_grads`); else it recomputes ``P = e^(S - LSE)``.
With ``D = rowsum(dO ∘ O)``::

    dV_span = Pᵀ dO;  dS = P ∘ (dO V_spanᵀ - D);  dQ_blk = κ dS K_span;  dK_span = dSᵀ (κ Q_blk)

A span covers ``S / b`` consecutive key blocks, so ``dK`` and ``dV`` are gathered back by ``S / b``
shifted additions. The products do ``S / w`` of the band's exact work (≈ 1.125 at ``b = 32, w = 256``);
each head's buffer carries ``S / b - 1`` blocks of padding rows at its end, so that one stride walks the
blocks of every head. Time ``O(N · w)``; memory ``O(N)`` beyond one group of scores. GQA copies each
key/value head once per query head into the buffer (``O(N·D)``); bf16/fp16 inputs are computed in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from attnlab.backends import reference
from attnlab.functional.masks import additive_without_grads, call_mask_mod, call_score_mod, derivative_without_grads

BLOCK = 32                  # query rows per block (measured: 32 beats 64 and 128 at w = 256)
GROUP_ELEMENTS = 1 << 20    # scores per group of blocks (4 MiB in float32)
KEEP_ELEMENTS = 1 << 26     # backward reuses the forward's e^(S - m) up to this many scores (256 MiB in float32)


def applies(Lq: int, Lk: int, window: Optional[int], causal: bool, block: int = BLOCK) -> bool:
    """Whether the banded layout pays: a window narrow enough that the padding blocks cost ≤ 1/3."""
    if window is None or window >= Lk:
        return False
    m = _span_blocks(window, causal, block)
    return math.ceil(Lq / block) >= 2 * (m - 1)


def saves_work(Lq: int, Lk: int, window: Optional[int], causal: bool, block: int = BLOCK) -> bool:
    """Whether the banded path does at most half the work of dense attention (a span of ``S`` keys per row
    against ``Lk / 2`` on average if causal, else ``Lk``): where it does not, a fused dense kernel with a mask
    is faster."""
    dense = Lk / 2 if causal else Lk
    return applies(Lq, Lk, window, causal, block) and 2 * _span_blocks(window, causal, block) * block <= dense


def _span_blocks(window: int, causal: bool, block: int) -> int:
    return math.ceil((block + (window - 1) * (1 if causal else 2)) / block)


@dataclass
class _Layout:
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    b: int      # rows per block
    m: int      # key blocks per span
    nb: int     # blocks per head, padding blocks included
    P: int      # buffer row of key position 0
    window: int
    causal: bool
    scale: float

    @property
    def S(self) -> int:
        return self.m * self.b

    @property
    def rows(self) -> int:  # buffer rows per head
        return self.nb * self.b

    @property
    def blocks(self) -> int:
        return self.B * self.H * self.nb

    def key_rows(self) -> tuple[int, int]:
        """Buffer rows ``[lo, hi)`` that hold key positions ``[lo - P, hi - P)`` (the rest stays zero)."""
        return max(0, self.P), min(self.rows, self.Lk + self.P)

    def groups(self) -> list[tuple[int, int]]:
        """Ranges of block indices ``[J0, J1)``: whole heads, or part of one head."""
        per_head = self.rows * self.S
        if per_head <= GROUP_ELEMENTS:
            heads = GROUP_ELEMENTS // per_head
            return [(h * self.nb, min(h + heads, self.B * self.H) * self.nb) for h in range(0, self.B * self.H, heads)]
        step = max(1, GROUP_ELEMENTS // (self.b * self.S))
        return [(h * self.nb + i, h * self.nb + min(i + step, self.nb))
                for h in range(self.B * self.H) for i in range(0, self.nb, step)]


def _layout(q: Tensor, k: Tensor, window: int, causal: bool, scale: float, block: int) -> _Layout:
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    m = _span_blocks(window, causal, block)
    nb = math.ceil(Lq / block) + m - 1
    return _Layout(B=B, H=H, Hkv=k.shape[1], Lq=Lq, Lk=Lk, b=block, m=m, nb=nb, P=window - 1 - (Lk - Lq),
                   window=window, causal=causal, scale=scale)


def _keys_buffer(x: Tensor, L: _Layout, dtype) -> Tensor:
    """``(B·H·nb + m - 1)·b × D`` rows: each query head's keys (or values) at rows ``position + P``, zero elsewhere."""
    D = x.shape[-1]
    buf = x.new_empty((L.blocks + L.m - 1) * L.b, D, dtype=dtype)
    buf[L.B * L.H * L.rows:].zero_()
    heads = buf[: L.B * L.H * L.rows].view(L.B, L.Hkv, L.H // L.Hkv, L.rows, D)
    lo, hi = L.key_rows()
    heads[:, :, :, :max(lo, 0)].zero_()
    heads[:, :, :, max(hi, lo):].zero_()
    if hi > lo:
        heads[:, :, :, lo:hi] = x[:, :, None, lo - L.P:hi - L.P]
    return buf


def _spans(buf: Tensor, L: _Layout, J0: int, J1: int) -> Tensor:
    """The key spans of blocks ``J0..J1``: ``(J1 - J0, S, D)``, overlapping views of ``buf``."""
    D = buf.shape[-1]
    return buf.as_strided((J1 - J0, L.S, D), (L.b * D, D, 1), J0 * L.b * D)


def _rows_buffer(x: Tensor, L: _Layout, dtype, scale: float = 1.0) -> Tensor:
    """``(B·H·nb, b, ·)``: query-side rows in blocks (padding rows zero), times ``scale``."""
    buf = x.new_empty(L.B, L.H, L.rows, x.shape[-1], dtype=dtype)
    buf[:, :, L.Lq:].zero_()
    rows = buf[:, :, :L.Lq].copy_(x)
    if scale != 1.0:
        rows.mul_(scale)
    return buf.view(L.blocks, L.b, x.shape[-1])


def _unblock(x: Tensor, L: _Layout) -> Tensor:
    """``(B·H·nb, b, ·) -> (B, H, Lq, ·)``."""
    return x.reshape(L.B, L.H, L.rows, x.shape[-1])[:, :, :L.Lq]


class _Positions:
    """Per-call tables over one head's buffer rows: which (row, span column) pairs the window allows, and
    the clamped positions score_mod / mask_mod see (built only when a mod needs them)."""

    def __init__(self, L: _Layout, device, need_grids: bool) -> None:
        t = torch.arange(L.b, device=device).view(-1, 1)
        s = torch.arange(L.S, device=device).view(1, -1)
        d = t - s + (L.window - 1)                                             # the same band in every block
        band = (d >= 0) & (d < L.window) if L.causal else d.abs() < L.window
        kv_pos = (torch.arange(L.nb, device=device) * L.b).view(-1, 1) + s - L.P  # (nb, S)
        key_ok = (kv_pos >= 0) & (kv_pos < L.Lk)
        self.blocked = ~(band.view(1, L.b, L.S) & key_ok.view(L.nb, 1, L.S)).view(L.rows, L.S)
        # the rectangles (rows, columns) that hold masked pairs: the band's ragged edge columns in every row,
        # and its full middle columns only in the first/last blocks, whose keys run past the sequence
        edge = ~band.all(dim=0)
        mid_bad = ~key_ok[:, ~edge].all(dim=1) if bool((~edge).any()) else torch.zeros(L.nb, dtype=torch.bool)
        self.rects = [(0, L.rows, c0, c1) for c0, c1 in true_runs(edge)]
        self.rects += [(i0 * L.b, i1 * L.b, c0, c1) for i0, i1 in true_runs(mid_bad) for c0, c1 in true_runs(~edge)]
        self.q_pos = self.kv_pos = None
        if need_grids:  # padding rows repeat the last real row; padding columns are clamped into range (masked)
            self.q_pos = (torch.arange(L.rows, device=device).clamp(max=L.Lq - 1) + (L.Lk - L.Lq)).view(-1, 1)
            self.kv_pos = kv_pos.clamp(0, L.Lk - 1).repeat_interleave(L.b, dim=0)


class _Group:
    """The blocks ``J0..J1`` (whole heads, or part of one): their scores' 4-D shape, mask and mod grids."""

    def __init__(self, L: _Layout, pos: _Positions, J0: int, J1: int, mask_mod) -> None:
        self.J0, self.J1 = J0, J1
        bh0, i0 = divmod(J0, L.nb)
        nh = max(1, (J1 - J0) // L.nb)
        i1 = L.nb if nh > 1 or J1 - J0 == L.nb else i0 + (J1 - J0)
        r0, r1 = i0 * L.b, i1 * L.b
        self.shape = (1, nh, r1 - r0, L.S)   # the group's scores as (1, heads, rows, S)
        self.blocked = pos.blocked[r0:r1].view(1, 1, r1 - r0, L.S)
        self.rects = [(max(a, r0) - r0, min(b, r1) - r0, c0, c1) for a, b, c0, c1 in pos.rects if a < r1 and b > r0]
        self.grids = None
        if pos.q_pos is not None:
            bh = torch.arange(bh0, bh0 + nh, device=pos.blocked.device).view(1, nh, 1, 1)
            self.grids = (bh // L.H, bh % L.H, pos.q_pos[r0:r1].view(1, 1, -1, 1),
                          pos.kv_pos[r0:r1].view(1, 1, r1 - r0, L.S))
        if mask_mod is not None:
            self.blocked = self.blocked | ~call_mask_mod(mask_mod, *self.grids)
            self.rects = [(0, r1 - r0, 0, L.S)]

    def scores(self, qb: Tensor, kbuf: Tensor, L: _Layout, score_mod, *, keep_graph: bool = False, out=None,
               derivative=None):
        """``(leaf, modded, S)``: ``S`` masked, as ``(J1 - J0, b, S)`` (in ``out`` when given);
        ``leaf``/``modded`` carry score_mod's graph for its gradient; with ``derivative`` (a closed-form
        ``grad_from_output``), ``modded`` is instead its value on the modded scores, taken before the mask."""
        raw = torch.bmm(qb[self.J0:self.J1], _spans(kbuf, L, self.J0, self.J1).transpose(1, 2), out=out)
        leaf = modded = None
        s = raw
        if score_mod is not None:
            with torch.set_grad_enabled(keep_graph):
                leaf = raw.view(self.shape).detach().requires_grad_(keep_graph)
                modded = call_score_mod(score_mod, leaf, *self.grids)
            s = (modded.detach().clone() if keep_graph else modded).reshape(raw.shape)
            if derivative is not None:
                modded = derivative(s)
            if out is not None:
                s = out.copy_(s)
        s4 = s.view(self.shape)
        for a, b, c0, c1 in self.rects:  # only where the mask has holes (the band's edges): fewer bytes touched
            s4[:, :, a:b, c0:c1].masked_fill_(self.blocked[:, :, a:b, c0:c1], float("-inf"))
        return leaf, modded, s


def true_runs(flags: Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in a 1-D bool tensor."""
    padded = torch.cat([flags.new_zeros(1), flags, flags.new_zeros(1)]).to(torch.int8)
    change = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return list(zip(change[0::2], change[1::2]))


def _shift_add(dst: Tensor, spans: Tensor, L: _Layout, J0: int) -> None:
    """Add span gradients ``(n, S, D)`` of blocks ``J0..`` into the ``(·, b, D)`` buffer ``dst``.

    Key block ``J0 + j + t`` is part ``t`` of block ``j``'s span. Part 0 is *copied*: the caller visits
    the groups from last to first, so rows ``J0..J0+n`` have received no other part yet, and only the
    ``m - 1`` rows past the last block need zeros beforehand.
    """
    n, _, D = spans.shape
    parts = spans.view(n, L.m, L.b, D)
    dst[J0:J0 + n].copy_(parts[:, 0])
    for t in range(1, L.m):
        dst[J0 + t:J0 + t + n] += parts[:, t]


class _BandedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, L: _Layout, score_mod, mask_mod, q, k, v, *captured):
        cdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qb = _rows_buffer(q, L, cdt, L.scale)
        kbuf, vbuf = _keys_buffer(k, L, cdt), _keys_buffer(v, L, cdt)
        ob = q.new_empty(L.blocks, L.b, v.shape[-1], dtype=cdt)
        lse = q.new_empty(L.blocks, L.b, 1, dtype=cdt)
        inv_l = q.new_empty(L.blocks, L.b, 1, dtype=cdt)
        # e^(S - m) of every block is kept for backward when it is small enough and no score_mod needs autograd
        plain = score_mod is None or additive_without_grads(score_mod, captured)
        keep = plain and any(ctx.needs_input_grad[3:6]) and L.blocks * L.b * L.S <= KEEP_ELEMENTS
        p_all = q.new_empty(L.blocks, L.b, L.S, dtype=cdt) if keep else None
        pos = _Positions(L, q.device, need_grids=score_mod is not None or mask_mod is not None)
        for J0, J1 in L.groups():
            g = _Group(L, pos, J0, J1, mask_mod)
            _, _, s = g.scores(qb, kbuf, L, score_mod, out=None if p_all is None else p_all[J0:J1])
            mx = torch.nan_to_num(s.amax(dim=-1, keepdim=True), neginf=0.0)   # an empty row: 0, not -inf
            p = s.sub_(mx).exp_()
            l = p.sum(dim=-1, keepdim=True)
            torch.bmm(p, _spans(vbuf, L, J0, J1), out=ob[J0:J1])
            torch.reciprocal(l.clamp_min(1.0), out=inv_l[J0:J1])  # l >= 1 on a non-empty row (max gives e^0)
            ob[J0:J1].mul_(inv_l[J0:J1])
            torch.add(mx, l.log_(), out=lse[J0:J1])                # log 0 = -inf on an empty row
        out = _unblock(ob, L).to(q.dtype)
        ctx.layout, ctx.score_mod, ctx.mask_mod, ctx.cdt = L, score_mod, mask_mod, cdt
        ctx.derivative = None if plain else derivative_without_grads(score_mod, captured)
        ctx.autograd_mod = not plain and ctx.derivative is None
        ctx.q_dtype, ctx.k_dtype, ctx.v_dtype = q.dtype, k.dtype, v.dtype
        ctx.keep = keep
        kept = (p_all, inv_l) if keep else (lse,)
        ctx.save_for_backward(qb, kbuf, vbuf, ob, *kept, q, k, v, *captured)  # q, k, v: for create_graph=True
        ctx.mark_non_differentiable(lse)
        return out, _unblock(lse, L).squeeze(-1).to(q.dtype)

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        L: _Layout = ctx.layout
        qb, kbuf, vbuf, ob, *rest = ctx.saved_tensors
        (p_all, inv_l), (q, k, v, *captured) = (rest[:2], rest[2:]) if ctx.keep else ((None, None), rest[1:])
        if torch.is_grad_enabled():  # create_graph=True: gradients differentiable again, from the formula
            return (None, None, None, *reference.formula_grads(
                d_out, q, k, v, captured, ctx.needs_input_grad[3:], compute_dtype=ctx.cdt, mask=None,
                causal=L.causal, window=L.window, scale=L.scale, score_mod=ctx.score_mod, mask_mod=ctx.mask_mod))
        dob = _rows_buffer(d_out, L, ctx.cdt)
        delta = (dob * ob).sum(dim=-1, keepdim=True)                           # D = rowsum(dO ∘ O)
        if ctx.keep:  # P = e^(S - m) / l: the 1/l is folded into dO and D (dO/l gives dV and dP/l)
            dob.mul_(inv_l)
            delta.mul_(inv_l)
        else:
            lse = rest[0]
            lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
        dqb = torch.empty_like(qb)
        dk_rows = qb.new_empty(L.blocks + L.m - 1, L.b, kbuf.shape[-1])
        dv_rows = qb.new_empty(L.blocks + L.m - 1, L.b, vbuf.shape[-1])
        dk_rows[L.blocks:].zero_()
        dv_rows[L.blocks:].zero_()
        dcaptured = [torch.zeros_like(t) for t in captured]
        pos = _Positions(L, qb.device, need_grids=ctx.score_mod is not None or ctx.mask_mod is not None)
        for J0, J1 in reversed(L.groups()):  # last to first: see _shift_add
            if ctx.keep:
                p = p_all[J0:J1]
            else:
                g = _Group(L, pos, J0, J1, ctx.mask_mod)
                leaf, modded, s = g.scores(qb, kbuf, L, ctx.score_mod, keep_graph=ctx.autograd_mod,
                                           derivative=ctx.derivative)
                p = s.sub_(lse_safe[J0:J1]).exp_()                                # P = e^(S - LSE)
            do = dob[J0:J1]
            _shift_add(dv_rows, torch.bmm(p.transpose(1, 2), do), L, J0)
            ds = torch.bmm(do, _spans(vbuf, L, J0, J1).transpose(1, 2)).sub_(delta[J0:J1]).mul_(p)
            if ctx.derivative is not None:  # closed form: dS_raw = dS ∘ mod'(s) (softcap: 1 - (s'/c)²)
                ds.mul_(modded)
            elif ctx.autograd_mod:
                grads = torch.autograd.grad(modded, [leaf, *captured], ds.view(g.shape), allow_unused=True)
                ds = grads[0].view_as(ds)
                for acc, gr in zip(dcaptured, grads[1:]):
                    if gr is not None:
                        acc += gr
            torch.bmm(ds, _spans(kbuf, L, J0, J1), out=dqb[J0:J1])
            _shift_add(dk_rows, torch.bmm(ds.transpose(1, 2), qb[J0:J1]), L, J0)  # qb holds κ Q
        dq = _unblock(dqb, L).mul(L.scale).to(ctx.q_dtype)
        dk, dv = _keys_grad(dk_rows, L, ctx.k_dtype), _keys_grad(dv_rows, L, ctx.v_dtype)
        grads_captured = [gr if ctx.needs_input_grad[6 + i] else None for i, gr in enumerate(dcaptured)]
        return (None, None, None, dq, dk, dv, *grads_captured)


def _keys_grad(rows: Tensor, L: _Layout, dtype) -> Tensor:
    """Buffer-row gradients -> ``(B, Hkv, Lk, D)``: summed over the query heads of each group."""
    D = rows.shape[-1]
    heads = rows.view(-1, D)[: L.B * L.H * L.rows].view(L.B, L.Hkv, L.H // L.Hkv, L.rows, D)
    out = rows.new_empty(L.B, L.Hkv, L.Lk, D)
    lo, hi = L.key_rows()
    out[:, :, :max(lo - L.P, 0)].zero_()   # keys no query sees (a window shorter than Lk - Lq)
    if hi > lo:
        torch.sum(heads[:, :, :, lo:hi], dim=2, out=out[:, :, lo - L.P:hi - L.P]) if L.H > L.Hkv \
            else out[:, :, lo - L.P:hi - L.P].copy_(heads[:, :, 0, lo:hi])
    out[:, :, max(hi - L.P, lo - L.P, 0):].zero_()
    return out.to(dtype)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, scale: float,
                     score_mod=None, mask_mod=None, captured=(), block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``(out (B, H, Lq, Dv), lse (B, H, Lq))`` of attention limited to a window of ``window`` positions.

    Arguments as :func:`attnlab.backends.tiled.tiled_attention` without a dense mask; ``captured``: tensors
    ``score_mod`` reads that should receive gradients.
    """
    L = _layout(q, k, window, causal, scale, block)
    return _BandedAttention.apply(L, score_mod, mask_mod, q, k, v, *captured)
