"""Bad inputs to :func:`attnlab.attention` fail at the boundary, with a
message that names the offending argument."""
import pytest
import torch

from attnlab import attention

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 3, 5, 8, 6


def qkv(**shapes):
    s = dict(q=(B, H, LQ, D), k=(B, HKV, LK, D), v=(B, HKV, LK, DV)) | shapes
    return torch.randn(s["q"]), torch.randn(s["k"]), torch.randn(s["v"])


def test_valid_call_works():  # the baseline every case below breaks in one place
    out, w = attention(*qkv(), mask=torch.ones(LQ, LK, dtype=torch.bool), causal=True, window=2,
                       normalize="topk", top_k=2, return_weights=True)
    assert out.shape == (B, H, LQ, DV) and w.shape == (B, H, LQ, LK)


@pytest.mark.parametrize("name,shape", [
    ("q", (H, LQ, D)), ("k", (B, HKV, LK, D, 1)), ("v", (LK, DV)),
])
def test_wrong_rank(name, shape):
    with pytest.raises(ValueError, match=rf"{name} must have 4 dims"):
        attention(*qkv(**{name: shape}))


@pytest.mark.parametrize("pos", [0, 1, 2])
def test_non_tensor(pos):
    args = list(qkv())
    args[pos] = args[pos].tolist()
    with pytest.raises(TypeError, match=rf"{'qkv'[pos]} must be a floating-point tensor .*, got list"):
        attention(*args)


def test_integer_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a floating-point tensor"):
        attention(q, k.long(), v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        attention(q, k.double(), v)


@pytest.mark.parametrize("shapes,match", [
    (dict(k=(B + 1, HKV, LK, D), v=(B + 1, HKV, LK, DV)), "batch sizes differ"),
    (dict(k=(B, HKV, LK, D + 1), v=(B, HKV, LK, DV)), "same head dim D"),
    (dict(v=(B, HKV, LK + 1, DV)), "k and v must have the same length"),
    (dict(k=(B, 3, LK, D), v=(B, 3, LK, DV)), r"H % Hkv == 0"),
    (dict(v=(B, HKV + 1, LK, DV)), "same number of heads"),
])
def test_mismatched_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        attention(*qkv(**shapes))


@pytest.mark.parametrize("shape", [(LQ + 1, LK), (LK, LQ), (B, H, LQ, LK, 1), (3, 1, 1, 1)])
def test_mask_that_does_not_broadcast(shape):
    with pytest.raises(ValueError, match="mask of shape .* does not broadcast"):
        attention(*qkv(), mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_mask_of_integer_dtype(dtype):
    with pytest.raises(TypeError, match="mask must be bool"):
        attention(*qkv(), mask=torch.ones(LQ, LK, dtype=dtype))


def test_mask_not_a_tensor():
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        attention(*qkv(), mask=[[True] * LK] * LQ)


@pytest.mark.parametrize("window", [0, -1, 2.5, True, "3"])
def test_bad_window(window):
    with pytest.raises(ValueError, match="window must be a positive int"):
        attention(*qkv(), window=window)


@pytest.mark.parametrize("top_k", [0, LK + 1, None, 1.5])
def test_bad_top_k(top_k):
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, Lk=5\]"):
        attention(*qkv(), normalize="topk", top_k=top_k)


def test_top_k_without_topk_normalize():
    with pytest.raises(ValueError, match="top_k is only used with normalize='topk'"):
        attention(*qkv(), top_k=2)


def test_unknown_normalize():
    with pytest.raises(ValueError, match="normalize must be one of .*'softmax'.*got 'entmax'"):
        attention(*qkv(), normalize="entmax")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be 'auto' or one of .*got 'cudnn'"):
        attention(*qkv(), backend="cudnn")


def test_sdpa_cannot_return_weights():
    with pytest.raises(ValueError, match="backend='sdpa' cannot compute .*return_weights=True .*materialise"):
        attention(*qkv(), backend="sdpa", return_weights=True)


@pytest.mark.parametrize("kw,why", [
    (dict(normalize="sparsemax"), "softmax only"),
    (dict(score_mod=lambda s, b, h, q, kv: s), "score_mod"),
])
def test_sdpa_refuses_what_it_cannot_compute(kw, why):
    with pytest.raises(ValueError, match=f"backend='sdpa' cannot compute .*{why}"):
        attention(*qkv(), backend="sdpa", **kw)


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5, "0.1"])
def test_bad_dropout(p):
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        attention(*qkv(), dropout_p=p)


def test_scale_not_a_number():
    with pytest.raises(TypeError, match="scale must be a real number"):
        attention(*qkv(), scale="0.1")


@pytest.mark.parametrize("name", ["score_mod", "mask_mod"])
def test_mod_not_callable(name):
    with pytest.raises(TypeError, match=f"{name} must be callable"):
        attention(*qkv(), **{name: 3})


@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
@pytest.mark.parametrize("ret,got", [
    (lambda b, h, q, kv: (kv - q).float(), "torch.float32 tensor"),
    (lambda b, h, q, kv: True, "bool"),
])
def test_mask_mod_returning_non_bool(backend, ret, got):
    with pytest.raises(ValueError, match=f"mask_mod must return a bool tensor, got .*{got}"):
        attention(*qkv(), mask_mod=ret, backend=backend)


def test_mask_mod_returning_wrong_shape():
    with pytest.raises(ValueError, match="mask_mod returned shape"):
        attention(*qkv(), mask_mod=lambda b, h, q, kv: torch.ones(7, 7, dtype=torch.bool))


@pytest.mark.parametrize("fn,got", [
    (lambda s, b, h, q, kv: s[..., :1], r"shape \(1, 1, 2, 1\)"),
    (lambda s, b, h, q, kv: s.double(), "dtype torch.float64"),
    (lambda s, b, h, q, kv: 1.0, "got float"),
])
def test_score_mod_returning_wrong_shape(fn, got):
    with pytest.raises(ValueError, match=rf"score_mod must return a tensor of the scores' shape .*{got}"):
        attention(*qkv(), score_mod=fn, backend="reference")


# ---- boundary cases found by review: each now a clear error at the API --------------------

def _qkv(Lk=5, D=4):
    return torch.randn(1, 2, 3, D), torch.randn(1, 2, Lk, D), torch.randn(1, 2, Lk, D)


@pytest.mark.parametrize("kw, exc, match", [
    ({"normalize": ["softmax"]}, ValueError, "normalize"),
    ({"backend": ["sdpa"]}, TypeError, "backend"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"scale": True}, TypeError, "scale"),
    ({"causal": "no"}, TypeError, "causal"),
    ({"return_weights": 1}, TypeError, "return_weights"),
    ({"mask": torch.full((3, 5), float("nan"))}, ValueError, "NaN"),
    ({"mask": torch.full((3, 5), float("inf"))}, ValueError, r"\+inf"),
])
def test_invalid_option_values(kw, exc, match):
    with pytest.raises(exc, match=match):
        attention(*_qkv(), **kw)


@pytest.mark.parametrize("Lk, D", [(0, 4), (5, 0)])
def test_empty_keys_or_zero_head_dim(Lk, D):
    with pytest.raises(ValueError, match="Lk=.*D="):
        attention(*_qkv(Lk, D))
