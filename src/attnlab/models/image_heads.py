"""Image classification heads, as Hugging Face defines them::

    ViTForImageClassification    logits = W_c LN(hᴸ)_[CLS] + b_c                      (B, num_labels)
    CLIPForImageClassification   logits = W_c mean_{i ≥ 1} hᴸ_i + b_c                 (B, num_labels)

ViT reads the [CLS] token after the final LayerNorm (:mod:`attnlab.models.vit`, where the class lives beside
its encoder). CLIP's image classifier is its vision tower alone (no text tower, no projection) with a linear
layer on the mean of the patch tokens of the last layer — before the post-LayerNorm, which only the pooled
[CLS] state passes through. Its config is a :class:`ClassifierConfig` over the whole :class:`CLIPConfig`
(``config.json`` keeps both tower configs, ``model_type`` ``"clip"``), plus ``id2label`` and ``problem_type``.

A checkpoint without the head — a bare ``ViTModel``, a ``CLIPModel`` — loads with a freshly initialised
classifier and one warning line naming it, as transformers does; the losses are transformers'
(:func:`attnlab.models.classifier.classification_loss`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.models.classifier import ClassifierConfig, SequenceClassifierOutput, classification_loss
from attnlab.models.clip import WEIGHT_MAP as CLIP_WEIGHT_MAP, CLIPConfig, CLIPVisionTransformer, init_tower
from attnlab.models.classifier import extend_family
from attnlab.models.hub import PreTrainedMixin, WeightMap, rename
from attnlab.models.vit import ViTForImageClassification  # noqa: F401  (one import place for both heads)

__all__ = ["CLIPForImageClassification", "ViTForImageClassification"]


def _vision_weight_map() -> WeightMap:
    """CLIP's names for the vision tower alone (:data:`attnlab.models.clip.WEIGHT_MAP`'s vision rules) +
    ``classifier``."""
    rules = []
    for r in CLIP_WEIGHT_MAP.rules:
        ours = r.ours.replace("{tower:text_model|vision_model}", "{tower:vision_model}")
        if ours.startswith(("vision_model.", "{tower:vision_model}")):
            rules.append(dataclasses.replace(r, ours=ours))
    return WeightMap("CLIP", [*rules, rename("classifier.{p}", "classifier.{p}")], ignore=CLIP_WEIGHT_MAP.ignore)


class CLIPForImageClassification(PreTrainedMixin, nn.Module):
    """HF ``CLIPForImageClassification``: ``logits = W_c mean_{i ≥ 1} hᴸ_i + b_c`` over the vision tower's
    patch tokens (``hᴸ`` before the post-LayerNorm).

    Args:
        config: a :class:`ClassifierConfig` whose ``base`` is a :class:`CLIPConfig`.
    """

    hf_architecture = "CLIPForImageClassification"

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        if not isinstance(config, ClassifierConfig) or not isinstance(config.base, CLIPConfig):
            raise TypeError(f"config must be a ClassifierConfig of a CLIPConfig, got {type(config).__name__}")
        self.config = config
        v = config.base.vision_config
        self.vision_model = CLIPVisionTransformer(v)
        self.classifier = nn.Linear(v.hidden_size, config.num_labels)
        init_tower(self.vision_model, config.base.initializer_factor)
        w, b = self._fresh_head(config, torch.float32)
        with torch.no_grad():
            self.classifier.weight.copy_(w)
            self.classifier.bias.copy_(b)

    @staticmethod
    def _fresh_head(config: ClassifierConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """HF's init of the head: ``W_c ~ N(0, (E^-½ · initializer_factor)²)``, ``b_c = 0``."""
        E = config.base.vision_config.hidden_size
        std = E ** -0.5 * config.base.initializer_factor
        return torch.randn(config.num_labels, E).mul_(std).to(dtype), torch.zeros(config.num_labels, dtype=dtype)

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over :meth:`CLIPConfig.from_hf`."""
        return ClassifierConfig.from_hf(d, CLIPConfig.from_hf)

    def hf_weight_map(self) -> WeightMap:
        """The vision tower's HF names + ``classifier.{weight,bias}``."""
        return _vision_weight_map()

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any CLIP checkpoint into this head: the vision tower's tensors are kept, the text tower's, the
        projections and ``logit_scale`` dropped, and a missing classifier freshly initialised with one warning
        line."""
        hf = {k: v for k, v in hf.items() if k.startswith(("vision_model.", "classifier."))}
        anchor = "vision_model.embeddings.class_embedding"
        if "classifier.weight" not in hf and anchor in hf:
            warnings.warn(f"the checkpoint has no classifier.weight / .bias: {cls.__name__}'s head is freshly "
                          f"initialised ({config.num_labels} outputs), train it before use", stacklevel=3)
            w, b = cls._fresh_head(config, hf[anchor].dtype)
            hf = {**hf, "classifier.weight": w, "classifier.bias": b}
        return config, hf

    def forward(self, pixel_values: Tensor, labels: Optional[Tensor] = None, *,
                output_attentions: bool = False) -> SequenceClassifierOutput:
        """Classify ``pixel_values (B, num_channels, image_size, image_size)``; ``labels`` ``(B,)`` add ``loss``.

        Raises:
            ValueError: ``pixel_values`` of another kind or size (named); labels the loss refuses.
        """
        out = self.vision_model(pixel_values, output_attentions=output_attentions)
        logits = self.classifier(out.last_hidden_state[:, 1:].mean(1))  # (B, num_labels)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(logits, loss, None, out.attentions)


extend_family("clip", CLIPForImageClassification)
