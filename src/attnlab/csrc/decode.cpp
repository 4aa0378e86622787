// The small operations of a decoding step, each in one call instead of several PyTorch operations.
//
// A decoding step (one new token per sequence) spends its time in two places: the weight products (matvec.cpp,
// which stream the weights at memory speed) and everything between them — per layer ~40 small PyTorch
// operations for RMSNorm, RoPE, the cache write and the attention over the cache, each a dispatch, an output
// allocation and, after a product has swept the caches, cold instructions and data. Here they are two calls:
//
//   attnlab::rms_norm(x, w, eps)           y = x / sqrt(mean(x²) + ε) · w               (row by row)
//   attnlab::attend_decode(qkv, K, V, t, …)  one query per sequence and head, at position t:
//       q, k ← RoPE_t(q), RoPE_t(k)          (when cos/sin are given: a' = a cos φ − b sin φ, b' = b cos φ + a sin φ)
//       K[:, :, t], V[:, :, t] ← k, v        (the cache buffers, written in place)
//       out = softmax(scale · q K[:, :, :t+1]ᵀ) V[:, :, :t+1]     (query head h reads key/value head h / (H / Hkv))
//
// float32 throughout, the same formulas as the PyTorch path (nn/norms.py, functional/positional.py, SDPA), up
// to float32 summation order; the exponential is a polynomial within ~1 ulp (decode_body.h). The
// instruction set is the caller's (`isa`: 2 = AVX-512, 1 = AVX2 + FMA, 0 = portable), as in matvec.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "native.h"

namespace {

#define ATTNLAB_BODY "train_body.h"  // decode_body.h, and the float32 / bf16 rows RMSNorm shares with training
#include "isa_regions.h"

using attnlab_native::check_f32;

// dst[0 .. D) = src rotated at one position: pairs (i, i + R/2) (half-split) or (2i, 2i + 1) (interleaved) for
// i < R/2 = n_rot, the last D − R dims copied
void rope_copy(const float* src, float* dst, int64_t D, const float* c, const float* s, int64_t n_rot,
               bool interleaved) {
  for (int64_t i = 0; i < n_rot; ++i) {
    const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + n_rot;
    const float a = src[ia], b = src[ib];
    dst[ia] = a * c[i] - b * s[i];
    dst[ib] = b * c[i] + a * s[i];
  }
  std::memcpy(dst + 2 * n_rot, src + 2 * n_rot, sizeof(float) * (D - 2 * n_rot));
}

at::Tensor attend_decode(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t length,
                         int64_t heads, int64_t kv_heads, const std::optional<at::Tensor>& cos,
                         const std::optional<at::Tensor>& sin, bool interleaved, double scale) {
  check_f32(qkv, "attend_decode", "qkv");
  check_f32(k_cache, "attend_decode", "k_cache");
  check_f32(v_cache, "attend_decode", "v_cache");
  ATTNLAB_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0,
                "attnlab::attend_decode: heads must be a multiple of kv_heads, got ", heads, " and ", kv_heads);
  ATTNLAB_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                "attnlab::attend_decode: k_cache and v_cache must be equal (B, Hkv, capacity, D), got ",
                k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = k_cache.size(0), cap = k_cache.size(2), D = k_cache.size(3);
  int64_t width = 0;
  const bool fits = k_cache.size(1) == kv_heads && heads <= qkv.numel() &&  // (so no overflow below)
                    !__builtin_mul_overflow(heads + 2 * kv_heads, D, &width);
  ATTNLAB_CHECK(fits && qkv.dim() >= 1 && qkv.numel() == B * width && qkv.size(-1) == width,
                "attnlab::attend_decode: qkv must be (B, 1, (H + 2 Hkv) · D) = (", B, ", 1, ", width,
                ") for a cache of ", k_cache.sizes(), " and ", heads, "/", kv_heads, " heads, got ", qkv.sizes());
  ATTNLAB_CHECK(0 <= length && length < cap, "attnlab::attend_decode: position ", length,
                " is outside the cache's room of ", cap);
  ATTNLAB_CHECK(cos.has_value() == sin.has_value(), "attnlab::attend_decode: give both cos and sin, or neither");
  int64_t n_rot = 0;
  if (cos) {
    check_f32(*cos, "attend_decode", "cos");
    check_f32(*sin, "attend_decode", "sin");
    n_rot = cos->numel();
    ATTNLAB_CHECK(sin->numel() == n_rot && 2 * n_rot <= D, "attnlab::attend_decode: cos and sin must hold R/2 ≤ D/2 = ",
                  D / 2, " angles each, got ", cos->numel(), " and ", sin->numel());
  }
  const float* c = cos ? cos->data_ptr<float>() : nullptr;
  const float* s = sin ? sin->data_ptr<float>() : nullptr;
  const float* in = qkv.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  at::Tensor q = at::empty({B, heads, D}, qkv.options());  // the rotated queries
  float* qp = q.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = in + b * width;  // q's heads, then k's, then v's
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      float* dst = h < heads ? qp + (b * heads + h) * D : kp + ((b * kv_heads + h - heads) * cap + length) * D;
      if (n_rot) {
        rope_copy(row + h * D, dst, D, c, s, n_rot, interleaved);
      } else {
        std::memcpy(dst, row + h * D, sizeof(float) * D);
      }
    }
    for (int64_t g = 0; g < kv_heads; ++g)
      std::memcpy(vp + ((b * kv_heads + g) * cap + length) * D, row + (heads + kv_heads + g) * D, sizeof(float) * D);
  }
  at::Tensor out = at::empty({B, 1, heads * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t S = length + 1, group = heads / kv_heads;
  const auto fn = ISA_FN(attend_one);
  // ~64 K multiply-adds per task at least: a short cache stays on one thread (waking another costs more)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, S * D));
  at::parallel_for(0, B * heads, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / heads, h = i % heads, g = b * kv_heads + h / group;
      fn(qp + i * D, kp + g * cap * D, vp + g * cap * D, S, D, static_cast<float>(scale), scratch.data(),
         op + i * D);
    }
  });
  return out;
}

}  // namespace

void attnlab_native::activate(int64_t act, float* y, const float* g, int64_t n) {
  const auto fn = ISA_FN(activate_row);
  fn(act, y, g, n);
}

namespace {

// y = act(x) (⊙ g when given, g of x's shape), a new tensor, the elements split over the threads (~64 K per task)
at::Tensor activate(const at::Tensor& x, const std::optional<at::Tensor>& g, int64_t act) {
  check_f32(x, "activate", "x");
  ATTNLAB_CHECK(0 <= act && act <= 6, "attnlab::activate: act must be an activation code 0-6, got ", act);
  if (g) {
    check_f32(*g, "activate", "g");
    ATTNLAB_CHECK(g->sizes() == x.sizes(), "attnlab::activate: g must have x's shape ", x.sizes(), ", got ",
                  g->sizes());
  }
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float* gp = g ? g->data_ptr<float>() : nullptr;
  const auto fn = ISA_FN(activate_row);
  at::parallel_for(0, x.numel(), int64_t(1) << 16, [&](int64_t i0, int64_t i1) {
    std::memcpy(y + i0, in + i0, sizeof(float) * (i1 - i0));
    fn(act, y + i0, gp ? gp + i0 : nullptr, i1 - i0);
  });
  return out;
}

using Opt = std::optional<at::Tensor>;

const float* ptr(const Opt& t) { return t ? t->data_ptr<float>() : nullptr; }

// RMSNorm (w) or LayerNorm (w, b optional) of each row of x (..., E) -> a new tensor, the rows split over the threads
// (~64 K elements per task at least); `op` names the caller in the errors
at::Tensor norm(const char* op, const at::Tensor& x, const Opt& w, const Opt& b, bool rms, double eps) {
  check_f32(x, op, "x");
  ATTNLAB_CHECK(x.dim() >= 1, "attnlab::", op, ": x must be (..., E), got a 0-D tensor");
  for (const Opt* t : {&w, &b})
    if (*t) {
      check_f32(**t, op, "a norm's weight or bias");
      ATTNLAB_CHECK((*t)->dim() == 1 && (*t)->size(0) == x.size(-1), "attnlab::", op,
                    ": a norm's weight or bias must be (E,) with E = x.size(-1); got x ", x.sizes(), ", ",
                    (*t)->sizes());
    }
  ATTNLAB_CHECK(x.dim() >= 1 && (!rms || w), "attnlab::", op, ": RMSNorm needs x (..., E) and its weight");
  at::Tensor y = at::empty_like(x);
  const int64_t E = x.size(-1), rows = E ? x.numel() / E : 0;
  const auto rms_fn = ISA_FN(rms_norm_row<float>);
  const auto ln_fn = ISA_FN(layer_norm_row);
  const float *xp = x.data_ptr<float>(), *wp = ptr(w), *bp = ptr(b);
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, E));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (rms) {
        rms_fn(xp + r * E, wp, E, static_cast<float>(eps), yp + r * E);
      } else {
        ln_fn(xp + r * E, wp, bp, yp + r * E, E, static_cast<float>(eps));
      }
    }
  });
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return norm("rms_norm", x, w, std::nullopt, true, eps);
}

void add_(at::Tensor& acc, const at::Tensor& y) {  // acc += y, both contiguous float32 of one size
  float* a = acc.data_ptr<float>();
  const float* b = y.data_ptr<float>();
  for (int64_t i = 0, n = acc.numel(); i < n; ++i) a[i] += b[i];
}

// A pre-norm decoder-only layer's decoding step, x (B, 1, E) -> (B, 1, E), in one call:
//     h = norm₁(x);  qkv = h W_qkvᵀ;  a = attend_decode(qkv, …);  x₁ = x + a W_oᵀ
//     x₂ = x₁ + W₂ f(norm₂(x₁)),  f(h) = act(h W₁ᵀ) ⊙ h W₃ᵀ (gated) or act(h W₁ᵀ)
// (every product with its optional row scale and bias, as matvec), the step's k and v written into the cache buffers
// k_cache, v_cache. t holds, in order: norm₁ w, b; W_qkv, s, b; W_o, s, b; norm₂ w, b; W₁, s, b; W₃, s, b; W₂, s, b;
// cos, sin. A qkv with a NaN or ±inf returns an empty tensor and writes nothing: the caller recomputes the layer
// with its own semantics.
at::Tensor decoder_step(const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache, at::ArrayRef<Opt> t,
                        bool rms, double eps1, double eps2, int64_t heads,
                        int64_t kv_heads, int64_t position, bool interleaved, double scale, int64_t act, bool gated) {
  ATTNLAB_CHECK(t.size() == 21, "attnlab::decoder_step: expected 21 tensors (see decode.cpp), got ", t.size());
  check_f32(x, "decoder_step", "x");
  ATTNLAB_CHECK(x.dim() == 3 && x.size(1) == 1, "attnlab::decoder_step: x must be (B, 1, E), got ", x.sizes());
  for (int i : {2, 5, 10, 16})
    ATTNLAB_CHECK(t[i].has_value(), "attnlab::decoder_step: tensor ", i, " (a weight) is missing");
  ATTNLAB_CHECK(!gated || t[13].has_value(), "attnlab::decoder_step: a gated FFN needs W₃");
  ATTNLAB_CHECK(gated ? attnlab_native::is_gate(act) : attnlab_native::is_plain(act),
                "attnlab::decoder_step: act must be an activation code of csrc/native.h, got ", act);
  at::Tensor h = norm("decoder_step", x, t[0], t[1], rms, eps1);
  at::Tensor qkv = attnlab_native::matvec(h, *t[2], t[3], t[4]);
  const float* q = qkv.data_ptr<float>();
  for (int64_t i = 0, n = qkv.numel(); i < n; ++i)
    if (!std::isfinite(q[i])) return at::empty({0}, x.options());
  at::Tensor a = attend_decode(qkv, k_cache, v_cache, position, heads, kv_heads, t[19], t[20], interleaved, scale);
  at::Tensor x1 = attnlab_native::matvec(a, *t[5], t[6], t[7]);
  add_(x1, x);  // x₁ = x + a W_oᵀ
  at::Tensor h2 = norm("decoder_step", x1, t[8], t[9], rms, eps2);
  at::Tensor f;
  if (gated) {
    f = attnlab_native::gated_matvec(h2, *t[10], t[11], t[12], *t[13], t[14], t[15], act);
  } else {
    f = attnlab_native::matvec(h2, *t[10], t[11], t[12]);
    attnlab_native::activate(act, f.data_ptr<float>(), nullptr, f.numel());
  }
  at::Tensor out = attnlab_native::matvec(f, *t[16], t[17], t[18]);
  add_(out, x1);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("activate(Tensor x, Tensor? g, int act) -> Tensor");
  m.def("attend_decode(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, int length, int heads, int kv_heads, "
        "Tensor? cos, Tensor? sin, bool interleaved, float scale) -> Tensor");
  m.def("decoder_step(Tensor x, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor?[] t, bool rms, float eps1, "
        "float eps2, int heads, int kv_heads, int position, "
        "bool interleaved, float scale, int act, bool gated) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("activate", &activate);
  m.impl("attend_decode", &attend_decode);
  m.impl("decoder_step", &decoder_step);
}
