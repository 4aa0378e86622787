"""Attention heatmaps with matplotlib, written to PNG (a bare ``Figure``: no pyplot, so a notebook's backend is
left alone)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure
from torch import Tensor

from attnlab._io import atomic_write


def save_heatmap(weights: Tensor, path, *, x_labels: Sequence[str], y_labels: Sequence[str],
                 title: str = "", x_name: str = "key", y_name: str = "query") -> Path:
    """Write ``weights (Lq, Lk)`` as a heatmap PNG: row i = query i, column j = key j."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be 2-D (Lq, Lk), got shape {tuple(weights.shape)}")
    if weights.shape != (len(y_labels), len(x_labels)):
        raise ValueError(f"weights {tuple(weights.shape)} do not match labels ({len(y_labels)}, {len(x_labels)})")
    w = weights.detach().float().cpu().numpy()
    # 0.45 inch per token, capped so that long inputs stay a readable page (labels then shrink)
    fig = Figure(figsize=(min(1.0 + 0.45 * w.shape[1], 24.0), min(1.0 + 0.45 * w.shape[0], 24.0)))
    ax = fig.subplots()
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-9), aspect="equal")
    ax.set_xticks(range(len(x_labels)), labels=list(x_labels))
    ax.set_yticks(range(len(y_labels)), labels=list(y_labels))
    ax.set_xlabel(x_name)
    ax.set_ylabel(y_name)
    if title:
        ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    return path
