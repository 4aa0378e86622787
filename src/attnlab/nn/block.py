"""Transformer layers: encoder (self-attention + FFN) and decoder (causal self-attention, cross-attention, FFN).

Each sub-layer ``F`` (attention or feed-forward) sits in a residual branch::

    post-norm (Vaswani et al. 2017, eqs. 7–8):  x = Norm(x + DropPath(Dropout(F(x))))
    pre-norm  (Xiong et al. 2020):              x = x + DropPath(Dropout(F(Norm(x))))

``DropPath`` is stochastic depth (Huang et al. 2016): in training each sample's whole branch is
dropped with probability ``p`` and the kept ones scaled by ``1 / (1 - p)``; in eval it is the
identity. Module names follow ``torch.nn.TransformerEncoderLayer``/``DecoderLayer`` (``self_attn``,
``cross_attn`` ≙ torch's ``multihead_attn``, ``ffn.w1/w2`` ≙ ``linear1/linear2``, ``norm1..3``), so
``from_torch`` converts those layers with weights copied.

The options of a layer (widths, dropouts, norm, positions, backend) live in one frozen
:class:`LayerSpec`, checked once; ``EncoderLayer(dim, num_heads, **options)`` and
``EncoderLayer.from_spec(spec)`` build the same layer.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, fields
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import boolean, one_of, positive_int, positive_number, rate
from attnlab.modules.multihead import MultiheadAttention
from attnlab.modules.cache import KVCache
from attnlab.nn.dropout import Dropout
from attnlab.nn.feedforward import FFN_ACTIVATIONS, FeedForward
from attnlab.nn import layer_native
from attnlab.nn.norms import NORMS, RMSNorm, make_norm


class DropPath(nn.Module):
    """Stochastic depth: ``x · m / (1 - p)`` with ``m ~ Bernoulli(1 - p)`` per sample (dim 0), in training only."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        rate("drop_path", p)
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


@dataclass
class AttentionWeights:
    """Per-head attention weights of one layer, taken before dropout.

    Attributes:
        self_attn: ``(B, H, L, L)`` (decoder: ``(B, H, L_new, L_past + L_new)`` with a cache).
        cross_attn: ``(B, H, L, S)`` over the memory; ``None`` for encoder / decoder-only layers.
    """

    self_attn: Tensor
    cross_attn: Optional[Tensor] = None


@dataclass
class LayerCache:
    """The KV caches of one decoder layer: growing or preallocated self-attention, static cross-attention."""

    self_attn: KVCache
    cross_attn: Optional[KVCache] = None

    @classmethod
    def create(cls, *, max_length: Optional[int] = None, cross_attention: bool = True,
               window: Optional[int] = None) -> "LayerCache":
        """Empty caches; ``max_length`` preallocates the self-attention cache (static cache); ``window`` makes it a
        ring buffer of the keys a sliding window of that width can still see (:class:`KVCache`)."""
        return cls(KVCache(max_length=max_length, window=window), KVCache(static=True) if cross_attention else None)


@dataclass(frozen=True)
class LayerSpec:
    """The options of one :class:`EncoderLayer` / :class:`DecoderLayer`, held and checked in one place.

    Build a layer from it with ``EncoderLayer.from_spec(spec)`` or
    ``DecoderLayer.from_spec(spec, cross_attention=...)``; ``EncoderLayer(dim, num_heads, **options)``
    builds the same spec from its keywords. A stack of identical layers shares one spec
    (``dataclasses.replace(spec, drop_path=p)`` for a per-layer rate).

    Args:
        dim: model width E.
        num_heads: attention heads H.
        ffn_dim: feed-forward hidden width.
        activation: FFN activation (see :class:`attnlab.nn.feedforward.FeedForward`).
        dropout: dropout on the residual branches (and the FFN hidden layer, as ``torch.nn.Transformer``).
        attn_dropout: dropout on the attention weights (default ``dropout``).
        ffn_dropout: dropout on the FFN hidden layer (default ``dropout``; GPT-2 and BERT have none).
        norm_first: pre-norm instead of post-norm.
        norm: ``"layernorm"`` or ``"rmsnorm"``; ``norm_eps`` its ε.
        drop_path: stochastic-depth probability of each residual branch.
        num_kv_heads: key/value heads for grouped-query attention.
        bias: biases in the attention, FFN and norm layers.
        rotary, position_bias: positional modules handed to the self-attention
            (see :class:`attnlab.modules.multihead.MultiheadAttention`); shared, not copied.
        backend: attention backend.
        head_dim: per-head width of every attention (default ``dim // num_heads``; T5: ``d_kv``).
        scale: score scale κ of every attention (default ``1 / sqrt(head_dim)``; T5: 1).
        qk_norm: an RMSNorm (ε ``norm_eps``) on each head's query and key of the self-attention
            (:class:`~attnlab.modules.multihead.MultiheadAttention`'s ``q_norm`` / ``k_norm``).

    Raises:
        ValueError / TypeError: an option is invalid (the message names it). The attention's own
            checks (``num_kv_heads``, ``head_dim``, ``scale``, ``backend``) run when a layer is built.
    """

    dim: int
    num_heads: int
    _: KW_ONLY
    ffn_dim: int
    activation: str = "relu"
    dropout: float = 0.1
    attn_dropout: Optional[float] = None
    ffn_dropout: Optional[float] = None
    norm_first: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    drop_path: float = 0.0
    num_kv_heads: Optional[int] = None
    bias: bool = True
    rotary: Optional[nn.Module] = None
    position_bias: Optional[nn.Module] = None
    backend: str = "auto"
    head_dim: Optional[int] = None
    scale: Optional[float] = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        positive_int("dim", self.dim)
        positive_int("num_heads", self.num_heads)
        positive_int("ffn_dim", self.ffn_dim)
        one_of("activation", self.activation, FFN_ACTIVATIONS)
        rate("dropout", self.dropout)
        rate("attn_dropout", self.resolved_attn_dropout)
        rate("ffn_dropout", self.resolved_ffn_dropout)
        boolean("norm_first", self.norm_first)
        one_of("norm", self.norm, NORMS)
        positive_number("norm_eps", self.norm_eps)
        rate("drop_path", self.drop_path)
        boolean("qk_norm", self.qk_norm)

    @property
    def resolved_attn_dropout(self) -> float:
        """Dropout on the attention weights: ``attn_dropout``, or ``dropout`` when it is None."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def resolved_ffn_dropout(self) -> float:
        """Dropout on the FFN hidden layer: ``ffn_dropout``, or ``dropout`` when it is None."""
        return self.dropout if self.ffn_dropout is None else self.ffn_dropout

    def options(self) -> dict:
        """Every option but ``dim`` and ``num_heads``, as keywords (modules shared, not copied)."""
        return {name: getattr(self, name) for name in _SPEC_OPTIONS}

    @classmethod
    def _from_keywords(cls, owner: str, dim: int, num_heads: int, options: dict) -> "LayerSpec":
        """``LayerSpec(dim, num_heads, **options)``; an unknown keyword is a ``TypeError`` naming it and ``owner``."""
        unknown = [name for name in options if name not in _SPEC_OPTIONS]
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r};"
                            f" its options are LayerSpec's: {', '.join(_SPEC_OPTIONS)}")
        return cls(dim, num_heads, **options)


_SPEC_OPTIONS = tuple(f.name for f in fields(LayerSpec) if f.name not in ("dim", "num_heads"))  # field order


def _is_spec(spec) -> None:
    if not isinstance(spec, LayerSpec):
        raise TypeError(f"spec must be a LayerSpec, got {type(spec).__name__}")


class _ResidualLayer(nn.Module):
    """The sub-modules built from a :class:`LayerSpec` and the residual wrapper of Encoder/DecoderLayer."""

    def __init__(self, spec: LayerSpec, num_sublayers: int) -> None:
        super().__init__()
        self.spec = spec
        self.dim, self.num_heads, self.norm_first = spec.dim, spec.num_heads, spec.norm_first
        head_dim = spec.head_dim or spec.dim // spec.num_heads
        qk_norms = {name: RMSNorm(head_dim, eps=spec.norm_eps) for name in ("q_norm", "k_norm")} if spec.qk_norm else {}
        self.self_attn = MultiheadAttention(spec.dim, spec.num_heads, num_kv_heads=spec.num_kv_heads, bias=spec.bias,
                                            dropout=spec.resolved_attn_dropout, head_dim=spec.head_dim,
                                            scale=spec.scale, rotary=spec.rotary, position_bias=spec.position_bias,
                                            backend=spec.backend, **qk_norms)
        self.ffn = FeedForward(spec.dim, spec.ffn_dim, activation=spec.activation, dropout=spec.resolved_ffn_dropout,
                               bias=spec.bias)
        for i in range(1, num_sublayers + 1):
            setattr(self, f"norm{i}", make_norm(spec.norm, spec.dim, eps=spec.norm_eps, bias=spec.bias))
            setattr(self, f"dropout{i}", Dropout(spec.dropout))
        self.drop_path = DropPath(spec.drop_path)

    def _residual(self, x: Tensor, i: int, branch: Callable[[Tensor], Tensor]) -> Tensor:
        """Sub-layer ``i`` (1-based) around ``branch`` with norm ``norm{i}`` and dropout ``dropout{i}``."""
        norm = getattr(self, f"norm{i}")
        h = branch(norm(x) if self.norm_first else x)
        drop = getattr(self, f"dropout{i}")
        # dropout and stochastic depth are the identity in eval and at rate 0: skip the calls
        if self.training and (getattr(drop, "p", 1.0) or getattr(self.drop_path, "p", 1.0)):
            h = self.drop_path(drop(h))
        return x + h if self.norm_first else norm(x + h)

    def _load_torch(self, layer: nn.Module, attn_names: dict[str, str], num_sublayers: int) -> None:
        """Copy weights from a torch layer: attention modules by name, FFN, norms."""
        for ours, theirs in attn_names.items():
            converted = MultiheadAttention.from_torch(getattr(layer, theirs))
            getattr(self, ours).load_state_dict(converted.state_dict())
        with torch.no_grad():
            for ours, theirs in ((self.ffn.w1, layer.linear1), (self.ffn.w2, layer.linear2)):
                ours.weight.copy_(theirs.weight)
                if theirs.bias is not None:
                    ours.bias.copy_(theirs.bias)
            for i in range(1, num_sublayers + 1):
                ours, theirs = getattr(self, f"norm{i}"), getattr(layer, f"norm{i}")
                ours.weight.copy_(theirs.weight)
                if theirs.bias is not None:
                    ours.bias.copy_(theirs.bias)
        self.train(layer.training)


class EncoderLayer(_ResidualLayer):
    """Self-attention then feed-forward, each in a (post- or pre-norm) residual branch.

    ``EncoderLayer(dim, num_heads, ffn_dim=..., **options)``: the options and their defaults are
    :class:`LayerSpec`'s (``activation``, ``dropout``, ``attn_dropout``, ``ffn_dropout``, ``norm_first``,
    ``norm``, ``norm_eps``, ``drop_path``, ``num_kv_heads``, ``bias``, ``rotary``, ``position_bias``,
    ``backend``, ``head_dim``, ``scale``); ``EncoderLayer.from_spec(spec)`` builds the same layer from a spec.
    The layer keeps the spec it was built from as ``self.spec``.

    Raises:
        TypeError: an unknown keyword (the message names it).
        ValueError / TypeError: an option is invalid (the message names it).
    """

    def __init__(self, dim: int, num_heads: int, **options) -> None:
        super().__init__(LayerSpec._from_keywords(type(self).__name__, dim, num_heads, options), 2)

    @classmethod
    def from_spec(cls, spec: LayerSpec) -> "EncoderLayer":
        """The layer of ``spec``: the same as ``EncoderLayer(spec.dim, spec.num_heads, **options)``."""
        _is_spec(spec)
        return cls(spec.dim, spec.num_heads, **spec.options())

    def forward(self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, need_weights: bool = False
                ) -> Union[Tensor, tuple[Tensor, AttentionWeights]]:
        """``x (B, L, E) -> (B, L, E)``; with ``need_weights`` also :class:`AttentionWeights`.

        Masks follow ``torch.nn.MultiheadAttention``: ``key_padding_mask (B, L)`` bool, True =
        padding; ``attn_mask (L, L)`` bool (True = blocked) or float (added).
        """
        weights: list[Optional[Tensor]] = []

        def attend(h: Tensor) -> Tensor:
            out, w = self.self_attn(h, h, h, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                    is_causal=is_causal, need_weights=need_weights, average_attn_weights=False)
            weights.append(w)
            return out

        x = self._residual(x, 1, attend)
        x = self._residual(x, 2, self.ffn)
        return (x, AttentionWeights(weights[0])) if need_weights else x

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer, *, backend: str = "auto") -> "EncoderLayer":
        """Convert a ``torch.nn.TransformerEncoderLayer`` (any ``batch_first``; ours is batch-first)."""
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"layer must be torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        ours = cls(**_torch_layer_kwargs(layer), backend=backend)
        ours._load_torch(layer, {"self_attn": "self_attn"}, 2)
        return ours


class DecoderLayer(_ResidualLayer):
    """Causal self-attention, cross-attention on the encoder memory, feed-forward; each residual.

    ``DecoderLayer(dim, num_heads, ffn_dim=..., cross_attention=True, **options)``: the options are
    :class:`LayerSpec`'s, as :class:`EncoderLayer`; ``DecoderLayer.from_spec(spec, cross_attention=...)``
    builds the same layer from a spec. ``cross_attention`` False: a decoder-only, GPT-style layer with
    no memory. ``rotary`` / ``position_bias`` apply to the self-attention only (query and memory
    positions are unrelated).

    Raises:
        TypeError: an unknown keyword, or ``cross_attention`` not a bool (the message names it).
        ValueError / TypeError: an option is invalid (the message names it).
    """

    def __init__(self, dim: int, num_heads: int, *, cross_attention: bool = True, **options) -> None:
        boolean("cross_attention", cross_attention)
        spec = LayerSpec._from_keywords(type(self).__name__, dim, num_heads, options)
        super().__init__(spec, 3 if cross_attention else 2)
        self.cross_attn = None
        if cross_attention:
            self.cross_attn = MultiheadAttention(spec.dim, spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                                 bias=spec.bias, dropout=self.self_attn.dropout,
                                                 head_dim=spec.head_dim, scale=spec.scale, backend=spec.backend)
        self._plans: dict = {}  # the dispatcher's plans per mode (layer_native.plan)

    def train(self, mode: bool = True) -> "DecoderLayer":
        """``nn.Module.train``; a mode change forgets the layer's plans (:func:`attnlab.nn.layer_native.plan`)."""
        self.__dict__.setdefault("_plans", {}).clear()
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        self.__dict__.setdefault("_plans", {}).clear()  # a dtype or device change makes new plans
        return super()._apply(fn, recurse)

    @classmethod
    def from_spec(cls, spec: LayerSpec, *, cross_attention: bool = True) -> "DecoderLayer":
        """The layer of ``spec``: as ``DecoderLayer(spec.dim, spec.num_heads, cross_attention=..., **options)``."""
        _is_spec(spec)
        return cls(spec.dim, spec.num_heads, cross_attention=cross_attention, **spec.options())

    def step(self, x: Tensor, cache: LayerCache, *, value_embed: Optional[Tensor] = None) -> Tensor:
        """``forward(x, cache=cache)`` for one new position per sequence of a decoder-only layer, ``x (B, 1, E)``, no
        masks: pre-norm residual branches around :meth:`MultiheadAttention.step` and the FFN, in the fewest
        operations (eval mode; otherwise, for a post-norm or cross-attention layer or with ``value_embed``, it is
        :meth:`forward`)."""
        if self.cross_attn is not None or not self.norm_first or self.training or value_embed is not None:
            return self.forward(x, cache=cache, is_causal=False, value_embed=value_embed)
        out = self._step_native(x, cache.self_attn)
        if out is not None:
            return out
        x = x + self.self_attn.step(self.norm1(x), cache.self_attn)
        return x + self.ffn(self.norm2(x))

    def _step_native(self, x: Tensor, cache: KVCache) -> Optional[Tensor]:
        """:meth:`step` in one C++ call where every part is one it computes, else None
        (:func:`attnlab.nn.layer_native.decoder_step`)."""
        return layer_native.decoder_step(self, x, cache)

    def _train_native(self, x: Tensor) -> Optional[Tensor]:
        """The training forward as one autograd node where the modules would make exactly its calls, else None
        (:func:`attnlab.nn.layer_native.decoder_train`)."""
        return layer_native.decoder_train(self, x)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, is_causal: bool = True, cache: Optional[LayerCache] = None,
                need_weights: bool = False, value_embed: Optional[Tensor] = None
                ) -> Union[Tensor, tuple[Tensor, AttentionWeights]]:
        """``x (B, T, E)``, ``memory (B, S, E)`` -> ``(B, T, E)``; with ``need_weights`` also weights.
        ``value_embed (B, T, Hkv · head_dim)`` is added to the self-attention's values (its ``value_embed``).

        With ``cache``, ``x`` holds only the new positions; the self-attention attends to the cached
        past plus them (``tgt_key_padding_mask``, if given, must cover all of them), and the
        cross-attention projects ``memory`` once and reuses it. ``is_causal`` is bottom-right aligned.
        """
        if (self.cross_attn is None) != (memory is None):
            raise ValueError("memory is required with cross-attention and must be None without it"
                             f" (cross_attention={self.cross_attn is not None})")
        if (is_causal is True and memory is None and cache is None and not need_weights and value_embed is None
                and tgt_key_padding_mask is None and tgt_mask is None and self.training):
            out = self._train_native(x)  # training's common case: the layer as one C++ node
            if out is not None:
                return out
        weights: list[Optional[Tensor]] = []

        def self_attend(h: Tensor) -> Tensor:
            out, w = self.self_attn(h, h, h, key_padding_mask=tgt_key_padding_mask, attn_mask=tgt_mask,
                                    is_causal=is_causal, need_weights=need_weights, average_attn_weights=False,
                                    cache=None if cache is None else cache.self_attn, value_embed=value_embed)
            weights.append(w)
            return out

        def cross_attend(h: Tensor) -> Tensor:
            out, w = self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                     attn_mask=memory_mask, need_weights=need_weights, average_attn_weights=False,
                                     cache=None if cache is None else cache.cross_attn)
            weights.append(w)
            return out

        x = self._residual(x, 1, self_attend)
        if self.cross_attn is not None:
            x = self._residual(x, 2, cross_attend)
        x = self._residual(x, 3 if self.cross_attn is not None else 2, self.ffn)
        if not need_weights:
            return x
        return x, AttentionWeights(weights[0], weights[1] if len(weights) > 1 else None)

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer, *, backend: str = "auto") -> "DecoderLayer":
        """Convert a ``torch.nn.TransformerDecoderLayer`` (``multihead_attn`` becomes ``cross_attn``)."""
        if not isinstance(layer, nn.TransformerDecoderLayer):
            raise TypeError(f"layer must be torch.nn.TransformerDecoderLayer, got {type(layer).__name__}")
        ours = cls(**_torch_layer_kwargs(layer), backend=backend)
        ours._load_torch(layer, {"self_attn": "self_attn", "cross_attn": "multihead_attn"}, 3)
        return ours


def _torch_layer_kwargs(layer: nn.Module) -> dict:
    """Our constructor arguments for a torch Transformer{Encoder,Decoder}Layer."""
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        activation = "relu"
    elif act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        activation = "gelu"
    elif isinstance(act, nn.GELU) and act.approximate == "tanh":
        activation = "gelu_tanh"
    else:
        raise ValueError(f"unsupported torch activation {act!r}; expected relu or gelu")
    return dict(dim=layer.self_attn.embed_dim, num_heads=layer.self_attn.num_heads,
                ffn_dim=layer.linear1.out_features, activation=activation, dropout=layer.dropout.p,
                norm_first=layer.norm_first, norm_eps=layer.norm1.eps, bias=layer.linear1.bias is not None)

