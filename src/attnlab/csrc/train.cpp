// Element-wise passes of a training step on the CPU, each one call that reads and writes float32 or bfloat16 (the
// arithmetic in float32) instead of several PyTorch operations with casts between them (under bf16 autocast
// PyTorch's element-wise kernels on bf16 cost several times their float32 time):
//
//   attnlab::rms_norm_train(x, w, eps) -> (y, r)
//       y = (x r) ⊙ w row by row, r = (mean(x²) + ε)^(-1/2) float32 (rows,), y in x's dtype      (RMSNorm's forward)
//   attnlab::rms_norm_train_backward(dy, x, w, r) -> (dx, dw)
//       x̂ = x r, h = dy ⊙ w: dx = r (h − x̂ mean(h ⊙ x̂)), dw = Σ_rows dy ⊙ x̂ (float32)
//   attnlab::rope_train(x, cos, sin, sign) -> y
//       x (B, H, L, D) (any strides, the last 1): pairs (i, i + D/2) of position l rotated by sign · φ_li
//       (cos, sin (L, D/2) float32); y contiguous in x's dtype. sign −1 is the backward (Rᵀ = R(−φ))
//   attnlab::act_train(g, u, act, keep) -> (h, d)  /  attnlab::act_train_backward(dh, g, u, act) -> (dg, du)
//       h = act(g) ⊙ u (u absent: 1); dg = dh ⊙ u ⊙ act'(g), du = dh ⊙ act(g)          (an FFN's (gated) activation)
//       with keep (no u) also d = act'(g) in g's dtype (the backward then dh ⊙ d), else d empty
//   attnlab::all_finite(tensors) -> bool
//       no entry of any tensor NaN or ±inf (the attention pipeline's check: one pass, no tensor made)
//   attnlab::clip_grad_norm_(grads, max_norm) -> norm
//       ‖g‖ = (Σ over every tensor of Σ g²)^½ (float32 tensors, contiguous), and where c = max_norm / (‖g‖ + 1e-6)
//       is below 1 (or NaN) every g scaled by c in place (torch.nn.utils.clip_grad_norm_'s rule); norm float32 ().
//       The squares summed in fixed chunks of CLIP_CHUNK elements, the chunks in order: the same bits on any
//       thread count
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

#define ATTNLAB_BODY "train_body.h"
#include "isa_regions.h"

using namespace attnlab_native;



}  // namespace

namespace attnlab_native {

// x viewed as (rows, n), n its last dimension
int64_t last(const at::Tensor& x) { return x.dim() ? x.size(-1) : 1; }

std::tuple<at::Tensor, at::Tensor> rms_norm_train(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_fb(x, "rms_norm_train", "x");
  attnlab_native::check_f32(w, "rms_norm_train", "w");
  const int64_t n = last(x), rows = n ? x.numel() / n : 0;
  ATTNLAB_CHECK(w.dim() == 1 && w.size(0) == n, "attnlab::rms_norm_train: w must be (", n, ",), got ", w.sizes());
  at::Tensor y = at::empty_like(x);
  at::Tensor r = at::empty({rows}, x.options().dtype(at::kFloat));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* X = data<T>(x);
    T* Y = data<T>(y);
    const float* W = w.data_ptr<float>();
    float* R = r.data_ptr<float>();
    const auto row = ISA_FN(rms_norm_row<T>);
    at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) R[i] = row(X + i * n, W, n, static_cast<float>(eps), Y + i * n);
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {y, r};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_train_backward(const at::Tensor& dy, const at::Tensor& x,
                                                           const at::Tensor& w, const at::Tensor& r) {
  check_fb(x, "rms_norm_train_backward", "x");
  check_fb(dy, "rms_norm_train_backward", "dy");
  attnlab_native::check_f32(w, "rms_norm_train_backward", "w");
  attnlab_native::check_f32(r, "rms_norm_train_backward", "r");
  const int64_t n = last(x), rows = n ? x.numel() / n : 0;
  ATTNLAB_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && w.numel() == n && r.numel() == rows,
                "attnlab::rms_norm_train_backward: dy must match x ", x.sizes(), " ", x.scalar_type(), ", w (", n,
                ",) and r (", rows, ",); got dy ", dy.sizes(), " ", dy.scalar_type(), ", w ", w.sizes(), ", r ",
                r.sizes());
  at::Tensor dx = at::empty_like(x);
  // dw: each block of rows sums its own part (a fixed partition: the same bits on any number of threads), then
  // torch's sum over the blocks — (block + log₂ blocks) roundings a term instead of one chain over every row
  constexpr int64_t block = 32;
  const int64_t blocks = (rows + block - 1) / block;
  at::Tensor part = at::zeros({std::max<int64_t>(blocks, 1), n}, w.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *DY = data<T>(dy), *X = data<T>(x);
    T* DX = data<T>(dx);
    const float *W = w.data_ptr<float>(), *R = r.data_ptr<float>();
    float* P = part.data_ptr<float>();
    const auto row = ISA_FN(rms_norm_grad_row<T>);
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, n * block));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t i = b * block; i < std::min(rows, (b + 1) * block); ++i) {
          row(DY + i * n, X + i * n, W, R[i], n, DX + i * n, P + b * n);
        }
      }
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {dx, part.sum(0)};
}

at::Tensor rope_train(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, double sign) {
  ATTNLAB_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
                "attnlab::rope_train: x must be a float32 or bfloat16 CPU tensor (B, H, L, D), D even, its last ",
                "dimension contiguous; got ", x.scalar_type(), " ", x.sizes());
  attnlab_native::check_not_expanded(x, "rope_train", "x");
  const int64_t B = x.size(0), H = x.size(1), Lx = x.size(2), D = x.size(3), h = D / 2;
  attnlab_native::check_f32(cos, "rope_train", "cos");
  attnlab_native::check_f32(sin, "rope_train", "sin");
  ATTNLAB_CHECK(cos.dim() == 2 && cos.size(0) == Lx && cos.size(1) == h && sin.sizes() == cos.sizes(),
                "attnlab::rope_train: cos and sin must be (L, D/2) = (", Lx, ", ", h, "), got ", cos.sizes(), " and ",
                sin.sizes());
  at::Tensor y = at::empty({B, H, Lx, D}, x.options());
  const int64_t sb = x.stride(0), sh = x.stride(1), sl = x.stride(2);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* X = data<T>(x);
    T* Y = data<T>(y);
    const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
    const auto row = ISA_FN(rope_row<T>);
    at::parallel_for(0, B * H * Lx, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, D)), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t l = i % Lx, bh = i / Lx, b = bh / H, hd = bh % H;
        row(X + b * sb + hd * sh + l * sl, C + l * h, S + l * h, h, static_cast<float>(sign), Y + i * D);
      }
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return y;
}

void check_act(const at::Tensor& g, const std::optional<at::Tensor>& u, int64_t act, const char* op) {
  check_fb(g, op, "g");
  ATTNLAB_CHECK(0 <= act && act <= 6, "attnlab::", op, ": act must be an activation code 0-6, got ", act);
  if (u) {
    check_fb(*u, op, "u");
    ATTNLAB_CHECK(u->sizes() == g.sizes() && u->scalar_type() == g.scalar_type(), "attnlab::", op,
                  ": u must have g's shape and dtype ", g.sizes(), " ", g.scalar_type(), ", got ", u->sizes(), " ",
                  u->scalar_type());
  }
}

constexpr int64_t ACT_GRAIN = 1 << 14;  // elements a task

std::tuple<at::Tensor, at::Tensor> act_train(const at::Tensor& g, const std::optional<at::Tensor>& u, int64_t act,
                                             bool keep) {
  check_act(g, u, act, "act_train");
  ATTNLAB_CHECK(!(keep && u), "attnlab::act_train: keep (the derivative) is for a plain activation, got a gate u");
  at::Tensor h = at::empty_like(g), d = keep ? at::empty_like(g) : at::empty({0}, g.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *G = data<T>(g), *U = u ? data<T>(*u) : nullptr;
    T *Hp = data<T>(h), *Dp = keep ? data<T>(d) : nullptr;
    const auto span = ISA_FN(act_train_span<T>);
    const auto span_keep = ISA_FN(act_keep_span<T>);
    at::parallel_for(0, g.numel(), ACT_GRAIN, [&](int64_t i0, int64_t i1) {
      if (keep) {
        span_keep(act, G + i0, i1 - i0, Hp + i0, Dp + i0);
      } else {
        span(act, G + i0, U ? U + i0 : nullptr, i1 - i0, Hp + i0);
      }
    });
  };
  g.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {h, d};
}

std::tuple<at::Tensor, at::Tensor> act_train_backward(const at::Tensor& dh, const at::Tensor& g,
                                                      const std::optional<at::Tensor>& u, int64_t act) {
  check_act(g, u, act, "act_train_backward");
  check_fb(dh, "act_train_backward", "dh");
  ATTNLAB_CHECK(dh.sizes() == g.sizes() && dh.scalar_type() == g.scalar_type(), "attnlab::act_train_backward: dh must ",
                "have g's shape and dtype ", g.sizes(), " ", g.scalar_type(), ", got ", dh.sizes(), " ",
                dh.scalar_type());
  at::Tensor dg = at::empty_like(g);
  at::Tensor du = u ? at::empty_like(g) : at::empty({0}, g.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *DH = data<T>(dh), *G = data<T>(g), *U = u ? data<T>(*u) : nullptr;
    T *DG = data<T>(dg), *DU = u ? data<T>(du) : nullptr;
    const auto span = ISA_FN(act_grad_span<T>);
    at::parallel_for(0, g.numel(), ACT_GRAIN, [&](int64_t i0, int64_t i1) {
      span(act, DH + i0, G + i0, U ? U + i0 : nullptr, i1 - i0, DG + i0, DU ? DU + i0 : nullptr);
    });
  };
  g.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {dg, du};
}

// whether every entry of every tensor is finite: float32 and bfloat16 tensors whose elements fill one block of
// memory (contiguous, or a permutation of a contiguous tensor) scanned by finite_span over torch's threads, any other
// by at::isfinite
bool all_finite(at::TensorList ts) {
  for (const at::Tensor& arg : ts) {
    ATTNLAB_CHECK(arg.device().is_cpu(), "attnlab::all_finite: tensors must be on the CPU, got ", arg.device().str());
    at::Tensor t = arg;  // an expanded dimension repeats its first entry: that entry is enough
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.stride(d) == 0 && t.size(d) > 1) t = t.narrow(d, 0, 1);
    const bool scan = (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                      t.is_non_overlapping_and_dense();
    if (!scan) {
      if (t.is_floating_point() && !at::isfinite(t).all().item<bool>()) return false;
      continue;
    }
    std::atomic<bool> bad{false};
    const auto run = [&](auto tag) {
      using T = decltype(tag);
      const T* x = data<T>(t);
      const auto span = ISA_FN(finite_span<T>);
      at::parallel_for(0, t.numel(), 1 << 15, [&](int64_t j0, int64_t j1) {
        if (!span(x + j0, j1 - j0)) bad.store(true, std::memory_order_relaxed);
      });
    };
    t.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
    if (bad.load()) return false;
  }
  return true;
}

constexpr int64_t CLIP_CHUNK = 1 << 14;  // elements a partial sum (and a task)

at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm) {
  ATTNLAB_CHECK(std::isfinite(max_norm) && max_norm > 0, "attnlab::clip_grad_norm_: max_norm must be a positive ",
                "finite number, got ", max_norm);
  std::vector<std::pair<float*, int64_t>> chunks;  // (start, length) of each chunk of each gradient
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    ATTNLAB_CHECK(g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous(),
                  "attnlab::clip_grad_norm_: grads[", k, "] must be a contiguous float32 CPU tensor, got ",
                  g.scalar_type(), g.device().is_cpu() ? "" : " (not on the CPU)",
                  g.is_contiguous() ? "" : " (not contiguous)");
    float* p = g.data_ptr<float>();
    for (int64_t i = 0; i < g.numel(); i += CLIP_CHUNK) chunks.emplace_back(p + i, std::min(CLIP_CHUNK, g.numel() - i));
  }
  const int64_t n = static_cast<int64_t>(chunks.size());
  std::vector<double> part(n);
  const auto sumsq = ISA_FN(sum_squares);
  at::parallel_for(0, n, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) part[c] = sumsq(chunks[c].first, chunks[c].second);
  });
  double total = 0.0;
  for (double v : part) total += v;
  const float norm = static_cast<float>(std::sqrt(total));
  const float coef = static_cast<float>(max_norm / (static_cast<double>(norm) + 1e-6));
  if (!(coef >= 1.f)) {  // clipped (or a NaN / infinite norm: scaled by NaN / 0, as torch's clamp gives)
    at::parallel_for(0, n, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        float* p = chunks[c].first;
        for (int64_t i = 0; i < chunks[c].second; ++i) p[i] *= coef;
      }
    });
  }
  return at::scalar_tensor(norm, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("rms_norm_train(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_train_backward(Tensor dy, Tensor x, Tensor w, Tensor r) -> (Tensor, Tensor)");
  m.def("rope_train(Tensor x, Tensor cos, Tensor sin, float sign) -> Tensor");
  m.def("act_train(Tensor g, Tensor? u, int act, bool keep) -> (Tensor, Tensor)");
  m.def("act_train_backward(Tensor dh, Tensor g, Tensor? u, int act) -> (Tensor, Tensor)");
  m.def("all_finite(Tensor[] tensors) -> bool");
  m.def("clip_grad_norm_(Tensor(a!)[] grads, float max_norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("rms_norm_train", &attnlab_native::rms_norm_train);
  m.impl("rms_norm_train_backward", &attnlab_native::rms_norm_train_backward);
  m.impl("rope_train", &attnlab_native::rope_train);
  m.impl("act_train", &attnlab_native::act_train);
  m.impl("act_train_backward", &attnlab_native::act_train_backward);
  m.impl("all_finite", &attnlab_native::all_finite);
  m.impl("clip_grad_norm_", &attnlab_native::clip_grad_norm_);
}
