"""Multi-head attention, a drop-in for ``torch.nn.MultiheadAttention(batch_first=True)``.

``MultiHead(Q, K, V) = Concat(head_1, …, head_H) W_O``,
``head_i = Attention(Q W_Q^i, K W_K^i, V W_V^i)``,
``Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d_k)) V`` (Vaswani et al. 2017), computed by the one
pipeline :func:`attnlab.attention`, so every backend, mask, mod and normaliser is available.
Grouped-query attention (Ainslie et al. 2023) shares each key/value head among
``num_heads // num_kv_heads`` query heads; ``num_kv_heads=1`` is multi-query attention.
QK-norm (Henry et al. 2020; OLMo 2, Qwen 3) normalises each head's query and key before RoPE and the scores:
``q_h ← N_q(q_h)``, ``k_h ← N_k(k_h)``; with RMSNorms (learned gains ``g`` of ``head_dim`` D, shared by the heads;
``LayerSpec(qk_norm=True)`` builds them) every score is bounded, ``|κ q·k| ≤ √D · max|g_q| · max|g_k|``
(κ = 1/√D; RoPE keeps norms), whatever the weights.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import boolean, float_dtype, is_int, one_of, positive_int, rate
from attnlab._limits import check_memory
from attnlab.backends import BACKENDS
from attnlab.functional.scores import check_normalize
from attnlab import _native
from attnlab.modules.cache import KVCache
from attnlab.backends.dispatch import (all_finite, attend, attend_plain, attend_step, attention_weights, keeps_lse,
                                       position_bias_terms)
from attnlab.functional.request import default_scale, prepare


class MultiheadAttention(nn.Module):
    """Self / cross multi-head attention with GQA/MQA, a KV cache, RoPE and position biases.

    Args:
        embed_dim: model width E (query input and output).
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (default H); ``H % Hkv == 0``.
        kdim, vdim: key / value input widths (default E). When both equal E the q, k, v
            projections are packed in one ``in_proj`` Linear (rows q, k, v — torch's layout).
        bias: biases on the projections.
        dropout: dropout on the attention weights, in training.
        head_dim: per-head width (default E // H).
        scale: the score scale κ in ``softmax(κ Q Kᵀ) V`` (default ``1 / sqrt(head_dim)``; T5: 1, its
            scaling folded into ``W_Q``).
        rotary: module applied to q and k as ``rotary(x, positions)`` (e.g. ``RotaryEmbedding``).
        position_bias: module giving an additive bias ``(1, H, Lq, Lk)`` as
            ``position_bias(q_positions, k_positions)`` (e.g. ``ALiBi``, ``T5RelativeBias``); a
            dense bias when small, its ``score_mod()`` (tiled backend, O(N) memory) when large.
        backend, normalize, top_k, window: passed to :func:`attnlab.attention`.
        q_norm, k_norm: modules applied to each head's query / key ``(B, H, L, head_dim)`` before RoPE (QK-norm:
            ``attnlab.nn.RMSNorm(head_dim)`` each); submodules of this attention (not shared, unlike ``rotary``).

    Forward arguments and masks follow ``torch.nn.MultiheadAttention``: boolean
    ``key_padding_mask (B, S)`` and ``attn_mask (L, S) | (B·H, L, S)`` are True where attention
    is *not* allowed; float masks are added. ``is_causal=True`` applies a causal mask (ANDed
    with ``attn_mask`` when both are given). Returned weights are taken before dropout.

    Weights (``need_weights=True``) never switch the forward to a slower path when nothing needs their
    gradient (inference, ``torch.no_grad``): the output comes from a backend that keeps each row's
    log-sum-exp and the weights follow from it, ``w_ij = e^(s_ij - LSE_i)`` (:func:`attnlab.attention_weights`).
    Where their gradient is needed, or the normaliser is not softmax, they are materialised by the
    ``reference`` path, with exact gradients.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, head_dim: Optional[int] = None, scale: Optional[float] = None,
                 rotary: Optional[nn.Module] = None, position_bias: Optional[nn.Module] = None,
                 backend: str = "auto", normalize: str = "softmax", top_k: Optional[int] = None,
                 window: Optional[int] = None, q_norm: Optional[nn.Module] = None,
                 k_norm: Optional[nn.Module] = None, device=None, dtype=None):
        super().__init__()
        positive_int("embed_dim", embed_dim)
        positive_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not is_int(num_kv_heads) or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must be a positive divisor of num_heads={num_heads}, got {num_kv_heads!r}")
        positive_int("head_dim", head_dim, optional=True)
        positive_int("kdim", kdim, optional=True)
        positive_int("vdim", vdim, optional=True)
        positive_int("window", window, optional=True)
        if not (backend == "auto" or backend in BACKENDS):  # (an unhashable backend is refused here, not in a dict)
            one_of("backend", backend, ["auto", *BACKENDS])
        check_normalize(normalize, top_k)
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads} (or pass head_dim)")
            head_dim = embed_dim // num_heads
        rate("dropout", dropout)
        for name, module in (("rotary", rotary), ("position_bias", position_bias), ("q_norm", q_norm),
                             ("k_norm", k_norm)):
            if module is not None and not callable(module):
                raise TypeError(f"{name} must be a module (callable) or None, got {type(module).__name__}")
        if rotary is not None and getattr(rotary, "head_dim", head_dim) != head_dim:
            raise ValueError(f"rotary is built for head_dim={rotary.head_dim}, but this attention's head_dim is "
                             f"{head_dim} (embed_dim // num_heads)")
        if position_bias is not None and getattr(position_bias, "num_heads", num_heads) != num_heads:
            raise ValueError(f"position_bias is built for {position_bias.num_heads} heads, but this attention has "
                             f"num_heads={num_heads}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a positive finite float or None (1/sqrt(head_dim)), got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = dropout
        self.rotary, self.position_bias = rotary, position_bias
        self.backend, self.normalize, self.top_k, self.window = backend, normalize, top_k, window
        float_dtype("dtype", dtype)
        if device is not None:
            try:
                torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device must name a torch device ('cpu', 'cuda:0', ...), got {device!r}: {e}") \
                    from None
        fk = dict(device=device, dtype=dtype)
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        if torch.device(device or "cpu").type != "meta":  # the weights' memory, refused before it is allocated
            width = torch.empty((), dtype=dtype).element_size()
            check_memory(f"MultiheadAttention(embed_dim={embed_dim}, num_heads={num_heads}, head_dim={head_dim})",
                         width * (embed_dim * q_out + (self.kdim + self.vdim) * kv_out + q_out * embed_dim),
                         device=device or "cpu")
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        if self.packed:
            self.in_proj = nn.Linear(embed_dim, q_out + 2 * kv_out, bias=bias, **fk)
        else:
            self.q_proj = nn.Linear(embed_dim, q_out, bias=bias, **fk)
            self.k_proj = nn.Linear(self.kdim, kv_out, bias=bias, **fk)
            self.v_proj = nn.Linear(self.vdim, kv_out, bias=bias, **fk)
        self.out_proj = nn.Linear(q_out, embed_dim, bias=bias, **fk)
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm go together (QK-norm): give both or neither")
        self.q_norm, self.k_norm = q_norm, k_norm

    # ---- projections ---------------------------------------------------------------------

    def _linear(self, x: Tensor, start: int, end: int) -> Tensor:
        """Rows ``start:end`` of the packed projection (views, no copy; in the weight's dtype, which a
        bf16 :class:`~attnlab.nn.inference.PackedLinear` makes differ from ``x``'s)."""
        w, b = self.in_proj.weight[start:end], self.in_proj.bias
        return F.linear(x.to(w.dtype), w, None if b is None else b[start:end]).to(x.dtype)

    def _project(self, query: Tensor, key: Tensor, value: Tensor, skip_kv: bool):
        """``(Q W_Q, K W_K, V W_V, qkv)``, each ``(B, L, ·)``: k and v are None with ``skip_kv``; ``qkv`` is the
        one packed product q, k and v are views of (self-attention), else None."""
        if not self.packed:
            q = self.q_proj(query)
            if skip_kv:
                return q, None, None, None
            return q, self.k_proj(key), self.v_proj(value), None
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if key is query and value is query and not skip_kv:  # self-attention: one matmul
            qkv = self.in_proj(query)
            return (*qkv.split([nq, nkv, nkv], dim=-1), qkv)
        q = self._linear(query, 0, nq)
        if skip_kv:
            return q, None, None, None
        if key is value:
            k, v = self._linear(key, nq, nq + 2 * nkv).split([nkv, nkv], dim=-1)
            return q, k, v, None
        return q, self._linear(key, nq, nq + nkv), self._linear(value, nq + nkv, nq + 2 * nkv), None

    # ---- forward -------------------------------------------------------------------------

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, cache: Optional[KVCache] = None, value_embed: Optional[Tensor] = None
                ) -> tuple[Tensor, Optional[Tensor]]:
        """Attend from ``query (B, L, E)`` to ``key (B, S, kdim)`` / ``value (B, S, vdim)``.

        ``value_embed (B, S, Hkv · head_dim)``, if given, is added to the projected values, ``V ← V W_V + e``
        (value embeddings, a per-token table lookup the caller makes; modded-nanogpt's speedrun lever).

        Returns ``(out (B, L, E), weights)``; weights are ``(B, L, S)`` averaged over heads,
        ``(B, H, L, S)`` with ``average_attn_weights=False``, or None without ``need_weights``.
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, flag in (("need_weights", need_weights), ("average_attn_weights", average_attn_weights),
                           ("is_causal", is_causal)):
            boolean(name, flag)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attnlab.KVCache or None, got {type(cache).__name__}")
        self._check_inputs(query, key, value)
        B, L, _ = query.shape
        H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        skip_kv = cache is not None and cache.static and cache.filled
        past = 0 if cache is None or cache.static else cache.length

        q, k, v, qkv = self._project(query, key, value, skip_kv)
        if value_embed is not None:
            if skip_kv or value_embed.shape != v.shape:
                want = "values projected in this call" if skip_kv else f"(B, S, Hkv · head_dim) = {tuple(v.shape)}"
                raise ValueError(f"value_embed must be {want}, got {tuple(value_embed.shape)}")
            v, qkv = v + value_embed.to(v.dtype), None  # (bf16 under autocast; the packed projection no longer holds v)
        # one NaN/inf check of the packed projection serves the pipeline (q, k, v) and the cache (new k, v): one
        # reduction instead of three (QK-norm and RoPE, applied after, cannot make finite values infinite short of
        # overflow, which the pipeline's output check still reports)
        fresh_finite = all_finite(qkv) if qkv is not None else None
        q = q.view(B, L, H, Dh).transpose(1, 2)  # (B, H, L, Dh)
        if not skip_kv:
            S_new = k.shape[1]
            k = k.view(B, S_new, Hkv, Dh).transpose(1, 2)  # (B, Hkv, S, Dh)
            v = v.view(B, S_new, Hkv, Dh).transpose(1, 2)
            if self.k_norm is not None:
                k = self.k_norm(k).to(k.dtype)  # (a bf16 k under autocast stays bf16 with a float32 gain)
            if self.rotary is not None:
                k = self._rotary_from(k, past)
        if self.q_norm is not None:
            q = self.q_norm(q).to(q.dtype)
        if self.rotary is not None:
            q = self._rotary_from(q, past)
        if (fresh_finite and cache is None and key_padding_mask is None and attn_mask is None and not need_weights
                and isinstance(is_causal, bool) and self.position_bias is None and self.window is None
                and self.normalize == "softmax" and self.top_k is None and (self.dropout == 0.0 or not self.training)):
            # q, k, v still the views of one packed projection: the kernel takes it whole (same bits, fewer nodes)
            packed = qkv if (qkv is not None and H == Hkv and self.q_norm is None and self.k_norm is None
                             and self.rotary is None) else None
            out = attend_plain(q, k, v, causal=is_causal, scale=self.scale, backend=self.backend, packed=packed)
            if out is not None:  # training's common case: the fused kernel without the request (attend_plain)
                return self.out_proj(out if packed is not None else out.transpose(1, 2).reshape(B, L, H * Dh)), None
        if cache is not None:
            if cache.window is not None and (self.window is None or self.window > cache.window):
                raise ValueError(f"a cache with window={cache.window} keeps fewer keys than this attention sees "
                                 f"(window={self.window}): give the attention a window ≤ {cache.window}")
            k, v = cache.update(k, v, finite=fresh_finite)
        S = k.shape[2]
        if cache is not None and cache.window is not None:  # a ring holds the newest S keys: the masks' last S columns
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, -S:]
            attn_mask = None if attn_mask is None else attn_mask[..., -S:]

        mask, score_mod = self._mask_and_mod(key_padding_mask, attn_mask, B, L, S, q)
        request = dict(mask=mask, causal=is_causal, window=self.window, scale=self.scale, score_mod=score_mod,
                       mask_mod=None)
        dropout_p = self.dropout if self.training else 0.0
        kv_finite = cache.finite if cache is not None else fresh_finite  # the cache checked each entry once
        if need_weights and self._weights_from_lse(q, k, v, dropout_p):
            checked = prepare(q, k, v, **request, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False)
            out, lse = attend(q, k, v, checked, return_lse=True, backend=self.backend, kv_finite=kv_finite,
                              q_finite=fresh_finite)
            weights = attention_weights(q, k, lse=lse, **request)
        else:
            checked = prepare(q, k, v, **request, dropout_p=dropout_p, normalize=self.normalize, top_k=self.top_k,
                              return_weights=need_weights)
            res = attend(q, k, v, checked, backend=self.backend, kv_finite=kv_finite, q_finite=fresh_finite)
            out, weights = res if need_weights else (res, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, H * Dh))  # (B, L, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights

    def step(self, query: Tensor, cache: KVCache) -> Tensor:
        """``forward(query, cache=cache, need_weights=False)[0]`` for one new position per sequence, ``query (B, 1,
        E)``, self-attention with no masks: a decoding step, in the fewest operations.

        The pipeline's general machinery (input checks, mask building, backend choice, one NaN/inf reduction per
        tensor) is what a decoding step pays per layer per token; here the one packed projection is checked once
        and, finite, goes straight to ``F.scaled_dot_product_attention`` over the cache (which holds only finite
        entries, :attr:`KVCache.finite`) by :func:`~attnlab.backends.dispatch.attend_step`: the backend ``auto`` takes. Anything else — non-finite
        entries, a window, a position bias, another normalisation or backend, an unusual scale — runs
        :meth:`forward`, so the semantics are the pipeline's. The caller checks the step's final output
        (``DecoderOnlyLM`` does: non-finite logits rerun the step through the pipeline, which says why).
        """
        if not self.steps(query, cache):
            return self.forward(query, cache=cache, need_weights=False)[0]
        qkv = self.in_proj(query)  # (B, 1, nq + 2 nkv)
        if not all_finite(qkv):
            return self.forward(query, cache=cache, need_weights=False)[0]
        B, H, Hkv, Dh = query.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        out = self._step_native(qkv, cache)
        if out is not None:
            return self.out_proj(out)
        heads = qkv.view(B, H + 2 * Hkv, 1, Dh)  # q's heads, then k's, then v's
        q, k, v = heads.split([H, Hkv, Hkv], dim=1)  # (B, ·, 1, Dh) each
        if self.rotary is not None and hasattr(self.rotary, "at"):  # RotaryEmbedding: q and k (adjacent heads at
            q, k = self.rotary.at(heads[:, :H + Hkv], cache.length).split([H, Hkv], dim=1)  # one position) at once
        elif self.rotary is not None:  # any other rotary(x, positions) module
            pos = torch.arange(cache.length, cache.length + 1, device=q.device)
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        k, v = cache.update(k, v, finite=True)
        out = attend_step(q, k, v, scale=self.scale)  # (B, H, 1, Dh)
        return self.out_proj(out.reshape(B, 1, H * Dh))

    def _rotary_from(self, x: Tensor, start: int) -> Tensor:
        """``x (B, H, L, Dh)`` rotated at positions ``start .. start + L - 1``: by the rotary module's ``span`` where it
        has one (:class:`~attnlab.nn.positional.RotaryEmbedding`: no positions tensor whose data a compiled graph
        would have to read), else by its ``forward(x, positions)``."""
        span = getattr(self.rotary, "span", None)
        if span is not None and isinstance(start, int):
            return span(x, start)
        return self.rotary(x, torch.arange(start, start + x.shape[2], device=x.device))

    def steps(self, query: Tensor, cache: KVCache) -> bool:
        """Whether :meth:`step` computes ``query`` itself (else it runs :meth:`forward`): one position, a packed
        softmax self-attention with no window, position bias or QK-norm on the ``auto``/``sdpa`` backend, a moderate
        scale, a plain cache holding only finite entries."""
        return not (not self.packed or self.position_bias is not None or self.window is not None
                    or self.q_norm is not None or self.normalize != "softmax" or self.backend not in ("auto", "sdpa") or cache.static
                    or cache.window is not None or not cache.finite or (self.scale is not None and abs(self.scale) > 1e3)
                    or query.shape[1] != 1)

    def native_step(self, cache: KVCache) -> Optional[tuple]:
        """What :func:`attnlab._native.attend_decode` needs for the next position of ``cache`` after its input:
        ``(k_cache, v_cache, position, heads, kv_heads, cos, sin, interleaved, scale)``, the buffers grown to hold it;
        None where that call does not apply (a rotary module without ``angles_at`` —
        :class:`~attnlab.nn.positional.RotaryEmbedding` has it —, angles or a cache not float32 on the CPU, a cache it
        cannot write in place). The caller has checked :meth:`steps` and :func:`attnlab._native.usable`, and calls
        ``cache.advance(1, finite=True)`` once it has written the entries."""
        rotary, position = self.rotary, cache.length
        cos = sin = None
        if rotary is not None:
            angles = getattr(rotary, "angles_at", None)
            cos_sin = None if angles is None else angles(position)
            if cos_sin is None or cos_sin[0].dtype != torch.float32 or cos_sin[0].device.type != "cpu":
                return None
            cos, sin = cos_sin
        buffers = cache.room_for(1)
        if buffers is None or buffers[0].dtype != torch.float32 or buffers[0].device.type != "cpu":
            return None
        scale = self.scale if self.scale is not None else default_scale(self.head_dim)
        return (*buffers, position, self.num_heads, self.num_kv_heads, cos, sin,
                bool(rotary is not None and rotary.interleaved), scale)

    def _step_native(self, qkv: Tensor, cache: KVCache) -> Optional[Tensor]:
        """:meth:`step`'s RoPE, cache write and attention in one C++ call (:func:`attnlab._native.attend_decode`):
        ``(B, 1, H · Dh)``, or None where that call does not apply (no native kernels, not float32 on the CPU, a
        graph being traced or compiled, or see :meth:`native_step`)."""
        args = self.native_step(cache) if _native.usable(qkv) else None
        if args is None:
            return None
        out = _native.attend_decode(qkv.contiguous(), *args)
        cache.advance(1, finite=True)
        return out

    def _weights_from_lse(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
        """Weights can come from the log-sum-exp: softmax, no dropout, nothing needs their gradient."""
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return self.normalize == "softmax" and dropout_p == 0.0 and not grad and keeps_lse(self.backend)

    def _mask_and_mod(self, key_padding_mask, attn_mask, B, L, S, q: Tensor):
        """The pipeline mask (masks + a dense position bias) and score_mod (a large position bias)."""
        mask = self._mask(key_padding_mask, attn_mask, B, L, S, q.dtype)
        if self.position_bias is None:
            return mask, None
        bias, score_mod = position_bias_terms(self.position_bias, backend=self.backend, heads=self.num_heads,
                                              q_len=L, k_len=S, device=q.device, dtype=q.dtype)
        if bias is None:
            return mask, score_mod
        return (bias if mask is None else _add_masks(mask, bias)), None

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != width:
                raise ValueError(f"{name} must be (B, L, {width}) (batch first), got shape {tuple(t.shape)}")
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value lengths differ: {key.shape[1]} and {value.shape[1]}")
        if key.shape[1] == 0:
            raise ValueError(f"key must hold at least one position (S >= 1; the query in self-attention), got shape "
                             f"{tuple(key.shape)}")
        proj = self.in_proj if self.packed else self.q_proj
        if not query.is_floating_point():
            raise TypeError(f"query must be a floating-point tensor, got {query.dtype}")
        if type(proj) is nn.Linear and query.dtype != proj.weight.dtype and not torch.is_autocast_enabled(
                query.device.type):
            raise TypeError(f"query is {query.dtype} but this module's weights are {proj.weight.dtype}: convert one "
                            f"to the other (module.to(dtype) or query.to(dtype))")

    def _mask(self, key_padding_mask, attn_mask, B, L, S, dtype) -> Optional[Tensor]:
        """torch MHA masks (True = blocked, float = added) -> one pipeline mask (True = allowed)."""
        masks = []
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and not isinstance(m, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"key_padding_mask must be (B, S) = {(B, S)}, got {tuple(key_padding_mask.shape)}")
            masks.append(_to_pipeline(key_padding_mask.view(B, 1, 1, S), dtype, "key_padding_mask"))
        if attn_mask is not None:
            if attn_mask.shape == (L, S):
                am = attn_mask
            elif attn_mask.shape == (B * self.num_heads, L, S):
                am = attn_mask.view(B, self.num_heads, L, S)
            else:
                raise ValueError(
                    f"attn_mask must be (L, S) = {(L, S)} or (B*num_heads, L, S) = {(B * self.num_heads, L, S)}, "
                    f"got {tuple(attn_mask.shape)}"
                )
            masks.append(_to_pipeline(am, dtype, "attn_mask"))
        if not masks:
            return None
        return masks[0] if len(masks) == 1 else _add_masks(*masks)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> "MultiheadAttention":
        """Convert a ``torch.nn.MultiheadAttention`` (weights copied; ours is batch-first)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported by attnlab.MultiheadAttention")
        w = module.out_proj.weight
        ours = cls(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                   bias=module.in_proj_bias is not None, dropout=module.dropout, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            if ours.packed:
                ours.in_proj.weight.copy_(module.in_proj_weight)
            else:
                ours.q_proj.weight.copy_(module.q_proj_weight)
                ours.k_proj.weight.copy_(module.k_proj_weight)
                ours.v_proj.weight.copy_(module.v_proj_weight)
            if module.in_proj_bias is not None:
                if ours.packed:
                    ours.in_proj.bias.copy_(module.in_proj_bias)
                else:
                    E = module.embed_dim
                    for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
                        proj.bias.copy_(module.in_proj_bias[i * E:(i + 1) * E])
                ours.out_proj.bias.copy_(module.out_proj.bias)
            ours.out_proj.weight.copy_(module.out_proj.weight)
        return ours.train(module.training)

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        qk = ", qk_norm=True" if self.q_norm is not None else ""
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, head_dim={self.head_dim}, "
                f"backend={self.backend!r}{qk}")


def _to_pipeline(m: Tensor, dtype, name: str) -> Tensor:
    """torch MHA convention (bool True = blocked) -> pipeline convention (bool True = allowed)."""
    if m.dtype == torch.bool:
        return ~m
    if not m.is_floating_point():
        raise TypeError(f"{name} must be bool (True = blocked) or floating (added), got {m.dtype}")
    return m.to(dtype)


def _add_masks(*masks: Tensor) -> Tensor:
    """Combine pipeline masks: all bool -> AND; otherwise bool becomes 0 / -inf and all are summed."""
    if all(m.dtype == torch.bool for m in masks):
        out = masks[0]
        for m in masks[1:]:
            out = out & m
        return out
    dtype = next(m.dtype for m in masks if m.dtype != torch.bool)
    out = None
    for m in masks:
        f = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf")) if m.dtype == torch.bool else m
        out = f if out is None else out + f
    return out
