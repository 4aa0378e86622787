"""Bottleneck adapters (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP").

Each adapted sub-layer output ``h = F(x)`` (attention after its output projection, or the
feed-forward network) passes through a small residual bottleneck before the layer's own residual
connection and norm::

    Adapter(h) = h + W_up f(W_down h + b_down) + b_up        W_down ∈ R^{m×E}, W_up ∈ R^{E×m}, m ≪ E

so a post-norm layer computes ``LN(x + Dropout(Adapter(F(x))))`` and a pre-norm one
``x + Dropout(Adapter(F(LN(x))))``. ``W_up`` and ``b_up`` start at zero: a freshly adapted model
computes exactly what the base model does. Only the adapters train (Houlsby et al. also train the
layer norms; pass their names to your optimiser yourself if you want that).

The adapters are attached to attnlab's :class:`~attnlab.nn.block.EncoderLayer` /
:class:`~attnlab.nn.block.DecoderLayer` without editing them: each layer gets a child ``adapters``
(a ``ModuleDict`` keyed by sub-layer name) and a forward hook on the sub-layer module applies it
to the sub-layer's output. The base parameters keep their names, so a base checkpoint still loads.
"""
from __future__ import annotations

from typing import Iterable

from torch import Tensor, nn

from attnlab._checks import non_negative_number, one_of, positive_int
from attnlab._limits import check_elements
from attnlab.nn.block import DecoderLayer, EncoderLayer
from attnlab.nn.feedforward import ACTIVATIONS

SUBLAYERS = ("self_attn", "cross_attn", "ffn")


class BottleneckAdapter(nn.Module):
    """``h + W_up f(W_down h + b_down) + b_up`` (identity at initialisation).

    Args:
        dim: model width E.
        bottleneck: hidden width m.
        activation: ``f``, one of ``relu``, ``gelu``, ``gelu_tanh``.
        init_std: std of the normal initialisation of ``W_down`` (Houlsby: near-identity init).
    """

    def __init__(self, dim: int, bottleneck: int, *, activation: str = "gelu", init_std: float = 1e-2,
                 device=None, dtype=None) -> None:
        super().__init__()
        positive_int("bottleneck", bottleneck)
        check_elements(f"an adapter of bottleneck={bottleneck} on width {dim}", 2 * dim + 1, bottleneck,
                       device=device or "cpu")
        self.down = nn.Linear(dim, bottleneck, device=device, dtype=dtype)
        self.up = nn.Linear(bottleneck, dim, device=device, dtype=dtype)
        self.activation = activation
        self._act = ACTIVATIONS[activation]
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(self._act(self.down(h)))  # (B, L, E)

    def hook(self, module: nn.Module, args, output):
        """Forward hook on a sub-layer: adapt its output (attention returns ``(out, weights)``)."""
        if isinstance(output, tuple):
            return (self(output[0]), *output[1:])
        return self(output)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (EncoderLayer, DecoderLayer))}


def apply_adapters(model: nn.Module, *, bottleneck: int, activation: str = "gelu",
                   sublayers: Iterable[str] = ("self_attn", "ffn"), init_std: float = 1e-2) -> nn.Module:
    """Insert a :class:`BottleneckAdapter` after the chosen sub-layers of every Encoder/DecoderLayer;
    freeze every base parameter (in place).

    Args:
        model: a model built from :class:`~attnlab.nn.block.EncoderLayer` / ``DecoderLayer`` (BERT,
            GPT-2, Llama, BART, ViT, CLIP, ``Seq2SeqTransformer``, ...).
        bottleneck: adapter hidden width m (Houlsby: 8–256 for BERT-base).
        activation: ``relu``, ``gelu`` or ``gelu_tanh``.
        sublayers: any of ``"self_attn"``, ``"cross_attn"`` (decoder layers that have one), ``"ffn"``;
            Houlsby's placement is after the attention and after the feed-forward network.
        init_std: std of ``W_down``'s normal init (``W_up = 0`` always).

    Returns:
        ``model``, with only the adapters trainable.

    Raises:
        ValueError: bad ``bottleneck``/``activation``/``sublayers``, a model with no Encoder/DecoderLayer,
            or one that already has adapters.
    """
    positive_int("bottleneck", bottleneck)
    one_of("activation", activation, sorted(ACTIVATIONS))
    non_negative_number("init_std", init_std)
    sublayers = [sublayers] if isinstance(sublayers, str) else list(sublayers)
    bad = [s for s in sublayers if s not in SUBLAYERS]
    if bad or not sublayers or len(set(sublayers)) != len(sublayers):
        raise ValueError(f"sublayers must be distinct names from {SUBLAYERS}, got {sublayers!r}")
    layers = _layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no EncoderLayer/DecoderLayer to put adapters in")
    if adapter_layers(model):
        raise ValueError("model already has adapters; remove_adapters(model) first")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers.values():
        present = [s for s in sublayers if getattr(layer, s, None) is not None]  # cross_attn may be None
        if not present:
            continue
        w = layer.ffn.w1.weight
        layer.adapters = nn.ModuleDict({s: BottleneckAdapter(layer.dim, bottleneck, activation=activation,
                                                             init_std=init_std, device=w.device, dtype=w.dtype)
                                        for s in present})
        for s, a in layer.adapters.items():
            getattr(layer, s).register_forward_hook(a.hook)
    return model


def adapter_layers(model: nn.Module) -> dict[str, nn.ModuleDict]:
    """``{layer name: ModuleDict of its adapters}``."""
    return {n: m.adapters for n, m in _layers(model).items() if isinstance(getattr(m, "adapters", None), nn.ModuleDict)}


def remove_adapters(model: nn.Module) -> nn.Module:
    """Detach the hooks and delete the adapters: the base model again.

    Raises:
        ValueError: the model has no adapters.
    """
    found = adapter_layers(model)
    if not found:
        raise ValueError(f"model ({type(model).__name__}) has no adapters")
    for name in found:
        layer = model.get_submodule(name)
        for s, adapter in layer.adapters.items():
            # find the hook by its owner (not a stored handle: a deep-copied model has copied hooks)
            hooks = getattr(layer, s)._forward_hooks
            for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is adapter]:
                del hooks[key]
        del layer.adapters
    return model


def adapters_config(model: nn.Module) -> dict | None:
    """The settings that rebuild this model's adapters (None without adapters)."""
    found = adapter_layers(model)
    if not found:
        return None
    adapters = [a for d in found.values() for a in d.values()]
    settings = {(a.down.out_features, a.activation) for a in adapters}
    if len(settings) > 1:
        raise ValueError(f"adapters differ in (bottleneck, activation): {sorted(settings)}")
    bottleneck, activation = settings.pop()
    sublayers = sorted({s for d in found.values() for s in d}, key=SUBLAYERS.index)
    return {"bottleneck": bottleneck, "activation": activation, "sublayers": sublayers}


def apply_adapters_config(model: nn.Module, config: dict) -> nn.Module:
    """:func:`apply_adapters` from :func:`adapters_config`'s dict."""
    return apply_adapters(model, bottleneck=config["bottleneck"], activation=config["activation"],
                          sublayers=config["sublayers"])


def adapters_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors, ``{"<layer>.adapters.<sublayer>.<down|up>.<weight|bias>": t}``."""
    return {f"{n}.adapters.{k}": t.detach() for n, d in adapter_layers(model).items()
            for k, t in d.state_dict().items()}

