// Exact softmax attention for long sequences on the CPU: FlashAttention's algorithm (Dao et al. 2022; the
// FlashAttention-2 loop order, 2023) with interval and block masks and a few score mods, forward and backward, one
// call each.
//
//   attnlab::flash_forward(q, k, v, scale, causal, window, …) -> (out, lse)
//       for each (batch, head, block of query rows), over the key blocks the mask leaves visible (online softmax):
//       S = scale · Q_i K_jᵀ;  m' = max(m, rowmax S);  P = e^(S − m');  l = e^(m − m') l + rowsum P;
//       acc = e^(m − m') acc + P V_j;  m = m'          then  O_i = acc / l,  LSE_i = m + log l
//   attnlab::flash_backward(q, k, v, out, lse, d_out, scale, causal, window, …) -> (dq, dk, dv)
//       for each (batch, kv head, block of keys j), over the query blocks that see it, recomputing P from LSE:
//       P = e^(S − LSE);  dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − Δ_i),  Δ_i = rowsum(dO_i ∘ O_i);
//       dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
//
// Query row i sits at position p = i + Lk − Lq (aligned to the end of the keys, as attnlab's masks are); it sees
// the keys [lo(p), hi(p)): causal hi = p + 1; a window w gives lo = p − w + 1 (and hi = p + w without causal);
// `spans` (Bs, 2, Lk) int64, Bs = 1 or B, intersects them with [spans[b][0][p], spans[b][1][p]) (packed documents,
// prefix-LM: both bounds non-decreasing in p). Those are intervals, so a block's mask is two column bounds per row,
// and key blocks outside every row's interval are never computed. A block `layout` (query blocks, key blocks) uint8
// of `granularity` G (BigBird's) also hides key j from position p unless layout[p / G][j / G]: only its visible
// blocks are computed. Time O(Lq · visible keys); memory O(block) per thread beyond the inputs and outputs (and, with
// our own products, Kᵀ and Vᵀ; in the backward with fewer kv heads than threads, the key parts' dQ sums, ≤ 4 |Q|).
// Score mods computed in place, S → mod(S), before the mask (`mod`: 1 ALiBi s + m_h (j − p), 2 symmetric ALiBi
// s − m_h |j − p| with the slopes m (H,) float32, 3 softcap c · tanh(s / c) with c = `cap`); the backward pass
// multiplies dS by d mod / ds (1 for ALiBi, 1 − (mod(s) / c)² for softcap).
// Grouped-query attention: query head h reads key/value head h / (H / Hkv). float32 throughout.
//
// The block products (`products`): our own register-tiled kernel (flash_body.h: gemm_own, reading Kᵀ and Vᵀ
// transposed once per call) or ATen's addmm on views of the same memory (the BLAS torch links); by default ours with
// AVX-512, else ATen's. The element-wise
// passes are vectorised (flash_body.h) for the library's instruction set. Tasks are handed out dynamically over
// torch's threads.
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

using attnlab_native::check_f32;

enum Products : int64_t { AUTO = -1, ATEN = 0, OWN = 2 };

Products resolve(int64_t products) {
  ATTNLAB_CHECK(products == AUTO || products == ATEN || products == OWN,
                "attnlab::flash: products must be -1 (auto), 0 (ATen) or 2 (own), got ", products);
  if (products != AUTO) return static_cast<Products>(products);
  // ours with AVX-512 (faster than MKL's on these blocks, whose packing of both operands every call costs; see
  // docs/performance.md); with AVX2's 16 registers its tiles are smaller and the BLAS's tuned kernels serve
  // (through ATen's addmm)
  return attnlab_native::cpu_isa() >= 2 ? OWN : ATEN;
}

// the columns our products read past a block's last key (Kᵀ and Vᵀ are padded by them; S rows are as wide)
constexpr int64_t kPad = 16;

// xᵀ per (batch, head): (B·H, D, L + kPad), the padding zero: the B operand of our S = Q Kᵀ and dP = dO Vᵀ products
at::Tensor transposed(const at::Tensor& x) {
  const int64_t G = x.size(0) * x.size(1), Lk = x.size(2), D = x.size(3), ld = Lk + kPad, chunk = 64;
  at::Tensor t = at::empty({G, D, ld}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = t.data_ptr<float>();
  const int64_t chunks = (Lk + chunk - 1) / chunk;
  const auto transpose = ISA_FN(transpose_rows);
  at::parallel_for(0, G * chunks, 1, [&](int64_t a, int64_t e) {
    for (int64_t c = a; c < e; ++c) {
      const int64_t g = c / chunks, j0 = c % chunks * chunk, j1 = std::min(Lk, j0 + chunk);
      const float* from = src + g * Lk * D;
      float* to = dst + g * D * ld;
      transpose(from, D, D, j0, j1, to, ld);
      if (j1 == Lk)
        for (int64_t d = 0; d < D; ++d) std::fill(to + d * ld + Lk, to + (d + 1) * ld, 0.f);
    }
  });
  return t;
}

// C (M×N, row stride ldc) = α op(A) op(B) + β C, row-major: op(A) is M×K (A stored K×M when ta), op(B) K×N (B
// stored N×K when tb), with ATen's addmm. β = 0 ignores C's contents.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto view = [&](const float* p, int64_t rows, int64_t cols, int64_t ld, bool t) {
    at::Tensor x = at::from_blob(const_cast<float*>(p), {t ? cols : rows, t ? rows : cols}, {ld, 1}, f32);
    return t ? x.t() : x;
  };
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, f32);
  c.addmm_(view(A, M, K, lda, ta), view(B, K, N, ldb, tb), beta, alpha);
}

// a call's block products in the three forms the passes use, by `how`
struct Gemms {
  Products how;
  decltype(&portable::gemm_own) own;
  // C (M×N) = α A Bᵀ (+ C when acc): A (M×K, lda), B (N×K, ldb); ours reads Bᵀ (K×N, ldbt) from Kᵀ or Vᵀ instead
  void abt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
           const float* bt, int64_t ldbt, bool acc, float* C, int64_t ldc) const {
    if (how == OWN) own(M, N, K, alpha, A, lda, 1, bt, ldbt, acc, C, ldc, true);
    else gemm(false, true, M, N, K, alpha, A, lda, B, ldb, acc ? 1.f : 0.f, C, ldc);
  }
  // C (M×N) = α A B (+ C when acc): A (M×K, lda), B (K×N, ldb)
  void ab(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          bool acc, float* C, int64_t ldc) const {
    if (how == OWN) own(M, N, K, alpha, A, lda, 1, B, ldb, acc, C, ldc, false);
    else gemm(false, false, M, N, K, alpha, A, lda, B, ldb, acc ? 1.f : 0.f, C, ldc);
  }
  // C (M×N) = α Aᵀ B (+ C when acc): A (K×M, lda), B (K×N, ldb)
  void atb(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
           bool acc, float* C, int64_t ldc) const {
    if (how == OWN) own(M, N, K, alpha, A, 1, lda, B, ldb, acc, C, ldc, false);
    else gemm(true, false, M, N, K, alpha, A, lda, B, ldb, acc ? 1.f : 0.f, C, ldc);
  }
};

// the keys [lo(p), hi(p)) that query position p of batch b sees, clamped to [0, Lk) (empty: lo ≥ hi)
struct Band {
  bool causal;
  int64_t window;                 // ≤ 0: none
  int64_t Lk;
  const int64_t* spans = nullptr;  // (Bs, 2, Lk) or null
  int64_t span_batches = 1;
  const int64_t* span(int64_t b) const { return spans + (span_batches > 1 ? b : 0) * 2 * Lk; }
  int64_t lo(int64_t b, int64_t p) const {
    int64_t x = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    if (spans && p >= 0 && p < Lk) x = std::max(x, span(b)[p]);
    return x;
  }
  int64_t hi(int64_t b, int64_t p) const {
    int64_t x = causal ? std::min(Lk, std::max<int64_t>(0, p + 1))
                       : (window > 0 ? std::min(Lk, std::max<int64_t>(0, p + window)) : Lk);
    if (spans && p >= 0 && p < Lk) x = std::min(x, span(b)[Lk + p]);
    return x;
  }
};

// a score mod of the kernel's own (flash_body.h: mod_row): 0 none, 1 ALiBi, 2 symmetric ALiBi, 3 softcap
struct Mod {
  int64_t code = 0;
  const float* slopes = nullptr;  // (H,) for ALiBi
  float cap = 0.f;
  float param(int64_t h) const { return code == 3 ? cap : (code ? slopes[h] : 0.f); }
};

// a block layout (BigBird's): key j is visible from query position p only if on[(p / G) · nkb + j / G]
struct Layout {
  const uint8_t* on = nullptr;  // (nqb, nkb), or null: every block
  int64_t G = 1, nqb = 0, nkb = 0;
  // f(a, e) for each run [a, e) of positions in [lo, hi) whose blocks b have visible(b), consecutive blocks merged
  template <class Visible, class F>
  void runs(int64_t lo, int64_t hi, const Visible& visible, const F& f) const {
    if (on == nullptr) {
      if (lo < hi) f(lo, hi);
      return;
    }
    int64_t start = -1;
    for (int64_t blk = lo / G; blk * G < hi; ++blk) {
      const bool vis = visible(blk);
      if (vis && start < 0) start = std::max(lo, blk * G);
      if (!vis && start >= 0) f(start, blk * G), start = -1;
    }
    if (start >= 0) f(start, hi);
  }
};

// `tile`: the forward pass's query tile or the backward pass's key tile, which must be one block of the layout
Layout make_layout(const char* op, const std::optional<at::Tensor>& layout, int64_t G, int64_t Lq, int64_t Lk,
                   int64_t tile) {
  Layout lay;
  if (!layout) return lay;
  ATTNLAB_CHECK(1 <= G && G <= std::max<int64_t>(Lk, 1), "attnlab::", op, ": granularity must be in [1, Lk = ", Lk,
                "] (a larger block is one block: pass Lk), got ", G);
  const int64_t blocks = (Lk + G - 1) / G;  // (G ≤ Lk: no overflow)
  ATTNLAB_CHECK(layout->device().is_cpu() && layout->scalar_type() == at::kByte && layout->is_contiguous() &&
                  layout->dim() == 2 && layout->size(0) >= blocks && layout->size(1) >= blocks,
                "attnlab::", op, ": layout must be a contiguous uint8 CPU tensor of (query blocks, key blocks) "
                "covering ", Lk, " positions in blocks of ", G, ", got ", layout->scalar_type(), " ", layout->sizes());
  ATTNLAB_CHECK(tile == G && (Lk - Lq) % G == 0, "attnlab::", op, ": with a layout of ", G, "-blocks the ",
                "forward's query tile (block_q) and the backward's key tile (block_k) must be one block and Lk − Lq a "
                "multiple of it, got a tile of ", tile, " and Lk − Lq = ", Lk - Lq);
  lay.on = layout->data_ptr<uint8_t>();
  lay.G = G;
  lay.nqb = layout->size(0);
  lay.nkb = layout->size(1);
  return lay;
}

Band make_band(const char* op, bool causal, int64_t window, int64_t B, int64_t Lq, int64_t Lk,
               const std::optional<at::Tensor>& spans) {
  Band band{causal, attnlab_native::clamp_window(window, Lq, Lk), Lk};
  if (spans) {
    ATTNLAB_CHECK(spans->device().is_cpu() && spans->scalar_type() == at::kLong && spans->is_contiguous() &&
                    spans->dim() == 3 && (spans->size(0) == 1 || spans->size(0) == B) && spans->size(1) == 2 &&
                    spans->size(2) == Lk,
                  "attnlab::", op, ": spans must be a contiguous int64 CPU tensor (1 or B, 2, Lk) = (", B, ", 2, ", Lk,
                  "), got ", spans->scalar_type(), " ", spans->sizes());
    ATTNLAB_CHECK(Lq <= Lk, "attnlab::", op, ": spans need Lq ≤ Lk (query positions within the keys'), got ", Lq,
                  " > ", Lk);
    band.spans = spans->data_ptr<int64_t>();
    band.span_batches = spans->size(0);
    for (int64_t b = 0; b < band.span_batches; ++b) {  // the block skipping relies on it
      const int64_t* sp = band.span(b);
      for (int64_t p = 0; p < Lk; ++p) {
        ATTNLAB_CHECK(0 <= sp[p] && sp[p] <= Lk && 0 <= sp[Lk + p] && sp[Lk + p] <= Lk, "attnlab::", op,
                      ": spans' bounds must lie in [0, Lk = ", Lk, "] (batch ", b, ", position ", p, "), got [",
                      sp[p], ", ", sp[Lk + p], ")");
        ATTNLAB_CHECK(p == 0 || (sp[p - 1] <= sp[p] && sp[Lk + p - 1] <= sp[Lk + p]), "attnlab::", op,
                      ": spans' bounds must be non-decreasing in the position (batch ", b, ", position ", p, ")");
      }
    }
  }
  return band;
}

Mod make_mod(const char* op, int64_t code, const std::optional<at::Tensor>& slopes, double cap, int64_t H) {
  ATTNLAB_CHECK(code >= 0 && code <= 3, "attnlab::", op, ": mod must be 0-3, got ", code);
  Mod mod{code};
  if (code == 1 || code == 2) {
    ATTNLAB_CHECK(slopes.has_value(), "attnlab::", op, ": ALiBi (mod ", code, ") needs slopes");
    check_f32(*slopes, op, "slopes");
    ATTNLAB_CHECK(slopes->numel() == H, "attnlab::", op, ": slopes must hold one per query head (", H, "), got ",
                  slopes->numel());
    mod.slopes = slopes->data_ptr<float>();
  }
  if (code == 3) {
    ATTNLAB_CHECK(cap > 0 && std::isfinite(cap), "attnlab::", op, ": softcap needs a positive finite cap, got ", cap);
    mod.cap = static_cast<float>(cap);
  }
  return mod;
}

// the first query row i in [0, Lq) whose position off + i satisfies pred (pred is monotone: false, then true), Lq if none
template <class Pred>
int64_t first_row(int64_t off, int64_t Lq, const Pred& pred) {
  int64_t a = 0, b = Lq;
  while (a < b) {
    const int64_t mid = (a + b) / 2;
    if (pred(off + mid)) b = mid; else a = mid + 1;
  }
  return a;
}

// run task(t, thread) for t in [0, n), handed out one at a time to torch's threads (uneven tasks stay balanced)
template <class F>
void for_tasks(int64_t n, const F& task) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t thread = t0; thread < t1; ++thread)
      for (int64_t t = next++; t < n; t = next++) task(t, thread);
  });
}

struct Shapes {
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
};

Shapes check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block_q,
             int64_t block_k) {
  check_f32(q, op, "q");
  check_f32(k, op, "k");
  check_f32(v, op, "v");
  ATTNLAB_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attnlab::", op,
                ": q, k, v must be 4-D (B, H, L, D), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const Shapes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  ATTNLAB_CHECK(k.size(0) == s.B && v.size(0) == s.B && v.size(1) == s.Hkv && v.size(2) == s.Lk && k.size(3) == s.D,
                "attnlab::", op, ": k must be (B, Hkv, Lk, D) and v (B, Hkv, Lk, Dv) for q ", q.sizes(), ", got ",
                k.sizes(), " and ", v.sizes());
  ATTNLAB_CHECK(s.Hkv >= 1 && s.H % s.Hkv == 0, "attnlab::", op, ": q's heads (", s.H,
                ") must be a multiple of k's (", s.Hkv, ")");
  ATTNLAB_CHECK(block_q >= 1 && block_k >= 1, "attnlab::", op, ": block sizes must be ≥ 1, got ", block_q, " and ",
                block_k);
  return s;
}

// a pass's tiles (rows, keys): block_q and block_k within the sequences (a larger tile covers the same rows: the
// same result), at most MAX_TILE scores (their scratch per thread)
constexpr int64_t MAX_TILE = int64_t(1) << 24;
std::pair<int64_t, int64_t> tiles(const char* op, const Shapes& s, int64_t block_q, int64_t block_k) {
  const int64_t bq = std::min(block_q, std::max<int64_t>(s.Lq, 1)), bk = std::min(block_k, std::max<int64_t>(s.Lk, 1));
  ATTNLAB_CHECK(bq <= MAX_TILE / bk, "attnlab::", op, ": a tile of block_q × block_k scores (within Lq × Lk) must ",
                "hold at most 2^24, got ", bq, " × ", bk);
  return {bq, bk};
}

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
  const Gemms mm{resolve(products), ISA_FN(gemm_own)};
  const at::Tensor kt = mm.how == OWN ? transposed(k) : at::Tensor();
  const int64_t ldt = s.Lk + kPad;
  const std::pair<int64_t, int64_t> tile = tiles("flash_forward", s, block_q, block_k);
  const int64_t BQ = tile.first, BK = tile.second;
  const int64_t BS = (BK + kPad - 1) / kPad * kPad, off = s.Lk - s.Lq, group = s.H / s.Hkv;
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
  const Gemms mm{resolve(products), ISA_FN(gemm_own)};
  const at::Tensor kt = mm.how == OWN ? transposed(k) : at::Tensor();
  const at::Tensor vt = mm.how == OWN ? transposed(v) : at::Tensor();
  const int64_t ldt = s.Lk + kPad;
  const std::pair<int64_t, int64_t> tile = tiles("flash_backward", s, block_q, block_k);
  const int64_t BQ = tile.first, BK = tile.second;
  const int64_t BS = (BK + kPad - 1) / kPad * kPad, off = s.Lk - s.Lq, group = s.H / s.Hkv;
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
  m.def("flash_forward(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window, Tensor? spans, "
        "Tensor? layout, int granularity, int mod, Tensor? slopes, float cap, int block_q, int block_k, "
        "int products) -> (Tensor, Tensor)");
  m.def("flash_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor d_out, float scale, bool causal, "
        "int window, Tensor? spans, Tensor? layout, int granularity, int mod, Tensor? slopes, float cap, int block_q, "
        "int block_k, int products) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("flash_forward", &flash_forward);
  m.impl("flash_backward", &flash_backward);
}
