"""Every C++ op (``torch.ops.attnlab.*``) on drawn arguments: it returns the right result or raises one error that
names it (``attnlab::<op>`` — or the attnlab op it calls), never a crash, a hang or a multi-GB allocation.

Each op starts from a valid call (``BASES``); hypothesis replaces one to three of its arguments by a drawn value: an
int from ``INTS`` (0, 1, odd, 2³¹, 2⁴⁰, 2⁶², negative), a float from ``FLOATS``, a flipped bool, None for an
optional tensor, and for a tensor another dtype, a size of 0, 1 or 3 in one dimension, a dimension more or less, a
non-contiguous copy of the same values (a transposed or strided view), or an expanded view of 2³¹ or 2⁴⁰ elements (no
memory behind it: an op must refuse its size before allocating). Where the op succeeds on the valid call its result is
checked against the PyTorch formula (``REFERENCES``), and a non-contiguous copy of an argument gives the same result
or a named error.

A crash must not end pytest silently: each family of ops runs in its own subprocess (``python
tests/test_native_fuzz.py FAMILY``) under an address-space limit (a multi-GB allocation fails there, unnamed, and so
the test), and the test asserts the subprocess exits 0 — a segfault's signal fails it, naming the family.
"""
from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _native_isas import needs_native  # noqa: E402

INTS = (0, 1, -1, 3, 7, 2**31, 2**40, 2**62, -2**62)
FLOATS = (0.0, -1.0, 1e30, math.nan, math.inf)
DTYPES = (torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool)
HUGE = (2**31, 2**40)
MEMORY_LIMIT = 16 << 30  # address space of a fuzzing process: torch's own reservations fit, a huge allocation fails
EXAMPLES = int(os.environ.get("ATTNLAB_FUZZ_EXAMPLES", "60"))  # per op


def _g(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen).to(dtype)


def _bases() -> dict:
    """op name -> (family, a function giving a valid call's arguments, fresh each time: some ops write into theirs)."""
    from attnlab.adapt.quantize import quantize_groups
    from attnlab.functional.positional import rope_frequencies

    ops = torch.ops.attnlab

    def w4():
        return quantize_groups(_g(6, 256), 32)

    def decode_args():
        B, H, Hkv, D, cap, pos = 2, 4, 2, 8, 6, 3
        cos, sin = (t[pos].contiguous() for t in rope_frequencies(D, torch.arange(pos + 1)))
        return [_g(B, 1, (H + 2 * Hkv) * D), _g(B, Hkv, cap, D), _g(B, Hkv, cap, D, seed=1), pos, H, Hkv, cos, sin,
                False, D**-0.5]

    def step_args():
        B, E, H, D, F, cap = 1, 16, 2, 8, 24, 5
        t = [torch.ones(E), None, _g(3 * E, E), None, None, _g(E, E), None, None, torch.ones(E), None,
             _g(F, E), None, None, None, None, None, _g(E, F), None, None, None, None]
        return [_g(B, 1, E), _g(B, H, cap, D), _g(B, H, cap, D), t, True, 1e-5, 1e-5, H, H, 2, False, D**-0.5, 1,
                False]

    def flash_args():
        q, k, v = _g(1, 2, 9, 8), _g(1, 1, 11, 8, seed=1), _g(1, 1, 11, 4, seed=2)
        return [q, k, v, 0.35, True, -1, None, None, 1, 0, None, 0.0, 4, 8, -1]

    def flash_bwd_args():
        a = flash_args()
        out, lse = ops.flash_forward(*a)
        return a[:3] + [out, lse, _g(*out.shape, seed=3)] + a[3:]

    def int8_linear_args():
        return [_g(6, 16), _g(8, 16, seed=1), _g(8, seed=2), 127, 127, True, False]

    def int8_bwd_args():
        y, qw, sw, qxt, sxc = ops.int8_linear(*int8_linear_args())
        return [_g(6, 8, seed=3), qw, sw, qxt, sxc, 127, 127, True, True, True, False]

    def block_args():
        C, F = 16, 32
        return [_g(2, 5, C), torch.ones(C), torch.zeros(C), _g(3 * C, C) / 4, torch.zeros(3 * C), _g(C, C) / 4, None,
                torch.ones(C), None, _g(F, C) / 4, torch.zeros(F), _g(C, F) / 4, None, 2, 8**-0.5, 1e-5, 1e-5, 1,
                127, 127]

    def block_bwd_args():
        a = block_args()
        y, saved = ops.gpt_block_train(*a)
        return [_g(*y.shape, seed=4), a[0], saved, *a[1:13], a[13], a[14], *a[17:]]

    def qkv_args():
        return [_g(2, 5, 24), 2, 0.5, True, -1]

    def packed_bwd_args():
        a = qkv_args()
        out, p = ops.short_attention_packed(*a)
        return [a[0], p, _g(*out.shape, seed=5), *a[1:]]

    def short_args():
        return [_g(2, 2, 5, 8), _g(2, 2, 7, 8, seed=1), _g(2, 2, 7, 8, seed=2), 0.35, True, -1]

    def short_bwd_args():
        a = short_args()
        out, p = ops.short_attention(*a)
        return a[:3] + [p, _g(*out.shape, seed=3)] + a[3:]

    def rms_bwd_args():
        x, w = _g(4, 8), _g(8, seed=1)
        y, r = ops.rms_norm_train(x, w, 1e-6)
        return [_g(4, 8, seed=2), x, w, r]

    def int8_product_args():
        a = torch.randint(-127, 128, (5, 40), dtype=torch.int8)
        b = torch.randint(-127, 128, (40, 6), dtype=torch.int8)
        return [a, b, torch.rand(5), torch.rand(6), _g(6), False, 1 << 16]

    return {
        "matvec": ("matvec", lambda: [_g(3, 16), _g(8, 16, seed=1), None, _g(8, seed=2)]),
        "matvec_int4": ("matvec", lambda: [_g(2, 256), *w4(), None]),
        "gated_matvec": ("matvec", lambda: [_g(2, 16), _g(8, 16, seed=1), None, None, _g(8, 16, seed=2), None, None,
                                            3]),
        "int4_dequantize": ("matvec", lambda: [*w4(), 256]),
        "rms_norm": ("decode", lambda: [_g(3, 8), _g(8, seed=1), 1e-6]),
        "activate": ("decode", lambda: [_g(3, 8), None, 1]),
        "attend_decode": ("decode", decode_args),
        "decoder_step": ("decode", step_args),
        "flash_forward": ("flash", flash_args),
        "flash_backward": ("flash", flash_bwd_args),
        "rms_norm_train": ("rows", lambda: [_g(4, 8), _g(8, seed=1), 1e-6]),
        "rms_norm_train_backward": ("rows", rms_bwd_args),
        "rope_train": ("rows", lambda: [_g(1, 2, 3, 8), _g(3, 4, seed=1), _g(3, 4, seed=2), 1.0]),
        "act_train": ("rows", lambda: [_g(4, 8), _g(4, 8, seed=1), 3, False]),
        "act_train_backward": ("rows", lambda: [_g(4, 8), _g(4, 8, seed=1), None, 1]),
        "clip_grad_norm_": ("rows", lambda: [[_g(4, 8), _g(3, seed=1)], 1.0]),
        "all_finite": ("rows", lambda: [[_g(4, 8), _g(3, seed=1)]]),
        "quantize_rows": ("int8", lambda: [_g(4, 8), None, 127]),
        "quantize_rows_cols": ("int8", lambda: [_g(4, 8), _g(8, seed=1), 127, 127]),
        "dequantize": ("int8", lambda: [torch.randint(-99, 99, (4, 6), dtype=torch.int32), torch.rand(4),
                                        torch.rand(6), _g(6), False]),
        "int8_product": ("int8", int8_product_args),
        "int8_linear": ("int8", int8_linear_args),
        "int8_linear_backward": ("int8", int8_bwd_args),
        "int8_cols_laid": ("int8", lambda: [6, 127, 127]),
        "short_attention": ("attention", short_args),
        "short_attention_backward": ("attention", short_bwd_args),
        "short_attention_packed": ("attention", qkv_args),
        "short_attention_packed_backward": ("attention", packed_bwd_args),
        "gpt_block_train": ("attention", block_args),
        "gpt_block_train_backward": ("attention", block_bwd_args),
    }


def _references() -> dict:
    """op name -> (args -> the expected first output), where the PyTorch formula is one line."""
    def rms(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    return {
        "matvec": lambda a: a[0] @ a[1].T + a[3],
        "rms_norm": lambda a: rms(*a),
        "rms_norm_train": lambda a: rms(*a),
        "activate": lambda a: torch.nn.functional.gelu(a[0]),
        "flash_forward": lambda a: torch.nn.functional.scaled_dot_product_attention(
            a[0], a[1].expand(-1, 2, -1, -1), a[2].expand(-1, 2, -1, -1), scale=a[3],
            attn_mask=torch.ones(9, 11, dtype=torch.bool).tril(11 - 9)),
    }


def _op_name(name: str) -> str:
    return "matvec" if name == "matvec_int4" else name


def _variants(t: torch.Tensor) -> list:
    """Drawn replacements of tensor ``t`` (see the module docstring)."""
    out = [t.to(d) for d in DTYPES if d != t.dtype]
    if t.dim():
        for i in range(t.dim()):
            for n in (0, 1, 3):
                shape = list(t.shape)
                shape[i] = n
                out.append(_g(*shape, dtype=t.dtype if t.is_floating_point() else torch.float32).to(t.dtype))
        for n in HUGE:
            shape = list(t.shape)
            shape[0] = n
            out.append(t[:1].expand(shape) if t.numel() else t)  # (the other dimensions' own strides)
        out.append(t[..., None])
        out.append(t.reshape(-1)[:0] if t.dim() > 1 else t.reshape(1, -1))
    if t.dim() >= 2:
        out.append(t.transpose(-1, -2).contiguous().transpose(-1, -2))  # the same values, not contiguous
        out.append(torch.stack([t, t], -1)[..., 0])                      # the same values, strided
    out.append(torch.tensor(1.0, dtype=t.dtype) if t.is_floating_point() else torch.tensor(1, dtype=t.dtype))
    return out


def _same_values(a, b) -> bool:
    """Whether argument ``b`` holds what ``a`` does (a tensor: the same dtype, shape and values, any strides)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same_values, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _named(e: Exception) -> bool:
    return isinstance(e, (RuntimeError, ValueError)) and "attnlab::" in str(e)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    want = want.to(got.dtype)
    tol = 64 * torch.finfo(got.dtype).eps * (1 + want.abs().max().item() if want.numel() else 1)
    return got.shape == want.shape and bool(((got - want).abs() <= tol).all())


def _describe(args) -> str:
    """The arguments in a line: tensors by dtype, shape and strides."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype)[6:]}{list(a.shape)}/{list(a.stride())}"
        return f"[{', '.join(map(one, a))}]" if isinstance(a, list) else repr(a)
    return ", ".join(map(one, args))


def _no_defaults(f):
    """``f(args)`` as a function without default arguments (which hypothesis's ``given`` refuses)."""
    def call(args):
        f(args)
    return call


def run_family(family: str) -> None:
    """Fuzz every op of ``family`` (a subprocess's work); prints the examples and the named errors seen."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from attnlab import _native
    assert _native.available(), _native.status()
    ops, bases, refs = torch.ops.attnlab, _bases(), _references()
    counts, failed = {"examples": 0, "errors": 0}, []

    for name, (fam, base) in bases.items():
        if family not in (fam, name):  # (an op's name: that op alone)
            continue
        op = getattr(ops, _op_name(name)).default
        first = op(*base())  # the valid call succeeds, and where its formula is short, equals it
        if name in refs:
            got = first[0] if isinstance(first, tuple) else first
            assert _close(got, refs[name](base())), f"{name}: the valid call's result is not the formula's"

        optional = [str(a.type).startswith("Optional[Tensor") for a in op._schema.arguments]

        @st.composite
        def calls(draw, base=base, optional=optional):
            args = base()
            for i in draw(st.lists(st.integers(0, len(args) - 1), min_size=1, max_size=3, unique=True)):
                a = args[i]
                if isinstance(a, bool):
                    args[i] = not a
                elif isinstance(a, int):
                    args[i] = draw(st.sampled_from(INTS))
                elif isinstance(a, float):
                    args[i] = draw(st.sampled_from(FLOATS))
                elif isinstance(a, torch.Tensor):
                    args[i] = draw(st.sampled_from(_variants(a) + ([None] if optional[i] else [])))
                elif isinstance(a, list) and a and all(isinstance(x, torch.Tensor) for x in a):
                    j = draw(st.integers(0, len(a) - 1))
                    a = list(a)
                    a[j] = draw(st.sampled_from(_variants(a[j])))
                    args[i] = a
                elif isinstance(a, list):  # decoder_step's Tensor?[]: one entry replaced or dropped
                    j = draw(st.integers(0, len(a) - 1))
                    a = list(a)
                    a[j] = draw(st.sampled_from(([None] + _variants(a[j])) if a[j] is not None else [None]))
                    args[i] = a if draw(st.booleans()) else a[:-1]
                elif a is None:
                    args[i] = draw(st.sampled_from([None, torch.ones(3), torch.ones(1, 1)]))
            return args

        def check(args, name=name, op=op, base=base):
            counts["examples"] += 1
            print(name, _describe(args), file=sys.stderr, flush=True)  # the last call before a crash
            try:
                got = op(*args)
            except Exception as e:  # noqa: BLE001 (the property: every failure is a named error)
                assert _named(e), f"{name}: unnamed {type(e).__name__}: {str(e)[:300]}"
                counts["errors"] += 1
                return
            valid = base()
            if name in refs and len(valid) == len(args) and all(map(_same_values, valid, args)):
                got1 = got[0] if isinstance(got, tuple) else got
                assert _close(got1, refs[name](valid)), f"{name}: a non-contiguous copy changed the result"

        try:
            settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=False,
                     suppress_health_check=list(HealthCheck))(given(calls())(_no_defaults(check)))()
        except AssertionError as e:  # the next op still runs; the family fails at the end, naming each op
            failed.append(str(e).splitlines()[0])
    print(f"{family}: {counts['examples']} examples, {counts['errors']} named errors")
    assert not failed, "\n".join(failed)


FAMILIES = ("matvec", "decode", "flash", "rows", "int8", "attention")


@needs_native
@pytest.mark.parametrize("family", FAMILIES)
def test_every_op_returns_its_result_or_a_named_error(family):
    out = subprocess.run([sys.executable, __file__, family], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, (f"the {family} ops' fuzzing ended with exit code {out.returncode}"
                                 f"{' (a crash: signal ' + str(-out.returncode) + ')' if out.returncode < 0 else ''}"
                                 f"\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    assert f"{family}: " in out.stdout and " examples, " in out.stdout


# calls that once ended the process, each with the error (or result) it gives now
CASES = """
import math, torch, attnlab
from attnlab import _native, _native_train
q = k = v = torch.randn(1, 2, 64, 30)
out = attnlab.attention(q, k, v, mask_mod=attnlab.bigbird_mod(2**62, seq_len=64))  # one block: dense attention
assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-5)
out = attnlab.attention(q, k, v, mask_mod=attnlab.bigbird_mod(4096, seq_len=64))
assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-5)
kw = dict(scale=0.125, causal=True, window=None, block_q=64, block_k=64)
want, _ = _native.flash_forward(q, k, v, **kw)
for big in (dict(block_q=2**62), dict(block_k=2**61), dict(window=2**62)):  # tiles within the sequence: the same
    assert torch.allclose(_native.flash_forward(q, k, v, **{**kw, **big})[0], want, atol=1e-6)
for bad, words in ((dict(block_q=0), "block sizes"), (dict(block_q=2**20, block_k=2**20), None)):
    try:
        _native.flash_forward(torch.randn(1, 1, 2**12, 1), torch.randn(1, 1, 2**13, 1), torch.randn(1, 1, 2**13, 1),
                              **{**kw, **bad})
        assert words is None, bad
    except RuntimeError as e:
        assert "attnlab::flash_forward" in str(e) and (words is None or words in str(e)), e
y = _native_train.rope_train(torch.randn(1, 2, 3, 0), torch.ones(3, 0), torch.ones(3, 0))
assert y.shape == (1, 2, 3, 0)
print("ok")
"""


@needs_native
def test_the_calls_that_once_crashed_give_results_or_named_errors():
    out = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-3000:])


if __name__ == "__main__":
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # (AddressSanitizer reserves terabytes of address space)
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    run_family(sys.argv[1])
