// Quantized linear layers for x86 CPUs with AVX2 + FMA + F16C (no AVX-512, no VNNI needed).
//
// y[B, N] = x[B, K] @ W[N, K]^T (+ bias), W stored per 32-value block along K (ggml's blocks):
//   int8: q int8 [N, K],          d f16 [N, K/32]            w = d * q            (ggml Q8_0)
//   int4: q u8   [N, K/2],        d, m f16 [N, K/32]         w = d * q + m        (ggml Q4_1)
//         byte j of a block holds value j in its low nibble and value j + 16 in its high one.
// The activations are quantized per row and block to int8 (d_x = max|x| / 127), as llama.cpp does
// (its Q8_0 / Q8_1), and each block's dot product is an integer one: _mm256_maddubs_epi16 (u8 x s8
// -> pairs of s16) then _mm256_madd_epi16 (-> s32). Output rows are split over ATen's intra-op
// threads (at::parallel_for). Both layouts slice by output rows, and by input columns at multiples
// of 32 (tensor parallelism).
//
// Built by kernels/cpu_quant.py (g++ -O3 -mavx2 -mfma -mf16c), registered as torch.ops.weir_quant.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t QK = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

// x [B, K] -> xq int8 [B, K], xd [B, K/32] (the block's scale), xs [B, K/32] (xd * sum of the block's q).
void quantize_rows(const float* x, int64_t B, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = K / QK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, B * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* p = x + (i / nb) * K + (i % nb) * QK;
      __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
      __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.0f;
      const __m256 id = _mm256_set1_ps(d > 0.0f ? 127.0f / amax : 0.0f);
      constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), round));
      __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), round));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), round));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), round));
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      xd[i] = d;
      xs[i] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
      i0 = _mm256_packs_epi32(i0, i1);
      i2 = _mm256_packs_epi32(i2, i3);
      i0 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i0, i2), perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + (i / nb) * K + (i % nb) * QK), i0);
    }
  });
}

struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, nb;
};

// R output rows x T activation rows of y, from row n and activation row b.
template <int R, int T>
inline void q8_tile(const int8_t* w, const uint16_t* wd, const Acts& a, int64_t n, int64_t b, float* y,
                    int64_t N, const float* bias) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.nb; ++j) {
    __m256i xv[T];
    float xd[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (b + t) * a.K + j * QK));
      xd[t] = a.d[(b + t) * a.nb + j];
    }
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + r) * a.K + j * QK));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      const float d = f16(wd[(n + r) * a.nb + j]);
      for (int t = 0; t < T; ++t) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], wv)), ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[t]), _mm256_cvtepi32_ps(p), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[(b + t) * N + n + r] = hsum(acc[r][t]) + (bias ? bias[n + r] : 0.0f);
}

template <int R, int T>
inline void q4_tile(const uint8_t* w, const uint16_t* wd, const uint16_t* wm, const Acts& a, int64_t n, int64_t b,
                    float* y, int64_t N, const float* bias) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][T];
  float mins[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps(), mins[r][t] = 0.0f;
  const int64_t row_bytes = a.K / 2;
  for (int64_t j = 0; j < a.nb; ++j) {
    __m256i xv[T];
    float xd[T], xs[T];
    for (int t = 0; t < T; ++t) {
      xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (b + t) * a.K + j * QK));
      xd[t] = a.d[(b + t) * a.nb + j];
      xs[t] = a.s[(b + t) * a.nb + j];
    }
    for (int r = 0; r < R; ++r) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * row_bytes + j * 16));
      const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
      const float d = f16(wd[(n + r) * a.nb + j]);
      const float m = f16(wm[(n + r) * a.nb + j]);
      for (int t = 0; t < T; ++t) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv[t]), ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[t]), _mm256_cvtepi32_ps(p), acc[r][t]);
        mins[r][t] += m * xs[t];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      y[(b + t) * N + n + r] = hsum(acc[r][t]) + mins[r][t] + (bias ? bias[n + r] : 0.0f);
}

// Calls tile(R, T, n, b) over rows [n0, n1) and all B activation rows: R = 4 at batch 1 (memory
// bound: four independent chains), else 2 rows x 4 activation rows sharing each load.
template <typename Tile>
void cover(int64_t n0, int64_t n1, int64_t B, const Tile& tile) {
  int64_t n = n0;
  if (B == 1) {
    for (; n + 4 <= n1; n += 4) tile.template run<4, 1>(n, 0);
    for (; n < n1; ++n) tile.template run<1, 1>(n, 0);
    return;
  }
  for (; n + 2 <= n1; n += 2) {
    int64_t b = 0;
    for (; b + 4 <= B; b += 4) tile.template run<2, 4>(n, b);
    for (; b < B; ++b) tile.template run<2, 1>(n, b);
  }
  for (; n < n1; ++n) {
    int64_t b = 0;
    for (; b + 4 <= B; b += 4) tile.template run<1, 4>(n, b);
    for (; b < B; ++b) tile.template run<1, 1>(n, b);
  }
}

struct Q8Tile {
  const int8_t* w;
  const uint16_t* wd;
  const Acts& a;
  float* y;
  int64_t N;
  const float* bias;
  template <int R, int T>
  void run(int64_t n, int64_t b) const { q8_tile<R, T>(w, wd, a, n, b, y, N, bias); }
};

struct Q4Tile {
  const uint8_t* w;
  const uint16_t* wd;
  const uint16_t* wm;
  const Acts& a;
  float* y;
  int64_t N;
  const float* bias;
  template <int R, int T>
  void run(int64_t n, int64_t b) const { q4_tile<R, T>(w, wd, wm, a, n, b, y, N, bias); }
};

void check_common(const at::Tensor& x, const at::Tensor& scales, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [B, K]");
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == x.size(1) / QK,
              "scales must be contiguous float16 [N, K/32]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous float32 [N]");
  }
}

// Rows of output per parallel chunk: enough that a chunk's weights are ~32 KB at least.
int64_t grain(int64_t K) { return std::max<int64_t>(8, (32 * 1024) / std::max<int64_t>(K, 1)); }

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t B = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w has ", w.size(1), " columns, x has ", K);
  check_common(x, scales, N, bias);
  at::Tensor xq = at::empty({B, K}, x.options().dtype(at::kChar));
  at::Tensor xds = at::empty({2, B, K / QK}, x.options());
  quantize_rows(x.data_ptr<float>(), B, K, xq.data_ptr<int8_t>(), xds[0].data_ptr<float>(), xds[1].data_ptr<float>());
  at::Tensor y = at::empty({B, N}, x.options());
  const Acts a{xq.data_ptr<int8_t>(), xds[0].data_ptr<float>(), xds[1].data_ptr<float>(), K, K / QK};
  const Q8Tile tile{w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), a,
                    y.data_ptr<float>(), N, bias ? bias->data_ptr<float>() : nullptr};
  at::parallel_for(0, N, grain(K), [&](int64_t n0, int64_t n1) { cover(n0, n1, B, tile); });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be contiguous uint8 [N, K/2]");
  const int64_t B = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) * 2 == K, "w holds ", w.size(1) * 2, " columns, x has ", K);
  check_common(x, scales, N, bias);
  check_common(x, mins, N, c10::nullopt);
  at::Tensor xq = at::empty({B, K}, x.options().dtype(at::kChar));
  at::Tensor xds = at::empty({2, B, K / QK}, x.options());
  quantize_rows(x.data_ptr<float>(), B, K, xq.data_ptr<int8_t>(), xds[0].data_ptr<float>(), xds[1].data_ptr<float>());
  at::Tensor y = at::empty({B, N}, x.options());
  const Acts a{xq.data_ptr<int8_t>(), xds[0].data_ptr<float>(), xds[1].data_ptr<float>(), K, K / QK};
  const Q4Tile tile{w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                    reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), a, y.data_ptr<float>(), N,
                    bias ? bias->data_ptr<float>() : nullptr};
  at::parallel_for(0, N, grain(K / 2), [&](int64_t n0, int64_t n1) { cover(n0, n1, B, tile); });
  return y;
}

}  // namespace

TORCH_LIBRARY(weir_quant, m) {
  m.def("q8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor w, Tensor scales, Tensor mins, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(weir_quant, CPU, m) {
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_linear", &q4_linear);
}
