"""GPT-2 (Radford et al. 2019) from attnlab's blocks, weight-compatible with Hugging Face ``gpt2``.

::

    h_0 = W_te[x] + W_pe[p]                       p = position ids (follow the attention mask)
    h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l = h_l + FFN(LN(h_l))     (pre-norm, causal)
    logits = LN_f(h_L) W_teᵀ                      (LM head tied to the token embedding)

``FFN(x) = W₂ gelu_tanh(W₁ x)`` ("gelu_new" in GPT-2's config). Hugging Face's GPT-2 stores its
projections as ``Conv1D`` (weights ``(in, out)``, the transpose of ``nn.Linear``) and packs q, k, v
in ``c_attn``, which maps onto our packed ``in_proj``: :func:`state_dict_from_hf` /
:func:`state_dict_to_hf` convert; :meth:`GPT2Config.from_hf` / :meth:`GPT2Config.to_hf` convert the
``config.json`` dict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional

from torch import Tensor, nn

from attnlab._checks import boolean, one_of, positive_int
from attnlab.models.causal_lm import DecoderOnlyLM
from attnlab.models.hub import register
from attnlab.nn.block import DecoderLayer
from attnlab.nn.dropout import Dropout

# HF activation_function -> our FeedForward activation
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# HF GPT-2 keys (after "transformer.") -> ours; Conv1D weights are transposed
_LAYER_KEYS = {
    "ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "self_attn.in_proj", "attn.c_proj": "self_attn.out_proj",
    "mlp.c_fc": "ffn.w1", "mlp.c_proj": "ffn.w2",
}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
_TOP_KEYS = {"wte": "wte", "wpe": "wpe", "ln_f": "ln_f"}


@dataclass
class GPT2Config:
    """GPT-2 hyper-parameters; the defaults are GPT-2 small (124M). Names follow HF's ``GPT2Config``.

    ``activation`` is HF's ``activation_function`` (``"gelu_new"`` = tanh-approximated GELU);
    ``n_inner`` the FFN width (default ``4 · n_embd``). ``bias=False`` drops every bias of the linear
    layers and LayerNorms (nanoGPT's ``bias=False``): attnlab-only, Hugging Face's GPT-2 has no such
    option, so such a model cannot be saved in its format.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None
    activation: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    bos_token_id: Optional[int] = 50256
    eos_token_id: Optional[int] = 50256
    bias: bool = True

    def __post_init__(self) -> None:
        boolean("bias", self.bias)
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        one_of("activation", self.activation, _HF_ACTIVATIONS)

    @classmethod
    def from_hf(cls, d: dict) -> "GPT2Config":
        """From a Hugging Face GPT-2 ``config.json`` dict (unknown keys are ignored)."""
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if d.get(flag):
                raise ValueError(f"HF GPT-2 config option {flag}=True is not supported")
        if not d.get("scale_attn_weights", True):
            raise ValueError("HF GPT-2 config option scale_attn_weights=False is not supported")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "activation_function" in d:
            kw["activation"] = d["activation_function"]
        return cls(**kw)

    def to_hf(self) -> dict:
        """A Hugging Face GPT-2 ``config.json`` dict (loads with ``transformers.GPT2Config(**d)``)."""
        if not self.bias:
            raise ValueError("GPT2Config(bias=False) has no Hugging Face GPT-2 equivalent (HF's GPT-2 always "
                             "has biases); save this model's state_dict with safetensors instead")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("activation", "bias")}
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "activation_function": self.activation, "tie_word_embeddings": True, **d}


class GPT2LMHeadModel(DecoderOnlyLM):
    """GPT-2 language model: embeddings, ``n_layer`` pre-norm causal :class:`DecoderLayer`, tied head.

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories (see
    :mod:`attnlab.models.hub`).
    """

    hf_architecture = "GPT2LMHeadModel"
    hf_ignored = (r"^lm_head\.weight$", r"\.attn\.(masked_)?bias$")  # tied copy; causal-mask buffers

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        c = self.config = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.drop = Dropout(c.embd_pdrop)
        self.layers = nn.ModuleList(
            DecoderLayer(c.n_embd, c.n_head, ffn_dim=c.n_inner or 4 * c.n_embd,
                         activation=_HF_ACTIVATIONS[c.activation], dropout=c.resid_pdrop,
                         attn_dropout=c.attn_pdrop, norm_first=True, norm_eps=c.layer_norm_epsilon,
                         bias=c.bias, cross_attention=False, ffn_dropout=0.0)  # HF GPT-2: no FFN hidden dropout
            for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(_init_weights)
        for layer in self.layers:  # residual projections: std 0.02 / sqrt(2 · n_layer), as GPT-2
            for proj in (layer.self_attn.out_proj, layer.ffn.w2):
                nn.init.normal_(proj.weight, std=0.02 / (2 * c.n_layer) ** 0.5)

    positions_field = "n_positions"

    @property
    def max_positions(self) -> int:
        return self.config.n_positions

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Token + learned position embeddings (positions follow the mask, as in HF), then dropout."""
        return self.drop(self.wte(input_ids) + self.wpe(positions))

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """HF names and layout; the tied ``lm_head.weight`` is left out (stored once, as ``wte``)."""
        sd = state_dict_to_hf(self.state_dict())
        del sd["lm_head.weight"]
        return sd

    def from_hf_state_dict(self, hf: dict[str, Tensor]) -> dict[str, Tensor]:
        """An HF GPT-2 state dict in our names, for ``load_state_dict``."""
        return state_dict_from_hf(hf)


def _init_weights(m: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def state_dict_from_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``) state dict -> ours.

    Conv1D weights ``(in, out)`` are transposed to ``nn.Linear``'s ``(out, in)``; the causal-mask
    buffers (``attn.bias``, ``attn.masked_bias``) are dropped; the tied ``lm_head.weight`` is
    taken from ``wte`` when absent (safetensors checkpoints store it once).

    Raises:
        ValueError: a key is not a GPT-2 weight.
    """
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        k = key.removeprefix("transformer.")
        if k == "lm_head.weight":
            out[k] = t
            continue
        m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", k)
        if m and m.group(2) in _LAYER_KEYS:
            i, name, kind = m.groups()
            transpose = name in _CONV1D and kind == "weight"
            out[f"layers.{i}.{_LAYER_KEYS[name]}.{kind}"] = t.t().contiguous() if transpose else t
        elif re.fullmatch(r"h\.\d+\.attn\.(bias|masked_bias)", k):
            continue
        elif k.rsplit(".", 1)[0] in _TOP_KEYS and k.rsplit(".", 1)[1] in ("weight", "bias"):
            out[k] = t
        else:
            raise ValueError(f"state dict key {key!r} is not a Hugging Face GPT-2 weight")
    if "wte.weight" not in out:
        raise ValueError("state dict has no token embedding (transformer.wte.weight)")
    out.setdefault("lm_head.weight", out["wte.weight"])
    return out


def state_dict_to_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face ``GPT2LMHeadModel``'s (``transformer.`` prefix, Conv1D layout)."""
    inverse = {v: k for k, v in _LAYER_KEYS.items()}
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key == "lm_head.weight":
            out[key] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", key)
        if m and m.group(2) in inverse:
            i, name, kind = m.groups()
            hf = inverse[name]
            transpose = hf in _CONV1D and kind == "weight"
            out[f"transformer.h.{i}.{hf}.{kind}"] = t.t().contiguous() if transpose else t
        elif key.rsplit(".", 1)[0] in _TOP_KEYS:
            out[f"transformer.{key}"] = t
        else:
            raise ValueError(f"state dict key {key!r} is not an attnlab GPT-2 weight")
    return out


register("gpt2", config_from_hf=GPT2Config.from_hf, architectures={"GPT2LMHeadModel": GPT2LMHeadModel},
         default="GPT2LMHeadModel")
