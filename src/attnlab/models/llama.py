"""Llama (Touvron et al. 2023) from attnlab's blocks, weight-compatible with Hugging Face ``LlamaForCausalLM``.

::

    h_0 = Dropout(W_emb[x])                      (Dropout: the identity unless hidden_dropout > 0 and training)
    h_l = h_{l-1} + Dropout(Attn(RMSNorm(h_{l-1})));  h_l = h_l + Dropout(FFN(RMSNorm(h_l)))   (pre-norm, causal)
    logits = RMSNorm_f(h_L) W_headᵀ              (W_head = W_emb when tie_word_embeddings)
    logits ← c · tanh(logits / c)                 (only with final_logit_softcapping = c: not in HF's Llama)

``Attn`` is grouped-query attention (``num_key_value_heads`` key/value heads) with rotary position
embeddings on q and k (HF's half-split layout, ``θ_i = rope_theta^(-2i/D)``), no biases;
``FFN(x) = W_down (act(W_gate x) ⊙ W_up x)`` with ``act`` = ``hidden_act``: ``silu`` (SwiGLU, Llama's) or
``relu2`` (``max(x, 0)²``, Primer's; HF's Llama computes it too). ``qk_norm`` (an attnlab extension, as OLMo 2 and
Qwen 3) RMS-normalises each head's q and k before RoPE; ``value_embeddings`` (an attnlab extension, modded-nanogpt's
speedrun lever) gives each layer ``l`` a table ``E_l (vocab, Hkv·D)`` added to its values, ``V ← V W_V + E_l[x]``.
HF's separate ``q_proj/k_proj/v_proj``
map onto our packed ``in_proj`` (rows q, k, v): :func:`weight_map` declares the names (read both ways
by :func:`state_dict_from_hf` / :func:`state_dict_to_hf`); :meth:`LlamaConfig.from_hf` /
:meth:`LlamaConfig.to_hf` convert the ``config.json`` dict.

Positions: RoPE makes ``⟨R(m)q, R(n)k⟩`` depend on ``m - n`` only, so the constant per-row shift
that left padding puts between ``arange`` positions and HF's ``cumsum(mask) - 1`` cancels: the
real tokens' outputs are the same either way (padding keys are masked out).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, one_of, positive_int, positive_number, rate
from attnlab._limits import check_model_sizes
from attnlab.models.causal_lm import DecoderOnlyLM
from attnlab.models.hub import WeightMap, pack, register, rename
from attnlab.nn.block import DecoderLayer, LayerSpec
from attnlab.nn.dropout import Dropout
from attnlab.nn.norms import RMSNorm
from attnlab.nn.positional import RotaryEmbedding

_ROPE_TABLE = r"\.rotary_emb\.inv_freq$"  # non-persistent in HF, present in old checkpoints
HIDDEN_ACTS = {"silu": "swiglu", "relu2": "relu2_glu"}  # HF's hidden_act -> our gated FeedForward activation
EXTENSIONS = {"final_logit_softcapping": None, "qk_norm": False, "value_embeddings": False}  # not HF's: off values
TRAINING = ("hidden_dropout",)  # not HF's either, but the identity in evaluation: left out of the export


def weight_map(config: "LlamaConfig") -> WeightMap:
    """Our names <-> HF ``LlamaForCausalLM``'s: q/k/v (``H·D``, ``Hkv·D``, ``Hkv·D`` rows) packed into
    ``in_proj``; with tied embeddings ``lm_head.weight`` is stored once, as ``model.embed_tokens.weight``; with
    ``qk_norm`` the gains as HF's ``Qwen3ForCausalLM`` names them (``self_attn.q_norm`` / ``k_norm``)."""
    nq, nkv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layer = "model.layers.{i}"
    return WeightMap("Llama", [
        rename("embed_tokens.weight", "model.embed_tokens.weight"),
        rename("norm.weight", "model.norm.weight"),
        *([] if config.tie_word_embeddings else [rename("lm_head.weight", "lm_head.weight")]),
        rename("layers.{i}.norm1.weight", f"{layer}.input_layernorm.weight"),
        rename("layers.{i}.norm2.weight", f"{layer}.post_attention_layernorm.weight"),
        pack("layers.{i}.self_attn.in_proj.weight", *(f"{layer}.self_attn.{x}_proj.weight" for x in "qkv"),
             sizes=(nq, nkv, nkv)),
        rename("layers.{i}.self_attn.out_proj.weight", f"{layer}.self_attn.o_proj.weight"),
        *([rename(f"layers.{{i}}.self_attn.{x}_norm.weight", f"{layer}.self_attn.{x}_norm.weight") for x in "qk"]
          if config.qk_norm else []),  # Qwen 3's names (its layer is Llama's with QK-norm)
        rename("layers.{i}.ffn.w1.weight", f"{layer}.mlp.gate_proj.weight"),
        rename("layers.{i}.ffn.w3.weight", f"{layer}.mlp.up_proj.weight"),
        rename("layers.{i}.ffn.w2.weight", f"{layer}.mlp.down_proj.weight"),
    ], tied={"lm_head.weight": "embed_tokens.weight"} if config.tie_word_embeddings else None,
        ignore=(_ROPE_TABLE, r"^lm_head\.weight$"))


@dataclass
class LlamaConfig:
    """Llama hyper-parameters; names and defaults follow HF's ``LlamaConfig`` (Llama-7B sizes).

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain multi-head attention).
    ``rope_scaling`` must be None (scaled RoPE variants are not implemented); ``attention_bias``
    and ``mlp_bias`` must be False (Llama has no biases). ``hidden_act``: ``"silu"`` or ``"relu2"``.
    Three attnlab extensions (training levers), so :meth:`to_hf` refuses a config that sets any:
    ``final_logit_softcapping`` (Gemma 2's name; None = off) caps the logits smoothly at ``±c``; ``qk_norm``
    RMS-normalises each head's query and key (gains ``q_norm``, ``k_norm`` of ``head_dim``, ε ``rms_norm_eps``);
    ``value_embeddings`` adds a per-layer token table to the attention's values (``value_embeds.{l}``, N(0, 0.02)).
    One training-only extension, left out of :meth:`to_hf` (it changes no evaluation logit): ``hidden_dropout``,
    GPT-2's dropout on the embeddings and on each residual branch's output (``resid_pdrop``, ``embd_pdrop``).
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
    final_logit_softcapping: Optional[float] = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    value_embeddings: bool = False
    hidden_dropout: float = 0.0

    def __post_init__(self) -> None:
        check_model_sizes(self)
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
            positive_number(name, getattr(self, name), finite=True)
        if self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            raise ValueError(f"rope_scaling must be None (scaled RoPE is not supported), got {self.rope_scaling!r}")
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name) is not False:
                raise ValueError(f"{name} must be False (Llama layers have no biases), got {getattr(self, name)!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.final_logit_softcapping is not None:
            positive_number("final_logit_softcapping", self.final_logit_softcapping, finite=True)
        one_of("hidden_act", self.hidden_act, tuple(HIDDEN_ACTS))
        boolean("qk_norm", self.qk_norm)
        boolean("value_embeddings", self.value_embeddings)
        rate("hidden_dropout", self.hidden_dropout)

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
        if d.get("hidden_act", "silu") not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(map(repr, HIDDEN_ACTS))}, got {d['hidden_act']!r}")
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
        """A Hugging Face Llama ``config.json`` dict (loads with ``transformers.LlamaConfig(**d)``).

        Raises:
            ValueError: one of :data:`EXTENSIONS` is set (HF's Llama has no such option: the exported model would
                compute other logits).
        """
        for name, off in EXTENSIONS.items():
            if getattr(self, name) != off:
                raise ValueError(f"{name}={getattr(self, name)} has no equivalent in Hugging Face's Llama: this model "
                                 "cannot be saved in its format (save the attnlab checkpoint)")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in (*EXTENSIONS, *TRAINING)}
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "head_dim": self.head_dim, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                **d}


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama language model: token embedding, ``num_hidden_layers`` pre-RMSNorm causal
    :class:`DecoderLayer` (GQA + RoPE, SwiGLU), final RMSNorm, LM head (tied per config).

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories (see
    :mod:`attnlab.models.hub`).
    """

    hf_architecture = "LlamaForCausalLM"

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.drop = Dropout(c.hidden_dropout)
        # one RoPE table (non-persistent buffers) shared by every layer
        rope = RotaryEmbedding(c.head_dim, base=float(c.rope_theta), max_positions=min(c.max_position_embeddings, 4096))
        spec = LayerSpec(c.hidden_size, c.num_attention_heads, ffn_dim=c.intermediate_size,
                         activation=HIDDEN_ACTS[c.hidden_act], dropout=c.hidden_dropout, attn_dropout=0.0,
                         ffn_dropout=0.0, norm_first=True, norm="rmsnorm", norm_eps=c.rms_norm_eps,
                         num_kv_heads=c.num_key_value_heads, bias=False, rotary=rope, qk_norm=c.qk_norm)
        self.layers = nn.ModuleList(DecoderLayer.from_spec(spec, cross_attention=False)
                                    for _ in range(c.num_hidden_layers))
        self.value_embeds = nn.ModuleList(nn.Embedding(c.vocab_size, c.num_key_value_heads * c.head_dim)
                                          for _ in range(c.num_hidden_layers)) if c.value_embeddings else None
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for m in self.modules():  # HF Llama's initialisation: N(0, 0.02), unit RMSNorm gains
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Token embeddings (dropped out in training); RoPE in each layer gives positions (relative, so left padding
        is exact)."""
        h = self.embed_tokens(input_ids)
        return self.drop(h) if self.training else h  # as the layers: no dropout call in evaluation or decoding

    def layer_inputs(self, input_ids: Tensor) -> Optional[list[dict]]:
        """Each layer's ``value_embed`` ``E_l[x] (B, T, Hkv·D)`` with ``value_embeddings``; else None."""
        if self.value_embeds is None:
            return None
        return [{"value_embed": table(input_ids)} for table in self.value_embeds]

    def head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def hf_weight_map(self) -> WeightMap:
        """:func:`weight_map` of this model's config."""
        return weight_map(self.config)


def state_dict_from_hf(sd: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Hugging Face ``LlamaForCausalLM`` state dict -> ours, by :func:`weight_map` (q/k/v packed into
    ``in_proj``; with ``config.tie_word_embeddings`` the head is ``model.embed_tokens.weight``).

    Raises:
        ValueError: a key is not a Llama weight, or a layer lacks one of q/k/v.
    """
    return weight_map(config).from_hf(sd)


def state_dict_to_hf(sd: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face ``LlamaForCausalLM``'s (``in_proj`` split into q/k/v), with
    ``lm_head.weight`` even when tied (as ``LlamaForCausalLM.state_dict()`` has it)."""
    return {**weight_map(config).to_hf(sd), "lm_head.weight": sd["lm_head.weight"]}


register("llama", config_from_hf=LlamaConfig.from_hf, architectures={"LlamaForCausalLM": LlamaForCausalLM},
         default="LlamaForCausalLM")
