// The vector vocabulary of attnlab's kernels: each operation a kernel body performs on vectors, named once, with one
// definition per instruction set, as ATen's Vectorized<T> or ggml's SIMD mappings do. isa_regions.h includes it at
// the top of each region (namespace avx512 / avx2 / portable; `L` = 16 / 8 / 4 float lanes; ATTNLAB_VEC = 2 / 1 / 0),
// before the kernel body, so a body names no intrinsic. What one set does with an instruction of its own (the
// reciprocal estimate, the horizontal sum, fused multiply-add, the int8 multiply-adds, bf16 widening and narrowing,
// int8 packing) is spelt here per set under `#if ATTNLAB_VEC`; what the compiler emits well for all three from GCC's
// vector extensions (lane arithmetic, compares, selects, shuffles, e^x) is written once. The types are GCC vector
// types and the operations free functions, so `a * b + c` and `x > y ? x : y` stay plain expressions. The .cpp that
// includes the regions includes <immintrin.h> first on x86.
//
//   types (a register of 4L bytes, unless said)  VF: L float  VI: L int32  VU: L uint32  VW: 2L int16
//                                                VQ: 4L int8  VQU: 4L uint8  VH: L uint16 (half)  VB: L int8 (quarter)
//                                                X16: 16 int8 (an SSE register, on every set)
//   reinterpret, load, store, broadcast          bits<To>, loadu<V>, storeu, load, store, splat, splat_i32
//   rows of float32 or bf16, and masked tails    ld, st, ld1, st1, ld_part, st_part
//   bf16 ⇄ float32                               widen_u16, narrow_u16, load_bf16, store_bf16, load_bf16_pairs
//   arithmetic                                   fmadd, fmadd1, vabs, vmax, recip, exp_in_range, exp_any,
//                                                exp_nonpositive
//   horizontal                                   hsum (lanes in order), reduce_add (halving tree), tree_max, any_nan
//   integers                                     to_float, widen_i8, madd, maddubs, dot4, store_i8, store_i8x4, store_scaled,
//                                                abs_u8, max_u8, max_lane_u8, zip_lo<E>, zip_hi<E>
//   memory and threads                           prefetch_write, spin_pause

using VF = float __attribute__((vector_size(4 * L)));
using VI = int32_t __attribute__((vector_size(4 * L)));
using VU = uint32_t __attribute__((vector_size(4 * L)));
using VW = int16_t __attribute__((vector_size(4 * L)));
using VQ = int8_t __attribute__((vector_size(4 * L)));
using VQU = uint8_t __attribute__((vector_size(4 * L)));
using VH = uint16_t __attribute__((vector_size(2 * L)));
using VB = int8_t __attribute__((vector_size(L)));
using X16 = int8_t __attribute__((vector_size(16)));

// ---- reinterpret, load, store ----------------------------------------------------------------------------------
// the bits of `from` as a To of the same size (a set's register type and a vector type: no instruction)
template <class To, class From>
[[gnu::always_inline]] inline To bits(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}
template <class V>
[[gnu::always_inline]] inline V loadu(const void* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
[[gnu::always_inline]] inline void storeu(void* p, V v) { std::memcpy(p, &v, sizeof v); }
inline VF load(const float* p) { return loadu<VF>(p); }
inline void store(float* p, VF v) { storeu(p, v); }
// every lane a: one vbroadcastss (GCC's `VF{} + a` costs an add before it where a is not a constant, and turns −0
// into +0)
inline VF splat(float a) {
#if ATTNLAB_VEC == 2
  return bits<VF>(_mm512_set1_ps(a));
#elif ATTNLAB_VEC == 1
  return bits<VF>(_mm256_set1_ps(a));
#else
  VF v;
  for (int i = 0; i < L; ++i) v[i] = a;
  return v;
#endif
}
inline VI splat_i32(int32_t a) { return VI{} + a; }

// ---- bf16 ⇄ float32 ---------------------------------------------------------------------------------------------
// L uint16 lanes widened to uint32: GCC widens a __builtin_convertvector in two halves and re-joins them with AVX-512
// (5 instructions where one vpmovzxwd does it)
inline VU widen_u16(const uint16_t* p) {
#if ATTNLAB_VEC == 2
  return bits<VU>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif ATTNLAB_VEC == 1
  return bits<VU>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(loadu<VH>(p), VU);
#endif
}
// uint32 lanes ≤ 0xFFFF narrowed to uint16: GCC makes __builtin_convertvector one vpmovdw with AVX-512 only through
// a vpermt2w and a table, and one extract per lane with AVX2; packing never saturates here (the lanes fit)
inline VH narrow_u16(VU u) {
#if ATTNLAB_VEC == 2
  return bits<VH>(_mm512_cvtepi32_epi16(bits<__m512i>(u)));
#elif ATTNLAB_VEC == 1
  const __m256i v = bits<__m256i>(u);
  return bits<VH>(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#else
  return __builtin_convertvector(u, VH);
#endif
}
// L bf16 as float32 (the 16 bits shifted up: exact)
inline VF load_bf16(const uint16_t* p) { return bits<VF>(widen_u16(p) << 16); }
// L float32 to bf16, rounded to nearest even, a NaN kept a (quiet) NaN as PyTorch's cast does (rounding could carry
// a NaN's payload into inf)
inline void store_bf16(uint16_t* p, VF v) {
  const VU u = bits<VU>(v);
  const VU rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
  const VU quiet = (u >> 16) | 0x40u;
  storeu(p, narrow_u16(v != v ? quiet : rounded));
}
// 2L bf16 as two vectors of float32, the even and the odd ones: a 32-bit lane holding (w[2i], w[2i+1]) is w[2i+1]
// once its low 16 bits are cleared and w[2i] once shifted left by 16 (two integer operations, no conversion)
inline void load_bf16_pairs(const uint16_t* w, VF& even, VF& odd) {
  const VU v = loadu<VU>(w);
  even = bits<VF>(v << 16);
  odd = bits<VF>(v & 0xFFFF0000u);
}

// ---- rows of float32 or bf16 (uint16_t): a vector, one element, a masked tail ----------------------------------
inline VF ld(const float* p) { return load(p); }
inline VF ld(const uint16_t* p) { return load_bf16(p); }
inline void st(float* p, VF v) { store(p, v); }
inline void st(uint16_t* p, VF v) { store_bf16(p, v); }
template <class T>
inline float ld1(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return *p;
  } else {
    return bits<float>(static_cast<uint32_t>(*p) << 16);
  }
}
template <class T>
inline void st1(T* p, float x) {  // (bf16: the vector's rounding, the same bits as st)
  if constexpr (sizeof(T) == 4) {
    *p = x;
  } else {
    VF v = splat(0.f);
    v[0] = x;
    T out[L];
    st(out, v);
    *p = out[0];
  }
}
// r ≤ L elements as one vector, the lanes past r filled with `fill` (a row's last, partial vector), and back
template <class T>
inline VF ld_part(const T* p, int64_t r, float fill) {
  float t[L];
  for (int64_t i = 0; i < L; ++i) t[i] = i < r ? ld1(p + i) : fill;
  return load(t);
}
template <class T>
inline void st_part(T* p, VF v, int64_t r) {
  T t[L];
  st(t, v);
  std::memcpy(p, t, r * sizeof(T));
}

// ---- arithmetic ---------------------------------------------------------------------------------------------------
// a b + c rounded once (AVX2 and AVX-512: FMA), twice in the portable set. Written out, not left to GCC's
// contraction, which fuses or not by the context a function is inlined into (a kernel inlined in two places must
// give the same bits in both)
inline VF fmadd(VF a, VF b, VF c) {
#if ATTNLAB_VEC == 2
  return bits<VF>(_mm512_fmadd_ps(bits<__m512>(a), bits<__m512>(b), bits<__m512>(c)));
#elif ATTNLAB_VEC == 1
  return bits<VF>(_mm256_fmadd_ps(bits<__m256>(a), bits<__m256>(b), bits<__m256>(c)));
#else
  return a * b + c;
#endif
}
inline float fmadd1(float a, float b, float c) {
#if ATTNLAB_VEC > 0
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
// |a| lane by lane; a NaN stays a NaN (the sign bit cleared: one AND, where a select costs a compare and a blend)
inline VF vabs(VF a) { return bits<VF>(bits<VI>(a) & 0x7FFFFFFF); }
inline VF vmax(VF m, VF a) { return a > m ? a : m; }  // drops a NaN of a: callers also sum (a NaN sum flags it)

// 1 / d lane by lane: the hardware's estimate (AVX-512 14 bits, AVX2 12) and one Newton step r (2 − d r), ~1 ulp
// (AVX-512) / ~2 ulp (AVX2) where a vdivps costs several times the two FMAs; the exact quotient in the portable set
[[gnu::always_inline]] inline VF recip(VF d) {
#if ATTNLAB_VEC == 2
  const VF r = bits<VF>(_mm512_rcp14_ps(bits<__m512>(d)));
  return r * (splat(2.f) - d * r);
#elif ATTNLAB_VEC == 1
  const VF r = bits<VF>(_mm256_rcp_ps(bits<__m256>(d)));
  return r * (splat(2.f) - d * r);
#else
  return splat(1.f) / d;
#endif
}

// e^x = 2ⁿ · e^r with n = round(x log₂e), r = x − n ln 2 (ln 2 in two parts, exact products), e^r ≈ 1 + r + r² p(r)
// on |r| ≤ ln2/2 (Cephes expf's polynomial: relative error ~1e-7, about an ulp of float32), 2ⁿ built in the exponent
// bits; for x in [−87.3, 88.7] (NaN stays NaN): exp_any and exp_nonpositive clamp or select outside it
[[gnu::always_inline]] inline VF exp_in_range(VF x) {
  const VF magic = splat(12582912.f);
  const VF n = (x * splat(1.44269504088896341f) + magic) - magic;
  const VF r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  VF p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const VF er = p * (r * r) + r + splat(1.f);
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return er * bits<VF>(e);
}
// e^x, lane by lane (NaN stays NaN): x < −87.3 → 0, x > 88.7 → +inf
[[gnu::always_inline]] inline VF exp_any(VF x) {
  const VF lo = splat(-87.3f), hi = splat(88.7f);
  const VF e = exp_in_range(x > hi ? hi : (x < lo ? lo : x));
  return x < lo ? splat(0.f) : (x > hi ? splat(INFINITY) : e);
}
// e^x for x ≤ 0 (NaN stays NaN): without the upper clamp a non-positive argument never needs; x < −87.3 → 0 (there
// n < −126 builds garbage bits, never kept)
[[gnu::always_inline]] inline VF exp_nonpositive(VF x) { return x < splat(-87.3f) ? splat(0.f) : exp_in_range(x); }

// ---- horizontal -------------------------------------------------------------------------------------------------
// Σ of the lanes in lane order
inline float hsum(VF v) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
}
// Σ of the lanes by a halving tree (the upper half added to the lower, log₂ L times): what a set's reduction
// instructions compute
inline float reduce_add(VF v) {
#if ATTNLAB_VEC == 2
  return _mm512_reduce_add_ps(bits<__m512>(v));
#elif ATTNLAB_VEC == 1
  const __m256 r = bits<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float t[L];
  std::memcpy(t, &v, sizeof t);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
#endif
}
// the largest lane, and whether a lane is NaN: halving trees (log₂ L steps deep, not L)
inline float tree_max(VF v) {
  float t[L];
  std::memcpy(t, &v, sizeof t);
  for (int w = L / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) t[i] = t[i + w] > t[i] ? t[i + w] : t[i];
  }
  return t[0];
}
inline bool any_nan(VF v) {
  float t[L];
  std::memcpy(t, &v, sizeof t);
  for (int w = L / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) t[i] += t[i + w];  // a NaN lane makes the sum NaN
  }
  return std::isnan(t[0]);
}

// ---- integers -----------------------------------------------------------------------------------------------------
// 2L int8 widened to int16 (GCC widens a __builtin_convertvector in halves: one vpmovsxbw does it)
inline VW widen_i8(const int8_t* p) {
#if ATTNLAB_VEC == 2
  return bits<VW>(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif ATTNLAB_VEC == 1
  return bits<VW>(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  using Q2 = int8_t __attribute__((vector_size(2 * L)));
  return __builtin_convertvector(loadu<Q2>(p), VW);
#endif
}
// L int32: the products of 2L int16 pairs, adjacent ones summed (vpmaddwd; exact but for −2¹⁵ · −2¹⁵ twice)
inline VI madd(VW a, VW b) {
#if ATTNLAB_VEC == 2
  return bits<VI>(_mm512_madd_epi16(bits<__m512i>(a), bits<__m512i>(b)));
#elif ATTNLAB_VEC == 1
  return bits<VI>(_mm256_madd_epi16(bits<__m256i>(a), bits<__m256i>(b)));
#else
  VI r;
  for (int i = 0; i < L; ++i)
    r[i] = static_cast<int32_t>(static_cast<uint32_t>(a[2 * i] * b[2 * i]) + static_cast<uint32_t>(a[2 * i + 1] *
                                                                                                    b[2 * i + 1]));
  return r;
#endif
}
// 2L int16: the products of 4L unsigned (a) × signed (b) byte pairs, adjacent ones summed with signed saturation
// (vpmaddubsw)
inline VW maddubs(VQU a, VQ b) {
#if ATTNLAB_VEC == 2
  return bits<VW>(_mm512_maddubs_epi16(bits<__m512i>(a), bits<__m512i>(b)));
#elif ATTNLAB_VEC == 1
  return bits<VW>(_mm256_maddubs_epi16(bits<__m256i>(a), bits<__m256i>(b)));
#else
  VW r;
  for (int i = 0; i < 2 * L; ++i)
    r[i] = static_cast<int16_t>(std::clamp(a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1], -32768, 32767));
  return r;
#endif
}
// acc + the sums of four u8 × s8 products, a 32-bit lane each: VNNI's vpdpbusd, emulated by vpmaddubsw and vpmaddwd
// by ones (the regions target no VNNI set); the pairs' int16 sums saturate where |a b + a' b'| > 2¹⁵ − 1 (vpdpbusd's
// do not): exact for callers that keep |b| ≤ 63
inline VI dot4(VI acc, VQU a, VQ b) { return acc + madd(maddubs(a, b), VW{} + 1); }
// L int32 lanes within [−128, 127] stored as int8: GCC makes __builtin_convertvector one vpmovdb with AVX-512 but one
// extract per lane with AVX2, where the SSE packs do it
inline void store_i8(int8_t* q, VI i) {
#if ATTNLAB_VEC == 1
  const __m256i v = bits<__m256i>(i);
  const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(h, h));
#else
  storeu(q, __builtin_convertvector(i, VB));
#endif
}
// four registers of such lanes, to q[0, 4L): with AVX2 the 32 bytes packed together (two vpackssdw, one vpacksswb
// and one vpermd: 1¼ instructions a register where store_i8's extract, packs and store take 4)
inline void store_i8x4(int8_t* q, VI r0, VI r1, VI r2, VI r3) {
#if ATTNLAB_VEC == 1
  // the packs work within 128-bit halves: the bytes come out in groups of 4 lanes (r0 r1 r2 r3's low halves, then
  // their high halves); vpermd puts the eight 4-byte groups back in order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(bits<__m256i>(r0), bits<__m256i>(r1)),
                                       _mm256_packs_epi32(bits<__m256i>(r2), bits<__m256i>(r3)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  store_i8(q, r0), store_i8(q + L, r1), store_i8(q + 2 * L, r2), store_i8(q + 3 * L, r3);
#endif
}
inline VF to_float(VI a) { return __builtin_convertvector(a, VF); }
// 2L int16 as float32 times sc, to out[0, 2L) (the halves widened by one vpmovsxwd each)
inline void store_scaled(VW w, VF sc, float* out) {
#if ATTNLAB_VEC == 2
  const __m512i v = bits<__m512i>(w);
  store(out, to_float(bits<VI>(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)))) * sc);
  store(out + L, to_float(bits<VI>(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)))) * sc);
#elif ATTNLAB_VEC == 1
  const __m256i v = bits<__m256i>(w);
  store(out, to_float(bits<VI>(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)))) * sc);
  store(out + L, to_float(bits<VI>(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)))) * sc);
#else
  using W1 = int16_t __attribute__((vector_size(2 * L)));
  W1 lo, hi;
  std::memcpy(&lo, &w, sizeof lo), std::memcpy(&hi, reinterpret_cast<const char*>(&w) + sizeof lo, sizeof hi);
  store(out, to_float(__builtin_convertvector(lo, VI)) * sc);
  store(out + L, to_float(__builtin_convertvector(hi, VI)) * sc);
#endif
}
// |b| of each byte as unsigned (|−128| = 128), the larger of two unsigned bytes, and the largest byte of a register
inline VQU abs_u8(VQ b) {
  const VQU u = bits<VQU>(b);
  return b < 0 ? VQU{} - u : u;
}
inline VQU max_u8(VQU a, VQU b) { return a > b ? a : b; }
inline int max_lane_u8(VQU v) {
  int m = 0;
  for (int i = 0; i < 4 * L; ++i) m = std::max<int>(m, v[i]);
  return m;
}
// The lower (zip_lo) or upper (zip_hi) halves of two 16-byte registers interleaved by elements of E bytes: a0 b0 a1
// b1 … (SSE's punpckl / punpckh of bytes, words, dwords, qwords)
template <int E>
[[gnu::always_inline]] inline X16 zip_lo(X16 a, X16 b) {
  if constexpr (E == 1) {
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  } else if constexpr (E == 2) {
    using W = int16_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<W>(a), bits<W>(b), 0, 8, 1, 9, 2, 10, 3, 11));
  } else if constexpr (E == 4) {
    using D = int32_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<D>(a), bits<D>(b), 0, 4, 1, 5));
  } else {
    using Q = int64_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<Q>(a), bits<Q>(b), 0, 2));
  }
}
template <int E>
[[gnu::always_inline]] inline X16 zip_hi(X16 a, X16 b) {
  if constexpr (E == 1) {
    return __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  } else if constexpr (E == 2) {
    using W = int16_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<W>(a), bits<W>(b), 4, 12, 5, 13, 6, 14, 7, 15));
  } else if constexpr (E == 4) {
    using D = int32_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<D>(a), bits<D>(b), 2, 6, 3, 7));
  } else {
    using Q = int64_t __attribute__((vector_size(16)));
    return bits<X16>(__builtin_shufflevector(bits<Q>(a), bits<Q>(b), 1, 3));
  }
}

// ---- memory and threads -------------------------------------------------------------------------------------------
// ask for p's cache line for writing (prefetchw where the CPU has it)
inline void prefetch_write(const void* p) { __builtin_prefetch(p, 1, 3); }
// a spin-wait loop's pause (x86's pause: the other hyper-thread runs meanwhile)
inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#endif
}
