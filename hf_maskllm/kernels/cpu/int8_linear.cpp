// Dense int8 linear on CPU, for a layer kept dense but stored as 8-bit codes (the output embedding):
//
//   qweight int8 [out, in]  codes in [-127, 127]
//   scales  float16 [out]   row r of the weight is scales[r] * qweight[r]
//
//   int8_linear(x [T, in], qweight, scales, bias?) -> y [T, out] in x's dtype (decode, small batches)
//
// Routes, by instruction set (nm_linear.cpp's set_isa):
// - AVX-512 with VNNI: the inputs are rounded once per call to 8-bit codes, one float32 scale per 32
//   inputs and token (absmax / 127, round to nearest), stored as u8 = code + 128. Per 64 inputs: one
//   vpdpbusd per token sums four byte products into each of 16 int32 lanes, starting from -128 x the
//   sum of the lane's weight codes (computed once per block), then float32 times the input scale.
// - AVX2: the inputs are rounded the same way, stored as signed codes. Per 32 inputs: vpmaddubsw multiplies
//   |w| (unsigned) by the input codes carrying w's sign (vpsignb) and sums pairs into 16-bit lanes (at most
//   2 x 128 x 127, no saturation), vpmaddwd sums those into 8 int32 lanes, then float32 times the block's
//   input scale, one FMA per token.
// - Scalar: exact float32 arithmetic.
// Each row is summed by one thread in a fixed order: results do not depend on the thread count.

#include "common.h"

namespace {

#define TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

#if HF_MASKLLM_X86
bool has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512vnni"));
  }();
  return has;
}
#else
bool has_vnni() { return false; }
#endif

enum Route : int { kRouteScalar = 0, kRouteAvx2 = 1, kRouteVnni = 2 };

Route int8_route() {
  const int level = static_cast<int>(isa());
  if (level >= kAvx512 && has_vnni()) return kRouteVnni;
  return level >= kAvx2 ? kRouteAvx2 : kRouteScalar;
}

void row_scalar(const int8_t* q, const float* xf, int64_t K, int64_t tokens, float* acc) {
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(q[k]) * xf[t * K + k];
    acc[t] = sum;
  }
}

#if HF_MASKLLM_X86
TARGET_AVX2 inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Inputs per token and 32 inputs (quantize32_s8): xc int8 [T, Kp] (codes, zeros past K; Kp a multiple of 32),
// xs float32 [T, Kp / 32] (the scale of each 32 inputs).
TARGET_AVX2 void quantize_inputs_avx2(const float* xf, int64_t tokens, int64_t K, int64_t Kp, int8_t* xc, float* xs) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c0 = 0; c0 < Kp; c0 += 32)
      xs[t * (Kp / 32) + c0 / 32] = quantize32_s8(xf + t * K + c0, K - c0, xc + t * Kp + c0);
}

// One step of 32 codes against TB tokens' inputs, into acc.
template <int TB>
TARGET_AVX2 inline void step_avx2q(__m256* acc, const __m256i w, const int8_t* xc, const float* xs, int64_t Kp,
                                   int64_t k) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i aw = _mm256_abs_epi8(w);
  for (int t = 0; t < TB; ++t) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + t * Kp + k));
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(xs + t * (Kp / 32) + k / 32), acc[t]);
  }
}

// One row against TB tokens: even and odd steps of 32 codes add into two sets of accumulators (two chains of
// FMAs, held in registers), summed at the end; the row's tail reads zero codes past it.
template <int TB>
TARGET_AVX2 void row_avx2q(const int8_t* q, int64_t K, const int8_t* xc, const float* xs, int64_t Kp,
                           float* acc_out) {
  __m256 even[TB], odd[TB];
  for (int t = 0; t < TB; ++t) even[t] = odd[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    step_avx2q<TB>(even, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)), xc, xs, Kp, k);
    step_avx2q<TB>(odd, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k + 32)), xc, xs, Kp, k + 32);
  }
  for (; k < K; k += 32) {  // at most two steps, the last one possibly partial
    alignas(32) int8_t tail[32] = {};
    std::memcpy(tail, q + k, std::min<int64_t>(32, K - k));
    const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
    if ((k >> 5) & 1) step_avx2q<TB>(odd, w, xc, xs, Kp, k);
    else step_avx2q<TB>(even, w, xc, xs, Kp, k);
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = hsum8(_mm256_add_ps(even[t], odd[t]));
}

// Inputs per token and 32 inputs (quantize32_u8): xu uint8 [T, Kp] (code + 128), xs float32 [T, Kp / 64, 16]
// (the scale of each int32 lane's four inputs: lanes 0-7 the first 32 of a block of 64, lanes 8-15 the second).
void quantize_inputs(const float* xf, int64_t tokens, int64_t K, int64_t Kp, uint8_t* xu, float* xs) {
  std::memset(xu, 128, tokens * Kp);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c0 = 0; c0 < Kp; c0 += 32) {
      const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, K - c0));
      const float scale = quantize32_u8(xf + t * K + c0, cnt, xu + t * Kp + c0);
      float* dst = xs + t * (Kp / 64) * 16 + (c0 / 64) * 16 + ((c0 / 32) % 2) * 8;
      for (int l = 0; l < 8; ++l) dst[l] = scale;
    }
  }
}

template <int TB>
TARGET_VNNI void row_vnni(const int8_t* q, int64_t K, const uint8_t* xu, const float* xs, int64_t Kp,
                          float* acc_out) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t xs_stride = Kp / 64 * 16;
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ull : (1ull << (K - k)) - 1;  // zero codes past the row
    // no software prefetch: the rows are one sequential stream the hardware prefetcher follows, and a
    // prefetch per 64 codes only took load slots (slower, most of all with the weights on huge pages)
    const __m512i w = _mm512_maskz_loadu_epi8(mask, q + k);
    const __m512i start =
        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w));
    for (int t = 0; t < TB; ++t) {
      const __m512i dot = _mm512_dpbusd_epi32(start, _mm512_loadu_si512(xu + t * Kp + k), w);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(xs + t * xs_stride + k / 4), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) acc_out[t] = _mm512_reduce_add_ps(acc[t]);
}
#endif  // HF_MASKLLM_X86

template <typename T>
void int8_linear_impl(const T* xp, int64_t tokens, int64_t K, const int8_t* qp, const c10::Half* sp, int64_t out,
                      const T* bp, T* yp) {
  const Route route = int8_route();
  std::vector<float> xf_buf;
  const float* xf;
  if constexpr (std::is_same<T, float>::value) {
    xf = xp;
  } else {
    xf_buf.resize(tokens * K);
    for (int64_t i = 0; i < tokens * K; ++i) xf_buf[i] = to_float(xp[i]);
    xf = xf_buf.data();
  }
  int64_t Kp = K;
  std::vector<float> xs;
  std::vector<uint8_t> xu;
  std::vector<int8_t> xc;
#if HF_MASKLLM_X86
  if (route == kRouteVnni) {  // 64 more columns keep the tokens' rows out of one another's L1 sets
    Kp = round_up(K, 64) + 64;
    xu.resize(tokens * Kp);
    xs.resize(tokens * (Kp / 64) * 16);
    quantize_inputs(xf, tokens, K, Kp, xu.data(), xs.data());
  } else if (route == kRouteAvx2) {
    Kp = round_up(K, 32) + 64;
    xc.resize(tokens * Kp);
    xs.resize(tokens * (Kp / 32));
    quantize_inputs_avx2(xf, tokens, K, Kp, xc.data(), xs.data());
  }
#endif
  const int64_t block = route == kRouteVnni ? kMaxTokenBlock : kAvx2TokenBlock;
  at::parallel_for(0, out, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    float acc[kMaxTokenBlock];
    std::vector<float> acc_all;
    if (route == kRouteScalar) acc_all.resize(tokens);
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* q = qp + r * K;
      const float scale = static_cast<float>(sp[r]);
      const float bias_r = bp ? to_float(bp[r]) : 0.f;
      if (route == kRouteScalar) {
        row_scalar(q, xf, K, tokens, acc_all.data());
        for (int64_t t = 0; t < tokens; ++t) yp[t * out + r] = static_cast<T>(acc_all[t] * scale + bias_r);
        continue;
      }
      for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        const int64_t tb = std::min<int64_t>(block, tokens - t0);
#if HF_MASKLLM_X86
        with_token_block(tb, [&](auto tokens_in_pass) {
          constexpr int TB = decltype(tokens_in_pass)::value;
          if (route == kRouteVnni) {
            row_vnni<TB>(q, K, xu.data() + t0 * Kp, xs.data() + t0 * (Kp / 64) * 16, Kp, acc);
          } else if constexpr (TB <= kAvx2TokenBlock) {
            row_avx2q<TB>(q, K, xc.data() + t0 * Kp, xs.data() + t0 * (Kp / 32), Kp, acc);
          }
        });
#endif
        for (int64_t t = 0; t < tb; ++t) yp[(t0 + t) * out + r] = static_cast<T>(acc[t] * scale + bias_r);
      }
    }
  });
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.device().is_cpu(), "int8_linear: x must be a CPU tensor [..., in]");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1);
  TORCH_CHECK(qweight.device().is_cpu() && scales.device().is_cpu(), "int8_linear: tensors must be on the CPU");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar &&
                  qweight.size(1) == K,
              "int8_linear: qweight must be contiguous int8 [out, ", K, "] (x's last dimension)");
  const int64_t out = qweight.size(0);
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.size(0) == out,
              "int8_linear: scales must be contiguous float16 [", out, "]");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == out &&
                    bias->scalar_type() == x.scalar_type(),
                "int8_linear: bias must be contiguous [out] in x's dtype");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  if (K == 0 || x.numel() == 0 || out == 0) {
    at::Tensor y = new_zeros(shape, x.options());
    return has_bias ? y.add_(*bias) : y;
  }
  at::Tensor y = new_empty(shape, x.options());
  const int64_t tokens = x.numel() / K;
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  switch (x.scalar_type()) {
#define HF_MASKLLM_INT8(scalar_t)                                                                          \
  int8_linear_impl<scalar_t>(x.data_ptr<scalar_t>(), tokens, K, qp, sp, out,                               \
                             has_bias ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());     \
  return y;
    case at::kFloat: HF_MASKLLM_INT8(float)
    case at::kBFloat16: HF_MASKLLM_INT8(c10::BFloat16)
    case at::kHalf: HF_MASKLLM_INT8(c10::Half)
#undef HF_MASKLLM_INT8
    default: TORCH_CHECK(false, "int8_linear: x must be float32, bfloat16 or float16");
  }
}

std::string int8_linear_route() {
  switch (int8_route()) {
    case kRouteVnni: return "vnni";
    case kRouteAvx2: return "avx2_q8";
    default: return "scalar";
  }
}
