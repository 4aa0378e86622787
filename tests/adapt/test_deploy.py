"""Sliding-window attention at inference on a model trained with full attention.

Oracle: with one layer, the windowed logits at position p equal transformers' GPT-2 run on the w tokens
ending at p with their original position ids (max abs ≤ 1e-4, the GPT-2 parity tolerance)."""
import pytest
import torch
import transformers

from attnlab.adapt.deploy import self_attention_modules, set_window, sliding_window
from attnlab.models.gpt import state_dict_to_hf

transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("w", [1, 3, 8])
@torch.no_grad()
def test_one_layer_window_equals_transformers_on_the_window(w, make_gpt2):
    model = make_gpt2(n_layer=1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model.config.to_hf())).eval()
    hf.load_state_dict(state_dict_to_hf(model.state_dict()), strict=True)
    ids = torch.randint(0, 97, (2, 20))
    with sliding_window(model, w):
        got = model(ids).logits
    for p in range(20):
        lo = max(0, p - w + 1)
        ref = hf(ids[:, lo:p + 1], position_ids=torch.arange(lo, p + 1).expand(2, -1)).logits[:, -1]
        assert (got[:, p] - ref).abs().max() <= 1e-4
    assert (got - model(ids).logits).abs().max() > 1e-3 or w >= 20  # the window was undone, and it mattered


@torch.no_grad()
def test_wide_window_is_full_attention_and_cache_decoding_agrees(make_gpt2):
    model = make_gpt2()
    ids = torch.randint(0, 97, (2, 16))
    full = model(ids).logits
    with sliding_window(model, 16):
        assert (model(ids).logits - full).abs().max() <= 1e-5 * full.abs().max()
    with sliding_window(model, 4):
        windowed = model(ids).logits
        cache = model.new_cache()
        step = [model(ids[:, :8], past_key_values=cache, use_cache=True).logits]
        step += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(8, 16)]
        assert (torch.cat(step, 1) - windowed).abs().max() <= 1e-4
    assert all(m.window is None for m in self_attention_modules(model).values())


def test_encoder_windows_and_errors(make_bert):
    bert = make_bert()
    previous = set_window(bert, 5)
    assert set(previous) == {"layers.0.self_attn", "layers.1.self_attn"} and set(previous.values()) == {None}
    assert all(m.window == 5 for m in self_attention_modules(bert).values())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            set_window(bert, bad)
    with pytest.raises(ValueError, match="no EncoderLayer"):
        set_window(torch.nn.Linear(2, 2), 4)
