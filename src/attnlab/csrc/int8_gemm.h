// The int8 product of attnlab::int8_product on AVX2 (isa 1), with its rescaling fused (included by int8_product.cpp
// and int8_train.cpp inside their anonymous namespace, after isa_regions.h with int8_rows.h: the tiles are rescaled
// with dequant_vec's arithmetic):
//
//   y = diag(rs) (A B) diag(cs) + bias,   A (M, K) int8 (rows contiguous), B (K, N) int8 with |b| ≤ 63 (any
//   strides), y (M, N) float32 or bfloat16 contiguous. K past a multiple of 8 is padded with zero rows of B.
//
// AVX2 multiplies bytes only as vpmaddubsw: unsigned × signed pairs summed into a saturating int16. So A is read
// shifted to unsigned, a + 128 ∈ [0, 255] (one XOR of its sign bit), and B's 7 bits keep a pair's sum within int16
// (2 · 255 · 63 = 32130 < 32767); vpmaddwd widens four terms of a column to int32, where they are summed exactly.
// The shift comes back out per column: the sums start at −128 Σ_k b_kn, so they end at Σ_k (a_k + 128) b_kn −
// 128 Σ_k b_kn = Σ_k a_k b_kn, the exact int32 sums of torch._int_mm. Where A's rows (a thread's share of them) lie
// within ±63 too — the int8 layers round both operands to ±63 — the shift is 64 and two steps' int16 sums add
// exactly (2 · 2 · 127 · 63 = 32004) before one vpmaddwd widens them: 12 multiply-type instructions for 8 k
// instead of 16, which bound the loop (the multiply-type instructions retire about two a cycle). Each 4 × 16 tile
// of sums is rescaled from its registers by the arithmetic of the dequant_row that rescales torch._int_mm's rows
// (dequant_vec), so y has the same bits either way.
//
// Why not torch._int_mm (oneDNN) there: for s8 × s8 on AVX2 oneDNN copies B shifted and sums its columns on every
// call, ~15 µs a call before any product (nanogpt-cpu makes 48 products a step), and its int32 result then takes a
// pass of its own to rescale. Here B is packed once a call (the column sums and the check |b| ≤ 63 in the same pass)
// into panels of 16 columns, P[k/4][c][k%4], the operand vpmaddubsw reads. (With AVX2 and no VNNI oneDNN's s8 × s8
// product is moreover a reference loop, slower than float32's: see docs/performance.md.)
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace u8s8 {
using namespace avx2;  // the AVX2 region's vocabulary (vec.h) and rows (int8_rows.h)

constexpr int64_t NR = 16;  // columns of a panel: two vectors of 8 int32 sums
constexpr int64_t MR = 4;   // rows of a tile: 4 × 2 accumulators, two vectors of B, the broadcast and scratch

// Panel p of B (columns [16p, 16p + 16), zeros past N) into P (K4 · 64 bytes, K4 ≥ ⌈K/4⌉: P[k4 · 64 + 4c + i] =
// b(4 k4 + i, 16p + c), zeros past K); −128 Σ_k b_kn into shift[0, 16) (where the shifted sums of its columns
// start); returns max |b| over it (as unsigned bytes: −128 reads 128)
inline int pack_panel(const int8_t* B, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t p, int64_t K4, int8_t* P,
                      int32_t* shift) {
  const int64_t n0 = p * NR, cols = std::min(NR, N - n0), full = K / 4;
  if (sn == 1 && cols == NR) {  // rows of B contiguous: four rows' 16 bytes interleaved into 16 columns' 4 bytes
    for (int64_t k4 = 0; k4 < full; ++k4) {
      const int8_t* row = B + 4 * k4 * sk + n0;
      const X16 r0 = loadu<X16>(row), r1 = loadu<X16>(row + sk), r2 = loadu<X16>(row + 2 * sk),
                r3 = loadu<X16>(row + 3 * sk);
      const X16 lo01 = zip_lo<1>(r0, r1), hi01 = zip_hi<1>(r0, r1);
      const X16 lo23 = zip_lo<1>(r2, r3), hi23 = zip_hi<1>(r2, r3);
      int8_t* out = P + 64 * k4;
      storeu(out, zip_lo<2>(lo01, lo23)), storeu(out + 16, zip_hi<2>(lo01, lo23));
      storeu(out + 32, zip_lo<2>(hi01, hi23)), storeu(out + 48, zip_hi<2>(hi01, hi23));
    }
  } else if (sk == 1 && cols == NR) {  // columns contiguous (B a transposed matrix): 4 × 4 blocks of 4 bytes transposed
    const int64_t K16 = K / 16;
    for (int64_t c = 0; c < NR; c += 4) {
      const int8_t* col = B + (n0 + c) * sn;
      for (int64_t k16 = 0; k16 < K16; ++k16) {
        const X16 r0 = loadu<X16>(col + 16 * k16), r1 = loadu<X16>(col + sn + 16 * k16),
                  r2 = loadu<X16>(col + 2 * sn + 16 * k16), r3 = loadu<X16>(col + 3 * sn + 16 * k16);
        const X16 lo01 = zip_lo<4>(r0, r1), lo23 = zip_lo<4>(r2, r3);
        const X16 hi01 = zip_hi<4>(r0, r1), hi23 = zip_hi<4>(r2, r3);
        int8_t* out = P + 64 * 4 * k16 + 4 * c;
        storeu(out, zip_lo<8>(lo01, lo23)), storeu(out + 64, zip_hi<8>(lo01, lo23));
        storeu(out + 128, zip_lo<8>(hi01, hi23)), storeu(out + 192, zip_hi<8>(hi01, hi23));
      }
      for (int64_t k4 = 4 * K16; k4 < full; ++k4) {  // K past a multiple of 16
        for (int64_t i = 0; i < 4; ++i) std::memcpy(P + 64 * k4 + 4 * (c + i), col + i * sn + 4 * k4, 4);
      }
    }
  }
  // the rest: any other layout, a last panel short of 16 columns, the rows past a multiple of 4 (zeros past K)
  const int64_t from = (sn == 1 || sk == 1) && cols == NR ? full : 0;
  for (int64_t k4 = from; k4 < K4; ++k4) {
    for (int64_t c = 0; c < NR; ++c) {
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t k = 4 * k4 + i;
        P[64 * k4 + 4 * c + i] = c < cols && k < K ? B[k * sk + (n0 + c) * sn] : 0;
      }
    }
  }
  const VQU ones = VQU{} + 1;
  VI s0{}, s1{};
  VQU top{};
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    const VQ v0 = loadu<VQ>(P + 64 * k4), v1 = loadu<VQ>(P + 64 * k4 + 32);
    s0 = dot4(s0, ones, v0), s1 = dot4(s1, ones, v1);
    top = max_u8(top, max_u8(abs_u8(v0), abs_u8(v1)));
  }
  storeu(shift, VU{} - (bits<VU>(s0) << 7)), storeu(shift + 8, VU{} - (bits<VU>(s1) << 7));
  return max_lane_u8(top);
}

// The tile c (R rows × 16 columns: c[2r], c[2r + 1]) = A's R rows (stride lda, already shifted) times panel P over
// K = 4 · K4, started at the shift: Σ_k a_k b_kn. 8-bit rows (PAIRED false): a + 128 as unsigned bytes, started at
// −128 Σ_k b_kn. The paired loop (PAIRED), where A lies within ±63: read shifted by 64 (a + 64 ∈ [1, 127]), a pair's
// sum is within 2 · 127 · 63 = 16002, so the int16 sums of two steps of vpmaddubsw add exactly (≤ 32004) before one
// vpmaddwd widens them: 12 multiply-type instructions for 8 k instead of 16, the sums started at −64 Σ_k b_kn; K4
// even (the panel and the rows padded with zeros)
template <int R, bool PAIRED>
inline void tile(const uint8_t* A, int64_t lda, const int8_t* P, int64_t K4, const int32_t* shift, VI* c) {
  const VW ones = VW{} + 1;
  for (int r = 0; r < R; ++r) c[2 * r] = loadu<VI>(shift), c[2 * r + 1] = loadu<VI>(shift + 8);
  constexpr int64_t STEP = PAIRED ? 2 : 1;  // steps of 4 k an iteration
  for (int64_t k4 = 0; k4 < K4; k4 += STEP) {
    VQ b[2 * STEP];
    for (int64_t i = 0; i < 2 * STEP; ++i) b[i] = loadu<VQ>(P + 64 * k4 + 32 * i);
    for (int r = 0; r < R; ++r) {
      int32_t four[STEP];
      std::memcpy(four, A + r * lda + 4 * k4, 4 * STEP);
      const VQU a0 = bits<VQU>(splat_i32(four[0]));
      VW s0 = maddubs(a0, b[0]), s1 = maddubs(a0, b[1]);
      if constexpr (PAIRED) {
        const VQU a1 = bits<VQU>(splat_i32(four[STEP - 1]));
        s0 += maddubs(a1, b[2]), s1 += maddubs(a1, b[3]);
      }
      c[2 * r] += madd(s0, ones), c[2 * r + 1] += madd(s1, ones);
    }
  }
}

// tile<4, PAIRED>'s loop in assembly: GCC kept the eight accumulators' array in memory (a store of each and register
// copies in every step, 1.3x the instructions); here they stay in registers (8-bit: ymm12-15 the scratch; paired:
// ymm8-15 the two steps of B, the broadcasts and scratch, the ones from memory)
template <bool PAIRED>
inline void tile4(const uint8_t* A, int64_t lda, const int8_t* P, int64_t K4, const int32_t* shift, VI* c) {
  const VI s0 = loadu<VI>(shift), s1 = loadu<VI>(shift + 8);
  const VW ones = VW{} + 1;
  VI c00 = s0, c01 = s1, c10 = s0, c11 = s1, c20 = s0, c21 = s1, c30 = s0, c31 = s1;
  if (K4 > 0) {
    const uint8_t *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda;
    const int64_t end = 4 * K4;
    int64_t k = 0;
    const int8_t* p = P;
    if constexpr (PAIRED) {
#define ATTNLAB_ROW7(a, x0, x1)                           \
  "vpbroadcastd (%[" a "],%[k]), %%ymm12\n\t"              \
  "vpbroadcastd 4(%[" a "],%[k]), %%ymm13\n\t"             \
  "vpmaddubsw %%ymm8, %%ymm12, %%ymm14\n\t"                \
  "vpmaddubsw %%ymm10, %%ymm13, %%ymm15\n\t"               \
  "vpaddw %%ymm15, %%ymm14, %%ymm14\n\t"                   \
  "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t"                 \
  "vpaddd %%ymm14, %[" x0 "], %[" x0 "]\n\t"               \
  "vpmaddubsw %%ymm9, %%ymm12, %%ymm14\n\t"                \
  "vpmaddubsw %%ymm11, %%ymm13, %%ymm15\n\t"               \
  "vpaddw %%ymm15, %%ymm14, %%ymm14\n\t"                   \
  "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t"                 \
  "vpaddd %%ymm14, %[" x1 "], %[" x1 "]\n\t"
      asm volatile(
        "1:\n\t"
        "vmovdqu (%[p]), %%ymm8\n\t"
        "vmovdqu 32(%[p]), %%ymm9\n\t"
        "vmovdqu 64(%[p]), %%ymm10\n\t"
        "vmovdqu 96(%[p]), %%ymm11\n\t"
        ATTNLAB_ROW7("a0", "c00", "c01") ATTNLAB_ROW7("a1", "c10", "c11") ATTNLAB_ROW7("a2", "c20", "c21")
        ATTNLAB_ROW7("a3", "c30", "c31")
        "add $128, %[p]\n\t"
        "add $8, %[k]\n\t"
        "cmp %[end], %[k]\n\t"
        "jl 1b\n\t"
        : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20), [c21] "+x"(c21),
          [c30] "+x"(c30), [c31] "+x"(c31), [p] "+r"(p), [k] "+r"(k)
        : [a0] "r"(A), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [end] "r"(end), [ones] "m"(ones)
        : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef ATTNLAB_ROW7
    } else {
#define ATTNLAB_ROW(a, x0, x1)                            \
  "vpbroadcastd (%[" a "],%[k]), %%ymm14\n\t"              \
  "vpmaddubsw %%ymm12, %%ymm14, %%ymm15\n\t"               \
  "vpmaddubsw %%ymm13, %%ymm14, %%ymm14\n\t"               \
  "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"                 \
  "vpmaddwd %[ones], %%ymm14, %%ymm14\n\t"                 \
  "vpaddd %%ymm15, %[" x0 "], %[" x0 "]\n\t"               \
  "vpaddd %%ymm14, %[" x1 "], %[" x1 "]\n\t"
      asm volatile(
        "1:\n\t"
        "vmovdqu (%[p]), %%ymm12\n\t"
        "vmovdqu 32(%[p]), %%ymm13\n\t"
        ATTNLAB_ROW("a0", "c00", "c01") ATTNLAB_ROW("a1", "c10", "c11") ATTNLAB_ROW("a2", "c20", "c21")
        ATTNLAB_ROW("a3", "c30", "c31")
        "add $64, %[p]\n\t"
        "add $4, %[k]\n\t"
        "cmp %[end], %[k]\n\t"
        "jl 1b\n\t"
        : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20), [c21] "+x"(c21),
          [c30] "+x"(c30), [c31] "+x"(c31), [p] "+r"(p), [k] "+r"(k)
        : [a0] "r"(A), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [end] "r"(end), [ones] "x"(ones)
        : "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
#undef ATTNLAB_ROW
    }
  }
  c[0] = c00, c[1] = c01, c[2] = c10, c[3] = c11, c[4] = c20, c[5] = c21, c[6] = c30, c[7] = c31;
}

// the tile of `rows` (1-4) rows
template <bool PAIRED>
inline void any_tile(int64_t rows, const uint8_t* A, int64_t lda, const int8_t* P, int64_t K4, const int32_t* shift,
                     VI* c) {
  switch (rows) {
    case 4: return tile4<PAIRED>(A, lda, P, K4, shift, c);
    case 3: return tile<3, PAIRED>(A, lda, P, K4, shift, c);
    case 2: return tile<2, PAIRED>(A, lda, P, K4, shift, c);
    default: return tile<1, PAIRED>(A, lda, P, K4, shift, c);
  }
}

// A tile's R rows × 16 columns rescaled from its registers as dequant_row rescales a row (dequant_vec's arithmetic:
// s = rs cs, y = v s + b with the add fused), cs and b read once a tile; CS, BIAS: whether cs and b are given. With
// res (float32 y only; rows ldy apart as y's) y = res + (v s + b), the sum rounded after v s + b is: a residual added
// to the layer's output in the same pass, the same bits as the separate add
template <class T, bool CS, bool BIAS>
inline void rescale_tile(const VI* c, int64_t rows, const float* rs, const float* cs, const float* b, T* y,
                         int64_t ldy, const float* res) {
  avx2::VF c0{}, c1{}, b0{}, b1{};
  if constexpr (CS) c0 = avx2::load(cs), c1 = avx2::load(cs + 8);
  if constexpr (BIAS) b0 = avx2::load(b), b1 = avx2::load(b + 8);
  for (int64_t i = 0; i < rows; ++i) {
    const avx2::VF r = avx2::splat(rs[i]);
    avx2::VF s0 = r, s1 = r;
    if constexpr (CS) s0 = r * c0, s1 = r * c1;
    const VI a0 = c[2 * i], a1 = c[2 * i + 1];
    const avx2::VF v0 = __builtin_convertvector(a0, avx2::VF), v1 = __builtin_convertvector(a1, avx2::VF);
    avx2::VF y0, y1;
    if constexpr (BIAS) {
      y0 = avx2::fmadd(v0, s0, b0), y1 = avx2::fmadd(v1, s1, b1);
    } else {
      y0 = v0 * s0, y1 = v1 * s1;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (res) {
        asm("" : "+x"(y0), "+x"(y1));  // (y rounded first: GCC would otherwise fuse v s + res into one FMA)
        y0 = avx2::load(res + i * ldy) + y0, y1 = avx2::load(res + i * ldy + 8) + y1;
      }
    }
    avx2::st(y + i * ldy, y0), avx2::st(y + i * ldy + 8, y1);
  }
}

// The longest K whose running sums an int32 holds: they start at −128 Σ b and add (a + 128) b, so stay within
// (128 + 255) · 63 · K < 2^31
constexpr int64_t MAX_K = ((int64_t{1} << 31) - 1) / (383 * 63);

// B (K, N) packed for the tiles: panels of 16 columns (K padded to a multiple of 4, its steps of 4 to an even count:
// the paired loop's; the padding's rows zero), the sums' starts for 8-bit (−128 Σ_k b_kn) and paired rows (−64 Σ_k
// b_kn), and max |b|
struct Packed {
  int64_t panels = 0, K4 = 0, K4p = 0, Kp = 0;
  std::unique_ptr<int8_t[]> memory;
  int8_t* P = nullptr;  // (32-byte aligned in memory)
  std::vector<int32_t> shift, half;
  int top = 0;
};

// packs B (strides sk, sn) over torch's threads (serially inside a parallel region)
inline void pack(const int8_t* B, int64_t sk, int64_t sn, int64_t K, int64_t N, Packed& pk) {
  pk.panels = (N + NR - 1) / NR, pk.K4 = (K + 3) / 4, pk.K4p = pk.K4 + pk.K4 % 2, pk.Kp = 4 * pk.K4p;
  pk.memory.reset(new int8_t[pk.panels * pk.Kp * NR + 32]);  // (uninitialised: every byte written)
  pk.P = pk.memory.get() + (32 - reinterpret_cast<uintptr_t>(pk.memory.get()) % 32) % 32;
  pk.shift.resize(pk.panels * NR), pk.half.resize(pk.panels * NR);
  std::vector<int> top(pk.panels);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * NR));
  at::parallel_for(0, pk.panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      top[p] = pack_panel(B, sk, sn, K, N, p, pk.K4p, pk.P + p * pk.Kp * NR, pk.shift.data() + p * NR);
      for (int64_t j = p * NR; j < (p + 1) * NR; ++j) pk.half[j] = pk.shift[j] / 2;  // (exact: shift is −128 Σ b)
    }
  });
  pk.top = pk.panels ? *std::max_element(top.begin(), top.end()) : 0;
}

// The row groups [g0, g1) (4 rows each) of y = diag(rs) (A B) diag(cs) + bias, B packed in pk: these rows of A
// shifted to unsigned once, not in every panel's tiles — a + 64 where they all lie within ±63 (the paired loop),
// else a + 128 (the sign bit flipped) — then tile by tile, each rescaled from its registers. While a tile computes,
// the next one's lines of y are asked for, for writing (PREFETCHW): y is fresh memory that a training step's tens of
// MB have pushed out of the caches, and a store to a line no cache holds waits for the line to be read first (the
// prefetch brings a product after such a sweep back to about its warm-cache time)
template <class T>
void groups(const Packed& pk, const int8_t* A, int64_t lda, int64_t M, int64_t K, int64_t N, int64_t g0, int64_t g1,
            const float* rs, const float* cs, const float* bias, T* y, const float* res = nullptr) {
  const int64_t panels = pk.panels, Kp = pk.Kp;
  const auto full = cs ? (bias ? rescale_tile<T, true, true> : rescale_tile<T, true, false>)
                       : (bias ? rescale_tile<T, false, true> : rescale_tile<T, false, false>);
  const int64_t first = g0 * MR, count = std::min(M, g1 * MR) - first;
  VQU big{};
  int widest = 0;
  for (int64_t r = 0; r < count; ++r) {
    const int8_t* src = A + (first + r) * lda;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) big = max_u8(big, abs_u8(loadu<VQ>(src + k)));
    for (; k < K; ++k) widest = std::max(widest, std::abs(static_cast<int>(src[k])));
  }
  const bool paired = std::max<int>(widest, max_lane_u8(big)) <= 63;
  const uint8_t zero = paired ? 64 : 0x80;  // a = 0 shifted
  const std::unique_ptr<uint8_t[]> shifted(new uint8_t[count * Kp + 32]);
  const VQU add = VQU{} + zero;
  for (int64_t r = 0; r < count; ++r) {
    const int8_t* src = A + (first + r) * lda;
    uint8_t* dst = shifted.get() + r * Kp;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) storeu(dst + k, loadu<VQU>(src + k) + add);  // (+128: the sign bit's XOR)
    for (; k < K; ++k) dst[k] = static_cast<uint8_t>(src[k] + zero);
    for (; k < Kp; ++k) dst[k] = zero;  // a = 0 past K (B's rows there are zero anyway)
  }
  const int32_t* start = paired ? pk.half.data() : pk.shift.data();
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const int8_t* panel = pk.P + p * Kp * NR;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * MR, rows = std::min(MR, M - r0);
      const uint8_t* a = shifted.get() + (r0 - first) * Kp;
      for (int64_t r = r0 + MR; g + 1 < g1 && r < std::min(M, r0 + 2 * MR); ++r) {
        prefetch_write(y + r * N + n0), prefetch_write(y + r * N + n0 + cols - 1);  // (the next tile's lines of y)
      }
      VI c[2 * MR];
      if (paired) {
        any_tile<true>(rows, a, Kp, panel, pk.K4p, start + n0, c);
      } else {
        any_tile<false>(rows, a, Kp, panel, pk.K4, start + n0, c);
      }
      if (cols == NR) {
        full(c, rows, rs + r0, cs ? cs + n0 : nullptr, bias ? bias + n0 : nullptr, y + r0 * N + n0, N,
             res ? res + r0 * N + n0 : nullptr);
        continue;
      }
      for (int64_t i = 0; i < rows; ++i) {  // the last panel short of 16 columns: as dequant_row rescales a row
        T* out = y + (r0 + i) * N + n0;
        for (int64_t h = 0; h < 2 && 8 * (h + 1) <= cols; ++h) {
          avx2::st(out + 8 * h, avx2::dequant_vec(c[2 * i + h], rs[r0 + i], cs ? cs + n0 + 8 * h : nullptr,
                                                   bias ? bias + n0 + 8 * h : nullptr));
        }
        if (cols % 8) {  // the last panel's columns past a multiple of 8: dequant_row's scalar tail
          const int64_t j = cols - cols % 8;
          alignas(32) int32_t acc[8];
          std::memcpy(acc, &c[2 * i + j / 8], sizeof acc);
          avx2::dequant_row<T>(acc, rs[r0 + i], cs ? cs + n0 + j : nullptr, bias ? bias + n0 + j : nullptr,
                               cols % 8, out + j);
        }
        if constexpr (std::is_same_v<T, float>) {  // the residual of these columns added to what was stored
          for (int64_t j = 0; res && j < cols; ++j) {
            float o = out[j];
            asm("" : "+x"(o));  // (as in rescale_tile: no FMA across the stored value)
            out[j] = res[(r0 + i) * N + n0 + j] + o;
          }
        }
      }
    }
  }
}

// y (M, N) = diag(rs) (A B) diag(cs) + bias (cs, bias null: 1, 0), as described above; with res (float32 y, (M, N)
// contiguous) res + that. Returns false, having written nothing to y, where B holds an entry beyond ±63 (the caller
// then takes torch._int_mm)
template <class T>
bool product(const int8_t* A, int64_t lda, int64_t M, int64_t K, const int8_t* B, int64_t sk, int64_t sn, int64_t N,
             const float* rs, const float* cs, const float* bias, T* y, const float* res = nullptr) {
  Packed pk;
  pack(B, sk, sn, K, N, pk);
  if (pk.top > 63) return false;
  // a group (4 rows × all of N) is 4 K N multiply-adds: split across threads from ~2^20 of them
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, MR * K * N));
  at::parallel_for(0, (M + MR - 1) / MR, grain, [&](int64_t g0, int64_t g1) {
    groups(pk, A, lda, M, K, N, g0, g1, rs, cs, bias, y, res);
  });
  return true;
}

// One product's arguments (as product's; y in float32 or, y16 given, bfloat16)
struct Job {
  const int8_t* A;
  int64_t lda, M, K;
  const int8_t* B;
  int64_t sk, sn, N;
  const float *rs, *cs, *bias;
  float* y;
  uint16_t* y16;
};

// Two products on the calling region's two threads, sharing the work: thread t packs job t's B and takes job t's
// chunks of row groups, then helps with the other's (packing it first where that thread has not started). A
// backward's ∂L/∂x and ∂L/∂W products have the same multiply-adds but not the same time (their shapes differ: one
// 0.9–1.5× the other at nanogpt-cpu's, one thread each), so one a thread left a core waiting. Each chunk is exact
// and rescaled as in product, so y has the same bits. done[j]: whether job j was computed (false: its B holds an
// entry beyond ±63, y not written; the caller takes torch._int_mm for it)
inline void product_pair(const Job (&job)[2], bool (&done)[2]) {
  Packed pk[2];
  std::atomic<int> state[2] = {0, 0};  // 0 not packed, 1 being packed, 2 packed, 3 its packing threw
  std::atomic<int64_t> next[2] = {0, 0};
  int64_t total[2], chunk[2];
  for (int j = 0; j < 2; ++j) {
    total[j] = (job[j].M + MR - 1) / MR;
    chunk[j] = std::max<int64_t>(1, std::min<int64_t>(16, (total[j] + 7) / 8));  // ≥ 8 chunks a job, ≤ 64 rows each
  }
  const auto ready = [&](int j) {
    int expected = 0;
    if (state[j].compare_exchange_strong(expected, 1)) {
      try {
        pack(job[j].B, job[j].sk, job[j].sn, job[j].K, job[j].N, pk[j]);
      } catch (...) {  // (no memory for the panels: the other thread must not wait for them; the error goes on)
        state[j].store(3, std::memory_order_release);
        throw;
      }
      state[j].store(2, std::memory_order_release);
    } else {
      while (state[j].load(std::memory_order_acquire) == 1) spin_pause();
      if (state[j].load(std::memory_order_acquire) == 3) return false;
    }
    return pk[j].top <= 63;
  };
  const auto work = [&](int j) {
    if (!ready(j)) return;
    const Job& b = job[j];
    for (int64_t c = next[j].fetch_add(1); c * chunk[j] < total[j]; c = next[j].fetch_add(1)) {
      const int64_t g0 = c * chunk[j], g1 = std::min(total[j], g0 + chunk[j]);
      if (b.y16) {
        groups(pk[j], b.A, b.lda, b.M, b.K, b.N, g0, g1, b.rs, b.cs, b.bias, b.y16);
      } else {
        groups(pk[j], b.A, b.lda, b.M, b.K, b.N, g0, g1, b.rs, b.cs, b.bias, b.y);
      }
    }
  };
  at::parallel_for(0, 2, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) work(static_cast<int>(t)), work(static_cast<int>(1 - t));
  });
  for (int j = 0; j < 2; ++j) done[j] = pk[j].top <= 63;
}

}  // namespace u8s8
#pragma GCC pop_options
#endif
