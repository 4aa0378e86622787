"""Figures written by the library: ``save_heatmap`` writes a PNG of the requested size, and nothing that draws a
figure (heatmaps, the image view, the explain experiments' report) changes the caller's matplotlib backend or
leaves a pyplot figure open, so plots in a notebook keep showing after attnlab draws one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from attnlab.viz import save_heatmap

SRC = Path(__file__).resolve().parents[2] / "src"


def test_save_heatmap_writes_a_png_of_the_figure_size(tmp_path):
    w = torch.softmax(torch.randn(3, 4), -1)
    path = save_heatmap(w, tmp_path / "h.png", x_labels=list("abcd"), y_labels=list("xyz"), title="t")
    pixels = matplotlib.image.imread(path)
    # figsize (1 + 0.45·Lk, 1 + 0.45·Lq) inches at 120 dpi, RGBA
    assert pixels.shape == (round(120 * (1 + 0.45 * 3)), round(120 * (1 + 0.45 * 4)), 4)
    with pytest.raises(ValueError, match="do not match labels"):
        save_heatmap(w, tmp_path / "bad.png", x_labels=list("abc"), y_labels=list("xyz"))


SCRIPT = """
import json, matplotlib
matplotlib.use("svg")                       # the user's backend (a notebook's would be inline)
import matplotlib.pyplot as plt
plt.figure()                                # and one figure of theirs, open
import numpy as np, torch
from attnlab.viz import save_heatmap, image_view
import attnlab.experiments.explain._report, attnlab.evaluation.analysis
save_heatmap(torch.eye(2), {path!r}, x_labels=["a", "b"], y_labels=["c", "d"])
att = tuple(torch.full((1, 1, 5, 5), 0.2) for _ in range(2))
image_view(att, np.zeros((8, 8, 3)))
print(json.dumps({{"backend": matplotlib.get_backend(), "figures": plt.get_fignums()}}))
"""


def test_drawing_leaves_the_users_backend_and_figures_alone(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("MPLBACKEND", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(path=str(tmp_path / "h.png"))], env=env,
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"backend": "svg", "figures": [1]}
    assert (tmp_path / "h.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
