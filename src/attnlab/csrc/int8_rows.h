// The vector code of the int8 files (int8_quantize.cpp, int8_product.cpp, int8_train.cpp: attnlab.adapt.
// int8_training): symmetric int8 rounding with one scale per row or column, and int8 products' int32 sums back to
// float32 or bf16 — rows of float32 or bfloat16 read through vec.h's `ld`, compiled per instruction set
// (isa_regions.h).

// round(a s) half to even for |a s| < 2²²: a s + 1.5·2²³ rounded once (fmadd: the exact product, as the tests'
// reference; one rule on every lane and tail, spelt out: left to GCC's contraction, which register of a row was fused
// changed with the loop's shape, and the scalar tails were not)
inline VF rounded(VF a, VF s) { return fmadd(a, s, splat(12582912.f)) - splat(12582912.f); }
inline int8_t round_q(float a, float s) {
  return static_cast<int8_t>(static_cast<int32_t>(fmadd1(a, s, 12582912.f) - 12582912.f));
}
// integers in [−127, 127] to int8: L lanes (st_q), or four registers' (st_q4)
inline void st_q(int8_t* q, VF r) { store_i8(q, __builtin_convertvector(r, VI)); }
inline void st_q4(int8_t* q, VF r0, VF r1, VF r2, VF r3) {
  store_i8x4(q, __builtin_convertvector(r0, VI), __builtin_convertvector(r1, VI), __builtin_convertvector(r2, VI),
             __builtin_convertvector(r3, VI));
}

// m = max_j |x_j c_j| over a row (c null: 1); NaN if the row holds a NaN. Four accumulators: the max is a chain
template <class T>
inline float absmax_row(const T* x, const float* c, int64_t n) {
  const auto at = [&](int64_t j) { return vabs(c ? ld(x + j) * load(c + j) : ld(x + j)); };
  VF m0 = splat(0.f), m1 = m0, m2 = m0, m3 = m0, s = m0;
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) {
    const VF a0 = at(j), a1 = at(j + L), a2 = at(j + 2 * L), a3 = at(j + 3 * L);
    m0 = vmax(m0, a0), m1 = vmax(m1, a1), m2 = vmax(m2, a2), m3 = vmax(m3, a3);
    s += (a0 + a1) + (a2 + a3);
  }
  for (; j + L <= n; j += L) {
    const VF a = at(j);
    m0 = vmax(m0, a), s += a;
  }
  float r = tree_max(vmax(vmax(m0, m1), vmax(m2, m3)));
  bool nan = any_nan(s);
  for (; j < n; ++j) {
    const float a = std::fabs(c ? ld1(x + j) * c[j] : ld1(x + j));
    r = a > r ? a : r, nan |= std::isnan(a);
  }
  return nan ? NAN : r;
}

// q_j = round(x_j c_j inv) (c null: 1)
template <class T>
inline void quantize_row(const T* x, const float* c, int64_t n, float inv, int8_t* q) {
  const VF s = splat(inv);
  const auto at = [&](int64_t j) { return rounded(c ? ld(x + j) * load(c + j) : ld(x + j), s); };
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) st_q4(q + j, at(j), at(j + L), at(j + 2 * L), at(j + 3 * L));
  for (; j + L <= n; j += L) st_q(q + j, at(j));
  for (; j < n; ++j) q[j] = round_q(c ? ld1(x + j) * c[j] : ld1(x + j), inv);
}

// One row's part of both quantisations: returns max_j |x_j c_j| (c null: 1; NaN if the row holds a NaN) and folds
// the row into its block's column partials: m_j = max(m_j, |x_j|), sum_j += x_j (NaN kept in sum_j)
template <class T>
inline float row_col_stats(const T* x, const float* c, int64_t n, float* m, float* sum) {
  VF rm0 = splat(0.f), rm1 = rm0, rs = rm0;
  int64_t j = 0;
  for (; j + 2 * L <= n; j += 2 * L) {
    const VF a0 = ld(x + j), a1 = ld(x + j + L);
    const VF b0 = vabs(a0), b1 = vabs(a1);
    const VF r0 = c ? vabs(a0 * load(c + j)) : b0, r1 = c ? vabs(a1 * load(c + j + L)) : b1;
    rm0 = vmax(rm0, r0), rm1 = vmax(rm1, r1), rs += r0 + r1;
    store(m + j, vmax(load(m + j), b0)), store(m + j + L, vmax(load(m + j + L), b1));
    store(sum + j, load(sum + j) + a0), store(sum + j + L, load(sum + j + L) + a1);
  }
  for (; j + L <= n; j += L) {
    const VF a = ld(x + j), b = vabs(a), r = c ? vabs(a * load(c + j)) : b;
    rm0 = vmax(rm0, r), rs += r;
    store(m + j, vmax(load(m + j), b)), store(sum + j, load(sum + j) + a);
  }
  float r = tree_max(vmax(rm0, rm1));
  bool nan = any_nan(rs);
  for (; j < n; ++j) {
    const float a = ld1(x + j), b = std::fabs(a), rc = c ? std::fabs(a * c[j]) : b;
    r = rc > r ? rc : r, nan |= std::isnan(rc);
    m[j] = b > m[j] ? b : m[j], sum[j] += a;
  }
  return nan ? NAN : r;
}

// q_j = round(x_j c_j inv) and qc_j = round(x_j cinv_j): a row of both quantisations in one read
template <class T>
inline void quantize_row_col(const T* x, const float* c, int64_t n, float inv, const float* cinv, int8_t* q,
                             int8_t* qc) {
  const VF s = splat(inv);
  const auto row = [&](VF a, int64_t j) { return rounded(c ? a * load(c + j) : a, s); };
  const auto col = [&](VF a, int64_t j) { return rounded(a, load(cinv + j)); };
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) {
    const VF a0 = ld(x + j), a1 = ld(x + j + L), a2 = ld(x + j + 2 * L), a3 = ld(x + j + 3 * L);
    st_q4(q + j, row(a0, j), row(a1, j + L), row(a2, j + 2 * L), row(a3, j + 3 * L));
    st_q4(qc + j, col(a0, j), col(a1, j + L), col(a2, j + 2 * L), col(a3, j + 3 * L));
  }
  for (; j + L <= n; j += L) {
    const VF a = ld(x + j);
    st_q(q + j, row(a, j)), st_q(qc + j, col(a, j));
  }
  for (; j < n; ++j) {
    const float a = ld1(x + j);
    q[j] = round_q(c ? a * c[j] : a, inv);
    qc[j] = round_q(a, cinv[j]);
  }
}

// dst[c · ds + r] = src[r · ss + c] for r < rows, c < cols: a block of bytes transposed by 16 × 16 tiles (four
// rounds of byte interleaves of rows i and i + 8: each round rotates the 8 bits of (row, column) by one), a column of
// tiles at a time so each row of dst receives its bytes of the block in one run
inline void transpose_bytes(const int8_t* src, int64_t ss, int64_t rows, int64_t cols, int8_t* dst, int64_t ds) {
  int64_t c0 = 0, whole = rows - rows % 16;
  for (; whole && c0 + 16 <= cols; c0 += 16) {
    for (int64_t r0 = 0; r0 < whole; r0 += 16) {
      X16 a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = loadu<X16>(src + (r0 + i) * ss + c0);
      for (int round = 0; round < 4; ++round) {
        for (int i = 0; i < 8; ++i) b[2 * i] = zip_lo<1>(a[i], a[i + 8]), b[2 * i + 1] = zip_hi<1>(a[i], a[i + 8]);
        for (int i = 0; i < 16; ++i) a[i] = b[i];
      }
      for (int i = 0; i < 16; ++i) storeu(dst + (c0 + i) * ds + r0, a[i]);
    }
    for (int64_t c = c0; c < c0 + 16; ++c) {  // the rows past the whole tiles
      for (int64_t r = whole; r < rows; ++r) dst[c * ds + r] = src[r * ss + c];
    }
  }
  for (int64_t c = c0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) dst[c * ds + r] = src[r * ss + c];
  }
}

// y_j = acc_j (rs cs_j) + b_j  (cs null: 1, b null: 0; the add fused, see fmadd): a row of an int32 product back to
// float
// L lanes of it (cs, b at the lanes' columns, or null); int8_gemm.h rescales its tiles' registers with it
inline VF dequant_vec(VI a, float rs, const float* cs, const float* b) {
  const VF s = cs ? splat(rs) * load(cs) : splat(rs), v = __builtin_convertvector(a, VF);
  return b ? fmadd(v, s, load(b)) : v * s;
}
template <class T>
inline void dequant_row(const int32_t* acc, float rs, const float* cs, const float* b, int64_t n, T* y) {
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    VI a;
    std::memcpy(&a, acc + j, sizeof a);
    st(y + j, dequant_vec(a, rs, cs ? cs + j : nullptr, b ? b + j : nullptr));
  }
  for (; j < n; ++j) {
    const float s = cs ? rs * cs[j] : rs, v = static_cast<float>(acc[j]);
    st1(y + j, b ? fmadd1(v, s, b[j]) : v * s);
  }
}
