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
//   attnlab::short_attention(q, k, v, scale, causal, window) -> (out, p)
//       q (B, H, Lq, D), k, v (B, H, Lk, D) float32 or bfloat16 of one dtype, any strides with the last 1 (views of
//       a packed projection): out = softmax(κ Q Kᵀ) V on the keys each query sees (as softmax_rows), computed per
//       (batch, head) in float32 with the scores in the task's buffer; out (B, H, Lq, D) a view of a contiguous
//       (B, Lq, H, D) tensor (the heads already merged for the output projection); p (B, H, Lq, Lk) float32 holds
//       P for the backward where computed (a causal block's keys up to its last query's; the rest is not written)
//   attnlab::short_attention_backward(q, k, v, p, d_out, scale, causal, window) -> (dq, dk, dv)
//       κ dS = κ P ∘ (dP − rowsum(dP ∘ P)): dQ = κ dS K, dK = κ dSᵀ Q, dV = Pᵀ dO, each (B, H, L, D) a view of a
//       contiguous (B, L, H, D) tensor
//   attnlab::short_attention_packed(qkv, heads, scale, causal, window) -> (out, p)
//       short_attention on the packed projection qkv (B, L, 3E) that q, k, v are cut from (q, k, v in that order,
//       H = heads of E / H each), out (B, L, E)
//   attnlab::short_attention_packed_backward(qkv, p, d_out, heads, scale, causal, window) -> dqkv
//       its gradients written into one (B, L, 3E) tensor
//   attnlab::gpt_block_train(x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale, eps1, eps2,
//                            act, left, right) -> (y, saved)
//       a pre-norm GPT layer's training forward, x (B, L, C) float32, and what its backward reads (saved):
//       h₁ = LN₁(x), qkv = int8_linear(h₁), a = short_attention (causal), x₃ = x + int8_linear(a), h₂ = LN₂(x₃),
//       y = x₃ + int8_linear(act(int8_linear(h₂))) (act_train with keep) — those calls, and in the backward theirs,
//       so the same bits as the layer's modules; raises "not finite" (recording nothing) where qkv or a is not
//   attnlab::gpt_block_train_backward(dy, x, saved, n1w, …, b2, heads, scale, act, left, right) -> grads
//       its gradients, one per tensor argument of the forward (an empty tensor for an absent bias's)
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

#include "native.h"

namespace {

#define ATTNLAB_BODY "train_body.h"
#include "isa_regions.h"
#include "int8_gemm.h"

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
                                                bool cast) {
  check_fb(s, "softmax_rows", "s");
  ATTNLAB_CHECK(s.dim() == 3, "attnlab::softmax_rows: s must be (G, Lq, Lk), got ", s.sizes());
  at::Tensor p = at::empty(s.sizes(), s.options().dtype(at::kFloat));
  at::Tensor pc = cast && s.scalar_type() != at::kFloat ? at::empty_like(s) : at::empty({0}, s.options());
  const int64_t G = s.size(0), Lq = s.size(1), Lk = s.size(2), off = Lk - Lq;
  window = attnlab_native::clamp_window(window, Lq, Lk);
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

at::Tensor softmax_rows_backward(const at::Tensor& dp, const at::Tensor& p, double scale) {
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

// the longest sum of products of ±left and ±right integers an int32 holds exactly
int64_t max_terms(int64_t left, int64_t right) {
  check_levels(left, "int8_linear"), check_levels(right, "int8_linear");
  return ((int64_t{1} << 31) - 1) / (left * right);
}

// int8_linear, with bound (where given) set to a bound of |y| and res (where given: float32 (T, out) contiguous, bf16
// false) added to y as int8_product_plus adds it
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_linear_bounded(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t left, int64_t right,
    bool cols, bool bf16, double* bound, const at::Tensor* res = nullptr) {
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

void check_short(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name, int64_t L) {
  ATTNLAB_CHECK(t.device().is_cpu() && t.scalar_type() == q.scalar_type() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.dim() == 4 &&
                  t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(3) == q.size(3) && t.stride(3) == 1,
                "attnlab::", op, ": ", name, " must be a float32 or bfloat16 CPU tensor (B, H, L, D) like q ",
                q.sizes(), " ", q.scalar_type(), " with the last stride 1, got ", t.scalar_type(), " ", t.sizes(),
                " strides ", t.strides());
  ATTNLAB_CHECK(t.size(2) == L, "attnlab::", op, ": ", name, " must have ", L, " rows, got ", t.size(2));
  attnlab_native::check_not_expanded(t, op, name);
}

// the rows of (batch b, head h) of a (B, H, L, D) tensor x whose data starts at base
template <class T>
T* head(T* base, const at::Tensor& x, int64_t b, int64_t h) {
  return base + b * x.stride(0) + h * x.stride(1);
}

// fn(t, b, h, buf) for each of the B·H (batch, head) tasks t = b·H + h over torch's threads, `buf` a thread's
// scratch of `need` floats
template <class F>
void each_head(int64_t B, int64_t H, int64_t need, const F& fn) {
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(need);
    for (int64_t t = t0; t < t1; ++t) fn(t, t / H, t % H, buf.data());
  });
}

// (B, H, L, D) as a view of a new contiguous (B, L, H, D) tensor
at::Tensor heads_merged(const at::Tensor& like, int64_t L) {
  return at::empty({like.size(0), L, like.size(1), like.size(3)}, like.options()).permute({0, 2, 1, 3});
}

std::tuple<at::Tensor, at::Tensor> short_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   double scale, bool causal, int64_t window) {
  ATTNLAB_CHECK(q.dim() == 4, "attnlab::short_attention: q must be (B, H, Lq, D), got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.dim() == 4 ? k.size(2) : -1;
  check_short(q, q, "short_attention", "q", Lq);
  check_short(k, q, "short_attention", "k", Lk);
  check_short(v, q, "short_attention", "v", Lk);
  at::Tensor out = heads_merged(q, Lq);
  at::Tensor p = at::empty({B, H, Lq, Lk}, q.options().dtype(at::kFloat));
  const attnlab_native::Seen seen{Lq, Lk, attnlab_native::clamp_window(window, Lq, Lk), causal};
  const int64_t need = Lq * D + 2 * Lk * D + attnlab_native::SHORT_ROWS * D;
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *Q = data<T>(q), *K = data<T>(k), *V = data<T>(v);
    T* O = data<T>(out);
    float* P = p.data_ptr<float>();
    const auto task = ISA_FN(short_attention_task<T>);
    each_head(B, H, need, [&](int64_t t, int64_t b, int64_t h, float* buf) {
      task(head(Q, q, b, h), q.stride(2), head(K, k, b, h), k.stride(2), head(V, v, b, h), v.stride(2),
           head(O, out, b, h), out.stride(2), P + t * Lq * Lk, D, seen, static_cast<float>(scale), buf);
    });
  };
  q.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return {out, p};
}

void short_attention_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& p,
                                   const at::Tensor& d_out, const at::Tensor& dq, const at::Tensor& dk,
                                   const at::Tensor& dv, double scale, bool causal, int64_t window);

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_backward(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, const at::Tensor& p,
                                                                        const at::Tensor& d_out, double scale,
                                                                        bool causal, int64_t window) {
  ATTNLAB_CHECK(q.dim() == 4, "attnlab::short_attention_backward: q must be (B, H, Lq, D), got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.dim() == 4 ? k.size(2) : -1;
  check_short(q, q, "short_attention_backward", "q", Lq);
  check_short(k, q, "short_attention_backward", "k", Lk);
  check_short(v, q, "short_attention_backward", "v", Lk);
  check_short(d_out, q, "short_attention_backward", "d_out", Lq);
  attnlab_native::check_f32(p, "short_attention_backward", "p");
  ATTNLAB_CHECK(p.sizes() == at::IntArrayRef({B, H, Lq, Lk}), "attnlab::short_attention_backward: p must be (B, H, ",
                "Lq, Lk) = ", at::IntArrayRef({B, H, Lq, Lk}), " (short_attention's), got ", p.sizes());
  at::Tensor dq = heads_merged(q, Lq), dk = heads_merged(q, Lk), dv = heads_merged(q, Lk);
  short_attention_backward_into(q, k, v, p, d_out, dq, dk, dv, scale, causal, window);
  return {dq, dk, dv};
}

// short_attention_backward's arithmetic into dq, dk, dv ((B, H, L, D) of q's dtype, any strides with the last 1:
// views of one packed gradient, say), the operands checked by the caller
void short_attention_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& p,
                                   const at::Tensor& d_out, const at::Tensor& dq, const at::Tensor& dk,
                                   const at::Tensor& dv, double scale, bool causal, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
  const attnlab_native::Seen seen{Lq, Lk, attnlab_native::clamp_window(window, Lq, Lk), causal};
  const int64_t need = 2 * Lq * D + 4 * Lk * D + attnlab_native::SHORT_ROWS * (Lk + D);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *Q = data<T>(q), *K = data<T>(k), *V = data<T>(v), *G = data<T>(d_out);
    T *DQ = data<T>(dq), *DK = data<T>(dk), *DV = data<T>(dv);
    const float* P = p.data_ptr<float>();
    const auto task = ISA_FN(short_attention_grad_task<T>);
    each_head(B, H, need, [&](int64_t t, int64_t b, int64_t h, float* buf) {
      task(head(Q, q, b, h), q.stride(2), head(K, k, b, h), k.stride(2), head(V, v, b, h), v.stride(2),
           P + t * Lq * Lk, head(G, d_out, b, h), d_out.stride(2), head(DQ, dq, b, h), dq.stride(2),
           head(DK, dk, b, h), dk.stride(2), head(DV, dv, b, h), dv.stride(2), D, seen, static_cast<float>(scale), buf);
    });
  };
  q.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
}

// q, k, v as (B, H, L, D) views of a packed projection qkv (B, L, 3 H D): columns [0, HD) q, [HD, 2HD) k, then v
std::array<at::Tensor, 3> unpacked(const at::Tensor& qkv, int64_t H) {
  const int64_t B = qkv.size(0), L = qkv.size(1), E = qkv.size(2) / 3;
  std::array<at::Tensor, 3> out;
  for (int64_t i = 0; i < 3; ++i) out[i] = qkv.narrow(2, i * E, E).view({B, L, H, E / H}).transpose(1, 2);
  return out;
}

// short_attention on the packed projection qkv (B, L, 3E) q, k, v are cut from: (out (B, L, E) with the heads merged,
// p), and its backward writing dq, dk, dv into one (B, L, 3E) gradient: no split, views or concatenation of the
// three gradients. The same arithmetic, so the same bits
void check_packed(const at::Tensor& qkv, int64_t heads, const char* op) {
  ATTNLAB_CHECK(qkv.dim() == 3 && 1 <= heads && heads <= qkv.size(2) && qkv.size(2) % (3 * heads) == 0 &&
                    qkv.stride(2) == 1, "attnlab::", op,
                ": qkv must be (B, L, 3 · heads · D) with the last stride 1, got ", qkv.sizes(), " strides ",
                qkv.strides(), " for ", heads, " heads");
}

std::tuple<at::Tensor, at::Tensor> short_attention_packed(const at::Tensor& qkv, int64_t heads, double scale,
                                                          bool causal, int64_t window) {
  check_packed(qkv, heads, "short_attention_packed");
  const auto [q, k, v] = unpacked(qkv, heads);
  auto [out, p] = short_attention(q, k, v, scale, causal, window);
  return {out.transpose(1, 2).reshape({qkv.size(0), qkv.size(1), qkv.size(2) / 3}), p};  // (a view: (B, L, H, D))
}

at::Tensor short_attention_packed_backward(const at::Tensor& qkv, const at::Tensor& p, const at::Tensor& d_out,
                                           int64_t heads, double scale, bool causal, int64_t window) {
  check_packed(qkv, heads, "short_attention_packed_backward");
  const int64_t B = qkv.size(0), L = qkv.size(1), E = qkv.size(2) / 3;
  ATTNLAB_CHECK(d_out.sizes() == at::IntArrayRef({B, L, E}) && d_out.scalar_type() == qkv.scalar_type() &&
                    d_out.stride(2) == 1,
                "attnlab::short_attention_packed_backward: d_out must be (B, L, E) = ", at::IntArrayRef({B, L, E}),
                " of qkv's dtype with the last stride 1, got ", d_out.scalar_type(), " ", d_out.sizes());
  const auto [q, k, v] = unpacked(qkv, heads);
  attnlab_native::check_f32(p, "short_attention_packed_backward", "p");
  ATTNLAB_CHECK(p.sizes() == at::IntArrayRef({B, heads, L, L}), "attnlab::short_attention_packed_backward: p must be ",
                "(B, heads, L, L) = ", at::IntArrayRef({B, heads, L, L}), " (short_attention_packed's), got ", p.sizes());
  const at::Tensor go = d_out.view({B, L, heads, q.size(3)}).transpose(1, 2);
  at::Tensor dqkv = at::empty(qkv.sizes(), qkv.options());
  const auto [dq, dk, dv] = unpacked(dqkv, heads);
  short_attention_backward_into(q, k, v, p, go, dq, dk, dv, scale, causal, window);
  return dqkv;
}

// A pre-norm GPT block of training in two ops, its forward and its backward (one autograd node between them,
// attnlab/_native_library.py: what DecoderLayer runs as ten nodes and ~100 Python-level operations — the
// per-operation cost is a quarter of nanogpt-cpu's step on 2 cores):
//   h₁ = LN₁(x),  qkv = h₁ W_qkvᵀ + b,  a = softmax(κ q kᵀ + causal) v (heads merged),  x₃ = x + a W_oᵀ + b_o,
//   h₂ = LN₂(x₃),  f = h₂ W₁ᵀ + b₁,  y = x₃ + act(f) W₂ᵀ + b₂
// with each product an int8 layer's (int8_linear), the attention short_attention's and the activation act_train's
// kept derivative — the very calls, in the same order, of those nodes, so the same bits forward and backward (the
// residual's two gradients are summed once, as autograd's buffer does; addition commutes). Non-finite qkv or
// attention output raises "not finite" before any node is recorded: the caller then runs the layer's modules, whose
// pipeline handles or explains it. The forward returns y and what the backward reads: mean₁, rstd₁, then per int8
// layer (qkv, o, 1, 2) qw, sw, qxt, sxc, and between them qkv and P (attention), x₃, mean₂, rstd₂, act'(f)
bool all_finite(at::TensorList ts);

// gpt_block_train's (and its backward's) checks of x and the layer's parameters
void check_block(const char* op, const at::Tensor& x, const at::Tensor& n1w, const std::optional<at::Tensor>& n1b,
                 const at::Tensor& wqkv, const at::Tensor& wo, const at::Tensor& n2w,
                 const std::optional<at::Tensor>& n2b, const at::Tensor& w1, const at::Tensor& w2, int64_t heads) {
  ATTNLAB_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "attnlab::", op,
                ": x must be float32 (B, L, C) on the CPU, got ", x.scalar_type(), " ", x.sizes());
  attnlab_native::check_not_expanded(x, op, "x");
  const int64_t C = x.size(2);
  for (const auto& [t, name] : {std::pair{&n1w, "n1w"}, {&n2w, "n2w"}, {n1b ? &*n1b : nullptr, "n1b"},
                                {n2b ? &*n2b : nullptr, "n2b"}}) {
    if (!t) continue;
    attnlab_native::check_f32(*t, op, name);
    ATTNLAB_CHECK(t->dim() == 1 && t->size(0) == C, "attnlab::", op, ": ", name, " must be (", C, ",), got ",
                  t->sizes());
  }
  ATTNLAB_CHECK(wqkv.dim() == 2 && wo.dim() == 2 && w1.dim() == 2 && w2.dim() == 2, "attnlab::", op,
                ": the weights must be 2-D, got qkv ", wqkv.sizes(), ", o ", wo.sizes(), ", ffn ", w1.sizes(),
                " and ", w2.sizes());
  const int64_t E3 = wqkv.size(0);
  ATTNLAB_CHECK(1 <= heads && heads <= E3 && E3 % (3 * heads) == 0 && wqkv.size(1) == C && wo.size(1) == E3 / 3 &&
                    wo.size(0) == C && w2.size(0) == C && w1.size(0) == w2.size(1) && w1.size(1) == C,
                "attnlab::", op, ": the weights do not make a block of width ", C, " and ", heads, " heads: qkv ",
                wqkv.sizes(), ", o ", wo.sizes(), ", ffn ", w1.sizes(), " and ", w2.sizes());
}

std::tuple<at::Tensor, std::vector<at::Tensor>> gpt_block_train(
    const at::Tensor& x, const at::Tensor& n1w, const std::optional<at::Tensor>& n1b, const at::Tensor& wqkv,
    const std::optional<at::Tensor>& bqkv, const at::Tensor& wo, const std::optional<at::Tensor>& bo,
    const at::Tensor& n2w, const std::optional<at::Tensor>& n2b, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, int64_t heads, double scale, double eps1, double eps2,
    int64_t act, int64_t left, int64_t right) {
  check_block("gpt_block_train", x, n1w, n1b, wqkv, wo, n2w, n2b, w1, w2, heads);
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), T = B * L, E3 = wqkv.size(0);
  auto [h1, mean1, rstd1] = at::native_layer_norm(x, {C}, n1w, n1b, eps1);
  double bound;  // of |qkv|: where it is at most 1e15, qkv is finite and so is the attention's output (the scores
                 // |κ q·k| ≤ κ D 1e30 < 3e38 for |κ| ≤ 1e3, D ≤ 256; softmax's rows weigh finite v): no scan
  auto [qkv2, qw1, sw1, qxt1, sxc1] = int8_linear_bounded(h1.view({T, C}), wqkv, bqkv, left, right, true, false,
                                                          &bound);
  const bool scan = !(bound <= 1e15 && std::fabs(scale) <= 1e3 && E3 / (3 * heads) <= 256);
  ATTNLAB_CHECK(!scan || all_finite({qkv2}), "attnlab::gpt_block_train: not finite (the qkv projection)");
  const at::Tensor qkv = qkv2.view({B, L, E3});
  const auto [q, k, v] = unpacked(qkv, heads);
  auto [ao, p] = short_attention(q, k, v, scale, true, -1);
  const at::Tensor a = ao.transpose(1, 2).reshape({T, E3 / 3});  // (a view: ao is (B, L, H, D))
  ATTNLAB_CHECK(!scan || all_finite({a}), "attnlab::gpt_block_train: not finite (the attention's output)");
  // the residuals added in the products' rescaling (x must be contiguous for it; else at::add: the same bits)
  const at::Tensor xr = x.is_contiguous() ? x.view({T, C}) : at::Tensor();
  auto [o, qw2, sw2, qxt2, sxc2] = int8_linear_bounded(a, wo, bo, left, right, true, false, nullptr,
                                                       xr.defined() ? &xr : nullptr);
  const at::Tensor x3 = xr.defined() ? o.view({B, L, C}) : at::add(x, o.view({B, L, C}));
  auto [h2, mean2, rstd2] = at::native_layer_norm(x3, {C}, n2w, n2b, eps2);
  auto [f, qw3, sw3, qxt3, sxc3] = int8_linear(h2.view({T, C}), w1, b1, left, right, true, false);
  auto [g, d] = act_train(f, std::nullopt, act, true);
  const at::Tensor x3r = x3.view({T, C});
  auto [y, qw4, sw4, qxt4, sxc4] = int8_linear_bounded(g, w2, b2, left, right, true, false, nullptr, &x3r);
  return {y.view({B, L, C}), {mean1, rstd1, qw1, sw1, qxt1, sxc1, qkv, p, qw2, sw2, qxt2, sxc2, x3, mean2, rstd2,
                              qw3, sw3, qxt3, sxc3, d, qw4, sw4, qxt4, sxc4}};
}

// gpt_block_train's gradients from dy and what its forward returned (`saved`), in the order of its tensor arguments:
// (dx, dn1w, dn1b, dwqkv, dbqkv, dwo, dbo, dn2w, dn2b, dw1, db1, dw2, db2), an empty tensor for an absent bias's
std::vector<at::Tensor> gpt_block_train_backward(
    const at::Tensor& dy, const at::Tensor& x, at::TensorList saved, const at::Tensor& n1w,
    const std::optional<at::Tensor>& n1b, const at::Tensor& wqkv, const std::optional<at::Tensor>& bqkv,
    const at::Tensor& wo, const std::optional<at::Tensor>& bo, const at::Tensor& n2w,
    const std::optional<at::Tensor>& n2b, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, int64_t heads, double scale, int64_t act, int64_t left,
    int64_t right) {
  check_block("gpt_block_train_backward", x, n1w, n1b, wqkv, wo, n2w, n2b, w1, w2, heads);
  ATTNLAB_CHECK(saved.size() == 24 && dy.sizes() == x.sizes() && dy.scalar_type() == at::kFloat && dy.device().is_cpu(),
                "attnlab::gpt_block_train_backward: dy must be float32 like x ", x.sizes(), " and saved the 24 "
                "tensors gpt_block_train returned, got ", dy.sizes(), " and ", saved.size());
  {  // saved: what the forward returns for these shapes (its float32 tensors contiguous)
    const int64_t B = x.size(0), L = x.size(1), C = x.size(2), T = B * L, E3 = wqkv.size(0), E = E3 / 3;
    const int64_t F = w1.size(0);
    const std::vector<std::vector<int64_t>> shapes = {
        {B, L, 1}, {B, L, 1}, {E3, C}, {E3}, {C, T}, {C}, {B, L, E3}, {B, heads, L, L}, {C, E}, {C}, {E, T}, {E},
        {B, L, C}, {B, L, 1}, {B, L, 1}, {F, C}, {F}, {C, T}, {C}, {T, F}, {C, F}, {C}, {F, T}, {F}};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const bool rounded = shapes[i].size() == 2 && i != 19;  // int8 (qw, qxt), else float32
      const at::Tensor& t = saved[i];
      ATTNLAB_CHECK(t.device().is_cpu() && t.sizes() == c10::IntArrayRef(shapes[i]) &&
                        t.scalar_type() == (rounded ? at::kChar : at::kFloat) && (rounded || t.is_contiguous()),
                    "attnlab::gpt_block_train_backward: saved[", i, "] must be ", rounded ? "int8 " : "float32 ",
                    c10::IntArrayRef(shapes[i]), rounded ? "" : " contiguous", " as gpt_block_train returns it, got ",
                    t.scalar_type(), " ", t.sizes());
    }
  }
  const at::Tensor& qkv = saved[6];
  const at::Tensor& x3 = saved[12];
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), T = B * L;
  const auto rows = [&](const at::Tensor& t) {  // as the int8 layer's backward reads its gradient
    at::Tensor g = t.reshape({T, t.size(-1)});
    return g.is_contiguous() ? g : g.contiguous();
  };
  const auto layer = [&](const at::Tensor& g, int i, bool db) {  // the int8 layer saved from saved[i]
    return int8_linear_backward(rows(g), saved[i], saved[i + 1], saved[i + 2], saved[i + 3], left, right, true, true,
                                db, false);
  };
  auto [dg, dw2, db2] = layer(dy, 20, b2.has_value());
  const at::Tensor df = dg.mul(saved[19]);  // ∂L/∂f = ∂L/∂g ⊙ act'(f)
  auto [dh2, dw1, db1] = layer(df, 15, b1.has_value());
  auto [dx3n, dn2w, dn2b] = at::native_layer_norm_backward(dh2.view({B, L, C}), x3, {C}, saved[13], saved[14], n2w,
                                                           n2b, {true, true, n2b.has_value()});
  const at::Tensor dx3 = dx3n.add_(dy);  // (into LN's fresh gradient: no new buffer; the sum commutes)
  auto [da, dwo, dbo] = layer(dx3, 8, bo.has_value());
  const auto [q, k, v] = unpacked(qkv, heads);
  const at::Tensor go = da.view({B, L, heads, q.size(3)}).transpose(1, 2);
  at::Tensor dqkv = at::empty(qkv.sizes(), qkv.options());
  const auto [dq, dk, dv] = unpacked(dqkv, heads);
  short_attention_backward_into(q, k, v, saved[7], go, dq, dk, dv, scale, true, -1);
  auto [dh1, dwqkv, dbqkv] = layer(dqkv, 2, bqkv.has_value());
  auto [dxn, dn1w, dn1b] = at::native_layer_norm_backward(dh1.view({B, L, C}), x, {C}, saved[0], saved[1], n1w, n1b,
                                                          {true, true, n1b.has_value()});
  const auto opt = [&](bool has, const at::Tensor& t) { return has ? t : at::empty({0}, x.options()); };  // (apart)
  return {dxn.add_(dx3), dn1w, opt(n1b.has_value(), dn1b), dwqkv, opt(bqkv.has_value(), dbqkv), dwo,
          opt(bo.has_value(), dbo), dn2w, opt(n2b.has_value(), dn2b), dw1, opt(b1.has_value(), db1), dw2,
          opt(b2.has_value(), db2)};
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("softmax_rows(Tensor s, float scale, bool causal, int window, bool cast) -> (Tensor, Tensor)");
  m.def("softmax_rows_backward(Tensor dp, Tensor p, float scale) -> Tensor");
  m.def("rms_norm_train(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_train_backward(Tensor dy, Tensor x, Tensor w, Tensor r) -> (Tensor, Tensor)");
  m.def("rope_train(Tensor x, Tensor cos, Tensor sin, float sign) -> Tensor");
  m.def("act_train(Tensor g, Tensor? u, int act, bool keep) -> (Tensor, Tensor)");
  m.def("clip_grad_norm_(Tensor(a!)[] grads, float max_norm) -> Tensor");
  m.def("short_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window) -> (Tensor, "
        "Tensor)");
  m.def("short_attention_backward(Tensor q, Tensor k, Tensor v, Tensor p, Tensor d_out, float scale, bool causal, "
        "int window) -> (Tensor, Tensor, Tensor)");
  m.def("act_train_backward(Tensor dh, Tensor g, Tensor? u, int act) -> (Tensor, Tensor)");
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
  m.def("int8_cols_laid(int rows, int left, int right) -> bool", &int8_cols_laid);  // (no tensors, as int8_kernel)
  m.def("int8_kernel(int mode) -> int", &int8_kernel);  // (no tensors: one kernel for every dispatch key)
  m.def("short_attention_packed(Tensor qkv, int heads, float scale, bool causal, int window) -> (Tensor, Tensor)");
  m.def("short_attention_packed_backward(Tensor qkv, Tensor p, Tensor d_out, int heads, float scale, bool causal, "
        "int window) -> Tensor");
  m.def("all_finite(Tensor[] tensors) -> bool");
  m.def("gpt_block_train(Tensor x, Tensor n1w, Tensor? n1b, Tensor wqkv, Tensor? bqkv, Tensor wo, Tensor? bo, "
        "Tensor n2w, Tensor? n2b, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, int heads, float scale, float eps1, "
        "float eps2, int act, int left, int right) -> (Tensor, Tensor[])");
  m.def("gpt_block_train_backward(Tensor dy, Tensor x, Tensor[] saved, Tensor n1w, Tensor? n1b, Tensor wqkv, "
        "Tensor? bqkv, Tensor wo, Tensor? bo, Tensor n2w, Tensor? n2b, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
        "int heads, float scale, int act, int left, int right) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("softmax_rows", &softmax_rows);
  m.impl("softmax_rows_backward", &softmax_rows_backward);
  m.impl("rms_norm_train", &rms_norm_train);
  m.impl("rms_norm_train_backward", &rms_norm_train_backward);
  m.impl("rope_train", &rope_train);
  m.impl("act_train", &act_train);
  m.impl("clip_grad_norm_", &clip_grad_norm_);
  m.impl("all_finite", &all_finite);
  m.impl("short_attention", &short_attention);
  m.impl("short_attention_backward", &short_attention_backward);
  m.impl("act_train_backward", &act_train_backward);
  m.impl("quantize_rows", &quantize_rows);
  m.impl("quantize_rows_cols", &quantize_rows_cols);
  m.impl("dequantize", &dequantize);
  m.impl("int8_product", &int8_product);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_backward", &int8_linear_backward);
  m.impl("short_attention_packed", &short_attention_packed);
  m.impl("short_attention_packed_backward", &short_attention_packed_backward);
  m.impl("gpt_block_train", &gpt_block_train);
  m.impl("gpt_block_train_backward", &gpt_block_train_backward);
}
