// attnlab::matvec — the few-row linear product of a decoding step, streamed at memory bandwidth.
//
//     y[m, n] = s[n] · Σ_k W[n, k] · x[m, k] + b[n]        (s = 1 without a scale, b = 0 without a bias)
//
// x: (..., K) float32 (M rows), W: (N, K) row-major in float32, bfloat16 or int8 (with s: one float32 scale per row),
// or int4 in groups (below), y: (..., N) float32. Decoding one token reads every weight once and does 2 flops per
// weight, so the product runs at the speed W streams from memory: the kernel reads each row of W in order, in vectors
// (U of them in flight), converts them to float32 in registers (bf16: a 16-bit shift or a mask) and
// multiplies them into every row of x (4, 2 or 1 at a time), accumulating in float32; the rows are split over
// torch's intra-op threads. With float32 and bf16 weights x stays float32 (the weight is the only thing
// rounded); with int8 weights each row of x is rounded to 16-bit integers (relative error ≤ 2⁻¹⁶ of the
// row's largest |x|, finer than bf16) and the products run in integer arithmetic (madd), scaled at the end.
//
// int4 weights (uint8 W of (N, ⌈K/128⌉ · 64) bytes, s: float32 (N, K/G), one scale per group of G columns):
//
//     W[n, k] = s[n, k / G] · q[n, k],   q ∈ -8..7 (a two's-complement nibble)
//
// packed four to a 16-bit lane in blocks of 128 columns (64 bytes, 32 lanes): nibble r of lane t holds column
// 32 r + t, so two shifts (left, then arithmetic right: the sign comes along) turn a block's lanes into four runs of
// 32 consecutive columns, already 16-bit integers (no widening, nothing crosses a lane; AVX2 reads a block as two
// halves of 16 lanes). G is a multiple of 32 that divides K. The products run as int8's (x in 16-bit integers,
// madd), each group's int32 sums scaled into float32.
//
// attnlab::gated_matvec is a gated FFN's first half in one call: h = act(x W₁ᵀ ⊙ s₁ + b₁) ⊙ (x W₃ᵀ ⊙ s₃ + b₃), the
// two products split over the threads together and each task gating the rows it computed.
//
// The instruction set is the library's (native.h, cpu_isa(): 2 = AVX-512, 1 = AVX2 + FMA, 0 = portable C++): the
// CPU's best, capped by ATEN_CPU_CAPABILITY as ATen's is, so ATEN_CPU_CAPABILITY=avx2 selects the AVX2 code here too.
// The vector code is written once (matvec_rows.h, in vec.h's vocabulary) and compiled for each instruction set in its
// own `#pragma GCC target` region (isa_regions.h); the portable set runs rows_portable, element by element.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "native.h"

namespace {

enum Kind { F32, BF16, I8, I4 };
constexpr int U = 4;  // vectors of a row in flight (independent accumulators)
constexpr int64_t FLUSH = 2048;  // int8: int32 sums moved to float32 this often (|sum| < 2048 · 127 · 32767 < 2³¹)

struct Job {
  const void* w;
  const float* x;
  const float* xd;     // bf16 only: each row of x as its even then its odd columns (K/2 each, K even)
  const int16_t* xq;   // int8 only: each row of x rounded to 16-bit integers, x ≈ xs[m] · xq[m]
  const float* xs;
  const float* scale;  // nullptr: 1
  const float* bias;   // nullptr: 0
  float* y;
  int64_t M, N, K;
  const float* gs;  // int4 only: the group scales, (N, K / G); its `scale` is nullptr
  int64_t G;
};

// int4: q[n, k] of a row of packed nibbles (layout above)
inline int nibble(const uint8_t* row, int64_t k) {
  const int64_t c = k % 128, r = c / 32;
  const uint8_t b = row[(k / 128) * 64 + 2 * (c % 32) + r / 2];
  const int u = r % 2 ? b >> 4 : b & 15;
  return u >= 8 ? u - 16 : u;
}
inline int64_t int4_row_bytes(int64_t K) { return (K + 127) / 128 * 64; }
// W[n, k] = s[n, k / G] · q[n, k] from row n's nibbles and its group scales gs (the portable kernels')
inline float int4_weight(const uint8_t* row, const float* gs, int64_t k, int64_t G) {
  return gs[k / G] * static_cast<float>(nibble(row, k));
}
// a group's int32 lane sums at most G / 8 products of |q x| ≤ 8 · 32767 (AVX2; G / 16 with AVX-512): ≤ 2³⁰ here
constexpr int64_t INT4_MAX_GROUP = 32768;

template <int KIND>
inline float load1(const void* w, int64_t i) {
  if constexpr (KIND == F32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (KIND == BF16) {
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[i]);
  }
}

inline void finish(const Job& j, int64_t m, int64_t n, float acc) {
  if (j.scale) acc *= j.scale[n];
  if (j.bias) acc += j.bias[n];
  j.y[m * j.N + n] = acc;
}

// Columns [k0, K) of row n, one x row at a time (the vector loops' remainder, and the portable kernel).
template <int KIND>
inline float dot_tail(const Job& j, int64_t n, const float* x, int64_t k0) {
  float acc = 0.f;
  for (int64_t k = k0; k < j.K; ++k) acc += load1<KIND>(j.w, n * j.K + k) * x[k];
  return acc;
}

template <int KIND>
void rows_portable(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < j.M; ++m) {
      if constexpr (KIND == I4) {
        const uint8_t* w = static_cast<const uint8_t*>(j.w) + n * int4_row_bytes(j.K);
        const float* x = j.x + m * j.K;
        float acc = 0.f;
        const float* gs = j.gs + n * (j.K / j.G);
        for (int64_t k = 0; k < j.K; ++k) acc += int4_weight(w, gs, k, j.G) * x[k];
        finish(j, m, n, acc);
      } else {
        finish(j, m, n, dot_tail<KIND>(j, n, j.x + m * j.K, 0));
      }
    }
}

// the vector kernels of each instruction set (matvec_rows.h in vec.h's vocabulary)
#define ATTNLAB_BODY "matvec_rows.h"
#include "isa_regions.h"

// ---- int4 with many rows (a prompt): W dequantised in panels (≤ 16 MiB of float32), each multiplied by at::mm
constexpr int64_t INT4_ROWS = 64;  // more rows of x than this: panels (attnlab._native.INT4_ROWS, measured there)

// int4: row n's weights as float32, W[n, k] = s[n, k / G] · q[n, k] (the vector versions: matvec_rows.h)
void dequantize_row_portable(const uint8_t* w, const float* gs, int64_t K, int64_t G, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = int4_weight(w, gs, k, G);
}

using DequantizeFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, float*);
DequantizeFn pick_dequantize(int64_t isa) {
#ifdef ATTNLAB_ISAS
  if (isa >= 2) return avx512::dequantize_row;
  if (isa == 1) return avx2::dequantize_row;
#endif
  return dequantize_row_portable;
}

// rows [n0, n0 + nb) of an int4 W (N, ⌈K/128⌉ · 64) with its group scales (N, K / G) as float32 into out (nb, K)
void dequantize_int4(const at::Tensor& w, const at::Tensor& scale, int64_t K, int64_t n0, int64_t nb, float* out) {
  const int64_t G = K / scale.size(1), rb = int4_row_bytes(K), ng = scale.size(1);
  const DequantizeFn fn = pick_dequantize(attnlab_native::cpu_isa());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* gs = scale.data_ptr<float>();
  at::parallel_for(0, nb, std::max<int64_t>(1, (int64_t(1) << 14) / K), [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) fn(wp + (n0 + n) * rb, gs + (n0 + n) * ng, K, G, out + n * K);
  });
}

void int4_panels(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, const at::Tensor& y, int64_t M, int64_t N, int64_t K) {
  const int64_t rows = std::min(N, std::max<int64_t>(64, (int64_t(1) << 22) / K));
  const at::Tensor x2 = x.reshape({M, K});
  at::Tensor y2 = y.view({M, N});
  at::Tensor panel = at::empty({rows, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nb = std::min(rows, N - n0);
    dequantize_int4(w, scale, K, n0, nb, panel.data_ptr<float>());
    const at::Tensor wt = panel.narrow(0, 0, nb).t();
    if (nb == N) {  // one panel: straight into y
      if (bias) at::addmm_out(y2, *bias, x2, wt);
      else at::mm_out(y2, x2, wt);
    } else {
      at::Tensor part = at::mm(x2, wt);  // (M, nb)
      if (bias) part.add_(bias->narrow(0, n0, nb));
      y2.narrow(1, n0, nb).copy_(part);
    }
  }
}

// ---- the op ----------------------------------------------------------------------------------------------
using RowsFn = void (*)(const Job&, int64_t, int64_t);

template <int KIND>
RowsFn pick_rows(int64_t isa) {
#ifdef ATTNLAB_ISAS
  if (isa >= 2) return avx512::rows<KIND>;
  if (isa == 1) return avx2::rows<KIND>;
#endif
  return rows_portable<KIND>;
}

// x's per-call copies that a weight kind's vector kernel reads (bf16: even/odd columns; int8: int16 rows and
// their scales), and the row function for that kind and instruction set
struct Prepared {
  at::Tensor xd, xq, xs;
  RowsFn fn;
  std::vector<int64_t> nonfinite;  // int8 / int4: rows of x holding a NaN or ±inf (no integer stands for them)
};

// the rows of y whose x was not finite: NaN, as the float product would give (not the integers' garbage)
void mark_nonfinite(const Prepared& p, float* y, int64_t N) {
  for (const int64_t m : p.nonfinite) std::fill(y + m * N, y + (m + 1) * N, std::numeric_limits<float>::quiet_NaN());
}

Prepared prepare(const at::Tensor& x, at::ScalarType wt, int64_t M, int64_t K) {
  const int64_t isa = attnlab_native::cpu_isa();
  Prepared p;
  if (wt == at::kBFloat16 && isa > 0 && K % 2 == 0) {  // (K odd: the portable kernel)
    p.xd = at::empty({M, K}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = p.xd.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) dst[m * K + (k % 2) * (K / 2) + k / 2] = src[m * K + k];
  }
  if ((wt == at::kChar || wt == at::kByte) && isa > 0) {  // x ≈ xs[m] xq[m], xq = round(x / xs), xs = max|x[m]| / 32767
    p.xq = at::empty({M, K}, x.options().dtype(at::kShort));
    p.xs = at::empty({M}, x.options());
    const float* src = x.data_ptr<float>();
    int16_t* q = p.xq.data_ptr<int16_t>();
    float* sc = p.xs.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      bool nan = false;
      for (int64_t k = 0; k < K; ++k) {
        const float a = std::abs(src[m * K + k]);
        amax = std::max(amax, a);
        nan |= a != a;
      }
      if (nan || std::isinf(amax)) {
        p.nonfinite.push_back(m);
        amax = 0.f;  // the row's integers: zeros, its outputs marked afterwards
      }
      sc[m] = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / sc[m];
      for (int64_t k = 0; k < K; ++k)
        q[m * K + k] = amax > 0.f ? static_cast<int16_t>(std::nearbyint(src[m * K + k] * inv)) : int16_t(0);
    }
  }
  p.fn = wt == at::kFloat      ? pick_rows<F32>(isa)
         : wt == at::kBFloat16 ? pick_rows<BF16>(p.xd.defined() ? isa : 0)
         : wt == at::kChar     ? pick_rows<I8>(isa)
                               : pick_rows<I4>(isa);
  return p;
}

Job job(const Prepared& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
        const std::optional<at::Tensor>& bias, float* y, int64_t M, int64_t N, int64_t K) {
  const bool i4 = w.scalar_type() == at::kByte;  // its scale: the group scales (check)
  return Job{w.data_ptr(), x.data_ptr<float>(), p.xd.defined() ? p.xd.data_ptr<float>() : nullptr,
             p.xq.defined() ? p.xq.data_ptr<int16_t>() : nullptr, p.xs.defined() ? p.xs.data_ptr<float>() : nullptr,
             scale && !i4 ? scale->data_ptr<float>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, y, M, N, K,
             i4 ? scale->data_ptr<float>() : nullptr, i4 ? K / scale->size(1) : 0};
}

// the checks of a weight w of K columns (int4: uint8 nibbles, ⌈K/128⌉ · 64 bytes a row) with its scale and bias
void check_weight(const char* op, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias, int64_t K) {
  ATTNLAB_CHECK(w.device().is_cpu(), "attnlab::", op, ": w must be a CPU tensor");
  const auto wt = w.scalar_type();
  ATTNLAB_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar || wt == at::kByte, "attnlab::", op,
                ": w must be float32, bfloat16, int8 or uint8 (int4 pairs), got ", wt);
  const int64_t N = w.dim() == 2 ? w.size(0) : -1;
  const bool i4 = wt == at::kByte;
  const int64_t width = i4 ? int4_row_bytes(K) : K;  // int4: 128 columns in 64 bytes
  ATTNLAB_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == width, "attnlab::", op,
                ": w must be a contiguous (N, ", i4 ? "ceil(K / 128) * 64" : "K", ") tensor with K = ", K, ", i.e. (N, ",
                width, "), got ", w.sizes());
  ATTNLAB_CHECK(!(wt == at::kChar || i4) || scale.has_value(), "attnlab::", op,
                i4 ? ": an int4 w needs its group scales" : ": an int8 w needs its per-row scale");
  for (const auto* t : {&scale, &bias}) {
    if (t->has_value()) {
      const at::Tensor& v = **t;
      const bool groups = i4 && t == &scale;
      ATTNLAB_CHECK(v.device().is_cpu() && v.dim() == (groups ? 2 : 1) && v.size(0) == N &&
                      v.scalar_type() == at::kFloat && v.is_contiguous(),
                    "attnlab::", op, groups ? ": an int4 w's scale must be a contiguous float32 (N, K / G) = (" :
                    ": scale and bias must be contiguous float32 (N,) = (", N, groups ? ", K / G) tensor, got " :
                    ",) tensors, got ", v.sizes(), " ", v.scalar_type());
    }
  }
  if (i4) {
    const int64_t groups = scale->size(1), G = groups > 0 && K % groups == 0 ? K / groups : 0;
    ATTNLAB_CHECK(G > 0 && G % 32 == 0 && G <= INT4_MAX_GROUP, "attnlab::", op, ": an int4 w's scale (N, K / G) must "
                  "give a group size G that is a multiple of 32 up to ", INT4_MAX_GROUP, " and divides K = ", K, ", got ",
                  groups, " groups");
  }
}

// the checks of matvec's arguments; returns M (x's rows)
int64_t check(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
              const std::optional<at::Tensor>& bias) {
  ATTNLAB_CHECK(x.device().is_cpu(), "attnlab::", op, ": x must be a CPU tensor");
  ATTNLAB_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(), "attnlab::", op,
                ": x must be a contiguous float32 (..., K) tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t K = x.size(-1);
  check_weight(op, w, scale, bias, K);
  return K ? x.numel() / K : 0;  // x's leading dims flattened
}

at::Tensor output(const at::Tensor& x, int64_t N) {  // y: (..., N)
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

// ~256 KiB of weight per task at least: small matrices stay on one thread
int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, row_bytes)); }

}  // namespace

namespace attnlab_native {

at::Tensor matvec(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias) {
  const int64_t M = check("matvec", x, w, scale, bias), N = w.size(0), K = x.size(-1);
  at::Tensor y = output(x, N);
  if (M == 0 || N == 0) return y.zero_();
  if (w.scalar_type() == at::kByte && M > INT4_ROWS) {
    int4_panels(x, w, *scale, bias, y, M, N, K);
    return y;
  }
  const Prepared p = prepare(x, w.scalar_type(), M, K);
  const Job j = job(p, x, w, scale, bias, y.data_ptr<float>(), M, N, K);
  at::parallel_for(0, N, grain(w.size(1) * w.element_size()), [&](int64_t n0, int64_t n1) { p.fn(j, n0, n1); });
  mark_nonfinite(p, y.data_ptr<float>(), N);
  return y;
}

// h = act(x W₁ᵀ ⊙ s₁ + b₁) ⊙ (x W₃ᵀ ⊙ s₃ + b₃): a gated FFN's two products and its gate in one pass over the
// rows (each task reads row n of W₁, then of W₃, and gates its own rows)
at::Tensor gated_matvec(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& s1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w3, const std::optional<at::Tensor>& s3,
                        const std::optional<at::Tensor>& b3, int64_t act) {
  const int64_t M = check("gated_matvec", x, w1, s1, b1), N = w1.size(0), K = x.size(-1);
  check("gated_matvec", x, w3, s3, b3);
  ATTNLAB_CHECK(w3.sizes() == w1.sizes() && w3.scalar_type() == w1.scalar_type() &&
                  (w1.scalar_type() != at::kByte || s3->sizes() == s1->sizes()),
                "attnlab::gated_matvec: w1 and w3 must have the same shape and dtype (int4: and groups), got ", w1.sizes(),
                " ",
                w1.scalar_type(), " and ", w3.sizes(), " ", w3.scalar_type());
  ATTNLAB_CHECK(is_gate(act), "attnlab::gated_matvec: act must be 0 (sigmoid), 1 (gelu), 2 (gelu_tanh), 3 (silu) "
                "or 6 (relu²), got ", act);
  at::Tensor y = output(x, N);
  if (M == 0 || N == 0) return y.zero_();
  at::Tensor y3 = at::empty({M, N}, x.options());
  const Prepared p = prepare(x, w1.scalar_type(), M, K);
  const Job j1 = job(p, x, w1, s1, b1, y.data_ptr<float>(), M, N, K);
  const Job j3 = job(p, x, w3, s3, b3, y3.data_ptr<float>(), M, N, K);
  at::parallel_for(0, N, grain(2 * w1.size(1) * w1.element_size()), [&](int64_t n0, int64_t n1) {
    p.fn(j1, n0, n1);
    p.fn(j3, n0, n1);
    for (int64_t m = 0; m < M; ++m) activate(act, j1.y + m * N + n0, j3.y + m * N + n0, n1 - n0);
  });
  mark_nonfinite(p, y.data_ptr<float>(), N);
  return y;
}

// the float32 (N, K) that an int4 w (N, ⌈K/128⌉ · 64) and its group scales (N, K / G) stand for
at::Tensor int4_dequantize(const at::Tensor& w, const at::Tensor& scale, int64_t K) {
  ATTNLAB_CHECK(K > 0, "attnlab::int4_dequantize: K must be positive, got ", K);
  ATTNLAB_CHECK(w.scalar_type() == at::kByte, "attnlab::int4_dequantize: w must be uint8 (int4 pairs), got ",
                w.scalar_type());
  check_weight("int4_dequantize", w, scale, std::nullopt, K);
  at::Tensor out = at::empty({w.size(0), K}, scale.options());
  dequantize_int4(w, scale, K, 0, w.size(0), out.data_ptr<float>());
  return out;
}

// attnlab::cpu_isa() -> the instruction set every kernel uses (native.h: 2 AVX-512, 1 AVX2 + FMA, 0 portable C++)
int64_t cpu_isa_op() { return cpu_isa(); }

// attnlab::limit_isa(isa) -> cpu_isa() after it: the kernels use at most set `isa` (0-2; 2 lifts the limit) — only
// ever lower than what the CPU and ATEN_CPU_CAPABILITY allow, so a test runs each lower set's kernels in one process
int64_t limit_isa(int64_t isa) {
  ATTNLAB_CHECK(0 <= isa && isa <= 2, "attnlab::limit_isa: isa must be 0 (portable), 1 (AVX2) or 2 (AVX-512), got ",
                isa);
  isa_limit().store(isa, std::memory_order_relaxed);
  return cpu_isa();
}

}  // namespace attnlab_native

TORCH_LIBRARY(attnlab, m) {
  // (no tensors: one kernel for every dispatch key)
  m.def("cpu_isa() -> int", &attnlab_native::cpu_isa_op);
  m.def("limit_isa(int isa) -> int", &attnlab_native::limit_isa);
  m.def("matvec(Tensor x, Tensor w, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor w, Tensor scale, int K) -> Tensor");
  m.def("gated_matvec(Tensor x, Tensor w1, Tensor? s1, Tensor? b1, Tensor w3, Tensor? s3, Tensor? b3, int act) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("matvec", &attnlab_native::matvec);
  m.impl("int4_dequantize", &attnlab_native::int4_dequantize);
  m.impl("gated_matvec", &attnlab_native::gated_matvec);
}
