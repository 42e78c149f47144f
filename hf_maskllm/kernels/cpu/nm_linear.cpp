// N:M sparse linear on CPU, reading the compressed format (hf_maskllm.sparse.format, version 1) directly.
//
//   values [out, in*n/m]  the kept weights of every group, in position order (float, bfloat16 or half)
//   meta   uint8 [out, ceil(in*n/m * b / 8)]  b = ceil(log2 m) bits per kept value, little-endian
//
// Two entry points, both multi-threaded over output rows with ATen's intra-op pool (each row is
// computed by one thread in a fixed order, so results do not depend on the thread count):
//
//   nm_linear(x [T, in], values, meta, n, m, bias?) -> y [T, out]   (decode and small batches)
//     2:4: a row's kept values are read once for all T tokens. For each block of kept values the
//     input columns they multiply are picked from x with one two-source permute whose indices come
//     straight from the meta bits (index of kept value k = 4 * (k / 2) + position); the picked
//     inputs and the kept values meet in an FMA (or, for bfloat16 on CPUs with AVX512-BF16, in
//     vdpbf16ps: the two kept values of a group in one dot-product lane). Accumulation in float32.
//   nm_expand(values, meta, n, m, in_features, out [out, in]) -> out   (prefill: then a dense GEMM)
//     2:4 on AVX-512: a keep-bit mask per 16 (float) or 32 (16-bit) dense columns from a 256-entry
//     table of meta bytes, and one vpexpand places the kept values, zeros elsewhere.
//
// Any other N:M (and CPUs without AVX2) take a scalar loop that reads the bitstream: exact, not fast.
// The instruction set is chosen at run time (set_isa); the file is compiled without -m flags, and
// each vector routine carries its own target attribute.

#include "common.h"

#include <atomic>

namespace {

#if HF_MASKLLM_X86
int supported_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    return kAvx2;
  }
  return kScalar;
}

bool supports_vbmi2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512vbmi2"));
  }();
  return has;
}
#else
int supported_isa() { return kScalar; }
bool supports_vbmi2() { return false; }
#endif

std::atomic<int> g_isa{-1};  // the level in use: min(requested, supported); set by set_isa

int current_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = supported_isa();
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return isa;
}

// ------------------------------------------------------------------------------------------------
// Scalar reference route: any N:M, any dtype (x already in float32, [T, K]).
template <typename T>
void row_scalar(const T* v, const uint8_t* meta_row, int64_t kept, int n, int m, int b, const float* xf,
                int64_t K, int64_t tokens, float* acc) {
  for (int64_t t = 0; t < tokens; ++t) acc[t] = 0.f;
  for (int64_t j = 0; j < kept; ++j) {
    const int pos = read_position(meta_row, j, b);
    if (pos >= m) continue;  // corrupt meta (checkpoints are validated on load): never read outside the row
    const int64_t col = (j / n) * m + pos;
    const float w = to_float(v[j]);
    for (int64_t t = 0; t < tokens; ++t) acc[t] += w * xf[t * K + col];
  }
}

#if HF_MASKLLM_X86
// ------------------------------------------------------------------------------------------------
// AVX-512, 2:4, float32 arithmetic: 16 kept values (8 groups, 32 inputs, 4 meta bytes) per block.
TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TARGET_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TARGET_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Dense input index of each of 16 kept values: 4 * (k / 2) + position (bits 2k, 2k+1 of `word`).
TARGET_AVX512 inline __m512i indices16(uint32_t word) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i pos = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts),
                                       _mm512_set1_epi32(3));
  return _mm512_add_epi32(pos, base);
}

// acc[t] += w * (the 16 inputs of token t that the kept values multiply); x points at the block's first column.
template <int TB>
TARGET_AVX512 inline void step24_avx512(__m512* acc, const __m512 w, const __m512i idx, const float* x,
                                        int64_t Kp) {
  for (int t = 0; t < TB; ++t) {
    const float* xr = x + t * Kp;
    const __m512 g = _mm512_permutex2var_ps(_mm512_loadu_ps(xr), idx, _mm512_loadu_ps(xr + 16));
    acc[t] = _mm512_fmadd_ps(w, g, acc[t]);
  }
}

// xf: float32 [tokens, Kp] zero-padded to Kp (a multiple of 64) columns.
template <int TB, typename T>
TARGET_AVX512 void row24_avx512(const T* v, const uint8_t* meta_row, int64_t kept, const float* xf, int64_t Kp,
                                float* acc_out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t full = kept / 16;
  for (int64_t blk = 0; blk < full; ++blk) {
    uint32_t word;
    std::memcpy(&word, meta_row + 4 * blk, 4);
    _mm_prefetch(reinterpret_cast<const char*>(v + 16 * blk) + kPrefetchBytes, _MM_HINT_T0);
    step24_avx512<TB>(acc, load16(v + 16 * blk), indices16(word), xf + 32 * blk, Kp);
  }
  const int64_t rest = kept - 16 * full;
  if (rest) {  // the row's tail: through zero-padded copies (x is padded already)
    alignas(64) T vt[16] = {};
    uint32_t word = 0;
    std::memcpy(vt, v + 16 * full, rest * sizeof(T));
    std::memcpy(&word, meta_row + 4 * full, (rest + 3) / 4);
    step24_avx512<TB>(acc, load16(vt), indices16(word), xf + 32 * full, Kp);
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = _mm512_reduce_add_ps(acc[t]);
}

// AVX-512 BF16, 2:4: 32 kept bfloat16 values (16 groups, 64 inputs, 8 meta bytes) per block; one
// vdpbf16ps lane sums a group's two products. xb: bfloat16 [tokens, Kp] zero-padded.
TARGET_AVX512_BF16 inline __m512i indices32(uint64_t word) {
  // lane k (16-bit) takes the 16-bit meta word k / 8, shifts it by 2 * (k % 8), keeps 2 bits.
  const __m512i which = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1,
                                         1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shifts = _mm512_set_epi16(14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0, 14, 12, 10,
                                          8, 6, 4, 2, 0, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i base = _mm512_set_epi16(60, 60, 56, 56, 52, 52, 48, 48, 44, 44, 40, 40, 36, 36, 32, 32, 28,
                                        28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0);
  const __m512i words = _mm512_permutexvar_epi16(which, _mm512_castsi128_si512(_mm_cvtsi64_si128(
                                                            static_cast<long long>(word))));
  const __m512i pos = _mm512_and_si512(_mm512_srlv_epi16(words, shifts), _mm512_set1_epi16(3));
  return _mm512_add_epi16(pos, base);
}

template <int TB>
TARGET_AVX512_BF16 inline void step24_bf16dp(__m512* acc, const __m512i w, const __m512i idx,
                                             const c10::BFloat16* x, int64_t Kp) {
  for (int t = 0; t < TB; ++t) {
    const c10::BFloat16* xr = x + t * Kp;
    const __m512i g = _mm512_permutex2var_epi16(_mm512_loadu_si512(xr), idx, _mm512_loadu_si512(xr + 32));
    acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)w, (__m512bh)g);
  }
}

template <int TB>
TARGET_AVX512_BF16 void row24_bf16dp(const c10::BFloat16* v, const uint8_t* meta_row, int64_t kept,
                                     const c10::BFloat16* xb, int64_t Kp, float* acc_out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t full = kept / 32;
  for (int64_t blk = 0; blk < full; ++blk) {
    uint64_t word;
    std::memcpy(&word, meta_row + 8 * blk, 8);
    _mm_prefetch(reinterpret_cast<const char*>(v + 32 * blk) + kPrefetchBytes, _MM_HINT_T0);
    step24_bf16dp<TB>(acc, _mm512_loadu_si512(v + 32 * blk), indices32(word), xb + 64 * blk, Kp);
  }
  const int64_t rest = kept - 32 * full;
  if (rest) {
    alignas(64) c10::BFloat16 vt[32] = {};
    uint64_t word = 0;
    std::memcpy(vt, v + 32 * full, rest * sizeof(c10::BFloat16));
    std::memcpy(&word, meta_row + 8 * full, (rest + 3) / 4);
    step24_bf16dp<TB>(acc, _mm512_loadu_si512(vt), indices32(word), xb + 64 * full, Kp);
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = _mm512_reduce_add_ps(acc[t]);
}

// AVX2, 2:4, float32 arithmetic: 16 kept values (8 groups, 32 inputs, 4 meta bytes) per block, as two
// registers of 8. AVX2 has no two-source permute over 16 floats, so the inputs are laid out (once per
// call, see avx2_group_order) for the in-lane vpermilps: a register of kept values holds two groups
// per 128-bit lane, (a, a, b, b); input register A holds the groups `a` of both lanes, B the groups
// `b`; vpermilps picks by the low two bits of each index, which are exactly the stored positions;
// an immediate blend takes lanes 2, 3, 6, 7 from B.
template <typename T>
struct Avx2Values;

template <>
struct Avx2Values<float> {  // kept 0..7 and 8..15 in order: groups (0, 1 | 2, 3) and (4, 5 | 6, 7)
  static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  TARGET_AVX2 static inline void load(const float* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
  TARGET_AVX2 static inline void positions(uint32_t word, __m256i& lo, __m256i& hi) {
    const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
    lo = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    hi = _mm256_srlv_epi32(w, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30));
  }
};

template <>
struct Avx2Values<c10::Half> {  // the same order as float32 (converted 8 at a time)
  static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  TARGET_AVX2 static inline void load(const c10::Half* p, __m256& lo, __m256& hi) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  TARGET_AVX2 static inline void positions(uint32_t word, __m256i& lo, __m256i& hi) {
    Avx2Values<float>::positions(word, lo, hi);
  }
};

template <>
struct Avx2Values<c10::BFloat16> {  // unpacked with zeros per 128-bit lane: groups (0, 1 | 4, 5), (2, 3 | 6, 7)
  static constexpr int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  TARGET_AVX2 static inline void load(const c10::BFloat16* p, __m256& lo, __m256& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
  }
  TARGET_AVX2 static inline void positions(uint32_t word, __m256i& lo, __m256i& hi) {
    const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
    lo = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 16, 18, 20, 22));
    hi = _mm256_srlv_epi32(w, _mm256_setr_epi32(8, 10, 12, 14, 24, 26, 28, 30));
  }
};

TARGET_AVX2 inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[t] += w * (inputs picked by pos from A = x[0:8], B = x[8:16]) for each token.
template <int TB>
TARGET_AVX2 inline void step24_avx2(__m256* acc, const __m256 w, const __m256i pos, const float* x, int64_t Kp) {
  for (int t = 0; t < TB; ++t) {
    const float* xr = x + t * Kp;
    const __m256 a = _mm256_permutevar_ps(_mm256_loadu_ps(xr), pos);
    const __m256 b = _mm256_permutevar_ps(_mm256_loadu_ps(xr + 8), pos);
    acc[t] = _mm256_fmadd_ps(w, _mm256_blend_ps(a, b, 0xCC), acc[t]);
  }
}

// xf: float32 [tokens, Kp], every 32 inputs in Avx2Values<T>::order of their 8 groups.
// Two accumulators per token (one per half of a block) halve the FMA latency chain of decode; that
// and the 16 ymm registers cap a pass at kAvx2TokenBlock tokens.
template <int TB, typename T>
TARGET_AVX2 void row24_avx2(const T* v, const uint8_t* meta_row, int64_t kept, const float* xf, int64_t Kp,
                            float* acc_out) {
  __m256 acc[TB], acc2[TB];
  for (int t = 0; t < TB; ++t) acc[t] = acc2[t] = _mm256_setzero_ps();
  const int64_t full = kept / 16;
  __m256 w_lo, w_hi;
  __m256i p_lo, p_hi;
  for (int64_t blk = 0; blk < full; ++blk) {
    uint32_t word;
    std::memcpy(&word, meta_row + 4 * blk, 4);
    _mm_prefetch(reinterpret_cast<const char*>(v + 16 * blk) + kPrefetchBytes, _MM_HINT_T0);
    Avx2Values<T>::load(v + 16 * blk, w_lo, w_hi);
    Avx2Values<T>::positions(word, p_lo, p_hi);
    step24_avx2<TB>(acc, w_lo, p_lo, xf + 32 * blk, Kp);
    step24_avx2<TB>(acc2, w_hi, p_hi, xf + 32 * blk + 16, Kp);
  }
  const int64_t rest = kept - 16 * full;
  if (rest) {
    alignas(32) T vt[16] = {};
    uint32_t word = 0;
    std::memcpy(vt, v + 16 * full, rest * sizeof(T));
    std::memcpy(&word, meta_row + 4 * full, (rest + 3) / 4);
    Avx2Values<T>::load(vt, w_lo, w_hi);
    Avx2Values<T>::positions(word, p_lo, p_hi);
    step24_avx2<TB>(acc, w_lo, p_lo, xf + 32 * full, Kp);
    step24_avx2<TB>(acc2, w_hi, p_hi, xf + 32 * full + 16, Kp);
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = hsum8(_mm256_add_ps(acc[t], acc2[t]));
}

// x [tokens, K] -> float32 [tokens, Kp] zeros beyond K, each 32 inputs' groups of 4 in `order`.
template <typename T>
void avx2_layout(const T* x, int64_t tokens, int64_t K, int64_t Kp, const int* order, float* dst) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* xr = x + t * K;
    float* dr = dst + t * Kp;
    for (int64_t blk = 0; blk < Kp / 32; ++blk) {
      for (int slot = 0; slot < 8; ++slot) {
        const int64_t col = 32 * blk + 4 * order[slot];
        for (int i = 0; i < 4; ++i) dr[32 * blk + 4 * slot + i] = col + i < K ? to_float(xr[col + i]) : 0.f;
      }
    }
  }
}

#endif  // HF_MASKLLM_X86

template <typename T>
void linear_impl(const T* xp, int64_t tokens, int64_t K, const at::Tensor& values, const at::Tensor& meta, int n,
                 int m, const T* bp, T* yp) {
  const int64_t out = values.size(0), kept = values.size(1), meta_stride = meta.size(1);
  const T* vp = values.data_ptr<T>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  const int isa = current_isa();
  const bool fast24 = n == 2 && m == 4 && isa >= kAvx2;
  const bool bf16dp = fast24 && isa >= kAvx512Bf16 && std::is_same<T, c10::BFloat16>::value;
  // The inputs in the compute type, zero-padded to a multiple of 64 columns (no masked loads needed),
  // plus 32 more: a row stride that is not a multiple of 4 KiB keeps the tokens' rows in different
  // L1 sets.
  const int64_t Kp = fast24 ? round_up(K, 64) + 32 : K;
  std::vector<c10::BFloat16> xb_buf;
  std::vector<float> xf_buf;
  const c10::BFloat16* xb = nullptr;
  const float* xf = nullptr;
  if (bf16dp) {
    xb_buf.assign(tokens * Kp, c10::BFloat16(0.f));
    for (int64_t t = 0; t < tokens; ++t) std::memcpy(&xb_buf[t * Kp], xp + t * K, K * sizeof(T));
    xb = xb_buf.data();
#if HF_MASKLLM_X86
  } else if (fast24 && isa < kAvx512) {
    xf_buf.resize(tokens * Kp);
    avx2_layout<T>(xp, tokens, K, Kp, Avx2Values<T>::order, xf_buf.data());
    xf = xf_buf.data();
#endif
  } else if (fast24 || !std::is_same<T, float>::value) {
    xf_buf.assign(tokens * Kp, 0.f);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t k = 0; k < K; ++k) xf_buf[t * Kp + k] = to_float(xp[t * K + k]);
    xf = xf_buf.data();
  } else {
    xf = reinterpret_cast<const float*>(xp);
  }
  const int b = meta_bits(m);
  const int64_t block = isa >= kAvx512 ? kMaxTokenBlock : kAvx2TokenBlock;
  at::parallel_for(0, out, row_grain(kept), [&](int64_t begin, int64_t end) {
    float acc[kMaxTokenBlock];
    std::vector<float> acc_all;
    if (!fast24) acc_all.resize(tokens);
    for (int64_t r = begin; r < end; ++r) {
      const T* v = vp + r * kept;
      const uint8_t* meta_row = mp + r * meta_stride;
      const float bias_r = bp ? to_float(bp[r]) : 0.f;
      if (!fast24) {
        row_scalar<T>(v, meta_row, kept, n, m, b, xf, K, tokens, acc_all.data());
        for (int64_t t = 0; t < tokens; ++t) yp[t * out + r] = from_float<T>(acc_all[t] + bias_r);
        continue;
      }
      for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        const int64_t tb = std::min<int64_t>(block, tokens - t0);
#if HF_MASKLLM_X86
        with_token_block(tb, [&](auto tokens_in_pass) {
          constexpr int TB = decltype(tokens_in_pass)::value;
          if (bf16dp) {
            if constexpr (std::is_same<T, c10::BFloat16>::value) {
              row24_bf16dp<TB>(v, meta_row, kept, xb + t0 * Kp, Kp, acc);
            }
          } else if (isa >= kAvx512) {
            row24_avx512<TB, T>(v, meta_row, kept, xf + t0 * Kp, Kp, acc);
          } else if constexpr (TB <= kAvx2TokenBlock) {
            row24_avx2<TB, T>(v, meta_row, kept, xf + t0 * Kp, Kp, acc);
          }
        });
#endif
        for (int64_t t = 0; t < tb; ++t) yp[(t0 + t) * out + r] = from_float<T>(acc[t] + bias_r);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Expansion into a dense [out, K] buffer.

// Keep bits of the 8 dense columns of one 2:4 meta byte (two groups): bit 4g + position.
struct KeepTable {
  uint8_t bits[256];
  KeepTable() {
    for (int byte = 0; byte < 256; ++byte) {
      const int p0 = byte & 3, p1 = (byte >> 2) & 3, q0 = (byte >> 4) & 3, q1 = (byte >> 6) & 3;
      bits[byte] = static_cast<uint8_t>((1 << p0) | (1 << p1) | ((1 << q0) | (1 << q1)) << 4);
    }
  }
};
const KeepTable kKeep;

template <typename T>
void expand_row_scalar(const T* v, const uint8_t* meta_row, int64_t kept, int n, int m, int b, int64_t K,
                       T* dst) {
  std::memset(static_cast<void*>(dst), 0, K * sizeof(T));
  for (int64_t j = 0; j < kept; ++j) {
    const int pos = read_position(meta_row, j, b);
    if (pos < m) dst[(j / n) * m + pos] = v[j];  // corrupt meta never writes outside the row
  }
}

#if HF_MASKLLM_X86
// 2:4, 32-bit values: 8 kept -> 16 dense per vpexpandd.
TARGET_AVX512 void expand_row24_avx512_32(const uint32_t* v, const uint8_t* meta_row, int64_t kept,
                                          uint32_t* dst) {
  const int64_t full = kept / 8;
  for (int64_t blk = 0; blk < full; ++blk) {
    const __mmask16 keep =
        static_cast<__mmask16>(kKeep.bits[meta_row[2 * blk]] | (kKeep.bits[meta_row[2 * blk + 1]] << 8));
    const __m512i w = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 8 * blk)));
    _mm512_storeu_si512(dst + 16 * blk, _mm512_maskz_expand_epi32(keep, w));
  }
  for (int64_t j = 8 * full; j < kept; ++j) {  // tail: at most 7 values
    if (j % 2 == 0) std::memset(dst + 2 * j, 0, 4 * sizeof(uint32_t));
    dst[(j / 2) * 4 + ((meta_row[j / 4] >> (2 * (j % 4))) & 3)] = v[j];
  }
}

// 2:4, 16-bit values: 16 kept -> 32 dense per vpexpandw (AVX512-VBMI2).
TARGET_AVX512_VBMI2 void expand_row24_avx512_16(const uint16_t* v, const uint8_t* meta_row, int64_t kept,
                                                uint16_t* dst) {
  const int64_t full = kept / 16;
  for (int64_t blk = 0; blk < full; ++blk) {
    const uint8_t* mb = meta_row + 4 * blk;
    const __mmask32 keep = static_cast<__mmask32>(kKeep.bits[mb[0]]) |
                           (static_cast<__mmask32>(kKeep.bits[mb[1]]) << 8) |
                           (static_cast<__mmask32>(kKeep.bits[mb[2]]) << 16) |
                           (static_cast<__mmask32>(kKeep.bits[mb[3]]) << 24);
    const __m512i w =
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * blk)));
    _mm512_storeu_si512(dst + 32 * blk, _mm512_maskz_expand_epi16(keep, w));
  }
  for (int64_t j = 16 * full; j < kept; ++j) {
    if (j % 2 == 0) std::memset(dst + 2 * j, 0, 4 * sizeof(uint16_t));
    dst[(j / 2) * 4 + ((meta_row[j / 4] >> (2 * (j % 4))) & 3)] = v[j];
  }
}

#endif  // HF_MASKLLM_X86

template <typename T>
void expand_impl(const at::Tensor& values, const at::Tensor& meta, int n, int m, int64_t K, at::Tensor& dense) {
  const int64_t out = values.size(0), kept = values.size(1), meta_stride = meta.size(1);
  const T* vp = values.data_ptr<T>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  T* dp = dense.data_ptr<T>();
  const int isa = current_isa();
  const bool vec24 = n == 2 && m == 4 && isa >= kAvx512 && (sizeof(T) == 4 || supports_vbmi2());
  const int b = meta_bits(m);
  at::parallel_for(0, out, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* v = vp + r * kept;
      const uint8_t* meta_row = mp + r * meta_stride;
      T* dst = dp + r * K;
      if (!vec24) {
        expand_row_scalar<T>(v, meta_row, kept, n, m, b, K, dst);
        continue;
      }
#if HF_MASKLLM_X86
      if constexpr (sizeof(T) == 4) {
        expand_row24_avx512_32(reinterpret_cast<const uint32_t*>(v), meta_row, kept,
                               reinterpret_cast<uint32_t*>(dst));
      } else {
        expand_row24_avx512_16(reinterpret_cast<const uint16_t*>(v), meta_row, kept,
                               reinterpret_cast<uint16_t*>(dst));
      }
#endif
    }
  });
}

void check_common(const at::Tensor& values, const at::Tensor& meta, int n, int m, int64_t K) {
  TORCH_CHECK(values.device().is_cpu() && meta.device().is_cpu(), "nm kernels: tensors must be on the CPU");
  TORCH_CHECK(values.dim() == 2 && values.is_contiguous(), "nm kernels: values must be contiguous [out, kept]");
  TORCH_CHECK(meta.dim() == 2 && meta.is_contiguous() && meta.scalar_type() == at::kByte,
              "nm kernels: meta must be contiguous uint8 [out, bytes]");
  TORCH_CHECK(meta.size(0) == values.size(0), "nm kernels: values and meta row counts differ");
  TORCH_CHECK(1 <= n && n < m && m <= 8, "nm kernels: need 1 <= n < m <= 8");
  TORCH_CHECK(K % m == 0 && values.size(1) == K / m * n, "nm kernels: values do not match in_features");
  TORCH_CHECK(meta.size(1) * 8 >= values.size(1) * meta_bits(m), "nm kernels: meta is too short");
}

}  // namespace

at::Tensor nm_linear(const at::Tensor& x_in, const at::Tensor& values_in, const at::Tensor& meta_in, int64_t n,
                     int64_t m, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "nm_linear: x must be a CPU tensor [..., in]");
  const at::Tensor x = x_in.contiguous(), values = values_in.contiguous(), meta = meta_in.contiguous();
  const int64_t K = x.size(-1);
  check_common(values, meta, static_cast<int>(n), static_cast<int>(m), K);
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "nm_linear: x and values must share a dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == values.size(0) &&
                    bias->scalar_type() == values.scalar_type(),
                "nm_linear: bias must be contiguous [out] in the values' dtype");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = values.size(0);
  if (K == 0 || x.numel() == 0 || values.size(0) == 0) {  // an empty sum: the bias alone, or zeros
    at::Tensor y = new_zeros(shape, x.options());
    return has_bias ? y.add_(*bias) : y;
  }
  at::Tensor y = new_empty(shape, x.options());
  const int64_t tokens = x.numel() / K;
  switch (x.scalar_type()) {
#define HF_MASKLLM_LINEAR(scalar_t)                                                                    \
  linear_impl<scalar_t>(x.data_ptr<scalar_t>(), tokens, K, values, meta, static_cast<int>(n), static_cast<int>(m), \
                        has_bias ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());      \
  return y;
    case at::kFloat: HF_MASKLLM_LINEAR(float)
    case at::kBFloat16: HF_MASKLLM_LINEAR(c10::BFloat16)
    case at::kHalf: HF_MASKLLM_LINEAR(c10::Half)
#undef HF_MASKLLM_LINEAR
    default: TORCH_CHECK(false, "nm_linear: dtype must be float32, bfloat16 or float16");
  }
}

at::Tensor nm_expand(const at::Tensor& values, const at::Tensor& meta, int64_t n, int64_t m, int64_t in_features,
                     at::Tensor dense) {
  check_common(values, meta, static_cast<int>(n), static_cast<int>(m), in_features);
  TORCH_CHECK(dense.device().is_cpu() && dense.is_contiguous() && dense.scalar_type() == values.scalar_type() && dense.dim() == 2 &&
                  dense.size(0) == values.size(0) && dense.size(1) == in_features,
              "nm_expand: the output must be contiguous [out, in_features] in the values' dtype");
  switch (values.scalar_type()) {
    case at::kFloat: expand_impl<float>(values, meta, n, m, in_features, dense); break;
    case at::kBFloat16: expand_impl<c10::BFloat16>(values, meta, n, m, in_features, dense); break;
    case at::kHalf: expand_impl<c10::Half>(values, meta, n, m, in_features, dense); break;
    default: TORCH_CHECK(false, "nm_expand: dtype must be float32, bfloat16 or float16");
  }
  return dense;
}

// Use at most `level` (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 with BF16); returns the level in use.
int64_t set_isa(int64_t level) {
  TORCH_CHECK(level >= kScalar && level <= kAvx512Bf16, "set_isa: level must be 0 to 3");
  const int isa = std::min<int>(static_cast<int>(level), supported_isa());
  g_isa.store(isa, std::memory_order_relaxed);
  return isa;
}

int64_t isa() { return current_isa(); }
