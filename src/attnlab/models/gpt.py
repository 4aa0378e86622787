"""GPT-2 (Radford et al. 2019) from attnlab's blocks, weight-compatible with Hugging Face ``gpt2``.

::

    h_0 = W_te[x] + W_pe[p]                       p = position ids (follow the attention mask)
    h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l = h_l + FFN(LN(h_l))     (pre-norm, causal)
    logits = LN_f(h_L) W_teᵀ                      (LM head tied to the token embedding)

``FFN(x) = W₂ gelu_tanh(W₁ x)`` ("gelu_new" in GPT-2's config). Hugging Face's GPT-2 stores its
projections as ``Conv1D`` (weights ``(in, out)``, the transpose of ``nn.Linear``) and packs q, k, v
in ``c_attn``, which maps onto our packed ``in_proj``: :data:`WEIGHT_MAP` declares the names (read
both ways by :func:`state_dict_from_hf` / :func:`state_dict_to_hf`); :meth:`GPT2Config.from_hf` /
:meth:`GPT2Config.to_hf` convert the ``config.json`` dict.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from torch import Tensor, nn

from attnlab._checks import boolean, one_of, positive_int, positive_number, rate
from attnlab._limits import check_model_sizes
from attnlab.models.causal_lm import DecoderOnlyLM
from attnlab.models.hub import WeightMap, register, rename
from attnlab.nn.block import DecoderLayer, LayerSpec
from attnlab.nn.dropout import Dropout

# HF activation_function -> our FeedForward activation
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# HF GPT-2 keys (after "transformer.") -> ours; Conv1D weights are transposed
# Our names <-> HF GPT2LMHeadModel's. Conv1D keeps (in, out): its weights are stored transposed.
WEIGHT_MAP = WeightMap("GPT-2", [
    rename("{t:wte|wpe}.weight", "transformer.{t}.weight"),
    rename("ln_f.{p}", "transformer.ln_f.{p}"),
    rename("layers.{i}.norm{n:1|2}.{p}", "transformer.h.{i}.ln_{n}.{p}"),
    rename("layers.{i}.self_attn.in_proj.{p}", "transformer.h.{i}.attn.c_attn.{p}", transpose=True),
    rename("layers.{i}.self_attn.out_proj.{p}", "transformer.h.{i}.attn.c_proj.{p}", transpose=True),
    rename("layers.{i}.ffn.w1.{p}", "transformer.h.{i}.mlp.c_fc.{p}", transpose=True),
    rename("layers.{i}.ffn.w2.{p}", "transformer.h.{i}.mlp.c_proj.{p}", transpose=True),
], tied={"lm_head.weight": "wte.weight"}, ignore=(r"^lm_head\.weight$", r"\.attn\.(masked_)?bias$"))


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
        check_model_sizes(self)
        boolean("bias", self.bias)
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(name, getattr(self, name))
        positive_number("layer_norm_epsilon", self.layer_norm_epsilon, finite=True)
        positive_int("n_inner", self.n_inner, optional=True)
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            rate(name, getattr(self, name))
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

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        c = self.config = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.drop = Dropout(c.embd_pdrop)
        spec = LayerSpec(c.n_embd, c.n_head, ffn_dim=c.n_inner or 4 * c.n_embd,
                         activation=_HF_ACTIVATIONS[c.activation], dropout=c.resid_pdrop,
                         attn_dropout=c.attn_pdrop, norm_first=True, norm_eps=c.layer_norm_epsilon,
                         bias=c.bias, ffn_dropout=0.0)  # HF GPT-2: no FFN hidden dropout
        self.layers = nn.ModuleList(DecoderLayer.from_spec(spec, cross_attention=False) for _ in range(c.n_layer))
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

    def hf_weight_map(self) -> WeightMap:
        """:data:`WEIGHT_MAP`: HF names and Conv1D layout; the tied ``lm_head.weight`` stored once, as ``wte``."""
        return WEIGHT_MAP


def _init_weights(m: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def state_dict_from_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face GPT-2 (``GPT2LMHeadModel``, or ``GPT2Model`` without the ``transformer.`` prefix)
    state dict -> ours, by :data:`WEIGHT_MAP`: Conv1D weights ``(in, out)`` transposed to ``nn.Linear``'s
    ``(out, in)``, the causal-mask buffers (``attn.bias``, ``attn.masked_bias``) dropped, the tied
    ``lm_head.weight`` taken from ``wte``.

    Raises:
        ValueError: a key is not a GPT-2 weight, or a weight is missing.
    """
    return WEIGHT_MAP.from_hf({k if k.startswith("transformer.") or k == "lm_head.weight" else f"transformer.{k}": t
                               for k, t in sd.items()})


def state_dict_to_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our state dict -> Hugging Face ``GPT2LMHeadModel``'s (``transformer.`` prefix, Conv1D layout), with
    the tied ``lm_head.weight`` too (as ``GPT2LMHeadModel.state_dict()`` has it)."""
    return {**WEIGHT_MAP.to_hf(sd), "lm_head.weight": sd["lm_head.weight"]}


register("gpt2", config_from_hf=GPT2Config.from_hf, architectures={"GPT2LMHeadModel": GPT2LMHeadModel},
         default="GPT2LMHeadModel")
