"""CLIP (Radford et al. 2021) from attnlab's blocks, loading and saving Hugging Face checkpoints.

::

    text:    h⁰ = E_tok[x] + E_pos[i];  hˡ = EncoderLayer(hˡ⁻¹)  (pre-norm, causal, padding masked)
             t = W_t LN_f(hᴸ)_eos                         eos: see :meth:`CLIPTextTransformer.eos_positions`
    vision:  h⁰ = LN_pre([x_cls; Conv2d_P(image)] + E_pos);  hˡ = EncoderLayer(hˡ⁻¹)  (pre-norm)
             v = W_v LN_post(hᴸ_[CLS])
    logits_per_text = exp(s) · (t / ‖t‖)(v / ‖v‖)ᵀ,   logits_per_image = logits_per_textᵀ

The feed-forward is ``W₂ quick_gelu(W₁ x)`` with ``quick_gelu(x) = x · σ(1.702 x)`` (OpenAI's
checkpoints; ``hidden_act="gelu"`` is also read). Module names are ours (``layers.i.self_attn.in_proj``
packs HF's q/k/v projections); HF's names appear only in :data:`WEIGHT_MAP`, which
:meth:`CLIPModel.to_hf_state_dict` / :meth:`CLIPModel.from_hf_state_dict` read.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_positive_float, is_int, one_of, positive_int, rate
from attnlab._limits import check_model_sizes
from attnlab.models.hub import PreTrainedMixin, WeightMap, check_token_inputs, pack, register, rename
from attnlab.models.vit import check_pixel_values
from attnlab.nn.block import EncoderLayer, LayerSpec
from attnlab.nn.feedforward import quick_gelu  # noqa: F401  (public here since CLIP introduced it)

# HF hidden_act -> our FeedForward activation.
HIDDEN_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# eos_token_id of CLIP configs written before huggingface/transformers#24773: pool at argmax(input_ids) instead.
LEGACY_EOS_TOKEN_ID = 2


def _check_fields(cfg, positive_ints: tuple[str, ...]) -> None:
    """The checks shared by the two tower configs."""
    for f in positive_ints:
        positive_int(f, getattr(cfg, f))
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"hidden_size={cfg.hidden_size} must be divisible by "
                         f"num_attention_heads={cfg.num_attention_heads}")
    one_of("hidden_act", cfg.hidden_act, sorted(HIDDEN_ACTS))
    rate("attention_dropout", cfg.attention_dropout)
    check_positive_float("layer_norm_eps", cfg.layer_norm_eps)


def _known_fields(cls, d: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass
class CLIPTextConfig:
    """The text tower, with HF ``CLIPTextConfig``'s names and defaults (ViT-B/32's text encoder)."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0
    pad_token_id: Optional[int] = 1
    bos_token_id: Optional[int] = 49406
    eos_token_id: int = 49407

    def __post_init__(self) -> None:
        check_model_sizes(self)
        _check_fields(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "max_position_embeddings"))
        e = self.eos_token_id
        if not (is_int(e) and e >= 0):
            raise ValueError(f"eos_token_id must be a non-negative int (the pooled token), got {e!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "CLIPTextConfig":
        return cls(**_known_fields(cls, d))

    def to_hf(self) -> dict:
        return {**dataclasses.asdict(self), "model_type": "clip_text_model"}


@dataclass
class CLIPVisionConfig:
    """The vision tower, with HF ``CLIPVisionConfig``'s names and defaults (ViT-B/32)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_factor: float = 1.0

    def __post_init__(self) -> None:
        check_model_sizes(self)
        _check_fields(self, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                             "num_channels", "image_size", "patch_size"))
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} must be divisible by patch_size={self.patch_size}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, d: dict) -> "CLIPVisionConfig":
        return cls(**_known_fields(cls, d))

    def to_hf(self) -> dict:
        return {**dataclasses.asdict(self), "model_type": "clip_vision_model"}


@dataclass
class CLIPConfig:
    """CLIP: the two tower configs (objects or HF-style dicts), the shared embedding width and ``s₀``.

    ``logit_scale`` starts at ``logit_scale_init_value`` = log(1 / 0.07), the learned temperature.
    """

    text_config: Union[CLIPTextConfig, dict] = field(default_factory=CLIPTextConfig)
    vision_config: Union[CLIPVisionConfig, dict] = field(default_factory=CLIPVisionConfig)
    projection_dim: int = 512
    logit_scale_init_value: float = 2.6592
    initializer_factor: float = 1.0

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if isinstance(self.text_config, dict):
            self.text_config = CLIPTextConfig.from_hf(self.text_config)
        if isinstance(self.vision_config, dict):
            self.vision_config = CLIPVisionConfig.from_hf(self.vision_config)
        if not isinstance(self.text_config, CLIPTextConfig):
            raise TypeError(f"text_config must be a CLIPTextConfig or dict, got {type(self.text_config).__name__}")
        if not isinstance(self.vision_config, CLIPVisionConfig):
            raise TypeError(f"vision_config must be a CLIPVisionConfig or dict, "
                            f"got {type(self.vision_config).__name__}")
        positive_int("projection_dim", self.projection_dim)
        if not isinstance(self.logit_scale_init_value, numbers.Real):
            raise TypeError(f"logit_scale_init_value must be a float, got {self.logit_scale_init_value!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "CLIPConfig":
        """From an HF ``config.json`` dict. Missing tower configs take the defaults and the legacy
        ``text_config_dict`` / ``vision_config_dict`` (older OpenAI checkpoints) override, as in HF."""
        kw = _known_fields(cls, d)
        for tower, tower_cls in (("text", CLIPTextConfig), ("vision", CLIPVisionConfig)):
            merged = {**(d.get(f"{tower}_config") or {}), **(d.get(f"{tower}_config_dict") or {})}
            kw[f"{tower}_config"] = tower_cls.from_hf(merged)
        return cls(**kw)

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.CLIPConfig`` reads back unchanged."""
        return {"model_type": "clip", "projection_dim": self.projection_dim,
                "logit_scale_init_value": self.logit_scale_init_value, "initializer_factor": self.initializer_factor,
                "text_config": {**self.text_config.to_hf(), "projection_dim": self.projection_dim},
                "vision_config": {**self.vision_config.to_hf(), "projection_dim": self.projection_dim}}


@dataclass
class CLIPTowerOutput:
    """One tower's output: ``last_hidden_state (B, L, E)`` (text: after the final LayerNorm; vision:
    before the post-LayerNorm, as HF), ``pooler_output (B, E)`` and optional per-layer
    ``attentions (B, H, L, L)``."""

    last_hidden_state: Tensor
    pooler_output: Tensor
    attentions: Optional[tuple[Tensor, ...]] = None


@dataclass
class CLIPOutput:
    """``logits_per_image (B_img, B_txt)``, ``logits_per_text (B_txt, B_img)``, the unit-norm
    ``text_embeds`` / ``image_embeds`` ``(B, projection_dim)`` and each tower's output."""

    logits_per_image: Tensor
    logits_per_text: Tensor
    text_embeds: Tensor
    image_embeds: Tensor
    text_model_output: CLIPTowerOutput
    vision_model_output: CLIPTowerOutput


def _encoder_layers(cfg: Union[CLIPTextConfig, CLIPVisionConfig]) -> nn.ModuleList:
    """``num_hidden_layers`` pre-norm :class:`EncoderLayer` (no residual dropout, as HF's CLIP)."""
    spec = LayerSpec(cfg.hidden_size, cfg.num_attention_heads, ffn_dim=cfg.intermediate_size,
                     activation=HIDDEN_ACTS[cfg.hidden_act], dropout=0.0, attn_dropout=cfg.attention_dropout,
                     norm_first=True, norm_eps=cfg.layer_norm_eps)
    return nn.ModuleList(EncoderLayer.from_spec(spec) for _ in range(cfg.num_hidden_layers))


class CLIPTextTransformer(nn.Module):
    """The text tower: token + position embeddings, causal pre-norm encoder, final LayerNorm, EOS pooling."""

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = _encoder_layers(config)
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def eos_positions(self, input_ids: Tensor) -> Tensor:
        """Where each row is pooled ``(B,)``: the first ``eos_token_id``, as transformers does; with the
        legacy ``eos_token_id == 2`` the position of the largest id (the EOS token is the last vocabulary entry).

        Raises:
            ValueError: a row holds no ``eos_token_id`` (new convention only).
        """
        if self.config.eos_token_id == LEGACY_EOS_TOKEN_ID:
            return input_ids.argmax(dim=-1)
        is_eos = input_ids == self.config.eos_token_id  # (B, L)
        if not bool(is_eos.any(dim=-1).all()):
            rows = (~is_eos.any(dim=-1)).nonzero().flatten().tolist()
            raise ValueError(f"input_ids rows {rows} hold no eos_token_id={self.config.eos_token_id} to pool at")
        return is_eos.int().argmax(dim=-1)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *,
                output_attentions: bool = False) -> CLIPTowerOutput:
        """Encode ``input_ids (B, L)`` (``attention_mask``: 1 = token, 0 = padding); pooled at the EOS token."""
        self._check_inputs(input_ids, attention_mask)
        B, L = input_ids.shape
        pad = None if attention_mask is None else attention_mask == 0  # (B, L), True = padding
        pos = torch.arange(L, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(pos)  # (B, L, E)
        attns = []
        for layer in self.layers:
            x = layer(x, key_padding_mask=pad, is_causal=True, need_weights=output_attentions)
            if output_attentions:
                x, w = x
                attns.append(w.self_attn)
        x = self.final_norm(x)
        pooled = x[torch.arange(B, device=x.device), self.eos_positions(input_ids)]  # (B, E)
        return CLIPTowerOutput(x, pooled, tuple(attns) if output_attentions else None)

    def _check_inputs(self, input_ids, attention_mask) -> None:
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size,
                           max_positions=self.config.max_position_embeddings)


class CLIPVisionTransformer(nn.Module):
    """The vision tower: bias-free patch conv, class embedding, positions, pre-LN, encoder, post-LN on [CLS]."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.config = config
        E = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, E, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(E))
        self.position_embedding = nn.Embedding(config.num_patches + 1, E)
        self.pre_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.layers = _encoder_layers(config)
        self.post_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)

    def forward(self, pixel_values: Tensor, *, output_attentions: bool = False) -> CLIPTowerOutput:
        """Encode ``pixel_values (B, num_channels, image_size, image_size)``; pooled at [CLS]."""
        cfg = self.config
        pixel_values = check_pixel_values(pixel_values, num_channels=cfg.num_channels, image_size=cfg.image_size,
                                          dtype=self.patch_embedding.weight.dtype)
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (B, N, E)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)  # (B, 1 + N, E)
        x = self.pre_norm(x + self.position_embedding.weight)
        attns = []
        for layer in self.layers:
            x = layer(x, need_weights=output_attentions)
            if output_attentions:
                x, w = x
                attns.append(w.self_attn)
        return CLIPTowerOutput(x, self.post_norm(x[:, 0]), tuple(attns) if output_attentions else None)


_LAYER = "{tower}.encoder.layers.{i}"
# Our names <-> HF CLIPModel's; {tower} is text_model or vision_model, q/k/v are packed into in_proj.
WEIGHT_MAP = WeightMap("CLIP", [
    rename("text_model.{e:token|position}_embedding.weight", "text_model.embeddings.{e}_embedding.weight"),
    rename("text_model.final_norm.{p}", "text_model.final_layer_norm.{p}"),
    rename("vision_model.class_embedding", "vision_model.embeddings.class_embedding"),
    rename("vision_model.{e:patch|position}_embedding.{p}", "vision_model.embeddings.{e}_embedding.{p}"),
    rename("vision_model.pre_norm.{p}", "vision_model.pre_layrnorm.{p}"),  # sic: HF's spelling
    rename("vision_model.post_norm.{p}", "vision_model.post_layernorm.{p}"),
    pack("{tower:text_model|vision_model}.layers.{i}.self_attn.in_proj.{p}",
         *(f"{_LAYER}.self_attn.{x}_proj.{{p}}" for x in "qkv")),
    rename("{tower:text_model|vision_model}.layers.{i}.self_attn.out_proj.{p}", f"{_LAYER}.self_attn.out_proj.{{p}}"),
    rename("{tower:text_model|vision_model}.layers.{i}.norm{n:1|2}.{p}", f"{_LAYER}.layer_norm{{n}}.{{p}}"),
    rename("{tower:text_model|vision_model}.layers.{i}.ffn.w{n:1|2}.{p}", f"{_LAYER}.mlp.fc{{n}}.{{p}}"),
    rename("{x:text_projection|visual_projection}.weight", "{x}.weight"),
    rename("logit_scale", "logit_scale"),
], ignore=(r"position_ids$",))


class CLIPModel(PreTrainedMixin, nn.Module):
    """CLIP: both towers, bias-free projections to ``projection_dim`` and the learned ``logit_scale``."""

    hf_architecture = "CLIPModel"

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__()
        if not isinstance(config, CLIPConfig):
            raise TypeError(f"config must be a CLIPConfig, got {type(config).__name__}")
        self.config = config
        t, v = config.text_config, config.vision_config
        self.text_model = CLIPTextTransformer(t)
        self.vision_model = CLIPVisionTransformer(v)
        self.text_projection = nn.Linear(t.hidden_size, config.projection_dim, bias=False)
        self.visual_projection = nn.Linear(v.hidden_size, config.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(float(config.logit_scale_init_value)))
        self._init_weights()

    def get_text_features(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """``W_t LN_f(hᴸ)_eos`` ``(B, projection_dim)``, not normalised."""
        return self.text_projection(self.text_model(input_ids, attention_mask).pooler_output)

    def get_image_features(self, pixel_values: Tensor) -> Tensor:
        """``W_v LN_post(hᴸ_[CLS])`` ``(B, projection_dim)``, not normalised."""
        return self.visual_projection(self.vision_model(pixel_values).pooler_output)

    def forward(self, input_ids: Tensor, pixel_values: Tensor, attention_mask: Optional[Tensor] = None, *,
                output_attentions: bool = False) -> CLIPOutput:
        """Scaled cosine similarities of ``input_ids (B_txt, L)`` (``attention_mask``: 1 = token,
        0 = padding) and ``pixel_values (B_img, C, S, S)``.

        ``output_attentions`` adds each tower's per-layer softmax weights to its output.

        Raises:
            ValueError: bad ids, mask or pixels (the message names the argument), or a text row with
                no EOS token to pool at.
        """
        text = self.text_model(input_ids, attention_mask, output_attentions=output_attentions)
        vision = self.vision_model(pixel_values, output_attentions=output_attentions)
        t = F.normalize(self.text_projection(text.pooler_output), dim=-1)  # (B_txt, P)
        v = F.normalize(self.visual_projection(vision.pooler_output), dim=-1)  # (B_img, P)
        logits_per_text = self.logit_scale.exp() * t @ v.T  # (B_txt, B_img)
        return CLIPOutput(logits_per_text.T, logits_per_text, t, v, text, vision)

    def hf_weight_map(self) -> WeightMap:
        """:data:`WEIGHT_MAP`."""
        return WEIGHT_MAP

    @torch.no_grad()
    def _init_weights(self) -> None:
        """HF's CLIP init: each tower by :func:`init_tower`, the projections N(0, E^-½ · f)."""
        f = self.config.initializer_factor
        for tower in (self.text_model, self.vision_model):
            init_tower(tower, f)
        nn.init.normal_(self.text_projection.weight, std=self.config.text_config.hidden_size ** -0.5 * f)
        nn.init.normal_(self.visual_projection.weight, std=self.config.vision_config.hidden_size ** -0.5 * f)


@torch.no_grad()
def init_tower(tower: Union[CLIPTextTransformer, CLIPVisionTransformer], f: float) -> None:
    """HF's CLIP init of one tower: N(0, σ) with σ scaled by width, depth and the factor ``f``, zero biases,
    unit LayerNorms (as built)."""
    c = tower.config
    E, depth = c.hidden_size, (2 * c.num_hidden_layers) ** -0.5
    for layer in tower.layers:
        nn.init.normal_(layer.self_attn.in_proj.weight, std=E ** -0.5 * depth * f)
        nn.init.normal_(layer.self_attn.out_proj.weight, std=E ** -0.5 * f)
        nn.init.normal_(layer.ffn.w1.weight, std=(2 * E) ** -0.5 * f)
        nn.init.normal_(layer.ffn.w2.weight, std=E ** -0.5 * depth * f)
        for lin in (layer.self_attn.in_proj, layer.self_attn.out_proj, layer.ffn.w1, layer.ffn.w2):
            nn.init.zeros_(lin.bias)
    if isinstance(tower, CLIPTextTransformer):
        nn.init.normal_(tower.token_embedding.weight, std=0.02 * f)
        nn.init.normal_(tower.position_embedding.weight, std=0.02 * f)
    else:
        nn.init.normal_(tower.class_embedding, std=E ** -0.5 * f)
        nn.init.normal_(tower.patch_embedding.weight, std=c.initializer_range * f)
        nn.init.normal_(tower.position_embedding.weight, std=c.initializer_range * f)

register("clip", config_from_hf=CLIPConfig.from_hf, architectures={"CLIPModel": CLIPModel}, default="CLIPModel")
