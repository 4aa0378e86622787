"""A hostile corpus against the Python API and the C++ ops behind it, as a careless or malicious user would call it.

Every input is a case with the one outcome it must have: a result equal to an oracle (a float64 formula written
here, or the float model), or one error of the right type whose message names the argument. A case's outcome is
classified as

* ``good``: the result matches the oracle, or the expected error names the argument;
* ``obscure``: an error of another type, or a message that does not name the argument (a traceback from inside);
* ``silent-wrong``: a result where an error was due, or a result that differs from the oracle (NaN appearing or
  vanishing included);
* ``crash``: the process died (a signal, the OOM killer) — seen by the parent test, as each family of cases runs in
  its own subprocess (``python tests/test_hostile_api.py FAMILY``) under an address-space limit, as
  ``tests/test_native_fuzz.py`` runs the ops.

The test of a family asserts that every case of it is ``good``. Families of inputs meant as a range (scales,
rates, sizes) are drawn by hypothesis in :func:`test_drawn_arguments_are_refused_by_name_or_computed`.
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

HERE = Path(__file__).parent
MEMORY_LIMIT = 16 << 30  # address space of a corpus process: a multi-GB allocation fails instead of swapping


# ----------------------------------------------------------------------------------------- outcomes

class Err:
    """The case must raise one of ``types`` whose message holds every one of ``words`` (case-insensitive)."""

    def __init__(self, types, *words: str):
        self.types, self.words = types, words

    def judge(self, error: Optional[BaseException], result) -> tuple[str, str]:
        if error is None:
            return "silent-wrong", f"returned {_brief(result)} where {self} was due"
        msg = str(error).lower()
        if isinstance(error, self.types) and all(w.lower() in msg for w in self.words):
            return "good", ""
        return "obscure", f"{type(error).__name__}: {str(error)[:300]} (want {self})"

    def __str__(self):
        names = "/".join(t.__name__ for t in (self.types if isinstance(self.types, tuple) else (self.types,)))
        return f"{names} naming {', '.join(map(repr, self.words))}"


class Ok:
    """The case must return a result for which ``check(result)`` holds (it asserts against an oracle)."""

    def __init__(self, check: Callable = lambda r: None):
        self.check = check

    def judge(self, error, result):
        if error is not None:
            return "obscure", f"refused a valid call: {type(error).__name__}: {str(error)[:300]}"
        try:
            self.check(result)
        except AssertionError as e:
            return "silent-wrong", f"wrong result: {str(e)[:300]}"
        return "good", ""


class AnyErr:
    """One of several refusals (each an :class:`Err`)."""

    def __init__(self, *errs: Err):
        self.errs = errs

    def judge(self, error, result):
        verdicts = [e.judge(error, result) for e in self.errs]
        return next((v for v in verdicts if v[0] == "good"), verdicts[0])

    def __str__(self):
        return " or ".join(map(str, self.errs))


class Either:
    """A result that passes ``ok`` or a refusal that passes ``err`` (a backend that cannot compute a request
    says so by name)."""

    def __init__(self, ok: Ok, err: Err):
        self.ok, self.err = ok, err

    def judge(self, error, result):
        return self.ok.judge(None, result) if error is None else self.err.judge(error, None)


def _brief(result) -> str:
    if isinstance(result, torch.Tensor):
        return f"a tensor {tuple(result.shape)} {result.dtype}"
    if isinstance(result, (tuple, list)):
        return f"({', '.join(_brief(r) for r in result)})"
    return type(result).__name__


CASES: dict[str, list[tuple[str, Callable, object]]] = {}


def case(family: str, name: str, fn: Callable, expect) -> None:
    CASES.setdefault(family, []).append((name, fn, expect))


def close(want, *, dtype=torch.float32, rtol=None):
    """A check: the result (or its first element) equals ``want`` within a tolerance of ``dtype``."""
    eps = torch.finfo(dtype).eps

    def check(got):
        got = got[0] if isinstance(got, tuple) else got
        assert isinstance(got, torch.Tensor), f"not a tensor: {type(got).__name__}"
        w = want() if callable(want) else want
        assert got.shape == w.shape, f"shape {tuple(got.shape)} != {tuple(w.shape)}"
        assert torch.equal(torch.isnan(got), torch.isnan(w)), "NaN where the oracle has none (or the reverse)"
        g, e = got.double().nan_to_num(), w.double().nan_to_num()
        tol = 64 * eps * max(1.0, float(e.abs().max()) if e.numel() else 1.0)
        err = float((g - e).abs().max()) if e.numel() else 0.0
        assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
    return check


# ------------------------------------------------------------------------------------ the oracle

def oracle(q, k, v, *, mask=None, causal=False, window=None, scale=None, score=None, allow=None):
    """``softmax(κ q kᵀ + mask) v`` in float64, rows that see nothing zero; ``score(s, i, j)`` and ``allow(i, j)``
    as a score_mod and a mask_mod."""
    q, k, v = q.double(), k.double(), v.double()
    H, Hkv, Lq, Lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    i = torch.arange(Lq)[:, None] + (Lk - Lq)
    j = torch.arange(Lk)[None, :]
    if score is not None:
        s = score(s, i, j)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (i - j < window) & ((j - i < window) | causal)
    if allow is not None:
        ok = ok & allow(i, j)
    ok = ok.expand(s.shape)
    if mask is not None:
        if mask.dtype == torch.bool:
            ok = ok & mask
        else:
            s = s + mask.double()
    s = s.masked_fill(~ok, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)  # a row of -inf only: zeros
    w = torch.where(torch.isneginf(s).all(-1, keepdim=True), torch.zeros_like(w), w)
    return w @ v


def qkv(B=2, H=4, Hkv=2, Lq=5, Lk=7, D=8, Dv=None, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
           for s in ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D if Dv is None else Dv))]
    return [t.requires_grad_(grad) for t in out]


BACKEND_NAMES = ("auto", "reference", "sdpa", "short", "tiled", "flex")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _refused(backend: str) -> Err:
    """How a named backend may decline a request: one error naming itself."""
    return Err(ValueError, f"backend={backend!r}")


# ------------------------------------------------------------------------- family: attention(...)

def _attention_cases():
    from attnlab import attention

    def add(name, fn, expect):
        case("attention", name, fn, expect)

    for b in BACKEND_NAMES:
        def run(b=b, **kw):
            q, k, v = kw.pop("qkv", None) or qkv()
            return attention(q, k, v, backend=b, **kw)

        # dtypes: every float computes the formula in its precision; the others are refused by name
        for dt in FLOAT_DTYPES:
            q, k, v = qkv(dtype=dt)
            add(f"{b}: {dt}", lambda b=b, q=q, k=k, v=v: attention(q, k, v, backend=b),
                Either(Ok(close(lambda q=q, k=k, v=v: oracle(q, k, v).to(q.dtype), dtype=dt)), _refused(b)))
        for dt in (torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64):
            add(f"{b}: q, k, v of {dt}", lambda b=b, dt=dt: run(b, qkv=[t.to(dt) for t in qkv()]),
                Err(TypeError, "q must be a floating-point tensor"))
        add(f"{b}: q float32, k float64", lambda b=b: run(b, qkv=[qkv()[0], qkv()[1].double(), qkv()[2]]),
            Err(TypeError, "share a dtype"))
        add(f"{b}: meta tensors", lambda b=b: run(b, qkv=[t.to("meta") for t in qkv()]), Err(ValueError, "meta"))

        # shapes
        q, k, v = qkv()
        add(f"{b}: 3-D q", lambda b=b: run(b, qkv=[q[0], k, v]), Err(ValueError, "q must have 4 dims"))
        add(f"{b}: 5-D k", lambda b=b: run(b, qkv=[q, k[None], v]), Err(ValueError, "k must have 4 dims"))
        add(f"{b}: H=3 over Hkv=2", lambda b=b: run(b, qkv=qkv(H=3, Hkv=2)), Err(ValueError, "H % Hkv"))
        add(f"{b}: Hkv=0", lambda b=b: run(b, qkv=qkv(Hkv=0)), Err(ValueError, "Hkv=0"))
        add(f"{b}: D=0", lambda b=b: run(b, qkv=qkv(D=0)), Err(ValueError, "D >= 1"))
        add(f"{b}: Lk=0", lambda b=b: run(b, qkv=qkv(Lk=0)), Err(ValueError, "Lk=0"))
        for shape in (dict(Lq=0), dict(B=0), dict(H=0, Hkv=1), dict(Dv=0), dict(Dv=3)):
            t = qkv(**shape)
            add(f"{b}: {shape}", lambda b=b, t=t: run(b, qkv=t),
                Either(Ok(close(lambda t=t: oracle(*t).float())), _refused(b)))
        add(f"{b}: k, v lengths differ", lambda b=b: run(b, qkv=[q, k, v[:, :, :-1]]), Err(ValueError, "same length"))
        add(f"{b}: q, k head dims differ", lambda b=b: run(b, qkv=[q[..., :-1], k, v]), Err(ValueError, "head dim"))
        add(f"{b}: batch sizes differ", lambda b=b: run(b, qkv=[q[:1], k, v]), Err(ValueError, "batch sizes"))
        add(f"{b}: q a list", lambda b=b: run(b, qkv=[q.tolist(), k, v]), Err(TypeError, "q must be"))

        # layouts: the same values whatever the strides
        layouts = {
            "transposed": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
            "expanded over the batch": lambda t: t[:1].expand(t.shape),
            "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
            "every other element": lambda t: torch.repeat_interleave(t, 2, dim=-1)[..., ::2],
            "a flipped copy": lambda t: t.flip(-2).flip(-2),
        }
        for lname, f in layouts.items():
            t = [f(x) for x in qkv()]
            add(f"{b}: {lname} q, k, v", lambda b=b, t=t: run(b, qkv=t),
                Either(Ok(close(lambda t=t: oracle(*t).float())), _refused(b)))

        # masks
        q, k, v = qkv()
        g = torch.Generator().manual_seed(1)
        bmask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
        fmask = torch.randn(5, 7, generator=g)
        for mname, m in (("bool (B, 1, Lq, Lk)", bmask), ("float (Lq, Lk)", fmask), ("bool (Lk,)", bmask[0, 0, 0]),
                         ("float64 (Lq, Lk)", fmask.double()), ("all False", torch.zeros(5, 7, dtype=torch.bool)),
                         ("all -inf", torch.full((5, 7), -math.inf)),
                         ("float needing grad", fmask.clone().requires_grad_())):
            add(f"{b}: mask {mname}", lambda b=b, m=m: run(b, mask=m),
                Either(Ok(close(lambda m=m: oracle(q, k, v, mask=m).float())), _refused(b)))
        for mname, m, err in (("(Lq+1, Lk)", torch.ones(6, 7, dtype=torch.bool), Err(ValueError, "mask")),
                              ("5-D", torch.ones(1, 2, 1, 5, 7, dtype=torch.bool), Err(ValueError, "mask")),
                              ("int64", torch.ones(5, 7, dtype=torch.int64), Err(TypeError, "mask")),
                              ("with NaN", fmask.masked_fill(fmask > 1, math.nan), Err(ValueError, "NaN")),
                              ("with +inf", fmask.masked_fill(fmask > 1, math.inf), Err(ValueError, "+inf")),
                              ("a list", [[True] * 7] * 5, Err(TypeError, "mask")),
                              ("on meta", torch.ones(5, 7, dtype=torch.bool, device="meta"), Err(ValueError, "mask"))):
            add(f"{b}: mask {mname}", lambda b=b, m=m: run(b, mask=m), err)

        # causal and window
        for kw in (dict(causal=True), dict(causal=True, window=1), dict(causal=True, window=3), dict(window=2),
                   dict(causal=True, window=2**62)):
            add(f"{b}: {kw}", lambda b=b, kw=kw: run(b, **kw),
                Either(Ok(close(lambda kw=kw: oracle(q, k, v, **kw).float())), _refused(b)))
        t = qkv(Lq=9, Lk=4)
        add(f"{b}: causal with Lq > Lk", lambda b=b, t=t: run(b, qkv=t, causal=True),
            Either(Ok(close(lambda t=t: oracle(*t, causal=True).float())), _refused(b)))
        for kw, err in ((dict(causal=1), Err(TypeError, "causal")), (dict(causal="yes"), Err(TypeError, "causal")),
                        (dict(window=0), Err(ValueError, "window")), (dict(window=-3), Err(ValueError, "window")),
                        (dict(window=2.5), Err(ValueError, "window")), (dict(window=True), Err(ValueError, "window"))):
            add(f"{b}: {kw}", lambda b=b, kw=kw: run(b, **kw), err)

        # scale
        for s in (0.0, -1.0, 1e-30, 3, 1e30):
            add(f"{b}: scale={s}", lambda b=b, s=s: run(b, scale=s),
                Either(Ok(close(lambda s=s: oracle(q, k, v, scale=s).float())), _refused(b)))
        for s, err in ((math.inf, Err(ValueError, "scale")), (math.nan, Err(ValueError, "scale")),
                       (-math.inf, Err(ValueError, "scale")), ("0.5", Err(TypeError, "scale")),
                       (True, Err(TypeError, "scale")), (1e38, Err(ValueError, "scale")),
                       (torch.tensor([0.5, 0.5]), Err(TypeError, "scale"))):
            add(f"{b}: scale={s!r}", lambda b=b, s=s: run(b, scale=s), err)

        # mods
        add(f"{b}: a score_mod", lambda b=b: run(b, score_mod=lambda s, bb, h, i, j: s - 0.1 * (i - j).abs()),
            Either(Ok(close(lambda: oracle(q, k, v, score=lambda s, i, j: s - 0.1 * (i - j).abs()).float())),
                   _refused(b)))
        add(f"{b}: a mask_mod", lambda b=b: run(b, mask_mod=lambda bb, h, i, j: (i + j) % 3 != 0),
            Either(Ok(close(lambda: oracle(q, k, v, allow=lambda i, j: (i + j) % 3 != 0).float())), _refused(b)))
        add(f"{b}: a mask_mod that allows nothing", lambda b=b: run(b, mask_mod=lambda bb, h, i, j: i < -1),
            Either(Ok(close(lambda: torch.zeros(2, 4, 5, 8))), _refused(b)))

        def raises(*a):
            raise KeyError("the user's own error")
        add(f"{b}: a score_mod that raises", lambda b=b: run(b, score_mod=raises),
            Either(Ok(lambda r: pytest.fail("returned")), Err((KeyError, ValueError), "")))
        add(f"{b}: a mask_mod that raises", lambda b=b: run(b, mask_mod=raises),
            Either(Ok(lambda r: pytest.fail("returned")), Err((KeyError, ValueError), "")))
        add(f"{b}: a score_mod of the wrong shape", lambda b=b: run(b, score_mod=lambda s, *a: s[..., :1, :]),
            Err(ValueError, "score_mod"))
        add(f"{b}: a score_mod returning None", lambda b=b: run(b, score_mod=lambda s, *a: None),
            Err((TypeError, ValueError), "score_mod"))
        add(f"{b}: a score_mod returning ints", lambda b=b: run(b, score_mod=lambda s, *a: s.long()),
            Err((TypeError, ValueError), "score_mod"))
        add(f"{b}: a mask_mod returning floats", lambda b=b: run(b, mask_mod=lambda bb, h, i, j: (i - j).float()),
            Err((TypeError, ValueError), "mask_mod"))
        add(f"{b}: a mask_mod of the wrong shape",
            lambda b=b: run(b, mask_mod=lambda bb, h, i, j: torch.ones(3, 3) > 0),
            Err(ValueError, "mask_mod"))
        add(f"{b}: score_mod not callable", lambda b=b: run(b, score_mod=3), Err(TypeError, "score_mod"))

        # normalize, top_k, dropout
        add(f"{b}: top_k=Lk", lambda b=b: run(b, normalize="topk", top_k=7),
            Either(Ok(close(lambda: oracle(q, k, v).float())), _refused(b)))
        for tk in (0, -1, 8, 2**62, 1.5, True, None):
            add(f"{b}: top_k={tk!r}", lambda b=b, tk=tk: run(b, normalize="topk", top_k=tk), Err(ValueError, "top_k"))
        add(f"{b}: top_k with softmax", lambda b=b: run(b, top_k=2), Err(ValueError, "top_k"))
        for nm in ("SOFTMAX", "", None, "entmax"):
            add(f"{b}: normalize={nm!r}", lambda b=b, nm=nm: run(b, normalize=nm), Err(ValueError, "normalize"))
        for p in (-0.1, 1.0, 1.5, math.nan, math.inf, "0.1", True):
            add(f"{b}: dropout_p={p!r}", lambda b=b, p=p: run(b, dropout_p=p), Err(ValueError, "dropout_p"))

        # what it returns
        def weights_check(r):
            out, w = r
            assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5), "weights do not sum to 1"
            assert torch.allclose(out, torch.einsum("bhqk,bhkd->bhqd", w, v.repeat_interleave(2, 1)), atol=1e-5)
        add(f"{b}: return_weights", lambda b=b: run(b, return_weights=True), Either(Ok(weights_check), _refused(b)))

        def lse_check(r):
            out, lse = r
            s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
            assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=1e-4), "lse differs"
        add(f"{b}: return_lse", lambda b=b: run(b, return_lse=True),
            Either(Ok(lse_check), Err(ValueError, "return_lse")))
        add(f"{b}: return_lse and return_weights", lambda b=b: run(b, return_lse=True, return_weights=True),
            Either(Ok(lambda r: pytest.fail("two extras in a pair")), Err(ValueError, "return_")))
        add(f"{b}: return_lse=1", lambda b=b: run(b, return_lse=1), Err(TypeError, "return_lse"))

    for bad in ("", "AUTO", "Reference", "flash", "cuda"):
        case("attention", f"backend={bad!r}", lambda bad=bad: attention(*qkv(), backend=bad),
             Err(ValueError, "backend"))
    for bad in (None, 3, ["sdpa"]):
        case("attention", f"backend={bad!r}", lambda bad=bad: attention(*qkv(), backend=bad),
             Err(TypeError, "backend"))


# ---------------------------------------------------------- family: gradients through every backend

def _grad_cases():
    """First and second derivatives (a gradient penalty: ``create_graph=True``) through every backend, against
    the float64 oracle, or a refusal that names the path."""
    from attnlab import attention

    def penalty(fn, q, k, v):
        out = fn(q, k, v)
        gq, gk = torch.autograd.grad(out.pow(2).sum(), (q, k), create_graph=True)
        return torch.autograd.grad(gq.pow(2).sum() + gk.pow(2).sum(), (q, k, v))

    for b in BACKEND_NAMES:
        for kw in (dict(), dict(causal=True), dict(window=2, causal=True),
                   dict(mask=torch.arange(7) % 3 != 0), dict(score_mod=lambda s, *a: s * 0.5)):
            for dt, dv in ((torch.float32, None), (torch.float64, None), (torch.float64, 3)):
                def run(b=b, kw=kw, dt=dt, dv=dv):
                    q, k, v = qkv(Hkv=4, Dv=dv, dtype=dt, grad=True)
                    got = penalty(lambda q, k, v: attention(q, k, v, backend=b, **kw), q, k, v)
                    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
                    ok = {k2: v2 for k2, v2 in kw.items() if k2 != "score_mod"}
                    score = (lambda s, i, j: s * 0.5) if "score_mod" in kw else None
                    want = penalty(lambda q, k, v: oracle(q, k, v, score=score, **ok), qd, kd, vd)
                    return got, want

                def check(r, dt=dt):
                    got, want = r
                    for a, w in zip(got, want):
                        tol = 1e3 * torch.finfo(dt).eps * max(1.0, float(w.abs().max()))
                        assert a is not None and float((a.double() - w).abs().max()) <= tol, \
                            f"second derivative differs by {float((a.double() - w).abs().max()):.3g}"
                case("grad", f"{b}: double backward {dt} Dv={dv or 'D'} {sorted(kw)}", run,
                     Either(Ok(check), AnyErr(Err(RuntimeError, "no second derivative", "backend"),
                                              # torch's CPU flash kernel behind sdpa raises its own error
                                              Err(RuntimeError, "scaled_dot_product", "not implemented"),
                                              _refused(b))))


# ------------------------------------------------------------------- family: attention modules

def _module_cases():
    from attnlab import (AdditiveAttention, LocationAwareAttention, LuongAttention, MonotonicAttention,
                         MultiheadAttention, get_attention)

    def add(name, fn, expect):
        case("modules", name, fn, expect)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)

    def mha(*a, **kw):
        torch.manual_seed(0)
        return MultiheadAttention(*a, **kw)

    for a, kw, word in (((0, 2), {}, "embed_dim"), ((-8, 2), {}, "embed_dim"), ((8.0, 2), {}, "embed_dim"),
                        ((8, 3), {}, "num_heads"), ((8, 0), {}, "num_heads"), ((8, -2), {}, "num_heads"),
                        ((8, True), {}, "num_heads"), ((8, 4), dict(num_kv_heads=3), "num_kv_heads"),
                        ((8, 4), dict(num_kv_heads=0), "num_kv_heads"), ((8, 2), dict(dropout=1.0), "dropout"),
                        ((8, 2), dict(dropout=-0.5), "dropout"), ((8, 2), dict(dropout=math.nan), "dropout"),
                        ((8, 2), dict(backend="fast"), "backend"), ((8, 2), dict(window=0), "window"),
                        ((8, 2), dict(normalize="topk", top_k=0), "top_k"), ((8, 2), dict(head_dim=0), "head_dim"),
                        ((8, 2), dict(scale=math.nan), "scale"), ((8, 2), dict(scale=math.inf), "scale"),
                        ((8, 2), dict(kdim=0), "kdim"), ((8, 2), dict(vdim=-1), "vdim"),
                        ((10**7, 1), {}, "embed_dim"), ((8, 2), dict(head_dim=10**10), "head_dim")):
        add(f"MultiheadAttention{a} {kw}", lambda a=a, kw=kw: mha(*a, **kw), Err((ValueError, TypeError), word))

    m = mha(8, 2)
    for name, fn, expect in (
            ("query (B, L, 7) for embed_dim 8", lambda: m(torch.randn(2, 5, 7)), Err(ValueError, "query")),
            ("query 4-D", lambda: m(torch.randn(1, 2, 5, 8)), Err(ValueError, "query")),
            ("query int64", lambda: m(torch.ones(2, 5, 8, dtype=torch.long)), Err(TypeError, "query")),
            ("query a list", lambda: m([[0.0] * 8]), Err(TypeError, "query")),
            ("query float64 into float32 weights", lambda: m(x.double()), Err((TypeError, ValueError), "dtype")),
            ("key of another batch", lambda: m(x, x[:1], x[:1]), Err(ValueError, "batch")),
            ("key and value lengths differ", lambda: m(x, x, x[:, :3]), Err(ValueError, "value")),
            ("key_padding_mask (B, L+1)", lambda: m(x, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool)),
             Err(ValueError, "key_padding_mask")),
            ("key_padding_mask int", lambda: m(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long)),
             Err(TypeError, "key_padding_mask")),
            ("attn_mask (L+1, L)", lambda: m(x, attn_mask=torch.zeros(6, 5, dtype=torch.bool)),
             Err(ValueError, "attn_mask")),
            ("attn_mask with NaN", lambda: m(x, attn_mask=torch.full((5, 5), math.nan)), Err(ValueError, "NaN")),
            ("is_causal=1", lambda: m(x, is_causal=1), Err(TypeError, "is_causal")),
            ("need_weights='yes'", lambda: m(x, need_weights="yes"), Err(TypeError, "need_weights")),
            ("an empty batch", lambda: m(x[:0]), Ok(lambda r: _shape(r[0], (0, 5, 8)))),
            ("an empty sequence", lambda: m(x[:, :0]), Either(Ok(lambda r: _shape(r[0], (2, 0, 8))),
                                                              Err(ValueError, "query"))),
    ):
        add(f"MultiheadAttention: {name}", fn, expect)

    def nan_rows(r):
        out = r[0]
        assert bool(out[0].isnan().all()), "row 0 (NaN input) is not NaN"
        assert bool(out[1].isfinite().all()), "row 1 (finite input) caught the NaN"
    xn = x.clone()
    xn[0, 2, 3] = math.nan
    add("MultiheadAttention: a NaN in one batch row", lambda: m(xn), Ok(nan_rows))
    add("MultiheadAttention: every key padded", lambda: m(x, key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
        Ok(lambda r: _finite(r[0])))

    def same_as_torch(r):
        ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        sd = {k2: v2 for k2, v2 in m.state_dict().items()}
        try:
            ref.load_state_dict(sd)
        except RuntimeError:
            return  # parameter names differ: the causal case below is the oracle
        want = ref(x, x, x, need_weights=False)[0]
        assert torch.allclose(r[0], want, atol=1e-5)
    add("MultiheadAttention: the plain forward", lambda: m(x), Ok(same_as_torch))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    add("MultiheadAttention: is_causal equals the causal mask (attn_mask True = blocked)",
        lambda: (m(x, is_causal=True)[0], m(x, attn_mask=~causal)[0]),
        Ok(lambda r: _assert(torch.allclose(r[0], r[1], atol=1e-6), "is_causal != the causal mask")))

    import attnlab
    from attnlab import KVCache, LinformerAttention, PerformerAttention, attention_weights, linear_attention

    def overflow():
        c = KVCache(max_length=4)
        m(x[:1, :3], cache=c)
        return m(x[:1, :3], cache=c)

    def batch_change():
        c = KVCache()
        m(x, cache=c)
        return m(x[:1, :1], cache=c)
    qa, ka = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    va = torch.randn(1, 2, 7, 3, generator=g)

    def elu_oracle(causal):
        fq, fk = torch.nn.functional.elu(qa.double()) + 1, torch.nn.functional.elu(ka.double()) + 1
        a = fq @ fk.transpose(-1, -2)
        if causal:
            a = a * (torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2)
        return (a @ va.double()) / a.sum(-1, keepdim=True)
    for name, fn, expect in (
            ("MultiheadAttention: a cache overflowing max_length", overflow, Err(ValueError, "max_length")),
            ("MultiheadAttention: cache={}", lambda: m(x, cache={}), Err(TypeError, "cache")),
            ("MultiheadAttention: a cache of another batch", batch_change, Err(ValueError, "reset()")),
            ("MultiheadAttention: value_embed of the wrong width", lambda: m(x, value_embed=torch.randn(2, 5, 7)),
             Err(ValueError, "value_embed")),
            ("MultiheadAttention: rotary for head_dim 6", lambda: mha(8, 2, rotary=attnlab.RotaryEmbedding(6)),
             Err(ValueError, "rotary")),
            ("MultiheadAttention: ALiBi of 4 heads on 2", lambda: mha(8, 2, position_bias=attnlab.ALiBi(4)),
             Err(ValueError, "position_bias")),
            ("MultiheadAttention: rotary='rope'", lambda: mha(8, 2, rotary="rope"), Err(TypeError, "rotary")),
            ("MultiheadAttention: q_norm without k_norm", lambda: mha(8, 2, q_norm=attnlab.RMSNorm(4)),
             Err(ValueError, "k_norm")),
            ("attention_weights: lse of another shape", lambda: attention_weights(qa, ka, lse=torch.zeros(1, 2, 4)),
             Err(ValueError, "lse")),
            ("attention_weights: lse of another request",
             lambda: attention_weights(qa, ka, lse=attnlab.attention(qa, ka, va, causal=True, return_lse=True)[1]),
             Err(ValueError, "lse")),
            ("attention_weights: heads=5 of 2", lambda: attention_weights(qa, ka, heads=5), Err(ValueError, "heads")),
            ("attention_weights: rows=[]", lambda: attention_weights(qa, ka, rows=[]), Err(ValueError, "rows")),
            ("attention_weights: rows=[0.5]", lambda: attention_weights(qa, ka, rows=[0.5]), Err(ValueError, "rows")),
            ("attention_weights: the softmax rows", lambda: attention_weights(qa, ka, rows=[1, 4]),
             Ok(close(lambda: torch.softmax(qa.double() @ ka.double().transpose(-1, -2) / math.sqrt(8), -1)
                      [:, :, [1, 4]].float()))),
            ("linear_attention: the elu formula", lambda: linear_attention(qa, ka, va),
             Ok(close(lambda: elu_oracle(False).float()))),
            ("linear_attention: causal, bottom-right", lambda: linear_attention(qa, ka, va, causal=True),
             Ok(close(lambda: elu_oracle(True).float()))),
            ("linear_attention: causal with Lq > Lk", lambda: linear_attention(ka, qa, qa, causal=True),
             Err(ValueError, "Lq")),
            ("linear_attention: feature_map='nope'", lambda: linear_attention(qa, ka, va, feature_map="nope"),
             Err(ValueError, "feature_map")),
            ("linear_attention: chunk_size=0", lambda: linear_attention(qa, ka, va, causal=True, chunk_size=0),
             Err(ValueError, "chunk_size")),
            ("linear_attention: eps=-1", lambda: linear_attention(qa, ka, va, eps=-1.0), Err(ValueError, "eps")),
            ("PerformerAttention: num_features=0", lambda: PerformerAttention(8, 2, num_features=0),
             Err(ValueError, "num_features")),
            ("PerformerAttention: num_features=2**40", lambda: PerformerAttention(8, 2, num_features=2**40),
             Err(ValueError, "num_features")),
            ("LinformerAttention: k=0", lambda: LinformerAttention(8, 2, seq_len=16, k=0), Err(ValueError, "k")),
            ("LinformerAttention: seq_len=2**40", lambda: LinformerAttention(8, 2, seq_len=2**40, k=4),
             Err(ValueError, "seq_len")),
            ("LinformerAttention: a sequence past seq_len", lambda: LinformerAttention(8, 2, seq_len=4, k=2)(x),
             Err(ValueError, "seq_len")),
    ):
        add(name, fn, expect)

    q2, keys = torch.randn(2, 4, generator=g), torch.randn(2, 6, 5, generator=g)
    vals = torch.randn(2, 6, 3, generator=g)
    add_m = AdditiveAttention(4, 5, 8, value_dim=3)

    def additive_oracle(r, mask=None):
        ctx, w = r
        s = add_m.v(torch.tanh(add_m.W_q(q2)[:, None] + add_m.W_k(keys))).squeeze(-1)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        want = torch.softmax(s, -1)
        assert torch.allclose(w, want, atol=1e-6) and torch.allclose(ctx, (want[:, :, None] * vals).sum(1), atol=1e-6)
    mask = torch.tensor([[True] * 6, [True, False] * 3])
    for name, fn, expect in (
            ("Additive: the formula", lambda: add_m(q2, keys, vals), Ok(additive_oracle)),
            ("Additive: a mask", lambda: add_m(q2, keys, vals, mask=mask), Ok(lambda r: additive_oracle(r, mask))),
            ("Additive: a mask of nothing", lambda: add_m(q2, keys, vals, mask=torch.zeros(2, 6, dtype=torch.bool)),
             Ok(lambda r: _assert(bool((r[0] == 0).all()) and bool((r[1] == 0).all()), "not zeros"))),
            ("Additive: query of width 5", lambda: add_m(torch.randn(2, 5), keys, vals), Err(ValueError, "query")),
            ("Additive: keys 2-D", lambda: add_m(q2, keys[0], vals), Err(ValueError, "keys")),
            ("Additive: values of another length", lambda: add_m(q2, keys, vals[:, :4]), Err(ValueError, "values")),
            ("Additive: no keys", lambda: add_m(q2, keys[:, :0], vals[:, :0]), Err(ValueError, "keys")),
            ("Additive: mask (B, Lk+1)", lambda: add_m(q2, keys, vals, mask=torch.ones(2, 7, dtype=torch.bool)),
             Err(ValueError, "mask")),
            ("Additive: float mask", lambda: add_m(q2, keys, vals, mask=torch.ones(2, 6)), Err(TypeError, "mask")),
            ("Additive: hidden_dim=0", lambda: AdditiveAttention(4, 5, 0), Err(ValueError, "hidden_dim")),
            ("Additive: top_k=7 > Lk", lambda: AdditiveAttention(4, 5, 8, normalize="topk", top_k=7)(q2, keys),
             Err(ValueError, "top_k")),
            ("Additive: normalize='max'", lambda: AdditiveAttention(4, 5, 8, normalize="max"),
             Err(ValueError, "normalize")),
            ("Luong: mode='cosine'", lambda: LuongAttention(4, 5, mode="cosine"), Err(ValueError, "mode")),
            ("Luong: mode='concat' without hidden_dim (query_dim)", lambda: LuongAttention(4, 5, mode="concat").W_a,
             Ok(lambda r: _shape(r.weight, (4, 9)))),
            ("Luong: 'dot' with other widths", lambda: LuongAttention(4, 5, mode="dot"), Err(ValueError, "dot")),
            ("Luong: a NaN query", lambda: LuongAttention(4, 5)(torch.full((2, 4), math.nan), keys),
             Ok(lambda r: _assert(bool(r[0].isnan().all()), "the NaN query vanished"))),
            ("Location: kernel_size=0", lambda: LocationAwareAttention(4, 5, 8, kernel_size=0),
             Err(ValueError, "kernel_size")),
            ("Location: kernel_size=4 (even)", lambda: LocationAwareAttention(4, 5, 8, kernel_size=4),
             Either(Ok(), Err(ValueError, "kernel_size"))),
            ("Location: conv_channels=-1", lambda: LocationAwareAttention(4, 5, 8, conv_channels=-1),
             Err(ValueError, "conv_channels")),
            ("Location: prev_weights (B, Lk+1)",
             lambda: LocationAwareAttention(4, 5, 8)(q2, keys, torch.zeros(2, 7)), Err(ValueError, "prev_weights")),
            ("Location: prev_weights int",
             lambda: LocationAwareAttention(4, 5, 8)(q2, keys, torch.zeros(2, 6, dtype=torch.long)),
             Err(TypeError, "prev_weights")),
            ("Location: a 3-D query", lambda: LocationAwareAttention(4, 5, 8)(q2[:, None], keys),
             Either(Ok(), Err(ValueError, "query"))),
            ("Monotonic: prev_alignment (B, Lk-1)",
             lambda: MonotonicAttention(4, 5, 8)(q2, keys, torch.zeros(2, 5)), Err(ValueError, "prev_alignment")),
            ("Monotonic: prev_alignment None", lambda: MonotonicAttention(4, 5, 8)(q2, keys, None),
             Err((ValueError, TypeError), "prev_alignment")),
            ("Monotonic: noise_std=-1", lambda: MonotonicAttention(4, 5, 8, noise_std=-1.0),
             Err(ValueError, "noise_std")),
            ("Monotonic: init_r=nan", lambda: MonotonicAttention(4, 5, 8, init_r=math.nan), Err(ValueError, "init_r")),
            ("Monotonic: a NaN alignment",
             lambda: MonotonicAttention(4, 5, 8).eval()(q2, keys, torch.full((2, 6), math.nan)),
             Either(Ok(lambda r: _assert(bool(r[1].isnan().all()), "the NaN alignment vanished")),
                    Err(ValueError, "prev_alignment"))),
            ("get_attention('nope')", lambda: get_attention("nope"), Err(ValueError, "nope")),
            ("get_attention(None)", lambda: get_attention(None), Err((ValueError, TypeError), "name")),
            ("get_attention('MULTIHEAD')", lambda: get_attention("MULTIHEAD"), Either(Ok(), Err(ValueError, "name"))),
            ("get_attention(['additive'])", lambda: get_attention(["additive"]), Err((ValueError, TypeError), "name")),
    ):
        add(name, fn, expect)


def _shape(t, shape):
    assert tuple(t.shape) == shape, f"shape {tuple(t.shape)} != {shape}"


def _finite(t):
    assert bool(torch.isfinite(t).all()), "not finite"


def _assert(cond, msg):
    assert cond, msg


# ------------------------------------------------------ family: norms, positions, caches, blocks

def _nn_cases():
    import attnlab
    from attnlab import (ALiBi, FeedForward, KVCache, LearnedPositionalEmbedding, RMSNorm, RotaryEmbedding,
                         SinusoidalPositionalEmbedding, T5RelativeBias, alibi_slopes, apply_rope, make_norm,
                         rope_frequencies, sinusoidal_table)
    from attnlab import DecoderLayer, EncoderLayer

    def add(name, fn, expect):
        case("nn", name, fn, expect)

    x = torch.randn(2, 3, 8)
    for name, fn, word in (
            ("RMSNorm(0)", lambda: RMSNorm(0), "dim"), ("RMSNorm(8, eps=0)", lambda: RMSNorm(8, eps=0.0), "eps"),
            ("RMSNorm(8, eps=-1e-6)", lambda: RMSNorm(8, eps=-1e-6), "eps"),
            ("RMSNorm(8, eps=nan)", lambda: RMSNorm(8, eps=math.nan), "eps"),
            ("RMSNorm(8, eps=inf)", lambda: RMSNorm(8, eps=math.inf), "eps"),
            ("RMSNorm(8, eps='1e-6')", lambda: RMSNorm(8, eps="1e-6"), "eps"),
            ("make_norm('batchnorm')", lambda: make_norm("batchnorm", 8), "'layernorm', 'rmsnorm', got 'batchnorm'"),
            ("make_norm('layernorm', eps=0)", lambda: make_norm("layernorm", 8, eps=0.0), "eps"),
            ("make_norm('rmsnorm', eps=-1)", lambda: make_norm("rmsnorm", 8, eps=-1.0), "eps"),
            ("make_norm('layernorm', 0)", lambda: make_norm("layernorm", 0), "dim"),
            ("RMSNorm(8) on width 7", lambda: RMSNorm(8)(torch.randn(2, 7)), "8"),
            ("RotaryEmbedding(7)", lambda: RotaryEmbedding(7), "head_dim"),
            ("RotaryEmbedding(0)", lambda: RotaryEmbedding(0), "head_dim"),
            ("RotaryEmbedding(8, rotary_dim=10)", lambda: RotaryEmbedding(8, rotary_dim=10), "rotary_dim"),
            ("RotaryEmbedding(8, rotary_dim=3)", lambda: RotaryEmbedding(8, rotary_dim=3), "rotary_dim"),
            ("RotaryEmbedding(8, base=0)", lambda: RotaryEmbedding(8, base=0.0), "base"),
            ("RotaryEmbedding(8, base=-10000)", lambda: RotaryEmbedding(8, base=-1e4), "base"),
            ("RotaryEmbedding(8, base=nan)", lambda: RotaryEmbedding(8, base=math.nan), "base"),
            ("RotaryEmbedding(8, max_positions=0)", lambda: RotaryEmbedding(8, max_positions=0), "max_positions"),
            ("RotaryEmbedding(8, max_positions=2**40)", lambda: RotaryEmbedding(8, max_positions=2**40),
             "max_positions"),
            ("RotaryEmbedding: float positions", lambda: RotaryEmbedding(8)(torch.randn(1, 2, 3, 8),
                                                                           torch.tensor([0.5, 1.0, 2.0])), "positions"),
            ("RotaryEmbedding: negative positions", lambda: RotaryEmbedding(8)(torch.randn(1, 2, 3, 8),
                                                                              torch.tensor([-1, 0, 1])), "positions"),
            ("RotaryEmbedding: 3 positions for 4 rows", lambda: RotaryEmbedding(8)(torch.randn(1, 2, 4, 8),
                                                                                  torch.arange(3)), "positions"),
            ("RotaryEmbedding: x of width 6", lambda: RotaryEmbedding(8)(torch.randn(1, 2, 3, 6), torch.arange(3)),
             "8"),
            ("rope_frequencies(7, ...)", lambda: rope_frequencies(7, torch.arange(3)), "head_dim"),
            ("rope_frequencies(8, base=0)", lambda: rope_frequencies(8, torch.arange(3), base=0.0), "base"),
            ("apply_rope: cos of another length", lambda: apply_rope(torch.randn(1, 1, 3, 8), *rope_frequencies(
                8, torch.arange(4))), "cos"),
            ("ALiBi(0)", lambda: ALiBi(0), "num_heads"), ("ALiBi(-2)", lambda: ALiBi(-2), "num_heads"),
            ("ALiBi(2.0)", lambda: ALiBi(2.0), "num_heads"), ("ALiBi(2**40)", lambda: ALiBi(2**40), "num_heads"),
            ("alibi_slopes(0)", lambda: alibi_slopes(0), "num_heads"),
            ("alibi_slopes(2**40)", lambda: alibi_slopes(2**40), "num_heads"),
            ("ALiBi: float positions", lambda: ALiBi(4)(torch.tensor([0.5]), torch.arange(3)), "positions"),
            ("sinusoidal_table(2**40, 8)", lambda: sinusoidal_table(2**40, 8), "num_positions"),
            ("sinusoidal_table(4, 8, base=-1)", lambda: sinusoidal_table(4, 8, base=-1.0), "base"),
            ("SinusoidalPositionalEmbedding(8, max_positions=-1)",
             lambda: SinusoidalPositionalEmbedding(8, max_positions=-1), "max_positions"),
            ("LearnedPositionalEmbedding(0, 8)", lambda: LearnedPositionalEmbedding(0, 8), "max_positions"),
            ("LearnedPositionalEmbedding(2**40, 8)", lambda: LearnedPositionalEmbedding(2**40, 8), "max_positions"),
            ("LearnedPositionalEmbedding: position 16 of 16",
             lambda: LearnedPositionalEmbedding(16, 8)(torch.arange(17)), "16"),
            ("T5RelativeBias(4, num_buckets=0)", lambda: T5RelativeBias(4, num_buckets=0), "num_buckets"),
            ("T5RelativeBias(4, max_distance=0)", lambda: T5RelativeBias(4, max_distance=0), "max_distance"),
            ("T5RelativeBias(4, num_buckets=2**40)", lambda: T5RelativeBias(4, num_buckets=2**40, max_distance=2**41),
             "num_buckets"),
            ("KVCache(max_length=0)", lambda: KVCache(max_length=0), "max_length"),
            ("KVCache(max_length=-1)", lambda: KVCache(max_length=-1), "max_length"),
            ("KVCache(window=0)", lambda: KVCache(window=0), "window"),
            ("KVCache(window=4, max_length=8)", lambda: KVCache(window=4, max_length=8), "window"),
            ("KVCache(static='yes')", lambda: KVCache(static="yes"), "static"),
            ("FeedForward(0, 8)", lambda: FeedForward(0, 8), "dim"),
            ("FeedForward(8, 0)", lambda: FeedForward(8, 0), "hidden_dim"),
            ("FeedForward(8, 16, activation='swish2')", lambda: FeedForward(8, 16, activation="swish2"), "activation"),
            ("FeedForward(8, 16, dropout=1.0)", lambda: FeedForward(8, 16, dropout=1.0), "dropout"),
            ("FeedForward(8, 2**40)", lambda: FeedForward(8, 2**40), "hidden_dim"),
            ("EncoderLayer(8, 3, ffn_dim=16)", lambda: EncoderLayer(8, 3, ffn_dim=16), "num_heads"),
            ("EncoderLayer(8, 2, ffn_dim=0)", lambda: EncoderLayer(8, 2, ffn_dim=0), "ffn_dim"),
            ("EncoderLayer(8, 2, norm_eps=0)", lambda: EncoderLayer(8, 2, ffn_dim=16, norm_eps=0.0), "eps"),
            ("EncoderLayer(8, 2, drop_path=1.0)", lambda: EncoderLayer(8, 2, ffn_dim=16, drop_path=1.0), "drop_path"),
            ("EncoderLayer(8, 2, norm='group')", lambda: EncoderLayer(8, 2, ffn_dim=16, norm="group"), "norm"),
            ("EncoderLayer(8, 2, colour='red')", lambda: EncoderLayer(8, 2, ffn_dim=16, colour="red"), "colour"),
            ("DecoderLayer(8, 2, ffn_dim=16, num_kv_heads=3)",
             lambda: DecoderLayer(8, 2, ffn_dim=16, num_kv_heads=3), "num_kv_heads"),
    ):
        add(name, fn, Err((ValueError, TypeError, IndexError), word))

    def rms_oracle(r):
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(r, want, atol=1e-6), "RMSNorm differs from its formula"
    add("RMSNorm: the formula", lambda: RMSNorm(8)(x), Ok(rms_oracle))
    add("RMSNorm: a zero row stays finite", lambda: RMSNorm(8)(torch.zeros(2, 8)), Ok(_finite))
    add("RMSNorm: a NaN row stays its own", lambda: RMSNorm(8)(torch.tensor([[math.nan] * 8, [1.0] * 8])),
        Ok(lambda r: _assert(bool(r[0].isnan().all()) and bool(r[1].isfinite().all()), "NaN crossed rows")))
    add("RMSNorm: float64 input to float32 weights", lambda: RMSNorm(8)(x.double()),
        Either(Ok(lambda r: _assert(torch.allclose(r.float(), RMSNorm(8)(x), atol=1e-6), "differs")),
               Err((TypeError, ValueError), "dtype")))

    def rope_beyond(r):
        rot = RotaryEmbedding(8, max_positions=4)
        xq = torch.randn(1, 1, 3, 8, generator=torch.Generator().manual_seed(3))
        pos = torch.tensor([5, 9, 100])
        cos, sin = rope_frequencies(8, pos)
        want = apply_rope(xq, cos, sin)
        assert torch.allclose(rot(xq, pos), want, atol=1e-6), "positions past max_positions rotate wrongly"
    add("RotaryEmbedding: positions beyond max_positions", lambda: None, Ok(rope_beyond))
    add("ALiBi(3): slopes for a non-power-of-two head count", lambda: ALiBi(3)(torch.arange(4), torch.arange(4)),
        Ok(lambda r: _shape(r, (1, 3, 4, 4))))
    add("ALiBi(4) used with 8 heads", lambda: attnlab.attention(*qkv(H=8, Hkv=8), score_mod=attnlab.alibi_score_mod(
        alibi_slopes(4))), Err(ValueError, "heads"))
    add("sinusoidal_table(0, 8): no rows", lambda: sinusoidal_table(0, 8), Ok(lambda r: _shape(r, (0, 8))))
    add("sinusoidal_table(4, 7): an odd width ends on a sine", lambda: sinusoidal_table(4, 7),
        Ok(lambda r: _assert(torch.allclose(r[3, 6], torch.tensor(math.sin(3 / 10000 ** (6 / 7)))), "last column")))
    add("sinusoidal_table: the formula", lambda: sinusoidal_table(3, 4),
        Ok(lambda r: _assert(torch.allclose(r[2], torch.tensor([math.sin(2), math.cos(2), math.sin(2 / 100),
                                                                   math.cos(2 / 100)])), "table differs")))

    # KV caches
    def kv(L=2, H=2, dt=torch.float32):
        return torch.randn(1, H, L, 4, dtype=dt), torch.randn(1, H, L, 4, dtype=dt)

    def overflow():
        c = KVCache(max_length=3)
        c.update(*kv(2))
        return c.update(*kv(2))

    def wrong_dtype():
        c = KVCache()
        c.update(*kv())
        return c.update(*kv(dt=torch.float64))

    def wrong_dtype_static():
        c = KVCache(max_length=8)
        c.update(*kv())
        return c.update(*kv(dt=torch.float16))

    def wrong_heads():
        c = KVCache(max_length=8)
        c.update(*kv())
        return c.update(*kv(H=3))

    def wrong_heads_growing():
        c = KVCache()
        c.update(*kv())
        c.update(*kv())
        return c.update(*kv(H=3))

    def reuse():
        c = KVCache(max_length=4)
        c.update(*kv(3))
        c.reset()
        a = kv(2)
        k, v = c.update(*a)
        assert torch.equal(k, a[0]) and torch.equal(v, a[1]), "a reset cache returned stale entries"
        return k

    def ring_reuse():
        c = KVCache(window=2)
        for _ in range(5):
            c.update(*kv(1))
        c.reset()
        a = kv(1)
        k, _ = c.update(*a)
        assert torch.equal(k, a[0]), "a reset ring cache returned stale entries"
        return k

    add("KVCache: overflow max_length", overflow, Err(ValueError, "max_length"))
    add("KVCache: float64 after float32", wrong_dtype, Err(ValueError, "torch.float64", "does not match"))
    add("KVCache(max_length): float16 after float32", wrong_dtype_static,
        Err(ValueError, "torch.float16", "does not match"))
    add("KVCache(max_length): 3 heads after 2", wrong_heads, Err(ValueError, "shape"))
    add("KVCache: 3 heads after 2", wrong_heads_growing, Err(ValueError, "shape"))
    add("KVCache: k a list", lambda: KVCache().update([[1.0]], [[1.0]]), Err(TypeError, "k"))
    add("KVCache: k and v of other lengths", lambda: KVCache().update(kv(2)[0], kv(3)[1]), Err(ValueError, "v"))
    add("KVCache: 3-D k", lambda: KVCache().update(kv()[0][0], kv()[1][0]), Err(ValueError, "k"))
    add("KVCache: reuse after reset", reuse, Ok())
    add("KVCache(window): reuse after reset", ring_reuse, Ok())
    add("KVCache: rewind to a mark from the future", lambda: KVCache().rewind((5, True)), Err(ValueError, "mark"))


# ------------------------------------------------------------------ family: models from configs

def tiny_gpt2(**kw):
    import attnlab
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, embd_pdrop=0.0, resid_pdrop=0.0,
               attn_pdrop=0.0)
    return attnlab.GPT2LMHeadModel(attnlab.GPT2Config(**{**cfg, **kw})).eval()


def tiny_llama(**kw):
    import attnlab
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16)
    return attnlab.LlamaForCausalLM(attnlab.LlamaConfig(**{**cfg, **kw})).eval()


def _model_cases():
    import attnlab

    def add(name, fn, expect):
        case("models", name, fn, expect)

    bad_sizes = (0, -1, 10**9, 2.5, math.nan, "2", True, None)
    for field in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"):
        for value in bad_sizes:
            add(f"GPT2Config({field}={value!r})", lambda f=field, v=value: tiny_gpt2(**{f: v}),
                Err((ValueError, TypeError), field))
    for field in ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size",
                  "max_position_embeddings"):
        for value in (0, -1, 10**9, 2.5, math.nan):
            add(f"LlamaConfig({field}={value!r})", lambda f=field, v=value: tiny_llama(**{f: v}),
                Err((ValueError, TypeError), field))
    for kw, word in ((dict(n_head=3), "n_head"), (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
                     (dict(layer_norm_epsilon=math.nan), "layer_norm_epsilon"), (dict(embd_pdrop=1.5), "embd_pdrop"),
                     (dict(attn_pdrop=-0.1), "attn_pdrop"), (dict(activation="gelu_fast2"), "activation"),
                     (dict(n_inner=0), "n_inner"), (dict(n_inner=10**9), "n_inner")):
        add(f"GPT2Config({kw})", lambda kw=kw: tiny_gpt2(**kw), Err((ValueError, TypeError), word))
    for kw, word in ((dict(num_key_value_heads=3), "num_key_value_heads"), (dict(rope_theta=0.0), "rope_theta"),
                     (dict(rope_theta=math.nan), "rope_theta"), (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
                     (dict(rope_scaling={"type": "bogus", "factor": 2.0}), "rope_scaling"),
                     (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), "factor"),
                     (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
                     (dict(final_logit_softcapping=math.nan), "final_logit_softcapping"),
                     (dict(hidden_act="relu7"), "hidden_act"),
                     (dict(hidden_dropout=1.0), "hidden_dropout")):
        add(f"LlamaConfig({kw})", lambda kw=kw: tiny_llama(**kw), Err((ValueError, TypeError), word))
    for kw, word in ((dict(dim=0), "dim"), (dict(dim=8, num_heads=3), "num_heads"), (dict(ffn_dim=0), "ffn_dim"),
                     (dict(position="spiral"), "position"), (dict(max_positions=-1), "max_positions"),
                     (dict(norm="group"), "norm"), (dict(norm_eps=0.0), "norm_eps"), (dict(dropout=1.0), "dropout"),
                     (dict(num_encoder_layers=10**9), "num_encoder_layers"), (dict(pad_id=100), "pad_id")):
        add(f"TransformerConfig({kw})", lambda kw=kw: attnlab.TransformerConfig(src_vocab_size=20, **kw),
            Err((ValueError, TypeError), word))

    add("GPT2Config: every size within its range, the whole beyond memory",
        lambda: tiny_gpt2(n_embd=65536, n_layer=1024, n_head=1024, vocab_size=1 << 22),
        Err(ValueError, "n_embd=65536", "of memory"))
    # a config's token ids are kept as transformers keeps them (a small test vocabulary keeps GPT-2's 50256);
    # generate() refuses the ids it is given beyond the vocabulary (family "generate")
    for kw in (dict(eos_token_id=50), dict(bos_token_id=50)):
        add(f"GPT2Config({kw}) is kept", lambda kw=kw: tiny_gpt2(**kw).config, Ok())

    m = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    for name, fn, expect in (
            ("GPT-2: an id = vocab_size", lambda: m(torch.tensor([[1, 50]])),
             Err((ValueError, IndexError), "input_ids")),
            ("GPT-2: a negative id", lambda: m(torch.tensor([[1, -1]])), Err((ValueError, IndexError), "input_ids")),
            ("GPT-2: float ids", lambda: m(ids.float()), Err((TypeError, ValueError), "input_ids")),
            ("GPT-2: 17 tokens for 16 positions", lambda: m(torch.zeros(1, 17, dtype=torch.long)),
             Err(ValueError, "16")),
            ("GPT-2: no tokens", lambda: m(torch.zeros(1, 0, dtype=torch.long)),
             Either(Ok(lambda r: _shape(r.logits, (1, 0, 50))), Err(ValueError, "input_ids"))),
            ("GPT-2: 1-D ids", lambda: m(ids[0]), Either(Ok(), Err(ValueError, "input_ids"))),
            ("GPT-2: attention_mask of another shape", lambda: m(ids, attention_mask=torch.ones(2, 5)),
             Err(ValueError, "attention_mask")),
            ("GPT-2: attention_mask of 2s", lambda: m(ids, attention_mask=torch.full((2, 6), 2)),
             Err(ValueError, "attention_mask")),
            ("Llama: an id = vocab_size", lambda: tiny_llama()(torch.tensor([[1, 50]])),
             Err((ValueError, IndexError), "input_ids")),
            ("Llama: 17 tokens for 16 positions", lambda: tiny_llama()(torch.zeros(1, 17, dtype=torch.long)),
             Either(Ok(), Err(ValueError, "16"))),
    ):
        add(name, fn, expect)

    def one_row_not_another(r):
        a, b = r
        assert bool(a[0].isfinite().all()), "a NaN weight's model: row 0 finite?"
    def nan_weight():
        mm = tiny_gpt2()
        with torch.no_grad():
            mm.transformer.h[0].mlp.c_fc.weight[0, 0] = math.nan if hasattr(mm, "transformer") else 0
        return mm(ids).logits
    add("GPT-2: a NaN weight gives NaN logits", lambda: _nan_weight_logits(tiny_gpt2(), ids),
        Ok(lambda r: _assert(bool(r.isnan().any()), "the NaN weight vanished")))

    torch.manual_seed(0)
    t5 = attnlab.T5ForConditionalGeneration(attnlab.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                             num_heads=2)).eval()
    vit = attnlab.ViTForImageClassification(attnlab.ViTConfig(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=3)).eval()
    px = torch.randn(1, 3, 8, 8)
    t5_ids = torch.tensor([[3, 4, 5]])
    for name, fn, expect in (
            ("T5: labels = vocab_size", lambda: t5(t5_ids, labels=torch.tensor([[1, 40]])),
             Err(ValueError, "labels")),
            ("T5: labels of -5", lambda: t5(t5_ids, labels=torch.tensor([[1, -5]])), Err(ValueError, "labels")),
            ("T5: labels of -100 are ignored", lambda: (t5(t5_ids, labels=torch.tensor([[1, -100]])).loss,
                                                        t5(t5_ids, labels=torch.tensor([[1, 2]]))),
             Ok(lambda r: _finite(r[0]))),
            ("T5: float labels", lambda: t5(t5_ids, labels=torch.tensor([[1.0, 2.0]])), Err(ValueError, "labels")),
            ("T5: neither decoder ids nor labels", lambda: t5(t5_ids), Err(ValueError, "labels")),
            ("ViT: 12×12 pixels for 8×8", lambda: vit(torch.randn(1, 3, 12, 12)), Err(ValueError, "image_size")),
            ("ViT: 1 channel for 3", lambda: vit(torch.randn(1, 1, 8, 8)), Err(ValueError, "num_channels")),
            ("ViT: uint8 pixels", lambda: vit(px.to(torch.uint8)), Err(ValueError, "pixel_values")),
            ("ViT: 3-D pixels", lambda: vit(px[0]), Err(ValueError, "pixel_values")),
            ("ViT: label 3 of 3", lambda: vit(px, labels=torch.tensor([3])), Err(ValueError, "labels")),
            ("ViT: NaN pixels give NaN logits", lambda: vit(torch.full((1, 3, 8, 8), math.nan)).logits,
             Ok(lambda r: _assert(bool(r.isnan().all()), "the NaN image vanished"))),
            ("ViTConfig: patch_size 3 of 8", lambda: attnlab.ViTConfig(image_size=8, patch_size=3),
             Err(ValueError, "patch_size")),
    ):
        add(name, fn, expect)

    def padded_rows():
        left = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        out = m(left, attention_mask=mask).logits
        alone = m(torch.tensor([[5, 6, 7]])).logits
        return out[0, 2:], alone[0]
    add("GPT-2: a left-padded row equals itself unpadded", padded_rows,
        Ok(lambda r: _assert(torch.allclose(r[0], r[1], atol=1e-5), "padding changed the row")))


def _nan_weight_logits(model, ids):
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "embed" not in n)[0, 0] = \
            math.nan
    return model(ids).logits


# --------------------------------------------------------------------- family: hostile folders

def _hub_cases():
    import attnlab
    from safetensors.torch import load_file, save_file

    root = Path(tempfile.mkdtemp(prefix="attnlab-hostile-"))
    good = root / "good"
    attnlab.save_pretrained(tiny_gpt2(), good)
    weights = load_file(good / "model.safetensors")
    config = json.loads((good / "config.json").read_text())
    ids = torch.tensor([[1, 2, 3]])
    want = tiny_gpt2()(ids).logits

    def folder(name, *, tensors=None, cfg=None, raw=None):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config if cfg is None else cfg))
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        else:
            save_file(weights if tensors is None else tensors, d / "model.safetensors")
        return d

    def header(d: Path, edit):
        raw = (d / "model.safetensors").read_bytes()
        n = int.from_bytes(raw[:8], "little")
        h = json.loads(raw[8:8 + n])
        edit(h)
        hb = json.dumps(h).encode()
        hb += b" " * (-len(hb) % 8)
        (d / "model.safetensors").write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
        return d

    def load(d):
        return attnlab.from_pretrained(d)

    def add(name, make, expect):
        case("hub", name, lambda: load(make()), expect)

    first = sorted(weights)[0]
    wte = next(k for k in weights if "wte" in k)
    fc = next(k for k in weights if "c_fc.weight" in k)
    add("the folder as saved", lambda: good, Ok(lambda mm: _assert(torch.allclose(mm(ids).logits, want, atol=1e-6),
                                                                   "logits differ")))
    add("a tensor missing", lambda: folder("missing", tensors={k: v for k, v in weights.items() if k != fc}),
        Err(ValueError, fc))
    add("an extra tensor", lambda: folder("extra", tensors={**weights, "extra.weight": torch.ones(2)}),
        Either(Ok(lambda mm: _assert(torch.allclose(mm(ids).logits, want, atol=1e-6), "logits differ")),
               Err(ValueError, "extra.weight")))
    add("a tensor renamed", lambda: folder("renamed", tensors={(k + "_x" if k == fc else k): v
                                                                for k, v in weights.items()}), Err(ValueError, fc))
    add("a tensor of the wrong shape", lambda: folder("shape", tensors={**weights, fc: weights[fc][:, :-1].clone()}),
        Err(ValueError, fc))
    add("a tensor transposed", lambda: folder("transposed", tensors={**weights, fc: weights[fc].t().contiguous()}),
        Err(ValueError, fc))
    add("NaN weights", lambda: folder("nan", tensors={**weights, fc: torch.full_like(weights[fc], math.nan)}),
        Either(Ok(lambda mm: _assert(bool(mm(ids).logits.isnan().any()), "NaN weights gave finite logits")),
               Err(ValueError, "nan")))
    add("an int32 weight", lambda: folder("int", tensors={**weights, fc: weights[fc].to(torch.int32)}),
        Err(ValueError, fc))
    add("float64 weights", lambda: folder("f64", tensors={k: v.double() for k, v in weights.items()}),
        Either(Ok(lambda mm: _assert(torch.allclose(mm(ids).logits.double(), want.double(), atol=1e-5), "differ")),
               Err(ValueError, "float64")))
    add("a header declaring F32 data as I32", lambda: header(folder("decl"), lambda h: h[fc].update(dtype="I32")),
        Err(ValueError, fc))
    add("a header declaring F32 data as F16", lambda: header(folder("decl16"), lambda h: h[fc].update(dtype="F16")),
        Err(ValueError, ""))
    add("a header with offsets past the end",
        lambda: header(folder("offsets"), lambda h: h[fc].update(data_offsets=[0, 10**12])), Err(ValueError, ""))
    add("a header with overlapping offsets",
        lambda: header(folder("overlap"), lambda h: h[fc].update(data_offsets=h[wte]["data_offsets"])),
        Err(ValueError, ""))
    add("a header of the wrong shape for its bytes",
        lambda: header(folder("hshape"), lambda h: h[fc].update(shape=[h[fc]["shape"][0], 1])), Err(ValueError, ""))
    raw = (good / "model.safetensors").read_bytes()
    add("a truncated file", lambda: folder("trunc", raw=raw[: len(raw) // 2]), Err(ValueError, "model.safetensors"))
    add("a 0-byte file", lambda: folder("empty", raw=b""), Err(ValueError, "model.safetensors"))
    add("a header length of 2**62", lambda: folder("hlen", raw=(2**62).to_bytes(8, "little") + raw[8:]),
        Err(ValueError, "model.safetensors"))
    add("a header that is not JSON", lambda: folder("hjson", raw=(16).to_bytes(8, "little") + b"not json at all!"),
        Err(ValueError, "model.safetensors"))

    def fifo():
        d = root / "fifo"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        os.mkfifo(d / "model.safetensors")
        return d
    add("model.safetensors a FIFO", fifo, Err(ValueError, "model.safetensors"))

    def zero_link(name="model.safetensors"):
        def make():
            d = root / f"zero-{name}"
            d.mkdir()
            if name != "config.json":
                (d / "config.json").write_text(json.dumps(config))
            else:
                save_file(weights, d / "model.safetensors")
            (d / name).symlink_to("/dev/zero")
            return d
        return make
    add("model.safetensors linked to /dev/zero", zero_link(), Err(ValueError, "model.safetensors"))
    add("config.json linked to /dev/zero", zero_link("config.json"), Err(ValueError, "config.json"))

    def config_fifo():
        d = root / "cfg-fifo"
        d.mkdir()
        save_file(weights, d / "model.safetensors")
        os.mkfifo(d / "config.json")
        return d
    add("config.json a FIFO", config_fifo, Err(ValueError, "config.json"))

    def sharded(name, index, shards=True):
        def make():
            d = root / name
            d.mkdir()
            (d / "config.json").write_text(json.dumps(config))
            if shards:
                save_file({k: v for k, v in weights.items() if k != fc}, d / "a.safetensors")
                save_file({fc: weights[fc]}, d / "b.safetensors")
            (d / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
            return d
        return make
    wmap = {k: ("b.safetensors" if k == fc else "a.safetensors") for k in weights}
    (root / "outside.safetensors").write_bytes(raw)
    add("a sharded folder", sharded("shards", {"weight_map": wmap}),
        Ok(lambda mm: _assert(torch.allclose(mm(ids).logits, want, atol=1e-6), "logits differ")))
    add("an index naming ../outside.safetensors",
        sharded("outside", {"weight_map": {**wmap, fc: "../outside.safetensors"}}), Err(ValueError, "outside"))
    add("an index naming an absolute path",
        sharded("absolute", {"weight_map": {**wmap, fc: str(root / "outside.safetensors")}}),
        Err(ValueError, "outside"))
    add("an index naming a missing shard", sharded("noshard", {"weight_map": {**wmap, fc: "c.safetensors"}}),
        Err((ValueError, FileNotFoundError), "c.safetensors"))
    add("an index that is not JSON", sharded("badindex", "{weight_map"), Err(ValueError, "index"))
    add("an index whose weight_map is a list", sharded("listindex", {"weight_map": ["a.safetensors"]}),
        Err(ValueError, "weight_map"))
    add("an index leaving out a tensor",
        sharded("partial", {"weight_map": {k: v for k, v in wmap.items() if k != fc}}), Err(ValueError, fc))

    for key, value in (("n_layer", "2"), ("n_layer", 10**9), ("n_embd", 2**40), ("n_head", 0), ("vocab_size", -1),
                       ("n_positions", 1.5), ("layer_norm_epsilon", "small"), ("n_layer", None),
                       ("model_type", "gpt9"), ("model_type", 7), ("activation_function", ["gelu"])):
        add(f"config.json {key}={value!r}", lambda key=key, value=value: folder(
            f"cfg-{key}-{value!s}"[:60].replace("/", "_"), cfg={**config, key: value}),
            Err((ValueError, TypeError), key))
    add("config.json n_embd NaN", lambda: _nan_config(folder("cfg-nan"), "n_embd"),
        Err((ValueError, TypeError), "n_embd"))
    add("config.json a list", lambda: folder("cfg-list", cfg=[config]), Err(ValueError, "config.json"))
    add("config.json not JSON", lambda: _write(folder("cfg-text"), "config.json", "{n_layer: 2"),
        Err(ValueError, "config.json"))
    add("config.json of 64 MB", lambda: _write(folder("cfg-big"), "config.json", json.dumps(
        {**config, "pad": "x" * (64 << 20)})), Err(ValueError, "config.json"))
    add("config.json missing", lambda: _remove(folder("cfg-none"), "config.json"), Err((ValueError, FileNotFoundError),
                                                                                      "config.json"))
    add("no weights", lambda: _remove(folder("noweights"), "model.safetensors"), Err((ValueError, FileNotFoundError),
                                                                                     "weights"))
    add("a path that does not exist", lambda: root / "nowhere", Err((ValueError, FileNotFoundError), "nowhere"))
    add("a path that is a file", lambda: good / "config.json",
        Err((ValueError, FileNotFoundError), "config.json", "is a file"))
    case("hub", "from_pretrained('')", lambda: attnlab.from_pretrained(""),
         Err((ValueError, FileNotFoundError), "empty string"))
    case("hub", "dtype='float16' (a str)", lambda: attnlab.from_pretrained(good, dtype="float16"),
         Err((ValueError, TypeError), "dtype"))
    case("hub", "dtype=torch.int8", lambda: attnlab.from_pretrained(good, dtype=torch.int8),
         Err((ValueError, TypeError), "dtype"))
    case("hub", "dtype=torch.float64", lambda: attnlab.from_pretrained(good, dtype=torch.float64),
         Ok(lambda mm: _assert(torch.allclose(mm(ids).logits, want.double(), atol=1e-5), "float64 logits differ")))


def _nan_config(d: Path, key: str) -> Path:
    text = (d / "config.json").read_text()
    cfg = json.loads(text)
    cfg[key] = "NAN_HERE"
    (d / "config.json").write_text(json.dumps(cfg).replace('"NAN_HERE"', "NaN"))
    return d


def _write(d: Path, name: str, text: str) -> Path:
    (d / name).write_text(text)
    return d


def _remove(d: Path, name: str) -> Path:
    (d / name).unlink()
    return d


# -------------------------------------------------------------------------- family: generate()

def _generate_cases():
    import attnlab

    m = tiny_gpt2()
    ids = torch.tensor([[3, 4, 5]])

    def greedy_oracle(n, prompt=ids):
        out = prompt
        with torch.no_grad():
            for _ in range(n):
                out = torch.cat([out, m(out).logits[:, -1].argmax(-1, keepdim=True)], 1)
        return out

    def gen(**kw):
        kw.setdefault("max_new_tokens", 4)
        prompt = kw.pop("input_ids", ids)
        return attnlab.generate(m, prompt, **kw)

    def add(name, fn, expect):
        case("generate", name, fn, expect)

    add("greedy equals the argmax loop", lambda: gen(),
        Ok(lambda r: _assert(torch.equal(r, greedy_oracle(4)), "differ")))
    add("max_new_tokens=0", lambda: gen(max_new_tokens=0),
        Either(Ok(lambda r: _assert(torch.equal(r, ids), "not the prompt")), Err(ValueError, "max_new_tokens")))
    add("cache='static' equals dynamic", lambda: gen(cache="static"),
        Ok(lambda r: _assert(torch.equal(r, greedy_oracle(4)), "differ")))
    add("do_sample with top_k=1 is greedy", lambda: gen(do_sample=True, top_k=1),
        Ok(lambda r: _assert(torch.equal(r, greedy_oracle(4)), "differ")))
    add("top_k > vocab", lambda: gen(do_sample=True, top_k=10**6), Either(Ok(), Err(ValueError, "top_k")))
    add("top_p=1.0", lambda: gen(do_sample=True, top_p=1.0), Ok())
    for kw, word in ((dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2**40), "max_new_tokens"),
                     (dict(max_new_tokens=1.5), "max_new_tokens"), (dict(max_new_tokens=None), "max_new_tokens"),
                     (dict(max_new_tokens=True), "max_new_tokens"),
                     (dict(do_sample=True, temperature=0.0), "temperature"),
                     (dict(do_sample=True, temperature=-1.0), "temperature"),
                     (dict(do_sample=True, temperature=math.nan), "temperature"),
                     (dict(do_sample=True, temperature=math.inf), "temperature"),
                     (dict(do_sample=True, top_k=0), "top_k"), (dict(do_sample=True, top_k=-1), "top_k"),
                     (dict(do_sample=True, top_k=1.5), "top_k"), (dict(do_sample=True, top_p=0.0), "top_p"),
                     (dict(do_sample=True, top_p=1.5), "top_p"), (dict(do_sample=True, top_p=math.nan), "top_p"),
                     (dict(do_sample=True, top_p=-0.1), "top_p"), (dict(eos_token_id=50), "eos_token_id"),
                     (dict(eos_token_id=-1), "eos_token_id"), (dict(pad_token_id=50), "pad_token_id"),
                     (dict(num_beams=0), "num_beams"), (dict(num_beams=-2), "num_beams"),
                     (dict(num_beams=10**6), "num_beams"),
                     (dict(num_beams=2, length_penalty=math.nan), "length_penalty"),
                     (dict(do_sample="yes"), "do_sample"), (dict(cache="paged"), "cache"),
                     (dict(generator="seed"), "generator"), (dict(streamer=3), "streamer"),
                     (dict(decoder_start_token_id=0), "decoder_start_token_id"),
                     (dict(max_new_tokens=14), "max_new_tokens")):
        add(f"generate({kw})", lambda kw=kw: gen(**kw), Err((ValueError, TypeError), word))
    for name, prompt, word in (("an empty prompt", torch.zeros(1, 0, dtype=torch.long), "input_ids"),
                               ("a prompt of 17 tokens for 16 positions", torch.zeros(1, 17, dtype=torch.long),
                                "prompt"),
                               ("a prompt of float ids", ids.float(), "input_ids"),
                               ("a prompt with id = vocab", torch.tensor([[3, 50]]), "input_ids"),
                               ("a prompt with a negative id", torch.tensor([[3, -4]]), "input_ids"),
                               ("a 1-D prompt", ids[0], "input_ids"), ("a list prompt", [[3, 4, 5]], "input_ids")):
        add(f"generate: {name}", lambda prompt=prompt: gen(input_ids=prompt), Err((ValueError, TypeError), word))

    def batch_rows():
        batch = torch.tensor([[0, 0, 3, 4, 5], [7, 8, 9, 10, 11]])
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        out = attnlab.generate(m, batch, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
        return out, greedy_oracle(3, ids), greedy_oracle(3, batch[1:])
    add("a batch of different lengths: each row as alone", batch_rows,
        Ok(lambda r: _assert(torch.equal(r[0][0, 2:], r[1][0]) and torch.equal(r[0][1], r[2][0]), "rows differ")))
    add("an attention_mask with an empty row", lambda: gen(input_ids=torch.tensor([[1, 2], [3, 4]]),
                                                           attention_mask=torch.tensor([[0, 0], [1, 1]])),
        Err(ValueError, "attention_mask"))
    add("an attention_mask of another shape", lambda: gen(attention_mask=torch.ones(1, 4, dtype=torch.long)),
        Err(ValueError, "attention_mask"))
    add("right padding", lambda: gen(input_ids=torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]])),
        Err(ValueError, "attention_mask"))
    torch.manual_seed(0)
    t5 = attnlab.T5ForConditionalGeneration(attnlab.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                             num_heads=2)).eval()
    add("T5: max_new_tokens=10**9 (no position limit)", lambda: attnlab.generate(t5, ids, max_new_tokens=10**9),
        Err(ValueError, "max_new_tokens"))
    add("T5: decoder_start_token_id = vocab_size", lambda: attnlab.generate(t5, ids, max_new_tokens=2,
                                                                           decoder_start_token_id=40),
        Err(ValueError, "decoder_start_token_id"))
    add("T5: 3 beams", lambda: attnlab.generate(t5, ids, max_new_tokens=3, num_beams=3),
        Ok(lambda r: _assert(r.shape[0] == 1 and 2 <= r.shape[1] <= 4 and bool((r < 40).all()), "beam output")))
    add("eos_token_id stops every row", lambda: gen(eos_token_id=int(greedy_oracle(1)[0, -1]), pad_token_id=0),
        Ok(lambda r: _assert(r.shape[1] == 4, f"did not stop: {r.shape}")))
    _generation_memory_cases(add, t5, ids, gen)


def _generation_memory_cases(add, t5, ids, gen):
    """Every row's and beam's KV caches (self- and cross-attention), the encoder's output and activations, checked
    against free memory before the encoder runs or a cache is made; the encoder is replaced by a failure, so a
    refusal that came after it shows as another error."""
    import attnlab

    torch.manual_seed(0)
    bart = attnlab.BartForConditionalGeneration(attnlab.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)).eval()
    s2s = attnlab.Seq2SeqTransformer(attnlab.TransformerConfig(
        src_vocab_size=40, tgt_vocab_size=40, dim=16, num_heads=2, ffn_dim=32, num_encoder_layers=1,
        num_decoder_layers=1, dropout=0.0)).eval()

    def before_encoding(model, source, **kw):
        def encode(*args, **kwargs):
            raise AssertionError("the source was encoded before the refusal")
        model.encode = encode
        try:
            return attnlab.generate(model, source, decoder_start_token_id=1, **kw)
        finally:
            del model.encode

    huge = dict(max_new_tokens=2**20, num_beams=1024)  # ~128 GiB of keys and values a source row: never free
    for name, model in (("T5", t5), ("BART", bart), ("Seq2SeqTransformer", s2s)):
        for cache in ("dynamic", "static"):
            add(f"{name}: max_new_tokens=2**20 with num_beams=1024, cache={cache!r}",
                lambda model=model, cache=cache: before_encoding(model, ids, cache=cache, **huge),
                Err(ValueError, "max_new_tokens=1048576", "num_beams=1024", "a batch of 1", "is free"))
        add(f"{name}: a batch of 65536 sources with num_beams=1024",
            lambda model=model: before_encoding(model, ids.expand(65536, -1), max_new_tokens=16, num_beams=1024),
            Err(ValueError, "num_beams=1024", "a batch of 65536", "is free"))
        add(f"{name}: a source of 2**20 tokens", lambda model=model: before_encoding(
            model, torch.ones(1, 2**20, dtype=torch.long), max_new_tokens=4, num_beams=64),
            Err(ValueError, "1048576-token source", "is free"))

        def loop(model=model, n=6):  # the argmax of a full decode at every step: no cache, no memory check
            out = torch.tensor([[1]])
            with torch.no_grad():
                memory = model.encode(ids)
                for _ in range(n):
                    logits = model.decode(out, memory)[:, -1]
                    out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
            return out

        add(f"{name}: greedy on the cache equals the argmax loop (up to its end token)",
            lambda model=model, loop=loop: (attnlab.generate(model, ids, max_new_tokens=6, decoder_start_token_id=1),
                                            loop()),
            Ok(lambda r: _assert(r[0].shape[1] >= 2 and torch.equal(r[0], r[1][:, :r[0].shape[1]]),
                                 f"{r[0].tolist()} != {r[1].tolist()}")))
    add("GPT-2: a batch of 65536 prompts with num_beams=1024 (within its positions)",
        lambda: gen(input_ids=ids.expand(65536, -1), num_beams=1024),
        Err(ValueError, "num_beams=1024", "a batch of 65536", "is free"))


# ------------------------------------------------------------- family: quantisation and adapters

def _adapt_cases():
    import attnlab
    from attnlab.adapt.adapters import apply_adapters
    from attnlab.adapt.int8_training import int8_training
    from attnlab.adapt.lora import apply_lora, merge_lora
    from attnlab.adapt.prompt import PrefixTuningLM, PromptTuningLM
    from attnlab.adapt.quantize import quantize, quantize_groups, quantize_rows

    def add(name, fn, expect):
        case("adapt", name, fn, expect)

    ids = torch.tensor([[3, 4, 5, 6]])
    wide = dict(n_embd=64, n_head=2)  # int4 quantises groups of 32 columns and more
    want = tiny_gpt2(**wide)(ids).logits

    def near_float(r, tol=0.25):
        err = float((r - want).abs().max())
        assert err <= tol * max(1.0, float(want.abs().max())), f"quantised logits off by {err:.3g}"

    for mode in ("int8", "int8-weight", "int4"):
        add(f"quantize({mode!r})", lambda mode=mode: quantize(tiny_gpt2(**wide), mode, group_size=32)(ids).logits,
            Ok(near_float))
        add(f"quantize({mode!r}) of a NaN weight",
            lambda mode=mode: quantize(_with_nan(tiny_gpt2(**wide)), mode, group_size=32)(ids).logits,
            Either(Ok(lambda r: _assert(bool(r.isnan().any()), "the NaN weight vanished")), Err(ValueError, "nan")))
        add(f"quantize({mode!r}) of an odd-shaped model",
            lambda mode=mode: quantize(tiny_gpt2(n_embd=6, n_head=2, vocab_size=37), mode)(ids).logits,
            Either(Ok(lambda r: _shape(r, (1, 4, 37))), Err(ValueError, "int4", "exclude=")))
        for gs in (0, -1, 3, 2**40, 1.5):
            add(f"quantize({mode!r}, group_size={gs!r})", lambda mode=mode, gs=gs: quantize(tiny_gpt2(), mode,
                                                                                            group_size=gs),
                Either(Ok(), Err((ValueError, TypeError), "group_size")) if mode != "int4" or gs == 3 else
                Err((ValueError, TypeError), "group_size"))
    for mode in ("INT8", "int3", None, "fp8", ""):
        add(f"quantize({mode!r})", lambda mode=mode: quantize(tiny_gpt2(), mode), Err((ValueError, TypeError), "mode"))
    add("quantize(a model, compute_dtype=torch.int8)", lambda: quantize(tiny_gpt2(), "int8", compute_dtype=torch.int8),
        Err((ValueError, TypeError), "compute_dtype"))
    add("quantize(not a module)", lambda: quantize({"w": torch.ones(2)}, "int8"), Err(TypeError, "model"))

    def rows_alone():
        w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        w2 = w.clone()
        w2[3] = math.inf
        a, sa = quantize_rows(w)
        b, sb = quantize_rows(w2)
        return a, sa, b, sb
    add("quantize_rows: an inf row spoils no other", rows_alone,
        Either(Ok(lambda r: _assert(torch.equal(r[0][:3], r[2][:3]) and torch.equal(r[1][:3], r[3][:3]),
                                    "other rows changed")), Err(ValueError, "inf")))
    add("quantize_groups(group_size=5) of 16 columns", lambda: quantize_groups(torch.randn(4, 16), 5),
        Err(ValueError, "group_size"))
    add("quantize_groups of a 3-D tensor", lambda: quantize_groups(torch.randn(2, 4, 16), 8),
        Either(Ok(), Err(ValueError, "w")))

    def int8_double_backward():
        mm = tiny_gpt2()
        int8_training(mm)
        mm.train()
        emb = mm.transformer.wte(ids).detach().requires_grad_() if hasattr(mm, "transformer") else None
        x = torch.randn(1, 4, 16, requires_grad=True)
        lin = next(mod for mod in mm.modules() if type(mod).__name__ == "Int8TrainingLinear")
        y = lin(x)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), x)
    add("int8 training layer: double backward", int8_double_backward,
        Either(Ok(lambda r: _finite(r[0])), Err((RuntimeError, ValueError), "int8")))

    for kw, word in ((dict(r=0, alpha=8.0), "r"), (dict(r=-1, alpha=8.0), "r"), (dict(r=1.5, alpha=8.0), "r"),
                     (dict(r=2, alpha=math.nan), "alpha"), (dict(r=2, alpha=-1.0), "alpha"),
                     (dict(r=2, alpha=8.0, dropout=1.0), "dropout"), (dict(r=10**9, alpha=8.0), "r"),
                     (dict(r=2, alpha=8.0, targets=["nothing_matches"]), "targets"),
                     (dict(r=2, alpha=8.0, targets="c_attn"), "targets")):
        add(f"apply_lora({kw})", lambda kw=kw: apply_lora(tiny_gpt2(), **kw), Err((ValueError, TypeError), word))

    def lora_merge():
        mm = apply_lora(tiny_gpt2(), r=2, alpha=4.0)
        for mod in mm.modules():
            for name, p in mod.named_parameters(recurse=False):
                if "lora_B" in name or name == "B":
                    torch.nn.init.normal_(p, std=0.1)
        before = mm(ids).logits
        return before, merge_lora(mm)(ids).logits
    add("LoRA: merged equals unmerged", lora_merge,
        Ok(lambda r: _assert(torch.allclose(r[0], r[1], atol=1e-5), "merge changed the logits")))
    add("LoRA applied twice", lambda: apply_lora(apply_lora(tiny_gpt2(), r=2, alpha=4.0), r=2, alpha=4.0),
        Err(ValueError, "lora"))
    for kw, word in ((dict(bottleneck=0), "bottleneck"), (dict(bottleneck=4, activation="zap"), "activation"),
                     (dict(bottleneck=4, sublayers=("nothing",)), "sublayers"),
                     (dict(bottleneck=4, init_std=-1.0), "init_std"), (dict(bottleneck=10**9), "bottleneck")):
        add(f"apply_adapters({kw})", lambda kw=kw: apply_adapters(_encoder(), **kw), Err((ValueError, TypeError), word))
    for cls in (PromptTuningLM, PrefixTuningLM):
        for kw, word in ((dict(num_tokens=0), "num_tokens"), (dict(num_tokens=-1), "num_tokens"),
                         (dict(num_tokens=10**9), "num_tokens"), (dict(num_tokens=2, init_ids=[1, 50]), "init_ids"),
                         (dict(num_tokens=2, init_ids=[1]), "init_ids"), (dict(num_tokens=2, seed=-1), "seed")):
            add(f"{cls.__name__}({kw})", lambda cls=cls, kw=kw: cls(tiny_gpt2(), **kw),
                Err((ValueError, TypeError), word))
        add(f"{cls.__name__}: prompt + input past the context",
            lambda cls=cls: cls(tiny_gpt2(), num_tokens=4)(torch.zeros(1, 13, dtype=torch.long)),
            Err(ValueError, "16"))


def _with_nan(model):
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n)[0, 0] = math.nan
    return model


def _encoder():
    import attnlab
    torch.manual_seed(0)
    return attnlab.TransformerEncoder(lambda i: attnlab.EncoderLayer(16, 2, ffn_dim=32), 1)


# ---------------------------------------------------------------------------------- the runner

FAMILIES = {"attention": _attention_cases, "grad": _grad_cases, "modules": _module_cases, "nn": _nn_cases,
            "models": _model_cases, "hub": _hub_cases, "generate": _generate_cases, "adapt": _adapt_cases}


CASE_SECONDS = 120  # a case that runs longer hangs (a FIFO read, an unbounded loop): a crash


class _Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _Hang()


def run_family(family: str, start: int = 0) -> dict:
    """Run the cases of ``family`` from number ``start`` on in this process; print one JSON line per case; return
    the counts."""
    signal.signal(signal.SIGALRM, _on_alarm)
    FAMILIES[family]()
    counts: dict[str, int] = {}
    for name, fn, expect in CASES[family][start:]:
        print(json.dumps({"case": name, "start": True}), file=sys.stderr, flush=True)  # the last before a crash
        error = result = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            signal.alarm(CASE_SECONDS)
            try:
                result = fn()
            except (MemoryError, _Hang) as e:
                error = e
            except Exception as e:  # noqa: BLE001 (classified below)
                error = e
            finally:
                signal.alarm(0)
        if isinstance(error, (MemoryError, _Hang)):
            kind, why = "crash", type(error).__name__
        else:
            kind, why = expect.judge(error, result)
        counts[kind] = counts.get(kind, 0) + 1
        print(json.dumps({"case": name, "outcome": kind, "why": why}), flush=True)
    print(json.dumps({"family": family, "counts": counts}), flush=True)
    return counts


def _run_subprocess(family: str, env: dict):
    out = subprocess.run([sys.executable, __file__, family], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "2", **env})
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return out, lines


# the tests run FlexAttention eagerly (conftest); users run it compiled, which reports a mod's errors its own way
RUNS = [(family, {}) for family in sorted(FAMILIES)] + [("attention", {"ATTNLAB_FLEX_COMPILE": "1"})]


@pytest.mark.parametrize("family, env", RUNS, ids=[f + "-flex-compiled" * bool(env) for f, env in RUNS])
def test_every_hostile_input_has_its_outcome(family, env):
    out, lines = _run_subprocess(family, env)
    if out.returncode != 0:
        last = [json.loads(x)["case"] for x in out.stderr.splitlines() if x.startswith('{"case"')][-1:]
        pytest.fail(f"{family}: the process ended with exit code {out.returncode} (crash at {last})\n"
                    f"{out.stderr[-3000:]}")
    bad = [f"{x['outcome']}: {x['case']}: {x['why']}" for x in lines if x.get("outcome") not in (None, "good")]
    assert lines and "counts" in lines[-1], out.stderr[-3000:]
    assert not bad, f"{len(bad)} of {sum(lines[-1]['counts'].values())} cases not good:\n" + "\n".join(bad)


# ------------------------------------------------------------- drawn arguments (hypothesis, in process)

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

DRAWN = dict(max_examples=int(os.environ.get("ATTNLAB_HOSTILE_EXAMPLES", "120")), deadline=None, database=None,
             derandomize=True, suppress_health_check=list(HealthCheck))
ODD = st.sampled_from([None, True, False, "1", math.nan, math.inf, -math.inf, 2**62, -2**62, 1e300, -0.0, [1]])


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _judge_drawn(call, bad: list, check=None):
    """``call()`` raises a ValueError/TypeError naming one of ``bad`` (the invalid arguments drawn), or, with
    nothing bad, returns a result that passes ``check``."""
    try:
        result = call()
    except (ValueError, TypeError) as e:
        assert bad, f"a valid call was refused: {type(e).__name__}: {e}"
        assert any(name in str(e) for name in bad), f"the error names none of {bad}: {type(e).__name__}: {e}"
        return
    assert not bad, f"accepted invalid {bad}"
    if check is not None:
        check(result)


def _topk_oracle(q, k, v, top_k, **kw):
    """The oracle with only each row's ``top_k`` largest visible scores kept (top-k softmax)."""
    def keep(s, i, j):
        kth = s.topk(min(top_k, s.shape[-1]), dim=-1).values[..., -1:]
        return torch.where(s >= kth, s, torch.full_like(s, -math.inf))
    if kw.get("causal") or kw.get("window") is not None:
        return None  # masked rows keep fewer than top_k: compared by the fixed cases instead
    return oracle(q, k, v, score=keep, **kw)


@settings(**DRAWN)
@given(backend=st.sampled_from(["auto", "reference", "sdpa", "short", "tiled"]),
       scale=st.one_of(st.none(), st.floats(-1e4, 1e4), ODD), window=st.one_of(st.none(), st.integers(-3, 9), ODD),
       top_k=st.one_of(st.none(), st.integers(-2, 9), ODD), dropout_p=st.one_of(st.just(0.0), st.floats(-1, 2), ODD),
       causal=st.one_of(st.booleans(), st.sampled_from([0, 1, None, "yes"])))
def test_drawn_attention_arguments_are_refused_by_name_or_computed(backend, scale, window, top_k, dropout_p, causal):
    from attnlab import attention

    q, k, v = qkv()
    bad = [name for name, ok in (
        ("scale", scale is None or (_real(scale) and math.isfinite(scale))),
        ("window", window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 1)),
        ("top_k", top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= 7)),
        ("dropout_p", _real(dropout_p) and 0 <= dropout_p < 1), ("causal", isinstance(causal, bool))) if not ok]
    kw = dict(scale=scale, window=window, causal=causal)
    normalize = "softmax" if top_k is None else "topk"

    def check(out):
        if dropout_p:
            assert out.shape == (2, 4, 5, 8) and bool(out.isfinite().all()), "dropout's output"
            return
        want = oracle(q, k, v, **kw) if top_k is None else _topk_oracle(q, k, v, top_k, **kw)
        if want is not None:
            close(want.float())(out)
    try:
        _judge_drawn(lambda: attention(q, k, v, normalize=normalize, top_k=top_k, dropout_p=dropout_p,
                                       backend=backend, **kw), bad, check)
    except AssertionError as e:
        if "was refused" in str(e) and f"backend={backend!r}" in str(e):
            return  # a named backend that cannot compute the request says so
        raise


@settings(**DRAWN)
@given(max_new_tokens=st.one_of(st.integers(-2, 14), ODD), do_sample=st.one_of(st.booleans(), ODD),
       temperature=st.one_of(st.floats(-2, 5), ODD), top_k=st.one_of(st.none(), st.integers(-2, 80), ODD),
       top_p=st.one_of(st.none(), st.floats(-0.5, 1.5), ODD), num_beams=st.one_of(st.integers(-1, 3), ODD))
def test_drawn_generation_settings_are_refused_by_name_or_decode(max_new_tokens, do_sample, temperature, top_k,
                                                                 top_p, num_beams):
    import attnlab

    model, ids = _generation_model(), torch.tensor([[3, 4, 5]])

    def integer(x):
        return isinstance(x, int) and not isinstance(x, bool)
    bad = [name for name, ok in (
        ("max_new_tokens", integer(max_new_tokens) and 1 <= max_new_tokens <= 13),
        ("do_sample", isinstance(do_sample, bool)),
        ("temperature", _real(temperature) and 0 < temperature < math.inf),
        ("top_k", top_k is None or (integer(top_k) and top_k >= 1)),
        ("top_p", top_p is None or (_real(top_p) and 0 < top_p <= 1)),
        ("num_beams", integer(num_beams) and 1 <= num_beams <= 1024)) if not ok]
    if not bad and do_sample and num_beams > 1:
        bad = ["num_beams"]  # beam sampling is not supported

    def check(out):
        n = out.shape[1] - 3
        assert out.shape[0] == 1 and 1 <= n <= max_new_tokens and torch.equal(out[:, :3], ids), tuple(out.shape)
        assert bool(((out >= 0) & (out < 50)).all()), "an id outside the vocabulary"
    # max_new_tokens > 13 runs past the 16 positions: refused by name ("max_new_tokens")
    _judge_drawn(lambda: attnlab.generate(model, ids, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                          temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams,
                                          generator=torch.Generator().manual_seed(0)), bad, check)


_MODEL = []


def _generation_model():
    if not _MODEL:
        _MODEL.append(tiny_gpt2())
    return _MODEL[0]


@settings(**DRAWN)
@given(field=st.sampled_from(["n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "n_inner"]),
       value=st.one_of(st.integers(-3, 64), st.integers((1 << 22) + 1, 2**45), ODD))
def test_drawn_model_sizes_are_refused_by_name_or_built(field, value):
    """A size is built (small), or refused by name: beyond every limit of the size table. (Sizes between 64 and the
    table's limits build models too large for a test: the fixed cases and ``tests/models/test_hub.py`` refuse them
    by memory.)"""
    import attnlab

    base = dict(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    cfg = {**base, field: value}
    ok_int = isinstance(value, int) and not isinstance(value, bool)
    small = ok_int and 1 <= value <= 64 and (field != "n_embd" or value % 2 == 0) and (
        field != "n_head" or 16 % value == 0)
    bad = [] if (small or (field == "n_inner" and value is None)) else [field]
    _judge_drawn(lambda: attnlab.GPT2LMHeadModel(attnlab.GPT2Config(**cfg)), bad,
                 lambda m: _assert(m.config.__dict__[field] == value, "the config changed the value"))


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    run_family(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
