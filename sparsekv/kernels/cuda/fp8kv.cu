// Split-K decode attention over an fp8 (e4m3) page cache on tensor cores (mma.sync m16n8k16 in fp16, sm_89 and
// later): ``triton.attention``'s page mode (``sparse_decode``), with the same partial outputs, merged by its merge
// kernel.
//
// Both products take the cache's tiles as the A operand, in registers converted from e4m3 as they come from shared
// memory, so no 16-bit tile goes through shared memory and no 8-bit tile needs a transposed load:
// - q . k as S^T = K Q^T: rows the page's 16 tokens, columns the row's query heads (at most 8), k the head dim. A
//   lane's channels in the 16 of a product need not be consecutive, since a dot product does not depend on the
//   order of its terms: in product c, lane t's four take the dims D/4 t + 4c + (0..3), so that a lane reads D/4
//   consecutive bytes of its two tokens and one cvt makes each pair of its A fragment; q's fragments (B) follow the
//   same order.
// - p @ v as O^T += V^T P^T: rows D/16 tiles of 16 dims, columns the heads, k the page's tokens. Row g of tile m is
//   dim D/8 g + 2m and row g + 8 the next dim, so a lane reads D/8 consecutive bytes of each of its four tokens and
//   one byte permute (prmt) gathers two tokens' bytes of two dims for the two cvt of its fragment pairs. P^T, the
//   B operand, is the probabilities of S^T's accumulator fragments transposed in registers (movmatrix).
//
// Operands: q (B, H, D) bf16 or fp16 with a contiguous head dim (products in fp16, bf16 values past fp16's range
// clamped); k, v (B, Hkv, C, 16, D) e4m3 of one layout, each slot's page contiguous and 16-byte aligned; slot_page
// (B, Hkv, C) int64; sel (B, Hs, N) int64, the slots each selection row attends (-1: none), or every slot in order
// (``in_order``: entry j is slot j, which holds page j or nothing; sel is not read, rows are read up to their
// length); seq_len (B,) int64; table (B, C) int64 or None: with a table, k and v are a pool's store of shared pages
// (1, Hkv, N, 16, D) and slot s of row b is its page table[b, s] there. A selection row r of b takes query heads
// r G .. r G + G - 1 (G = H / Hs) against KV head r / (Hs / Hkv). A block of W warps takes
// ``per_split`` entries of one row (its split), warp w the entries w, w + W, ...; each warp copies its next pages
// into shared memory (cp.async, a page ahead, zeros for free slots) while it computes the current one, with
// an online softmax per head; the warps then merge through shared memory. Outputs, as the Triton kernel's: part
// (B, H, splits, D) float32, the split's unnormalised output; stats (B, H, splits, 2) its running max (log2 units)
// and sum; counts (B * Hs, splits) int32, its attended tokens (when counted).

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "fragments.cuh"

namespace {

using sparsekv::commit_copies;
using sparsekv::ex2;
using sparsekv::mma;
using sparsekv::wait_copies;

constexpr int kPage = 16;      // tokens per page: the k of one product of p @ v
constexpr int kMaxGroup = 8;   // query heads per selection row: the columns of a product
constexpr int kWarps = 4;      // warps per block
constexpr int kStages = 2;     // pages in flight per warp (4 measured slower: 597-628 us against ~490 at 1M)
constexpr float kLog2e = 1.4426950408889634f;  // the scale's factor: the softmax runs in powers of 2

// Two e4m3 of w (its low or high 16 bits) as two fp16, exactly. The conversion exists from sm_89; a build that also
// targets older GPUs (TORCH_CUDA_ARCH_LIST) gets a trap there, never launched: ``fp8kv.supported`` asks for sm_89.
template <bool HIGH>
__device__ __forceinline__ uint32_t e4m3x2(uint32_t w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  __trap();
  return w;
#else
  uint32_t r;
  const uint16_t h = HIGH ? w >> 16 : w & 0xFFFFu;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
#endif
}

// An 8x8 matrix of 16-bit values, one word a lane (row lane / 4, columns 2 (lane % 4) and the next), transposed.
__device__ __forceinline__ uint32_t transposed(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ uint32_t f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// cp.async of 16 bytes, or 16 zero bytes when !valid (nothing is read).
__device__ __forceinline__ void copy16_or_zero(uint32_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(valid ? 16 : 0));
}

template <typename T>
__device__ __forceinline__ float as_float(T x) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return __bfloat162float(x);
}

struct Args {
  const void* q;
  const uint8_t* k;
  const uint8_t* v;
  const int64_t* slot_page;
  const int64_t* sel;
  const int64_t* seq_len;
  const int64_t* table;  // null: slot s of row b is page s of the row's own cache
  float* part;
  float* stats;
  int32_t* counts;
  int64_t sq_b, sq_h, sk_b, sk_h, sk_c, ss_b, ss_h, sl_b, sl_h, st_b;
  int n_sel, per_split, n_splits, hs, rows_per_kv, group;
  float scale_log2;
};

// Shared memory of a block: each warp's kStages pages of keys and values, then (after the loop) the warps' partial
// outputs, maxima and sums for the merge.
template <int D>
constexpr int shared_bytes() {
  constexpr int pages = kWarps * kStages * 2 * kPage * D, merge = kWarps * kMaxGroup * (D + 2) * 4;
  return pages > merge ? pages : merge;
}

template <typename T, int D, bool IN_ORDER, bool COUNT>
__global__ void __launch_bounds__(kWarps * 32) split_kernel(const Args a) {
  constexpr int PAGE = kPage * D;  // bytes of a page of keys (or values)
  constexpr int CHUNKS = D / 16;   // 16-byte pieces of a token's row
  constexpr int KC = D / 16;       // products of q . k (16 dims each); also the dim tiles of p @ v
  constexpr int KW = D / 16;       // words of a lane's D / 4 bytes of a key
  constexpr int VW = D / 32;       // words of a lane's D / 8 bytes of a value
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static_assert(kStages >= 2, "a stage is refilled only after the one computed before it");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int page_start[kWarps][kStages];  // first position of each stage's page, -1 for none
  __shared__ int counted[kWarps];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row = blockIdx.x, split = blockIdx.y, G = a.group;
  const int64_t b = row / a.hs;
  const int r = row % a.hs, kvh = r / a.rows_per_kv;
  sparsekv::dependent_launch();
  const int64_t q_pos = a.seq_len[b] - 1;
  const int first = split * a.per_split;
  int last = min(first + a.per_split, a.n_sel);
  if (IN_ORDER) last = (int)min((int64_t)last, (q_pos + kPage) / kPage);  // no page past the current token
  const int count = last > first + warp ? (last - first - warp + kWarps - 1) / kWarps : 0;

  // q's B fragments: head g (zeros past the row's heads), dims D/4 t + 4c + (0, 1) and (2, 3).
  uint32_t qf[KC][2];
  {
    const T* qh = reinterpret_cast<const T*>(a.q) + b * a.sq_b + (int64_t)(r * G + min(g, G - 1)) * a.sq_h;
#pragma unroll
    for (int c = 0; c < KC; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = D / 4 * t + 4 * c + 2 * h;
        const float lo = fminf(fmaxf(as_float(qh[d]), -65504.f), 65504.f);
        const float hi = fminf(fmaxf(as_float(qh[d + 1]), -65504.f), 65504.f);
        qf[c][h] = g < G ? f16x2(lo, hi) : 0u;
      }
  }

  const uint8_t* k_row = a.k + b * a.sk_b + kvh * a.sk_h;
  const uint8_t* v_row = a.v + b * a.sk_b + kvh * a.sk_h;
  const int64_t* sel = a.sel + b * a.sl_b + r * a.sl_h;
  const int64_t* sp = a.slot_page + b * a.ss_b + kvh * a.ss_h;
  const int64_t* tb = a.table ? a.table + b * a.st_b : nullptr;
  uint8_t* stages = smem + warp * kStages * 2 * PAGE;
  const uint32_t stages_s = static_cast<uint32_t>(__cvta_generic_to_shared(stages));

  // Entry n of this warp (first + warp + W n): its slot and page start, one entry a lane, 32 at a time.
  int64_t my_slot = 0;
  int my_start = -1;
  auto issue = [&](int n) {
    if (n % 32 == 0) {
      const int e = first + warp + kWarps * (n + lane);
      my_slot = -1;
      if (n + lane < count) my_slot = IN_ORDER ? e : sel[e];  // in order, entry e is slot e: nothing to read
      const int64_t page = my_slot >= 0 ? sp[my_slot] : -1;
      my_start = page >= 0 ? (int)(page * kPage) : -1;
      if (tb && my_slot >= 0) my_slot = tb[my_slot];  // where the slot's page is stored
    }
    const int64_t slot = __shfl_sync(0xFFFFFFFFu, my_slot, n % 32);
    const int start = n < count ? __shfl_sync(0xFFFFFFFFu, my_start, n % 32) : -1;
    const bool valid = start >= 0;
    const int64_t off = valid ? slot * a.sk_c : 0;
    const uint32_t dst = stages_s + (n % kStages) * 2 * PAGE;
#pragma unroll
    for (int j = 0; j < PAGE / 16 / 32; ++j) {
      const int i = lane + 32 * j, tok = i / CHUNKS, ch = i % CHUNKS;
      const uint32_t at = tok * D + ((ch ^ (tok % CHUNKS)) * 16);
      copy16_or_zero(dst + at, k_row + off + 16 * i, valid);
      copy16_or_zero(dst + PAGE + at, v_row + off + 16 * i, valid);
    }
    if (lane == 0) page_start[warp][n % kStages] = start;
    commit_copies();
  };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, acc[KC][4];
#pragma unroll
  for (int i = 0; i < KC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  int tokens = 0;

#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) issue(n);
  for (int n = 0; n < count; ++n) {
    issue(n + kStages - 1);
    wait_copies<kStages - 1>();
    __syncwarp();
    const uint8_t* ks = stages + (n % kStages) * 2 * PAGE;
    const uint8_t* vs = ks + PAGE;
    const int start = page_start[warp][n % kStages];

    // S^T = K Q^T: a lane's keys are tokens g and g + 8, bytes D/4 t ...
    uint32_t kg[2][KW];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < KW / 4; ++h) {
        const int tok = g + 8 * j, ch = KW / 4 * t + h;
        const uint4 x = *reinterpret_cast<const uint4*>(ks + tok * D + ((ch ^ (tok % CHUNKS)) * 16));
        kg[j][4 * h] = x.x, kg[j][4 * h + 1] = x.y, kg[j][4 * h + 2] = x.z, kg[j][4 * h + 3] = x.w;
      }
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // two chains, summed after
#pragma unroll
    for (int c = 0; c < KC; ++c)
      mma<false>(s[c % 2], e4m3x2<false>(kg[0][c]), e4m3x2<false>(kg[1][c]), e4m3x2<true>(kg[0][c]),
                 e4m3x2<true>(kg[1][c]), qf[c][0], qf[c][1]);

    // Online softmax per head (columns 2t, 2t + 1) over the page: tokens g (x[0], x[1]) and g + 8 (x[2], x[3]).
    const bool ok0 = start >= 0 && start + g <= q_pos, ok1 = start >= 0 && start + g + 8 <= q_pos;
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = (i < 2 ? ok0 : ok1) ? (s[0][i] + s[1][i]) * a.scale_log2 : -INFINITY;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float top = fmaxf(x[h], x[h + 2]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, off));
      const float now = fmaxf(m[h], top), safe = now == -INFINITY ? 0.f : now;
      alpha[h] = ex2(m[h] - safe);
      x[h] = ex2(x[h] - safe), x[h + 2] = ex2(x[h + 2] - safe);
      l[h] = l[h] * alpha[h] + x[h] + x[h + 2];
      m[h] = now;
    }
    if (COUNT && lane == 0 && start >= 0) tokens += (int)max((int64_t)0, min((int64_t)kPage, q_pos - start + 1));
    const uint32_t p0 = transposed(f16x2(x[0], x[1])), p1 = transposed(f16x2(x[2], x[3]));

    // O^T += V^T P^T: a lane's values are tokens 2t, 2t + 1, 2t + 8, 2t + 9, bytes D/8 g ...
    uint32_t vt[4][VW];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = 2 * t + (j & 1) + 8 * (j >> 1);
      if constexpr (VW == 4) {
        const uint4 y = *reinterpret_cast<const uint4*>(vs + tok * D + ((g ^ (tok % CHUNKS)) * 16));
        vt[j][0] = y.x, vt[j][1] = y.y, vt[j][2] = y.z, vt[j][3] = y.w;
      } else {
        const uint2 y = *reinterpret_cast<const uint2*>(vs + tok * D + (((g >> 1) ^ (tok % CHUNKS)) * 16) +
                                                        (g & 1) * 8);
        vt[j][0] = y.x, vt[j][1] = y.y;
      }
    }
#pragma unroll
    for (int i = 0; i < KC; ++i) {
      const uint32_t pick = i % 2 ? 0x7362u : 0x5140u;  // bytes 2(i % 2) and the next of two tokens' words
      const uint32_t x01 = __byte_perm(vt[0][i / 2], vt[1][i / 2], pick);
      const uint32_t x23 = __byte_perm(vt[2][i / 2], vt[3][i / 2], pick);
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] *= alpha[c % 2];
      mma<false>(acc[i], e4m3x2<false>(x01), e4m3x2<true>(x01), e4m3x2<false>(x23), e4m3x2<true>(x23), p0, p1);
    }
    __syncwarp();
  }

  // Merge the warps: each head's sum over its lanes, then max, sum and output over the warps.
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], off);
  wait_copies<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // (W, 8, D) outputs, then (W, 8) maxima and (W, 8) sums
  float* red_m = red + kWarps * kMaxGroup * D;
  float* red_l = red_m + kWarps * kMaxGroup;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* o = red + (warp * kMaxGroup + 2 * t + h) * D + D / 8 * g;
#pragma unroll
    for (int i = 0; i < KC; ++i) o[2 * i] = acc[i][h], o[2 * i + 1] = acc[i][2 + h];
    if (g == 0) red_m[warp * kMaxGroup + 2 * t + h] = m[h], red_l[warp * kMaxGroup + 2 * t + h] = l[h];
  }
  if (COUNT && lane == 0) counted[warp] = tokens;
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kWarps * 32) {
    const int h = i / D, d = i % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, red_m[w * kMaxGroup + h]);
    const float safe = top == -INFINITY ? 0.f : top;
    float o = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = ex2(red_m[w * kMaxGroup + h] - safe);
      o += f * red[(w * kMaxGroup + h) * D + d];
      sum += f * red_l[w * kMaxGroup + h];
    }
    const int64_t out = ((int64_t)row * G + h) * a.n_splits + split;
    a.part[out * D + d] = o;
    if (d == 0) a.stats[2 * out] = top, a.stats[2 * out + 1] = sum;
  }
  if (COUNT && threadIdx.x == 0) {
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += counted[w];
    a.counts[(int64_t)row * a.n_splits + split] = total;
  }
}

template <typename T, int D, bool IN_ORDER, bool COUNT>
void launch(const Args& a, int rows, bool pdl) {
  constexpr int bytes = shared_bytes<D>();
  auto* kernel = split_kernel<T, D, IN_ORDER, COUNT>;
  static const cudaError_t set = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  TORCH_CHECK(set == cudaSuccess, "fp8 split_attention: ", cudaGetErrorString(set));
  sparsekv::launch_kernel(kernel, dim3(rows, a.n_splits), kWarps * 32, bytes, pdl, a);
}

template <typename T, int D>
void by_mode(const Args& a, int rows, bool in_order, bool count, bool pdl) {
  if (in_order) count ? launch<T, D, true, true>(a, rows, pdl) : launch<T, D, true, false>(a, rows, pdl);
  else count ? launch<T, D, false, true>(a, rows, pdl) : launch<T, D, false, false>(a, rows, pdl);
}

template <typename T>
void by_head_dim(const Args& a, int rows, int D, bool in_order, bool count, bool pdl) {
  D == 64 ? by_mode<T, 64>(a, rows, in_order, count, pdl) : by_mode<T, 128>(a, rows, in_order, count, pdl);
}

}  // namespace

// {part, stats, counts} of the split attention (see the top of this file): rows_per_b selection rows per sequence,
// n_splits splits of per_split entries each; counts is empty unless count. pdl: programmatic dependent launch.
std::vector<torch::Tensor> split_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& slot_page, const torch::Tensor& sel,
                                           const torch::Tensor& seq_len, double scale, int64_t n_splits,
                                           int64_t per_split, bool in_order, bool count,
                                           const std::optional<torch::Tensor>& table, bool pdl) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), HKV = k.size(1), HS = sel.size(1);
  const auto type = q.scalar_type();
  TORCH_CHECK(q.is_cuda() && (type == torch::kBFloat16 || type == torch::kHalf) && q.stride(2) == 1,
              "fp8 split_attention: q must be a bf16 or fp16 CUDA tensor with a contiguous head dim");
  TORCH_CHECK(k.scalar_type() == torch::kFloat8_e4m3fn && v.scalar_type() == k.scalar_type() && k.dim() == 5 &&
              k.strides() == v.strides() && k.size(3) == kPage && k.size(4) == D && k.stride(4) == 1 &&
              k.stride(3) == D && k.stride(2) == kPage * D && k.stride(1) % 16 == 0 && k.stride(0) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "fp8 split_attention: k and v must be e4m3 (B, Hkv, C, 16, D) of one layout, each page contiguous and "
              "16-byte aligned");
  TORCH_CHECK(slot_page.scalar_type() == torch::kLong && slot_page.stride(2) == 1 && sel.scalar_type() ==
              torch::kLong && sel.stride(2) == 1 && seq_len.scalar_type() == torch::kLong,
              "fp8 split_attention: slot_page, sel and seq_len must be int64 with a contiguous last dim");
  TORCH_CHECK(H % HS == 0 && HS % HKV == 0 && H / HS <= kMaxGroup && (D == 64 || D == 128) && n_splits >= 1 &&
              per_split >= 1, "fp8 split_attention: unsupported shape (head_dim ", D, ", ", H / HS,
              " query heads a selection row)");
  const bool store = table.has_value();
  TORCH_CHECK(!store || (table->scalar_type() == torch::kLong && table->dim() == 2 && table->size(0) == B &&
                         table->size(1) == slot_page.size(2) && table->stride(1) == 1 && k.size(0) == 1),
              "fp8 split_attention: table must be (B, C) int64, contiguous in the slots, over a store of one row");
  auto options = q.options().dtype(torch::kFloat);
  auto part = torch::empty({B, H, n_splits, D}, options);
  auto stats = torch::empty({B, H, n_splits, 2}, options);
  auto counts = torch::empty({count ? B * HS : 0, n_splits}, options.dtype(torch::kInt));
  const Args a{q.data_ptr(), reinterpret_cast<const uint8_t*>(k.data_ptr()),
               reinterpret_cast<const uint8_t*>(v.data_ptr()), slot_page.data_ptr<int64_t>(),
               sel.data_ptr<int64_t>(), seq_len.data_ptr<int64_t>(), store ? table->data_ptr<int64_t>() : nullptr,
               part.data_ptr<float>(), stats.data_ptr<float>(), count ? counts.data_ptr<int32_t>() : nullptr,
               q.stride(0), q.stride(1), store ? 0 : k.stride(0), k.stride(1), k.stride(2), slot_page.stride(0),
               slot_page.stride(1), sel.stride(0), sel.stride(1), store ? table->stride(0) : 0,
               (int)sel.size(2), (int)per_split, (int)n_splits, (int)HS, (int)(HS / HKV), (int)(H / HS),
               (float)scale * kLog2e};
  if (type == torch::kHalf) by_head_dim<__half>(a, B * HS, D, in_order, count, pdl);
  else by_head_dim<__nv_bfloat16>(a, B * HS, D, in_order, count, pdl);
  return {part, stats, counts};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_attention", &split_attention, "split-K decode attention over an fp8 page cache");
}
