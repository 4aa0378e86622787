// Element-wise passes of a training step on the CPU, each one call that reads and writes float32 or bfloat16 (the
// arithmetic in float32) instead of several PyTorch operations with casts between them (under bf16 autocast
// PyTorch's element-wise kernels on bf16 cost several times their float32 time):
//
//   attnlab::softmax_rows(s, scale, causal, window, cast) -> (p, p_cast)
//       s (G, Lq, Lk) scores; row i of each matrix sits at position t = i + Lk − Lq and sees the keys [lo, hi) of
//       causal (hi = t + 1) and window w (lo = t − w + 1; without causal hi = t + w):
//       p_ij = e^(κ s_ij − m_i) / Σ_k e^(κ s_ik − m_i) on them, m_i = max_k κ s_ik, 0 elsewhere (all 0: no key);
//       p float32, and with `cast` p again in s's dtype (the operand of P V).         (the short backend's forward)
//   attnlab::softmax_rows_backward(dp, p, scale) -> ds
//       ds_ij = κ p_ij (dp_ij − Σ_k dp_ik p_ik), in dp's dtype (κ folded in: dQ = dS K, dK = dSᵀ Q)
//
// Rows are split over torch's threads; the vector code is the caller's instruction set
// (isa_regions.h). A NaN stays a NaN through every pass (the pipeline reports it).
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
#include <tuple>

#include "native.h"

namespace {

#define ATTNLAB_BODY "train_body.h"
#include "isa_regions.h"

// contiguous float32 or bfloat16 on the CPU
void check_fb(const at::Tensor& t, const char* op, const char* name) {
  ATTNLAB_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous(),
                "attnlab::", op, ": ", name, " must be a contiguous float32 or bfloat16 CPU tensor, got ",
                t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

template <class T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

std::tuple<at::Tensor, at::Tensor> softmax_rows(const at::Tensor& s, double scale, bool causal, int64_t window,
                                                bool cast, int64_t isa) {
  check_fb(s, "softmax_rows", "s");
  ATTNLAB_CHECK(s.dim() == 3, "attnlab::softmax_rows: s must be (G, Lq, Lk), got ", s.sizes());
  at::Tensor p = at::empty(s.sizes(), s.options().dtype(at::kFloat));
  at::Tensor pc = cast && s.scalar_type() != at::kFloat ? at::empty_like(s) : at::empty({0}, s.options());
  const int64_t G = s.size(0), Lq = s.size(1), Lk = s.size(2), off = Lk - Lq;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, Lk));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* S = data<T>(s);
    float* P = p.data_ptr<float>();
    T* PC = pc.numel() ? data<T>(pc) : nullptr;
    const auto row = ISA_FN(softmax_row<T>);
    at::parallel_for(0, G * Lq, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t t = r % Lq + off;
        const int64_t lo = std::clamp<int64_t>(window > 0 ? t - window + 1 : 0, 0, Lk);
        const int64_t hi = std::clamp<int64_t>(causal ? t + 1 : (window > 0 ? t + window : Lk), lo, Lk);
        row(S + r * Lk, Lk, lo, hi, static_cast<float>(scale), P + r * Lk, PC ? PC + r * Lk : nullptr);
      }
    });
  };
  s.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {p, pc};
}

at::Tensor softmax_rows_backward(const at::Tensor& dp, const at::Tensor& p, double scale, int64_t isa) {
  check_fb(dp, "softmax_rows_backward", "dp");
  attnlab_native::check_f32(p, "softmax_rows_backward", "p");
  ATTNLAB_CHECK(dp.sizes() == p.sizes() && p.dim() == 3, "attnlab::softmax_rows_backward: dp and p must be the same ",
                "(G, Lq, Lk), got ", dp.sizes(), " and ", p.sizes());
  const int64_t rows = p.size(0) * p.size(1), n = p.size(2);
  at::Tensor ds = at::empty_like(dp);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, n));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* DP = data<T>(dp);
    const float* P = p.data_ptr<float>();
    T* DS = data<T>(ds);
    const auto row = ISA_FN(softmax_grad_row<T>);
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row(DP + r * n, P + r * n, n, static_cast<float>(scale), DS + r * n);
    });
  };
  dp.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return ds;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("softmax_rows(Tensor s, float scale, bool causal, int window, bool cast, int isa) -> (Tensor, Tensor)");
  m.def("softmax_rows_backward(Tensor dp, Tensor p, float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("softmax_rows", &softmax_rows);
  m.impl("softmax_rows_backward", &softmax_rows_backward);
}
