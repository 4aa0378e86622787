// The int8 linear layer of attnlab.adapt.int8_training, forward and backward, each one call, made of
// int8_quantize.cpp's roundings and int8_product.cpp's products:
//
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
//
// Rows are split over torch's threads; the vector code is the library's instruction set
// (native.h's cpu_isa(), isa_regions.h). A NaN stays a NaN through every pass (the pipeline reports it).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
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
    const bool laid = own_int8_takes(x.size(0), max_terms(left, right));
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
  if (two && own_int8_for(qz, qw, max_inner) && own_int8_for(qgt, qxt.t(), max_inner)) {
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
bool int8_cols_laid(int64_t rows, int64_t left, int64_t right) { return own_int8_takes(rows, max_terms(left, right)); }

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor? b, int left, int right, bool cols, bool bf16) -> (Tensor, "
        "Tensor, Tensor, Tensor, Tensor)");
  m.def("int8_linear_backward(Tensor g, Tensor qw, Tensor sw, Tensor qxt, Tensor sxc, int left, int right, bool dx, "
        "bool dw, bool db, bool dx_bf16) -> (Tensor, Tensor, Tensor)");
  m.def("int8_cols_laid(int rows, int left, int right) -> bool", &attnlab_native::int8_cols_laid);  // (no tensors, as int8_kernel)
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("int8_linear", &attnlab_native::int8_linear);
  m.impl("int8_linear_backward", &attnlab_native::int8_linear_backward);
}
