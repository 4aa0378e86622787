"""BERT (Devlin et al. 2019) from attnlab's blocks, loading and saving Hugging Face checkpoints.

::

    h⁰ = LayerNorm(E_word[x] + E_pos[i] + E_type[t])            (then dropout)
    hˡ = EncoderLayer(hˡ⁻¹)    post-norm: LN(x + Attn(x)), LN(x + W₂ gelu(W₁ x))
    pooler = tanh(W_p h_[CLS] + b_p)
    MLM logits = LN(gelu(W_t h + b_t)) E_wordᵀ + b              (decoder tied to the word embeddings)
    NSP logits = W_s pooler + b_s

Module names are ours (``layers.i.self_attn.in_proj`` packs HF's query/key/value); the HF names
appear only in :func:`weight_map`, which :meth:`to_hf_state_dict` / :meth:`from_hf_state_dict` read.
Training-mode difference from HF: our feed-forward also applies dropout to its hidden activation.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int, check_positive_float, check_rate, is_int, one_of
from attnlab._limits import check_model_sizes
from attnlab.models.hub import PreTrainedMixin, WeightMap, check_token_inputs, pack, register, rename
from attnlab.nn.block import EncoderLayer, LayerSpec
from attnlab.nn.dropout import Dropout
from attnlab.nn.feedforward import ACTIVATIONS
from attnlab.nn.inference import InferenceLayoutMixin

# HF hidden_act -> our activation name ("gelu_new" and "gelu_pytorch_tanh" are the tanh approximation).
HIDDEN_ACTS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def check_encoder_config(config, int_fields) -> None:
    """The checks every BERT-style encoder config shares (BERT, ViT): positive sizes, heads dividing the
    width, a known activation, dropout rates in [0, 1), a positive LayerNorm ε. Raises ValueError naming the field."""
    for f in int_fields:
        check_int(f, getattr(config, f))
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} must be divisible by "
                         f"num_attention_heads={config.num_attention_heads}")
    one_of("hidden_act", config.hidden_act, sorted(HIDDEN_ACTS))
    for f in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        check_rate(f, getattr(config, f))
    check_positive_float("layer_norm_eps", config.layer_norm_eps)


@dataclass
class BertConfig:
    """BERT hyper-parameters, with HF ``BertConfig``'s field names and defaults (BERT-base)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        check_model_sizes(self)
        check_encoder_config(self, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "intermediate_size", "max_position_embeddings", "type_vocab_size"))
        pad = self.pad_token_id
        if pad is not None and not (is_int(pad) and 0 <= pad < self.vocab_size):
            raise ValueError(f"pad_token_id must be a token id in [0, vocab_size={self.vocab_size}) or None, "
                             f"got {self.pad_token_id!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "BertConfig":
        """From an HF ``config.json`` dict (unknown keys ignored; unsupported variants rejected)."""
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type must be 'absolute', got {d['position_embedding_type']!r}")
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ValueError(f"{flag}=True (a BERT decoder) is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.BertConfig`` reads back unchanged."""
        return {**dataclasses.asdict(self), "model_type": "bert", "position_embedding_type": "absolute",
                "tie_word_embeddings": True}


@dataclass
class BertOutput:
    """What a BERT forward returns; fields a model does not compute are None.

    Attributes:
        last_hidden_state: ``(B, L, E)``.
        pooler_output: ``(B, E)``, ``tanh(W_p h_[CLS] + b_p)``.
        logits: masked-LM logits ``(B, L, V)``.
        seq_relationship_logits: next-sentence logits ``(B, 2)``.
        hidden_states: ``num_layers + 1`` tensors ``(B, L, E)`` (embeddings, then each layer).
        attentions: ``num_layers`` tensors ``(B, H, L, L)`` of softmax weights.
    """

    last_hidden_state: Optional[Tensor] = None
    pooler_output: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    seq_relationship_logits: Optional[Tensor] = None
    hidden_states: Optional[tuple[Tensor, ...]] = None
    attentions: Optional[tuple[Tensor, ...]] = None


class BertEmbeddings(nn.Module):
    """``LayerNorm(E_word[x] + E_pos[i] + E_type[t])`` then dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)  # (B, L, E)
        return self.dropout(self.norm(x))


def weight_map(*, pooler: bool, heads: tuple[str, ...] = ()) -> WeightMap:
    """Our names <-> HF BERT's: the encoder (+ ``pooler``) at the top for ``BertModel``, under ``bert.``
    when ``heads`` are there (``"mlm"``: the masked-LM transform and decoder bias; ``"nsp"``: the
    next-sentence classifier). q/k/v are packed into ``in_proj``."""
    pre = "bert." if heads else ""
    layer = pre + "encoder.layer.{i}"
    rules = [
        rename(f"{pre}embeddings.{{e:word|position|token_type}}.weight", f"{pre}embeddings.{{e}}_embeddings.weight"),
        rename(f"{pre}embeddings.norm.{{p}}", f"{pre}embeddings.LayerNorm.{{p}}"),
        pack(f"{pre}layers.{{i}}.self_attn.in_proj.{{p}}", *(f"{layer}.attention.self.{x}.{{p}}"
                                                            for x in ("query", "key", "value"))),
        rename(f"{pre}layers.{{i}}.self_attn.out_proj.{{p}}", f"{layer}.attention.output.dense.{{p}}"),
        rename(f"{pre}layers.{{i}}.norm1.{{p}}", f"{layer}.attention.output.LayerNorm.{{p}}"),
        rename(f"{pre}layers.{{i}}.ffn.w1.{{p}}", f"{layer}.intermediate.dense.{{p}}"),
        rename(f"{pre}layers.{{i}}.ffn.w2.{{p}}", f"{layer}.output.dense.{{p}}"),
        rename(f"{pre}layers.{{i}}.norm2.{{p}}", f"{layer}.output.LayerNorm.{{p}}"),
    ]
    if pooler:
        rules.append(rename(f"{pre}pooler.{{p}}", f"{pre}pooler.dense.{{p}}"))
    if "mlm" in heads:
        rules += [rename("transform.dense.{p}", "cls.predictions.transform.dense.{p}"),
                  rename("transform.norm.{p}", "cls.predictions.transform.LayerNorm.{p}"),
                  rename("bias", "cls.predictions.bias")]
    if "nsp" in heads:
        rules.append(rename("nsp.{p}", "cls.seq_relationship.{p}"))
    # position_ids: a non-persistent buffer old checkpoints carry; the MLM decoder: tied copies
    return WeightMap("BERT", rules, ignore=(r"position_ids$", r"^cls\.predictions\.decoder\.(weight|bias)$"))


class _BertBase(InferenceLayoutMixin, PreTrainedMixin, nn.Module):
    """What the BERT models share: HF's names from :func:`weight_map`, HF's initialisation.

    ``optimize_for_inference(dtype=...)`` packs every linear layer for oneDNN
    (:class:`~attnlab.nn.inference.InferenceLayoutMixin`).
    """

    heads: tuple[str, ...] = ()

    def hf_weight_map(self) -> WeightMap:
        """:func:`weight_map` for this model's heads and pooler."""
        encoder = self.bert if self.heads else self
        return weight_map(pooler=encoder.pooler is not None, heads=self.heads)

    def _init_weights(self, std: float) -> None:
        """HF's BERT init: N(0, std) for linear and embedding weights, zero biases, unit LayerNorms."""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=std)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
            if isinstance(mod, nn.Embedding) and mod.padding_idx is not None:
                nn.init.zeros_(mod.weight[mod.padding_idx])
            if isinstance(mod, nn.LayerNorm):
                nn.init.ones_(mod.weight)
                nn.init.zeros_(mod.bias)


def encoder_layers(config, *, norm_first: bool) -> nn.ModuleList:
    """The encoder stack of a BERT-style HF config (BERT post-norm, ViT pre-norm): fields
    ``hidden_size, num_attention_heads, intermediate_size, hidden_act, hidden_dropout_prob,
    attention_probs_dropout_prob, layer_norm_eps, num_hidden_layers``."""
    spec = LayerSpec(config.hidden_size, config.num_attention_heads, ffn_dim=config.intermediate_size,
                     activation=HIDDEN_ACTS[config.hidden_act], dropout=config.hidden_dropout_prob,
                     attn_dropout=config.attention_probs_dropout_prob, norm_first=norm_first,
                     norm_eps=config.layer_norm_eps, ffn_dropout=0.0)  # HF: no dropout on the FFN hidden layer
    return nn.ModuleList(EncoderLayer.from_spec(spec) for _ in range(config.num_hidden_layers))


class BertModel(_BertBase):
    """The BERT encoder (+ pooler): HF ``BertModel``.

    Args:
        config: :class:`BertConfig`.
        add_pooling_layer: keep the ``tanh(W_p h_[CLS])`` pooler (HF's masked-LM model has none).
    """

    hf_architecture = "BertModel"

    def __init__(self, config: BertConfig, *, add_pooling_layer: bool = True) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = encoder_layers(config, norm_first=False)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        self._init_weights(config.initializer_range)

    @classmethod
    def adapt_hf_checkpoint(cls, config: BertConfig, hf: dict[str, Tensor]) -> tuple[BertConfig, dict[str, Tensor]]:
        """A checkpoint saved without the pooler (as HF's ``BertForMaskedLM`` and
        ``BertModel(add_pooling_layer=False)`` save it) gets a freshly initialised one, as transformers does:
        ``W_p ~ N(0, initializer_range)``, ``b_p = 0``, and one warning line naming it
        (``pooler_output`` is then untrained; ``last_hidden_state`` is unaffected)."""
        names = ("pooler.dense.weight", "pooler.dense.bias")
        if any(n in hf for n in names) or "embeddings.word_embeddings.weight" not in hf:
            return config, hf  # a pooler (whole or partial: the loader checks), or not a BertModel checkpoint
        dtype = hf["embeddings.word_embeddings.weight"].dtype
        E = config.hidden_size
        warnings.warn(f"the checkpoint has no pooler ({', '.join(names)}): BertModel's pooler is freshly "
                      f"initialised (N(0, {config.initializer_range}), zero bias), so pooler_output is untrained",
                      stacklevel=3)
        return config, {**hf, names[0]: torch.randn(E, E).mul_(config.initializer_range).to(dtype),
                        names[1]: torch.zeros(E, dtype=dtype)}

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> BertOutput:
        """Encode ``input_ids (B, L)``; ``attention_mask (B, L)`` is 1 for tokens, 0 for padding.

        ``output_attentions`` adds each layer's softmax weights ``(B, H, L, L)``, recovered from
        q, k and the row log-sum-exp (:func:`attnlab.attention_weights`) beside the normal fast
        forward, which is unchanged.

        Raises:
            ValueError: an id ≥ ``vocab_size`` (or < 0), a sequence longer than
                ``max_position_embeddings``, or a mask / token-type tensor of the wrong shape or values.
        """
        token_type_ids = self._check_inputs(input_ids, attention_mask, token_type_ids)
        B, L = input_ids.shape
        pad = None if attention_mask is None else attention_mask == 0  # (B, L), True = padding
        x = self.embeddings(input_ids, token_type_ids)  # (B, L, E)
        hidden, attns = [x], []
        for layer in self.layers:
            x = layer(x, key_padding_mask=pad, need_weights=output_attentions)
            if output_attentions:
                x, w = x
                attns.append(w.self_attn)
            hidden.append(x)
        pooled = None if self.pooler is None else torch.tanh(self.pooler(x[:, 0]))  # (B, E)
        return BertOutput(last_hidden_state=x, pooler_output=pooled,
                          hidden_states=tuple(hidden) if output_hidden_states else None,
                          attentions=tuple(attns) if output_attentions else None)

    def _check_inputs(self, input_ids, attention_mask, token_type_ids) -> Tensor:
        cfg = self.config
        B, L = check_token_inputs(input_ids, attention_mask, vocab_size=cfg.vocab_size,
                                  max_positions=cfg.max_position_embeddings)
        if token_type_ids is None:
            return torch.zeros_like(input_ids)
        if not isinstance(token_type_ids, Tensor) or token_type_ids.shape != (B, L):
            raise ValueError(f"token_type_ids must be a tensor of shape (B, L) = {(B, L)}")
        if token_type_ids.min() < 0 or token_type_ids.max() >= cfg.type_vocab_size:
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={cfg.type_vocab_size})")
        return token_type_ids


class _MLMTransform(nn.Module):
    """``LayerNorm(act(W_t h + b_t))``, the masked-LM head before the tied decoder."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[HIDDEN_ACTS[config.hidden_act]]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, h: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(h)))


class BertForMaskedLM(_BertBase):
    """BERT with the masked-LM head (no pooler): HF ``BertForMaskedLM``. ``.logits`` is ``(B, L, V)``."""

    hf_architecture = "BertForMaskedLM"
    heads = ("mlm",)
    with_pooler = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=self.with_pooler)
        self.config = config
        self.transform = _MLMTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self._init_weights(config.initializer_range)

    def _mlm_logits(self, h: Tensor) -> Tensor:
        return F.linear(self.transform(h), self.bert.embeddings.word.weight, self.bias)  # (B, L, V)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> BertOutput:
        """As :meth:`BertModel.forward`, plus ``logits``."""
        out = self.bert(input_ids, attention_mask, token_type_ids, output_attentions=output_attentions,
                        output_hidden_states=output_hidden_states)
        out.logits = self._mlm_logits(out.last_hidden_state)
        return out


class BertForPreTraining(BertForMaskedLM):
    """BERT with the masked-LM and next-sentence heads: HF ``BertForPreTraining``.

    ``.logits`` (HF: ``prediction_logits``) is ``(B, L, V)``; ``.seq_relationship_logits`` is ``(B, 2)``.
    """

    hf_architecture = "BertForPreTraining"
    heads = ("mlm", "nsp")
    with_pooler = True

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.nsp = nn.Linear(config.hidden_size, 2)
        self._init_weights(config.initializer_range)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> BertOutput:
        """As :meth:`BertForMaskedLM.forward`, plus ``seq_relationship_logits``."""
        out = super().forward(input_ids, attention_mask, token_type_ids, output_attentions=output_attentions,
                              output_hidden_states=output_hidden_states)
        out.seq_relationship_logits = self.nsp(out.pooler_output)
        return out


register("bert", config_from_hf=BertConfig.from_hf, default="BertModel",
         architectures={c.hf_architecture: c for c in (BertModel, BertForMaskedLM, BertForPreTraining)})
