// What the CPU kernels (nm_linear.cpp, nm_linear_quant.cpp, int8_linear.cpp, decode_attention.cpp) share:
// headers, the x86 switch, instruction-set levels and target attributes, dtype conversion, the meta bitstream,
// the row-pass helpers.
#pragma once

// The ATen pieces the kernels use, not <torch/extension.h>: that header (pybind11 and the whole C++ API) takes
// longer to parse than a kernel file takes to compile. Outputs are allocated through ATen/EmptyTensor.h (a third
// of ATen/ops/empty.h's parse time). Only bindings.cpp, the Python module, includes pybind11 and torch/library.h.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(HF_MASKLLM_PORTABLE)
#define HF_MASKLLM_X86 1
#include <immintrin.h>
#else
#define HF_MASKLLM_X86 0
#endif

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#define TARGET_AVX512_VBMI2 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi2,avx2,fma,f16c")))

int64_t isa();  // nm_linear.cpp: the instruction-set level in use (an Isa)

namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

constexpr int kMaxTokenBlock = 8;     // tokens per row pass (accumulators in registers); more take more passes
constexpr int kAvx2TokenBlock = 4;    // AVX2: 16 registers
constexpr int kPrefetchBytes = 1024;  // how far ahead of the kept values a row pass prefetches

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // round to nearest even for bfloat16 and half
}

// Bits per kept value's position in the meta bitstream: ceil(log2 m).
inline int meta_bits(int m) {
  int b = 1;
  while ((1 << b) < m) ++b;
  return b;
}

// Position (0..m-1) of kept value j of a row: b bits at bit j*b of the row's little-endian bitstream.
inline int read_position(const uint8_t* meta_row, int64_t j, int b) {
  const int64_t bit = j * b;
  const int64_t byte = bit >> 3;
  const int shift = static_cast<int>(bit & 7);
  unsigned word = meta_row[byte];
  if (shift + b > 8) word |= static_cast<unsigned>(meta_row[byte + 1]) << 8;
  return static_cast<int>((word >> shift) & ((1u << b) - 1));
}

// One row pass for `tb` (1..kMaxTokenBlock) tokens: dispatch to the instantiation with tb accumulators.
template <typename Fn>
inline void with_token_block(int64_t tb, Fn&& fn) {
  switch (tb) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// A new CPU tensor of `shape` with `options` (dtype), uninitialised; new_zeros fills it with zeros.
inline at::Tensor new_empty(c10::IntArrayRef shape, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cpu(shape, options));
}
inline at::Tensor new_zeros(c10::IntArrayRef shape, const at::TensorOptions& options) {
  return new_empty(shape, options).zero_();
}

#if HF_MASKLLM_X86
// 16 inputs times 127 / absmax to u8 = code + 128: the same float32 product and rounding as
// std::nearbyint(v * inv), clamped to [-127, 127].
TARGET_AVX512 inline __m128i codes16_u8(__m512 v, __m512 inv) {
  const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f), r));
  return _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(clamped), _mm512_set1_epi32(128)));
}

// The VNNI routes' input rounding, for `cnt` (0..32) inputs: 8-bit codes, scale = absmax / 127, round to
// nearest even (llama.cpp's Q8_0 rounding), stored as u8 = code + 128 over `dst`'s first `cnt` bytes.
// Returns the scale. All zeros, or an inf or NaN among the inputs, leave `dst` as it is (the caller's
// code 0) and return the absmax itself: 0, or inf / NaN, which the products then carry to the outputs.
TARGET_AVX512 inline float quantize32_u8(const float* x, int64_t cnt, uint8_t* dst) {
  const __mmask16 k0 = static_cast<__mmask16>(cnt >= 16 ? 0xFFFFu : (1u << cnt) - 1);
  const __mmask16 k1 = static_cast<__mmask16>(cnt >= 32 ? 0xFFFFu : cnt > 16 ? (1u << (cnt - 16)) - 1 : 0u);
  const __m512 a = _mm512_maskz_loadu_ps(k0, x), b = _mm512_maskz_loadu_ps(k1, x + 16);
  if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) return NAN;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (amax == 0.f || !std::isfinite(amax)) return amax;
  const __m512 inv = _mm512_set1_ps(127.f / amax);
  _mm_mask_storeu_epi8(dst, k0, codes16_u8(a, inv));
  _mm_mask_storeu_epi8(dst + 16, k1, codes16_u8(b, inv));
  return amax / 127.f;
}

// The same rounding on AVX2 (routes with 8-bit inputs on CPUs without VNNI): `cnt` (0..32) inputs to 32 signed
// codes in `dst` (zeros past `cnt`), the same float32 product and round to nearest even; returns the scale, or
// the absmax itself where it is 0, inf or NaN (then `dst` holds zeros).
TARGET_AVX2 inline float quantize32_s8(const float* x, int64_t cnt, int8_t* dst) {
  alignas(32) float v[32] = {};
  std::memcpy(v, x, std::max<int64_t>(0, std::min<int64_t>(32, cnt)) * sizeof(float));
  __m256 a[4];
  __m256 amax8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_load_ps(v + 8 * i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(a[i], a[i], _CMP_UNORD_Q));
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, a[i]));
  }
  std::memset(dst, 0, 32);
  if (_mm256_movemask_ps(nan8)) return NAN;
  alignas(32) float m[8];
  _mm256_store_ps(m, amax8);
  float amax = 0.f;
  for (float e : m) amax = std::max(amax, e);
  if (amax == 0.f || !std::isfinite(amax)) return amax;
  const __m256 inv = _mm256_set1_ps(127.f / amax), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(a[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
  }
  // packs work within 128-bit lanes: bytes come out as [c0 0-3, c1 0-3, c2 0-3, c3 0-3 | c0 4-7, ...]
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return amax / 127.f;
}
#endif

// Rows per task: enough work per row (kept values or bytes) that a task outweighs the pool's overhead.
inline int64_t row_grain(int64_t per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(per_row, 1)); }

}  // namespace
