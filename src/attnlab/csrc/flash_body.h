// The vector code of flash.cpp: the element-wise passes over one row of a score block, written once with GCC's
// vector extensions and compiled per instruction set (isa_regions.h), on top of decode_body.h's `exp_any`.
// A row's visible keys are one interval [c0, c1) of the block's n columns (causal and sliding-window masks are
// intervals); the columns outside it get probability 0.

#include "decode_body.h"

inline void zero_outside(float* s, int64_t n, int64_t c0, int64_t c1) {
  if (c1 <= c0) c0 = c1 = n;
  std::memset(s, 0, sizeof(float) * c0);
  std::memset(s + c1, 0, sizeof(float) * (n - c1));
}

// The forward pass's online softmax on one row of scores s (n columns, visible [c0, c1)), with the row's running
// max m and sum l:  m' = max(m, max_j s_j);  s_j ← e^(s_j − m');  l ← e^(m − m') l + Σ_j s_j;  m ← m'.
// Returns α = e^(m − m'), the factor for the row's accumulated output (1 when the row sees nothing here).
// A NaN score makes the row's sum NaN; an overflowed (+inf) one gives inf − inf = NaN: never a silent number.
inline float online_softmax_row(float* s, int64_t n, int64_t c0, int64_t c1, float& m, float& l) {
  zero_outside(s, n, c0, c1);
  if (c1 <= c0) return 1.f;
  VF vmax = splat(-INFINITY);
  int64_t j = c0;
  for (; j + L <= c1; j += L) {
    const VF v = load(s + j);
    vmax = v > vmax ? v : vmax;
  }
  float mx = -INFINITY;
  for (int i = 0; i < L; ++i) mx = std::max(mx, vmax[i]);
  for (; j < c1; ++j) mx = std::max(mx, s[j]);
  const float m_new = std::max(m, mx);
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - m_new);
  const float sum = exp_shifted(s, c0, c1, m_new);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// The backward pass's probabilities of one row, P_j = e^(s_j − LSE) on [c0, c1), 0 elsewhere, in place
inline void probs_row(float* s, int64_t n, int64_t c0, int64_t c1, float lse) {
  zero_outside(s, n, c0, c1);
  if (c1 > c0) exp_shifted(s, c0, c1, lse);
}

// dS = P ∘ (dP − Δ) in place in dp (one row of n columns; Δ = rowsum(dO ∘ O))
inline void dscores_row(const float* p, float* dp, int64_t n, float delta) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(dp + j, load(p + j) * (load(dp + j) - splat(delta)));
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

// y[0..n) *= a
inline void scale_row(float* y, int64_t n, float a) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(y + j, load(y + j) * splat(a));
  for (; j < n; ++j) y[j] *= a;
}

// The score_mods the kernel computes itself (codes of flash.cpp's Mod), on the columns [c0, c1) of one row whose
// column 0 is the key at distance d0 = (key position − query position):
//   ALiBi        s_j += m · (d0 + j)        symmetric ALiBi  s_j −= m · |d0 + j|        softcap  s_j = c · tanh(s_j / c)
inline void mod_row(int64_t mod, float* s, int64_t c0, int64_t c1, float param, int64_t d0) {
  if (mod == 0 || c1 <= c0) return;
  VF ramp;
  for (int i = 0; i < L; ++i) ramp[i] = static_cast<float>(i);
  int64_t j = c0;
  for (; j < c1; j += L) {
    const int64_t n = std::min<int64_t>(L, c1 - j);
    VF v = splat(0.f);
    std::memcpy(&v, s + j, sizeof(float) * n);
    if (mod == 3) {
      const VF e = exp_any(v * splat(2.f / param));
      v = splat(param) * (splat(1.f) - splat(2.f) / (splat(1.f) + e));  // c · tanh(s / c)
    } else {
      VF d = ramp + static_cast<float>(d0 + j);  // exact: |distance| < 2²⁴
      if (mod == 2) d = d < splat(0.f) ? -d : d;
      v += (mod == 1 ? splat(param) : splat(-param)) * d;
    }
    std::memcpy(s + j, &v, sizeof(float) * n);
  }
}

// softcap's derivative written in its output y = c · tanh(s / c): g_j = 1 − (y_j / c)², over [0, n)
inline void softcap_grad_row(const float* y, float* g, int64_t n, float cap) {
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const VF t = load(y + j) * splat(1.f / cap);
    store(g + j, splat(1.f) - t * t);
  }
  for (; j < n; ++j) g[j] = 1.f - (y[j] / cap) * (y[j] / cap);
}

// y[0..n) *= g[0..n)
inline void mul_row(float* y, const float* g, int64_t n) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(y + j, load(y + j) * load(g + j));
  for (; j < n; ++j) y[j] *= g[j];
}

// The block products of our own: C (M × N, row stride ldc) = α Σ_k A(i, k) B(k, ·), added to C when `acc`, with
// A(i, k) = A[i·sa + k·sk] (A row-major: sa = lda, sk = 1; Aᵀ stored: sa = 1, sk = lda) and B row-major (ldb).
// A register tile of MR rows × NV vectors of C takes, per k, one broadcast of A per row, NV loads of B and MR·NV
// fused multiply-adds: no packing (these blocks are small and read once, where a BLAS call packs both operands
// every time). `pad`: N rounded up to whole vectors (the caller's B and C have the room); else the last N mod L
// columns are summed element by element.
template <int MR, int NV>
inline __attribute__((always_inline)) void gemm_tile(int64_t K, float alpha, const float* A, int64_t sa, int64_t sk,
                                                     const float* B, int64_t ldb, bool acc, float* C, int64_t ldc) {
  VF c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = splat(0.f);
  for (int64_t k = 0; k < K; ++k) {
    VF b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + k * ldb + v * L);
    for (int r = 0; r < MR; ++r) {
      const VF a = splat(A[r * sa + k * sk]);
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float* p = C + r * ldc + v * L;
      store(p, acc ? load(p) + c[r][v] * splat(alpha) : c[r][v] * splat(alpha));
    }
}

// a last tile of mr < MR rows: an instance of its own
template <int MR, int NV>
void gemm_rows(int64_t mr, int64_t K, float alpha, const float* A, int64_t sa, int64_t sk, const float* B,
               int64_t ldb, bool acc, float* C, int64_t ldc) {
  if constexpr (MR > 1) {
    if (mr == MR - 1) gemm_tile<MR - 1, NV>(K, alpha, A, sa, sk, B, ldb, acc, C, ldc);
    else gemm_rows<MR - 1, NV>(mr, K, alpha, A, sa, sk, B, ldb, acc, C, ldc);
  }
}

// the columns [0, n·NV·L) of C, MR rows at a time
template <int MR, int NV>
void gemm_panels(int64_t M, int64_t n, int64_t K, float alpha, const float* A, int64_t sa, int64_t sk,
                 const float* B, int64_t ldb, bool acc, float* C, int64_t ldc) {
  for (int64_t j = 0; j < n * NV * L; j += NV * L) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) gemm_tile<MR, NV>(K, alpha, A + i * sa, sa, sk, B + j, ldb, acc, C + i * ldc + j, ldc);
    if (i < M) gemm_rows<MR, NV>(M - i, K, alpha, A + i * sa, sa, sk, B + j, ldb, acc, C + i * ldc + j, ldc);
  }
}

inline void gemm_own(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t sa, int64_t sk,
                     const float* B, int64_t ldb, bool acc, float* C, int64_t ldc, bool pad) {
  // tiles for L = 16 (AVX-512, 32 registers): 6 × 4 and 12 × 2 vectors; narrower sets (16 registers): 3 × 4, 6 × 2
  constexpr int wide = L == 16 ? 6 : 3, narrow = L == 16 ? 12 : 6;
  const int64_t vecs = pad ? (N + L - 1) / L : N / L;
  int64_t j = vecs / 4 * 4 * L;
  gemm_panels<wide, 4>(M, vecs / 4, K, alpha, A, sa, sk, B, ldb, acc, C, ldc);
  if (vecs % 4 >= 2) gemm_panels<narrow, 2>(M, 1, K, alpha, A, sa, sk, B + j, ldb, acc, C + j, ldc), j += 2 * L;
  if (vecs % 2) gemm_panels<narrow, 1>(M, 1, K, alpha, A, sa, sk, B + j, ldb, acc, C + j, ldc), j += L;
  for (; j < N; ++j)  // (not pad) the last columns
    for (int64_t i = 0; i < M; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += A[i * sa + k * sk] * B[k * ldb + j];
      C[i * ldc + j] = acc ? C[i * ldc + j] + alpha * sum : alpha * sum;
    }
}

// xᵀ of a run of rows: to[d·ldt + j] = from[j·D + d] for j in [j0, j1), d in [0, D). With AVX-512 by 16 × 16 tiles
// in registers: four rounds of two-source shuffles, each swapping the off-diagonal blocks of one size (8, 4, 2, 1)
// — ~3× faster than element by element, which cost ~5 ms for each (8, 8192, 64) K or V on 2 cores
using V16 = float __attribute__((vector_size(64)));
template <int W>
inline void swap_blocks(V16* r) {
  for (int a = 0; a < 16; ++a) {
    if (a & W) continue;
    const V16 x = r[a], y = r[a + W];
    if constexpr (W == 8) {
      r[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      r[a + W] = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (W == 4) {
      r[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[a + W] = __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    } else if constexpr (W == 2) {
      r[a] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[a + W] = __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    } else {
      r[a] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[a + W] = __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
  }
}

inline void transpose_rows(const float* from, int64_t D, int64_t j0, int64_t j1, float* to, int64_t ldt) {
  int64_t j = j0;
  if constexpr (L == 16)
    for (; j + 16 <= j1; j += 16) {
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        V16 r[16];
        for (int a = 0; a < 16; ++a) std::memcpy(&r[a], from + (j + a) * D + d, sizeof(V16));
        swap_blocks<8>(r), swap_blocks<4>(r), swap_blocks<2>(r), swap_blocks<1>(r);
        for (int a = 0; a < 16; ++a) std::memcpy(to + (d + a) * ldt + j, &r[a], sizeof(V16));
      }
      for (; d < D; ++d)
        for (int64_t a = j; a < j + 16; ++a) to[d * ldt + a] = from[a * D + d];
    }
  for (; j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) to[d * ldt + j] = from[j * D + d];
}
