"""Vision Transformer (Dosovitskiy et al. 2021) from attnlab's blocks, loading and saving HF checkpoints.

::

    x_p = Conv2d_{P×P, stride P}(image)                  N = (S / P)² patches of width E
    h⁰ = [x_cls; x_p¹; …; x_pᴺ] + E_pos                   (then dropout)
    hˡ = EncoderLayer(hˡ⁻¹)    pre-norm: x + Attn(LN(x)), x + W₂ gelu(W₁ LN(x))
    y = LN(hᴸ)
    logits = W_c y_[CLS] + b_c;  pooler = tanh(W_p y_[CLS] + b_p)      (ViTModel only)

A checkpoint of the bare ``ViTModel`` loads into :class:`ViTForImageClassification` with a freshly
initialised classifier and one warning line, as transformers does (CLIP's image classifier is in
:mod:`attnlab.models.image_heads`).

Module names are ours (``layers.i.self_attn.in_proj`` packs HF's query/key/value); HF's checkpoint
names (``vit.encoder.layer.i.attention.attention.query``, ...) appear only in :func:`weight_map`,
which :meth:`to_hf_state_dict` / :meth:`from_hf_state_dict` read. Training-mode difference from HF: our
feed-forward also applies dropout to its hidden activation (HF's ViT default dropout is 0).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, one_of
from attnlab._limits import check_model_sizes
from attnlab.models.bert import check_encoder_config, encoder_layers
from attnlab.models.classifier import PROBLEM_TYPES, classification_loss
from attnlab.models.hub import PreTrainedMixin, WeightMap, pack, register, rename
from attnlab.nn.dropout import Dropout


@dataclass
class ViTConfig:
    """ViT hyper-parameters, with HF ``ViTConfig``'s field names and defaults (ViT-B/16 at 224²).

    ``id2label`` (optional) names the ``num_labels`` classes; it is kept so that a checkpoint's
    class names survive a load/save round trip. ``problem_type`` (one of
    :data:`attnlab.models.classifier.PROBLEM_TYPES` or None: inferred) chooses the loss, as transformers.
    """

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-12
    qkv_bias: bool = True
    initializer_range: float = 0.02
    num_labels: int = 2
    id2label: Optional[dict[int, str]] = None
    problem_type: Optional[str] = None

    def __post_init__(self) -> None:
        check_model_sizes(self)
        check_encoder_config(self, ("image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers",
                                    "num_attention_heads", "intermediate_size", "num_labels"))
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}")
        boolean("qkv_bias", self.qkv_bias)
        if self.problem_type is not None:
            one_of("problem_type", self.problem_type, PROBLEM_TYPES)
        if self.id2label is not None:
            if not isinstance(self.id2label, dict) or sorted(self.id2label) != list(range(self.num_labels)):
                raise ValueError(f"id2label must map each class id 0..num_labels-1 ({self.num_labels} classes) "
                                 f"to a name, got {self.id2label!r}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, d: dict) -> "ViTConfig":
        """From an HF ``config.json`` dict; ``num_labels`` comes from ``id2label`` as in HF.

        Raises:
            ValueError: an unsupported variant (non-tanh or resized pooler) or an invalid field.
        """
        if d.get("pooler_act", "tanh") != "tanh":
            raise ValueError(f"pooler_act must be 'tanh', got {d['pooler_act']!r}")
        if d.get("pooler_output_size") not in (None, d.get("hidden_size", cls.hidden_size)):
            raise ValueError(f"pooler_output_size must equal hidden_size, got {d['pooler_output_size']!r}")
        names = {f.name for f in dataclasses.fields(cls)} - {"id2label", "num_labels"}
        kw = {k: v for k, v in d.items() if k in names}
        if d.get("id2label"):
            kw["id2label"] = {int(k): v for k, v in d["id2label"].items()}
            kw["num_labels"] = len(kw["id2label"])
        elif "num_labels" in d:
            kw["num_labels"] = d["num_labels"]
        return cls(**kw)

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.ViTConfig`` reads back unchanged."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("num_labels", "id2label")}
        id2label = self.id2label or {i: f"LABEL_{i}" for i in range(self.num_labels)}
        return {**d, "model_type": "vit", "pooler_act": "tanh", "pooler_output_size": self.hidden_size,
                "id2label": {str(i): name for i, name in id2label.items()},
                "label2id": {name: i for i, name in id2label.items()}}


@dataclass
class ViTOutput:
    """What a ViT forward returns; fields a model does not compute are None.

    Attributes:
        last_hidden_state: ``(B, 1 + N, E)`` after the final LayerNorm.
        pooler_output: ``(B, E)``, ``tanh(W_p y_[CLS] + b_p)`` (ViTModel with a pooler).
        logits: ``(B, num_labels)`` (ViTForImageClassification).
        loss: the classification loss when ``labels`` are given (ViTForImageClassification).
        hidden_states: ``num_layers + 1`` tensors ``(B, 1 + N, E)`` (embeddings, then each layer; before
            the final LayerNorm, as HF).
        attentions: ``num_layers`` tensors ``(B, H, 1 + N, 1 + N)`` of softmax weights.
    """

    last_hidden_state: Optional[Tensor] = None
    pooler_output: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    loss: Optional[Tensor] = None
    hidden_states: Optional[tuple[Tensor, ...]] = None
    attentions: Optional[tuple[Tensor, ...]] = None


def check_pixel_values(pixel_values, *, num_channels: int, image_size: int, dtype: torch.dtype) -> Tensor:
    """``pixel_values`` checked to be ``(B, num_channels, image_size, image_size)`` and cast to ``dtype``.

    Raises:
        ValueError: not a floating 4-D tensor, or the wrong number of channels or image size.
    """
    if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4 or not pixel_values.is_floating_point():
        raise ValueError("pixel_values must be a floating tensor (B, C, H, W), got "
                         f"{getattr(pixel_values, 'dtype', type(pixel_values).__name__)} "
                         f"{tuple(getattr(pixel_values, 'shape', ()))}")
    _, C, H, W = pixel_values.shape
    if C != num_channels:
        raise ValueError(f"pixel_values has {C} channels; the model expects num_channels={num_channels}")
    if (H, W) != (image_size, image_size):
        raise ValueError(f"pixel_values is {H}×{W}; the model expects image_size={image_size} "
                         f"({image_size}×{image_size})")
    return pixel_values.to(dtype)


class ViTEmbeddings(nn.Module):
    """``[x_cls; Conv2d_P(image)] + E_pos`` then dropout: ``(B, C, S, S) -> (B, 1 + N, E)``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        E = config.hidden_size
        self.patch = nn.Conv2d(config.num_channels, E, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, E))
        self.position = nn.Parameter(torch.zeros(1, config.num_patches + 1, E))
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)  # (B, N, E), patches in row-major order
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, E)
        return self.dropout(x + self.position)


def weight_map(*, pooler: bool, classifier: bool) -> WeightMap:
    """Our names <-> HF ViT's: the encoder (+ ``pooler``) at the top for ``ViTModel``, under ``vit.``
    beside the ``classifier`` for ``ViTForImageClassification``. q/k/v are packed into ``in_proj``."""
    pre = "vit." if classifier else ""
    layer = pre + "encoder.layer.{i}"
    rules = [
        rename(f"{pre}embeddings.cls_token", f"{pre}embeddings.cls_token"),
        rename(f"{pre}embeddings.position", f"{pre}embeddings.position_embeddings"),
        rename(f"{pre}embeddings.patch.{{p}}", f"{pre}embeddings.patch_embeddings.projection.{{p}}"),
        pack(f"{pre}layers.{{i}}.self_attn.in_proj.{{p}}", *(f"{layer}.attention.attention.{x}.{{p}}"
                                                            for x in ("query", "key", "value"))),
        rename(f"{pre}layers.{{i}}.self_attn.out_proj.{{p}}", f"{layer}.attention.output.dense.{{p}}"),
        rename(f"{pre}layers.{{i}}.norm1.{{p}}", f"{layer}.layernorm_before.{{p}}"),
        rename(f"{pre}layers.{{i}}.norm2.{{p}}", f"{layer}.layernorm_after.{{p}}"),
        rename(f"{pre}layers.{{i}}.ffn.w1.{{p}}", f"{layer}.intermediate.dense.{{p}}"),
        rename(f"{pre}layers.{{i}}.ffn.w2.{{p}}", f"{layer}.output.dense.{{p}}"),
        rename(f"{pre}norm.{{p}}", f"{pre}layernorm.{{p}}"),
    ]
    if pooler:
        rules.append(rename(f"{pre}pooler.{{p}}", f"{pre}pooler.dense.{{p}}"))
    if classifier:
        rules.append(rename("classifier.{p}", "classifier.{p}"))
    return WeightMap("ViT", rules)


class _ViTBase(PreTrainedMixin, nn.Module):
    """What the ViT models share: HF's names from :func:`weight_map`, HF's initialisation."""

    def hf_weight_map(self) -> WeightMap:
        """:func:`weight_map` for this model's pooler and classifier."""
        classifier = hasattr(self, "classifier")
        encoder = self.vit if classifier else self
        return weight_map(pooler=encoder.pooler is not None, classifier=classifier)

    def _init_weights(self, std: float) -> None:
        """HF's ViT init: truncated N(0, std) for weights and the [CLS]/position tables, zero biases."""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(mod.weight, std=std)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.LayerNorm):
                nn.init.ones_(mod.weight)
                nn.init.zeros_(mod.bias)
            elif isinstance(mod, ViTEmbeddings):
                nn.init.trunc_normal_(mod.cls_token, std=std)
                nn.init.trunc_normal_(mod.position, std=std)


class ViTModel(_ViTBase):
    """The ViT encoder (+ optional ``tanh`` pooler on [CLS]): HF ``ViTModel``.

    Args:
        config: :class:`ViTConfig`.
        add_pooling_layer: keep the pooler (HF's classifier has none).
    """

    hf_architecture = "ViTModel"

    def __init__(self, config: ViTConfig, *, add_pooling_layer: bool = True) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = ViTEmbeddings(config)
        self.layers = encoder_layers(config, norm_first=True)
        if not config.qkv_bias:  # HF keeps the output projection's bias; only q, k, v lose theirs
            for layer in self.layers:
                layer.self_attn.in_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        self._init_weights(config.initializer_range)

    def forward(self, pixel_values: Tensor, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> ViTOutput:
        """Encode ``pixel_values (B, num_channels, image_size, image_size)``.

        ``output_attentions`` adds each layer's softmax weights ``(B, H, 1 + N, 1 + N)``
        (from each layer's forward, recovered from the rows' log-sum-exp when no gradient is needed).

        Raises:
            ValueError: ``pixel_values`` is not a floating ``(B, C, H, W)`` tensor, or its channels or
                size differ from ``num_channels`` / ``image_size``.
        """
        cfg = self.config
        pixel_values = check_pixel_values(pixel_values, num_channels=cfg.num_channels, image_size=cfg.image_size,
                                          dtype=self.embeddings.patch.weight.dtype)
        x = self.embeddings(pixel_values)  # (B, 1 + N, E)
        hidden, attns = [x], []
        for layer in self.layers:
            x = layer(x, need_weights=output_attentions)
            if output_attentions:
                x, w = x
                attns.append(w.self_attn)
            hidden.append(x)
        y = self.norm(x)
        pooled = None if self.pooler is None else torch.tanh(self.pooler(y[:, 0]))  # (B, E)
        return ViTOutput(last_hidden_state=y, pooler_output=pooled,
                         hidden_states=tuple(hidden) if output_hidden_states else None,
                         attentions=tuple(attns) if output_attentions else None)


class ViTForImageClassification(_ViTBase):
    """ViT with a linear classifier on the final [CLS] state: HF ``ViTForImageClassification``."""

    hf_architecture = "ViTForImageClassification"

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        self.config = config
        self.vit = ViTModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights(config.initializer_range)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ViTConfig, hf: dict[str, Tensor]):
        """A bare ``ViTModel`` checkpoint into this head: its names get ``vit.``, its pooler is dropped and
        the missing classifier is freshly initialised (truncated N(0, initializer_range), zero bias) with one
        warning line."""
        if not any(k.startswith("vit.") for k in hf):
            hf = {(k if k.startswith("classifier.") else "vit." + k): v for k, v in hf.items()}
        hf = {k: v for k, v in hf.items() if not k.startswith("vit.pooler.")}
        if "classifier.weight" not in hf and "vit.embeddings.cls_token" in hf:
            warnings.warn(f"the checkpoint has no classifier.weight / .bias: {cls.__name__}'s head is freshly "
                          f"initialised ({config.num_labels} outputs), train it before use", stacklevel=3)
            dtype = hf["vit.embeddings.cls_token"].dtype
            w = nn.init.trunc_normal_(torch.empty(config.num_labels, config.hidden_size), std=config.initializer_range)
            hf = {**hf, "classifier.weight": w.to(dtype),
                  "classifier.bias": torch.zeros(config.num_labels, dtype=dtype)}
        return config, hf

    def forward(self, pixel_values: Tensor, labels: Optional[Tensor] = None, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> ViTOutput:
        """As :meth:`ViTModel.forward`, plus ``logits (B, num_labels) = W_c y_[CLS] + b_c``; ``labels`` ``(B,)``
        add ``loss`` (:func:`attnlab.models.classifier.classification_loss`: cross-entropy for class indices)."""
        out = self.vit(pixel_values, output_attentions=output_attentions,
                       output_hidden_states=output_hidden_states)
        out.logits = self.classifier(out.last_hidden_state[:, 0])
        out.loss = None if labels is None else classification_loss(out.logits, labels, self.config)
        return out


register("vit", config_from_hf=ViTConfig.from_hf, default="ViTModel",
         architectures={c.hf_architecture: c for c in (ViTModel, ViTForImageClassification)})
