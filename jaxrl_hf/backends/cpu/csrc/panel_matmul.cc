// y[M, N] = x[M, K] · w[K, N] in float32, with w's K x N elements stored in panel order: column panel p
// (columns [48p, 48p + 48)) row after row, then the last N % 48 columns row after row; a panel is one
// contiguous stream (no TLB miss per k row, as the row-major [K, N] matrix has at large N).
//
// The kernel: for each panel, blocks of up to 8 rows of x are multiplied into 8 x 48 accumulators (24 AVX-512
// registers), one rank-1 update per k: three panel loads, eight broadcasts of x, 24 FMAs. A panel (K x 48
// floats, 110 KB at K = 576) is read from memory once per chunk of 256 rows and reused from L2 by its 32 row
// blocks; a chunk of x stays in cache while every panel passes. Each output is one float32 sum over k in order.
//
// Threads: the (chunk, panel) items are shared by the calling thread and XLA's intra-op pool (shared_items.h).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "shared_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 48;
constexpr int kRowBlock = 8;
constexpr int64_t kRowChunk = 256;  // rows of x kept in cache while the panels stream past (a prefill's many rows)

inline __mmask16 Lanes(int64_t width, int v) {  // the lanes of vector v (16 columns) inside a panel's width
  const int64_t n = std::min<int64_t>(std::max<int64_t>(width - 16 * v, 0), 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// An 8 x 48 (or ROWS x 48) block of y: acc += x[i, k] * panel[k, :] over k. FULL: 48 columns; otherwise the
// last panel's `width` columns (masked loads and stores).
template <int ROWS, bool FULL>
inline void RowBlock(const float* x, int64_t ldx, const float* panel, int64_t width, float* y, int64_t ldy,
                     int64_t k_size) {
  __m512 acc[ROWS][3];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = _mm512_setzero_ps();
  const __mmask16 m0 = Lanes(width, 0), m1 = Lanes(width, 1), m2 = Lanes(width, 2);
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * width;
    const __m512 w0 = FULL ? _mm512_loadu_ps(w) : _mm512_maskz_loadu_ps(m0, w);
    const __m512 w1 = FULL ? _mm512_loadu_ps(w + 16) : _mm512_maskz_loadu_ps(m1, w + 16);
    const __m512 w2 = FULL ? _mm512_loadu_ps(w + 32) : _mm512_maskz_loadu_ps(m2, w + 32);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(a, w2, acc[i][2]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    if (FULL) {
      for (int j = 0; j < 3; ++j) _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
    } else {
      _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
      _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
      _mm512_mask_storeu_ps(y + i * ldy + 32, m2, acc[i][2]);
    }
  }
}

template <int ROWS>
inline void Rows(const float* x, int64_t ldx, const float* panel, int64_t width, float* y, int64_t ldy,
                 int64_t k_size) {
  if (width == kPanel) return RowBlock<ROWS, true>(x, ldx, panel, width, y, ldy, k_size);
  RowBlock<ROWS, false>(x, ldx, panel, width, y, ldy, k_size);
}

template <int ROWS>
void Tail(const float* x, int64_t ldx, const float* panel, int64_t width, float* y, int64_t ldy, int64_t k_size,
          int rows) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return Rows<ROWS>(x, ldx, panel, width, y, ldy, k_size);
    Tail<ROWS - 1>(x, ldx, panel, width, y, ldy, k_size, rows);
  }
}

// Columns [48p, min(48p + 48, N)) of rows [r0, r1) of y.
void Panel(const float* x, const float* w_panels, float* y, int64_t r0, int64_t r1, int64_t k, int64_t n,
           int64_t p) {
  const float* panel = w_panels + p * k * kPanel;
  const int64_t width = std::min(kPanel, n - p * kPanel);
  float* out = y + p * kPanel;
  int64_t r = r0;
  for (; r + kRowBlock <= r1; r += kRowBlock) Rows<kRowBlock>(x + r * k, k, panel, width, out + r * n, n, k);
  if (r < r1) Tail<kRowBlock - 1>(x + r * k, k, panel, width, out + r * n, n, k, static_cast<int>(r1 - r));
}

struct Work : jaxrl_hf::SharedItems<Work> {  // an item: one panel of one chunk of rows, chunk by chunk
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, panels;

  void Item(int64_t i) {
    const int64_t r0 = i / panels * kRowChunk;
    Panel(x, w, y, r0, std::min(r0 + kRowChunk, m), k, n, i % panels);
  }
};

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1] || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("panel_matmul expects x [M, K], w [K, N] (panel order) and y [M, N]");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m = xd[0];
  work->k = xd[1];
  work->n = yd[1];
  work->panels = (yd[1] + kPanel - 1) / kPanel;
  work->items = work->panels * ((xd[0] + kRowChunk - 1) / kRowChunk);
  jaxrl_hf::RunShared(pool, work, jaxrl_hf::Helpers(pool, work->items));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlHfPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
