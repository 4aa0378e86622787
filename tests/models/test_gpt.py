"""GPT-2 against Hugging Face ``transformers.GPT2LMHeadModel`` on the same (random) weights.

Tolerances: logits max abs difference <= 1e-4 (float32, eval); the cache test compares our
incremental logits with our full forward at 1e-5.
"""
import copy

import pytest
import torch
import transformers

from attnlab.models import hub
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel, state_dict_from_hf, state_dict_to_hf
from attnlab.nn.inference import PackedLinear
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

transformers.logging.set_verbosity_error()
V, N_POS = 101, 64
TOL = 1e-4


def _hf_config(**kw):
    return transformers.GPT2Config(vocab_size=V, n_positions=N_POS, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0, **kw)


def _pair(attn="sdpa"):
    """A tiny transformers GPT-2 (weights widened to N(0, 0.3)) and ours holding the same weights."""
    theirs = transformers.GPT2LMHeadModel(_hf_config()).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(-0.5, 0.5)
    theirs.set_attn_implementation(attn)
    ours = GPT2LMHeadModel(GPT2Config.from_hf(theirs.config.to_dict())).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict()))
    return theirs, ours


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 7), mask


@torch.no_grad()
def test_logits_match_transformers():
    theirs, ours = _pair()
    ids = torch.randint(0, V, (3, 12))
    assert (ours(ids).logits - theirs(ids).logits).abs().max() <= TOL


@torch.no_grad()
def test_left_padded_logits_match_transformers_with_mask_positions():
    theirs, ours = _pair()
    ids, mask = _left_padded(torch.randint(0, V, (3, 12)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # what transformers' generate passes
    ref = theirs(ids, attention_mask=mask, position_ids=pos).logits
    got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got - ref)[keep].abs().max() <= TOL
    assert torch.isfinite(got).all()  # padded rows attend to nothing: zeros, not NaN


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(static, padded):
    _, ours = _pair()
    ids = torch.randint(0, V, (3, 10))
    mask = None
    if padded:
        ids, mask = _left_padded(ids)
    full = ours(ids, attention_mask=mask).logits
    cache = ours.new_cache(max_length=10 if static else None)
    out = ours(ids[:, :4], attention_mask=None if mask is None else mask[:, :4], past_key_values=cache, use_cache=True)
    steps = [out.logits]
    for t in range(4, 10):
        out = ours(ids[:, t:t + 1], attention_mask=None if mask is None else mask[:, :t + 1],
                   past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    inc = torch.cat(steps, dim=1)
    keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    assert (inc - full)[keep].abs().max() <= tolerance(full, n=32, depth=2)
    assert cache[0].self_attn.length == 10


@torch.no_grad()
def test_output_attentions_match_eager_transformers():
    theirs, ours = _pair(attn="eager")
    ids = torch.randint(0, V, (2, 9))
    ref = theirs(ids, output_attentions=True).attentions
    got = ours(ids, output_attentions=True).attentions
    assert len(got) == 2
    for g, r in zip(got, ref):
        assert g.shape == (2, 4, 9, 9)
        assert (g - r).abs().max() <= tolerance(r, n=32, depth=2)


@torch.no_grad()
def test_to_hf_round_trip_loads_into_transformers():
    config = GPT2Config(vocab_size=V, n_positions=N_POS, n_embd=32, n_layer=2, n_head=4)
    ours = GPT2LMHeadModel(config).eval()
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config.to_hf())).eval()
    theirs.load_state_dict(state_dict_to_hf(ours.state_dict()), strict=True)
    ids = torch.randint(0, V, (2, 11))
    assert (ours(ids).logits - theirs(ids).logits).abs().max() <= TOL
    assert GPT2Config.from_hf(config.to_hf()) == config
    back = state_dict_from_hf(state_dict_to_hf(ours.state_dict()))
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


@torch.no_grad()
def test_from_pretrained_reads_transformers_save_and_save_pretrained_writes_one(tmp_path):
    theirs, _ = _pair()
    theirs.save_pretrained(tmp_path / "hf")
    ours = hub.from_pretrained(tmp_path / "hf")
    assert isinstance(ours, GPT2LMHeadModel) and not ours.training
    ids = torch.randint(0, V, (2, 8))
    assert (ours(ids).logits - theirs(ids).logits).abs().max() <= TOL
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    assert (again(ids).logits - theirs(ids).logits).abs().max() <= TOL


def test_lm_head_is_tied_to_token_embedding():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=N_POS, n_embd=32, n_layer=1, n_head=4))
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([[1, V]]), "input_ids"),
    (torch.tensor([[-1, 2]]), "input_ids"),
    (torch.zeros(1, N_POS + 1, dtype=torch.long), "input_ids"),
])
def test_bad_input_ids_raise(ids, match):
    _, ours = _pair()
    with pytest.raises(ValueError, match=match):
        ours(ids)


def test_too_long_with_cache_and_bad_mask_raise():
    _, ours = _pair()
    cache = ours.new_cache()
    ours(torch.zeros(1, N_POS - 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="input_ids"):
        ours(torch.zeros(1, 2, dtype=torch.long), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask"):
        ours(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("kw, match", [
    (dict(vocab_size=0), "vocab_size"), (dict(n_embd=30, n_head=4), "n_embd"),
    (dict(activation="swish"), "activation"), (dict(n_layer=True), "n_layer"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GPT2Config(**kw)


def test_from_hf_rejects_unsupported_options_and_state_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        GPT2Config.from_hf(dict(_hf_config(reorder_and_upcast_attn=True).to_dict()))
    theirs, _ = _pair()
    sd = dict(theirs.state_dict(), **{"transformer.h.0.attn.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="extra"):
        state_dict_from_hf(sd)


@torch.no_grad()
def test_optimize_for_inference_float32_keeps_logits_and_greedy_tokens_of_transformers():
    """Packed fp32 weights: the same products up to summation order, the same state dict."""
    theirs, ours = _pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    assert ours.optimize_for_inference(dtype=torch.float32) is ours and not ours.training
    assert isinstance(ours.lm_head, PackedLinear) and isinstance(ours.layers[0].ffn.w1, PackedLinear)
    ids, mask = _left_padded(torch.randint(0, V, (3, 12)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = theirs(ids, attention_mask=mask, position_ids=pos).logits
    assert (ours(ids, attention_mask=mask).logits - ref)[mask.bool()].abs().max() <= TOL
    prompt = torch.randint(0, V, (1, 6))
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, max_new_tokens=20, cache="static"), expected)
    after = ours.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@torch.no_grad()
def test_optimize_for_inference_bfloat16_is_weight_only_bf16(tmp_path):
    """bf16 weights, fp32 activations: logits within bf16 rounding of fp32 (≤ 3 % of their range here),
    fp32 logits, and a state dict that still saves to a directory transformers loads."""
    _, ours = _pair()
    ids = torch.randint(0, V, (2, 12))
    ref = ours(ids).logits
    ours.optimize_for_inference(dtype=torch.bfloat16)
    got = ours(ids).logits
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert ours.wte.weight.dtype == torch.float32  # embeddings stay fp32
    cache = ours.new_cache(max_length=12)
    steps = [ours(ids[:, :5], past_key_values=cache, use_cache=True).logits]
    steps += [ours(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 12)]
    # the one-row steps may run attnlab's matvec (fp32 activations, bf16 weights) where the full forward rounds
    # activations and outputs to bf16 for its GEMM: the two agree to bf16 rounding, as each does with fp32
    tol = 1e-5 if not ours.layers[0].ffn.w1.native else 0.03 * ref.abs().max()
    assert (torch.cat(steps, 1) - got).abs().max() <= tol
    assert (torch.cat(steps, 1) - ref).abs().max() <= 0.03 * ref.abs().max()
    ours.save_pretrained(tmp_path / "bf16")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert (again(ids).logits - got).abs().max() <= 0.03 * ref.abs().max()
    with pytest.raises(ValueError, match="dtype"):
        ours.optimize_for_inference(dtype=torch.float16)


@torch.no_grad()
def test_bias_free_model_equals_transformers_with_zero_biases(tmp_path):
    """``bias=False`` (nanoGPT's): no bias parameter anywhere; logits = HF GPT-2 whose biases are all 0."""
    theirs, _ = _pair()
    for name, p in theirs.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
    ours = GPT2LMHeadModel(GPT2Config.from_hf({**theirs.config.to_dict(), "bias": False})).eval()
    assert not any(name.endswith("bias") for name, _ in ours.named_parameters())
    weights = {k: v for k, v in state_dict_from_hf(theirs.state_dict()).items() if not k.endswith("bias")}
    ours.load_state_dict(weights)
    ids, mask = _left_padded(torch.randint(0, V, (3, 12)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # our positions follow the mask
    diff = (ours(ids, attention_mask=mask).logits - theirs(ids, attention_mask=mask, position_ids=pos).logits)[mask.bool()]
    assert diff.abs().max() <= TOL
    with pytest.raises(ValueError, match="bias=False"):
        ours.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="bias"):
        GPT2Config(bias="no")


def test_dropout_sites_are_hf_gpt2s():
    """Embeddings, attention weights, attention output and MLP output; none on the MLP hidden layer."""
    c = GPT2Config(vocab_size=V, n_positions=N_POS, n_embd=32, n_layer=2, n_head=4, embd_pdrop=0.1, resid_pdrop=0.2,
                   attn_pdrop=0.3)
    model = GPT2LMHeadModel(c)
    layer = model.layers[0]
    assert model.drop.p == 0.1 and layer.dropout1.p == 0.2 and layer.dropout2.p == 0.2
    assert layer.self_attn.dropout == 0.3 and layer.ffn.dropout.p == 0.0


@torch.no_grad()
def test_optimized_decode_writes_the_cache_in_place_and_keeps_transformers_tokens():
    """After optimize_for_inference, greedy decoding with either cache gives transformers' tokens, and no
    decode step concatenates (the growing cache writes in place; the head runs on the last position only)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    theirs, ours = _pair()
    ours.optimize_for_inference(dtype=torch.float32)
    prompt = torch.randint(0, V, (1, 6))
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    for cache in ("dynamic", "static"):
        counted = Count()
        with counted:
            got = ours.generate(prompt, max_new_tokens=24, cache=cache)
        assert torch.equal(got, expected), cache
        assert "cat" not in counted.ops, cache
        # k and v buffers per layer: allocated once (static), or doubled from 6 to 12, 24, 48 positions (dynamic)
        assert counted.ops.count("new_empty") == (3 if cache == "dynamic" else 1) * 2 * len(ours.layers), cache
    full = ours(prompt).logits
    last = ours(prompt, logits_to_keep=1).logits
    assert last.shape == (1, 1, V) and (last[:, 0] - full[:, -1]).abs().max() <= TOL
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(prompt, logits_to_keep=-1)


@torch.no_grad()
def test_optimized_model_follows_to_and_holds_the_tied_table_once():
    """The tied head reads the embedding's table (one copy; decode_weight_bytes unchanged), and ``.to(float64)``
    after optimize_for_inference gives float64 logits equal to the unoptimised float64 model's."""
    from attnlab.nn.inference import decode_weight_bytes

    _, ours = _pair()
    ids = torch.randint(0, V, (2, 9))
    ref64 = copy.deepcopy(ours).double()(ids).logits
    before = decode_weight_bytes(ours)
    ours.optimize_for_inference(dtype=torch.float32)
    assert ours.lm_head.weight_.data_ptr() == ours.wte.weight.data_ptr()  # no second V × E copy
    assert decode_weight_bytes(ours) == before
    ours.to(torch.float64)
    got = ours(ids).logits
    assert got.dtype == torch.float64 and (got - ref64).abs().max() <= 1e-10
