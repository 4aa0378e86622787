"""What a training run leaves behind for people: ``metrics.jsonl``, ``metrics.json``, ``loss.png``.

``metrics.jsonl`` holds one JSON object per line, ``{"kind": "train", "step", "loss", "lr",
"tokens_per_s", "elapsed_s"}`` every ``log_every`` steps and ``{"kind": "eval", "step",
"val_loss", …}`` at every evaluation. A resumed run first drops the lines written after its
checkpoint's step (a killed run may have logged past it), so the file reads as one run.
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Iterable, Union

from attnlab.training.checkpoint import atomic_write_bytes

__all__ = ["MetricsLog", "write_json", "plot_loss_curve"]

PathLike = Union[str, os.PathLike]


def _jsonable(x):
    """Floats that JSON can hold (NaN/inf become None), recursively; tuples become lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: PathLike, obj) -> None:
    """``obj`` as indented JSON at ``path``, written atomically (non-finite floats become null)."""
    atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=2) + "\n").encode())


class MetricsLog:
    """Append-only JSON-lines log of a run (``enabled=False`` on ranks other than 0: nothing is written)."""

    def __init__(self, path: PathLike, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def records(self) -> list[dict]:
        """Every complete record in the file (a torn last line from a killed run is skipped)."""
        if not self.path.is_file():
            return []
        out = []
        from attnlab._io import read_input_text

        for line in read_input_text("", self.path, "text").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def truncate_after(self, step: int) -> list[dict]:
        """Keep only the records with ``step <= step`` (rewritten atomically); return them."""
        kept = [r for r in self.records() if isinstance(r.get("step"), int) and r["step"] <= step]
        if self.enabled:
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        return kept

    def reset(self) -> None:
        """Start an empty log (a fresh run)."""
        if self.enabled:
            atomic_write_bytes(self.path, b"")

    def append(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")


def plot_loss_curve(records: Iterable[dict], path: PathLike, *, title: str = "") -> None:
    """Train loss and validation loss against the step, as a PNG at ``path`` (matplotlib Agg, atomic)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state

    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4.5), dpi=100)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", linewidth=1)
    if val:
        ax.plot(*zip(*val), label="val loss", color="tab:orange", marker="o", markersize=3)
        best_step, best = min(val, key=lambda sv: sv[1])
        ax.axhline(best, color="tab:orange", linestyle=":", linewidth=1)
        ax.annotate(f"best {best:.4f} @ {best_step}", (best_step, best), textcoords="offset points",
                    xytext=(0, 8), fontsize=8, ha="center")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
