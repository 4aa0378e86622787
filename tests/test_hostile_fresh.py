"""A second hostile corpus, written apart from ``tests/test_hostile_api.py``'s cases: the public API called as a
careless or malicious user would call it — odd keyword values, wrong types, degenerate shapes, broken files.

It reuses that file's harness (:class:`Err`, :class:`Ok`, :func:`run_family`: a family of cases runs in its own
subprocess under an address-space limit and a per-case alarm) and its outcome classes (good, obscure,
silent-wrong, crash), and adds one of its own: ``data-loss``, a call that changed a file it was handed to read.
Every case must be ``good``: an exact result, or one error of the right type whose message names the argument.
"""
from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_hostile_api as H  # noqa: E402  (the harness: outcomes, run_family)
from test_hostile_api import AnyErr, Either, Err, Ok, close  # noqa: E402

FAMILY_PREFIX = "fresh_"
_TMP = []  # temporary folders of the file cases, removed when the process ends


def E(*words: str) -> Err:
    """A ValueError or TypeError whose message holds every one of ``words``."""
    return Err((ValueError, TypeError), *words)


def E_any(*names: str) -> AnyErr:
    """A ValueError or TypeError naming any one of ``names``."""
    return AnyErr(*(E(n) for n in names))


def tmpdir() -> Path:
    d = tempfile.TemporaryDirectory(prefix="attnlab-fresh-")
    _TMP.append(d)
    return Path(d.name)


def _assert(cond, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


# ----------------------------------------------------------------------------------------- data loss

class DataLoss(Exception):
    """Raised by :func:`keeping` when a call changed a file it was given to read."""


class Keeps:
    """``expect`` for a call made by :func:`keeping`: ``data-loss`` when it changed a watched file."""

    def __init__(self, expect):
        self.expect = expect

    def judge(self, error, result):
        if isinstance(error, DataLoss):
            return "data-loss", str(error)
        return self.expect.judge(error, result)


def _digest(folder: Path) -> dict:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def keeping(folder: Path, fn):
    """``fn`` run with every file under ``folder`` watched: a change or a removal raises :class:`DataLoss`."""
    def run():
        before = _digest(folder)
        error = result = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 (re-raised below unless a file changed)
            error = e
        after = _digest(folder)
        changed = [n for n in before if after.get(n) != before[n]]
        if changed:
            raise DataLoss(f"changed or removed {changed[:3]}")
        if error is not None:
            raise error
        return result
    return run


def case(family: str, name: str, fn, expect) -> None:
    H.case(FAMILY_PREFIX + family, name, fn, expect)


# ------------------------------------------------------------------------------------- the oracle

def ref_attention(q, k, v, **kw):
    """The harness's float64 formula (:func:`test_hostile_api.oracle`: bottom-right causal alignment, rows that see
    nothing zero), with a query row that holds NaN giving a NaN row, as it must."""
    out = H.oracle(*(t.detach() for t in (q, k, v)), **kw)
    return out.masked_fill(torch.isnan(q.detach()).any(-1, keepdim=True), math.nan)


def qkv(B=2, Hq=4, Hkv=2, Lq=5, Lk=6, D=8, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
            for s in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))]


BACKENDS = ("auto", "reference", "sdpa", "short", "tiled", "flex")


def _attn(backend, q, k, v, **kw):
    import attnlab
    return attnlab.attention(q, k, v, backend=backend, **kw)


def computes(backend, q, k, v, *, dtype=torch.float32, **kw):
    """A valid request: the oracle's result, or the named backend declining by name."""
    want = ref_attention(q, k, v, **{n: kw[n] for n in ("mask", "causal", "window", "scale") if n in kw})
    ok = Ok(close(want, dtype=dtype))
    return ok if backend == "auto" else Either(ok, Err(ValueError, backend))


# ------------------------------------------------------------------------- family: attention(...)

def _attention_cases():
    F = "attention"
    for b in BACKENDS:
        q, k, v = qkv()
        run = (lambda b: lambda **kw: (lambda: _attn(b, q, k, v, **kw)))(b)
        # scale: any finite real is a valid κ; NaN / ±inf / non-numbers are refused by name
        for s in (0.0, -1.0, 1e-30, 3, 1e4):
            case(F, f"{b}: scale={s!r}", run(scale=s), computes(b, q, k, v, scale=s))
        for s in (math.nan, math.inf, -math.inf, "0.5", True, 1j, torch.tensor(0.5), [0.5], None.__class__):
            case(F, f"{b}: scale={s!r}", run(scale=s), E("scale"))
        for p in (-0.1, 1.0, 1.5, math.nan, math.inf, "0.1", True, None):
            case(F, f"{b}: dropout_p={p!r}", run(dropout_p=p), E("dropout_p"))
        for w in (0, -1, 2.5, True, "3", math.inf):
            case(F, f"{b}: window={w!r}", run(window=w), E("window"))
        for w in (1, 2, 6, 10**9):
            case(F, f"{b}: window={w}", run(window=w), computes(b, q, k, v, window=w))
            case(F, f"{b}: causal window={w}", run(window=w, causal=True), computes(b, q, k, v, window=w, causal=True))
        for t in (0, -1, 7, 2.0, True, "2"):
            case(F, f"{b}: topk top_k={t!r}", run(normalize="topk", top_k=t), E("top_k"))
        case(F, f"{b}: top_k without topk", run(top_k=2), E("top_k"))
        for n in ("Softmax", "", None, 3, "softmax ", ["softmax"]):
            case(F, f"{b}: normalize={n!r}", run(normalize=n), E("normalize"))
        for c in (1, "yes", None, torch.tensor(True)):
            case(F, f"{b}: causal={c!r}", run(causal=c), E("causal"))
        case(F, f"{b}: return_weights=1", run(return_weights=1), E("return_weights"))
        case(F, f"{b}: score_mod=3", run(score_mod=3), E("score_mod"))
        case(F, f"{b}: mask_mod='causal'", run(mask_mod="causal"), E("mask_mod"))
        case(F, f"{b}: score_mod of another shape", run(score_mod=lambda s, b_, h, i, j: s.sum()), E("score_mod"))
        case(F, f"{b}: mask_mod returning floats", run(mask_mod=lambda b_, h, i, j: (i >= j).float()), E("mask_mod"))
        case(F, f"{b}: mask_mod that raises", run(mask_mod=lambda b_, h, i, j: 1 / 0),
             Err(ZeroDivisionError, "division"))
        # masks: dtype, shape, values, device, broadcasting
        Lq, Lk = 5, 6
        case(F, f"{b}: int mask", run(mask=torch.ones(Lq, Lk, dtype=torch.int64)), E("mask"))
        case(F, f"{b}: uint8 mask", run(mask=torch.ones(Lq, Lk, dtype=torch.uint8)), E("mask"))
        case(F, f"{b}: complex mask", run(mask=torch.zeros(Lq, Lk, dtype=torch.complex64)), E("mask"))
        case(F, f"{b}: list mask", run(mask=[[True] * Lk] * Lq), E("mask"))
        case(F, f"{b}: numpy-like mask (nested tuple)", run(mask=((True,) * Lk,) * Lq), E("mask"))
        case(F, f"{b}: mask (Lk, Lq) transposed", run(mask=torch.ones(Lk, Lq, dtype=torch.bool)), E("mask"))
        case(F, f"{b}: mask (3, 1, Lq, Lk) wrong batch", run(mask=torch.ones(3, 1, Lq, Lk, dtype=torch.bool)),
             E("mask"))
        case(F, f"{b}: 5-D mask", run(mask=torch.ones(1, 1, 1, Lq, Lk, dtype=torch.bool)), E("mask"))
        case(F, f"{b}: float mask with NaN", run(mask=torch.zeros(Lq, Lk).index_fill_(1, torch.tensor([2]), math.nan)),
             E("mask", "nan"))
        case(F, f"{b}: float mask with +inf", run(mask=torch.full((Lq, Lk), math.inf)), E("mask"))
        case(F, f"{b}: meta mask", run(mask=torch.ones(Lq, Lk, dtype=torch.bool, device="meta")), E("mask"))
        for shape in ((Lk,), (Lq, 1), (1, 1, Lq, Lk), (2, 1, 1, Lk), (1, 4, Lq, Lk), ()):
            g = torch.Generator().manual_seed(len(shape))
            m = torch.rand(shape, generator=g) > 0.3
            case(F, f"{b}: bool mask {shape}", run(mask=m), computes(b, q, k, v, mask=m))
        fm = torch.randn(Lq, Lk, generator=torch.Generator().manual_seed(3)).double().float()
        case(F, f"{b}: float mask (Lq, Lk)", run(mask=fm), computes(b, q, k, v, mask=fm))
        fm64 = fm.double()
        case(F, f"{b}: float64 mask on float32 q", run(mask=fm64), computes(b, q, k, v, mask=fm64))
        ninf = torch.zeros(Lq, Lk)
        ninf[1] = -math.inf
        case(F, f"{b}: a row of -inf (empty row gives zeros)", run(mask=ninf), computes(b, q, k, v, mask=ninf))
        none = torch.zeros(Lq, Lk, dtype=torch.bool)
        case(F, f"{b}: all-False mask (every row empty)", run(mask=none), computes(b, q, k, v, mask=none))
        case(F, f"{b}: mask + causal", run(mask=fm, causal=True), computes(b, q, k, v, mask=fm, causal=True))
        # q, k, v themselves
        _tensor_cases(F, b)


def _tensor_cases(F: str, b: str) -> None:
    q, k, v = qkv()

    def call(q_, k_, v_, **kw):
        return lambda: _attn(b, q_, k_, v_, **kw)

    for dt in (torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8):
        case(F, f"{b}: q k v {dt}", call(q.to(dt), k.to(dt), v.to(dt)), E("q"))
    case(F, f"{b}: q float32, k float64", call(q, k.double(), v), E("dtype"))
    case(F, f"{b}: v bfloat16 alone", call(q, k, v.bfloat16()), E("dtype"))
    case(F, f"{b}: q 3-D", call(q[0], k, v), E("q"))
    case(F, f"{b}: k 5-D", call(q, k[None], v), E("k"))
    case(F, f"{b}: q a list", call(q.tolist(), k, v), E("q"))
    case(F, f"{b}: v None", call(q, k, None), E("v"))
    case(F, f"{b}: Hq=4, Hkv=3", call(*qkv(Hq=4, Hkv=3)), E("Hkv"))
    case(F, f"{b}: Hkv=0", call(q, k[:, :0], v[:, :0]), E("Hkv"))
    case(F, f"{b}: k and v heads differ", call(q, k, v[:, :1]), E("heads"))
    case(F, f"{b}: batch differs", call(q, k[:1], v[:1]), E("batch"))
    case(F, f"{b}: D differs", call(q, k[..., :4], v), E("head dim"))
    case(F, f"{b}: Lk=0", call(q, k[:, :, :0], v[:, :, :0]), E("Lk"))
    case(F, f"{b}: D=0", call(q[..., :0], k[..., :0], v), E("D"))
    case(F, f"{b}: k and v lengths differ", call(q, k, v[:, :, :3]), E("Lk"))
    case(F, f"{b}: meta q k v", call(q.to("meta"), k.to("meta"), v.to("meta")), E("meta"))
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        qq, kk, vv = (t.to(dt) for t in (q, k, v))
        case(F, f"{b}: {dt}", call(qq, kk, vv), computes(b, qq, kk, vv, dtype=dt))
        case(F, f"{b}: {dt} causal", call(qq, kk, vv, causal=True), computes(b, qq, kk, vv, dtype=dt, causal=True))
    # layouts: non-contiguous, expanded (zero strides), channels-last, sliced
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)
    case(F, f"{b}: q transposed storage", call(qt, k, v), computes(b, qt, k, v))
    ke = k[:, :, :1].expand(-1, -1, 6, -1)
    case(F, f"{b}: k expanded (zero stride)", call(q, ke, v), computes(b, q, ke, v))
    ve = torch.randn(1, 1, 1, 8).expand(2, 2, 6, 8)
    case(F, f"{b}: v broadcast from one row", call(q, k, ve), computes(b, q, k, ve))
    qc = q.contiguous(memory_format=torch.channels_last)
    case(F, f"{b}: q channels_last", call(qc, k, v), computes(b, qc, k, v))
    qs = torch.randn(2, 4, 10, 8)[:, :, ::2]
    case(F, f"{b}: q strided slice", call(qs, k, v), computes(b, qs, k, v))
    # non-square causal (bottom-right) and more queries than keys
    for Lq, Lk in ((1, 6), (6, 1), (9, 4), (4, 9)):
        a = qkv(Lq=Lq, Lk=Lk, seed=Lq * 10 + Lk)
        case(F, f"{b}: causal Lq={Lq} Lk={Lk}", call(*a, causal=True), computes(b, *a, causal=True))
    # Dv != D
    a = [*qkv()[:2], torch.randn(2, 2, 6, 3)]
    case(F, f"{b}: Dv=3, D=8", call(*a), computes(b, *a))
    # values that overflow the scores: big but finite inputs stay finite
    big = [t * (3 if i < 2 else 1e3) for i, t in enumerate(qkv(seed=7))]
    case(F, f"{b}: scores ~30, values ~1e3", call(*big), computes(b, *big))
    nan_q = q.clone()
    nan_q[0, 0, 0, 0] = math.nan
    case(F, f"{b}: one NaN in q (its row NaN, the others exact)", call(nan_q, k, v),
         Either(computes(b, nan_q, k, v), E_any("nan", "finite")))
    inf_k = k.clone()
    inf_k[1, 1, 2, 3] = math.inf
    case(F, f"{b}: one inf in k (the rows that see it NaN or exact, the others exact)", call(q, inf_k, v),
         Either(Ok(_inf_key_check(q, inf_k, v)), E_any("nan", "finite", "inf")) if b == "auto" else
         Either(Ok(_inf_key_check(q, inf_k, v)), AnyErr(Err(ValueError, b), E_any("nan", "finite", "inf"))))


def _inf_key_check(q, k, v):
    """An inf key reaches every query of its batch row and heads: those rows are NaN (as the kernels propagate it) or
    the float64 formula's; every other row is the formula's."""
    want = ref_attention(q, k, v)
    hit = torch.zeros(want.shape[:3], dtype=torch.bool)
    b, hkv = (int(i) for i in torch.isinf(k).nonzero()[0][:2])
    group = q.shape[1] // k.shape[1]
    hit[b, hkv * group:(hkv + 1) * group] = True

    def check(got):
        rows_nan = torch.isnan(got).all(-1)
        _assert(not (rows_nan & ~hit).any(), "NaN in a row the inf key does not reach")
        exact = ~rows_nan
        _assert(torch.allclose(got[exact], want[exact].float(), rtol=1e-5, atol=1e-5),
                "rows without NaN differ from the formula")
    return check


def _grad_cases():
    F = "grad"
    for b in ("auto", "reference", "sdpa", "short", "tiled"):
        for which in ("q", "k", "v", "qk", "qkv"):
            for causal in (False, True):
                def fn(b=b, which=which, causal=causal):
                    ts = [t.double().requires_grad_(n in which) for n, t in zip("qkv", qkv(seed=5))]
                    out = _attn(b, *ts, causal=causal)
                    out.square().sum().backward()
                    ref = [t.detach().clone().requires_grad_(True) for t in ts]
                    H.oracle(*ref, causal=causal).square().sum().backward()
                    return [(t.grad, r.grad) for t, r in zip(ts, ref)]

                def check(pairs, which=which):
                    for n, (g, r) in zip("qkv", pairs):
                        if n not in which:
                            _assert(g is None, f"{n} got a gradient it did not ask for")
                            continue
                        _assert(g is not None, f"{n}'s gradient is missing")
                        _assert(torch.allclose(g, r, rtol=1e-9, atol=1e-9), f"{n}'s gradient differs: "
                                f"{float((g - r).abs().max()):.3g}")
                case(F, f"{b}: grad of {which} causal={causal}", fn,
                     Ok(check) if b == "auto" else Either(Ok(check), Err(ValueError, b)))
    for b in ("auto", "reference", "tiled"):
        def penalty(b=b):
            q, k, v = (t.double().requires_grad_(True) for t in qkv(seed=9))
            out = _attn(b, q, k, v, causal=True)
            (g,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
            return g.square().sum()

        case(F, f"{b}: double backward (gradient penalty)", lambda p=penalty: p().requires_grad,
             Either(Ok(lambda r: _assert(r is True, "the penalty came back detached")), E("create_graph", "double")))


# -------------------------------------------------------------------------------- family: modules

def _module_cases():
    import attnlab
    from attnlab import (AdditiveAttention, KVCache, LinformerAttention, LocationAwareAttention, LuongAttention,
                         MonotonicAttention, MultiheadAttention, PerformerAttention)

    F = "modules"
    MHA = MultiheadAttention
    odd_ints = {0: "positive", -4: "positive", 2.0: None, True: None, "8": None, None: None, 2**62: None}
    for arg in ("embed_dim", "num_heads"):
        for val in odd_ints:
            kw = dict(embed_dim=8, num_heads=2)
            kw[arg] = val
            case(F, f"MultiheadAttention({arg}={val!r})",
                 lambda kw=kw: MHA(kw.pop("embed_dim"), kw.pop("num_heads"), **kw),
                 E(arg) if val != 2**62 else E_any(arg, "memory"))
    for arg in ("num_kv_heads", "kdim", "vdim", "head_dim", "window"):
        for val in (0, -1, 1.5, True, "4"):
            case(F, f"MultiheadAttention({arg}={val!r})", lambda arg=arg, val=val: MHA(8, 2, **{arg: val}), E(arg))
    case(F, "MultiheadAttention(embed_dim=10, num_heads=3)", lambda: MHA(10, 3), E("divisible"))
    case(F, "MultiheadAttention(num_kv_heads=3 of 4)", lambda: MHA(8, 4, num_kv_heads=3), E("num_kv_heads"))
    case(F, "MultiheadAttention(num_kv_heads=8 > 4 heads)", lambda: MHA(8, 4, num_kv_heads=8), E("num_kv_heads"))
    for val in (-0.1, 1.0, 2, math.nan, "0.1"):
        case(F, f"MultiheadAttention(dropout={val!r})", lambda val=val: MHA(8, 2, dropout=val), E("dropout"))
    for val in (0, -1.0, math.nan, math.inf, "1", True):
        case(F, f"MultiheadAttention(scale={val!r})", lambda val=val: MHA(8, 2, scale=val), E("scale"))
    for val in ("fast", "", None, "SDPA"):
        case(F, f"MultiheadAttention(backend={val!r})", lambda val=val: MHA(8, 2, backend=val), E("backend"))
    case(F, "MultiheadAttention(normalize='topk') without top_k", lambda: MHA(8, 2, normalize="topk"), E("top_k"))
    case(F, "MultiheadAttention(normalize='max')", lambda: MHA(8, 2, normalize="max"), E("normalize"))
    case(F, "MultiheadAttention(rotary=3)", lambda: MHA(8, 2, rotary=3), E("rotary"))
    case(F, "MultiheadAttention(rotary of another head_dim)",
         lambda: MHA(8, 2, rotary=attnlab.RotaryEmbedding(8)), E("rotary"))
    case(F, "MultiheadAttention(2**20, 1) (a 4 TB weight)", lambda: MHA(2**20, 1), E("memory"))
    case(F, "MultiheadAttention(8, 2, head_dim=2**30)", lambda: MHA(8, 2, head_dim=2**30), E("memory"))
    case(F, "MultiheadAttention(dtype=torch.int64)", lambda: MHA(8, 2, dtype=torch.int64), E("dtype"))
    case(F, "MultiheadAttention(device='nowhere')", lambda: MHA(8, 2, device="nowhere"), E("device"))
    # forward with odd inputs
    m = MHA(8, 2, num_kv_heads=1).eval()
    x = torch.randn(2, 5, 8)
    ok_shape = Ok(lambda r: _assert(r[0].shape == (2, 5, 8) and torch.isfinite(r[0]).all(), "bad output"))
    case(F, "forward: query 2-D (unbatched)", lambda: m(x[0]), AnyErr(E("query"), Err(ValueError, "(B, L, E)")))
    case(F, "forward: query width 7", lambda: m(torch.randn(2, 5, 7)), E("query"))
    case(F, "forward: query int", lambda: m(torch.ones(2, 5, 8, dtype=torch.long)), E("query"))
    case(F, "forward: query float64 into float32 weights", lambda: m(x.double()), E_any("dtype", "query"))
    case(F, "forward: key of another batch", lambda: m(x, torch.randn(3, 4, 8)), E_any("key", "batch"))
    case(F, "forward: key and value lengths differ", lambda: m(x, torch.randn(2, 4, 8), torch.randn(2, 3, 8)),
         E_any("value", "key"))
    case(F, "forward: key_padding_mask (B, L+1)", lambda: m(x, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool)),
         E("key_padding_mask"))
    case(F, "forward: key_padding_mask int 0/1", lambda: m(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.long)),
         Either(ok_shape, E("key_padding_mask")))
    case(F, "forward: key_padding_mask list", lambda: m(x, key_padding_mask=[[False] * 5] * 2), E("key_padding_mask"))
    case(F, "forward: attn_mask (5, 4)", lambda: m(x, attn_mask=torch.zeros(5, 4)), E("attn_mask"))
    case(F, "forward: attn_mask int", lambda: m(x, attn_mask=torch.zeros(5, 5, dtype=torch.int32)), E("mask"))
    case(F, "forward: attn_mask NaN", lambda: m(x, attn_mask=torch.full((5, 5), math.nan)), E("mask"))
    case(F, "forward: is_causal='yes'", lambda: m(x, is_causal="yes"), E("is_causal"))
    case(F, "forward: need_weights=None", lambda: m(x, need_weights=None), E("need_weights"))
    case(F, "forward: cache={}", lambda: m(x, cache={}), E("cache"))
    case(F, "forward: empty sequence", lambda: m(torch.randn(2, 0, 8)), Either(
        Ok(lambda r: _assert(r[0].shape == (2, 0, 8), "shape")), E("query")))
    case(F, "forward: all keys padded (rows give zeros)",
         lambda: m(x, key_padding_mask=torch.ones(2, 5, dtype=torch.bool), need_weights=True),
         Ok(lambda r: _assert(torch.isfinite(r[0]).all(), "NaN from an all-padded row")))
    case(F, "forward: query with inf", lambda: m(x.index_fill(1, torch.tensor([0]), math.inf)),
         Either(Ok(lambda r: _assert(not torch.isfinite(r[0]).all(), "inf vanished")), E("query")))
    case(F, "forward: value_embed of another shape", lambda: m(x, value_embed=torch.randn(2, 5, 3)),
         E("value_embed"))
    # KV cache misuse
    for kw in (dict(max_length=0), dict(max_length=-1), dict(window=0), dict(window=2.5), dict(static=1),
               dict(max_length=4, window=2), dict(static=True, window=3), dict(max_length="8")):
        case(F, f"KVCache({kw})", lambda kw=kw: KVCache(**kw), E(next(iter(kw)) if len(kw) == 1 else "window"))

    def cache_reused():
        c = KVCache()
        MHA(8, 2).eval()(x, cache=c)
        return MHA(16, 2).eval()(torch.randn(2, 1, 16), cache=c)
    case(F, "a KVCache reused by a module of another width", cache_reused, E_any("cache", "head"))

    def cache_other_batch():
        c = KVCache()
        m(x, cache=c)
        return m(torch.randn(3, 1, 8), cache=c)
    case(F, "a KVCache continued with another batch size", cache_other_batch, E_any("cache", "batch"))

    def static_overflow():
        c = KVCache(max_length=4, static=True)
        return m(x, cache=c)
    case(F, "a static KVCache(max_length=4) given 5 positions", static_overflow, E_any("max_length", "cache"))
    # classic attentions
    for cls, args in ((AdditiveAttention, (4, 4, 4)), (LocationAwareAttention, (4, 4, 4)),
                      (MonotonicAttention, (4, 4, 4)), (LuongAttention, (4, 4))):
        names = ["query_dim", "key_dim", "hidden_dim"][:len(args)]
        for i, name in enumerate(names):
            for val in (0, -3, 1.5, True, None):
                a = list(args)
                a[i] = val
                case(F, f"{cls.__name__}({name}={val!r})", lambda cls=cls, a=a: cls(*a), E(name))
        case(F, f"{cls.__name__}(2**40 wide)", lambda cls=cls, args=args: cls(2**40, *args[1:]),
             E_any("memory", "query_dim"))
    luong = LuongAttention(4, 4)
    case(F, "LuongAttention(mode='cosine')", lambda: LuongAttention(4, 4, mode="cosine"), E("mode"))
    case(F, "LuongAttention: keys of another width", lambda: luong(torch.randn(2, 4), torch.randn(2, 3, 5)),
         E("keys"))
    case(F, "LuongAttention: no keys", lambda: luong(torch.randn(2, 4), torch.randn(2, 0, 4)), E("keys"))
    add = AdditiveAttention(4, 4, 4)
    case(F, "AdditiveAttention: query of batch 3, keys of batch 2",
         lambda: add(torch.randn(3, 4), torch.randn(2, 3, 4)), E_any("query", "batch", "keys"))
    case(F, "AdditiveAttention: keys int", lambda: add(torch.randn(2, 4), torch.ones(2, 3, 4, dtype=torch.long)),
         E("keys"))
    for kw in (dict(num_features=0), dict(num_features=-2), dict(num_features=2.0), dict(feature_map="laplace"),
               dict(redraw_interval=0), dict(causal="yes")):
        case(F, f"PerformerAttention({kw})", lambda kw=kw: PerformerAttention(8, 2, **kw), E(next(iter(kw))))
    case(F, "PerformerAttention(8, 3)", lambda: PerformerAttention(8, 3), E_any("num_heads", "divisible"))
    for kw in (dict(seq_len=0), dict(seq_len=-5), dict(seq_len=8, k=0), dict(seq_len=8, k=-1),
               dict(seq_len=8, k=2.5), dict(seq_len=8, share_kv=1)):
        last = list(kw)[-1]
        case(F, f"LinformerAttention({kw})", lambda kw=kw: LinformerAttention(8, 2, **kw), E(last))
    lin = LinformerAttention(8, 2, seq_len=6, k=3)
    case(F, "LinformerAttention: sequence longer than seq_len", lambda: lin(torch.randn(2, 7, 8)),
         E_any("seq_len", "length"))
    case(F, "LinformerAttention: is_causal=True", lambda: lin(torch.randn(2, 6, 8), is_causal=True),
         E_any("is_causal", "causal"))
    perf = PerformerAttention(8, 2)
    case(F, "PerformerAttention: key_padding_mask of another length",
         lambda: perf(torch.randn(2, 5, 8), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
         E("key_padding_mask"))
    # positional encodings and mask mods
    pos = torch.arange(4)
    for label, fn, name in (
            ("alibi_slopes(0)", lambda: attnlab.alibi_slopes(0), "num_heads"),
            ("alibi_slopes(-2)", lambda: attnlab.alibi_slopes(-2), "num_heads"),
            ("alibi_slopes(2.0)", lambda: attnlab.alibi_slopes(2.0), "num_heads"),
            ("sinusoidal_table(-1, 8)", lambda: attnlab.sinusoidal_table(-1, 8), "num_positions"),
            ("sinusoidal_table(4, 0)", lambda: attnlab.sinusoidal_table(4, 0), "dim"),
            ("sinusoidal_table(4, 8, base=inf)", lambda: attnlab.sinusoidal_table(4, 8, base=math.inf), "base"),
            ("sinusoidal_table(4, 8, base=0)", lambda: attnlab.sinusoidal_table(4, 8, base=0.0), "base"),
            ("sinusoidal_table(4, 8, base=nan)", lambda: attnlab.sinusoidal_table(4, 8, base=math.nan), "base"),
            ("rope_frequencies(7, pos)", lambda: attnlab.rope_frequencies(7, pos), "head_dim"),
            ("rope_frequencies(8, [0, 1])", lambda: attnlab.rope_frequencies(8, [0, 1]), "positions"),
            ("rope_frequencies(8, float pos)", lambda: attnlab.rope_frequencies(8, pos.float() + 0.5),
             "positions"),
            ("rope_frequencies(base=0)", lambda: attnlab.rope_frequencies(8, pos, base=0.0), "base"),
            ("rope_frequencies(base=-1)", lambda: attnlab.rope_frequencies(8, pos, base=-1.0), "base"),
            ("rope_frequencies(base=nan)", lambda: attnlab.rope_frequencies(8, pos, base=math.nan), "base"),
            ("rope_frequencies(base=inf)", lambda: attnlab.rope_frequencies(8, pos, base=math.inf), "base"),
            ("rope_frequencies(base=1)", lambda: attnlab.rope_frequencies(8, pos, base=1.0), "base"),
            ("RotaryEmbedding(7)", lambda: attnlab.RotaryEmbedding(7), "head_dim"),
            ("RotaryEmbedding(0)", lambda: attnlab.RotaryEmbedding(0), "head_dim"),
            ("RotaryEmbedding(8, base=0)", lambda: attnlab.RotaryEmbedding(8, base=0.0), "base"),
            ("RotaryEmbedding(8, rotary_dim=16)", lambda: attnlab.RotaryEmbedding(8, rotary_dim=16), "rotary_dim"),
            ("RotaryEmbedding(8, rotary_dim=3)", lambda: attnlab.RotaryEmbedding(8, rotary_dim=3), "rotary_dim"),
            ("ALiBi(0)", lambda: attnlab.ALiBi(0), "num_heads"),
            ("ALiBi(causal='no')", lambda: attnlab.ALiBi(4, causal="no"), "causal"),
            ("T5RelativeBias(0)", lambda: attnlab.T5RelativeBias(0), "num_heads"),
            ("T5RelativeBias(num_buckets=0)", lambda: attnlab.T5RelativeBias(2, num_buckets=0), "num_buckets"),
            ("SinusoidalPositionalEmbedding(0)", lambda: attnlab.SinusoidalPositionalEmbedding(0), "dim"),
            ("LearnedPositionalEmbedding(-1, 8)", lambda: attnlab.LearnedPositionalEmbedding(-1, 8), "max_positions"),
            ("sliding_window_mod(0)", lambda: attnlab.sliding_window_mod(0), "window"),
            ("sliding_window_mod(-3)", lambda: attnlab.sliding_window_mod(-3), "window"),
            ("sliding_window_mod(2.5)", lambda: attnlab.sliding_window_mod(2.5), "window"),
            ("prefix_lm_mod(-1)", lambda: attnlab.prefix_lm_mod(-1), "prefix_len"),
            ("prefix_lm_mod('3')", lambda: attnlab.prefix_lm_mod("3"), "prefix_len"),
            ("softcap_score_mod(0)", lambda: attnlab.softcap_score_mod(0.0), "cap"),
            ("softcap_score_mod(-5)", lambda: attnlab.softcap_score_mod(-5.0), "cap"),
            ("softcap_score_mod(nan)", lambda: attnlab.softcap_score_mod(math.nan), "cap"),
            ("softcap_score_mod(inf)", lambda: attnlab.softcap_score_mod(math.inf), "cap"),
            ("strided_mod(0)", lambda: attnlab.strided_mod(0), "stride"),
            ("strided_mod(-2)", lambda: attnlab.strided_mod(-2), "stride"),
            ("document_mod([0, 0, 1]) (a list)", lambda: attnlab.document_mod([0, 0, 1]), "doc_ids"),
            ("document_mod(float ids)", lambda: attnlab.document_mod(torch.tensor([0.0, 1.0])), "doc_ids"),
            ("document_mod(3-D ids)", lambda: attnlab.document_mod(torch.zeros(1, 1, 3, dtype=torch.long)),
             "doc_ids"),
            ("and_masks(3)", lambda: attnlab.and_masks(3), "mods"),
            ("or_masks('causal')", lambda: attnlab.or_masks("causal"), "mods"),
            ("bigbird_mod(block=0)", lambda: attnlab.bigbird_mod(0, seq_len=16), "block"),
            ("bigbird_mod(seq_len=0)", lambda: attnlab.bigbird_mod(4, seq_len=0), "seq_len"),
            ("fixed_mod(0)", lambda: attnlab.fixed_mod(0), "block"),
            ("fixed_mod(4, num_summary=5)", lambda: attnlab.fixed_mod(4, num_summary=5), "num_summary")):
        case(F, f"positional/mods: {label}", fn, E(name))
    for n, d in ((0, 8), (4, 7), (3, 1)):  # documented: an empty table, an odd width (its last column a sine)
        case(F, f"sinusoidal_table({n}, {d}) follows the formula", lambda n=n, d=d: attnlab.sinusoidal_table(n, d),
             Ok(close(_sinusoids(n, d))))


# ---------------------------------------------------------------------------------- family: models

def _sinusoids(n: int, d: int):
    """Vaswani et al.'s table in float64: even columns sin(p / 10000^(2i/d)), odd columns the cosine."""
    p = torch.arange(n, dtype=torch.float64)[:, None]
    col = torch.arange(d)
    angle = p / 10000 ** ((col - col % 2) / d)
    return torch.where(col % 2 == 0, angle.sin(), angle.cos()).float()


def gpt2(**kw):
    import attnlab
    base = dict(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return attnlab.GPT2LMHeadModel(attnlab.GPT2Config(**{**base, **kw})).eval()


def llama(**kw):
    import attnlab
    base = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16)
    return attnlab.LlamaForCausalLM(attnlab.LlamaConfig(**{**base, **kw})).eval()


def _model_cases():
    import attnlab

    F = "models"
    odd = (0, -1, 2.5, True, "16", None, 2**40)
    for field in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        for val in odd:
            case(F, f"GPT2Config({field}={val!r})", lambda f=field, v=val: gpt2(**{f: v}), E_any(f"{field}", "memory"))
    for field in ("layer_norm_epsilon",):
        for val in (0.0, -1e-5, math.nan, math.inf, "1e-5"):
            case(F, f"GPT2Config({field}={val!r})", lambda f=field, v=val: gpt2(**{f: v}), E(field))
    for field in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
        for val in (-0.1, 1.0, math.nan):
            case(F, f"GPT2Config({field}={val!r})", lambda f=field, v=val: gpt2(**{f: v}), E(field))
    for val in ("relu6", "", None):
        case(F, f"GPT2Config(activation={val!r})", lambda v=val: gpt2(activation=v), E("activation"))
    case(F, "GPT2Config(n_embd=18, n_head=4)", lambda: gpt2(n_embd=18, n_head=4), E("n_head"))
    case(F, "GPT2Config(n_inner=0)", lambda: gpt2(n_inner=0), E("n_inner"))
    lfields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")
    for field in lfields:
        for val in (0, -2, 3.0, False, "8", 2**41):
            case(F, f"LlamaConfig({field}={val!r})", lambda f=field, v=val: llama(**{f: v}), E_any(field, "memory"))
    for val in (0, 3, -2, 8, 1.0):
        case(F, f"LlamaConfig(num_key_value_heads={val!r}) of 4 heads",
             lambda v=val: llama(num_key_value_heads=v), E("num_key_value_heads"))
    for val in (0.0, -1.0, 1.0, math.nan, math.inf, "1e4", 0.5):
        case(F, f"LlamaConfig(rope_theta={val!r})", lambda v=val: llama(rope_theta=v), E("rope_theta"))
    for val in (0.0, -1e-6, math.nan, math.inf):
        case(F, f"LlamaConfig(rms_norm_eps={val!r})", lambda v=val: llama(rms_norm_eps=v), E("rms_norm_eps"))
    for val in (0.0, -30.0, math.inf, math.nan):
        case(F, f"LlamaConfig(final_logit_softcapping={val!r})",
             lambda v=val: llama(final_logit_softcapping=v), E("final_logit_softcapping"))
    case(F, "LlamaConfig(hidden_size=12, heads=4) (odd head size)", lambda: llama(hidden_size=12), E("hidden_size"))
    case(F, "LlamaConfig(tie_word_embeddings='yes')", lambda: llama(tie_word_embeddings="yes"),
         E("tie_word_embeddings"))
    case(F, "LlamaConfig(rope_scaling={'type': 'linear'})", lambda: llama(rope_scaling={"type": "linear"}),
         E("rope_scaling"))
    case(F, "LlamaConfig(hidden_act='gelu')", lambda: llama(hidden_act="gelu"), E("hidden_act"))
    for val in (-0.5, 1.0, math.nan):
        case(F, f"LlamaConfig(hidden_dropout={val!r})", lambda v=val: llama(hidden_dropout=v), E("hidden_dropout"))
    # TransformerConfig
    T = attnlab.TransformerConfig
    for field, vals in (("src_vocab_size", (0, -1, 1.5)), ("dim", (0, 6.0)), ("num_heads", (0, 3, -1)),
                        ("ffn_dim", (0,)), ("num_encoder_layers", (0, -1)), ("num_decoder_layers", (0,)),
                        ("max_positions", (0,)), ("dropout", (1.0, -0.1, math.nan)),
                        ("attn_dropout", (1.5,)), ("drop_path", (1.0,)), ("activation", ("tanh2",)),
                        ("norm", ("batchnorm",)), ("position", ("rotary", None)),
                        ("norm_eps", (0.0, -1.0, math.nan, math.inf)),
                        ("pad_id", (-1, 100, 1.0)), ("backend", ("cuda",)), ("num_kv_heads", (3, 0)),
                        ("tie_embeddings", (1,)), ("norm_first", ("no",))):
        for val in vals:
            kw = dict(src_vocab_size=32, dim=16, num_heads=2, ffn_dim=32, num_encoder_layers=1,
                      num_decoder_layers=1, max_positions=16)
            kw[field] = val
            word = "num_heads" if (field == "num_heads" and val == 3) else field
            case(F, f"TransformerConfig({field}={val!r})", lambda kw=kw: T(**kw), E_any(word, "dim"))
    # Bert
    for field, vals in (("vocab_size", (0, -3)), ("hidden_size", (15,)), ("num_attention_heads", (0, 3)),
                        ("type_vocab_size", (0, -1)), ("layer_norm_eps", (0.0, math.nan)),
                        ("hidden_dropout_prob", (1.0,)), ("attention_probs_dropout_prob", (-0.1,)),
                        ("pad_token_id", (-1, 64, 1.5)), ("max_position_embeddings", (0,)),
                        ("hidden_act", ("swish2",))):
        for val in vals:
            kw = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=16)
            kw[field] = val
            case(F, f"BertConfig({field}={val!r})", lambda kw=kw: attnlab.BertModel(attnlab.BertConfig(**kw)),
                 E_any(field, "num_attention_heads"))
    # forward with odd inputs
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        m = make()
        limit = 16 if name == "gpt2" else None
        V = 40
        for ids, why in ((torch.tensor([[1, 2, V]]), "id == vocab"), (torch.tensor([[-1, 2]]), "negative id"),
                         (torch.tensor([[1.0, 2.0]]), "float ids"), (torch.tensor([1, 2, 3]), "1-D ids"),
                         (torch.zeros(1, 0, dtype=torch.long), "empty"),
                         (torch.tensor([[True, False]]), "bool ids"), ([[1, 2, 3]], "a list"),
                         (torch.zeros(0, 3, dtype=torch.long), "batch 0")):
            case(F, f"{name}: forward on {why}", lambda m=m, ids=ids: m(ids), E("input_ids"))
        long = torch.zeros(1, 17, dtype=torch.long)
        case(F, f"{name}: 17 positions", lambda m=m: m(long),
             E("input_ids") if limit else Ok(lambda r: _assert(r.logits.shape == (1, 17, 40), "shape")))
        ids = torch.tensor([[1, 2, 3, 4]])
        case(F, f"{name}: attention_mask of 2s", lambda m=m: m(ids, attention_mask=torch.full((1, 4), 2)),
             E("attention_mask"))
        case(F, f"{name}: attention_mask (1, 3)", lambda m=m: m(ids, attention_mask=torch.ones(1, 3, dtype=torch.long)),
             E("attention_mask"))
        case(F, f"{name}: attention_mask float 0.5", lambda m=m: m(ids, attention_mask=torch.full((1, 4), 0.5)),
             E("attention_mask"))
        case(F, f"{name}: attention_mask a list", lambda m=m: m(ids, attention_mask=[[1, 1, 1, 1]]),
             E("attention_mask"))
        case(F, f"{name}: int32 ids equal int64 ids", lambda m=m: (m(ids.int()).logits, m(ids).logits),
             Ok(lambda r: _assert(torch.equal(r[0], r[1]), "int32 ids give other logits")))
        case(F, f"{name}: fully padded row is refused or finite",
             lambda m=m: m(torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.tensor([[1, 1], [0, 0]])),
             Either(Ok(lambda r: _assert(torch.isfinite(r.logits[0]).all(), "row 0 spoiled")), E("attention_mask")))
        case(F, f"{name}: batch rows independent (a NaN-free row next to a long one)",
             lambda m=m: (m(torch.tensor([[0, 0, 5, 6]]), attention_mask=torch.tensor([[0, 0, 1, 1]])).logits[0, -1],
                          m(torch.tensor([[5, 6]])).logits[0, -1]),
             Ok(lambda r: _assert(torch.allclose(r[0], r[1], atol=1e-5), "left padding changed the logits")))


# -------------------------------------------------------------------------------- family: generate

def _generate_cases():
    import attnlab
    from attnlab import GenerationConfig, generate

    F = "generate"
    m = gpt2()
    ids = torch.tensor([[1, 2, 3]])

    def gen(**kw):
        return lambda: generate(m, ids, **{"max_new_tokens": 3, **kw})
    new_len = Ok(lambda r: _assert(r.shape[0] == 1 and 4 <= r.shape[1] <= 6 and torch.equal(r[:, :3], ids),
                                   f"shape {tuple(r.shape)}"))
    for val in (0, -1, 1.5, True, "3", None, 10**12, math.nan):
        case(F, f"max_new_tokens={val!r}", gen(max_new_tokens=val), E("max_new_tokens"))
    case(F, "max_new_tokens=14 (fills n_positions exactly)", gen(max_new_tokens=13),
         Ok(lambda r: _assert(r.shape == (1, 16), f"shape {tuple(r.shape)}")))
    case(F, "max_new_tokens=14 past n_positions", gen(max_new_tokens=14), E("max_new_tokens"))
    for val in (0, -1, 0.0, math.nan, math.inf, -math.inf, "1", True, 1e-30):
        expect = E("temperature")
        if val == 1e-30:
            expect = Either(new_len, E("temperature"))
        case(F, f"do_sample temperature={val!r}", gen(do_sample=True, temperature=val), expect)
    for val in (0, -1, 1.5, True, "5"):
        case(F, f"top_k={val!r}", gen(do_sample=True, top_k=val), E("top_k"))
    for val in (1, 40, 10**9):
        case(F, f"top_k={val} (1, vocab, huge)", gen(do_sample=True, top_k=val), new_len)
    for val in (0, 0.0, -0.1, 1.5, math.nan, math.inf, "0.9", True):
        case(F, f"top_p={val!r}", gen(do_sample=True, top_p=val), E("top_p"))
    for val in (1.0, 1e-9):
        case(F, f"top_p={val}", gen(do_sample=True, top_p=val), new_len)
    for val in (0, -2, 1.5, 10**6, True):
        case(F, f"num_beams={val!r}", gen(num_beams=val), E("num_beams"))
    case(F, "num_beams=2 with do_sample", gen(num_beams=2, do_sample=True), E("num_beams"))
    for val in (math.nan, math.inf, "1", None):
        case(F, f"length_penalty={val!r}", gen(num_beams=2, length_penalty=val), E("length_penalty"))
    for val in ([2, 3], torch.tensor(2), "</s>", -1, 40, 2.0, True):
        case(F, f"eos_token_id={val!r}", gen(eos_token_id=val), E("eos_token_id"))
    for val in (-5, 40, "0"):
        case(F, f"pad_token_id={val!r}", gen(pad_token_id=val), E("pad_token_id"))
    case(F, "decoder_start_token_id on a decoder", gen(decoder_start_token_id=0), E("decoder_start_token_id"))
    for val in ("Static", "paged", None, 1):
        case(F, f"cache={val!r}", gen(cache=val), E("cache"))
    case(F, "cache='window' on a model without a window", gen(cache="window"), E("window"))
    for kw in (dict(repetition_penalty=1.2), dict(stop_strings=["\n"]), dict(min_length=2), dict(max_length=5),
               dict(no_repeat_ngram_size=2), dict(num_return_sequences=2), dict(typical_p=0.5)):
        case(F, f"an unknown keyword {kw}", gen(**kw), Err(TypeError, next(iter(kw))))
    case(F, "generator=42", gen(do_sample=True, generator=42), E("generator"))
    case(F, "streamer=print's string", gen(streamer="print"), E("streamer"))
    seen = []
    case(F, "streamer=list.append sees every new token", lambda: (gen(streamer=seen.append)(), seen),
         Ok(lambda r: _assert(len(r[1]) == r[0].shape[1] - 3, f"{len(r[1])} streamed of {r[0].shape[1] - 3}")))
    case(F, "streamer that raises", gen(streamer=lambda t: 1 / 0), Err(ZeroDivisionError, "division"))
    case(F, "streamer with beams", gen(num_beams=2, streamer=print), E("streamer"))
    case(F, "config=dict", lambda: generate(m, ids, config={"max_new_tokens": 2}), E("config"))
    case(F, "no max_new_tokens at all", lambda: generate(m, ids), E("max_new_tokens"))
    case(F, "config and keyword: keyword wins",
         lambda: generate(m, ids, config=GenerationConfig(max_new_tokens=8), max_new_tokens=2),
         Ok(lambda r: _assert(r.shape[1] == 5, f"length {r.shape[1]}")))
    # the prompt and its mask
    for bad, why in ((torch.tensor([1, 2, 3]), "1-D prompt"), (torch.tensor([[1.0, 2.0]]), "float prompt"),
                     (torch.zeros(1, 0, dtype=torch.long), "empty prompt"), ([[1, 2, 3]], "list prompt"),
                     (torch.tensor([[1, 40]]), "id == vocab"), (torch.tensor([[-3, 1]]), "negative id"),
                     (torch.zeros(1, 16, dtype=torch.long), "prompt fills the context"),
                     (torch.zeros(1, 30, dtype=torch.long), "prompt longer than the context")):
        case(F, f"input_ids: {why}", lambda bad=bad: generate(m, bad, max_new_tokens=1), E_any("input_ids", "prompt"))
    for mask, why in ((torch.zeros(1, 3, dtype=torch.long), "all zeros"),
                      (torch.tensor([[1, 1, 0]]), "right padding"), (torch.ones(1, 4, dtype=torch.long), "(1, 4)"),
                      (torch.tensor([[2, 2, 2]]), "values 2"), ([[1, 1, 1]], "a list"),
                      (torch.ones(3, dtype=torch.long), "1-D"), ("all", "a string")):
        case(F, f"attention_mask: {why}", lambda mask=mask: generate(m, ids, attention_mask=mask, max_new_tokens=2),
             E("attention_mask"))
    left = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    lmask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    case(F, "left padding equals the unpadded row",
         lambda: (generate(m, left, attention_mask=lmask, max_new_tokens=4)[0, 4:],
                  generate(m, torch.tensor([[5, 6]]), max_new_tokens=4)[0, 2:]),
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), f"{r[0].tolist()} != {r[1].tolist()}")))
    case(F, "attention_mask given as bool",
         lambda: (generate(m, left, attention_mask=lmask.bool(), max_new_tokens=3),
                  generate(m, left, attention_mask=lmask, max_new_tokens=3)),
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), "a bool mask decodes otherwise")))
    # the model
    case(F, "model=None", lambda: generate(None, ids, max_new_tokens=2), E("generate"))
    case(F, "model in training mode equals eval (dropout off?)",
         lambda: generate(gpt2(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0).train(), ids, max_new_tokens=3),
         Either(new_len, E("eval")))
    bert = attnlab.BertModel(attnlab.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32,
                                                max_position_embeddings=16))
    case(F, "a BertModel", lambda: generate(bert, ids, max_new_tokens=2), E("generate"))
    ll = llama()
    case(F, "llama: cache='static' equals dynamic",
         lambda: (generate(ll, ids, max_new_tokens=5, cache="static"), generate(ll, ids, max_new_tokens=5)),
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), "static cache decodes otherwise")))
    case(F, "llama (RoPE, no position table): cache='crop' refused by name",
         lambda: generate(ll, ids, max_new_tokens=20, cache="crop"), E("crop"))
    case(F, "gpt2: cache='crop' past the context",
         lambda: generate(m, ids, max_new_tokens=20, cache="crop"),
         Ok(lambda r: _assert(r.shape == (1, 23), f"shape {tuple(r.shape)}")))
    case(F, "gpt2: cache='crop' with beams", lambda: generate(m, ids, max_new_tokens=2, cache="crop", num_beams=2),
         E("num_beams"))
    case(F, "gpt2: crop with a padded prompt",
         lambda: generate(m, left, attention_mask=lmask, max_new_tokens=2, cache="crop"), E("crop"))
    for kw in (dict(), dict(do_sample=True), dict(num_beams=2)):
        case(F, f"a NaN logit row: refused by name, never a token ({kw})", lambda kw=kw: _nan_generate(**kw),
             E("nan"))
    # GenerationConfig directly
    for kw in (dict(max_new_tokens=0), dict(max_new_tokens=2, top_p=2), dict(max_new_tokens=2, num_beams=0),
               dict(max_new_tokens=2, temperature=-1), dict(max_new_tokens=2, eos_token_id=-1),
               dict(max_new_tokens=2, cache="ring"), dict(max_new_tokens=2, do_sample="no")):
        case(F, f"GenerationConfig({kw})", lambda kw=kw: GenerationConfig(**kw), E(list(kw)[-1]))
    case(F, "GenerationConfig(max_length=5)", lambda: GenerationConfig(max_new_tokens=2, max_length=5),
         Err(TypeError, "max_length"))
    # drawn sampling settings compared for reproducibility
    case(F, "seeded sampling twice gives the same tokens",
         lambda: [generate(m, ids, max_new_tokens=6, do_sample=True, top_k=5, top_p=0.9, temperature=0.7,
                           generator=torch.Generator().manual_seed(3)) for _ in range(2)],
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), "a seeded generator gave two answers")))
    case(F, "top_k=1 sampling equals greedy",
         lambda: (generate(m, ids, max_new_tokens=6, do_sample=True, top_k=1), generate(m, ids, max_new_tokens=6)),
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), "top_k=1 is not greedy")))


def _nan_generate(**kw):
    import attnlab
    m = gpt2()
    with torch.no_grad():
        m.lm_head.weight[3] = math.nan
    return attnlab.generate(m, torch.tensor([[1, 2]]), max_new_tokens=2, **kw)


# ----------------------------------------------------------------------------------- family: adapt

def _adapt_cases():
    from attnlab.adapt import apply_lora, merge_lora, quantize, unload_lora

    F = "adapt"
    for val in (0, -1, 1.5, True, "4", None, 17):
        case(F, f"apply_lora(r={val!r})", lambda v=val: apply_lora(gpt2(), r=v, alpha=8), E("r"))
    for val in (0, -1.0, math.nan, math.inf, "8", None):
        case(F, f"apply_lora(alpha={val!r})", lambda v=val: apply_lora(gpt2(), r=2, alpha=v), E("alpha"))
    for val in (-0.1, 1.0, math.nan):
        case(F, f"apply_lora(dropout={val!r})", lambda v=val: apply_lora(gpt2(), r=2, alpha=4, dropout=v),
             E("dropout"))
    for targets, why in ((["nothing_here"], "a name matching nothing"), ([], "no target"), ([3], "an int target"),
                         (["*.c_attn", "*.q_proj"], "packed and its slice"), ("*", "everything (glob)")):
        exp = E("target") if why != "everything (glob)" else Either(
            Ok(lambda r: _assert(any(p.requires_grad for p in r.parameters()), "nothing trainable")), E("target"))
        case(F, f"apply_lora(targets={targets!r}) {why}", lambda t=targets: apply_lora(gpt2(), r=2, alpha=4, targets=t),
             exp)
    case(F, "apply_lora twice", lambda: apply_lora(apply_lora(gpt2(), r=2, alpha=4), r=2, alpha=4), E("LoRA"))
    case(F, "apply_lora on a tensor", lambda: apply_lora(torch.zeros(3), r=2, alpha=4), E("model"))
    case(F, "merge_lora on a model without LoRA", lambda: merge_lora(gpt2()), E("LoRA"))

    def lora_then_merge():
        m = gpt2()
        ids = torch.tensor([[1, 2, 3]])
        apply_lora(m, r=2, alpha=4)
        for p in m.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p)
        before = m(ids).logits
        return before, unload_lora(m, merge=True)(ids).logits
    case(F, "LoRA logits equal the merged model's", lora_then_merge,
         Ok(lambda r: _assert(float((r[0] - r[1]).norm() / r[0].norm()) < 1e-5, "merging changed the logits")))
    for mode in ("int2", "INT8", "", None, "fp8", 8):
        case(F, f"quantize(mode={mode!r})", lambda mo=mode: quantize(gpt2(), mo), E("mode"))
    for g in (0, -32, 33, 48, 1.5, "64", True):
        case(F, f"quantize int4 group_size={g!r}", lambda g=g: quantize(gpt2(), "int4", group_size=g), E("group_size"))
    case(F, "quantize int4 a 16-wide model (no group of 32 fits)", lambda: quantize(gpt2(), "int4"),
         E_any("exclude", "32"))
    for dt in (torch.int8, "bfloat16", torch.float64):
        case(F, f"quantize int8-weight compute_dtype={dt!r}",
             lambda dt=dt: quantize(gpt2(n_embd=32), "int8-weight", compute_dtype=dt), E("compute_dtype"))
    case(F, "quantize a LoRA model", lambda: quantize(apply_lora(gpt2(), r=2, alpha=4), "int8"), E("LoRA"))

    def twice(first, second):
        q = quantize(gpt2(n_embd=64, n_head=2), first)
        return quantize(q, second)
    for a, b in (("int8", "int8"), ("int8", "int4"), ("int4", "int8"), ("int8-weight", "int4")):
        case(F, f"quantize {a} then {b}", lambda a=a, b=b: twice(a, b),
             Either(Ok(lambda r: None) if a == b else Ok(lambda r, a=a, b=b: _assert(False, f"{b} silently kept {a}")),
                    E_any("quantis", "quantiz", "already")))
    case(F, "quantize a model with a NaN weight", lambda: quantize(_with_nan(gpt2()), "int8"), E("nan"))
    case(F, "quantize a float64 model to int8", lambda: quantize(gpt2().double(), "int8"), E("dtype"))
    case(F, "quantize a tensor", lambda: quantize(torch.zeros(4), "int8"), E("model"))
    case(F, "quantize exclude=5", lambda: quantize(gpt2(), "int8", exclude=5), E("exclude"))

    def train_quantized():
        q = quantize(gpt2(n_embd=32), "int8")
        q.train()
        q(torch.tensor([[1, 2, 3]])).logits.logsumexp(-1).sum().backward()
        return [p for p in q.parameters() if p.grad is not None]
    case(F, "quantize then train: a loss with no gradient path is refused or trains the floats left",
         train_quantized, Either(Ok(lambda r: None), E_any("quantiz", "train", "grad")))
    case(F, "quantized model keeps logits close (int8-weight)",
         lambda: _quantized_close(), Ok(lambda r: _assert(r < 0.1, f"relative error {r:.3g}")))


def _with_nan(m):
    with torch.no_grad():
        next(p for p in m.parameters() if p.dim() == 2).view(-1)[0] = math.nan
    return m


def _quantized_close():
    from attnlab.adapt import quantize
    m = gpt2(n_embd=64, n_head=2)
    ids = torch.tensor([[1, 2, 3, 4]])
    a = m(ids).logits
    b = quantize(m, "int8-weight", compute_dtype=torch.float32)(ids).logits
    return float((a - b).norm() / a.norm())


# ------------------------------------------------------------------------------------ family: text

def _text_cases():
    from attnlab.data.tokenizers import CharTokenizer, load_tokenizer
    from attnlab.evaluation.metrics import accuracy, bleu, chrf, perplexity, rouge

    F = "text"
    tok = CharTokenizer.from_text("abc xyz\n")
    for text, why in (("", "empty text"), ("\x00", "a NUL"), ("\ud800", "a lone surrogate"),
                      ("é", "outside the vocabulary"),
                      ("a" * 1_000_000 + "!", "1 MB then an unknown char")):
        exp = Ok(lambda r: _assert(r == [], "empty text")) if text == "" else E("character")
        case(F, f"CharTokenizer.encode: {why}", lambda t=text: tok.encode(t), exp)
    for text in (b"abc", None, 3, ["a"]):
        case(F, f"CharTokenizer.encode({type(text).__name__})", lambda t=text: tok.encode(t), E("text"))
    case(F, "CharTokenizer.encode of 1 MB 'a'", lambda: tok.encode_tensor("a" * 1_000_000),
         Ok(lambda r: _assert(r.shape == (1_000_000,) and int(r.max()) == tok.encode("a")[0], "wrong ids")))
    for ids, why in (([0, 99], "id 99"), ([-1], "id -1"), ([1.5], "float id"), (torch.tensor([[0, 1]]), "2-D tensor"),
                     ("ab", "a string"), ([True], "a bool")):
        case(F, f"CharTokenizer.decode: {why}", lambda ids=ids: tok.decode(ids), E_any("ids", "id"))
    for chars, why in (([], "empty"), (["a", "a"], "repeated"), (["ab"], "two letters"), ([1], "an int"),
                       ("", "empty string")):
        case(F, f"CharTokenizer({why})", lambda c=chars: CharTokenizer(c), E("chars"))
    for text, why in (("", "empty"), (None, "None"), (b"ab", "bytes")):
        case(F, f"CharTokenizer.from_text({why})", lambda t=text: CharTokenizer.from_text(t), E("text"))
    weird = "\u202eabc\u202c a\u0301\u0301 \ufeff \x85 \u2028 \U0001F600 \x00"
    case(F, "CharTokenizer round-trips RTL, combining, BOM, NEL, emoji, NUL",
         lambda: (lambda t: t.decode(t.encode(weird)))(CharTokenizer.from_text(weird)),
         Ok(lambda r: _assert(r == weird, "round trip lost characters")))
    d = tmpdir()
    (d / "tok_dir").mkdir()
    (d / "empty.json").write_text("")
    (d / "nan.json").write_text('{"type": "char", "chars": NaN}')
    (d / "dup.json").write_text('{"type": "char", "chars": ["a"], "chars": ["b", "c"]}')
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "list.json").write_text('["a", "b"]')
    (d / "bad_utf8.json").write_bytes(b'{"type": "char", "chars": ["\xff"]}')
    (d / "chars_int.json").write_text('{"type": "char", "chars": [1, 2]}')
    (d / "chars_dup.json").write_text('{"type": "char", "chars": ["a", "a"]}')
    (d / "bom.json").write_bytes(b'\xef\xbb\xbf{"type": "char", "chars": ["a", "b"]}')
    (d / "huge.json").write_bytes(b'{"type": "char", "chars": ["a"]}')
    os.truncate(d / "huge.json", 300 << 20)  # past the 256 MB cap of a tokenizer file (sparse: no disk used)
    os.symlink(d / "loop_a", d / "loop_b")
    os.symlink(d / "loop_b", d / "loop_a")
    os.mkfifo(d / "fifo.json")
    for name in ("tok_dir", "empty.json", "nan.json", "dup.json", "deep.json", "list.json", "bad_utf8.json",
                 "chars_int.json", "chars_dup.json", "loop_a", "fifo.json", "missing.json", "huge.json"):
        exp = AnyErr(E("tokenizer"), Err(FileNotFoundError, name.split(".")[0]), E(name.split(".")[0]))
        case(F, f"load_tokenizer({name})", keeping(d, lambda n=name: load_tokenizer(d / n)), Keeps(exp))
    case(F, "load_tokenizer of a BOM-led file", lambda: load_tokenizer(d / "bom.json"),
         Either(Ok(lambda r: _assert(r.chars == ["a", "b"], "chars")), E("tokenizer")))
    case(F, "CharTokenizer.save over a directory", keeping(d, lambda: tok.save(d / "tok_dir")),
         Keeps(AnyErr(E("path"), Err(IsADirectoryError, "tok_dir"), Err(OSError, "tok_dir"))))
    # metrics
    for fn_name, fn in (("bleu", bleu), ("chrf", chrf), ("rouge", rouge)):
        for hyps, refs, why, word in (([], [], "empty lists", "hyps"), (["a b"], [], "one hyp, no refs", "refs"),
                                      (["a", "b"], ["a"], "2 hyps, 1 ref", "refs"), (None, ["a"], "hyps None", "hyps"),
                                      (["a"], None, "refs None", "refs"), ("a b", ["a b"], "hyps a string", "hyps"),
                                      ([b"a b"], ["a b"], "bytes hyp", "hyps"),
                                      (["a b"], [b"a b"], "bytes ref", "refs"),
                                      ([None], ["a"], "a None hyp", "hyps"), ([1], ["1"], "an int hyp", "hyps"),
                                      (["a"], [["a", "b"], ["c"]], "ragged reference lists", "refs"),
                                      (["a"], [[]], "an empty reference list", "refs"),
                                      (["x" * 200_000], ["x"], "a 200k-char line", "hypothesis"),
                                      ((h for h in ["a"]), ["a"], "a generator of hyps", "hyps")):
            case(F, f"{fn_name}: {why}", lambda fn=fn, h=hyps, r=refs: fn(h, r), E(word))
        case(F, f"{fn_name}: identical texts score the maximum",
             lambda fn=fn: fn(["the cat sat on the mat"], ["the cat sat on the mat"]),
             Ok(lambda r: _assert(abs(r["rougeL"] - 1) < 1e-12 if isinstance(r, dict) else abs(r.score - 100) < 1e-9,
                                  f"{r}")))
        case(F, f"{fn_name}: empty strings", lambda fn=fn: fn([""], [""]),
             Ok(lambda r: _assert(all(math.isfinite(x) for x in (r.values() if isinstance(r, dict) else [r.score])),
                                  "NaN score")))
        odd = ["\ufeffhello world", "a\x85b \u2028 c\x0cd", "\u202eabc"]
        plain = ["hello world", "a b c d", "abc"]
        if fn_name == "rouge":
            case(F, "rouge: BOM, NEL, U+2028, RTL marks do not change ROUGE's tokens",
                 lambda: (rouge(odd, plain), rouge(plain, plain)), Ok(lambda r: _assert(r[0] == r[1], f"{r}")))
        else:
            import sacrebleu
            own = sacrebleu.corpus_bleu if fn_name == "bleu" else sacrebleu.corpus_chrf
            case(F, f"{fn_name}: BOM, NEL, U+2028, RTL marks score as sacreBLEU scores them",
                 lambda fn=fn, own=own: (fn(odd, plain).score, own(odd, [plain]).score),
                 Ok(lambda r: _assert(r[0] == r[1], f"{r[0]} vs sacreBLEU's {r[1]}")))
    for opt in (dict(max_ngram_order=0), dict(max_ngram_order=-1), dict(max_ngram_order=10**6), dict(tokenize="nope"),
                dict(smooth_method="best")):
        case(F, f"bleu(**{opt})", lambda o=opt: bleu(["a b c"], ["a b c"], **o),
             AnyErr(E(list(opt)[0]), Err(ValueError, "")) if False else E(list(opt)[0]))
    for opt in (dict(char_order=0), dict(word_order=-1), dict(beta=-1), dict(char_order=10**6)):
        case(F, f"chrf(**{opt})", lambda o=opt: chrf(["a b c"], ["a b c"], **o), E(list(opt)[0]))
    case(F, "rouge: use_stemmer='yes'", lambda: rouge(["a"], ["a"], use_stemmer="yes"), E("use_stemmer"))
    for val, why in ((math.nan, "NaN"), (-1.0, "negative"), ("2", "a string"),
                     (torch.tensor([1.0, 2.0]), "a 2-element tensor"),
                     (None, "None"), (True, "a bool"), (torch.tensor(math.nan), "a NaN tensor")):
        case(F, f"perplexity({why})", lambda v=val: perplexity(v), E("mean_nll"))
    for val in (math.inf, 1e6, 709.5):
        case(F, f"perplexity({val}) is inf", lambda v=val: perplexity(v), Ok(lambda r: _assert(r == math.inf, f"{r}")))
    case(F, "perplexity(tensor(2.0))", lambda: perplexity(torch.tensor(2.0)),
         Ok(lambda r: _assert(abs(r - math.exp(2)) < 1e-12, f"{r}")))
    case(F, "perplexity(0) is 1", lambda: perplexity(0.0), Ok(lambda r: _assert(r == 1.0, f"{r}")))
    lg = torch.randn(4, 5)
    for t, why in ((torch.tensor([0, 1, 2]), "3 targets for 4 rows"), (torch.tensor([0, 1, 2, 7]), "class 7 of 5"),
                   (torch.tensor([0.0, 1.0, 2.0, 3.0]), "float targets"), (torch.full((4,), -100), "all ignored"),
                   (torch.tensor([-5, 1, 2, 3]), "a negative target")):
        case(F, f"accuracy: {why}", lambda t=t: accuracy(lg, t), E_any("targets", "target"))
    case(F, "accuracy: NaN logits", lambda: accuracy(torch.full((4, 5), math.nan), torch.tensor([0, 1, 2, 3])),
         E_any("logits", "nan"))


# ------------------------------------------------------------------------------------- family: viz

def _viz_cases():
    from attnlab.viz.notebook import head_view, model_view

    F = "viz"

    def attn(L=3, layers=2, heads=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.softmax(torch.randn(1, heads, L, L, generator=g), -1) for _ in range(layers))

    evil = ['<script>alert(1)</script>', '"onmouseover="x', "</style><img src=x onerror=alert(1)>"]

    def escaped(view):
        page = view.data
        for t in evil:
            _assert(t not in page, f"{t!r} appears unescaped")
        _assert(len(page) < 20_000_000, f"page of {len(page):,} characters")
    for fn_name, fn in (("head_view", head_view), ("model_view", model_view)):
        case(F, f"{fn_name}: tokens with <script> and quotes", lambda fn=fn: fn(attn(), evil, html_action="return"),
             Ok(escaped))
        case(F, f"{fn_name}: title with <script>",
             lambda fn=fn: fn(attn(), ["a", "b", "c"], title=evil[0], html_action="return"), Ok(escaped))
        case(F, f"{fn_name}: 10k tokens is bounded",
             lambda fn=fn: fn(tuple(torch.full((1, 1, 10_000, 10_000), 1e-4) for _ in range(1)),
                              [f"t{i}" for i in range(10_000)], html_action="return"),
             Either(Ok(escaped), E_any("tokens", "max_tokens")))
        case(F, f"{fn_name}: NaN attention",
             lambda fn=fn: fn(tuple(torch.full((1, 2, 3, 3), math.nan) for _ in range(2)), ["a", "b", "c"],
                              html_action="return"),
             E_any("attention", "nan", "weights"))
        case(F, f"{fn_name}: weights above 1", lambda fn=fn: fn(tuple(torch.full((1, 2, 3, 3), 2.0) for _ in range(2)),
                                                                ["a", "b", "c"], html_action="return"),
             E_any("attention", "weights", "[0, 1]"))
        case(F, f"{fn_name}: empty tuple", lambda fn=fn: fn((), [], html_action="return"), E("attention"))
        case(F, f"{fn_name}: empty maps (L=0)", lambda fn=fn: fn(attn(L=0), [], html_action="return"),
             E_any("attention", "tokens", "empty"))
        case(F, f"{fn_name}: tokens of the wrong length", lambda fn=fn: fn(attn(), ["a"], html_action="return"),
             E("tokens"))
        case(F, f"{fn_name}: tokens are ints", lambda fn=fn: fn(attn(), [1, 2, 3], html_action="return"), E("tokens"))
        case(F, f"{fn_name}: tokens None", lambda fn=fn: fn(attn(), None, html_action="return"), E("tokens"))
        case(F, f"{fn_name}: html_action='save'", lambda fn=fn: fn(attn(), ["a", "b", "c"], html_action="save"),
             E("html_action"))
        case(F, f"{fn_name}: batch_index=1 of 1", lambda fn=fn: fn(attn(), ["a", "b", "c"], batch_index=1,
                                                                   html_action="return"), E("batch_index"))
        case(F, f"{fn_name}: sentence_b_start=5 of 3",
             lambda fn=fn: fn(attn(), ["a", "b", "c"], sentence_b_start=5, html_action="return"), E("sentence_b_start"))
        case(F, f"{fn_name}: a list of numpy-like lists",
             lambda fn=fn: fn([a.tolist() for a in attn()], ["a", "b", "c"], html_action="return"), E("attention"))
        case(F, f"{fn_name}: layers of different shapes",
             lambda fn=fn: fn((attn(L=3)[0], attn(L=4)[0]), ["a", "b", "c"], html_action="return"), E("attention"))
        case(F, f"{fn_name}: 3-D weights", lambda fn=fn: fn(tuple(a[0] for a in attn()), ["a", "b", "c"],
                                                           html_action="return"), E("attention"))
        case(F, f"{fn_name}: an unknown option", lambda fn=fn: fn(attn(), ["a", "b", "c"], colour="red",
                                                                  html_action="return"), E("colour"))
    case(F, "head_view: layer=5 of 2", lambda: head_view(attn(), ["a", "b", "c"], layer=5, html_action="return"),
         E("layer"))
    case(F, "head_view: heads=[3] of 2", lambda: head_view(attn(), ["a", "b", "c"], heads=[3], html_action="return"),
         E("heads"))
    case(F, "model_view: include_heads=[-1]",
         lambda: model_view(attn(), ["a", "b", "c"], include_heads=[-1], html_action="return"), E("include_heads"))
    case(F, "model_view: display_mode='neon'",
         lambda: model_view(attn(), ["a", "b", "c"], display_mode="neon", html_action="return"), E("display_mode"))
    d = tmpdir()
    (d / "keep.html").write_text("mine")
    case(F, "AttentionView.save into a directory path", keeping(d, lambda: head_view(
        attn(), ["a", "b", "c"], html_action="return").save(d)),
        Keeps(AnyErr(E("path"), Err(IsADirectoryError, ""), Err(OSError, "directory"))))


# ---------------------------------------------------------------------------------- family: files

def _saved_gpt2(d: Path) -> Path:
    from attnlab import save_pretrained
    m = gpt2()
    save_pretrained(m, d)
    return d


def _files_cases():
    from safetensors.torch import load_file, save_file

    import attnlab
    from attnlab import from_pretrained

    F = "files"
    base = tmpdir()
    good = _saved_gpt2(base / "good")
    cfg = json.loads((good / "config.json").read_text())
    weights = load_file(good / "model.safetensors")

    def variant(name, *, config=None, config_text=None, tensors=None, raw=None, drop=()):
        d = base / name
        d.mkdir()
        (d / "config.json").write_text(config_text if config_text is not None else json.dumps(config or cfg))
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, d / "model.safetensors")
        else:
            (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        for n in drop:
            (d / n).unlink()
        return d

    def load(d):
        return keeping(d, lambda: from_pretrained(d))

    some = next(iter(weights))
    cases = [
        ("extra key", dict(tensors={**weights, "transformer.h.0.mlp.c_extra.weight": torch.zeros(3)}),
         E_any("unexpected", "c_extra")),
        ("missing key", dict(tensors={k: v for k, v in weights.items() if k != some}), E_any("missing", some)),
        ("renamed key", dict(tensors={("x." + k if k == some else k): v for k, v in weights.items()}),
         E_any("missing", "unexpected", some)),
        ("wrong shape", dict(tensors={k: (v[:-1] if k == some else v) for k, v in weights.items()}),
         E_any("shape", some)),
        ("int weights", dict(tensors={k: (v.long() if k == some else v) for k, v in weights.items()}),
         E_any("dtype", some)),
        ("mixed float64", dict(tensors={k: (v.double() if k == some else v) for k, v in weights.items()}),
         Either(Ok(lambda r: None), E_any("dtype", some))),
        ("NaN weight",
         dict(tensors={k: (torch.full_like(v, math.nan) if k == some else v) for k, v in weights.items()}),
         Either(Ok(lambda r: _assert(any(torch.isnan(p).any() for p in r.parameters()), "the NaN vanished")),
                E_any("nan", "finite"))),
        ("truncated safetensors", dict(raw=(good / "model.safetensors").read_bytes()[:1000]),
         E_any("safetensors", "truncated", "model.safetensors")),
        ("empty safetensors", dict(raw=b""), E_any("safetensors", "model.safetensors")),
        ("header length huge", dict(raw=(2**62).to_bytes(8, "little") + b"{}"), E_any("safetensors", "header")),
        ("header not JSON", dict(raw=(5).to_bytes(8, "little") + b"{{{{{"), E_any("safetensors", "header")),
        ("pickle as safetensors", dict(raw=b"\x80\x04\x95" + b"\x00" * 64), E_any("safetensors", "model.safetensors")),
        ("no weights file", dict(drop=("model.safetensors",)),
         AnyErr(E("weights"), Err(FileNotFoundError, "model.safetensors"))),
        ("config n_embd 32 vs 16-wide weights", dict(config={**cfg, "n_embd": 32}), E_any("shape", "n_embd")),
        ("config vocab 41 vs 40-row weights", dict(config={**cfg, "vocab_size": 41}), E_any("shape", "vocab")),
        ("config n_layer 2 vs 1 layer", dict(config={**cfg, "n_layer": 2}), E_any("missing", "n_layer")),
        ("config model_type unknown", dict(config={**cfg, "model_type": "gpt5"}), E("model_type")),
        ("config model_type missing", dict(config={k: v for k, v in cfg.items() if k != "model_type"}),
         E("model_type")),
        ("config n_head 0", dict(config={**cfg, "n_head": 0}), E("n_head")),
        ("config n_layer 10**6", dict(config={**cfg, "n_layer": 10**6}), E_any("n_layer", "memory")),
        ("config n_embd huge", dict(config={**cfg, "n_embd": 2**40}), E_any("n_embd", "memory")),
        ("config NaN literal", dict(config_text=json.dumps({**cfg, "layer_norm_epsilon": float("nan")})),
         E_any("nan", "layer_norm_epsilon", "config")),
        ("config Infinity literal", dict(config_text=json.dumps({**cfg, "n_positions": float("inf")})),
         E_any("infinity", "n_positions", "config")),
        ("config duplicate keys", dict(config_text=json.dumps(cfg)[:-1] + ', "layer_norm_epsilon": 0.5}'),
         E("duplicate")),
        ("config deep nesting", dict(config_text='{"x": ' + "[" * 50_000 + "]" * 50_000 + "}"),
         E_any("config", "nest", "deep")),
        ("config a list", dict(config_text="[1, 2]"), E("config")),
        ("config empty", dict(config_text=""), E("config")),
        ("config not UTF-8", dict(config_text=None, config={**cfg, "name": "x"}), None),
        ("config n_positions 'sixteen'", dict(config={**cfg, "n_positions": "sixteen"}), E("n_positions")),
        ("config n_positions true", dict(config={**cfg, "n_positions": True}), E("n_positions")),
        ("config activation 'os.system'", dict(config={**cfg, "activation_function": "os.system"}),
         E_any("activation", "activation_function")),
        ("config torch_dtype 'int8'", dict(config={**cfg, "torch_dtype": "int8"}), Either(Ok(lambda r: None),
                                                                                          E("torch_dtype"))),
    ]
    for name, kw, exp in cases:
        if exp is None:
            d = variant(name)
            (d / "config.json").write_bytes(b'{"model_type": "gpt2", "n_embd": 16, "name": "\xff\xfe"}')
            exp = E_any("config", "utf")
        else:
            d = variant(name, **kw)
        case(F, f"from_pretrained: {name}", load(d), Keeps(exp))
    # the folder itself
    (base / "a_file").write_text("x")
    os.symlink(base / "loop1", base / "loop2")
    os.symlink(base / "loop2", base / "loop1")
    cfg_dir = base / "config_is_dir"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").mkdir()
    fifo = base / "config_fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    zero = base / "config_dev_zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "config.json")
    wdir = base / "weights_dir"
    wdir.mkdir()
    (wdir / "config.json").write_text(json.dumps(cfg))
    (wdir / "model.safetensors").mkdir()
    wfifo = base / "weights_fifo"
    wfifo.mkdir()
    (wfifo / "config.json").write_text(json.dumps(cfg))
    os.mkfifo(wfifo / "model.safetensors")
    for p, why in ((base / "nope", "a missing folder"), (base / "a_file", "a file"), (base / "loop1", "a symlink loop"),
                   (cfg_dir, "config.json a directory"), (fifo, "config.json a FIFO"),
                   (zero, "config.json -> /dev/zero"),
                   (wdir, "model.safetensors a directory"), (wfifo, "model.safetensors a FIFO"), ("", "an empty path"),
                   (".", "the current folder")):
        case(F, f"from_pretrained: {why}", lambda p=p: from_pretrained(p),
             AnyErr(E_any("config", "path", "model.safetensors", "weights", "regular"),
                    Err(FileNotFoundError, ""), Err(OSError, "config")))
    for val in (torch.int8, "float16", 16, torch.complex64):
        case(F, f"from_pretrained(dtype={val!r})", lambda v=val: from_pretrained(good, dtype=v), E("dtype"))
    case(F, "from_pretrained(model_cls=dict)", lambda: from_pretrained(good, model_cls=dict), E("model_cls"))
    case(F, "from_pretrained then logits equal the saved model's", lambda: _round_trip(good),
         Ok(lambda r: _assert(torch.equal(r[0], r[1]), "the loaded model computes otherwise")))
    # writing: never over what we read
    case(F, "save_pretrained into the folder it was loaded from (same model)",
         keeping(good, lambda: attnlab.save_pretrained(from_pretrained(good), good)),
         Keeps(Either(Ok(lambda r: None), E_any("path", "overwrite", "exists"))))
    other = _saved_gpt2(base / "other")
    case(F, "save_pretrained a different model over a saved folder: the folder then holds it whole",
         lambda: (attnlab.save_pretrained(gpt2(n_embd=32), other), from_pretrained(other))[1],
         Ok(lambda r: _assert(r.config.n_embd == 32, "the folder mixes two models")))
    case(F, "save_pretrained to a file path", keeping(base, lambda: attnlab.save_pretrained(gpt2(), base / "a_file")),
         Keeps(AnyErr(E_any("path", "directory", "a_file"), Err(OSError, "a_file"))))
    case(F, "save_pretrained(None)", lambda: attnlab.save_pretrained(None, base / "x"), E("model"))
    # checkpoints
    ck = tmpdir()
    torch.save({"x": torch.zeros(2)}, ck / "ok.pt")
    (ck / "evil.pt").write_bytes(b"\x80\x04cos\nsystem\nq\x00X\x05\x00\x00\x00touchq\x01\x85q\x02Rq\x03.")
    from attnlab.training.checkpoint import load_checkpoint
    case(F, "load_checkpoint of a pickle that would run os.system",
         keeping(ck, lambda: load_checkpoint(ck / "evil.pt")),
         Keeps(E("checkpoint")))
    case(F, "load_checkpoint of a plain dict", lambda: load_checkpoint(ck / "ok.pt"),
         Ok(lambda r: _assert(torch.equal(r["x"], torch.zeros(2)), "contents")))
    case(F, "load_checkpoint of a missing file", lambda: load_checkpoint(ck / "missing.pt"),
         Err(FileNotFoundError, "missing.pt"))
    case(F, "load_checkpoint of a directory", lambda: load_checkpoint(ck), E_any("checkpoint", "folder"))


def _round_trip(d):
    from attnlab import from_pretrained
    m = from_pretrained(d).eval()
    ids = torch.tensor([[1, 2, 3]])
    m2 = from_pretrained(d).eval()
    return m(ids).logits, m2(ids).logits


FAMILIES = {"attention": _attention_cases, "grad": _grad_cases, "modules": _module_cases, "models": _model_cases,
            "generate": _generate_cases, "adapt": _adapt_cases, "text": _text_cases, "viz": _viz_cases,
            "files": _files_cases}
H.FAMILIES.update({FAMILY_PREFIX + f: fn for f, fn in FAMILIES.items()})
SLOW = {"text", "viz"}  # 1 MB texts, 10k-token pages: -m slow


def _run(family: str):
    out = subprocess.run([sys.executable, __file__, family], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "ATTNLAB_FLEX_COMPILE": "0"})
    return out, [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in FAMILIES])
def test_every_fresh_hostile_input_has_its_outcome(family):
    out, lines = _run(family)
    if out.returncode != 0:
        last = [json.loads(x)["case"] for x in out.stderr.splitlines() if x.startswith('{"case"')][-1:]
        pytest.fail(f"{family}: the process ended with exit code {out.returncode} (crash at {last})\n"
                    f"{out.stderr[-3000:]}")
    assert lines and "counts" in lines[-1], out.stderr[-3000:]
    bad = [f"{x['outcome']}: {x['case']}: {x['why']}" for x in lines if x.get("outcome") not in (None, "good")]
    assert not bad, f"{len(bad)} of {sum(lines[-1]['counts'].values())} cases not good:\n" + "\n".join(bad)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (H.MEMORY_LIMIT, H.MEMORY_LIMIT))
    H.run_family(FAMILY_PREFIX + sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
