// The int8 roundings of attnlab.adapt.int8_training's layers (int8_product.cpp multiplies what they round,
// int8_train.cpp is the layer), each one call:
//
//   attnlab::quantize_rows(x, c, levels) -> (q, s)
//       x (R, n), c (n,) float32 or absent (1): s_r = max_j |x_rj c_j| / k, q_rj = round(x_rj c_j / s_r) ∈ [−k, k]
//       int8 (k = levels; round half to even; a zero row: s 0, q 0; a row with a NaN or an infinity: s NaN, q 0)
//   attnlab::quantize_rows_cols(x, c, levels, col_levels) -> (q, s, qc, sc, sum)
//       quantize_rows, and in the same two reads of x the same with one scale per column and no c (sc_j =
//       max_r |x_rj| / k'), written transposed: qct (n, R) int8, qct_jr = round(x_rj / sc_j) (the contiguous
//       operand of a product over the rows, ∂L/∂W = Gᵀ X); and sum_j = Σ_r x_rj float32 (blocks of 32 rows, then
//       the blocks in order: the same bits on any thread count)
//
// Rows are split over torch's threads; the vector code is the library's instruction set
// (native.h's cpu_isa(), isa_regions.h). A NaN stays a NaN through every pass (the pipeline reports it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "train.h"

namespace {

#define ATTNLAB_BODY "int8_rows.h"
#include "isa_regions.h"

using namespace attnlab_native;

// the scale of a row or column whose largest |value| is m, and its inverse (0 for a zero row, NaN for NaN or ∞)
std::pair<float, float> scale_of(float m, int64_t levels) {
  if (!std::isfinite(m)) return {NAN, 0.f};
  if (m == 0.f) return {0.f, 0.f};
  return {m / static_cast<float>(levels), static_cast<float>(levels) / m};
}

}  // namespace

namespace attnlab_native {

void check_levels(int64_t levels, const char* op) {
  ATTNLAB_CHECK(1 <= levels && levels <= 127, "attnlab::", op, ": levels must be in [1, 127], got ", levels);
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

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("quantize_rows(Tensor x, Tensor? c, int levels) -> (Tensor, Tensor)");
  m.def("quantize_rows_cols(Tensor x, Tensor? c, int levels, int col_levels) -> (Tensor, Tensor, Tensor, "
        "Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("quantize_rows", &attnlab_native::quantize_rows);
  m.impl("quantize_rows_cols", &attnlab_native::quantize_rows_cols);
}
