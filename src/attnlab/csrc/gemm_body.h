// Small float32 block products with register tiles, and the transposes that feed them, written with GCC's vector
// extensions (vec.h's `VF`, `L`, `load`, `store`, `splat`) and compiled per instruction set (isa_regions.h):
// flash.h's attention blocks and short_attention.cpp's.

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

// xᵀ of a run of rows: to[d·ldt + j] = from[j·ldf + d] for j in [j0, j1), d in [0, D). With AVX-512 by 16 × 16 tiles
// (AVX2: 8 × 8)
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

// the same by 8 × 8 tiles (AVX2's registers): three rounds (4, 2, 1)
using V8 = float __attribute__((vector_size(32)));
template <int W>
inline void swap_blocks8(V8* r) {
  for (int a = 0; a < 8; ++a) {
    if (a & W) continue;
    const V8 x = r[a], y = r[a + W];
    if constexpr (W == 4) {
      r[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11);
      r[a + W] = __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
    } else if constexpr (W == 2) {
      r[a] = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13);
      r[a + W] = __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    } else {
      r[a] = __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14);
      r[a + W] = __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
    }
  }
}

inline void transpose_rows(const float* from, int64_t ldf, int64_t D, int64_t j0, int64_t j1, float* to,
                           int64_t ldt) {
  int64_t j = j0;
  if constexpr (L == 8)
    for (; j + 8 <= j1; j += 8) {
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        V8 r[8];
        for (int a = 0; a < 8; ++a) std::memcpy(&r[a], from + (j + a) * ldf + d, sizeof(V8));
        swap_blocks8<4>(r), swap_blocks8<2>(r), swap_blocks8<1>(r);
        for (int a = 0; a < 8; ++a) std::memcpy(to + (d + a) * ldt + j, &r[a], sizeof(V8));
      }
      for (; d < D; ++d)
        for (int64_t a = j; a < j + 8; ++a) to[d * ldt + a] = from[a * ldf + d];
    }
  if constexpr (L == 16)
    for (; j + 16 <= j1; j += 16) {
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        V16 r[16];
        for (int a = 0; a < 16; ++a) std::memcpy(&r[a], from + (j + a) * ldf + d, sizeof(V16));
        swap_blocks<8>(r), swap_blocks<4>(r), swap_blocks<2>(r), swap_blocks<1>(r);
        for (int a = 0; a < 16; ++a) std::memcpy(to + (d + a) * ldt + j, &r[a], sizeof(V16));
      }
      for (; d < D; ++d)
        for (int64_t a = j; a < j + 16; ++a) to[d * ldt + a] = from[a * ldf + d];
    }
  for (; j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) to[d * ldt + j] = from[j * ldf + d];
}
