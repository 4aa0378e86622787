// The short backend's fused attention: softmax(κ Q Kᵀ) V over few keys, forward and backward, one (batch, head) a
// task in float32, on q, k, v as they lie (views of a packed projection) or cut from it:
//
//   attnlab::short_attention(q, k, v, scale, causal, window) -> (out, p)
//       q (B, H, Lq, D), k, v (B, H, Lk, D) float32 or bfloat16 of one dtype, any strides with the last 1 (views of
//       a packed projection): out = softmax(κ Q Kᵀ) V on the keys each query sees (query i sits at position
//       t = i + Lk − Lq and sees the keys [lo, hi) of causal (hi = t + 1) and window w (lo = t − w + 1; without causal
//       hi = t + w); a query that sees none gets 0), computed per (batch, head) in float32 with the scores in the
//       task's buffer; out (B, H, Lq, D) a view of a contiguous (B, Lq, H, D) tensor (the heads already merged for
//       the output projection); p (B, H, Lq, Lk) float32 holds P for the backward where computed (a causal block's
//       keys up to its last query's; the rest is not written)
//   attnlab::short_attention_backward(q, k, v, p, d_out, scale, causal, window) -> (dq, dk, dv)
//       κ dS = κ P ∘ (dP − rowsum(dP ∘ P)): dQ = κ dS K, dK = κ dSᵀ Q, dV = Pᵀ dO, each (B, H, L, D) a view of a
//       contiguous (B, L, H, D) tensor
//   attnlab::short_attention_packed(qkv, heads, scale, causal, window) -> (out, p)
//       short_attention on the packed projection qkv (B, L, 3E) that q, k, v are cut from (q, k, v in that order,
//       H = heads of E / H each), out (B, L, E)
//   attnlab::short_attention_packed_backward(qkv, p, d_out, heads, scale, causal, window) -> dqkv
//       its gradients written into one (B, L, 3E) tensor
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

#define ATTNLAB_BODY "short_body.h"
#include "isa_regions.h"

using namespace attnlab_native;

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

}  // namespace

namespace attnlab_native {

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

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("short_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window) -> (Tensor, "
        "Tensor)");
  m.def("short_attention_backward(Tensor q, Tensor k, Tensor v, Tensor p, Tensor d_out, float scale, bool causal, "
        "int window) -> (Tensor, Tensor, Tensor)");
  m.def("short_attention_packed(Tensor qkv, int heads, float scale, bool causal, int window) -> (Tensor, Tensor)");
  m.def("short_attention_packed_backward(Tensor qkv, Tensor p, Tensor d_out, int heads, float scale, bool causal, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("short_attention", &attnlab_native::short_attention);
  m.impl("short_attention_backward", &attnlab_native::short_attention_backward);
  m.impl("short_attention_packed", &attnlab_native::short_attention_packed);
  m.impl("short_attention_packed_backward", &attnlab_native::short_attention_packed_backward);
}
