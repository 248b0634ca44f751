// One optimizer update of every float32 parameter in a single pass: global-norm clipping (the scale computed by
// the caller) then AdamW, the update of optax's chain(clip_by_global_norm, adamw) followed by apply_updates:
//
//   g' = s * g                      s = max_norm / ||g|| when ||g|| >= max_norm, else 1
//   m' = (1 - b1) * g' + b1 * m      v' = (1 - b2) * g'^2 + b2 * v
//   p' = p - lr * ((m' / bc1) / (sqrt(v' / bc2) + eps) + wd * p)      bc1 = 1 - b1^t, bc2 = 1 - b2^t
//
// Each element is read once (g, p, m, v) and written once (p, m, v) in place: 28 bytes a parameter, where XLA's
// fusions of optax's update read and write ~56 (the clipped gradient and both moments are written out and read
// again). Float32 throughout, as optax; the divisions by the scalars s, bc1 and bc2 are multiplications by their
// reciprocals (computed once by the caller) and the sums of products are fused multiply-adds, so an element may
// differ from XLA's by float32 rounding (XLA itself rewrites some of these per program), not more.
//
// Threads: the chunks of every leaf are shared by the calling thread and XLA's intra-op pool (shared_items.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "shared_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 16384;  // elements per work item: 64 KB of each of the 4 streams
enum Hyper { kScale, kOneMinusB1, kB1, kOneMinusB2, kB2, kInvBc1, kInvBc2, kEps, kWd, kStep, kHyperSize };

struct Leaf {
  const float* g;
  float* p;
  float* m;
  float* v;
  int64_t size;
};

struct Work : jaxrl_hf::SharedItems<Work> {  // an item: one chunk of one leaf
  std::vector<Leaf> leaves;
  std::vector<int64_t> first_item;  // leaf i's chunks are items [first_item[i], first_item[i + 1])
  float h[kHyperSize];

  void Chunk(const Leaf& leaf, int64_t begin, int64_t end) const {
    const __m512 scale = _mm512_set1_ps(h[kScale]);
    const __m512 c1 = _mm512_set1_ps(h[kOneMinusB1]), b1 = _mm512_set1_ps(h[kB1]);
    const __m512 c2 = _mm512_set1_ps(h[kOneMinusB2]), b2 = _mm512_set1_ps(h[kB2]);
    const __m512 inv_bc1 = _mm512_set1_ps(h[kInvBc1]), inv_bc2 = _mm512_set1_ps(h[kInvBc2]);
    const __m512 eps = _mm512_set1_ps(h[kEps]), wd = _mm512_set1_ps(h[kWd]), step = _mm512_set1_ps(h[kStep]);
    auto update = [&](__m512 g, __m512 p, __m512 m, __m512 v, float* pp, float* mp, float* vp, __mmask16 lanes) {
      g = _mm512_mul_ps(g, scale);
      m = _mm512_fmadd_ps(c1, g, _mm512_mul_ps(b1, m));
      v = _mm512_fmadd_ps(c2, _mm512_mul_ps(g, g), _mm512_mul_ps(b2, v));
      const __m512 root = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(v, inv_bc2)), eps);
      const __m512 u = _mm512_fmadd_ps(wd, p, _mm512_div_ps(_mm512_mul_ps(m, inv_bc1), root));
      _mm512_mask_storeu_ps(pp, lanes, _mm512_fmadd_ps(step, u, p));
      _mm512_mask_storeu_ps(mp, lanes, m);
      _mm512_mask_storeu_ps(vp, lanes, v);
    };
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
      update(_mm512_loadu_ps(leaf.g + i), _mm512_loadu_ps(leaf.p + i), _mm512_loadu_ps(leaf.m + i),
             _mm512_loadu_ps(leaf.v + i), leaf.p + i, leaf.m + i, leaf.v + i, 0xFFFF);
    }
    if (i < end) {
      const __mmask16 lanes = static_cast<__mmask16>((1u << (end - i)) - 1u);
      update(_mm512_maskz_loadu_ps(lanes, leaf.g + i), _mm512_maskz_loadu_ps(lanes, leaf.p + i),
             _mm512_maskz_loadu_ps(lanes, leaf.m + i), _mm512_maskz_loadu_ps(lanes, leaf.v + i), leaf.p + i,
             leaf.m + i, leaf.v + i, lanes);
    }
  }

  void Item(int64_t item) {
    const int64_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t begin = (item - first_item[i]) * kChunk;
    Chunk(leaves[i], begin, std::min(begin + kChunk, leaves[i].size));
  }
};

// Operands: hyper f32[10] (the Hyper order), then the G gradients, L params, L first and L second moments;
// results: the L params, first and second moments, each aliased to its operand (updated in place). Attribute
// ``pieces`` (L counts summing to G): leaf i's gradient is the next pieces[i] gradient operands, each covering the
// next elements of the leaf in order (a stacked [layers, ...] leaf takes its layers' gradients as they were made,
// with no concatenation into one buffer first).
ffi::Error ClipAdamWImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> hyper, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, ffi::Span<const int64_t> pieces) {
  if (hyper.element_count() != kHyperSize)
    return ffi::Error::InvalidArgument("clip_adamw expects 10 hyperparameters");
  const int64_t count = static_cast<int64_t>(pieces.size());
  int64_t grads = 0;
  for (int64_t n : pieces) {
    if (n < 1) return ffi::Error::InvalidArgument("clip_adamw: every leaf needs at least one gradient piece");
    grads += n;
  }
  if (static_cast<int64_t>(args.size()) != grads + 3 * count || static_cast<int64_t>(rets.size()) != 3 * count)
    return ffi::Error::InvalidArgument("clip_adamw expects G gradient pieces, L params, L first and L second "
                                       "moments (L = len(pieces), G = sum(pieces)) and 3 L results (p, m, v)");
  auto work = std::make_shared<Work>();
  std::copy_n(hyper.typed_data(), kHyperSize, work->h);
  int64_t next_grad = 0;
  for (int64_t i = 0; i < count; ++i) {  // a result is its operand's buffer (XLA copies first where it must)
    auto p = rets.get<ffi::Buffer<ffi::F32>>(i);
    auto m = rets.get<ffi::Buffer<ffi::F32>>(count + i);
    auto v = rets.get<ffi::Buffer<ffi::F32>>(2 * count + i);
    if (p.has_error() || m.has_error() || v.has_error())
      return ffi::Error::InvalidArgument("clip_adamw: every operand and result must be float32");
    const int64_t size = static_cast<int64_t>((*p)->element_count());
    if (static_cast<int64_t>((*m)->element_count()) != size || static_cast<int64_t>((*v)->element_count()) != size)
      return ffi::Error::InvalidArgument("clip_adamw: a leaf's parameter and moments differ in size");
    int64_t offset = 0;
    for (int64_t j = 0; j < pieces[i]; ++j, ++next_grad) {
      auto g = args.get<ffi::Buffer<ffi::F32>>(next_grad);
      if (g.has_error()) return ffi::Error::InvalidArgument("clip_adamw: every gradient must be float32");
      const int64_t piece = static_cast<int64_t>(g->element_count());
      if (offset + piece > size) break;
      work->first_item.push_back(work->items);
      work->leaves.push_back({g->typed_data(), (*p)->typed_data() + offset, (*m)->typed_data() + offset,
                              (*v)->typed_data() + offset, piece});
      work->items += (piece + kChunk - 1) / kChunk;
      offset += piece;
    }
    if (offset != size)
      return ffi::Error::InvalidArgument("clip_adamw: a leaf's gradient pieces do not add up to its size");
  }
  work->first_item.push_back(work->items);
  jaxrl_hf::RunShared(pool, work, jaxrl_hf::Helpers(pool, work->items));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlHfClipAdamW, ClipAdamWImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("pieces"));
