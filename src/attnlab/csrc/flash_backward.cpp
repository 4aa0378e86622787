// FlashAttention's backward pass (flash.h: the masks, mods and block products both passes share):
//
//   attnlab::flash_backward(q, k, v, out, lse, d_out, scale, causal, window, …) -> (dq, dk, dv)
//       for each (batch, kv head, block of keys j), over the query blocks that see it, recomputing P from LSE:
//       P = e^(S − LSE);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − Δ_i),  Δ_i = rowsum(dO_i ∘ O_i);
//       dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& out,
                                                               const at::Tensor& lse, const at::Tensor& d_out,
                                                               double scale_, bool causal, int64_t window,
                                                               const std::optional<at::Tensor>& spans,
                                                               const std::optional<at::Tensor>& layout,
                                                               int64_t granularity, int64_t mod_code,
                                                               const std::optional<at::Tensor>& slopes, double cap,
                                                               int64_t block_q, int64_t block_k, int64_t products) {
  const Shapes s = check("flash_backward", q, k, v, block_q, block_k);
  check_f32(out, "flash_backward", "out");
  check_f32(d_out, "flash_backward", "d_out");
  check_f32(lse, "flash_backward", "lse");
  ATTNLAB_CHECK(out.sizes() == d_out.sizes() && out.dim() == 4 && out.size(0) == s.B && out.size(1) == s.H &&
                  out.size(2) == s.Lq && out.size(3) == s.Dv && lse.numel() == s.B * s.H * s.Lq,
                "attnlab::flash_backward: out and d_out must be (B, H, Lq, Dv) and lse (B, H, Lq) for q ", q.sizes(),
                " and v ", v.sizes(), ", got ", out.sizes(), ", ", d_out.sizes(), ", ", lse.sizes());
  const Band band = make_band("flash_backward", causal, window, s.B, s.Lq, s.Lk, spans);
  const Layout lay = make_layout("flash_backward", layout, granularity, s.Lq, s.Lk, block_k);
  const Mod mod = make_mod("flash_backward", mod_code, slopes, cap, s.H);
  const float scale = static_cast<float>(scale_);
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *O = out.data_ptr<float>(), *dO = d_out.data_ptr<float>(), *LSE = lse.data_ptr<float>();
  float *dQ = dq.data_ptr<float>(), *dK = dk.data_ptr<float>(), *dV = dv.data_ptr<float>();
  const auto probs = ISA_FN(probs_row);
  const auto dscores = ISA_FN(dscores_row);
  const auto dot_fn = ISA_FN(dot);
  const auto modify = ISA_FN(mod_row);
  const auto softcap_grad = ISA_FN(softcap_grad_row);
  const auto mul = ISA_FN(mul_row);
  const auto [mm, kt, ldt, BQ, BK, BS, off, group] = walk("flash_backward", s, k, block_q, block_k, products);
  const at::Tensor vt = mm.how == OWN ? transposed(v) : at::Tensor();
  const int64_t n_kv = (s.Lk + BK - 1) / BK, kv_heads = s.B * s.Hkv;
  // tasks: (batch, kv head, a part of its key blocks); each owns its rows of dK and dV. With fewer kv heads than
  // threads the key blocks are split into parts; a part's dQ sums go to a buffer of its own that covers only the
  // query rows seeing its keys (a window's: its keys plus the window), added into dQ at the end, in parallel over
  // rows. Fewer parts where those buffers would pass 4 |Q| (dense causal attention on many threads).
  const int64_t threads = at::get_num_threads();
  struct Part {
    int64_t j0, j1, r0, r1, offset;  // key blocks [j0, j1), the query rows [r0, r1) that see them, dQ buffer offset
  };
  auto plan = [&](int64_t parts, std::vector<Part>& tasks) {
    tasks.resize(kv_heads * parts);
    int64_t total = 0;
    for (int64_t t = 0; t < kv_heads * parts; ++t) {
      const int64_t b = t / parts / s.Hkv, j0 = t % parts * n_kv / parts, j1 = (t % parts + 1) * n_kv / parts;
      const int64_t k0 = j0 * BK, k1 = std::min(s.Lk, j1 * BK);
      const int64_t r0 = first_row(off, s.Lq, [&](int64_t p) { return band.hi(b, p) > k0; });
      const int64_t r1 = std::max(r0, first_row(off, s.Lq, [&](int64_t p) { return band.lo(b, p) >= k1; }));
      tasks[t] = {j0, j1, r0, r1, total};
      if (parts > 1) total += group * (r1 - r0) * s.D;
    }
    return total;
  };
  int64_t parts = kv_heads < threads ? std::min(n_kv, (2 * threads + kv_heads - 1) / kv_heads) : 1;
  std::vector<Part> tasks;
  int64_t total = plan(parts, tasks);
  while (parts > 1 && total > std::max<int64_t>(4 * q.numel(), int64_t(1) << 22))
    total = plan(parts = (parts + 1) / 2, tasks);
  at::Tensor dq_parts = parts > 1 ? at::zeros({total}, q.options()) : at::Tensor();
  std::vector<std::vector<float>> scratch(threads);
  for_tasks(kv_heads * parts, [&](int64_t t, int64_t thread) {
    const Part& task = tasks[t];
    const int64_t g = t / parts, b = g / s.Hkv, rows = task.r1 - task.r0;
    std::vector<float>& buf = scratch[thread];
    buf.resize(3 * BQ * BS + group * rows);
    float *S = buf.data(), *dP = S + BQ * BS, *G = dP + BQ * BS, *delta = G + BQ * BS;
    for (int64_t h = 0; h < group; ++h) {  // Δ = rowsum(dO ∘ O) of the group's query heads, on the rows that matter
      const int64_t bh = b * s.H + (g % s.Hkv) * group + h;
      for (int64_t i = task.r0; i < task.r1; ++i)
        delta[h * rows + i - task.r0] = dot_fn(dO + (bh * s.Lq + i) * s.Dv, O + (bh * s.Lq + i) * s.Dv, s.Dv);
    }
    const auto dq_rows = [&](int64_t bh, int64_t h, int64_t i0) {  // where dQ's row i0 of head bh sums
      return dq_parts.defined() ? dq_parts.data_ptr<float>() + task.offset + (h * rows + i0 - task.r0) * s.D
                                : dQ + (bh * s.Lq + i0) * s.D;
    };
    for (int64_t j = task.j0; j < task.j1; ++j) {
      const int64_t ks = j * BK, nk = std::min(BK, s.Lk - ks);
      const float *Kj = K + (g * s.Lk + ks) * s.D, *Vj = V + (g * s.Lk + ks) * s.Dv;
      float *dKj = dK + (g * s.Lk + ks) * s.D, *dVj = dV + (g * s.Lk + ks) * s.Dv;
      const float* KTj = kt.defined() ? kt.data_ptr<float>() + g * s.D * ldt + ks : nullptr;
      const float* VTj = vt.defined() ? vt.data_ptr<float>() + g * s.Dv * ldt + ks : nullptr;
      const int64_t r0 = first_row(off, s.Lq, [&](int64_t p) { return band.hi(b, p) > ks; });
      const int64_t r1 = first_row(off, s.Lq, [&](int64_t p) { return band.lo(b, p) >= ks + nk; });
      for (int64_t h = 0; h < group; ++h) {
        const int64_t bh = b * s.H + (g % s.Hkv) * group + h;
        const float param = mod.param(bh % s.H);
        const auto sees = [&](int64_t I) { return lay.on[I * lay.nkb + j] != 0; };  // (the key tile is block j)
        lay.runs(off + r0, off + r1, sees, [&](int64_t pa, int64_t pe) {  // the rows that see these keys
          for (int64_t i0 = pa - off; i0 < pe - off; i0 += BQ) {  // BQ at a time
            const int64_t nq = std::min(BQ, pe - off - i0);
            bool any = false;
            const float *Qi = Q + (bh * s.Lq + i0) * s.D, *dOi = dO + (bh * s.Lq + i0) * s.Dv;
            mm.abt(nq, nk, s.D, scale, Qi, s.D, Kj, s.D, KTj, ldt, false, S, BS);
            for (int64_t r = 0; r < nq; ++r) {
              const int64_t p = off + i0 + r;
              const int64_t c0 = std::clamp<int64_t>(band.lo(b, p) - ks, 0, nk);
              const int64_t c1 = std::clamp<int64_t>(band.hi(b, p) - ks, 0, nk);
              modify(mod.code, S + r * BS, c0, c1, param, ks - p);
              if (mod.code == 3) softcap_grad(S + r * BS, G + r * BS, nk, mod.cap);
              probs(S + r * BS, nk, c0, c1, LSE[bh * s.Lq + i0 + r]);
              any = any || c1 > c0;
            }
            if (!any) continue;
            mm.atb(nk, s.Dv, nq, 1.f, S, BS, dOi, s.Dv, true, dVj, s.Dv);                   // dV_j += Pᵀ dO_i
            mm.abt(nq, nk, s.Dv, 1.f, dOi, s.Dv, Vj, s.Dv, VTj, ldt, false, dP, BS);        // dP = dO_i V_jᵀ
            for (int64_t r = 0; r < nq; ++r) {
              dscores(S + r * BS, dP + r * BS, nk, delta[h * rows + i0 + r - task.r0]);
              if (mod.code == 3) mul(dP + r * BS, G + r * BS, nk);  // dS w.r.t. the raw scores
            }
            mm.ab(nq, s.D, nk, scale, dP, BS, Kj, s.D, true, dq_rows(bh, h, i0), s.D);      // dQ_i += κ dS K_j
            mm.atb(nk, s.D, nq, scale, dP, BS, Qi, s.D, true, dKj, s.D);                    // dK_j += κ dSᵀ Q_i
          }
        });
      }
    }
  });
  if (parts > 1) {  // dQ += the parts' sums, 64 rows of a head at a time
    const float* sums = dq_parts.data_ptr<float>();
    const int64_t chunks = (s.Lq + 63) / 64;
    at::parallel_for(0, kv_heads * group * chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t g = c / (group * chunks), h = c / chunks % group, i0 = c % chunks * 64;
        const int64_t i1 = std::min(s.Lq, i0 + 64), bh = g / s.Hkv * s.H + (g % s.Hkv) * group + h;
        for (int64_t part = 0; part < parts; ++part) {
          const Part& task = tasks[g * parts + part];
          for (int64_t i = std::max(i0, task.r0); i < std::min(i1, task.r1); ++i) {
            const float* from = sums + task.offset + (h * (task.r1 - task.r0) + i - task.r0) * s.D;
            float* to = dQ + (bh * s.Lq + i) * s.D;
            for (int64_t d = 0; d < s.D; ++d) to[d] += from[d];
          }
        }
      }
    });
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("flash_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor d_out, float scale, bool causal, "
        "int window, Tensor? spans, Tensor? layout, int granularity, int mod, Tensor? slopes, float cap, int block_q, "
        "int block_k, int products) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("flash_backward", &flash_backward); }
