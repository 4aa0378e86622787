"""Llama against Hugging Face ``transformers.LlamaForCausalLM`` on the same (random) weights.

Tiny config: 2 layers, hidden 32, 4 heads, 2 kv heads (GQA), intermediate 64, vocab 101.
Tolerances: logits max abs difference <= 1e-4 (float32, eval); attention weights <= 1e-5; the
cache test compares our incremental logits with our full forward at 1e-5; generated tokens exactly.
"""
import pytest
import torch
import transformers

from attnlab.models import hub
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM, state_dict_from_hf, state_dict_to_hf
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

transformers.logging.set_verbosity_error()
V = 101
TOL = 1e-4
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=500.0, max_position_embeddings=64)


def _theirs(attn="sdpa", tie=False):
    """A tiny transformers Llama with weights widened to N(0, 0.3) and RMSNorm gains in [0.5, 1.5]."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=None,
                                      pad_token_id=0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    theirs.set_attn_implementation(attn)
    return theirs


def _pair(tmp_path, attn="sdpa", tie=False):
    """transformers' model saved with ``save_pretrained`` and read back by our hub."""
    theirs = _theirs(attn, tie)
    theirs.save_pretrained(tmp_path / "hf")
    ours = hub.from_pretrained(tmp_path / "hf")
    assert isinstance(ours, LlamaForCausalLM) and not ours.training
    return theirs, ours


def _incremental(model, ids, mask=None, *, cache=None, prefix=4):
    """Logits of ``ids`` from a prefill of ``prefix`` tokens, then one cached decoding step per token."""
    cache = model.new_cache() if cache is None else cache
    upto = (lambda t: None) if mask is None else (lambda t: mask[:, :t])
    steps = [model(ids[:, :prefix], attention_mask=upto(prefix), past_key_values=cache, use_cache=True).logits]
    for t in range(prefix, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], attention_mask=upto(t + 1), past_key_values=cache, use_cache=True).logits)
    return torch.cat(steps, dim=1)


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_from_pretrained_matches_transformers_with_left_padding(tmp_path, tie):
    theirs, ours = _pair(tmp_path, tie=tie)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tie
    ids = torch.randint(0, V, (3, 12))
    assert (ours(ids).logits - theirs(ids).logits).abs().max() <= TOL
    ids, mask = _left_padded(ids)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # what transformers' generate passes
    ref = theirs(ids, attention_mask=mask, position_ids=pos).logits
    got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert (got - ref)[keep].abs().max() <= TOL
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_save_pretrained_loads_into_transformers(tmp_path, tie):
    config = LlamaConfig(**SIZES, tie_word_embeddings=tie)
    torch.manual_seed(1)
    ours = LlamaForCausalLM(config).eval()
    ours.save_pretrained(tmp_path / "ours")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert theirs.config.rope_parameters["rope_theta"] == 500.0
    ids, mask = _left_padded(torch.randint(0, V, (3, 11)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    diff = ours(ids, attention_mask=mask).logits - theirs(ids, attention_mask=mask, position_ids=pos).logits
    assert diff[mask.bool()].abs().max() <= TOL
    assert LlamaConfig.from_hf(config.to_hf()) == config
    back = state_dict_from_hf(state_dict_to_hf(ours.state_dict(), config), config)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("static", [False, True])
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(tmp_path, static):
    _, ours = _pair(tmp_path)
    ids, mask = _left_padded(torch.randint(0, V, (3, 10)))
    full = ours(ids, attention_mask=mask).logits
    cache = ours.new_cache(max_length=10 if static else None)
    inc = _incremental(ours, ids, mask, cache=cache)
    assert (inc - full)[mask.bool()].abs().max() <= tolerance(full, n=SIZES["hidden_size"], depth=2)
    assert cache[0].self_attn.length == 10


@torch.no_grad()
def test_greedy_generate_equals_transformers(tmp_path):
    theirs, ours = _pair(tmp_path)
    ids, mask = _left_padded(torch.randint(1, V, (3, 7)))
    ref = theirs.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert got.shape == (3, 15)
    assert torch.equal(got, ref)


@torch.no_grad()
def test_output_attentions_match_eager_transformers(tmp_path):
    theirs, ours = _pair(tmp_path, attn="eager")
    ids, mask = _left_padded(torch.randint(0, V, (3, 9)))
    ref = theirs(ids, attention_mask=mask, output_attentions=True).attentions
    got = ours(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == 2
    keep = mask.bool()  # rows of padding queries are arbitrary in transformers (zeros in ours)
    for g, r in zip(got, ref):
        assert g.shape == (3, 4, 9, 9)
        assert (g - r).permute(0, 2, 1, 3)[keep].abs().max() <= tolerance(r, n=SIZES["hidden_size"], depth=2)


def test_bad_input_ids_and_mask_raise():
    ours = LlamaForCausalLM(LlamaConfig(**SIZES))
    with pytest.raises(ValueError, match="input_ids"):
        ours(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="input_ids"):
        ours(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="attention_mask"):
        ours(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))


@pytest.mark.parametrize("kw, match", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(num_key_value_heads=3), "num_key_value_heads"), (dict(hidden_size=30), "hidden_size"),
    (dict(attention_bias=True), "attention_bias"), (dict(vocab_size=0), "vocab_size"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**dict(SIZES, **kw))


def test_from_hf_rejects_scaled_rope_and_other_activations():
    d = transformers.LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0}).to_dict()
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf(d)
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf(dict(transformers.LlamaConfig(**SIZES).to_dict(), hidden_act="gelu"))
    with pytest.raises(ValueError, match="extra"):
        state_dict_from_hf({"model.layers.0.extra.weight": torch.zeros(1)}, LlamaConfig(**SIZES))


@torch.no_grad()
def test_optimize_for_inference_keeps_greedy_tokens_and_bf16_is_close(tmp_path):
    theirs, ours = _pair(tmp_path)
    ids, mask = _left_padded(torch.randint(1, V, (3, 7)))
    ref_logits = ours(ids, attention_mask=mask).logits
    ours.optimize_for_inference(dtype=torch.float32)
    assert ours.layers[0].self_attn.in_proj.dtype == torch.float32  # a PackedLinear
    ref = theirs.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for cache in ("dynamic", "static"):  # the growing cache doubles its room twice (7 -> 14 -> 28 positions)
        assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=12, cache=cache), ref), cache
    _, ours = _pair(tmp_path)
    ours.optimize_for_inference(dtype=torch.bfloat16)  # weight-only bf16: logits within bf16 rounding
    got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert got.dtype == torch.float32
    assert (got - ref_logits)[keep].abs().max() <= 0.03 * ref_logits[keep].abs().max()


@torch.no_grad()
def test_final_logit_softcapping_caps_the_logits_and_is_refused_by_to_hf(tmp_path):
    """``c · tanh(logits / c)`` on the same weights (decoding steps included); HF's Llama has no such option."""
    plain = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    with torch.no_grad():
        plain.lm_head.weight.mul_(100.0)  # logits well past the cap
    capped = LlamaForCausalLM(LlamaConfig(**SIZES, final_logit_softcapping=5.0)).eval()
    capped.load_state_dict(plain.state_dict())
    ids = torch.randint(0, V, (2, 9))
    raw, out = plain(ids).logits, capped(ids).logits
    assert raw.abs().max() > 20 and out.abs().max() < 5.0
    expected = 5.0 * torch.tanh(raw / 5.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=tolerance(expected))
    steps = capped.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)  # the cached step runs head() too
    torch.testing.assert_close(capped(steps).logits[:, 3:-1].argmax(-1), steps[:, 4:])
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        capped.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        LlamaConfig(**SIZES, final_logit_softcapping=0.0)
    assert "final_logit_softcapping" not in LlamaConfig(**SIZES).to_hf()


@torch.no_grad()
def test_relu2_mlp_matches_transformers_both_ways_and_decodes_natively(tmp_path):
    """``hidden_act="relu2"``: HF's Llama gates its MLP with ``max(x, 0)²``; ours reads and writes such a model (logits
    within TOL), and the fused decoding step (``optimize_for_inference``: the C++ ``decoder_step`` with the ReLU² code)
    gives the same greedy tokens and, on a prompt, logits within float32 round-off of the full forward."""
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, hidden_act="relu2", bos_token_id=0,
                                                                    eos_token_id=None, pad_token_id=0)).eval()
    for p in theirs.parameters():
        p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "hf")
    ours = hub.from_pretrained(tmp_path / "hf")
    assert ours.config.hidden_act == "relu2" and ours.layers[0].ffn.activation == "relu2_glu"
    ids, mask = _left_padded(torch.randint(1, V, (3, 9)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = theirs(ids, attention_mask=mask, position_ids=pos).logits
    assert (ours(ids, attention_mask=mask).logits - ref)[mask.bool()].abs().max() <= TOL
    ours.save_pretrained(tmp_path / "ours")  # and back: HF's Llama reads hidden_act
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert again.config.hidden_act == "relu2"
    assert (again(ids, attention_mask=mask, position_ids=pos).logits - ref)[mask.bool()].abs().max() <= TOL
    want = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours.optimize_for_inference(dtype=torch.float32)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=6), want)


def _qwen3(tie=False):
    """HF's Qwen 3 (Llama's layer with QK-norm) with widened random weights and gains in [0.5, 1.5]."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**SIZES, head_dim=SIZES["hidden_size"] // SIZES["num_attention_heads"],
                                      tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=None,
                                      pad_token_id=0)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return theirs


@torch.no_grad()
def test_qk_norm_equals_qwen3_and_is_refused_by_to_hf(tmp_path):
    """``qk_norm=True`` is Qwen 3's attention: the same weights (``q_norm`` / ``k_norm`` by :func:`weight_map`) give
    its logits within TOL with left padding, decoding with a cache equals the full forward (the step takes the
    pipeline: QK-norm is not in the fused kernels) and greedy generation equals Qwen 3's. HF's Llama has no QK-norm,
    so ``save_pretrained`` refuses before writing."""
    theirs = _qwen3()
    config = LlamaConfig(**SIZES, qk_norm=True, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    ours = LlamaForCausalLM(config).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict(), config))
    assert ours.layers[1].self_attn.k_norm.weight.shape == (SIZES["hidden_size"] // SIZES["num_attention_heads"],)
    ids, mask = _left_padded(torch.randint(1, V, (3, 10)))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = theirs(ids, attention_mask=mask, position_ids=pos).logits
    full = ours(ids, attention_mask=mask).logits
    assert (full - ref)[mask.bool()].abs().max() <= TOL
    inc = _incremental(ours, ids, mask)
    assert (inc - full)[mask.bool()].abs().max() <= tolerance(full, n=SIZES["hidden_size"], depth=2)
    want = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=6), want)
    ours.optimize_for_inference(dtype=torch.float32)  # inference layouts: still the pipeline's step, same tokens
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=6), want)
    with pytest.raises(ValueError, match="qk_norm"):
        ours.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(TypeError, match="qk_norm"):
        LlamaConfig(**SIZES, qk_norm=1)
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig(**SIZES, hidden_act="gelu")


@torch.no_grad()
def test_value_embeddings_add_a_token_table_to_the_values(tmp_path):
    """``value_embeddings``: layer l's values are ``V W_V + E_l[x]``. Oracle: the same weights without the option, with
    a hook adding ``E_l[x]`` to the value rows of the packed projection's output. Decoding with a cache equals the full
    forward, greedy generation equals the oracle's, and ``save_pretrained`` refuses (not in HF's Llama)."""
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES, value_embeddings=True)
    ours = LlamaForCausalLM(config).eval()
    for table in ours.value_embeds:
        table.weight.normal_(0, 1.0)  # large enough to move the logits
    plain = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("value_embeds.")})
    ids = torch.randint(0, V, (2, 9))
    nq, nkv = (SIZES[k] * config.head_dim for k in ("num_attention_heads", "num_key_value_heads"))
    tokens = {}

    def add_table(i):
        def hook(module, args, out):
            out = out.clone()
            out[..., nq + nkv:] += ours.value_embeds[i](tokens["ids"])  # rows q (nq), k (nkv), v (nkv)
            return out
        return hook

    for i, layer in enumerate(plain.layers):
        layer.self_attn.in_proj.register_forward_hook(add_table(i))
    tokens["ids"] = ids
    want, got = plain(ids).logits, ours(ids).logits
    assert (want - LlamaForCausalLM(LlamaConfig(**SIZES)).eval()(ids).logits).abs().max() > 0.1  # not a no-op
    assert (got - want).abs().max() <= tolerance(want, n=SIZES["hidden_size"], depth=2)
    assert (_incremental(ours, ids) - got).abs().max() <= tolerance(got, n=SIZES["hidden_size"], depth=2)
    out = ours.generate(ids[:1, :5], max_new_tokens=4)
    tokens["ids"] = out
    assert torch.equal(plain(out).logits[:, 4:-1].argmax(-1), out[:, 5:])
    with pytest.raises(ValueError, match="value_embeddings"):
        ours.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="value_embed must be"):
        ours.layers[0](torch.zeros(1, 3, SIZES["hidden_size"]), value_embed=torch.zeros(1, 3, 5))


def test_the_training_options_under_bf16_autocast():
    """QK-norm, value embeddings and ReLU² as the trainer runs them (bf16 autocast, float32 weights): q, k and v keep
    one dtype (the norms' and tables' float32 parameters do not promote them), the logits are the float32 model's
    within bf16's round-off, and every option's parameters get a gradient."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES, qk_norm=True, value_embeddings=True, hidden_act="relu2"))
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids).logits
    assert (out.float() - ref).abs().max() <= tolerance(ref, dtype=torch.bfloat16, n=SIZES["hidden_size"], depth=2)
    out.float().square().mean().backward()
    for name in ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight", "value_embeds.1.weight",
                 "layers.0.ffn.w1.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().max() > 0 and torch.isfinite(grad).all()


def test_hidden_dropout_drops_the_embeddings_and_each_branch_output_in_training_only(tmp_path):
    """``hidden_dropout`` = p: in training, ``Dropout`` on the token embeddings and on each residual branch's output
    (attention, FFN), as GPT-2's ``embd_pdrop`` / ``resid_pdrop``. Oracle: the same weights without dropout, with hooks
    that scale the embedding and each branch output (``out_proj``'s, the FFN's) by the masks the dropout modules drew
    (each ``0`` or ``1/(1-p)``): equal logits. In evaluation the option changes nothing; ``save_pretrained`` leaves it
    out (HF's Llama has no such field) and the export still loads in transformers."""
    p = 0.25
    torch.manual_seed(0)
    ours = LlamaForCausalLM(LlamaConfig(**SIZES, hidden_dropout=p))
    plain = LlamaForCausalLM(LlamaConfig(**SIZES))
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, V, (3, 16))
    with torch.no_grad():
        clean = plain.eval()(ids).logits
        assert torch.equal(ours.eval()(ids).logits, clean)
    drops = [ours.drop] + [m for layer in ours.layers for m in (layer.dropout1, layer.dropout2)]
    assert [m.p for m in drops] == [p] * 5
    assert all(layer.ffn.dropout.p == 0.0 and layer.self_attn.dropout == 0.0 for layer in ours.layers)
    masks = []
    for m in drops:
        m.register_forward_hook(lambda mod, args, out: masks.append(out / args[0].masked_fill(args[0] == 0, 1.0)))
    ours.train()
    with torch.no_grad():
        got = ours(ids).logits
    assert len(masks) == 5
    for mask in masks:
        kept = mask[mask != 0]
        assert torch.allclose(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-5, atol=0)
        assert 0.15 < (mask == 0).float().mean() < 0.35  # ~p of 3 x 16 x 32 elements dropped
    scale = iter(masks)
    targets = [plain.embed_tokens] + [m for layer in plain.layers for m in (layer.self_attn.out_proj, layer.ffn)]
    for m in targets:
        m.register_forward_hook(lambda mod, args, out, s=next(scale): out * s)
    with torch.no_grad():
        want = plain.train()(ids).logits
    assert (got - clean).abs().max() > 0.01  # the dropout moved the logits
    assert (got - want).abs().max() <= tolerance(want, n=SIZES["hidden_size"], depth=2)
    ours.eval().save_pretrained(tmp_path / "hf")
    assert "hidden_dropout" not in (tmp_path / "hf" / "config.json").read_text()
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = theirs(ids).logits
    assert (clean - want).abs().max() <= TOL
    with pytest.raises(ValueError, match="hidden_dropout"):
        LlamaConfig(**SIZES, hidden_dropout=1.5)
