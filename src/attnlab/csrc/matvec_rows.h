// The vector kernel of matvec.cpp, written once in vec.h's vocabulary and compiled per instruction set
// (isa_regions.h; the portable set runs matvec.cpp's rows_portable instead). Uses Job, Kind, U, FLUSH, finish,
// dot_tail and int4_row_bytes from matvec.cpp.
//
// row<KIND, NX>(j, n, m): y[m .. m + NX - 1, n] from row n of W, read once, in order, with UX vectors in flight
// (int4: a block of 128 columns at a time),
// each weight vector multiplied into NX rows of x (1, 2 or 4; UX · NX accumulators fit the registers); columns
// past the last whole vector go through dot_tail.

// Asks for the weight bytes [p + PREFETCH, p + PREFETCH + bytes) in L2 ahead of their use, a line at a time (ALL), or
// only the lines that open a 4 KiB page: the hardware prefetcher stops at each page, and these requests keep the
// stream going across it. Measured in one process, both fp32 decoders' matrices, 2 AVX-512 cores: fp32 22-29 ->
// 27-32 GB/s with every line (only the pages' first lines: about half the gain), bf16 29-31 -> 31-32 GB/s with the
// pages' first lines (every line: no gain); into L1, or further ahead, was slower. A prefetch past the end of the
// weights does not fault.
constexpr int64_t PREFETCH = 4096;
template <bool ALL>
inline void prefetch_ahead(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) {
    const char* t = static_cast<const char*>(p) + PREFETCH + c;
    if (ALL || (reinterpret_cast<uintptr_t>(t) & 4095) < 512) __builtin_prefetch(t, 0, 2);  // locality 2: L2
  }
}

// int4: a block's 32 lanes (64 bytes) as four runs of 32 int16 weights q (run r: columns 32 r .., in C vectors):
// shifted left so nibble r is on top, then arithmetically right (the sign comes along)
constexpr int C = 16 / L;
inline void nibbles(const uint8_t* p, VW (*w)[C]) {
  using UW = uint16_t __attribute__((vector_size(4 * L)));
  for (int c = 0; c < C; ++c) {
    const UW v = loadu<UW>(p + 4 * L * c);
    w[0][c] = bits<VW>(v << 12) >> 12;
    w[1][c] = bits<VW>(v << 8) >> 12;
    w[2][c] = bits<VW>(v << 4) >> 12;
    w[3][c] = bits<VW>(v) >> 12;
  }
}

template <int KIND, int NX>
inline void row(const Job& j, int64_t n, int64_t m) {
  constexpr int UX = NX == 4 ? U / 2 : U;
  const int64_t K = j.K;
  float s[NX];
  int64_t kv;  // columns done in vectors
  if constexpr (KIND == F32) {
    const float* w = static_cast<const float*>(j.w) + n * K;
    const float* x = j.x + m * K;
    kv = K - K % L;
    VF a[NX][UX];
    for (int i = 0; i < NX; ++i)
      for (int u = 0; u < UX; ++u) a[i][u] = splat(0.f);
    int64_t k = 0;
    for (; k + UX * L <= kv; k += UX * L) {
      prefetch_ahead<true>(w + k, UX * L * 4);
      for (int u = 0; u < UX; ++u) {
        const VF wv = load(w + k + u * L);
        for (int i = 0; i < NX; ++i) a[i][u] = fmadd(wv, load(x + i * K + k + u * L), a[i][u]);
      }
    }
    for (; k < kv; k += L) {
      const VF wv = load(w + k);
      for (int i = 0; i < NX; ++i) a[i][0] = fmadd(wv, load(x + i * K + k), a[i][0]);
    }
    for (int i = 0; i < NX; ++i) {
      for (int u = 1; u < UX; ++u) a[i][0] = a[i][0] + a[i][u];
      s[i] = reduce_add(a[i][0]);
    }
  } else if constexpr (KIND == BF16) {  // x's even / odd columns: j.xd (K even)
    const uint16_t* w = static_cast<const uint16_t*>(j.w) + n * K;
    const int64_t h = K / 2;
    const float* e = j.xd + m * K;
    constexpr int64_t P = 2 * L;  // weights per vector of pairs
    kv = K - K % P;
    VF a[NX][UX];
    for (int i = 0; i < NX; ++i)
      for (int u = 0; u < UX; ++u) a[i][u] = splat(0.f);
    auto step = [&](int64_t k, int u) __attribute__((always_inline)) {
      VF ev, od;
      load_bf16_pairs(w + k, ev, od);
      for (int i = 0; i < NX; ++i)
        a[i][u] = fmadd(od, load(e + i * K + h + k / 2), fmadd(ev, load(e + i * K + k / 2), a[i][u]));
    };
    int64_t k = 0;
    for (; k + UX * P <= kv; k += UX * P) {
      prefetch_ahead<false>(w + k, UX * P * 2);
      for (int u = 0; u < UX; ++u) step(k + u * P, u);
    }
    for (; k < kv; k += P) step(k, 0);
    for (int i = 0; i < NX; ++i) {
      for (int u = 1; u < UX; ++u) a[i][0] = a[i][0] + a[i][u];
      s[i] = reduce_add(a[i][0]);
    }
  } else if constexpr (KIND == I4) {  // blocks of 128 columns, four runs of 32: int8's products, scaled per group
    kv = K;
    const uint8_t* w = static_cast<const uint8_t*>(j.w) + n * int4_row_bytes(K);
    const float* gs = j.gs + n * (K / j.G);
    const int16_t* q = j.xq + m * K;
    constexpr int FA = NX == 4 ? 2 : 4;  // float accumulators a row (FMA chains in flight)
    VF f[NX][FA];
    VI a[NX][2];  // int32 sums of the group, even and odd runs (two dot chains in flight)
    for (int i = 0; i < NX; ++i) {
      a[i][0] = a[i][1] = VI{};
      for (int u = 0; u < FA; ++u) f[i][u] = splat(0.f);
    }
    int64_t left = j.G, g = 0;  // columns left in group g
    // run r (columns k + 32 r ..) of the weights wv into a; a group's int32 sums (exact) into f, scaled, at its end
    auto run = [&](const VW* wv, int r, int64_t k) __attribute__((always_inline)) {
      for (int i = 0; i < NX; ++i) {
        const int16_t* xr = q + i * K + k + 32 * r;
        for (int c = 0; c < C; ++c) a[i][r % 2] = a[i][r % 2] + madd(wv[c], loadu<VW>(xr + c * 2 * L));
      }
      if ((left -= 32) == 0) {
        const VF sc = splat(gs[g++]);
        for (int i = 0; i < NX; ++i) {
          f[i][r % FA] = fmadd(to_float(a[i][0] + a[i][1]), sc, f[i][r % FA]);
          a[i][0] = a[i][1] = VI{};
        }
        left = j.G;
      }
    };
    const int64_t kb = K - K % 128;  // whole blocks: the four runs unrolled (the weights stay in registers)
    for (int64_t k = 0; k < kb; k += 128) {
      prefetch_ahead<false>(w + k / 2, 64);
      VW wv[4][C];
      nibbles(w + k / 2, wv);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) run(wv[r], r, k);
    }
    if (kb < K) {  // a last block of 1-3 runs
      VW wv[4][C];
      nibbles(w + kb / 2, wv);
      for (int r = 0; r < (K - kb) / 32; ++r) run(wv[r], r, kb);
    }
    for (int i = 0; i < NX; ++i) {
      for (int u = 1; u < FA; ++u) f[i][0] = f[i][0] + f[i][u];
      s[i] = reduce_add(f[i][0]) * j.xs[m + i];
    }
  } else {  // int8: integer products with x's int16 copy j.xq, moved to float32 every FLUSH columns
    const int8_t* w = static_cast<const int8_t*>(j.w) + n * K;
    const int16_t* q = j.xq + m * K;
    constexpr int64_t P = 2 * L;  // weights per madd
    kv = K - K % P;
    VF f[NX];
    for (int i = 0; i < NX; ++i) f[i] = splat(0.f);
    for (int64_t k0 = 0; k0 < kv; k0 += FLUSH) {
      const int64_t end = std::min(kv, k0 + FLUSH);
      VI a[NX][UX];
      for (int i = 0; i < NX; ++i)
        for (int u = 0; u < UX; ++u) a[i][u] = VI{};
      int64_t k = k0;
      for (; k + UX * P <= end; k += UX * P) {
        prefetch_ahead<false>(w + k, UX * P);
        for (int u = 0; u < UX; ++u) {
          const VW wv = widen_i8(w + k + u * P);
          for (int i = 0; i < NX; ++i) a[i][u] = a[i][u] + madd(wv, loadu<VW>(q + i * K + k + u * P));
        }
      }
      for (; k < end; k += P) {
        const VW wv = widen_i8(w + k);
        for (int i = 0; i < NX; ++i) a[i][0] = a[i][0] + madd(wv, loadu<VW>(q + i * K + k));
      }
      for (int i = 0; i < NX; ++i) {
        for (int u = 1; u < UX; ++u) a[i][0] = a[i][0] + a[i][u];
        f[i] = f[i] + to_float(a[i][0]);
      }
    }
    for (int i = 0; i < NX; ++i) s[i] = reduce_add(f[i]) * j.xs[m + i];
  }
  for (int i = 0; i < NX; ++i) {
    if constexpr (KIND == I4) {
      finish(j, m + i, n, s[i]);  // (no tail: K is a whole number of groups)
    } else {
      finish(j, m + i, n, s[i] + dot_tail<KIND>(j, n, j.x + (m + i) * K, kv));
    }
  }
}

template <int KIND>
void rows(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= j.M; m += 4) row<KIND, 4>(j, n, m);
    if (m + 2 <= j.M) {
      row<KIND, 2>(j, n, m);
      m += 2;
    }
    if (m < j.M) row<KIND, 1>(j, n, m);
  }
}

// int4: row n's K weights as float32 into out, W[n, k] = s[n, k / G] · q[n, k] (a prompt's panels, embedding rows)
inline void dequantize_row(const uint8_t* w, const float* gs, int64_t K, int64_t G, float* out) {
  for (int64_t k = 0; k < K; k += 128) {
    VW wv[4][C];
    nibbles(w + k / 2, wv);
    const int runs = static_cast<int>(std::min<int64_t>(4, (K - k) / 32));
    for (int r = 0; r < runs; ++r) {
      const VF sc = splat(gs[(k + 32 * r) / G]);
      for (int c = 0; c < C; ++c) store_scaled(wv[r][c], sc, out + k + 32 * r + c * 2 * L);
    }
  }
}
