"""attnlab's C++ ops as ``torch.compile`` and autograd see them (:mod:`attnlab._native_library`): every op's fake gives
the real op's shapes, dtypes and strides; the one-node training passes have their autograd in ``torch.library``;
none of them differentiates a second time silently; compiled models that route through the kernels trace in one
graph and compute what eager mode does."""
import re

import pytest
import torch
import torch.nn.functional as F

from attnlab import _native, _native_train
from _native_isas import ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

pytestmark = needs_native
NO_FAKE = {"attnlab::all_finite", "attnlab::int8_kernel", "attnlab::int8_cols_laid", "attnlab::cpu_isa",
           "attnlab::limit_isa"}  # a bool read from the data; settings and questions of no tensor
OPCHECK = ("test_schema", "test_faketensor", "test_autograd_registration")


def _ops() -> list[str]:
    _native.available()
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attnlab::"))


def test_every_op_has_a_fake_implementation():
    from torch._library.simple_registry import singleton
    ops = _ops()
    assert len(ops) >= 30
    missing = [n for n in ops if n not in NO_FAKE and singleton.find(n).fake_impl.kernel is None]
    assert not missing


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _samples():
    """(op, args) for torch.library.opcheck: each op on inputs of the shapes its callers give it."""
    ops = torch.ops.attnlab
    x, w = _randn(3, 64), _randn(24, 64, seed=1)
    q, k, v = (_randn(2, 3, 8, 16, seed=s) for s in (2, 3, 4))
    qkv = _randn(2, 8, 3 * 32, seed=5)
    w8, sw = torch.randint(-63, 64, (24, 64), dtype=torch.int8), _randn(24).abs() + 0.1
    out = [
        (ops.matvec, (x, w, None, _randn(24, seed=7))),
        (ops.matvec, (x, w8, sw, None)),
        (ops.gated_matvec, (x, w, None, None, _randn(24, 64, seed=8), None, None, 3)),
        (ops.rms_norm, (x, _randn(64, seed=9), 1e-5)),
        (ops.activate, (x, None, 1)),
        (ops.flash_forward, (q, k, v, 0.25, True, -1, None, None, 1, 0, None, 0.0, 16, 16, -1)),
        (ops.rms_norm_train, (x, _randn(64, seed=9), 1e-5)),
        (ops.rope_train, (q.transpose(1, 2).contiguous().transpose(1, 2), _randn(8, 8), _randn(8, 8, seed=1), 1.0)),
        (ops.act_train, (x, None, 1, True)),
        (ops.act_train, (x, _randn(3, 64, seed=2), 3, False)),
        (ops.act_train_backward, (x, _randn(3, 64, seed=2), None, 1)),
        (ops.short_attention, (q, k, v, 0.25, True, -1)),
        (ops.short_attention_packed, (qkv, 4, 0.25, True, -1)),
        (ops.quantize_rows, (x, None, 127)),
        (ops.quantize_rows_cols, (x, None, 127, 63)),
        (ops.dequantize, (torch.randint(-999, 999, (3, 24), dtype=torch.int32), _randn(3).abs(), None, None, True)),
        (ops.int8_product, (torch.randint(-9, 9, (3, 64), dtype=torch.int8), w8.t(), _randn(3).abs(), sw, None,
                            False, 1 << 20)),
        (ops.int8_linear, (x, w, None, 127, 63, True, False)),
        (ops.int8_linear, (x, w, _randn(24), 127, 63, False, True)),
    ]
    y, qw, sw2, qxt, sxc = ops.int8_linear(x, w, None, 127, 63, True, False)
    out.append((ops.int8_linear_backward, (_randn(3, 24), qw, sw2, qxt, sxc, 127, 63, True, True, True, False)))
    o, p = ops.short_attention(q, k, v, 0.25, True, -1)
    out.append((ops.short_attention_backward, (q, k, v, p, _randn(2, 3, 8, 16, seed=11), 0.25, True, -1)))
    o, p = ops.short_attention_packed(qkv, 4, 0.25, True, -1)
    out.append((ops.short_attention_packed_backward, (qkv, p, _randn(2, 8, 32, seed=12), 4, 0.25, True, -1)))
    o, lse = ops.flash_forward(q, k, v, 0.25, True, -1, None, None, 1, 0, None, 0.0, 16, 16, -1)
    out.append((ops.flash_backward, (q, k, v, o, lse, _randn(2, 3, 8, 16, seed=13), 0.25, True, -1, None, None, 1, 0,
                                     None, 0.0, 16, 16, -1)))
    return out


@pytest.mark.parametrize("i", range(23))
def test_the_fakes_give_the_real_ops_shapes_dtypes_and_strides(i):
    samples = _samples()
    assert len(samples) == 23
    op, args = samples[i]
    torch.library.opcheck(op, args, test_utils=OPCHECK)


@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("kernel", ["auto", "ours"])
def test_the_int8_layer_fake_lays_the_weight_gradient_operand_as_the_op_does(isa, kernel):
    """With AVX2 and attnlab's own int8 product (``"ours"``, or ``"auto"`` where oneDNN has no VNNI instruction) the
    op writes ``qxt`` as the transposed view of a ``(T, in)`` rounding, else contiguous: the fake asks the library
    (``int8_cols_laid``) and gives the same strides."""
    from attnlab.adapt.quant_formats import _onednn_vnni
    before = _native_train.int8_kernel(kernel)
    try:
        x, w = _randn(40, 64), _randn(24, 64, seed=1)
        torch.library.opcheck(torch.ops.attnlab.int8_linear, (x, w, None, 127, 63, True, False), test_utils=OPCHECK)
        laid = torch.ops.attnlab.int8_linear(x, w, None, 127, 63, True, False)[3].stride() == (1, 64)
        assert laid == (isa == 1 and (kernel == "ours" or not _onednn_vnni()))
    finally:
        _native_train.int8_kernel(before)


def _block_args(C=32, heads=2, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.2).requires_grad_()  # noqa: E731
    b = (lambda n: r(n)) if bias else (lambda n: None)
    x = torch.randn(2, 8, C, generator=g).requires_grad_()
    params = (1 + r(C), b(C), r(3 * C, C), b(3 * C), r(C, C), b(C), 1 + r(C), b(C), r(4 * C, C), b(4 * C), r(C, 4 * C),
              b(C))
    return x, params


@pytest.mark.parametrize("bias", [True, False])
def test_the_gpt_block_op_fake_and_autograd(bias):
    x, params = _block_args(bias=bias)
    args = (x, *(p.detach().requires_grad_() if p is not None else None for p in params), 2, 0.25, 1e-5, 1e-5, 1,
            127, 63)
    torch.library.opcheck(torch.ops.attnlab.gpt_block_train, args, test_utils=OPCHECK)
    y, saved = torch.ops.attnlab.gpt_block_train(*args)
    dy = _randn(*y.shape, seed=3)
    torch.library.opcheck(torch.ops.attnlab.gpt_block_train_backward,
                          (dy, x.detach(), [t.detach() for t in saved], *(a for a in args[1:13]), 2, 0.25, 1, 127, 63),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_mutating_decode_ops_declare_what_they_write():
    """attend_decode and decoder_step write the KV cache in place: their schemas say so (``Tensor(a!)``), which is what
    lets a compiled graph keep the write."""
    for name in ("attend_decode", "decoder_step"):
        schema = getattr(torch.ops.attnlab, name).default._schema
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == {"k_cache", "v_cache"}, name
    qkv, kc, vc = _randn(2, 1, 3 * 2 * 8), torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8)
    torch.library.opcheck(torch.ops.attnlab.attend_decode, (qkv, kc, vc, 0, 2, 2, None, None, False, 0.35),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_gradient_clip_declares_the_list_it_scales():
    """clip_grad_norm_ scales its Tensor list in place: ``Tensor(a!)[]`` in the schema, and a fake for the norm."""
    schema = torch.ops.attnlab.clip_grad_norm_.default._schema
    assert schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
    grads = [_randn(5, 7) * 3, _randn(11, seed=1) * 3]
    torch.library.opcheck(torch.ops.attnlab.clip_grad_norm_, (grads, 1.0), test_utils=("test_schema", "test_faketensor"))


# second derivatives: refused by name, never silently detached


def _int8_layer(C=16):
    from attnlab.adapt.int8_training import int8_training
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(C, C))
    int8_training(m, skip=())
    return m.train()


def _gpt_layer(C=32, heads=2):
    from attnlab.adapt.int8_training import int8_training
    from attnlab.nn.block import DecoderLayer
    torch.manual_seed(0)
    layer = DecoderLayer(C, heads, ffn_dim=4 * C, cross_attention=False, norm_first=True, dropout=0.0)
    int8_training(layer, skip=())
    return layer.train()


def _short(q, k, v):
    return _native_train.short_attention_train(q, k, v, scale=0.25, causal=True, window=None)


def _packed(qkv):
    return _native_train.short_attention_packed(qkv, 2, scale=0.25, causal=True, window=None)


def _tiled(q, k, v):
    from attnlab import attention
    return attention(q, k, v, causal=True, backend="tiled")


@pytest.mark.parametrize("path, run, shapes, match", [
    ("int8", lambda x: _int8_layer()(x), [(4, 16)], "the int8 training layer"),
    ("short", _short, [(1, 2, 8, 16)] * 3, "the short backend's fused attention"),
    ("packed", _packed, [(1, 8, 3 * 32)], "the short backend's fused attention"),
    ("gelu", lambda g: _native_train.act_kept_train(g, "gelu"), [(4, 16)], "the FFN activation"),
    ("block", lambda x: _gpt_layer()(x), [(2, 8, 32)], "the GPT block's one-node training pass"),
    ("tiled", _tiled, [(1, 2, 8, 16)] * 3, "the tiled backend's C++ flash attention"),
])
def test_a_second_derivative_through_a_native_path_raises_naming_it(path, run, shapes, match):
    xs = [_randn(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    y = run(*xs)
    (g,) = torch.autograd.grad(y.square().sum(), xs[0], retain_graph=True)  # the first derivative still works
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    with pytest.raises(RuntimeError, match=f"attnlab: {re.escape(match)}.* has no second derivative"):
        torch.autograd.grad(run(*xs).square().sum(), xs[0], create_graph=True)


def test_a_gradient_penalty_through_the_int8_layer_is_not_dropped_with_the_float_layer():
    """The float layer (eval mode: ``nn.Linear``'s path) differentiates twice; the int8 layer refuses (above) — the
    penalty is either right or an error, never silently zero."""
    layer = _int8_layer().eval()
    x = _randn(4, 16).requires_grad_()
    (g,) = torch.autograd.grad(layer(x).tanh().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), x)
    x64, w64, b64 = x.detach().double().requires_grad_(), layer[0].weight.double(), layer[0].bias.double()
    (g64,) = torch.autograd.grad(F.linear(x64, w64, b64).tanh().sum(), x64, create_graph=True)
    (gg64,) = torch.autograd.grad(g64.square().sum(), x64)
    assert torch.allclose(gg.double(), gg64, rtol=1e-4, atol=1e-5)


# torch.compile


class _Count:
    """A compile backend that counts the graphs it is given and runs them as traced (aot_eager)."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        self.graphs, self.ops = 0, set()

        def compiler(gm, _inputs):
            for n in gm.graph.nodes:
                if n.op == "call_function":  # (an op that writes its inputs, functionalized: its name is an argument)
                    self.ops.add(str(n.args[0] if "auto_functionalized" in str(n.target) else n.target))
            return make_boxed_func(gm.forward)

        self._aot = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)

    def __call__(self, gm, inputs):
        self.graphs += 1
        return self._aot(gm, inputs)


def _train_step(model, x, y):
    logits = model(x).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()  # (through the compiled model: its backward graph)
    return loss.detach()


def _gpt2(n_layer=2):
    from attnlab.adapt.int8_training import int8_training
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=65, n_positions=32, n_embd=64, n_layer=n_layer, n_head=4, embd_pdrop=0.0,
                     resid_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg)
    int8_training(model)
    return model.train()


def _llama(n_layer=2):
    from attnlab.adapt.int8_training import int8_training
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=65, hidden_size=64, intermediate_size=192, num_hidden_layers=n_layer,
                      num_attention_heads=4, max_position_embeddings=32, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(cfg)
    int8_training(model)
    return model.train()


def _compiled_step_matches_eager(make, ops):
    """One training step of ``make()``'s model eager and compiled (``fullgraph=True``: no graph break at all, one
    graph): the same loss and gradients to float32 round-off of the loss's magnitude (the compiled graph may sum in
    another order), with the ``ops`` of attnlab in the traced forward and backward graphs."""
    torch._dynamo.reset()
    eager, model = make(), make()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 65, (2, 32), generator=g), torch.randint(0, 65, (2, 32), generator=g)
    want = _train_step(eager, x, y)
    count = _Count()
    got = _train_step(torch.compile(model, backend=count, fullgraph=True), x, y)
    assert count.graphs == 1
    assert {f"attnlab.{op}.default" for op in ops} <= count.ops, count.ops
    tol = 64 * 2.0**-24
    assert torch.allclose(got, want, rtol=tol, atol=0)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        scale = pe.grad.abs().max().item()
        assert torch.allclose(pc.grad, pe.grad, rtol=0, atol=1e3 * 2.0**-24 * max(scale, 1e-30)), name


def test_a_compiled_gpt2_training_step_is_one_graph_through_the_kernels():
    _compiled_step_matches_eager(_gpt2, ["int8_linear", "int8_linear_backward", "short_attention_packed",
                                         "short_attention_packed_backward", "act_train"])


@pytest.mark.slow
def test_a_compiled_llama_training_step_is_one_graph_through_the_kernels():
    _compiled_step_matches_eager(_llama, ["int8_linear", "int8_linear_backward", "short_attention",
                                          "short_attention_backward"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_compiled_decode_step_is_one_graph_through_the_kernels(arch):
    """A decoding step of an ``optimize_for_inference`` model (``DecoderOnlyLM``'s one-token path: matvec,
    attend_decode writing the KV cache in place, rms_norm / gated_matvec) compiled with ``fullgraph=True``: no graph
    break, the same logits as the eager step to float32 round-off, and the same cache entries afterwards."""
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
    torch._dynamo.reset()
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                           bos_token_id=None, eos_token_id=None))
        ops = {"matvec", "attend_decode"}
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=65, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=32, bos_token_id=None,
                                             eos_token_id=None))
        ops = {"matvec", "attend_decode", "rms_norm", "gated_matvec"}
    model.eval().optimize_for_inference(dtype=torch.float32)
    ids = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(1))

    def step(tok, caches):
        return model(tok, past_key_values=caches, use_cache=True).logits

    count = _Count()
    compiled = torch.compile(step, backend=count, fullgraph=True)
    with torch.no_grad():
        runs = []
        for fn in (step, compiled):
            caches = model.new_cache(max_length=32)
            tok = model(ids, past_key_values=caches, use_cache=True).logits[:, -1:].argmax(-1)
            first = fn(tok, caches)
            graphs = count.graphs
            second = fn(first.argmax(-1), caches)  # reads the entries the first step wrote
            runs.append(((first, second), caches))
    # fullgraph: no graph break; one graph a step (the second step's new position may trace it once more)
    assert graphs == 1 and count.graphs <= 2 and {f"attnlab.{op}.default" for op in ops} <= count.ops, count.ops
    (want, c_want), (got, c_got) = runs
    for w, g in zip(want, got):
        assert torch.allclose(g, w, rtol=0, atol=64 * 2.0**-24 * w.abs().max().item())
    for a, b in zip(c_want, c_got):  # the compiled steps wrote the same entries, in the cache's own buffers
        assert a.self_attn.length == b.self_attn.length == 10
        for t_a, t_b in ((a.self_attn.k, b.self_attn.k), (a.self_attn.v, b.self_attn.v)):
            t_a, t_b = t_a[:, :, :10], t_b[:, :, :10]  # (the buffers' rest is not written)
            assert torch.allclose(t_b, t_a, rtol=0, atol=64 * 2.0**-24 * t_a.abs().max().item())
