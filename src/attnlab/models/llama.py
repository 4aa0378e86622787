"""Llama (Touvron et al. 2023) from attnlab's blocks, weight-compatible with Hugging Face ``LlamaForCausalLM``.

::

    h_0 = W_emb[x]
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}));  h_l = h_l + FFN(RMSNorm(h_l))   (pre-norm, causal)
    logits = RMSNorm_f(h_L) W_headᵀ              (W_head = W_emb when tie_word_embeddings)

``Attn`` is grouped-query attention (``num_key_value_heads`` key/value heads) with rotary position
embeddings on q and k (HF's half-split layout, ``θ_i = rope_theta^(-2i/D)``), no biases;
``FFN(x) = W_down (silu(W_gate x) ⊙ W_up x)`` (SwiGLU). HF's separate ``q_proj/k_proj/v_proj``
map onto our packed ``in_proj`` (rows q, k, v): :func:`state_dict_from_hf` / :func:`state_dict_to_hf`
convert; :meth:`LlamaConfig.from_hf` / :meth:`LlamaConfig.to_hf` convert the ``config.json`` dict.

Positions: RoPE makes ``⟨R(m)q, R(n)k⟩`` depend on ``m - n`` only, so the constant per-row shift
that left padding puts between ``arange`` positions and HF's ``cumsum(mask) - 1`` cancels: the
real tokens' outputs are the same either way (padding keys are masked out).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import positive_int, positive_number
from attnlab.models.causal_lm import DecoderOnlyLM
from attnlab.models.hub import register
from attnlab.nn.block import DecoderLayer
from attnlab.nn.norms import RMSNorm
from attnlab.nn.positional import RotaryEmbedding

# HF per-layer names (after "model.layers.{i}.") -> ours; q/k/v are packed into in_proj
_LAYER_KEYS = {
    "input_layernorm": "norm1", "post_attention_layernorm": "norm2", "self_attn.o_proj": "self_attn.out_proj",
    "mlp.gate_proj": "ffn.w1", "mlp.up_proj": "ffn.w3", "mlp.down_proj": "ffn.w2",
}
_QKV = ("q_proj", "k_proj", "v_proj")
_TOP_KEYS = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}


@dataclass
class LlamaConfig:
    """Llama hyper-parameters; names and defaults follow HF's ``LlamaConfig`` (Llama-7B sizes).

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain multi-head attention).
    ``rope_scaling`` must be None (scaled RoPE variants are not implemented); ``attention_bias``
    and ``mlp_bias`` must be False (Llama has no biases).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Optional[dict] = None
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    pad_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                             f"{self.num_attention_heads} into an even head size (RoPE rotates pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            positive_number(name, getattr(self, name))
        if self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            raise ValueError(f"rope_scaling must be None (scaled RoPE is not supported), got {self.rope_scaling!r}")
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name} must be False (Llama layers have no biases), got {getattr(self, name)!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face Llama ``config.json`` dict (unknown keys are ignored).

        Reads ``rope_theta`` (transformers 4.x) or ``rope_parameters`` (5.x); a ``rope_parameters``
        whose ``rope_type`` is not ``"default"`` counts as ``rope_scaling``.

        Raises:
            ValueError: an option we cannot express (the message names the field).
        """
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {d['hidden_act']!r}")
        heads = d.get("num_attention_heads", 32)
        if d.get("head_dim") is not None and d["head_dim"] * heads != d.get("hidden_size", 4096):
            raise ValueError(f"head_dim={d['head_dim']} must equal hidden_size / num_attention_heads")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" and kw.get("rope_scaling") is None:
            kw["rope_scaling"] = rope
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        return cls(**kw)

    def to_hf(self) -> dict:
        """A Hugging Face Llama ``config.json`` dict (loads with ``transformers.LlamaConfig(**d)``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                "head_dim": self.head_dim, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                **d}


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama language model: token embedding, ``num_hidden_layers`` pre-RMSNorm causal
    :class:`DecoderLayer` (GQA + RoPE, SwiGLU), final RMSNorm, LM head (tied per config).

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories (see
    :mod:`attnlab.models.hub`).
    """

    hf_architecture = "LlamaForCausalLM"
    # RoPE table (non-persistent in HF, present in old checkpoints); with tied embeddings, a stored head copy
    hf_ignored = (r"\.rotary_emb\.inv_freq$", r"^lm_head\.weight$")

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        # one RoPE table (non-persistent buffers) shared by every layer
        rope = RotaryEmbedding(c.head_dim, base=float(c.rope_theta), max_positions=min(c.max_position_embeddings, 4096))
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.num_attention_heads, ffn_dim=c.intermediate_size, activation="swiglu",
                         dropout=0.0, norm_first=True, norm="rmsnorm", norm_eps=c.rms_norm_eps,
                         num_kv_heads=c.num_key_value_heads, bias=False, rotary=rope, cross_attention=False)
            for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for m in self.modules():  # HF Llama's initialisation: N(0, 0.02), unit RMSNorm gains
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Token embeddings; RoPE in each layer gives positions (relative, so left padding is exact)."""
        return self.embed_tokens(input_ids)

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))  # (B, T, V)

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """HF names; with tied embeddings ``lm_head.weight`` is left out (stored once, as ``embed_tokens``)."""
        sd = state_dict_to_hf(self.state_dict(), self.config)
        if self.config.tie_word_embeddings:
            del sd["lm_head.weight"]
        return sd

    def from_hf_state_dict(self, hf: dict[str, Tensor]) -> dict[str, Tensor]:
        """An HF Llama state dict in our names, for ``load_state_dict``."""
        return state_dict_from_hf(hf, self.config)


def state_dict_from_hf(sd: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Hugging Face ``LlamaForCausalLM`` state dict -> ours (q/k/v packed into ``in_proj``).

    A missing ``lm_head.weight`` is taken from ``model.embed_tokens.weight`` when
    ``config.tie_word_embeddings`` (checkpoints store tied weights once).

    Raises:
        ValueError: a key is not a Llama weight, or a layer lacks one of q/k/v.
    """
    out: dict[str, Tensor] = {}
    qkv: dict[str, dict[str, Tensor]] = {}
    for key, t in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", key)
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = t
        elif m and m.group(2) in _LAYER_KEYS:
            out[f"layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}.weight"] = t
        elif m and m.group(2).removeprefix("self_attn.") in _QKV:
            qkv.setdefault(m.group(1), {})[m.group(2).removeprefix("self_attn.")] = t
        elif re.search(r"\.rotary_emb\.inv_freq$", key):
            continue
        else:
            raise ValueError(f"state dict key {key!r} is not a Hugging Face Llama weight")
    for i, parts in qkv.items():
        if len(parts) != 3:
            raise ValueError(f"layer {i} lacks {sorted(set(_QKV) - parts.keys())} (model.layers.{i}.self_attn.*)")
        out[f"layers.{i}.self_attn.in_proj.weight"] = torch.cat([parts[n] for n in _QKV], dim=0)
    if "lm_head.weight" not in out and config.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def state_dict_to_hf(sd: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face ``LlamaForCausalLM``'s (``in_proj`` split into q/k/v)."""
    inverse_top = {v: k for k, v in _TOP_KEYS.items()}
    inverse = {v: k for k, v in _LAYER_KEYS.items()}
    nq = config.num_attention_heads * config.head_dim
    nkv = config.num_key_value_heads * config.head_dim
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", key)
        if key in inverse_top:
            out[inverse_top[key]] = t
        elif m and m.group(2) == "self_attn.in_proj":
            for name, part in zip(_QKV, t.split([nq, nkv, nkv], dim=0)):
                out[f"model.layers.{m.group(1)}.self_attn.{name}.weight"] = part.contiguous()
        elif m and m.group(2) in inverse:
            out[f"model.layers.{m.group(1)}.{inverse[m.group(2)]}.weight"] = t
        else:
            raise ValueError(f"state dict key {key!r} is not an attnlab Llama weight")
    return out


register("llama", config_from_hf=LlamaConfig.from_hf, architectures={"LlamaForCausalLM": LlamaForCausalLM},
         default="LlamaForCausalLM")
