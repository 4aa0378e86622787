"""Masks: which key each query may attend to.

Convention (as in SDPA): a boolean mask is True where attention is *allowed*.
Positions are absolute and aligned bottom-right: with ``Lq`` queries over ``Lk`` keys,
query row ``i`` sits at position ``p = Lk - Lq + i``. That is what decoding with a KV
cache needs (the one new query is the last position) and equals the usual top-left
alignment when ``Lq == Lk``.

Mask mods use FlexAttention's vocabulary: ``mask_mod(b, h, q_idx, kv_idx) -> bool``,
called here with broadcastable index tensors of shapes ``(B,1,1,1)``, ``(1,H,1,1)``,
``(1,1,Lq,1)`` and ``(1,1,1,Lk)``, so plain tensor code works unchanged.
"""
from __future__ import annotations

import functools

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, non_negative_int, positive_int, positive_number

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def positions(Lq: int, Lk: int, device=None) -> tuple[Tensor, Tensor]:
    """Absolute query and key positions, shaped ``(Lq, 1)`` and ``(1, Lk)``.

    ``q_pos[i] = Lk - Lq + i`` (bottom-right alignment), ``k_pos[j] = j``.
    """
    q_pos = torch.arange(Lk - Lq, Lk, device=device).unsqueeze(-1)
    k_pos = torch.arange(Lk, device=device).unsqueeze(0)
    return q_pos, k_pos


def index_grids(B: int, H: int, Lq: int, Lk: int, device=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable ``(b, h, q_idx, kv_idx)`` tensors for a score_mod / mask_mod call."""
    q_pos, k_pos = positions(Lq, Lk, device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    return b, h, q_pos.view(1, 1, Lq, 1), k_pos.view(1, 1, 1, Lk)


def causal_mask(Lq: int, Lk: int, device=None) -> Tensor:
    """``(Lq, Lk)`` bool: key ``j`` visible to query at position ``p`` iff ``j <= p``."""
    q_pos, k_pos = positions(Lq, Lk, device)
    return k_pos <= q_pos


def window_mask(Lq: int, Lk: int, window: int, *, causal: bool, device=None) -> Tensor:
    """``(Lq, Lk)`` bool sliding window: ``p - j < w``, and also ``j - p < w`` when not causal.

    With ``causal=True`` the causal constraint ``j <= p`` is included as well.
    """
    q_pos, k_pos = positions(Lq, Lk, device)
    d = q_pos - k_pos
    if causal:
        return (d >= 0) & (d < window)
    return d.abs() < window


def build_mask(
    *,
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    device,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Optional[int] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Optional[Tensor]:
    """Combine every boolean constraint into one mask broadcastable to ``(B, H, Lq, Lk)``.

    Returns ``None`` when nothing is masked. A float ``mask`` is not handled here: it is an
    additive bias (see :func:`split_mask`).
    """
    allowed: Optional[Tensor] = None

    def _and(m: Tensor) -> None:
        nonlocal allowed
        allowed = m if allowed is None else allowed & m

    if window is not None:
        _and(window_mask(Lq, Lk, window, causal=causal, device=device))
    elif causal:
        _and(causal_mask(Lq, Lk, device))
    if mask is not None:
        _and(mask)
    if mask_mod is not None:
        _and(evaluate_mask_mod(mask_mod, B, H, Lq, Lk, device))
    return allowed


def evaluate_mask_mod(mask_mod: MaskMod, B: int, H: int, Lq: int, Lk: int, device) -> Tensor:
    """Materialise a mask_mod as a bool tensor broadcastable to ``(B, H, Lq, Lk)``."""
    return call_mask_mod(mask_mod, *index_grids(B, H, Lq, Lk, device))


def call_mask_mod(mask_mod: MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod(b, h, q_idx, kv_idx)``, checked to be a bool tensor broadcastable to the grid."""
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = type(out).__name__ if not isinstance(out, Tensor) else f"a {out.dtype} tensor"
        raise ValueError(f"mask_mod must return a bool tensor, got {got}")
    grid = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    try:
        ok = torch.broadcast_shapes(out.shape, grid) == grid
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to "
            f"(B, H, Lq, Lk) = {tuple(grid)}"
        )
    return out


def call_score_mod(score_mod, s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``score_mod(s, b, h, q_idx, kv_idx)``, checked to return a tensor of the scores' shape and dtype."""
    out = score_mod(s, b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.shape != s.shape or out.dtype != s.dtype:
        got = f"shape {tuple(out.shape)}, dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"score_mod must return a tensor of the scores' shape {tuple(s.shape)} and dtype {s.dtype}, "
                         f"got {got}")
    return out


def additive_without_grads(score_mod, captured) -> bool:
    """A score_mod marked ``additive`` (it returns ``score + bias(b, h, q_idx, kv_idx)``) that reads no tensor
    needing a gradient: its backward is the identity on dS, in closed form."""
    return score_mod is not None and bool(getattr(score_mod, "additive", False)) and not captured


def derivative_without_grads(score_mod, captured) -> Optional[Callable[[Tensor], Tensor]]:
    """``score_mod.grad_from_output`` — ``d mod(s) / ds`` written in the mod's output ``y = mod(s)`` (softcap:
    ``1 - (y / c)²``; it must not modify ``y``) — when the mod declares one and reads no tensor needing a gradient;
    else None. The ``tiled`` backend's backward then scales ``dS`` by it, element-wise, instead of running autograd
    per block."""
    if score_mod is None or captured:
        return None
    return getattr(score_mod, "grad_from_output", None)


def captured_tensors(fn, _depth: int = 0) -> list[Tensor]:
    """Tensors requiring grad that ``fn`` reads: closure cells, global names its code uses,
    ``functools.partial`` arguments, the module of a bound method, and the parameters of modules
    found there. Tensors reached any other way (e.g. attributes of an object held in a global)
    get no gradient through the tiled backend.
    """
    found: dict[int, Tensor] = {}

    def visit(obj, depth):
        if isinstance(obj, Tensor):
            if obj.requires_grad:
                found.setdefault(id(obj), obj)
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                if p.requires_grad:
                    found.setdefault(id(p), p)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, depth)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth)
        elif depth < 4 and isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif depth < 4 and callable(obj):
            visit(getattr(obj, "__self__", None), depth + 1)
            code, glb = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
            if code is not None and glb is not None:  # globals the function reads (notebooks)
                visit([glb[n] for n in code.co_names if n in glb], depth + 1)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass

    visit(fn, _depth)
    return list(found.values())


def softcap_score_mod(cap: float) -> Callable:
    """Logit soft-capping (Gemma 2's ``attn_logit_softcapping``, Grok-1): ``score' = c · tanh(score / c)``.

    Scores stay inside ``(-c, c)``, smoothly: a FlexAttention-style ``score_mod``. It carries its derivative
    ``d score' / d score = 1 - (score' / c)²`` as ``grad_from_output``, so the ``tiled`` backend computes the
    backward in closed form, with no autograd inside the blocks.

    Raises:
        ValueError: ``cap`` is not a positive finite number.
    """
    positive_number("cap", cap, finite=True)
    cap = float(cap)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / cap) * cap

    def grad_from_output(y: Tensor) -> Tensor:
        return (y / cap).square_().neg_().add_(1.0)

    score_mod.grad_from_output = grad_from_output
    score_mod.softcap = cap  # what the tiled backend's C++ kernel computes itself
    return score_mod


def split_mask(mask: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Split a user mask into ``(bool_mask, float_bias)``; exactly one of them is set."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return mask, None
    return None, mask


# ---- mask_mod builders (FlexAttention-compatible) -------------------------------------

def causal_mod() -> MaskMod:
    """``kv_idx <= q_idx``."""
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx


def sliding_window_mod(window: int, *, causal: bool = True) -> MaskMod:
    """``0 <= q_idx - kv_idx < window`` (causal) or ``|q_idx - kv_idx| < window``."""
    positive_int("window", window)
    boolean("causal", causal)
    if causal:
        return lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx) >= 0) & ((q_idx - kv_idx) < window)
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < window


def prefix_lm_mod(prefix_len: int) -> MaskMod:
    """Bidirectional over the first ``prefix_len`` keys, causal after them: position p sees the keys
    ``[0, max(prefix_len, p + 1))`` (its ``key_spans``, which the tiled backend's C++ kernel takes)."""
    non_negative_int("prefix_len", prefix_len)

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (kv_idx <= q_idx)

    def key_spans(Lk: int) -> Tensor:
        p = torch.arange(Lk)
        return torch.stack([torch.zeros_like(p), (p + 1).clamp(min=prefix_len).clamp(max=Lk)]).unsqueeze(0)

    mod.key_spans = key_spans
    return mod


def document_mod(doc_ids: Tensor) -> MaskMod:
    """Block-diagonal mask for packed documents: attend only within the same document.

    ``doc_ids`` is an integer tensor ``(L,)`` or ``(B, L)`` giving each position's document number.
    """
    if (not isinstance(doc_ids, Tensor) or doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point()
            or doc_ids.is_complex() or doc_ids.dtype == torch.bool):
        raise ValueError(f"doc_ids must be an integer tensor (L,) or (B, L) of document numbers, got "
                         f"{getattr(doc_ids, 'dtype', type(doc_ids).__name__)} "
                         f"{tuple(getattr(doc_ids, 'shape', ()))}")
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)

    def mod(b, h, q_idx, kv_idx):
        row = b if ids.shape[0] > 1 else torch.zeros_like(b)
        return ids[row, q_idx] == ids[row, kv_idx]

    # per length and per contents of ``ids``: refilling it in place (its version) or swapping its storage gives new spans
    spans = functools.lru_cache(maxsize=4)(lambda Lk, version, ptr: _document_spans(ids, Lk))
    mod.key_spans = lambda Lk: spans(Lk, ids._version, ids.data_ptr())
    mod.cache_key = lambda: (ids._version, ids.data_ptr())
    return mod


def _document_spans(ids: Tensor, Lk: int) -> Optional[Tensor]:
    """``(Bd, 2, Lk)``: each position's document as the key interval ``[start, end)`` of its run, when every document
    is one contiguous run of ``Lk`` positions (packed sequences); None otherwise (the mask is then no interval)."""
    if ids.shape[-1] != Lk or ids.is_floating_point():
        return None
    ids = ids.cpu()
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]                                  # a run starts here
    if any(int(n.sum()) != row.unique().numel() for n, row in zip(new, ids)):
        return None                                                          # a document in several runs
    pos = torch.arange(Lk).expand_as(ids)
    start = torch.where(new, pos, 0).cummax(dim=-1).values
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]                                               # a run ends after here
    end = torch.where(last, pos + 1, Lk).flip(-1).cummin(dim=-1).values.flip(-1)
    return torch.stack([start, end], dim=1).contiguous()


def _check_mods(mods: tuple) -> None:
    """``mods`` of :func:`and_masks` / :func:`or_masks`: at least one, each callable."""
    if not mods or not all(callable(m) for m in mods):
        raise TypeError(f"mods must be one or more mask_mods (callables), got "
                        f"{[type(m).__name__ for m in mods] or 'none'}")


def and_masks(*mods: MaskMod) -> MaskMod:
    """Logical AND of several mask_mods."""
    _check_mods(mods)

    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mod


def or_masks(*mods: MaskMod) -> MaskMod:
    """Logical OR of several mask_mods."""
    _check_mods(mods)

    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return mod


def padding_mask(lengths: Tensor, L: int) -> Tensor:
    """``(B, 1, 1, L)`` bool mask, True for the first ``lengths[b]`` keys of each sequence."""
    return (torch.arange(L, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).view(-1, 1, 1, L)


# ---- sparse patterns: Sparse Transformer (Child et al. 2019), BigBird (Zaheer et al. 2020) ----

def _merge(h: Tensor, a1: Tensor, a2: Tensor, split_heads: bool) -> Tensor:
    """``A⁽¹⁾ ∪ A⁽²⁾``, or ``A⁽¹⁾`` on even heads and ``A⁽²⁾`` on odd heads."""
    return torch.where(h % 2 == 0, a1, a2) if split_heads else a1 | a2


def strided_mod(stride: int, *, causal: bool = True, split_heads: bool = False) -> MaskMod:
    """The Sparse Transformer's *strided* pattern (Child et al. 2019, §4.2), stride ``l``.

    The paper factorises attention over two heads::

        A⁽¹⁾_i = {t, t+1, ..., i}  for t = max(0, i - l)      # the previous l positions
        A⁽²⁾_i = {j : (i - j) mod l = 0}                      # every l-th position before i

    By default both are merged into one mask, ``A⁽¹⁾ ∪ A⁽²⁾`` (key ``j`` visible from query
    ``i`` iff ``0 <= i - j <= l`` or ``(i - j) mod l = 0`` with ``j <= i``), as most
    implementations do. ``split_heads=True`` keeps the factorisation: even heads attend with
    ``A⁽¹⁾``, odd heads with ``A⁽²⁾``. ``causal=False`` mirrors both sets (``|i - j|`` for
    ``i - j``). Positions are absolute (bottom-right aligned), like every mask_mod here.

    Raises:
        ValueError: ``stride`` is not a positive int.
        TypeError: ``causal`` or ``split_heads`` is not a bool.
    """
    positive_int("stride", stride)
    boolean("causal", causal)
    boolean("split_heads", split_heads)

    def mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx if causal else (q_idx - kv_idx).abs()
        local = (d >= 0) & (d <= stride)                    # A⁽¹⁾
        every_lth = (d >= 0) & (d % stride == 0)            # A⁽²⁾
        return _merge(h, local, every_lth, split_heads)

    return mod


def fixed_mod(block: int, *, num_summary: int = 1, causal: bool = True, split_heads: bool = False) -> MaskMod:
    """The Sparse Transformer's *fixed* pattern (Child et al. 2019, §4.2), block ``l``, ``c`` summaries.

    ::

        A⁽¹⁾_i = {j : ⌊j / l⌋ = ⌊i / l⌋}                       # the query's own block
        A⁽²⁾_i = {j : j mod l ∈ {t, t+1, ..., l}},  t = l - c   # the last c "summary" cells of every block

    By default both are merged, ``A⁽¹⁾ ∪ A⁽²⁾``; ``split_heads=True`` gives ``A⁽¹⁾`` to even heads
    and ``A⁽²⁾`` to odd heads (the paper's factorisation). ``causal=True`` (the paper's setting)
    further requires ``j <= i``; ``causal=False`` drops it (a query sees its whole block and the
    summaries of every block, before or after it).

    Raises:
        ValueError: ``block`` is not a positive int, or ``num_summary`` is not in ``[1, block]``.
        TypeError: ``causal`` or ``split_heads`` is not a bool.
    """
    positive_int("block", block)
    positive_int("num_summary", num_summary)
    if num_summary > block:
        raise ValueError(f"num_summary must be <= block={block}, got {num_summary}")
    boolean("causal", causal)
    boolean("split_heads", split_heads)

    def mod(b, h, q_idx, kv_idx):
        same_block = (q_idx // block) == (kv_idx // block)         # A⁽¹⁾
        summary = (kv_idx % block) >= block - num_summary          # A⁽²⁾
        out = _merge(h, same_block, summary, split_heads)
        return out & (kv_idx <= q_idx) if causal else out

    return mod


def bigbird_layout(block: int, *, seq_len: int, num_global_blocks: int = 1, window_blocks: int = 3,
                   num_random_blocks: int = 2, seed: int = 0) -> Tensor:
    """BigBird's block layout (Zaheer et al. 2020): ``(n, n)`` bool, ``n = ⌈seq_len / block⌉``.

    ``layout[I, J]`` is True iff query block ``I`` may attend to key block ``J``; it is the union of

    - *global*: the first ``num_global_blocks`` blocks attend to every block and every block
      attends to them (``layout[I, J]`` for ``I < g`` or ``J < g``);
    - *window*: ``|I - J| <= window_blocks // 2`` (the query's block and its neighbours);
    - *random*: for each non-global query block, ``num_random_blocks`` key blocks drawn
      uniformly without replacement from those not already visible (fewer when fewer remain),
      from a ``torch.Generator`` seeded with ``seed`` — the same layout for the same arguments.

    Raises:
        ValueError: an argument is out of range (``window_blocks`` must be a positive odd int).
    """
    positive_int("block", block)
    positive_int("seq_len", seq_len)
    non_negative_int("num_global_blocks", num_global_blocks)
    positive_int("window_blocks", window_blocks)
    if window_blocks % 2 == 0:
        raise ValueError(f"window_blocks must be odd (the query's block and as many on each side), got {window_blocks}")
    non_negative_int("num_random_blocks", num_random_blocks)
    non_negative_int("seed", seed)
    n = -(-seq_len // block)
    idx = torch.arange(n)
    layout = (idx[:, None] - idx[None, :]).abs() <= window_blocks // 2  # (n, n)
    g = min(num_global_blocks, n)
    layout[:g, :] = True
    layout[:, :g] = True
    gen = torch.Generator().manual_seed(seed)
    for i in range(g, n):
        candidates = (~layout[i]).nonzero().flatten()
        layout[i, candidates[torch.randperm(len(candidates), generator=gen)[:num_random_blocks]]] = True
    return layout


def bigbird_mod(block: int, *, seq_len: int, num_global_blocks: int = 1, window_blocks: int = 3,
                num_random_blocks: int = 2, seed: int = 0, device=None) -> MaskMod:
    """BigBird block-sparse attention (Zaheer et al. 2020) as a mask_mod; non-causal.

    "(i) a set of g global tokens attending on all parts of the sequence, (ii) all tokens
    attending to a set of w local neighboring tokens, and (iii) all tokens attending to a set
    of r random tokens", blockified: key ``j`` is visible from query ``i`` iff
    ``layout[⌊i / block⌋, ⌊j / block⌋]`` with the layout of :func:`bigbird_layout` (global
    blocks are the first ``num_global_blocks``). The random blocks are drawn once, here, so the
    mod is deterministic and can be evaluated block by block. Positions must lie in
    ``[0, seq_len)``; ``device`` is where the layout lives (that of the index tensors).

    Raises:
        ValueError: as :func:`bigbird_layout`.
    """
    layout = bigbird_layout(block, seq_len=seq_len, num_global_blocks=num_global_blocks,
                            window_blocks=window_blocks, num_random_blocks=num_random_blocks,
                            seed=seed).to(device)
    def mod(b, h, q_idx, kv_idx):
        return layout[q_idx // block, kv_idx // block]

    # what the tiled backend's C++ kernel reads (visible blocks only); a block past seq_len is one block, the same
    # as one of seq_len positions (whose tiles then stay within the sequence)
    mod.block_layout = (layout, min(block, seq_len))
    return mod
