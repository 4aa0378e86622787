// A pre-norm GPT block's training step as one autograd node, made of the other training kernels' calls:
//
//   attnlab::gpt_block_train(x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale, eps1, eps2,
//                            act, left, right) -> (y, saved)
//       a pre-norm GPT layer's training forward, x (B, L, C) float32, and what its backward reads (saved):
//       h₁ = LN₁(x), qkv = int8_linear(h₁), a = short_attention (causal), x₃ = x + int8_linear(a), h₂ = LN₂(x₃),
//       y = x₃ + int8_linear(act(int8_linear(h₂))) (act_train with keep) — those calls, and in the backward theirs,
//       so the same bits as the layer's modules; raises "not finite" (recording nothing) where qkv or a is not
//       finite
//   attnlab::gpt_block_train_backward(dy, x, saved, n1w, …, b2, heads, scale, act, left, right) -> grads
//       its gradients, one per tensor argument of the forward (an empty tensor for an absent bias's)
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

namespace attnlab_native {

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

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("gpt_block_train(Tensor x, Tensor n1w, Tensor? n1b, Tensor wqkv, Tensor? bqkv, Tensor wo, Tensor? bo, "
        "Tensor n2w, Tensor? n2b, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, int heads, float scale, float eps1, "
        "float eps2, int act, int left, int right) -> (Tensor, Tensor[])");
  m.def("gpt_block_train_backward(Tensor dy, Tensor x, Tensor[] saved, Tensor n1w, Tensor? n1b, Tensor wqkv, "
        "Tensor? bqkv, Tensor wo, Tensor? bo, Tensor n2w, Tensor? n2b, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
        "int heads, float scale, int act, int left, int right) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("gpt_block_train", &attnlab_native::gpt_block_train);
  m.impl("gpt_block_train_backward", &attnlab_native::gpt_block_train_backward);
}
