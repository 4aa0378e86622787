"""The configuration of an encoder–decoder Transformer, as a small validated dataclass.

Variants are named by strings (``activation="swiglu"``, ``position="rope"``), never by piles of
booleans. ``TransformerConfig.from_dict(cfg.to_dict()) == cfg``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from attnlab._checks import is_int, one_of, positive_int, positive_number, rate
from attnlab._limits import check_model_sizes
from attnlab.backends import BACKENDS
from attnlab.nn.feedforward import FFN_ACTIVATIONS
from attnlab.nn.norms import NORMS

POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "t5", "none")


@dataclass
class TransformerConfig:
    """Hyper-parameters of :class:`attnlab.models.transformer.Seq2SeqTransformer`.

    Attributes:
        src_vocab_size: source vocabulary size.
        tgt_vocab_size: target vocabulary size; ``None`` means the same as ``src_vocab_size``.
        dim: model width ``d_model``.
        num_heads: attention heads ``H``; ``dim % num_heads == 0``.
        num_kv_heads: key/value heads for grouped-query attention (``None`` = ``num_heads``).
        ffn_dim: hidden width of the feed-forward network.
        num_encoder_layers / num_decoder_layers: stack depths (``>= 1``).
        dropout: dropout on embeddings, residual branches and the FFN hidden layer.
        attn_dropout: dropout on attention weights (``None`` = ``dropout``).
        activation: feed-forward activation, one of :data:`attnlab.nn.feedforward.FFN_ACTIVATIONS`.
        norm_first: pre-norm ``x + F(LN(x))`` instead of post-norm ``LN(x + F(x))``.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        norm_eps: ε of the norms.
        position: ``"sinusoidal"`` / ``"learned"`` (added to the embeddings), ``"rope"``
            (rotary q/k), ``"alibi"`` or ``"t5"`` (additive score biases), or ``"none"``.
        max_positions: longest sequence the position table covers (sinusoidal, learned).
        tie_embeddings: the output projection shares the target embedding matrix.
        pad_id: padding token id (its embedding row is zero and gets no gradient; source
            positions holding it are masked); ``None`` for no padding token.
        drop_path: stochastic-depth rate of the deepest layer (linear rule, Huang et al. 2016).
        bias: biases in the attention and feed-forward linear layers.
        backend: attention backend, ``"auto"`` or a name in :data:`attnlab.backends.BACKENDS`.
    """

    src_vocab_size: int
    tgt_vocab_size: Optional[int] = None
    dim: int = 512
    num_heads: int = 8
    num_kv_heads: Optional[int] = None
    ffn_dim: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    attn_dropout: Optional[float] = None
    activation: str = "relu"
    norm_first: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    position: str = "sinusoidal"
    max_positions: int = 512
    tie_embeddings: bool = True
    pad_id: Optional[int] = 0
    drop_path: float = 0.0
    bias: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if self.tgt_vocab_size is None:
            self.tgt_vocab_size = self.src_vocab_size
        for name in ("src_vocab_size", "tgt_vocab_size", "dim", "num_heads", "ffn_dim",
                     "num_encoder_layers", "num_decoder_layers", "max_positions"):
            positive_int(name, getattr(self, name))
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.num_kv_heads is not None:
            positive_int("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
                )
        if self.position == "rope" and (self.dim // self.num_heads) % 2:
            raise ValueError(f"position='rope' needs an even head dim (dim // num_heads), got {self.dim // self.num_heads}")
        for name in ("dropout", "attn_dropout", "drop_path"):
            value = getattr(self, name)
            if value is None and name == "attn_dropout":
                continue
            rate(name, value)
        for name, value, valid in (("activation", self.activation, FFN_ACTIVATIONS),
                                   ("norm", self.norm, NORMS), ("position", self.position, POSITIONS)):
            one_of(name, value, valid)
        positive_number("norm_eps", self.norm_eps, finite=True)
        for name in ("norm_first", "tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.pad_id is not None:
            if not is_int(self.pad_id):
                raise ValueError(f"pad_id must be an int or None, got {self.pad_id!r}")
            limit = min(self.src_vocab_size, self.tgt_vocab_size)
            if not 0 <= self.pad_id < limit:
                raise ValueError(f"pad_id must be in [0, {limit}) (both vocabularies), got {self.pad_id}")
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {self.backend!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        """A plain ``{field: value}`` dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransformerConfig":
        """Build a config from :meth:`to_dict`'s output.

        Raises:
            ValueError: ``data`` has keys that are not fields (the message lists the valid ones),
                or a value is invalid.
        """
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys {unknown}; valid keys are {valid}")
        return cls(**data)
