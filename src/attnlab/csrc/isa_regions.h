// The vector body `ATTNLAB_BODY` (a header written in vec.h's vocabulary, e.g. decode_body.h) compiled once per
// instruction set, each in its own `#pragma GCC target` region and namespace with that set's width `L` (16 floats
// AVX-512, 8 AVX2, 4 portable) and vec.h's definitions for that set, and `ISA_FN(name)`: the `name` of the set the
// kernels use (attnlab_native::cpu_isa(): 2 AVX-512, 1 AVX2 + FMA, else portable; what the CPU runs). Include it inside an
// anonymous namespace, after native.h, <immintrin.h> (x86) and the standard headers the body uses.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")
namespace avx512 {
constexpr int L = 16;
#define ATTNLAB_VEC 2
#include "vec.h"
#undef ATTNLAB_VEC
#include ATTNLAB_BODY
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr int L = 8;
#define ATTNLAB_VEC 1
#include "vec.h"
#undef ATTNLAB_VEC
#include ATTNLAB_BODY
}  // namespace avx2
#pragma GCC pop_options
#define ATTNLAB_ISAS 1
#endif

namespace portable {
constexpr int L = 4;
#define ATTNLAB_VEC 0
#include "vec.h"
#undef ATTNLAB_VEC
#include ATTNLAB_BODY
}  // namespace portable

template <class T>
T pick(int64_t isa, T avx512_fn, T avx2_fn, T portable_fn) {
#ifdef ATTNLAB_ISAS
  if (isa >= 2) return avx512_fn;
  if (isa == 1) return avx2_fn;
#endif
  (void)avx512_fn, (void)avx2_fn;
  return portable_fn;
}

#ifdef ATTNLAB_ISAS
#define ISA_FN(name) \
  pick<decltype(&portable::name)>(::attnlab_native::cpu_isa(), avx512::name, avx2::name, portable::name)
#else
#define ISA_FN(name) pick<decltype(&portable::name)>(::attnlab_native::cpu_isa(), nullptr, nullptr, portable::name)
#endif
