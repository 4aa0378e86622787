"""`attnlab explain ensemble`: joint heads vs an ensemble of independently trained one-head models."""
import math

import pytest
import torch

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.ensemble import HEADS, js_divergence, member, specialisation
from attnlab.experiments.explain.heads import FIELDS, FieldsModel

from _explain import check_files


def test_ensemble_quick(tmp_path):
    r = run_experiment("ensemble", tmp_path, quick=True)
    data = check_files(r, tmp_path, "ensemble")
    assert [row["model"] for row in r["rows"]] == ["joint", "ensemble"] and len(r["members"]) == HEADS
    for row in r["rows"] + r["members"]:
        assert all(0 <= row[f"acc_{o}"] <= 1 for o in (1, 3, 5, 7))
    for kind in ("joint", "ensemble"):
        drops = torch.tensor(data["drops"][kind])
        js = torch.tensor(data["js_bits"][kind], dtype=torch.float64)
        assert drops.shape == (HEADS, FIELDS) and (drops.abs() <= 1).all()
        # JS in bits: symmetric, 0 between a head and itself, within [0, 1]
        assert js.shape == (HEADS, HEADS) and torch.allclose(js, js.T, atol=1e-12)
        assert js.diagonal().abs().max() < 1e-12 and (js > -1e-12).all() and (js < 1 + 1e-12).all()
    by_offset = data["attention_by_offset"]
    assert len(by_offset["joint"]) == len(by_offset["ensemble"]) == HEADS


def test_members_have_the_joint_models_head_sizes():
    joint, one = FieldsModel(dim=64, num_heads=HEADS), member()
    assert one.attn.num_heads == 1 and one.attn.head_dim == joint.attn.head_dim == 16
    # q/k/v and output maps: H one-head members hold exactly the joint model's attention parameters
    size = lambda m: sum(p.numel() for p in m.attn.parameters()) - m.attn.out_proj.bias.numel()  # noqa: E731
    assert HEADS * size(one) == size(joint)
    ids = torch.randint(16, (2, 24))
    w = one.weights(ids)
    assert w.shape == (2, 1, 24, 24) and torch.allclose(w.sum(-1), torch.ones(2, 1, 24))


def test_js_divergence_and_specialisation_known_values():
    a = torch.zeros(1, 3, 2, 2)
    a[:, 0, :, 0] = 1  # head 0 on key 0, head 1 on key 1: disjoint, head 2 half-half
    a[:, 1, :, 1] = 1
    a[:, 2] = 0.5
    js = js_divergence(a)
    # JS(δ0 ‖ δ1) = 1 bit; JS(δ0 ‖ ½½) = ½ KL(δ0‖(¾,¼)) + ½ KL(½½‖(¾,¼)), in bits
    half = 0.5 * math.log2(4 / 3) + 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25))
    assert js[0, 1].item() == pytest.approx(1.0, abs=1e-12) and js[0, 2].item() == pytest.approx(half, abs=1e-12)
    assert specialisation(torch.eye(4)) == pytest.approx(1.0) and specialisation(torch.full((4, 4), 0.3)) == 0.0


@pytest.mark.slow
def test_ensemble_full_heads_divide_the_work(tmp_path):
    r = run_experiment("ensemble", tmp_path)
    joint, ens = r["rows"]
    assert joint["mean field acc"] > 0.95 and ens["mean field acc"] < 0.6
    assert joint["specialisation"] > 0.3 > 0.1 > ens["specialisation"]
    assert joint["mean JS (bits)"] > 2 * ens["mean JS (bits)"]
    drops = torch.tensor(r["drops"]["joint"])
    assert len(set(drops.argmax(0).tolist())) >= FIELDS - 1  # the fields' worst removals: (nearly) all different heads
