// FlashAttention's forward pass (flash.h: the masks, mods and block products both passes share):
//
//   attnlab::flash_forward(q, k, v, scale, causal, window, …) -> (out, lse)
//       for each (batch, head, block of query rows), over the key blocks the mask leaves visible (online softmax):
//       S = scale · Q_i K_jᵀ;  m' = max(m, rowmax S);  P = e^(S − m');  l = e^(m − m') l + rowsum P;
//       acc = e^(m − m') acc + P V_j;  m = m'          then  O_i = acc / l,  LSE_i = m + log l
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "native.h"

namespace {

#define ATTNLAB_BODY "flash_body.h"
#include "isa_regions.h"
#include "flash.h"

std::tuple<at::Tensor, at::Tensor> flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double scale_, bool causal, int64_t window,
                                                 const std::optional<at::Tensor>& spans,
                                                 const std::optional<at::Tensor>& layout, int64_t granularity,
                                                 int64_t mod_code, const std::optional<at::Tensor>& slopes, double cap,
                                                 int64_t block_q, int64_t block_k, int64_t products) {
  const Shapes s = check("flash_forward", q, k, v, block_q, block_k);
  const Layout lay = make_layout("flash_forward", layout, granularity, s.Lq, s.Lk, block_q);
  const Band band = make_band("flash_forward", causal, window, s.B, s.Lq, s.Lk, spans);
  const Mod mod = make_mod("flash_forward", mod_code, slopes, cap, s.H);
  const float scale = static_cast<float>(scale_);
  at::Tensor out = at::empty({s.B, s.H, s.Lq, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.Lq}, q.options());
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  float *O = out.data_ptr<float>(), *LSE = lse.data_ptr<float>();
  const auto softmax_row = ISA_FN(online_softmax_row);
  const auto rescale = ISA_FN(scale_row);
  const auto modify = ISA_FN(mod_row);
  const auto [mm, kt, ldt, BQ, BK, BS, off, group] = walk("flash_forward", s, k, block_q, block_k, products);
  const int64_t n_blocks = (s.Lq + BQ - 1) / BQ, heads = s.B * s.H;
  std::vector<std::vector<float>> scratch(at::get_num_threads());
  // the last query blocks first: under a causal mask they see the most keys
  for_tasks(n_blocks * heads, [&](int64_t t, int64_t thread) {
    std::vector<float>& buf = scratch[thread];
    buf.resize(BQ * BS + BQ * s.Dv + 2 * BQ);
    float *S = buf.data(), *acc = S + BQ * BS, *m = acc + BQ * s.Dv, *l = m + BQ;
    const int64_t bh = t % heads, i0 = (n_blocks - 1 - t / heads) * BQ, nq = std::min(BQ, s.Lq - i0);
    const int64_t b = bh / s.H, kvh = b * s.Hkv + (bh % s.H) / group;
    const float param = mod.param(bh % s.H);
    const float *Qi = Q + (bh * s.Lq + i0) * s.D, *Kh = K + kvh * s.Lk * s.D, *Vh = V + kvh * s.Lk * s.Dv;
    const float* KTh = kt.defined() ? kt.data_ptr<float>() + kvh * s.D * ldt : nullptr;
    std::fill(acc, acc + nq * s.Dv, 0.f);
    std::fill(m, m + nq, -INFINITY);
    std::fill(l, l + nq, 0.f);
    const int64_t k0 = band.lo(b, off + i0), k1 = band.hi(b, off + i0 + nq - 1), I = (off + i0) / lay.G;
    const auto visible = [&](int64_t J) { return lay.on[I * lay.nkb + J] != 0; };
    lay.runs(k0, k1, visible, [&](int64_t a, int64_t e) {  // the visible keys, BK at a time
      for (int64_t ks = a; ks < e; ks += BK) {
        const int64_t nk = std::min(BK, e - ks);
        mm.abt(nq, nk, s.D, scale, Qi, s.D, Kh + ks * s.D, s.D, KTh + ks, ldt, false, S, BS);
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t p = off + i0 + r;
          const int64_t c0 = std::clamp<int64_t>(band.lo(b, p) - ks, 0, nk);
          const int64_t c1 = std::clamp<int64_t>(band.hi(b, p) - ks, 0, nk);
          modify(mod.code, S + r * BS, c0, c1, param, ks - p);
          const float alpha = softmax_row(S + r * BS, nk, c0, c1, m[r], l[r]);
          if (alpha != 1.f) rescale(acc + r * s.Dv, s.Dv, alpha);
        }
        mm.ab(nq, s.Dv, nk, 1.f, S, BS, Vh + ks * s.Dv, s.Dv, true, acc, s.Dv);
      }
    });
    for (int64_t r = 0; r < nq; ++r) {
      float* o = O + (bh * s.Lq + i0 + r) * s.Dv;
      const bool seen = l[r] > 0.f || std::isnan(l[r]);
      for (int64_t d = 0; d < s.Dv; ++d) o[d] = seen ? acc[r * s.Dv + d] / l[r] : 0.f;
      LSE[bh * s.Lq + i0 + r] = seen ? m[r] + std::log(l[r]) : -INFINITY;
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("flash_forward(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window, Tensor? spans, "
        "Tensor? layout, int granularity, int mod, Tensor? slopes, float cap, int block_q, int block_k, "
        "int products) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("flash_forward", &flash_forward); }
