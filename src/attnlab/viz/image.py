"""Attention over an image: rollout and per-head [CLS]→patch maps of a ViT or CLIP's image tower, drawn on
the patch grid over the input picture (matplotlib).

For a sequence ``[CLS], p_1 … p_N`` (``N = gh·gw`` patches, row-major) and per-layer weights
``A_l (heads, 1 + N, 1 + N)``:

- per-head map of layer ``l``: ``M_{l,h} = A_l[h, 0, 1:]`` reshaped to ``(gh, gw)``: where [CLS] looks;
- attention rollout (Abnar & Zuidema, 2020): ``Â_l = ½ mean_h A_l + ½ I`` (the residual path; rows
  renormalised), ``R = Â_L ⋯ Â_1``, map ``R[0, 1:]``: how much each patch reaches [CLS] through all layers.

Each panel colours its own map from 0 to its maximum (the maximum is in the panel's title).
"""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab._io import check_input_file, read_input_json
from attnlab.viz.notebook import _stack

# CLIP's normalisation (its preprocessor_config.json); ViT checkpoints use 0.5 / 0.5.
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def attention_rollout(weights: Tensor) -> Tensor:
    """``R = Â_L ⋯ Â_1`` with ``Â_l = ½ mean_h A_l + ½ I``, rows renormalised (see the module docstring).

    Args:
        weights: ``(layers, heads, T, T)`` softmax weights of one example.

    Returns:
        ``(T, T)``; each row sums to 1.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be a (layers, heads, T, T) tensor, got {tuple(getattr(weights, 'shape', ()))}")
    T = weights.shape[-1]
    eye = torch.eye(T, dtype=torch.float64)
    R = eye
    for A in weights.double().mean(1):  # (T, T) per layer, heads averaged
        A = 0.5 * A + 0.5 * eye
        R = (A / A.sum(-1, keepdim=True)) @ R
    return R.float()


def patch_grid(n_tokens: int, grid: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """``(gh, gw)`` of ``n_tokens = 1 + gh·gw`` ([CLS] then the patches); square unless ``grid`` says otherwise.

    Raises:
        ValueError: the patches do not form that grid (or a square one).
    """
    n = n_tokens - 1
    if grid is None:
        g = math.isqrt(max(n, 0))
        if n < 1 or g * g != n:
            raise ValueError(f"attentions have {n_tokens} tokens: not [CLS] + a square grid of patches; "
                             "give grid=(rows, cols)")
        return g, g
    if (len(grid) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in grid)
            or grid[0] * grid[1] != n):
        raise ValueError(f"grid must be (rows, cols) with rows·cols = {n} patches ({n_tokens} tokens - [CLS]), "
                         f"got {grid!r}")
    return int(grid[0]), int(grid[1])


class ImageAttentionView:
    """The maps over the picture as one PNG figure: shown inline by Jupyter (``_repr_png_``), saved by
    :meth:`save` as ``.png`` or as a self-contained ``.html`` page (the PNG as a ``data:`` URI).

    Attributes:
        png: the figure's PNG bytes.
        rollout: ``(gh, gw)`` rollout map; heads: ``(heads, gh, gw)`` [CLS]→patch maps of ``layer``.
    """

    def __init__(self, png: bytes, *, rollout: Tensor, heads: Tensor, layer: int, title: str):
        self.png, self.rollout, self.heads, self.layer, self.title = png, rollout, heads, layer, title

    def _repr_png_(self) -> bytes:
        """The figure, for Jupyter / VS Code / Colab to show inline."""
        return self.png

    def html(self) -> str:
        """A self-contained page holding the figure (``default-src 'none'; img-src data:``)."""
        t = html.escape(self.title, quote=True)
        data = base64.b64encode(self.png).decode("ascii")
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
                f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:">\n'
                f'<title>{t}</title></head>\n<body><h1 style="font: 20px sans-serif">{t}</h1>\n'
                f'<img alt="{t}" src="data:image/png;base64,{data}"></body></html>\n')

    def save(self, path) -> Path:
        """Write ``path``: ``.html`` gets :meth:`html`, anything else the PNG (atomically).

        Raises:
            FileNotFoundError: the parent directory does not exist.
        """
        from attnlab._io import atomic_write
        from attnlab.viz.html import write_page

        path = Path(path)
        if path.suffix.lower() in (".html", ".htm"):
            return write_page(self.html(), path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"no such directory for the output file: {str(path.parent)!r}")
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(self.png))
        return path


def image_view(attentions, image, *, layer: Optional[int] = None, heads: Optional[Sequence[int]] = None,
               batch_index: int = 0, grid: Optional[tuple[int, int]] = None,
               title: str = "attention over the image") -> ImageAttentionView:
    """Rollout and the [CLS]→patch map of each head of ``layer``, drawn over ``image``.

    Args:
        attentions: tuple of per-layer ``(batch, heads, 1 + N, 1 + N)`` tensors of a ViT or CLIP image tower
            (``model(pixel_values, output_attentions=True).attentions``).
        image: the picture the model saw: a PIL image, or an array / tensor ``(H, W)``, ``(H, W, C)`` or
            ``(C, H, W)`` with values in [0, 1] or [0, 255].
        layer: the layer of the per-head maps (default: the last).
        heads: the heads drawn (default all).
        batch_index: which example of the batch.
        grid: ``(rows, cols)`` of the patches when they are not square.
        title: the figure's title.

    Raises:
        TypeError, ValueError: as :func:`attnlab.viz.head_view` for ``attentions``; a bad ``layer``, ``heads``,
            ``grid`` or ``image``.
    """
    w = _stack("attentions", attentions, batch_index)  # (layers, heads, T, T)
    L, H, T, Tk = w.shape
    if Tk != T:
        raise ValueError(f"attentions must be self-attention over [CLS] + patches (q = k), got q={T}, k={Tk}")
    gh, gw = patch_grid(T, grid)
    layer = L - 1 if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer must be an int in [0, {L}), got {layer!r}")
    from attnlab.viz.html import _indices

    heads = _indices("heads", heads, H) or list(range(H))
    picture = _as_picture(image)
    rollout = attention_rollout(w)[0, 1:].reshape(gh, gw)
    maps = w[layer][:, 0, 1:].reshape(H, gh, gw)
    panels = [("input", None), ("rollout (all layers)", rollout)]
    panels += [(f"layer {layer} head {h}: [CLS]\u2192patch", maps[h]) for h in heads]
    return ImageAttentionView(_draw(picture, panels, title), rollout=rollout, heads=maps[heads], layer=layer,
                              title=title)


def image_attention_from_path(path, image_path, *, dtype: torch.dtype = torch.float32, device="cpu"):
    """Load a ViT or CLIP checkpoint (a folder or Hub id) and run it on the picture at ``image_path``.

    The picture is prepared as the model's processor does: ViT resizes to ``image_size²``; CLIP resizes the
    short side to ``image_size`` and crops the centre; both normalise with ``image_mean``/``image_std`` of
    ``preprocessor_config.json`` when the folder has one (else ViT 0.5/0.5, CLIP's constants).

    Returns:
        ``(attentions, picture, model_name)``: the per-layer ``(1, heads, 1 + N, 1 + N)`` weights, the
        ``(S, S, 3)`` picture in [0, 1] the model saw, and the model's class name.

    Raises:
        FileNotFoundError: the model or the picture is missing.
        ValueError: the model reads no images, or the file is not a picture.
    """
    import json

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from attnlab.models.clip import CLIPModel
    from attnlab.models.hub import from_pretrained, resolve_pretrained
    from attnlab.models.image_heads import CLIPForImageClassification
    from attnlab.models.vit import ViTForImageClassification, ViTModel

    folder = resolve_pretrained(path)
    model = from_pretrained(folder, dtype=dtype).to(device)
    channels = 3
    if isinstance(model, (CLIPModel, CLIPForImageClassification)):  # (the head's config reads through to CLIP's)
        size, mean, std, crop = model.config.vision_config.image_size, CLIP_MEAN, CLIP_STD, True
        tower = model.vision_model
    elif isinstance(model, (ViTModel, ViTForImageClassification)):
        channels = model.config.num_channels
        size, mean, std, crop, tower = model.config.image_size, (0.5,) * channels, (0.5,) * channels, False, model
    else:
        raise ValueError(f"--image needs a ViT or CLIP model, but {str(path)!r} holds a {type(model).__name__}")
    pre = Path(folder) / "preprocessor_config.json"
    if pre.is_file():
        cfg = read_input_json("", pre, "config")
        mean, std = tuple(cfg.get("image_mean", mean)), tuple(cfg.get("image_std", std))
    check_input_file("--image", image_path, "image")
    try:
        img = Image.open(image_path).convert("L" if channels == 1 else "RGB")  # a greyscale model reads one channel
    except FileNotFoundError:
        raise FileNotFoundError(f"no such image: {str(image_path)!r}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{str(image_path)!r} is not a picture PIL can read: {e}") from None
    if crop:  # short side to `size`, then the centre
        scale = size / min(img.size)
        img = img.resize((max(size, round(img.width * scale)), max(size, round(img.height * scale))),
                         Image.BICUBIC)
        left, top = (img.width - size) // 2, (img.height - size) // 2
        img = img.crop((left, top, left + size, top + size))
    else:
        img = img.resize((size, size), Image.BILINEAR)
    picture = np.asarray(img, dtype=np.float32).reshape(size, size, channels) / 255.0  # (S, S, C)
    x = (torch.from_numpy(picture) - torch.tensor(mean)) / torch.tensor(std)  # (S, S, C)
    pixel_values = x.permute(2, 0, 1).unsqueeze(0).to(device=device, dtype=dtype)  # (1, C, S, S)
    with torch.no_grad():
        attentions = tower(pixel_values, output_attentions=True).attentions
    return attentions, picture, type(model).__name__


def _as_picture(image):
    """``image`` as an ``(H, W, 3)`` float array in [0, 1] for ``imshow``."""
    import numpy as np

    try:
        from PIL import Image
    except ImportError:  # pillow comes with matplotlib; without it only arrays are accepted
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        a = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
    else:
        if isinstance(image, Tensor):
            image = image.detach().cpu().numpy()
        if not isinstance(image, np.ndarray):
            raise TypeError(f"image must be a PIL image, a numpy array or a tensor, got {type(image).__name__}")
        a = image.astype(np.float64)
        if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
            a = a.transpose(1, 2, 0)  # (C, H, W) -> (H, W, C)
        if a.ndim == 2:
            a = a[..., None]
        if a.ndim != 3 or a.shape[-1] not in (1, 3, 4) or 0 in a.shape:
            raise ValueError(f"image must be (H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4; got {image.shape}")
        a = np.repeat(a, 3, -1) if a.shape[-1] == 1 else a[..., :3]
        if not np.isfinite(a).all() or a.min() < 0:
            raise ValueError("image must hold finite values in [0, 1] or [0, 255]")
        a = a / 255.0 if a.max() > 1.0 else a
    return a


def _draw(picture, panels, title: str) -> bytes:
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    cols = min(len(panels), 6)
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(2.6 * cols, 2.8 * rows + 0.4))
    axes = fig.subplots(rows, cols, squeeze=False)
    H, W = picture.shape[:2]
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, m) in zip(axes.flat, panels):
        ax.imshow(picture, extent=(0, W, H, 0))
        if m is not None:
            top = max(float(m.max()), 1e-12)
            ax.imshow(m.numpy(), extent=(0, W, H, 0), cmap="inferno", alpha=0.6, vmin=0.0, vmax=top,
                      interpolation="nearest")  # one cell per patch
            name += f"\nmax {top:.3f}"
        ax.set_title(name, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    return buf.getvalue()
