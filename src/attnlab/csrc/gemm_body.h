// Small float32 block products with register tiles, written with GCC's vector extensions (`VF`, `L`, `load`, `store`,
// `splat` of decode_body.h, included before this) and compiled per instruction set (isa_regions.h): flash.cpp's
// attention blocks and train.cpp's short attention.

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
