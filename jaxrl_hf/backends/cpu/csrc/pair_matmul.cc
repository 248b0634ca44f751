// bf16 matmul with float32 accumulation on AVX512-BF16 (vdpbf16ps): y[M, N] = a[M, K] · b[K, N], K even. The
// training step's weight gradients ∂W = xᵀ · ∂y run here (models/pair_matmul.py): XLA:CPU upcasts both bf16
// operands of that dot to float32 and runs Eigen's float32 dot.
//
// vdpbf16ps multiplies pairs of bf16 and adds both products to one float32 lane, so b is stored as pair panels:
// column panel p (columns [48p, 48p + 48)), then k-pair j, then column c: the two bf16 b[2j, 48p + c] and
// b[2j + 1, 48p + c] side by side (one 32-bit unit). A panel is one contiguous stream of K x 48 values; a's rows
// are row-major, so a[i, 2j] and a[i, 2j + 1] are one 32-bit unit already.
//
// The product (JaxrlHfPairMatmul): blocks of up to 8 rows of a times one panel into 8 x 48 float32
// accumulators (24 AVX-512 registers); per k-pair three panel loads, eight broadcasts of a's unit, 24 vdpbf16ps.
// A panel is reused from L2 by every row block of a chunk of 128 rows. Each output is one float32 sum over the
// k-pairs in order, each pair's two products added in the instruction.
//
// The packing (JaxrlHfPackPairs): a bf16 [K, N] row-major b into its pair panels.
//
// The caller pads K to even and N to a multiple of 48. Threads: the items are shared by the calling thread and
// XLA's intra-op pool (shared_items.h). Functions using the BF16 instructions carry a target attribute, so the
// library builds on any AVX-512 CPU; Python calls them only where the CPU reports avx512_bf16.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "shared_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 48;
constexpr int kRowBlock = 8;
constexpr int64_t kRowChunk = 128;
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int ROWS>
BF16_TARGET inline void Block(const int32_t* a, int64_t lda, const uint32_t* panel, float* y, int64_t ldy,
                              int64_t pairs) {
  __m512 acc[ROWS][3];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t* w = panel + k * kPanel;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 16);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 32);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(a[i * lda + k]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], x, w2);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
}

template <int ROWS>
BF16_TARGET void Tail(const int32_t* a, int64_t lda, const uint32_t* panel, float* y, int64_t ldy, int64_t pairs,
                      int rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return Block<ROWS>(a, lda, panel, y, ldy, pairs);
    Tail<ROWS - 1>(a, lda, panel, y, ldy, pairs, rows);
  }
}

struct Product : jaxrl_hf::SharedItems<Product> {  // an item: one panel of one chunk of rows
  const int32_t* a;  // [M, K / 2] units
  const uint32_t* b;  // panels
  float* y;
  int64_t m, pairs, n, panels;

  BF16_TARGET void Item(int64_t i) {
    const int64_t r0 = i / panels * kRowChunk, r1 = std::min(r0 + kRowChunk, m), p = i % panels;
    const uint32_t* panel = b + p * pairs * kPanel;
    float* out = y + p * kPanel;
    int64_t r = r0;
    for (; r + kRowBlock <= r1; r += kRowBlock) Block<kRowBlock>(a + r * pairs, pairs, panel, out + r * n, n, pairs);
    if (r < r1) Tail<kRowBlock - 1>(a + r * pairs, pairs, panel, out + r * n, n, pairs, static_cast<int>(r1 - r));
  }
};

struct Pack : jaxrl_hf::SharedItems<Pack> {  // an item: one panel's units for a block of 16 k-pairs
  const uint16_t* src;
  uint32_t* out;
  int64_t cols, pairs;
  static constexpr int64_t kPairBlock = 16;

  int64_t Blocks() const { return (pairs + kPairBlock - 1) / kPairBlock; }

  void Item(int64_t item) {  // unit (j, c) of panel p = src[2j, 48p + c], src[2j + 1, 48p + c]
    const int64_t p = item / Blocks(), j0 = item % Blocks() * kPairBlock, j1 = std::min(j0 + kPairBlock, pairs);
    uint32_t* panel = out + p * pairs * kPanel;
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* r0 = src + 2 * j * cols + p * kPanel;
      const uint16_t* r1 = r0 + cols;
      for (int64_t c = 0; c < kPanel; c += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c)));
        _mm512_storeu_si512(panel + j * kPanel + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
};

ffi::Error PairMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || bd[0] != ad[1] || yd.size() != 2 || yd[0] != ad[0] || yd[1] != bd[1] ||
      ad[1] % 2 != 0 || bd[1] % kPanel != 0)
    return ffi::Error::InvalidArgument("pair_matmul expects a [M, K], b [K, N] (pair panels), y [M, N], K even, "
                                       "N a multiple of 48");
  auto work = std::make_shared<Product>();
  work->a = reinterpret_cast<const int32_t*>(a.untyped_data());
  work->b = reinterpret_cast<const uint32_t*>(b.untyped_data());
  work->y = y->typed_data();
  work->m = ad[0];
  work->pairs = ad[1] / 2;
  work->n = bd[1];
  work->panels = bd[1] / kPanel;
  work->items = work->panels * ((ad[0] + kRowChunk - 1) / kRowChunk);
  jaxrl_hf::RunShared(pool, work, jaxrl_hf::Helpers(pool, work->items));
  return ffi::Error::Success();
}

ffi::Error PackPairsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> src, ffi::ResultBuffer<ffi::BF16> out) {
  const auto sd = src.dimensions(), od = out->dimensions();
  if (sd.size() != 2 || od.size() != 2 || od[0] != sd[0] || od[1] != sd[1] || sd[0] % 2 != 0 || sd[1] % kPanel != 0)
    return ffi::Error::InvalidArgument("pack_pairs expects b [K, N] and out [K, N], K even, N a multiple of 48");
  auto work = std::make_shared<Pack>();
  work->src = reinterpret_cast<const uint16_t*>(src.untyped_data());
  work->out = reinterpret_cast<uint32_t*>(out->untyped_data());
  work->cols = sd[1];
  work->pairs = sd[0] / 2;
  work->items = sd[1] / kPanel * work->Blocks();
  jaxrl_hf::RunShared(pool, work, jaxrl_hf::Helpers(pool, work->items));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlHfPairMatmul, PairMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlHfPackPairs, PackPairsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
