// Attention for decode steps on CPU, reading only the cache positions the mask lets through:
//
//   decode_attention(query [B, H, T, D], key [B, KVH, L, D], value [B, KVH, L, Dv], mask?, scale)
//     -> out [B, T, H, Dv] in the query's dtype (the layout transformers' attention functions return)
//
// `mask` is boolean (true = attend) and broadcasts to [B, H, T, L]; without one every position is
// attended. A static KV cache is allocated for its longest use and the mask hides the positions not
// yet written, so a step's cost follows the tokens in the cache, not the cache's size: the masked
// positions are skipped 8 at a time by testing the mask's 64-bit words. Query head h reads key / value
// head h / (H / KVH) (grouped-query attention). Scores, softmax and the weighted sum are float32 (scores
// minus their maximum, then exp); a row whose mask lets nothing through gives zeros. Each output row is
// computed by one thread in a fixed order: results do not depend on the thread count.

#include "common.h"

namespace {

// The positions row `mrow` (L booleans, contiguous) lets through, in order.
void unmasked_positions(const bool* mrow, int64_t L, std::vector<int32_t>& out) {
  out.clear();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    uint64_t word;
    std::memcpy(&word, mrow + j, 8);
    if (word == 0) continue;
    for (int i = 0; i < 8; ++i)
      if (mrow[j + i]) out.push_back(static_cast<int32_t>(j + i));
  }
  for (; j < L; ++j)
    if (mrow[j]) out.push_back(static_cast<int32_t>(j));
}

template <typename T>
inline void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// One query row against its keys: scores (scaled dot products), softmax, weighted sum of the values.
// qf float32 [D]; positions: the keys attended (all L where `all`); scores: scratch [L]; acc: [Dv].
template <typename T>
inline void attend_row_generic(const float* qf, const T* kp, int64_t k_row, const T* vp, int64_t v_row, int64_t D,
                               int64_t Dv, const int32_t* pos, int64_t count, float scale, float* scores, float* kf,
                               float* acc) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    load_row(kp + pos[i] * k_row, D, kf);
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += qf[d] * kf[d];
    scores[i] = s * scale;
    mx = std::max(mx, scores[i]);
  }
  for (int64_t d = 0; d < Dv; ++d) acc[d] = 0.f;
  float sum = 0.f;
  for (int64_t i = 0; i < count; ++i) {
    const float p = std::exp(scores[i] - mx);
    sum += p;
    load_row(vp + pos[i] * v_row, Dv, kf);
    for (int64_t d = 0; d < Dv; ++d) acc[d] += p * kf[d];
  }
  const float inv = count ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < Dv; ++d) acc[d] *= inv;
}

#if HF_MASKLLM_X86
// 16 elements of a row in float32.
TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TARGET_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
TARGET_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// attend_row_generic for D and Dv multiples of 16 (at most 256): the same arithmetic in AVX-512, the
// dot products summed over 16 lanes and then across them.
template <typename T>
TARGET_AVX512 void attend_row_avx512(const float* qf, const T* kp, int64_t k_row, const T* vp, int64_t v_row,
                                     int64_t D, int64_t Dv, const int32_t* pos, int64_t count, float scale,
                                     float* scores, float* acc) {
  __m512 q[16];
  const int64_t dq = D / 16, dv = Dv / 16;
  for (int64_t c = 0; c < dq; ++c) q[c] = _mm512_loadu_ps(qf + 16 * c);
  float mx = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const T* k = kp + pos[i] * k_row;
    __m512 s = _mm512_mul_ps(q[0], load16(k));
    for (int64_t c = 1; c < dq; ++c) s = _mm512_fmadd_ps(q[c], load16(k + 16 * c), s);
    scores[i] = _mm512_reduce_add_ps(s) * scale;
    mx = std::max(mx, scores[i]);
  }
  __m512 a[16];
  for (int64_t c = 0; c < dv; ++c) a[c] = _mm512_setzero_ps();
  float sum = 0.f;
  for (int64_t i = 0; i < count; ++i) {
    const float p = std::exp(scores[i] - mx);
    sum += p;
    const __m512 pv = _mm512_set1_ps(p);
    const T* v = vp + pos[i] * v_row;
    for (int64_t c = 0; c < dv; ++c) a[c] = _mm512_fmadd_ps(pv, load16(v + 16 * c), a[c]);
  }
  const __m512 inv = _mm512_set1_ps(count ? 1.f / sum : 0.f);
  for (int64_t c = 0; c < dv; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_mul_ps(a[c], inv));
}
#endif

template <typename T>
void attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& mask, double scale_in, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Tq = query.size(2), D = query.size(3);
  const int64_t KVH = key.size(1), L = key.size(2), Dv = value.size(3), G = H / KVH;
  const float scale = static_cast<float>(scale_in);
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2);
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  // The mask's distinct rows (its own batch, head and query sizes, 1 where it broadcasts), each turned
  // once into the list of positions it lets through.
  const bool has_mask = mask.has_value() && mask->defined();
  int64_t mB = 1, mH = 1, mT = 1;
  std::vector<std::vector<int32_t>> lists;
  std::vector<int32_t> everything;
  if (has_mask) {
    const at::Tensor m = *mask;
    mB = m.size(0), mH = m.size(1), mT = m.size(2);
    const bool* mp = m.data_ptr<bool>();
    lists.resize(mB * mH * mT);
    for (int64_t r = 0; r < mB * mH * mT; ++r) unmasked_positions(mp + r * L, L, lists[r]);
  } else {
    everything.resize(L);
    for (int64_t j = 0; j < L; ++j) everything[j] = static_cast<int32_t>(j);
  }
#if HF_MASKLLM_X86
  const bool vector = isa() >= kAvx512 && D > 0 && Dv > 0 && D % 16 == 0 && Dv % 16 == 0 && D <= 256 && Dv <= 256;
#else
  const bool vector = false;
#endif
  // One task per (batch, head): its Tq query rows. Enough rows per task that a task outweighs the pool.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, Tq * L * (D + Dv)));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), kf(std::max(D, Dv)), acc(Dv), scores(std::max<int64_t>(L, 1));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kvh = h / G;
      const T* kb = kp + b * ks0 + kvh * ks1;
      const T* vb = vp + b * vs0 + kvh * vs1;
      for (int64_t t = 0; t < Tq; ++t) {
        const std::vector<int32_t>& pos =
            has_mask ? lists[((mB == 1 ? 0 : b) * mH + (mH == 1 ? 0 : h)) * mT + (mT == 1 ? 0 : t)] : everything;
        load_row(qp + b * qs0 + h * qs1 + t * qs2, D, qf.data());
        const int64_t count = static_cast<int64_t>(pos.size());
#if HF_MASKLLM_X86
        if (vector) {
          attend_row_avx512<T>(qf.data(), kb, ks2, vb, vs2, D, Dv, pos.data(), count, scale, scores.data(), acc.data());
        } else
#endif
        {
          attend_row_generic<T>(qf.data(), kb, ks2, vb, vs2, D, Dv, pos.data(), count, scale, scores.data(), kf.data(),
                                acc.data());
        }
        T* o = op + ((b * Tq + t) * H + h) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = from_float<T>(acc[d]);
      }
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                            const std::optional<at::Tensor>& mask_in, double scale) {
  TORCH_CHECK(query_in.dim() == 4 && key_in.dim() == 4 && value_in.dim() == 4,
              "decode_attention: query [B, H, T, D], key [B, KVH, L, D] and value [B, KVH, L, Dv] must be 4-d");
  TORCH_CHECK(query_in.device().is_cpu() && key_in.device().is_cpu() && value_in.device().is_cpu(),
              "decode_attention: tensors must be on the CPU");
  TORCH_CHECK(key_in.scalar_type() == query_in.scalar_type() && value_in.scalar_type() == query_in.scalar_type(),
              "decode_attention: query, key and value must share one dtype");
  const int64_t B = query_in.size(0), H = query_in.size(1), Tq = query_in.size(2), D = query_in.size(3);
  const int64_t KVH = key_in.size(1), L = key_in.size(2);
  TORCH_CHECK(key_in.size(0) == B && value_in.size(0) == B && value_in.size(1) == KVH && value_in.size(2) == L &&
                  key_in.size(3) == D,
              "decode_attention: key must be [", B, ", KVH, L, ", D, "] and value [", B, ", KVH, L, Dv]");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "decode_attention: the query heads (", H,
              ") must be a multiple of the key / value heads (", KVH, ")");
  TORCH_CHECK(L < (int64_t{1} << 31), "decode_attention: at most 2^31 - 1 key positions");
  // the last dimension contiguous (the rows are read as vectors); other strides are followed
  const at::Tensor query = query_in.stride(3) == 1 ? query_in : query_in.contiguous();
  const at::Tensor key = key_in.stride(3) == 1 ? key_in : key_in.contiguous();
  const at::Tensor value = value_in.stride(3) == 1 ? value_in : value_in.contiguous();
  std::optional<at::Tensor> mask;
  if (mask_in.has_value() && mask_in->defined()) {
    const at::Tensor& m = *mask_in;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.device().is_cpu(),
                "decode_attention: the mask must be a boolean CPU tensor (true = attend)");
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                    (m.size(2) == 1 || m.size(2) == Tq) && m.size(3) == L,
                "decode_attention: the mask must broadcast to [", B, ", ", H, ", ", Tq, ", ", L, "]");
    mask = m.contiguous();
  }
  const int64_t Dv = value.size(3);
  at::Tensor out = new_empty({B, Tq, H, Dv}, query.options());
  if (out.numel() == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat: attention_impl<float>(query, key, value, mask, scale, out); break;
    case at::kBFloat16: attention_impl<c10::BFloat16>(query, key, value, mask, scale, out); break;
    case at::kHalf: attention_impl<c10::Half>(query, key, value, mask, scale, out); break;
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 tensors");
  }
  return out;
}
