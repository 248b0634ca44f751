// Decode attention over a KV cache that holds the new keys already (keys stored transposed):
//   scores[m, s] = scale * rows[m, :] . kt[:, s]          rows [B, K, M, D], kt [B, K, D, S]
//   p[m, :] = softmax(where(mask[t(m), :], scores[m, :], NEG_INF))     mask [B, T, S], t(m) = m % T
//   out[m, :] = sum_s p[m, s] v[s, :]                     v [B, K, S, D], out [B, K, M, D]
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "shared_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -0.7f * 3.4028234663852886e38f;

// e^x for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor
// polynomial (relative error < 2e-7 on that interval); below -87.3 the result is 0.
inline __m512 Exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n);
}

inline __mmask16 Tail(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u); }

struct Work : jaxrl_hf::SharedItems<Work> {  // an item: one (row, kv head) pair, b * k of them
  const float *rows, *kt, *v;
  const bool* mask;
  float* out;
  int64_t b, k, m, t, d, s;
  float scale;
  int64_t stride = 1;  // threads: the next item this thread is likely to get

  // scores of rows [i0, i0 + R) over slots [j0, j0 + 64): R x 4 accumulators, one k row of 64 slots per step.
  // (`Values` is the same register block over other operands; one routine for both, its operands as arguments,
  // measured 6% slower at 64 rows x 168 slots, launch/bench/bench_cpu_kernels.py: kept apart.)
  template <int R>
  void Scores(const float* q, const float* keys, float* sc, int64_t i0, int64_t j0, const char* pf, int64_t pf_lines) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
    __mmask16 lanes[4];
    for (int u = 0; u < 4; ++u) lanes[u] = j0 + 16 * u < s ? Tail(s - j0 - 16 * u) : 0;
    for (int64_t e = 0; e < d; ++e) {
      for (int64_t l = e * pf_lines / d; l < (e + 1) * pf_lines / d; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
      const float* kr = keys + e * s + j0;
      __m512 kv[4];
      for (int u = 0; u < 4; ++u) kv[u] = _mm512_maskz_loadu_ps(lanes[u], kr + 16 * u);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(q[(i0 + r) * d + e]);
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_fmadd_ps(a, kv[u], acc[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u)
        _mm512_mask_storeu_ps(sc + (i0 + r) * s + j0 + 16 * u, lanes[u], _mm512_mul_ps(acc[r][u], _mm512_set1_ps(scale)));
  }

  // out rows [i0, i0 + R), columns [c, c + 64): R x 4 accumulators, one value row per slot
  template <int R>
  void Values(const float* p, const float* vals, float* o, int64_t i0, int64_t c, const char* pf, int64_t pf_lines) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
    __mmask16 lanes[4];
    for (int u = 0; u < 4; ++u) lanes[u] = c + 16 * u < d ? Tail(d - c - 16 * u) : 0;
    for (int64_t j = 0; j < s; ++j) {
      for (int64_t l = j * pf_lines / s; l < (j + 1) * pf_lines / s; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
      __m512 vv[4];
      for (int u = 0; u < 4; ++u) vv[u] = _mm512_maskz_loadu_ps(lanes[u], vals + j * d + c + 16 * u);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(p[(i0 + r) * s + j]);
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_fmadd_ps(w, vv[u], acc[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(o + (i0 + r) * d + c + 16 * u, lanes[u], acc[r][u]);
  }

  template <typename F>
  static void ByRows(int64_t m, F&& f) {  // f(i0, R) over row groups of up to 4 (R a compile-time constant)
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) f(i, std::integral_constant<int, 4>());
    switch (m - i) {
      case 3: f(i, std::integral_constant<int, 3>()); break;
      case 2: f(i, std::integral_constant<int, 2>()); break;
      case 1: f(i, std::integral_constant<int, 1>()); break;
    }
  }

  void Pair(int64_t bk, std::vector<float>& scores) {
    const int64_t row = bk / k;
    const float* q = rows + bk * m * d;
    const float* keys = kt + bk * d * s;
    const float* vals = v + bk * s * d;
    float* o = out + bk * m * d;
    scores.resize(m * s);
    float* sc = scores.data();
    const int64_t lines = (s * d * 4 + 63) / 64, chunks = (s + 63) / 64;
    const char* vpf = reinterpret_cast<const char*>(vals);
    ByRows(m, [&](int64_t i0, auto R) {
      for (int64_t j0 = 0; j0 < s; j0 += 64) {
        const int64_t part = i0 == 0 ? lines / chunks : 0;  // the values' lines, spread over the first row group
        Scores<decltype(R)::value>(q, keys, sc, i0, j0, vpf + 64 * part * (j0 / 64), part);
      }
    });
    for (int64_t i = 0; i < m; ++i) {  // mask, softmax
      float* si = sc + i * s;
      const bool* mk = mask + (row * t + i % t) * s;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int64_t j = 0; j < s; j += 16) {
        const __mmask16 lanes = Tail(s - j);
        const __m128i bytes = _mm_maskz_loadu_epi8(lanes, mk + j);
        const __mmask16 visible = _mm_test_epi8_mask(bytes, bytes);
        const __m512 x = _mm512_mask_blend_ps(visible, _mm512_set1_ps(kNegInf), _mm512_maskz_loadu_ps(lanes, si + j));
        _mm512_mask_storeu_ps(si + j, lanes, x);
        mx = _mm512_mask_max_ps(mx, lanes, mx, x);
      }
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < s; j += 16) {
        const __mmask16 lanes = Tail(s - j);
        const __m512 e = _mm512_maskz_mov_ps(lanes, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, si + j), top)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(si + j, lanes, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
      for (int64_t j = 0; j < s; j += 16)
        _mm512_mask_storeu_ps(si + j, Tail(s - j), _mm512_mul_ps(_mm512_maskz_loadu_ps(Tail(s - j), si + j), inv));
    }
    const int64_t ahead = bk + stride;
    const char* kpf = reinterpret_cast<const char*>(kt + std::min(ahead, b * k - 1) * d * s);
    ByRows(m, [&](int64_t i0, auto R) {
      for (int64_t c = 0; c < d; c += 64)
        Values<decltype(R)::value>(sc, vals, o, i0, c, kpf, i0 == 0 && c == 0 && ahead < b * k ? lines : 0);
    });
  }

  void Item(int64_t bk) {
    thread_local std::vector<float> scores;
    Pair(bk, scores);
  }
};

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> kt,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                              float scale) {
  const auto rd = rows.dimensions(), kd = kt.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (rd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3 || kd[0] != rd[0] || kd[1] != rd[1] ||
      kd[2] != rd[3] || vd[0] != rd[0] || vd[1] != rd[1] || vd[2] != kd[3] || vd[3] != rd[3] || md[0] != rd[0] ||
      md[2] != kd[3] || rd[2] % md[1] != 0)
    return ffi::Error::InvalidArgument("cache_attention expects rows [B, K, M, D], kt [B, K, D, S], v [B, K, S, D] "
                                       "and mask [B, T, S] with T dividing M");
  auto work = std::make_shared<Work>();
  work->rows = rows.typed_data();
  work->kt = kt.typed_data();
  work->v = v.typed_data();
  work->mask = mask.typed_data();
  work->out = out->typed_data();
  work->b = rd[0], work->k = rd[1], work->m = rd[2], work->d = rd[3], work->s = kd[3], work->t = md[1];
  work->scale = scale;
  work->items = work->b * work->k;
  const int64_t helpers = jaxrl_hf::Helpers(pool, work->items);
  work->stride = helpers + 1;
  jaxrl_hf::RunShared(pool, work, helpers);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlHfCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
