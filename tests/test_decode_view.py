"""``generate`` on a plain model takes attnlab's kernels itself (attnlab.nn.inference.decode_view): the view reads the
model's own weights (no copy), agrees with the model's forward to float32 rounding, and never serves stale weights
(an in-place edit, ``load_state_dict``, a replaced parameter, a training step) nor ignores a mode or a hook."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab import _native
from attnlab.generation import generate
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.nn.inference import PackedLinear, decode_view
from tests._tolerance import tolerance

needs_native = pytest.mark.skipif(not _native.available(),
                                  reason="attnlab's native kernels are not built here (attnlab env says why)")


def _model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=211, n_positions=96)).eval()


IDS = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(1))


def _greedy(model, n: int = 10) -> torch.Tensor:
    """Greedy continuation by full forwards of the module tree as it is (no cache, no view)."""
    x = IDS
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x


def _linears(model) -> list:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]


@needs_native
def test_the_view_reads_the_weights_in_place_and_agrees_with_the_forward():
    model = _model()
    view = decode_view(model)
    assert view is not model and decode_view(model) is view  # kept while nothing changed
    assert all(type(m) is nn.Linear for m in _linears(model))  # the model itself is untouched
    pairs = list(zip(_linears(model), _linears(view)))
    assert pairs and all(isinstance(v, PackedLinear) and v.native for _, v in pairs)
    assert all(v.weight_.data_ptr() == m.weight.data_ptr() for m, v in pairs)  # no weight copied
    assert view.lm_head.weight_.data_ptr() == model.wte.weight.data_ptr()  # the tied head reads the table
    assert set(dict(view.named_parameters())) <= set(dict(model.named_parameters()))
    with torch.no_grad():
        want = model(IDS).logits
        got = view(IDS).logits
        cache = view.new_cache()
        view(IDS[:, :-1], past_key_values=cache, use_cache=True)
        step = view(IDS[:, -1:], past_key_values=cache, use_cache=True).logits  # the native decoding step
    tol = tolerance(want, n=64, depth=2)
    assert (got - want).abs().max() <= tol
    assert (step[:, 0] - want[:, -1]).abs().max() <= tol
    assert torch.equal(generate(model, IDS, max_new_tokens=10), _greedy(model))


@needs_native
@pytest.mark.parametrize("change", ["in place", "load_state_dict", "new parameter", "optimizer step", "to double"])
def test_a_changed_weight_is_never_stale(change):
    model = _model()
    before = generate(model, IDS, max_new_tokens=10)
    assert torch.equal(before, _greedy(model))
    donor = _model(seed=5)
    if change == "in place":
        with torch.no_grad():
            for p, q in zip(model.parameters(), donor.parameters()):
                p.copy_(q)
    elif change == "load_state_dict":
        model.load_state_dict(donor.state_dict())
    elif change == "new parameter":
        for (name, p), q in zip(list(model.named_parameters()), donor.parameters()):
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(owner, name.rpartition(".")[2], nn.Parameter(q.detach().clone()))
        model.lm_head.weight = model.wte.weight  # tied again, as the model builds it
    elif change == "optimizer step":
        opt = torch.optim.SGD(model.parameters(), lr=5.0)
        model.train()
        model(IDS).logits.square().mean().backward()
        opt.step()
        model.eval()
    else:  # the same values in float64: no float32 layer left for the kernel, the model decodes as it is
        model.double()
        assert decode_view(model) is model
    after = generate(model, IDS, max_new_tokens=10)
    assert torch.equal(after, _greedy(model))
    if change != "to double":
        assert not torch.equal(after, before)  # the change mattered, and was seen


@needs_native
def test_modes_and_hooks_and_the_forced_choice_keep_the_model(monkeypatch):
    model = _model()
    model.train()
    assert decode_view(model) is model  # dropout and the training path are the model's own
    model.eval()
    calls = []
    handle = model.layers[0].ffn.w2.register_forward_hook(lambda *a: calls.append(1))
    view = decode_view(model)
    assert type(view.layers[0].ffn.w2) is nn.Linear  # a hooked layer stays itself: its hook runs
    generate(model, IDS, max_new_tokens=3)
    assert calls
    handle.remove()
    assert isinstance(decode_view(model).layers[0].ffn.w2, PackedLinear)
    monkeypatch.setenv("ATTNLAB_FORCE_DECODE_LINEAR", "aten")  # no layer on attnlab's kernel: nothing to view
    other = _model(seed=2)
    assert decode_view(other) is other
    assert torch.equal(generate(other, IDS, max_new_tokens=10), _greedy(other))


def test_what_the_view_leaves_alone():
    """Models that are not decoders with inference layouts, or already optimised, decode as they are."""
    lin = nn.Linear(4, 4)
    assert decode_view(lin) is lin
    model = _model().optimize_for_inference(dtype=torch.float32)
    assert decode_view(model) is model or not any(type(m) is nn.Linear for m in decode_view(model).modules())
