// The vector kernel of matvec.cpp, written once in terms of `V` (one instruction set's vector operations) and
// included inside that set's `#pragma GCC target` region and namespace. Uses Job, Kind, U, FLUSH, finish and
// dot_tail from matvec.cpp.
//
// row<KIND, TWO>(j, n, m): y[m, n] (and y[m + 1, n] with TWO) from row n of W, read once, in order, with U
// vectors in flight; columns past the last whole vector go through dot_tail.

template <int KIND, bool TWO>
inline void row(const Job& j, int64_t n, int64_t m) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int64_t L = V::L;
  const int64_t K = j.K;
  const float* x0 = j.x + m * K;
  const float* x1 = TWO ? x0 + K : x0;
  float s0 = 0.f, s1 = 0.f;
  int64_t kv;  // columns done in vectors
  if constexpr (KIND == F32) {
    const float* w = static_cast<const float*>(j.w) + n * K;
    kv = K - K % L;
    F a0[U], a1[U];
    for (int u = 0; u < U; ++u) a0[u] = a1[u] = V::zero();
    int64_t k = 0;
    for (; k + U * L <= kv; k += U * L) {
      for (int u = 0; u < U; ++u) {
        const F wv = V::load(w + k + u * L);
        a0[u] = V::fma(wv, V::load(x0 + k + u * L), a0[u]);
        if (TWO) a1[u] = V::fma(wv, V::load(x1 + k + u * L), a1[u]);
      }
    }
    for (; k < kv; k += L) {
      const F wv = V::load(w + k);
      a0[0] = V::fma(wv, V::load(x0 + k), a0[0]);
      if (TWO) a1[0] = V::fma(wv, V::load(x1 + k), a1[0]);
    }
    s0 = V::sum(V::add(V::add(a0[0], a0[1]), V::add(a0[2], a0[3])));
    if (TWO) s1 = V::sum(V::add(V::add(a1[0], a1[1]), V::add(a1[2], a1[3])));
  } else if constexpr (KIND == BF16) {  // x's even / odd columns: j.xd (K even)
    const uint16_t* w = static_cast<const uint16_t*>(j.w) + n * K;
    const int64_t h = K / 2;
    const float* e0 = j.xd + m * K;
    const float* e1 = TWO ? e0 + K : e0;
    constexpr int64_t P = 2 * L;  // weights per vector of pairs
    kv = K - K % P;
    F a0[U], a1[U];
    for (int u = 0; u < U; ++u) a0[u] = a1[u] = V::zero();
    auto step = [&](int64_t k, int u) __attribute__((always_inline)) {
      F ev, od;
      V::bf16_pairs(w + k, ev, od);
      a0[u] = V::fma(od, V::load(e0 + h + k / 2), V::fma(ev, V::load(e0 + k / 2), a0[u]));
      if (TWO) a1[u] = V::fma(od, V::load(e1 + h + k / 2), V::fma(ev, V::load(e1 + k / 2), a1[u]));
    };
    int64_t k = 0;
    for (; k + U * P <= kv; k += U * P)
      for (int u = 0; u < U; ++u) step(k + u * P, u);
    for (; k < kv; k += P) step(k, 0);
    s0 = V::sum(V::add(V::add(a0[0], a0[1]), V::add(a0[2], a0[3])));
    if (TWO) s1 = V::sum(V::add(V::add(a1[0], a1[1]), V::add(a1[2], a1[3])));
  } else {  // int8: integer products with x's int16 copy j.xq, moved to float32 every FLUSH columns
    const int8_t* w = static_cast<const int8_t*>(j.w) + n * K;
    const int16_t* q0 = j.xq + m * K;
    const int16_t* q1 = TWO ? q0 + K : q0;
    constexpr int64_t P = 2 * L;  // weights per madd
    kv = K - K % P;
    F f0 = V::zero(), f1 = V::zero();
    for (int64_t k0 = 0; k0 < kv; k0 += FLUSH) {
      const int64_t end = std::min(kv, k0 + FLUSH);
      I a0[U], a1[U];
      for (int u = 0; u < U; ++u) a0[u] = a1[u] = V::izero();
      int64_t k = k0;
      for (; k + U * P <= end; k += U * P) {
        for (int u = 0; u < U; ++u) {
          a0[u] = V::iadd(a0[u], V::madd_i8(w + k + u * P, q0 + k + u * P));
          if (TWO) a1[u] = V::iadd(a1[u], V::madd_i8(w + k + u * P, q1 + k + u * P));
        }
      }
      for (; k < end; k += P) {
        a0[0] = V::iadd(a0[0], V::madd_i8(w + k, q0 + k));
        if (TWO) a1[0] = V::iadd(a1[0], V::madd_i8(w + k, q1 + k));
      }
      f0 = V::add(f0, V::to_float(V::iadd(V::iadd(a0[0], a0[1]), V::iadd(a0[2], a0[3]))));
      if (TWO) f1 = V::add(f1, V::to_float(V::iadd(V::iadd(a1[0], a1[1]), V::iadd(a1[2], a1[3]))));
    }
    s0 = V::sum(f0) * j.xs[m];
    if (TWO) s1 = V::sum(f1) * j.xs[m + 1];
  }
  finish(j, m, n, s0 + dot_tail<KIND>(j, n, x0, kv));
  if (TWO) finish(j, m + 1, n, s1 + dot_tail<KIND>(j, n, x1, kv));
}

template <int KIND>
void rows(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= j.M; m += 2) row<KIND, true>(j, n, m);
    if (m < j.M) row<KIND, false>(j, n, m);
  }
}
