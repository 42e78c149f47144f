// N:M sparse linear on CPU with int8 / int4 kept values (hf_maskllm.sparse.format, version 2).
//
//   qvalues  int8 [out, kept] (8 bits), or uint8 [out, kept / 2] (4 bits: code j in byte j / 2, low
//            nibble for even j, high for odd j, stored as code + 8)
//   scales   float16 [out, kept / group_size]: kept value j of a row is scales[row, j / group_size] * code
//   meta     uint8, as in version 1 (b = ceil(log2 m) bits per kept value, little-endian)
//
// Two entry points, multi-threaded over output rows (each row summed by one thread in a fixed order,
// so results do not depend on the thread count):
//
//   nm_linear_q(x [T, in], qvalues, scales, meta, n, m, bits, group_size, bias?) -> y [T, out]
//     Decode. Four routes, by instruction set and pattern:
//     - AVX-512 with VNNI and VBMI, 2:4, group_size 8, 16, 32 or a multiple of 64: the inputs are
//       quantized once per call to 8 bits, one float32 scale per 32 inputs and token (round to nearest,
//       scale = absmax / 127, as llama.cpp's Q8_0 does for its activations). Per block of 64 kept values
//       (128 inputs): vpmultishiftqb + one ternary-logic op turn 16 meta bytes into 64 byte indices,
//       vpermt2b gathers the 64 inputs they multiply, vpdpbusd sums four byte products per int32 lane,
//       and the lane goes to float32 times (weight scale x input scale). Inputs are stored as
//       u8 = q + 128 (the unsigned operand); the int32 lanes start at -128 * (sum of the lane's codes),
//       computed once per block for all tokens (int4: from the stored nibbles by one vpdpbusd). One token:
//       a thread's rows run one after another in one call with the layout's constants in registers, the
//       scale products formed in a 128-bit register and spread to the lanes by one permute, the rows' sums
//       reduced four at a time in _mm512_reduce_add_ps's order (the same bits as alone); 2-4 tokens: short
//       rows run two side by side.
//     - AVX2 ("avx2_q8", where the route above does not apply), 2:4, group_size 8, 16 or a multiple of 32:
//       the inputs rounded as above. Per step of 32 kept values (64 inputs, 8 meta bytes): the meta becomes
//       32 byte indices (int8, and int4 with group size 8: in order, by vpshufb + a shift, a blend and a
//       16-entry vpshufb table; other int4: by field, one variable shift, an AND and an OR), two vpshufb and
//       a vpblendd gather the inputs (laid out once per call so that each 128-bit lane finds its 32
//       inputs in two registers), vpmaddubsw (|w| by the inputs carrying w's sign) and vpmaddwd sum four
//       products per int32 lane, then float32 times (weight scale x input scale). Codes and meta are
//       prefetched 64 steps ahead.
//     - AVX2 float32 (other group sizes that are multiples of 8), 2:4: the inputs stay in float32; 8 codes
//       are widened, scaled, and meet the inputs picked by two vpermps and a blend in an FMA.
//     - Scalar: any N:M, any group size: exact float32 arithmetic, not fast.
//   nm_expand_q(qvalues, scales, meta, n, m, bits, group_size, in_features, dense [out, in]) -> dense
//     Prefill: the dequantized dense weight (float32, bfloat16 or float16, rounded to nearest even once),
//     then a dense GEMM. 2:4 on AVX-512: 16 codes dequantized per step, placed by vpexpandd / vpexpandw.
//
// The instruction set in use is the one nm_linear.cpp's set_isa chose.

#include "common.h"

namespace {

constexpr int64_t kPairedRowsMaxKept = 512;  // VNNI decode: rows of at most this many kept values run in pairs

#define TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")))

#if HF_MASKLLM_X86
bool cpu_has(const char* what) {
  __builtin_cpu_init();
  if (std::strcmp(what, "vnni") == 0)
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  return __builtin_cpu_supports("avx512vbmi2");
}
bool has_vnni() {
  static const bool has = cpu_has("vnni");
  return has;
}
bool has_vbmi2() {
  static const bool has = cpu_has("vbmi2");
  return has;
}
#else
bool has_vnni() { return false; }
bool has_vbmi2() { return false; }
#endif

// Code of kept value j of a row.
inline int code_at(const uint8_t* q, int64_t j, int bits) {
  if (bits == 8) return static_cast<int8_t>(q[j]);
  const unsigned byte = q[j >> 1];
  return static_cast<int>((j & 1) ? (byte >> 4) : (byte & 15u)) - 8;
}

// Kept value j of a row in float32: exact (an 11-bit scale times a code of at most 8 bits).
inline float dequant(const uint8_t* q, const c10::Half* s, int64_t j, int bits, int64_t gs) {
  return static_cast<float>(s[j / gs]) * static_cast<float>(code_at(q, j, bits));
}

// Which decode route runs for a layer (the instruction set in use, the pattern, the group size).
enum Route : int { kRouteScalar = 0, kRouteAvx2 = 1, kRouteVnni = 2, kRouteAvx2q = 3 };

Route decode_route(int n, int m, int64_t gs) {
  const int level = static_cast<int>(isa());
  if (n != 2 || m != 4 || gs % 8 != 0 || level < kAvx2) return kRouteScalar;
  const bool vnni_gs = gs == 8 || gs == 16 || gs == 32 || gs % 64 == 0;
  if (level >= kAvx512 && has_vnni() && vnni_gs) return kRouteVnni;
  return gs == 8 || gs == 16 || gs % 32 == 0 ? kRouteAvx2q : kRouteAvx2;
}

// ------------------------------------------------------------------------------------------------
// Scalar route: any N:M, any group size; x in float32 [T, K].
void row_scalar_q(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row, int64_t kept, int n, int m,
                  int b, int bits, int64_t gs, const float* xf, int64_t K, int64_t tokens, float* acc) {
  for (int64_t t = 0; t < tokens; ++t) acc[t] = 0.f;
  for (int64_t j = 0; j < kept; ++j) {
    const int pos = read_position(meta_row, j, b);
    if (pos >= m) continue;  // corrupt meta (checkpoints are validated on load): never read outside the row
    const int64_t col = (j / n) * m + pos;
    const float w = dequant(q, s, j, bits, gs);
    for (int64_t t = 0; t < tokens; ++t) acc[t] += w * xf[t * K + col];
  }
}

#if HF_MASKLLM_X86
// ------------------------------------------------------------------------------------------------
// AVX2 route, 2:4, float32 inputs [T, Kp]: 8 kept values (4 groups, 16 inputs, 2 meta bytes) per step.
TARGET_AVX2 inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int TB, int BITS>
TARGET_AVX2 void row24q_avx2(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row, int64_t kept,
                             int64_t gs, const float* xf, int64_t Kp, float* acc_out) {
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i base = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
  const __m256i nibble_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  for (int64_t j = 0; j < kept; j += 8) {  // kept is a multiple of gs, itself a multiple of 8
    __m256i codes;
    if constexpr (BITS == 8) {
      codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
      _mm_prefetch(reinterpret_cast<const char*>(q + j) + kPrefetchBytes, _MM_HINT_T0);
    } else {
      uint32_t word;
      std::memcpy(&word, q + j / 2, 4);
      codes = _mm256_sub_epi32(
          _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), nibble_shifts),
                           _mm256_set1_epi32(15)),
          _mm256_set1_epi32(8));
    }
    uint16_t scale_bits;
    std::memcpy(&scale_bits, s + j / gs, 2);
    const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(_cvtsh_ss(scale_bits)));
    uint16_t mw;
    std::memcpy(&mw, meta_row + j / 4, 2);
    const __m256i idx = _mm256_add_epi32(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(mw), shifts), _mm256_set1_epi32(3)), base);
    const __m256 from_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 of the index
    const float* x = xf + 2 * j;
    for (int t = 0; t < TB; ++t) {
      const float* xr = x + t * Kp;
      const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xr), idx);
      const __m256 c = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xr + 8), idx);
      acc[t] = _mm256_fmadd_ps(w, _mm256_blendv_ps(a, c, from_hi), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = hsum8(acc[t]);
}

// ------------------------------------------------------------------------------------------------
// AVX2 route with 8-bit inputs, 2:4: 32 kept values (64 inputs, 8 meta bytes) per step, in one of two orders
// within the register:
//
//   kInOrder:  byte k = kept value k: bytes 0-15 (128-bit lane 0) kept 0-15, inputs 0-31; bytes 16-31 kept
//              16-31, inputs 32-63. int32 lane d holds kept values 4d .. 4d + 3.
//   kByField:  byte 8f + i (qword f, byte i) = kept value 4i + f, the field f of meta byte i: lane 0 (fields 0,
//              1) holds the kept values of the step's even groups of 4 inputs, lane 1 those of its odd groups.
//              int32 lane d holds kept values 4i + d / 2 for i = 4 (d % 2) .. + 3, all within kept values
//              16 (d % 2) .. + 15 and inputs 32 (d % 2) .. + 31. The meta decodes in four instructions (no
//              vpshufb), and int4 codes unpack with one vpshufb: int4 with group size 16 or a multiple of 32.
//
// Inputs per token (quantize32_s8, one scale per 32 inputs): xl int8 [T, Kp], each 64 inputs stored so that
// one 32-byte load gives each lane its first 16 candidate inputs and the next load its last 16 (vpshufb looks
// up within a 128-bit lane): kInOrder [0-15 | 32-47 | 16-31 | 48-63]; kByField [groups 0, 2, 4, 6 | 1, 3, 5, 7 |
// 8, 10, 12, 14 | 9, 11, 13, 15] (4 inputs each). xsl float32 [T, Kp / 64, 8]: each int32 lane's input scale,
// kInOrder (s0 x 4, s1 x 4), kByField (s0, s1) x 4, where s0 scales inputs 0-31 and s1 inputs 32-63.
enum Avx2qOrder : int { kInOrder = 0, kByField = 1 };

template <int ORDER>
TARGET_AVX2 void quantize_inputs_avx2(const float* xf, int64_t tokens, int64_t K, int64_t Kp, int8_t* xl, float* xsl) {
  alignas(32) int8_t codes[64];
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c0 = 0; c0 < Kp; c0 += 64) {
      const float s0 = quantize32_s8(xf + t * K + c0, K - c0, codes);
      const float s1 = quantize32_s8(xf + t * K + c0 + 32, K - c0 - 32, codes + 32);
      int8_t* dst = xl + t * Kp + c0;
      float* sc = xsl + t * (Kp / 8) + c0 / 8;
      if constexpr (ORDER == kInOrder) {
        std::memcpy(dst, codes, 16);
        std::memcpy(dst + 16, codes + 32, 16);
        std::memcpy(dst + 32, codes + 16, 16);
        std::memcpy(dst + 48, codes + 48, 16);
        for (int l = 0; l < 8; ++l) sc[l] = l < 4 ? s0 : s1;
      } else {
        for (int slot = 0; slot < 16; ++slot) {  // 4 bytes of dst each: one group's inputs
          const int lane = (slot / 4) % 2, half = slot / 8;
          const int group = 8 * half + 2 * (slot % 4) + lane;
          std::memcpy(dst + 4 * slot, codes + 4 * group, 4);
        }
        for (int l = 0; l < 8; ++l) sc[l] = l % 2 ? s1 : s0;
      }
    }
  }
}

// The constants of both orders (see avx2q_indices and avx2q_codes).
struct Avx2qLayout {
  __m256i rep, hi_sel, field, lut, base;  // kInOrder
  __m256i base_f, pick_f;                 // kByField: 4 x the group within the lane's 16 inputs; int4 byte picks
  TARGET_AVX2 Avx2qLayout() {
    alignas(32) int8_t r[32], h[32], f[32], lu[32], b[32], bf[32], pf[32];
    for (int k = 0; k < 32; ++k) {
      r[k] = static_cast<int8_t>(k / 4);  // the meta byte of kept value k (within the lane's copy of the 8)
      h[k] = static_cast<int8_t>(k % 4 >= 2 ? 0x80 : 0);  // fields 2, 3: from the high nibble
      f[k] = static_cast<int8_t>(k % 2 ? 0x0C : 0x03);    // the field's two bits within the nibble
      lu[k] = static_cast<int8_t>((k % 16) < 4 ? (k % 16) : (k % 16) >> 2);  // {0..3} or {0, 4, 8, 12} -> 0..3
      b[k] = static_cast<int8_t>(4 * ((k % 8) / 2));  // 4 x the group within the lane's 16 inputs
      bf[k] = static_cast<int8_t>(4 * (k % 4));       // byte 8f + i: group 2i + f / 2, its 4 inputs at 4 (i % 4)
      pf[k] = static_cast<int8_t>(2 * (k % 8) + k / 16);  // lane 0: packed bytes 2i, lane 1: 2i + 1
    }
    rep = _mm256_load_si256(reinterpret_cast<const __m256i*>(r));
    hi_sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
    field = _mm256_load_si256(reinterpret_cast<const __m256i*>(f));
    lut = _mm256_load_si256(reinterpret_cast<const __m256i*>(lu));
    base = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
    base_f = _mm256_load_si256(reinterpret_cast<const __m256i*>(bf));
    pick_f = _mm256_load_si256(reinterpret_cast<const __m256i*>(pf));
  }
};

// The codes of 32 kept values in ORDER (q: their codes; int4: 16 bytes, low nibble first).
template <int BITS, int ORDER>
TARGET_AVX2 inline __m256i avx2q_codes(const uint8_t* q, const Avx2qLayout& L) {
  const __m256i low = _mm256_set1_epi8(15);
  if constexpr (BITS == 8) {
    static_assert(ORDER == kInOrder, "int8 codes are read in order");
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  } else if constexpr (ORDER == kInOrder) {
    // qwords [0, 0, 1, 1]: each lane's low 8 bytes are its 16 codes, interleaved low / high nibble by vpunpcklbw
    const __m256i p =
        _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 0x50);
    const __m256i n = _mm256_unpacklo_epi8(_mm256_and_si256(p, low), _mm256_and_si256(_mm256_srli_epi16(p, 4), low));
    return _mm256_sub_epi8(n, _mm256_set1_epi8(8));
  } else {
    // kept 4i + f sits in packed byte 2i + f / 2, nibble f % 2: qword f gets the even (lane 0) or odd (lane 1)
    // packed bytes, and qwords 1 and 3 shift by 4 to their high nibbles
    const __m256i p =
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), L.pick_f);
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi64(p, _mm256_setr_epi64x(0, 4, 0, 4)), low);
    return _mm256_sub_epi8(n, _mm256_set1_epi8(8));
  }
}

// The 32 byte indices (within each lane's 16 candidate inputs, plus 16 for the second load's) of a step's kept
// values in ORDER, from its 8 meta bytes.
template <int ORDER>
TARGET_AVX2 inline __m256i avx2q_indices(const uint8_t* meta, const Avx2qLayout& L) {
  long long mw;
  std::memcpy(&mw, meta, 8);
  if constexpr (ORDER == kInOrder) {
    // kept value k's meta byte (k / 4) to byte k, its two bits (the nibble by a shift, the field by a mask,
    // then a 16-entry table), plus 4 x its group
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi64x(mw), L.rep);
    const __m256i nib = _mm256_blendv_epi8(rep, _mm256_srli_epi16(rep, 4), L.hi_sel);
    return _mm256_or_si256(_mm256_shuffle_epi8(L.lut, _mm256_and_si256(nib, L.field)), L.base);
  } else {
    // qword f shifted right by 2f: byte i holds field f of meta byte i in its low two bits
    const __m256i fields = _mm256_srlv_epi64(_mm256_set1_epi64x(mw), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_or_si256(_mm256_and_si256(fields, _mm256_set1_epi8(3)), L.base_f);
  }
}

// TB tokens' float32 accumulators, carried by value (the compiler keeps them in registers).
template <int TB>
struct Avx2qAcc {
  __m256 v[TB];
};

// One step (32 kept values, in ORDER) against TB tokens: `aw` = |codes|, `w` the codes, idx their inputs'
// byte indices, sw the weight scale of each int32 lane, xl / xsl the step's inputs and scales.
template <int TB, int ORDER>
TARGET_AVX2 inline Avx2qAcc<TB> avx2q_step(Avx2qAcc<TB> acc, const __m256i aw, const __m256i w, const __m256i idx,
                                           const __m256 sw, const int8_t* xl, const float* xsl, int64_t Kp,
                                           int64_t xs_stride) {
  // the second load's inputs: kInOrder kept 8-15 and 24-31 (dwords 2, 3, 6, 7), kByField bytes 4-7 of each qword
  constexpr int kSecond = ORDER == kInOrder ? 0xCC : 0xAA;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < TB; ++t) {
    const int8_t* x = xl + t * Kp;
    const __m256i g = _mm256_blend_epi32(
        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), idx),
        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)), idx), kSecond);
    // |w| x (g with w's sign): 2 x 128 x 127 at most per 16-bit pair, no saturation
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(g, w)), ones);
    acc.v[t] =
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_loadu_ps(xsl + t * xs_stride)), acc.v[t]);
  }
  return acc;
}

// The weight scales of a step's 8 int32 lanes in ORDER (s: the step's first scale; GS 8, 16, or 0 for a
// multiple of 32; kByField takes 16 or 0).
template <int GS, int ORDER>
TARGET_AVX2 inline __m256 avx2q_scales(const c10::Half* s) {
  if constexpr (GS == 0) {
    short h;
    std::memcpy(&h, s, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
  } else if constexpr (GS == 16) {
    uint32_t two;
    std::memcpy(&two, s, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
    const __m256i lanes = ORDER == kInOrder ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
                                            : _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), lanes);
  } else {
    static_assert(ORDER == kInOrder, "group size 8 takes the in-order layout");
    const __m128 f = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
}

// One step of a row: its codes (BITS), meta and scales (GS) decoded in ORDER, against TB tokens' inputs.
template <int TB, int BITS, int GS, int ORDER>
TARGET_AVX2 inline Avx2qAcc<TB> avx2q_row_step(Avx2qAcc<TB> acc, const uint8_t* codes, const uint8_t* meta,
                                               const c10::Half* scales, const int8_t* xl, const float* xsl, int64_t Kp,
                                               const Avx2qLayout& layout) {
  const __m256i w = avx2q_codes<BITS, ORDER>(codes, layout);
  return avx2q_step<TB, ORDER>(acc, _mm256_abs_epi8(w), w, avx2q_indices<ORDER>(meta, layout),
                               avx2q_scales<GS, ORDER>(scales), xl, xsl, Kp, Kp / 8);
}

// How many steps ahead of the one it reads a row pass prefetches its codes and meta (from the next rows near the
// row's end): 64 steps of 2-3 ns cover a read from memory.
constexpr int64_t kAvx2qPrefetchSteps = 64;

// One row against TB tokens (kept: a multiple of 8; the last step may hold fewer than 32 kept values: its codes,
// meta and scales are read through zero-filled copies, and zero codes add nothing). Even and odd steps add into
// two sets of accumulators (two chains of FMAs, carried by value: held in registers), summed at the end; the
// step's scales advance by a pointer (no division per step). Inlined into its callers, which loop over rows.
template <int TB, int BITS, int GS, int ORDER>
TARGET_AVX2 __attribute__((always_inline)) inline void row24q_avx2q(const uint8_t* q, const c10::Half* s,
                                                                    const uint8_t* meta_row, int64_t kept, int64_t gs,
                                                                    const int8_t* xl, const float* xsl, int64_t Kp,
                                                                    const Avx2qLayout& layout, float* acc_out) {
  Avx2qAcc<TB> even, odd;
  for (int t = 0; t < TB; ++t) even.v[t] = odd.v[t] = _mm256_setzero_ps();
  constexpr int64_t kBytes = BITS * 4;  // code bytes per step
  const int64_t full = kept / 32;
  // GS 0 (a multiple of 32): one scale per steps_per_scale steps; GS 8, 16: 32 / GS scales per step
  const int64_t steps_per_scale = GS == 0 ? gs / 32 : 1;
  const c10::Half* sc = s;  // the current step's first scale
  int64_t left = steps_per_scale;
  const auto next_scale = [&]() TARGET_AVX2 {
    if constexpr (GS == 0) {
      if (--left == 0) {
        ++sc;
        left = steps_per_scale;
      }
    } else {
      sc += 32 / GS;
    }
  };
  int64_t st = 0;
  for (; st + 2 <= full; st += 2) {
    // one line of int8 codes per two steps (int4: half a line), a quarter line of meta
    _mm_prefetch(reinterpret_cast<const char*>(q + (st + kAvx2qPrefetchSteps) * kBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(meta_row + 8 * (st + kAvx2qPrefetchSteps)), _MM_HINT_T0);
    even = avx2q_row_step<TB, BITS, GS, ORDER>(even, q + st * kBytes, meta_row + 8 * st, sc, xl + 64 * st,
                                               xsl + 8 * st, Kp, layout);
    next_scale();
    odd = avx2q_row_step<TB, BITS, GS, ORDER>(odd, q + (st + 1) * kBytes, meta_row + 8 * (st + 1), sc,
                                              xl + 64 * (st + 1), xsl + 8 * (st + 1), Kp, layout);
    next_scale();
  }
  if (st < full) {
    even = avx2q_row_step<TB, BITS, GS, ORDER>(even, q + st * kBytes, meta_row + 8 * st, sc, xl + 64 * st,
                                               xsl + 8 * st, Kp, layout);
    next_scale();
  }
  const int64_t rest = kept - 32 * full;
  if (rest) {
    alignas(32) uint8_t qt[32], mt[8] = {};
    std::memset(qt, BITS == 4 ? 0x88 : 0, sizeof(qt));  // int4: two codes 0 per byte
    c10::Half st_scales[4] = {};
    std::memcpy(qt, q + full * kBytes, rest * BITS / 8);
    std::memcpy(mt, meta_row + 8 * full, rest / 4);
    std::memcpy(st_scales, sc, (GS == 0 ? 1 : rest / GS) * sizeof(c10::Half));
    Avx2qAcc<TB>& acc = full % 2 ? odd : even;
    acc = avx2q_row_step<TB, BITS, GS, ORDER>(acc, qt, mt, st_scales, xl + 64 * full, xsl + 8 * full, Kp, layout);
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = hsum8(_mm256_add_ps(even.v[t], odd.v[t]));
}

// One row against TB tokens (passes of several tokens: one call per row and up to 4 tokens).
template <int TB, int BITS, int GS, int ORDER>
TARGET_AVX2 void rows24q_avx2q(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row, int64_t kept,
                               int64_t gs, const int8_t* xl, const float* xsl, int64_t Kp, float* acc_out) {
  static const Avx2qLayout layout;
  row24q_avx2q<TB, BITS, GS, ORDER>(q, s, meta_row, kept, gs, xl, xsl, Kp, layout, acc_out);
}

// One token, `rows` consecutive rows one after another in one call (no call per row, the layout's constants
// loaded once), each summed as alone (the same bits as rows24q_avx2q): sums[0, rows).
template <int BITS, int GS, int ORDER>
TARGET_AVX2 void range24q_avx2q(const uint8_t* q, int64_t q_stride, const c10::Half* s, int64_t s_stride,
                                const uint8_t* meta, int64_t meta_stride, int64_t rows, int64_t kept, int64_t gs,
                                const int8_t* xl, const float* xsl, int64_t Kp, float* sums) {
  static const Avx2qLayout layout;
  const Avx2qLayout local = layout;
  for (int64_t r = 0; r < rows; ++r)
    row24q_avx2q<1, BITS, GS, ORDER>(q + r * q_stride, s + r * s_stride, meta + r * meta_stride, kept, gs, xl, xsl, Kp,
                                     local, sums + r);
}

// f(GS, ORDER) for an avx2_q8 layer: GS 8, 16, or 0 for a multiple of 32; ORDER by field for int4 with group size
// 16 or a multiple of 32 (fewer shuffles), in order otherwise (int8 codes load in order; group size 8 would put
// two groups in a by-field int32 lane).
template <typename F>
void with_avx2q_layout(int bits, int64_t gs, F&& f) {
  if (gs == 8) f(std::integral_constant<int, 8>{}, std::integral_constant<int, kInOrder>{});
  else if (gs == 16 && bits == 4) f(std::integral_constant<int, 16>{}, std::integral_constant<int, kByField>{});
  else if (gs == 16) f(std::integral_constant<int, 16>{}, std::integral_constant<int, kInOrder>{});
  else if (bits == 4) f(std::integral_constant<int, 0>{}, std::integral_constant<int, kByField>{});
  else f(std::integral_constant<int, 0>{}, std::integral_constant<int, kInOrder>{});
}

// ------------------------------------------------------------------------------------------------
// VNNI route, 2:4: 64 kept values (128 inputs, 16 meta bytes) per block.
//
// Byte layout of a block in a register (lane L = 64-bit lane, byte j of it):
//   8 bits: byte k = kept value k (k = 8L + j), input index 4 * (k / 2) + p_k; int32 lane l holds
//           kept values 4l..4l+3 (inputs 8l..8l+7).
//   4 bits: bytes 0-31 the low nibbles (kept 2i, i = byte), bytes 32-63 the high nibbles (kept 2i + 1,
//           i = byte - 32), both at input 4i + p; int32 lane l holds kept values 8 (l % 8) .. + 7 (even
//           ones for l < 8, odd ones above; inputs 16 (l % 8) .. + 15).
// Either way an int32 lane never straddles a group of 8 kept values, nor a block of 32 inputs.
struct VnniLayout {
  alignas(64) uint8_t ctrl[64];   // vpmultishiftqb: bit offset of each byte's position in its meta qword
  alignas(64) uint8_t base[64];   // 4 * group of each byte
  alignas(64) int32_t xblock[16]; // input block (of 32) of each int32 lane, within the 128 inputs
  alignas(64) int32_t kept0[16];  // first kept value (within the 64) of each int32 lane
  explicit VnniLayout(int bits) {
    for (int L = 0; L < 8; ++L) {
      for (int j = 0; j < 8; ++j) {
        if (bits == 8) {
          const int k = 8 * L + j;
          ctrl[8 * L + j] = static_cast<uint8_t>((2 * k) % 64);
          base[8 * L + j] = static_cast<uint8_t>(4 * (k / 2));
        } else {
          const int i = 8 * (L % 4) + j, half = L / 4;
          ctrl[8 * L + j] = static_cast<uint8_t>((4 * i + 2 * half) % 64);
          base[8 * L + j] = static_cast<uint8_t>(4 * i);
        }
      }
    }
    for (int l = 0; l < 16; ++l) {
      xblock[l] = bits == 8 ? l / 4 : (l % 8) / 2;
      kept0[l] = bits == 8 ? 4 * l : 8 * (l % 8);
    }
  }
};
const VnniLayout kLayout8(8), kLayout4(4);
// vpermb table: index bits 0-3 hold an int4 code + 8, bits 4-5 are ignored
struct NibbleCodes {
  alignas(64) int8_t v[64];
  NibbleCodes() {
    for (int i = 0; i < 64; ++i) v[i] = static_cast<int8_t>((i & 15) - 8);
  }
};
const NibbleCodes kNibbleCodesTable;
const int8_t* const kNibbleCodes = kNibbleCodesTable.v;

// Inputs quantized per token and 32 inputs (quantize32_u8): xu uint8 [T, Kp] (code + 128), xs float32
// [T, Kp / 128, 16] (per block of 128 inputs, the scale of each int32 lane's inputs, in the layout's lane order;
// the multi-token passes read it, null for one token), xs4 float32 [T, Kp / 32] (the same scales, one per 32
// inputs, in input order; the one-token pass reads it).
TARGET_VNNI void quantize_inputs(const float* xf, int64_t tokens, int64_t K, int64_t Kp, const VnniLayout& layout,
                                 uint8_t* xu, float* xs, float* xs4) {
  const int64_t blocks = Kp / 128;
  std::memset(xu, 128, tokens * Kp);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xr = xf + t * K;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      float* sc = xs4 + (t * blocks + blk) * 4;
      for (int sub = 0; sub < 4; ++sub) {
        const int64_t c0 = 128 * blk + 32 * sub;
        sc[sub] = quantize32_u8(xr + c0, std::max<int64_t>(0, std::min<int64_t>(32, K - c0)), xu + t * Kp + c0);
      }
      if (xs == nullptr) continue;
      float* dst = xs + (t * blocks + blk) * 16;
      for (int l = 0; l < 16; ++l) dst[l] = sc[layout.xblock[l]];
    }
  }
}

// The codes of one block of 64 kept values as signed bytes (q: the block's codes), and in `start` the int32
// lanes' start, -128 * (sum of the lane's codes), so that (x + 128) . w sums to x . w. The row's last block
// may hold only `rest` (a multiple of 8) kept values (TAIL): masked loads then read no byte past the row, and
// the codes beyond it are zero.
template <int BITS, bool TAIL>
TARGET_VNNI inline __m512i codes24q(const uint8_t* q, int64_t rest, const __m512i nibble_codes, __m512i& start) {
  const __m512i minus128 = _mm512_set1_epi8(static_cast<char>(0x80));
  if constexpr (BITS == 8) {
    const __m512i w = TAIL ? _mm512_maskz_loadu_epi8((1ull << rest) - 1, q) : _mm512_loadu_si512(q);
    start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), minus128, w));
    return w;
  } else {
    // both halves read the 32 packed bytes; the upper half shifted right by 4 (high nibbles to bits 0-3);
    // vpermb maps index bits 0-5 (the nibble and two bits above it) to nibble - 8. In the last block the
    // bytes past `rest` kept values read as 0x88: two codes 0.
    const __m512i both = _mm512_broadcast_i64x4(
        TAIL ? _mm256_mask_loadu_epi8(_mm256_set1_epi8(static_cast<char>(0x88)), (1u << (rest / 2)) - 1, q)
             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512i shifted = _mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4);
    const __m512i w = _mm512_permutexvar_epi8(shifted, nibble_codes);
    // from the stored nibbles n = code + 8: -128 * sum(n - 8) = 4096 - 128 * sum(n) over a lane's four codes
    // (the same int32s; an AND where the sum of the codes would need a subtraction)
    const __m512i n = _mm512_and_si512(shifted, _mm512_set1_epi8(15));
    start = _mm512_dpbusd_epi32(_mm512_set1_epi32(4096), n, minus128);
    return w;
  }
}

// The 64 input byte indices (within the block's 128 inputs) of a block's kept values, from its 16 meta bytes:
// each 64-bit lane gets its meta qword by a permute, vpmultishiftqb moves each value's position bits to its
// byte, and one ternary-logic op makes (position bits & 3) | 4 * group (0xEA = (A & B) | C).
template <int BITS, bool TAIL>
TARGET_VNNI inline __m512i indices24(const uint8_t* meta, int64_t rest, const __m512i ctrl, const __m512i base) {
  const __mmask8 lanes1 = BITS == 8 ? 0xF0 : 0xCC;  // the lanes that read the second meta qword
  const __m128i mm = TAIL ? _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (rest / 4)) - 1), meta)
                          : _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta));
  const __m512i words = _mm512_permutexvar_epi64(
      lanes1 == 0xF0 ? _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1) : _mm512_setr_epi64(0, 0, 1, 1, 0, 0, 1, 1),
      _mm512_castsi128_si512(mm));
  return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(ctrl, words), _mm512_set1_epi8(3), base, 0xEA);
}

// One block of 64 kept values against TB tokens. q: the block's codes, meta: its 16 meta bytes, s: the
// row's float16 scales. The row's last block may hold only `rest` (a multiple of 8) kept values
// (TAIL): masked loads then read no byte past the row, and the codes beyond it are zero.
template <int TB, int BITS, bool TAIL>
TARGET_VNNI inline void block24q_vnni(__m512* acc, const uint8_t* q, const uint8_t* meta, const c10::Half* s,
                                      int64_t blk, int64_t rest, int64_t gs, int gs_shift, const __m512i scale_lane,
                                      const uint8_t* x, const float* xsb, int64_t Kp, int64_t xs_stride) {
  const VnniLayout& layout = BITS == 8 ? kLayout8 : kLayout4;
  __m512i start;
  const __m512i w = codes24q<BITS, TAIL>(q, rest, _mm512_load_si512(kNibbleCodes), start);
  const __m512i idx =
      indices24<BITS, TAIL>(meta, rest, _mm512_load_si512(layout.ctrl), _mm512_load_si512(layout.base));
  // ---- weight scale of each int32 lane
  // (straight from the float16 scales: a float32 copy on the stack would be stored and read back at once,
  // a load the store cannot forward)
  // (gs_shift: log2 of the group size below 64, where it is a power of two; -1 for a multiple of 64)
  __m512 sw;
  if (gs_shift < 0) {
    uint16_t h;
    std::memcpy(&h, s + 64 * blk / gs, 2);
    sw = _mm512_set1_ps(_cvtsh_ss(h));
  } else {  // the block's 64 / gs scales (rest / gs in the last block), one per lane by scale_lane
    const __mmask8 k = static_cast<__mmask8>((1u << ((TAIL ? rest : 64) >> gs_shift)) - 1);
    const __m256 f = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, s + ((64 * blk) >> gs_shift)));
    sw = _mm512_permutexvar_ps(scale_lane, _mm512_castps256_ps512(f));
  }
  // ---- per token: gather 64 input bytes, 64 byte products into 16 int32 lanes, scale, accumulate
  for (int t = 0; t < TB; ++t) {
    const uint8_t* xr = x + t * Kp;
    const __m512i g = _mm512_permutex2var_epi8(_mm512_loadu_si512(xr), idx, _mm512_loadu_si512(xr + 64));
    const __m512i dot = _mm512_dpbusd_epi32(start, g, w);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_loadu_ps(xsb + t * xs_stride)), acc[t]);
  }
}

// R consecutive rows (q, s, meta advance by their strides) against TB tokens: each row's 16-lane float32 sums
// into acc[i][t]. Two rows side by side give the core two independent chains where a row holds few blocks
// (several tokens); each row's arithmetic is the same as alone.
template <int TB, int BITS, int R>
TARGET_VNNI inline void lanes24q_vnni(const uint8_t* q, int64_t q_stride, const c10::Half* s, int64_t s_stride,
                                      const uint8_t* meta_row, int64_t meta_stride, int64_t kept, int64_t gs,
                                      const uint8_t* xu, const float* xs, int64_t Kp, __m512 (&acc)[R][TB]) {
  const VnniLayout& layout = BITS == 8 ? kLayout8 : kLayout4;
  // int32 lane -> the lane's group within the block's scales (group sizes 8, 16, 32)
  const __m512i scale_lane =
      _mm512_srli_epi32(_mm512_load_si512(layout.kept0), __builtin_ctzll(gs < 64 ? gs : 64));
  const int64_t xs_stride = Kp / 128 * 16;
  const int gs_shift = gs < 64 ? __builtin_ctzll(gs) : -1;  // the route takes 8, 16, 32 or multiples of 64
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < TB; ++t) acc[i][t] = _mm512_setzero_ps();
  const int64_t full = kept / 64;
  constexpr int64_t kBytes = BITS * 8;                  // code bytes per block
  constexpr int64_t kPrefetchBlocks = BITS == 8 ? 48 : 32;  // codes and meta prefetched this many blocks ahead
  for (int64_t blk = 0; blk < full; ++blk) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* qi = q + i * q_stride + blk * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(qi) + kPrefetchBlocks * kBytes, _MM_HINT_T0);  // 3 / 1 KiB ahead
      _mm_prefetch(reinterpret_cast<const char*>(meta_row + i * meta_stride + 16 * blk) + kPrefetchBlocks * 16, _MM_HINT_T0);
      block24q_vnni<TB, BITS, false>(acc[i], qi, meta_row + i * meta_stride + 16 * blk, s + i * s_stride, blk, 64, gs, gs_shift,
                                     scale_lane, xu + 128 * blk, xs + 16 * blk, Kp, xs_stride);
    }
  }
  const int64_t rest = kept - 64 * full;  // a multiple of 8
  if (rest) {
    for (int i = 0; i < R; ++i) {
      block24q_vnni<TB, BITS, true>(acc[i], q + i * q_stride + full * kBytes, meta_row + i * meta_stride + 16 * full,
                                    s + i * s_stride, full, rest, gs, gs_shift, scale_lane, xu + 128 * full, xs + 16 * full, Kp,
                                    xs_stride);
    }
  }
}

// R rows against TB tokens, summed: acc_out[i * kMaxTokenBlock + t].
template <int TB, int BITS, int R>
TARGET_VNNI void rows24q_vnni(const uint8_t* q, int64_t q_stride, const c10::Half* s, int64_t s_stride,
                              const uint8_t* meta_row, int64_t meta_stride, int64_t kept, int64_t gs,
                              const uint8_t* xu, const float* xs, int64_t Kp, float* acc_out) {
  __m512 acc[R][TB];
  lanes24q_vnni<TB, BITS, R>(q, q_stride, s, s_stride, meta_row, meta_stride, kept, gs, xu, xs, Kp, acc);
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < TB; ++t) acc_out[i * kMaxTokenBlock + t] = _mm512_reduce_add_ps(acc[i][t]);
}

// The sums of four float32 vectors, each summed in _mm512_reduce_add_ps's order (lane i plus lane i + 8, then
// + 4, + 2, + 1): a row's sum has the same bits whether it was reduced alone or as one of four.
TARGET_VNNI inline __m128 reduce_add4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0xEE), _mm512_shuffle_f32x4(a0, a1, 0x44));
  const __m512 b23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0xEE), _mm512_shuffle_f32x4(a2, a3, 0x44));
  // b01: vector 0's 8 sums, then vector 1's (b23: 2, 3); 128-bit lane k of c: vector k's first 4 + its last 4
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b01, b23, 0xDD), _mm512_shuffle_f32x4(b01, b23, 0x88));
  const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0xB1));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), e));
}

// One token's weight x input scale of each int32 lane in a block: the block's weight scales (s: the row's,
// GS: the group size, 0 for a multiple of 64) times its four input scales (xs4), as 4 (8 for GS 8) products
// in a small register, spread to the 16 lanes by `lane` (BITS 4: lane l holds kept values 8 (l % 8) .. + 7,
// inputs 16 (l % 8) .. + 15; BITS 8: kept 4l .. 4l + 3, inputs 8l .. 8l + 7). The same float32 products as
// the lane-wise ones of block24q_vnni. TAIL: only `rest` kept values, so only their scales are read.
template <int GS, bool TAIL>
TARGET_VNNI inline __m512 scales24_one(const c10::Half* s, int64_t blk, int64_t rest, int64_t gs, const float* xs4,
                                       const __m512i lane) {
  const __m128 sx = _mm_loadu_ps(xs4);
  __m256 p;
  if constexpr (GS == 0) {  // one weight scale: sw * sx[k]
    uint16_t h;
    std::memcpy(&h, s + 64 * blk / gs, 2);
    p = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(_cvtsh_ss(h)), sx));
  } else {
    constexpr int kScales = 64 / GS;
    const c10::Half* sb = s + kScales * blk;
    __m128i h;
    if constexpr (TAIL) {
      h = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << (rest / GS)) - 1), sb);
    } else if constexpr (GS == 32) {
      int32_t two;
      std::memcpy(&two, sb, 4);
      h = _mm_cvtsi32_si128(two);
    } else if constexpr (GS == 16) {
      h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb));
    } else {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb));
    }
    if constexpr (GS == 32) {  // sw[k / 2] * sx[k]
      const __m128 f = _mm_cvtph_ps(h);
      p = _mm256_castps128_ps256(_mm_mul_ps(_mm_unpacklo_ps(f, f), sx));
    } else if constexpr (GS == 16) {  // sw[k] * sx[k]
      p = _mm256_castps128_ps256(_mm_mul_ps(_mm_cvtph_ps(h), sx));
    } else {  // GS 8: sw[j] * sx[j / 2]
      const __m256 sx2 = _mm256_permutexvar_ps(_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_castps128_ps256(sx));
      p = _mm256_mul_ps(_mm256_cvtph_ps(h), sx2);
    }
  }
  return _mm512_permutexvar_ps(lane, _mm512_castps256_ps512(p));
}

// Which product of scales24_one each int32 lane takes.
template <int BITS, int GS>
TARGET_VNNI inline __m512i scale_lanes_one() {
  alignas(64) int32_t v[16];
  for (int l = 0; l < 16; ++l) {
    const int k = BITS == 8 ? l / 4 : (l % 8) / 2;  // the lane's input scale (32 inputs)
    v[l] = GS == 8 ? (BITS == 8 ? l / 2 : l % 8) : k;
  }
  return _mm512_load_si512(v);
}

// One block of 64 kept values (block `blk` of a row: q its codes, meta its meta bytes, s the row's scales)
// against one token, added to acc.
template <int BITS, int GS, bool TAIL>
TARGET_VNNI inline void block24q_one(__m512& acc, const uint8_t* q, const uint8_t* meta, const c10::Half* s,
                                     int64_t blk, int64_t rest, int64_t gs, const uint8_t* xu, const float* xs4,
                                     const __m512i nibble_codes, const __m512i ctrl, const __m512i base,
                                     const __m512i lane) {
  __m512i start;
  const __m512i w = codes24q<BITS, TAIL>(q, rest, nibble_codes, start);
  const __m512i idx = indices24<BITS, TAIL>(meta, rest, ctrl, base);
  const __m512 sc = scales24_one<GS, TAIL>(s, blk, rest, gs, xs4 + 4 * blk, lane);
  const uint8_t* x = xu + 128 * blk;
  const __m512i g = _mm512_permutex2var_epi8(_mm512_loadu_si512(x), idx, _mm512_loadu_si512(x + 64));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, g, w)), sc, acc);
}

// One token, `rows` consecutive rows one after another in one call (a single stream through the weights, no
// per-row call; the layout's constants stay in registers): each row's blocks summed in order as block24q_vnni
// sums them for one token (the same bits), the sums reduced four rows at a time into sums[0, rows). GS: the
// group size (8, 16, 32), 0 for a multiple of 64. PARTIAL: the rows end in a partial block (kept % 64 != 0);
// a pass of its own, because with that block's code in the loop the compiler copied the layout's constants
// between registers on every block.
template <int BITS, int GS, bool PARTIAL>
TARGET_VNNI void range24q_vnni(const uint8_t* q, int64_t q_stride, const c10::Half* s, int64_t s_stride,
                               const uint8_t* meta, int64_t meta_stride, int64_t rows, int64_t kept, int64_t gs,
                               const uint8_t* xu, const float* xs4, float* sums) {
  const VnniLayout& layout = BITS == 8 ? kLayout8 : kLayout4;
  const __m512i nibble_codes = _mm512_load_si512(kNibbleCodes), ctrl = _mm512_load_si512(layout.ctrl),
                base = _mm512_load_si512(layout.base), lane = scale_lanes_one<BITS, GS>();
  const int64_t full = kept / 64, rest = kept - 64 * full;  // rest: a multiple of 8
  constexpr int64_t kBytes = BITS * 8;                       // code bytes per block
  constexpr int64_t kPrefetchBlocks = BITS == 8 ? 48 : 32;   // codes and meta prefetched this many blocks ahead
  __m512 done[4];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* qr = q + r * q_stride;
    const uint8_t* mr = meta + r * meta_stride;
    const c10::Half* sr = s + r * s_stride;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < full; ++blk) {
      const uint8_t* qb = qr + blk * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(qb) + kPrefetchBlocks * kBytes, _MM_HINT_T0);  // 3 / 1 KiB ahead
      _mm_prefetch(reinterpret_cast<const char*>(mr + 16 * blk) + kPrefetchBlocks * 16, _MM_HINT_T0);
      block24q_one<BITS, GS, false>(acc, qb, mr + 16 * blk, sr, blk, rest, gs, xu, xs4, nibble_codes, ctrl, base, lane);
    }
    if constexpr (PARTIAL)
      block24q_one<BITS, GS, true>(acc, qr + full * kBytes, mr + 16 * full, sr, full, rest, gs, xu, xs4, nibble_codes,
                                   ctrl, base, lane);
    done[r & 3] = acc;
    if ((r & 3) == 3) _mm_storeu_ps(sums + r - 3, reduce_add4(done[0], done[1], done[2], done[3]));
  }
  for (int64_t r = rows & ~int64_t{3}; r < rows; ++r) sums[r] = _mm512_reduce_add_ps(done[r & 3]);
}

// f(std::integral_constant<int, GS>) for a VNNI route group size (8, 16, 32; 0 for a multiple of 64).
template <typename F>
void with_vnni_group(int64_t gs, F&& f) {
  if (gs == 8) f(std::integral_constant<int, 8>{});
  else if (gs == 16) f(std::integral_constant<int, 16>{});
  else if (gs == 32) f(std::integral_constant<int, 32>{});
  else f(std::integral_constant<int, 0>{});
}
#endif  // HF_MASKLLM_X86

template <typename T>
void linear_q_impl(const T* xp, int64_t tokens, int64_t K, const at::Tensor& qvalues, const at::Tensor& scales,
                   const at::Tensor& meta, int n, int m, int bits, int64_t gs, const T* bp, T* yp) {
  const int64_t out = qvalues.size(0), kept = K / m * n;
  const int64_t q_stride = qvalues.size(1), s_stride = scales.size(1), meta_stride = meta.size(1);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qvalues.data_ptr());
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  const Route route = decode_route(n, m, gs);
  // x in float32 [T, K] (every route starts from it)
  std::vector<float> xf_buf;
  const float* xf;
  if constexpr (std::is_same<T, float>::value) {
    xf = xp;
  } else {
    xf_buf.resize(tokens * K);
    for (int64_t i = 0; i < tokens * K; ++i) xf_buf[i] = to_float(xp[i]);
    xf = xf_buf.data();
  }
  // Route inputs: AVX2 float32 [T, Kp] zero-padded; VNNI bytes + scales. The extra 64 / 32 columns keep
  // the tokens' rows out of one another's L1 sets.
  int64_t Kp = K;
  std::vector<float> xpad;
  std::vector<uint8_t> xu;
  std::vector<int8_t> xl;
  std::vector<float> xs, xs4;
#if HF_MASKLLM_X86
  if (route == kRouteAvx2q) {
    Kp = round_up(K, 64) + 64;
    xl.resize(tokens * Kp);
    xs.resize(tokens * (Kp / 8));
    with_avx2q_layout(bits, gs, [&](auto, auto order) {
      quantize_inputs_avx2<decltype(order)::value>(xf, tokens, K, Kp, xl.data(), xs.data());
    });
  } else if (route == kRouteVnni) {
    Kp = round_up(K, 128) + 64;
    xu.resize(tokens * Kp);
    if (tokens > 1) xs.resize(tokens * (Kp / 128) * 16);
    xs4.resize(tokens * (Kp / 32));
    quantize_inputs(xf, tokens, K, Kp, bits == 8 ? kLayout8 : kLayout4, xu.data(), tokens > 1 ? xs.data() : nullptr,
                    xs4.data());
  } else if (route == kRouteAvx2) {
    Kp = round_up(K, 16) + 32;
    xpad.assign(tokens * Kp, 0.f);
    for (int64_t t = 0; t < tokens; ++t) std::memcpy(&xpad[t * Kp], xf + t * K, K * sizeof(float));
  }
#endif
  const int b = meta_bits(m);
  const int64_t block = route == kRouteVnni ? kMaxTokenBlock : kAvx2TokenBlock;
  at::parallel_for(0, out, row_grain(q_stride), [&](int64_t begin, int64_t end) {
#if HF_MASKLLM_X86
    if (route == kRouteVnni && tokens == 1) {  // decode of one token: the thread's rows in one pass
      constexpr int64_t kChunk = 256;
      float sums[kChunk];
      for (int64_t r0 = begin; r0 < end; r0 += kChunk) {
        const int64_t rows = std::min<int64_t>(kChunk, end - r0);
        with_vnni_group(gs, [&](auto group) {
          constexpr int GS = decltype(group)::value;
          const auto pass = [&](auto bits_c, auto partial) {
            range24q_vnni<decltype(bits_c)::value, GS, decltype(partial)::value>(
                qp + r0 * q_stride, q_stride, sp + r0 * s_stride, s_stride, mp + r0 * meta_stride, meta_stride, rows,
                kept, gs, xu.data(), xs4.data(), sums);
          };
          const bool partial = kept % 64 != 0;
          if (bits == 8)
            partial ? pass(std::integral_constant<int, 8>{}, std::true_type{})
                    : pass(std::integral_constant<int, 8>{}, std::false_type{});
          else
            partial ? pass(std::integral_constant<int, 4>{}, std::true_type{})
                    : pass(std::integral_constant<int, 4>{}, std::false_type{});
        });
        for (int64_t i = 0; i < rows; ++i) yp[r0 + i] = from_float<T>(sums[i] + (bp ? to_float(bp[r0 + i]) : 0.f));
      }
      return;
    }
    if (route == kRouteAvx2q && tokens == 1) {  // decode of one token: the thread's rows in one pass
      constexpr int64_t kChunk = 256;
      float sums[kChunk];
      for (int64_t r0 = begin; r0 < end; r0 += kChunk) {
        const int64_t rows = std::min<int64_t>(kChunk, end - r0);
        with_avx2q_layout(bits, gs, [&](auto group, auto order) {
          constexpr int GS = decltype(group)::value, ORDER = decltype(order)::value;
          const auto pass = [&](auto bits_c) {
            range24q_avx2q<decltype(bits_c)::value, GS, ORDER>(qp + r0 * q_stride, q_stride, sp + r0 * s_stride,
                                                               s_stride, mp + r0 * meta_stride, meta_stride, rows,
                                                               kept, gs, xl.data(), xs.data(), Kp, sums);
          };
          if (bits == 4) pass(std::integral_constant<int, 4>{});
          else if constexpr (ORDER == kInOrder) pass(std::integral_constant<int, 8>{});
        });
        for (int64_t i = 0; i < rows; ++i) yp[r0 + i] = from_float<T>(sums[i] + (bp ? to_float(bp[r0 + i]) : 0.f));
      }
      return;
    }
#endif
    float acc[2 * kMaxTokenBlock];
    std::vector<float> acc_all;
    if (route == kRouteScalar) acc_all.resize(tokens);
    for (int64_t r = begin; r < end;) {
      const uint8_t* q = qp + r * q_stride;
      const c10::Half* s = sp + r * s_stride;
      const uint8_t* meta_row = mp + r * meta_stride;
      if (route == kRouteScalar) {
        const float bias_r = bp ? to_float(bp[r]) : 0.f;
        row_scalar_q(q, s, meta_row, kept, n, m, b, bits, gs, xf, K, tokens, acc_all.data());
        for (int64_t t = 0; t < tokens; ++t) yp[t * out + r] = from_float<T>(acc_all[t] + bias_r);
        ++r;
        continue;
      }
      // VNNI, 2 to 4 tokens (one token took the pass above), short rows: two rows at a time
      const int64_t rows = route == kRouteVnni && tokens <= 4 && kept <= kPairedRowsMaxKept && r + 1 < end ? 2 : 1;
      for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        const int64_t tb = std::min<int64_t>(block, tokens - t0);
#if HF_MASKLLM_X86
        with_token_block(tb, [&](auto tokens_in_pass) {
          constexpr int TB = decltype(tokens_in_pass)::value;
          if (route == kRouteVnni) {
            const uint8_t* xr = xu.data() + t0 * Kp;
            const float* xsr = xs.data() + t0 * (Kp / 128) * 16;
            if constexpr (TB >= 2 && TB <= 4) {  // a pass of one token here is a tail of 9+ tokens: one row
              if (rows == 2) {
                if (bits == 8)
                  rows24q_vnni<TB, 8, 2>(q, q_stride, s, s_stride, meta_row, meta_stride, kept, gs, xr, xsr, Kp, acc);
                else
                  rows24q_vnni<TB, 4, 2>(q, q_stride, s, s_stride, meta_row, meta_stride, kept, gs, xr, xsr, Kp, acc);
                return;
              }
            }
            if (bits == 8)
              rows24q_vnni<TB, 8, 1>(q, q_stride, s, s_stride, meta_row, meta_stride, kept, gs, xr, xsr, Kp, acc);
            else
              rows24q_vnni<TB, 4, 1>(q, q_stride, s, s_stride, meta_row, meta_stride, kept, gs, xr, xsr, Kp, acc);
          } else if (route == kRouteAvx2q) {
            if constexpr (TB <= kAvx2TokenBlock) {
              const int8_t* xr = xl.data() + t0 * Kp;
              const float* xsr = xs.data() + t0 * (Kp / 8);
              with_avx2q_layout(bits, gs, [&](auto group, auto order) {
                constexpr int GS = decltype(group)::value, ORDER = decltype(order)::value;
                if (bits == 8) {
                  if constexpr (ORDER == kInOrder) rows24q_avx2q<TB, 8, GS, ORDER>(q, s, meta_row, kept, gs, xr, xsr, Kp, acc);
                } else {
                  rows24q_avx2q<TB, 4, GS, ORDER>(q, s, meta_row, kept, gs, xr, xsr, Kp, acc);
                }
              });
            }
          } else if constexpr (TB <= kAvx2TokenBlock) {
            const float* xr = xpad.data() + t0 * Kp;
            if (bits == 8) row24q_avx2<TB, 8>(q, s, meta_row, kept, gs, xr, Kp, acc);
            else row24q_avx2<TB, 4>(q, s, meta_row, kept, gs, xr, Kp, acc);
          }
        });
#endif
        for (int64_t i = 0; i < rows; ++i) {
          const float bias_r = bp ? to_float(bp[r + i]) : 0.f;
          for (int64_t t = 0; t < tb; ++t)
            yp[(t0 + t) * out + r + i] = from_float<T>(acc[i * kMaxTokenBlock + t] + bias_r);
        }
      }
      r += rows;
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Expansion: the dequantized dense weight.

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
void expand_row_scalar_q(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row, int64_t kept, int n, int m,
                         int b, int bits, int64_t gs, int64_t K, T* dst) {
  std::memset(static_cast<void*>(dst), 0, K * sizeof(T));
  for (int64_t j = 0; j < kept; ++j) {
    const int pos = read_position(meta_row, j, b);
    if (pos < m) dst[(j / n) * m + pos] = from_float<T>(dequant(q, s, j, bits, gs));
  }
}

#if HF_MASKLLM_X86
// 16 kept values from kept value j on (8 when `half`), dequantized to float32 (group size a multiple of 8).
template <int BITS>
TARGET_AVX512 inline __m512 dequant16(const uint8_t* q, const c10::Half* s, int64_t j, int64_t gs, bool half) {
  __m512i codes;
  if constexpr (BITS == 8) {
    codes = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(half ? 0xFF : 0xFFFF, q + j));
  } else {
    const __m128i packed = _mm_maskz_loadu_epi8(half ? 0x0F : 0xFF, q + j / 2);
    const __m512i dup = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(packed, packed));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    codes = _mm512_sub_epi32(_mm512_and_si512(_mm512_srlv_epi32(dup, shifts), _mm512_set1_epi32(15)),
                             _mm512_set1_epi32(8));
  }
  uint16_t s0, s1;
  std::memcpy(&s0, s + j / gs, 2);
  std::memcpy(&s1, s + (half ? j : j + 8) / gs, 2);
  const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(s0)), _mm256_set1_ps(_cvtsh_ss(s1)), 1);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(codes), sv);
}

template <int BITS>
TARGET_AVX512 void expand_row24q_f32(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row, int64_t kept,
                                     int64_t gs, float* dst) {
  for (int64_t j = 0; j < kept; j += 16) {
    const bool half = kept - j < 16;
    const __m512 v = dequant16<BITS>(q, s, j, gs, half);
    const uint8_t* mb = meta_row + j / 4;
    const __mmask16 k0 = static_cast<__mmask16>(kKeep.bits[mb[0]] | (kKeep.bits[mb[1]] << 8));
    _mm512_storeu_ps(dst + 2 * j, _mm512_maskz_expand_ps(k0, v));
    if (half) break;
    const __mmask16 k1 = static_cast<__mmask16>(kKeep.bits[mb[2]] | (kKeep.bits[mb[3]] << 8));
    _mm512_storeu_ps(dst + 2 * j + 16, _mm512_maskz_expand_ps(k1, _mm512_castps256_ps512(_mm512_extractf32x8_ps(v, 1))));
  }
}

// float32 -> 16-bit lanes, rounded to nearest even (finite values)
template <typename T>
TARGET_AVX512 inline __m256i to16(__m512 v) {
  if constexpr (std::is_same<T, c10::Half>::value) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  }
}

template <int BITS, typename T>
TARGET_AVX512_VBMI2 void expand_row24q_16(const uint8_t* q, const c10::Half* s, const uint8_t* meta_row,
                                          int64_t kept, int64_t gs, T* dst) {
  for (int64_t j = 0; j < kept; j += 16) {
    const bool half = kept - j < 16;
    const __m512i v = _mm512_castsi256_si512(to16<T>(dequant16<BITS>(q, s, j, gs, half)));
    const uint8_t* mb = meta_row + j / 4;
    __mmask32 keep = static_cast<__mmask32>(kKeep.bits[mb[0]]) | (static_cast<__mmask32>(kKeep.bits[mb[1]]) << 8);
    if (!half) {
      keep |= (static_cast<__mmask32>(kKeep.bits[mb[2]]) << 16) | (static_cast<__mmask32>(kKeep.bits[mb[3]]) << 24);
    }
    _mm512_mask_storeu_epi16(dst + 2 * j, half ? 0xFFFFu : 0xFFFFFFFFu, _mm512_maskz_expand_epi16(keep, v));
  }
}
#endif  // HF_MASKLLM_X86

template <typename T>
void expand_q_impl(const at::Tensor& qvalues, const at::Tensor& scales, const at::Tensor& meta, int n, int m,
                   int bits, int64_t gs, int64_t K, at::Tensor& dense) {
  const int64_t out = qvalues.size(0), kept = K / m * n;
  const int64_t q_stride = qvalues.size(1), s_stride = scales.size(1), meta_stride = meta.size(1);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qvalues.data_ptr());
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  const uint8_t* mp = meta.data_ptr<uint8_t>();
  T* dp = dense.data_ptr<T>();
  const bool vec24 = n == 2 && m == 4 && gs % 8 == 0 && isa() >= kAvx512 && (sizeof(T) == 4 || has_vbmi2());
  const int b = meta_bits(m);
  at::parallel_for(0, out, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* q = qp + r * q_stride;
      const c10::Half* s = sp + r * s_stride;
      const uint8_t* meta_row = mp + r * meta_stride;
      T* dst = dp + r * K;
      if (!vec24) {
        expand_row_scalar_q<T>(q, s, meta_row, kept, n, m, b, bits, gs, K, dst);
        continue;
      }
#if HF_MASKLLM_X86
      if constexpr (sizeof(T) == 4) {
        if (bits == 8) expand_row24q_f32<8>(q, s, meta_row, kept, gs, dst);
        else expand_row24q_f32<4>(q, s, meta_row, kept, gs, dst);
      } else {
        if (bits == 8) expand_row24q_16<8, T>(q, s, meta_row, kept, gs, dst);
        else expand_row24q_16<4, T>(q, s, meta_row, kept, gs, dst);
      }
#endif
    }
  });
}

void check_q(const at::Tensor& qvalues, const at::Tensor& scales, const at::Tensor& meta, int64_t n, int64_t m,
             int64_t bits, int64_t gs, int64_t K) {
  TORCH_CHECK(qvalues.device().is_cpu() && scales.device().is_cpu() && meta.device().is_cpu(),
              "nm quantized kernels: tensors must be on the CPU");
  TORCH_CHECK(bits == 8 || bits == 4, "nm quantized kernels: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(1 <= n && n < m && m <= 8, "nm quantized kernels: need 1 <= n < m <= 8");
  TORCH_CHECK(K % m == 0, "nm quantized kernels: in_features ", K, " is not a multiple of m = ", m);
  const int64_t out = qvalues.size(0), kept = K / m * n;
  TORCH_CHECK(gs >= 1 && kept % gs == 0 && (bits == 8 || gs % 2 == 0),
              "nm quantized kernels: group_size ", gs, " must divide the ", kept, " kept values of a row",
              bits == 4 ? " and be even" : "");
  TORCH_CHECK(qvalues.dim() == 2 && qvalues.is_contiguous() &&
                  qvalues.scalar_type() == (bits == 8 ? at::kChar : at::kByte) &&
                  qvalues.size(1) == (bits == 8 ? kept : kept / 2),
              "nm quantized kernels: qvalues must be contiguous ", bits == 8 ? "int8 [out, " : "uint8 [out, ",
              bits == 8 ? kept : kept / 2, "] for in_features ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.size(0) == out && scales.size(1) == kept / gs,
              "nm quantized kernels: scales must be contiguous float16 [out, ", kept / gs, "]");
  TORCH_CHECK(meta.dim() == 2 && meta.is_contiguous() && meta.scalar_type() == at::kByte && meta.size(0) == out &&
                  meta.size(1) * 8 >= kept * meta_bits(static_cast<int>(m)),
              "nm quantized kernels: meta must be contiguous uint8 [out, >= ",
              (kept * meta_bits(static_cast<int>(m)) + 7) / 8, "]");
}

}  // namespace

at::Tensor nm_linear_q(const at::Tensor& x_in, const at::Tensor& qvalues, const at::Tensor& scales,
                       const at::Tensor& meta, int64_t n, int64_t m, int64_t bits, int64_t group_size,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "nm_linear_q: x must be a CPU tensor [..., in]");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1);
  check_q(qvalues, scales, meta, n, m, bits, group_size, K);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == qvalues.size(0) &&
                    bias->scalar_type() == x.scalar_type(),
                "nm_linear_q: bias must be contiguous [out] in x's dtype");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = qvalues.size(0);
  if (K == 0 || x.numel() == 0 || qvalues.size(0) == 0) {
    at::Tensor y = new_zeros(shape, x.options());
    return has_bias ? y.add_(*bias) : y;
  }
  at::Tensor y = new_empty(shape, x.options());
  const int64_t tokens = x.numel() / K;
  switch (x.scalar_type()) {
#define HF_MASKLLM_LINEAR_Q(scalar_t)                                                                     \
  linear_q_impl<scalar_t>(x.data_ptr<scalar_t>(), tokens, K, qvalues, scales, meta, static_cast<int>(n),  \
                          static_cast<int>(m), static_cast<int>(bits), group_size,                        \
                          has_bias ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());       \
  return y;
    case at::kFloat: HF_MASKLLM_LINEAR_Q(float)
    case at::kBFloat16: HF_MASKLLM_LINEAR_Q(c10::BFloat16)
    case at::kHalf: HF_MASKLLM_LINEAR_Q(c10::Half)
#undef HF_MASKLLM_LINEAR_Q
    default: TORCH_CHECK(false, "nm_linear_q: x must be float32, bfloat16 or float16");
  }
}

at::Tensor nm_expand_q(const at::Tensor& qvalues, const at::Tensor& scales, const at::Tensor& meta, int64_t n,
                       int64_t m, int64_t bits, int64_t group_size, int64_t in_features, at::Tensor dense) {
  check_q(qvalues, scales, meta, n, m, bits, group_size, in_features);
  TORCH_CHECK(dense.device().is_cpu() && dense.is_contiguous() && dense.dim() == 2 &&
                  dense.size(0) == qvalues.size(0) && dense.size(1) == in_features,
              "nm_expand_q: the output must be contiguous [out, in_features]");
  switch (dense.scalar_type()) {
    case at::kFloat: expand_q_impl<float>(qvalues, scales, meta, n, m, bits, group_size, in_features, dense); break;
    case at::kBFloat16:
      expand_q_impl<c10::BFloat16>(qvalues, scales, meta, n, m, bits, group_size, in_features, dense);
      break;
    case at::kHalf: expand_q_impl<c10::Half>(qvalues, scales, meta, n, m, bits, group_size, in_features, dense); break;
    default: TORCH_CHECK(false, "nm_expand_q: the output must be float32, bfloat16 or float16");
  }
  return dense;
}

std::string nm_linear_q_route(int64_t n, int64_t m, int64_t group_size) {
  switch (decode_route(static_cast<int>(n), static_cast<int>(m), group_size)) {
    case kRouteVnni: return "vnni";
    case kRouteAvx2: return "avx2";
    case kRouteAvx2q: return "avx2_q8";
    default: return "scalar";
  }
}
