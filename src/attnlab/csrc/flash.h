// What FlashAttention's two passes share (flash_forward.cpp, flash_backward.cpp): the arguments' checks, the walk
// over blocks and the block products. Exact softmax attention for long sequences on the CPU: FlashAttention's
// algorithm (Dao et al. 2022; the FlashAttention-2 loop order, 2023) with interval and block masks and a few score
// mods, forward and backward, one call each.
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
// AVX-512, else ATen's. The element-wise passes are vectorised (flash_body.h) for the library's instruction set.
// Tasks are handed out dynamically over torch's threads.
//
// Included by both passes' files inside their anonymous namespace, after isa_regions.h with flash_body.h (the
// ISA_FN of transposed and of the products) and the headers below them.
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

// a pass's walk over blocks: who computes the block products (with ours, Kᵀ `kt`, its rows ldt apart), the tiles (BQ
// query rows, BK keys, a row of scores BS wide: BK padded to kPad), query row 0's position `off` (Lk − Lq) and the
// query heads per kv head (`group`)
struct Walk {
  Gemms mm;
  at::Tensor kt;
  int64_t ldt, BQ, BK, BS, off, group;
};
Walk walk(const char* op, const Shapes& s, const at::Tensor& k, int64_t block_q, int64_t block_k, int64_t products) {
  const Gemms mm{resolve(products), ISA_FN(gemm_own)};
  const auto [BQ, BK] = tiles(op, s, block_q, block_k);
  return {mm, mm.how == OWN ? transposed(k) : at::Tensor(), s.Lk + kPad, BQ, BK, (BK + kPad - 1) / kPad * kPad,
          s.Lk - s.Lq, s.H / s.Hkv};
}
