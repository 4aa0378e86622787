// The int8 products of attnlab.adapt.int8_training's layers: the roundings, the product and its rescaling, the
// layer's forward and backward, each one call:
//
//   attnlab::quantize_rows(x, c, levels) -> (q, s)
//       x (R, n), c (n,) float32 or absent (1): s_r = max_j |x_rj c_j| / k, q_rj = round(x_rj c_j / s_r) ∈ [−k, k]
//       int8 (k = levels; round half to even; a zero row: s 0, q 0; a row with a NaN or an infinity: s NaN, q 0)
//   attnlab::quantize_rows_cols(x, c, levels, col_levels) -> (q, s, qc, sc, sum)
//       quantize_rows, and in the same two reads of x the same with one scale per column and no c (sc_j =
//       max_r |x_rj| / k'), written transposed: qct (n, R) int8, qct_jr = round(x_rj / sc_j) (the contiguous
//       operand of a product over the rows, ∂L/∂W = Gᵀ X); and sum_j = Σ_r x_rj float32 (blocks of 32 rows, then
//       the blocks in order: the same bits on any thread count)
//   attnlab::dequantize(acc, rs, cs, b, bf16) -> y
//       acc (R, n) int32 (an int8 product): y_rj = acc_rj (rs_r cs_j) + b_j (cs absent: 1, b absent: 0), float32
//       or bfloat16
//   attnlab::int8_product(a, b, rs, cs, bias, bf16, max_inner) -> y
//       y = diag(rs) (a b) diag(cs) + bias for int8 a (M, K), b (K, N): torch._int_mm's exact int32 sums, in parts
//       of max_inner terms along K (each rescaled, the parts summed in float32) where an int32 could overflow
//   attnlab::int8_linear(x, w, b, left, right, cols, bf16) -> (y, qw, sw, qxt, sxc)
//       an int8 linear layer's forward (attnlab/adapt/int8_training.py): x by rows to ±left, w by rows to ±right,
//       y = diag(s_x) (q(x) q(w)ᵀ) diag(s_w) + b; with `cols` also x by columns to ±right, transposed (qxt, sxc:
//       the weight gradient's operand; qxt (in, T) contiguous, or where that product is int8_gemm.h's the (in, T)
//       view of the rounding written as x lies, no transposing pass), else qxt and sxc empty
//   attnlab::int8_linear_backward(g, qw, sw, qxt, sxc, left, right, dx, dw, db, dx_bf16) -> (dx, dw, db)
//       its gradients: Z = g diag(s_w) by rows, dx = diag(s_z) (q(Z) q(w)); g by columns transposed, dw =
//       diag(s_g) (q(g)ᵀ q(x)) diag(s_x cols); db = Σ_rows g; each only where asked for (else empty)
//   attnlab::int8_cols_laid(rows, left, right) -> bool
//       whether int8_linear with cols lays qxt as the (in, T) view of a (T, in) rounding (else contiguous)
//   attnlab::int8_kernel(mode) -> previous mode
//       which product int8_product runs with AVX2 (-1 auto, 0 torch._int_mm, 1 int8_gemm.h's; -2 only asks)
//
// Rows are split over torch's threads; the vector code is the library's instruction set
// (native.h's cpu_isa(), isa_regions.h). A NaN stays a NaN through every pass (the pipeline reports it).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "train.h"

namespace {

#define ATTNLAB_BODY "int8_rows.h"
#include "isa_regions.h"
#include "int8_gemm.h"

using namespace attnlab_native;

void check_levels(int64_t levels, const char* op) {
  ATTNLAB_CHECK(1 <= levels && levels <= 127, "attnlab::", op, ": levels must be in [1, 127], got ", levels);
}

// the scale of a row or column whose largest |value| is m, and its inverse (0 for a zero row, NaN for NaN or ∞)
std::pair<float, float> scale_of(float m, int64_t levels) {
  if (!std::isfinite(m)) return {NAN, 0.f};
  if (m == 0.f) return {0.f, 0.f};
  return {m / static_cast<float>(levels), static_cast<float>(levels) / m};
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const std::optional<at::Tensor>& c,
                                                 int64_t levels) {
  check_fb(x, "quantize_rows", "x");
  check_levels(levels, "quantize_rows");
  ATTNLAB_CHECK(x.dim() == 2, "attnlab::quantize_rows: x must be (rows, n), got ", x.sizes());
  const int64_t R = x.size(0), n = x.size(1);
  if (c) {
    attnlab_native::check_f32(*c, "quantize_rows", "c");
    ATTNLAB_CHECK(c->dim() == 1 && c->size(0) == n, "attnlab::quantize_rows: c must be (", n, ",), got ", c->sizes());
  }
  at::Tensor q = at::empty({R, n}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({R}, x.options().dtype(at::kFloat));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* X = data<T>(x);
    const float* C = c ? c->data_ptr<float>() : nullptr;
    int8_t* Q = q.data_ptr<int8_t>();
    float* S = s.data_ptr<float>();
    const auto amax = ISA_FN(absmax_row<T>);
    const auto quant = ISA_FN(quantize_row<T>);
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const auto [scale, inv] = scale_of(amax(X + r * n, C, n), levels);
        S[r] = scale;
        if (inv == 0.f) {
          if (n) std::memset(Q + r * n, 0, n);
        } else {
          quant(X + r * n, C, n, inv, Q + r * n);
        }
      }
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {q, s};
}

// (transposed false: the columns' rounding written as x lies, qc (R, n) contiguous, returned as its (n, R) view qc.t()
// — the same values without the transposing pass, for a product that reads either layout: int8_gemm.h's)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows_cols_laid(
    const at::Tensor& x, const std::optional<at::Tensor>& c, int64_t levels, int64_t col_levels, bool transposed) {
  check_fb(x, "quantize_rows_cols", "x");
  check_levels(levels, "quantize_rows_cols");
  check_levels(col_levels, "quantize_rows_cols");
  ATTNLAB_CHECK(x.dim() == 2, "attnlab::quantize_rows_cols: x must be (rows, n), got ", x.sizes());
  const int64_t R = x.size(0), n = x.size(1);
  if (c) {
    attnlab_native::check_f32(*c, "quantize_rows_cols", "c");
    ATTNLAB_CHECK(c->dim() == 1 && c->size(0) == n, "attnlab::quantize_rows_cols: c must be (", n, ",), got ",
                  c->sizes());
  }
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor q = at::empty({R, n}, x.options().dtype(at::kChar));
  at::Tensor qct = transposed ? at::empty({n, R}, q.options()) : at::empty({R, n}, q.options());
  at::Tensor s = at::empty({R}, f32), sc = at::empty({n}, f32), sum = at::empty({n}, f32);
  // pass 1: each block of rows its rows' maxima and its columns' partial maxima and sums (a fixed partition: the
  // same bits on any thread count); then the columns over the blocks in order. Pass 2: both roundings in one read.
  // (The scratch is plain memory: 32 calls a step of nanogpt-cpu, each ATen allocation a dispatch)
  constexpr int64_t block = 32;
  const int64_t blocks = std::max<int64_t>(1, (R + block - 1) / block);
  // (the partials uninitialised here: each block zeroes its own rows on its thread)
  std::vector<float> inv(R), cinv(n), mx(n, 0.f);
  const std::unique_ptr<float[]> pm(new float[blocks * n]), ps(new float[blocks * n]);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* X = data<T>(x);
    const float* C = c ? c->data_ptr<float>() : nullptr;
    float *S = s.data_ptr<float>(), *SC = sc.data_ptr<float>(), *SUM = sum.data_ptr<float>();
    float *INV = inv.data(), *CINV = cinv.data(), *PM = pm.get(), *PS = ps.get(), *MX = mx.data();
    const auto stats = ISA_FN(row_col_stats<T>);
    at::parallel_for(0, blocks, std::max<int64_t>(1, grain / block), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        std::fill(PM + b * n, PM + (b + 1) * n, 0.f), std::fill(PS + b * n, PS + (b + 1) * n, 0.f);
        for (int64_t r = b * block; r < std::min(R, (b + 1) * block); ++r) {
          std::tie(S[r], INV[r]) = scale_of(stats(X + r * n, C, n, PM + b * n, PS + b * n), levels);
        }
      }
    });
    // the columns over the blocks in order, a block's row at a time (contiguous: the loop over columns vectorises;
    // each column's max and sum still taken in the blocks' order, so the same bits as column by column)
    std::fill(SUM, SUM + n, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float *pmb = PM + b * n, *psb = PS + b * n;
      for (int64_t j = 0; j < n; ++j) MX[j] = std::max(MX[j], pmb[j]), SUM[j] += psb[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      std::tie(SC[j], CINV[j]) = scale_of(std::isnan(SUM[j]) ? NAN : MX[j], col_levels);
    }
    bool bad = false;  // a column with a NaN or an infinity gets q 0 like such a row (its x · 0 is NaN)
    for (int64_t j = 0; j < n; ++j) bad |= std::isnan(SC[j]);
    int8_t *Q = q.data_ptr<int8_t>(), *QCT = qct.data_ptr<int8_t>();
    const auto quant = ISA_FN(quantize_row_col<T>);
    const auto transpose = ISA_FN(transpose_bytes);
    constexpr int64_t tile = 64;  // rows rounded by columns into a buffer, then written transposed: 64 bytes a line
    at::parallel_for(0, (R + tile - 1) / tile, std::max<int64_t>(1, grain / tile), [&](int64_t t0, int64_t t1) {
      std::vector<int8_t> buf(transposed ? tile * n : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * tile, rows = std::min(tile, R - r0);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = r0 + i;
          int8_t* qc = transposed ? buf.data() + i * n : QCT + r * n;
          quant(X + r * n, C, n, INV[r], CINV, Q + r * n, qc);
          if (INV[r] == 0.f) std::memset(Q + r * n, 0, n);
          for (int64_t j = 0; bad && j < n; ++j) {
            if (std::isnan(SC[j])) qc[j] = 0;
          }
        }
        if (transposed) transpose(buf.data(), n, rows, n, QCT + r0, R);
      }
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {q, s, transposed ? qct : qct.t(), sc, sum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows_cols(
    const at::Tensor& x, const std::optional<at::Tensor>& c, int64_t levels, int64_t col_levels) {
  return quantize_rows_cols_laid(x, c, levels, col_levels, true);
}

// the rescaling of an (R, n) int32 product: rs (R,), cs and b (n,) or absent, contiguous float32
void check_scales(const at::Tensor& rs, const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& b,
                  int64_t R, int64_t n, const char* op) {
  attnlab_native::check_f32(rs, op, "rs");
  ATTNLAB_CHECK(rs.dim() == 1 && rs.size(0) == R, "attnlab::", op, ": rs must be (", R, ",), got ", rs.sizes());
  for (const auto* t : {&cs, &b}) {
    if (*t) {
      attnlab_native::check_f32(**t, op, t == &cs ? "cs" : "b");
      ATTNLAB_CHECK((*t)->dim() == 1 && (*t)->size(0) == n, "attnlab::", op, ": ", t == &cs ? "cs" : "b",
                    " must be (", n, ",), got ", (*t)->sizes());
    }
  }
}

at::Tensor dequantize(const at::Tensor& acc, const at::Tensor& rs, const std::optional<at::Tensor>& cs,
                      const std::optional<at::Tensor>& b, bool bf16) {
  ATTNLAB_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
                "attnlab::dequantize: acc must be a contiguous int32 CPU tensor (rows, n), got ", acc.scalar_type(),
                " ", acc.sizes());
  const int64_t R = acc.size(0), n = acc.size(1);
  check_scales(rs, cs, b, R, n, "dequantize");
  at::Tensor y = at::empty({R, n}, acc.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const int32_t* A = acc.data_ptr<int32_t>();
    const float *RS = rs.data_ptr<float>(), *CS = cs ? cs->data_ptr<float>() : nullptr;
    const float* B = b ? b->data_ptr<float>() : nullptr;
    T* Y = data<T>(y);
    const auto row = ISA_FN(dequant_row<T>);
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row(A + r * n, RS[r], CS, B, n, Y + r * n);
    });
  };
  bf16 ? run(uint16_t{}) : run(float{});
  return y;
}

// Which product int8_product takes with AVX2 (isa 1): kOneDnn torch._int_mm, kOurs int8_gemm.h's, kAuto (the
// default) ours where oneDNN has no VNNI instruction (vpdpbusd: 32 multiply-adds in one instruction, where ours takes
// two) — a CPU without AVX-VNNI or AVX512-VNNI, or oneDNN capped by ONEDNN_MAX_CPU_ISA to AVX2 or below
enum Int8Kernel : int64_t { kAuto = -1, kOneDnn = 0, kOurs = 1 };
std::atomic<int64_t> int8_kernel_mode{kAuto};

bool onednn_has_vnni() {
  static const bool has = [] {
#if defined(__x86_64__) || defined(_M_X64)
    if (!__builtin_cpu_supports("avx512vnni") && !__builtin_cpu_supports("avxvnni")) return false;
#else
    return true;  // (ours is x86 only)
#endif
    for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
      const char* cap = std::getenv(name);
      if (!cap) continue;
      std::string v(cap);
      for (auto& ch : v) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      if (v == "SSE41" || v == "AVX" || v == "AVX2") return false;
    }
    return true;
  }();
  return has;
}

// sets the mode (kAuto, kOneDnn, kOurs; −2 leaves it) and returns the one before
int64_t int8_kernel(int64_t mode) {
  ATTNLAB_CHECK(mode >= -2 && mode <= 1, "attnlab::int8_kernel: mode must be -2 (ask), -1 (auto), 0 (oneDNN) or 1 "
                "(ours), got ", mode);
  return mode == -2 ? int8_kernel_mode.load() : int8_kernel_mode.exchange(mode);
}

// whether int8_product takes int8_gemm.h's product for K terms a sum: AVX2, the int8_kernel setting, K's size
bool ours_takes(int64_t K, int64_t max_inner) {
#ifdef ATTNLAB_ISAS
  const int64_t mode = int8_kernel_mode.load(std::memory_order_relaxed);
  return attnlab_native::cpu_isa() == 1 && (mode == kOurs || (mode == kAuto && !onednn_has_vnni())) &&
         K <= std::min(max_inner, u8s8::MAX_K);
#else
  return false;
#endif
}

// whether it takes it for int8 a (M, K) and b (K, N) (where b lies within ±63): ours_takes, and a's layout and size
bool ours_for(const at::Tensor& a, const at::Tensor& b, int64_t max_inner) {
  return ours_takes(a.size(1), max_inner) && a.stride(1) == 1 && a.size(0) > 0 && b.size(1) > 0;
}

// torch._int_mm's sums. oneDNN's VNNI path (torch 2.13, AVX512-VNNI) reads memory it never wrote for an
// operand of one row or one column whose strides are not the plain ones ((33, 1).t(): sizes (1, 33), strides (1, 1),
// which torch calls contiguous: a known oneDNN-path bug, pytorch/pytorch#195066, open); such an operand is a vector,
// copied here with the plain strides first.
at::Tensor int_mm(const at::Tensor& a, const at::Tensor& b) {
  auto plain = [](const at::Tensor& t) {
    const bool vector = t.size(0) == 1 || t.size(1) == 1;
    return vector && (t.stride(0) != t.size(1) || t.stride(1) != 1) ? t.clone(at::MemoryFormat::Contiguous) : t;
  };
  return at::_int_mm(plain(a), plain(b));
}

// int8_product, with res (where given: float32 (M, N) contiguous, bf16 false) added to the result: res + y, each sum
// rounded once after y's (our product adds it in its rescaling; oneDNN's path in place after)
at::Tensor int8_product_plus(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                             const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                             int64_t max_inner, const at::Tensor* res) {
  ATTNLAB_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kChar && a.dim() == 2 && b.dim() == 2 &&
                    a.size(1) == b.size(0),
                "attnlab::int8_product: a (M, K) and b (K, N) must be int8, got ", a.scalar_type(), " ", a.sizes(),
                " and ", b.scalar_type(), " ", b.sizes());
  ATTNLAB_CHECK(max_inner >= 1, "attnlab::int8_product: max_inner must be >= 1, got ", max_inner);
  attnlab_native::check_not_expanded(a, "int8_product", "a");
  attnlab_native::check_not_expanded(b, "int8_product", "b");
  ATTNLAB_CHECK(!res || (!bf16 && res->scalar_type() == at::kFloat && res->is_contiguous() && res->dim() == 2 &&
                         res->size(0) == a.size(0) && res->size(1) == b.size(1)),
                "attnlab::int8_product: a residual must be float32 (M, N) contiguous with a float32 result");
  const int64_t K = a.size(1);
#ifdef ATTNLAB_ISAS
  if (ours_for(a, b, max_inner)) {
    // AVX2 without VNNI: our product with the rescaling fused (int8_gemm.h), where b's entries lie within ±63
    const int64_t M = a.size(0), N = b.size(1);
    check_scales(rs, cs, bias, M, N, "int8_product");
    at::Tensor y = at::empty({M, N}, rs.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    const float *RS = rs.data_ptr<float>(), *CS = cs ? cs->data_ptr<float>() : nullptr;
    const float* BIAS = bias ? bias->data_ptr<float>() : nullptr;
    const int8_t *A = a.data_ptr<int8_t>(), *B = b.data_ptr<int8_t>();
    const bool done = bf16 ? u8s8::product(A, a.stride(0), M, K, B, b.stride(0), b.stride(1), N, RS, CS, BIAS,
                                           data<uint16_t>(y))
                           : u8s8::product(A, a.stride(0), M, K, B, b.stride(0), b.stride(1), N, RS, CS, BIAS,
                                           data<float>(y), res ? res->data_ptr<float>() : nullptr);
    if (done) return y;
  }
#endif
  if (res) return int8_product_plus(a, b, rs, cs, bias, bf16, max_inner, nullptr).add_(*res);
  if (K <= max_inner) return dequantize(int_mm(a, b), rs, cs, bias, bf16);
  at::Tensor out;
  for (int64_t k0 = 0; k0 < K; k0 += max_inner) {
    const int64_t k1 = std::min(K, k0 + max_inner);
    at::Tensor part = dequantize(int_mm(a.slice(1, k0, k1), b.slice(0, k0, k1)), rs, cs,
                                 k0 == 0 ? bias : std::nullopt, false);
    out = k0 == 0 ? part : out.add_(part);
  }
  return bf16 ? out.to(at::kBFloat16) : out;
}

at::Tensor int8_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                        const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                        int64_t max_inner) {
  return int8_product_plus(a, b, rs, cs, bias, bf16, max_inner, nullptr);
}

}  // namespace

namespace attnlab_native {

// the longest sum of products of ±left and ±right integers an int32 holds exactly
int64_t max_terms(int64_t left, int64_t right) {
  check_levels(left, "int8_linear"), check_levels(right, "int8_linear");
  return ((int64_t{1} << 31) - 1) / (left * right);
}

// int8_linear, with bound (where given) set to a bound of |y| and res (where given: float32 (T, out) contiguous, bf16
// false) added to y as int8_product_plus adds it
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_linear_bounded(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t left, int64_t right,
    bool cols, bool bf16, double* bound, const at::Tensor* res) {
  check_fb(x, "int8_linear", "x");
  attnlab_native::check_f32(w, "int8_linear", "w");
  ATTNLAB_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1),
                "attnlab::int8_linear: x (T, in) and w (out, in) must agree, got ", x.sizes(), " and ", w.sizes());
  auto [qw, sw] = quantize_rows(w, std::nullopt, right);
  at::Tensor qx, sx, qxt, sxc;
  if (cols) {
    // qxt: the right operand qxt.t() (T, in) of the weight gradient's product over the T tokens; where that product
    // is ours (it reads either layout) x's rows as they lie, else transposed (oneDNN's VNNI path reads it fastest so)
    const bool laid = ours_takes(x.size(0), max_terms(left, right));
    std::tie(qx, sx, qxt, sxc, std::ignore) = quantize_rows_cols_laid(x, std::nullopt, left, right, !laid);
  } else {
    std::tie(qx, sx) = quantize_rows(x, std::nullopt, left);
    qxt = at::empty({0}, qx.options()), sxc = at::empty({0}, sx.options());
  }
  at::Tensor y = int8_product_plus(qx, qw.t(), sx, sw, b, bf16, max_terms(left, right), res);
  if (bound) {  // |y| ≤ K · left · right · max s_x · max s_w + max |b| (the integer sums' bound); NaN if one is not finite
    const auto amax = [&](const at::Tensor& t) {  // (NaN where an entry is NaN or infinite)
      return static_cast<double>(ISA_FN(absmax_row<float>)(t.data_ptr<float>(), nullptr, t.numel()));
    };
    *bound = static_cast<double>(x.size(1)) * left * right * amax(sx) * amax(sw) + (b ? amax(*b) : 0.0);
  }
  return {y, qw, sw, qxt, sxc};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_linear(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t left, int64_t right,
    bool cols, bool bf16) {
  return int8_linear_bounded(x, w, b, left, right, cols, bf16, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_linear_backward(
    const at::Tensor& g, const at::Tensor& qw, const at::Tensor& sw, const at::Tensor& qxt, const at::Tensor& sxc,
    int64_t left, int64_t right, bool dx, bool dw, bool db, bool dx_bf16) {
  check_fb(g, "int8_linear_backward", "g");
  ATTNLAB_CHECK(g.dim() == 2 && qw.dim() == 2 && g.size(1) == qw.size(0), "attnlab::int8_linear_backward: g (T, out) ",
                "and qw (out, in) must agree, got ", g.sizes(), " and ", qw.sizes());
  ATTNLAB_CHECK(qw.scalar_type() == at::kChar, "attnlab::int8_linear_backward: qw must be int8, got ",
                qw.scalar_type());
  ATTNLAB_CHECK(!dw || (qxt.scalar_type() == at::kChar && qxt.dim() == 2 && qxt.size(0) == qw.size(1) &&
                        qxt.size(1) == g.size(0)),
                "attnlab::int8_linear_backward: qxt must be int8 (", qw.size(1), ", ", g.size(0), ") for dw, got ",
                qxt.scalar_type(), " ", qxt.sizes());
  ATTNLAB_CHECK(!dw || (sxc.device().is_cpu() && sxc.scalar_type() == at::kFloat && sxc.is_contiguous() &&
                        sxc.dim() == 1 && sxc.size(0) == qw.size(1)),
                "attnlab::int8_linear_backward: sxc must be a contiguous float32 CPU tensor (", qw.size(1),
                ",) for dw, got ", sxc.scalar_type(), " ", sxc.sizes());
  const int64_t max_inner = max_terms(left, right);  // (operands checked before the rounding pass runs)
  at::Tensor qz, sz, qgt, sg, gsum, none = at::empty({0}, g.options().dtype(at::kFloat));
  if (dw || db) {
    std::tie(qz, sz, qgt, sg, gsum) = quantize_rows_cols(g, sw, left, left);  // G diag(s_w) by rows, Gᵀ
  } else {
    std::tie(qz, sz) = quantize_rows(g, sw, left);  // a frozen layer: only ∂L/∂X
  }
  at::Tensor dxv = none, dwv = none;
  const auto run_dx = [&] { dxv = int8_product(qz, qw, sz, std::nullopt, std::nullopt, dx_bf16, max_inner); };
  const auto run_dw = [&] { dwv = int8_product(qgt, qxt.t(), sg, sxc, std::nullopt, false, max_inner); };
  const bool two = dx && dw && at::get_num_threads() == 2 && !at::in_parallel_region();
#ifdef ATTNLAB_ISAS
  if (two && ours_for(qz, qw, max_inner) && ours_for(qgt, qxt.t(), max_inner)) {
    // int8_gemm.h's two products sharing the two threads (u8s8::product_pair): the same bits as one a thread, no
    // core waiting for the other's product
    const int64_t T = g.size(0), in = qw.size(1), out = qw.size(0);
    const auto f32 = g.options().dtype(at::kFloat);
    dxv = at::empty({T, in}, dx_bf16 ? f32.dtype(at::kBFloat16) : f32), dwv = at::empty({out, in}, f32);
    const u8s8::Job jobs[2] = {
        {qz.data_ptr<int8_t>(), qz.stride(0), T, out, qw.data_ptr<int8_t>(), qw.stride(0), qw.stride(1), in,
         sz.data_ptr<float>(), nullptr, nullptr, dx_bf16 ? nullptr : dxv.data_ptr<float>(),
         dx_bf16 ? data<uint16_t>(dxv) : nullptr},
        {qgt.data_ptr<int8_t>(), qgt.stride(0), out, T, qxt.data_ptr<int8_t>(), qxt.stride(1), qxt.stride(0), in,
         sg.data_ptr<float>(), sxc.data_ptr<float>(), nullptr, dwv.data_ptr<float>(), nullptr}};
    bool done[2];
    u8s8::product_pair(jobs, done);
    if (!done[0]) run_dx();
    if (!done[1]) run_dw();
    return {dxv, dwv, db ? gsum : none};
  }
#endif
  if (two) {
    // on 2 threads, where the products are oneDNN's (not shared above), one a thread, each whole on its core
    // (oneDNN and our passes run single-threaded inside a parallel region): neither product split, one meeting
    // point: at nanogpt-cpu's shapes faster than one after the other on both threads (either ISA)
    const at::ThreadLocalState state;
    at::parallel_for(0, 2, 1, [&](int64_t t0, int64_t t1) {
      const at::ThreadLocalStateGuard guard(state);
      for (int64_t t = t0; t < t1; ++t) t == 0 ? run_dx() : run_dw();
    });
  } else {
    if (dx) run_dx();
    if (dw) run_dw();
  }
  return {dxv, dwv, db ? gsum : none};
}

// whether int8_linear with `cols` lays qxt as the (in, T) view of a (T, in) rounding of T = rows rows (the weight
// gradient's product is then int8_gemm.h's, which reads either layout) rather than contiguous: what its fake
// (attnlab/_native_library.py) asks to give the real op's strides
bool int8_cols_laid(int64_t rows, int64_t left, int64_t right) { return ours_takes(rows, max_terms(left, right)); }

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("quantize_rows(Tensor x, Tensor? c, int levels) -> (Tensor, Tensor)");
  m.def("quantize_rows_cols(Tensor x, Tensor? c, int levels, int col_levels) -> (Tensor, Tensor, Tensor, "
        "Tensor, Tensor)");
  m.def("dequantize(Tensor acc, Tensor rs, Tensor? cs, Tensor? b, bool bf16) -> Tensor");
  m.def("int8_product(Tensor a, Tensor b, Tensor rs, Tensor? cs, Tensor? bias, bool bf16, int max_inner) "
        "-> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor? b, int left, int right, bool cols, bool bf16) -> (Tensor, "
        "Tensor, Tensor, Tensor, Tensor)");
  m.def("int8_linear_backward(Tensor g, Tensor qw, Tensor sw, Tensor qxt, Tensor sxc, int left, int right, bool dx, "
        "bool dw, bool db, bool dx_bf16) -> (Tensor, Tensor, Tensor)");
  m.def("int8_cols_laid(int rows, int left, int right) -> bool", &attnlab_native::int8_cols_laid);  // (no tensors, as int8_kernel)
  m.def("int8_kernel(int mode) -> int", &int8_kernel);  // (no tensors: one kernel for every dispatch key)
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("quantize_rows_cols", &quantize_rows_cols);
  m.impl("dequantize", &dequantize);
  m.impl("int8_product", &int8_product);
  m.impl("int8_linear", &attnlab_native::int8_linear);
  m.impl("int8_linear_backward", &attnlab_native::int8_linear_backward);
}
