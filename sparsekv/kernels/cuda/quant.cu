// Products of 4-bit group-quantized weights with 1-16 input rows on tensor cores (mma.sync, sm_80 and later).
//
// A warp multiplies 16 output rows (a tile) by x in steps of 16 inputs with one m16n8k16 product per 8 rows of x: the
// tile's codes are the A operand and x's rows the B operand's 8 columns (unused columns are zero). Each lane's 32-bit
// word of codes (``reference.to_tiles``) holds exactly the 8 codes its A fragment takes, so one or-and (lop3) puts
// two codes in the mantissas of two 16-bit floats, L + q (L = 128 in bf16, 1024 in fp16), with no conversion. The
// products of these exact levels with x are summed in fp32 per group of 32 inputs, starting from -L X (X: the
// group's sum of x, a product of a matrix of ones with the same B operand), so that the sum is that of the codes,
// and scaled there: the group's sum is scale * sum(q x) + minimum * X.
//
// Operands (``reference.to_tiles``): codes (K / 64, chunk_tiles, 32, 4) int32: chunk of 64 inputs, tile, lane,
// step; scale and minimum (K / 64, chunk_tiles, 8, 2, 2) fp16: chunk, tile, g, the chunk's group, rows g and g + 8;
// of these tiles of 16 outputs, the N / 16 from the pointers' (a weight stacked with others, as q, k and v are, is
// a view of their tiles); x (M, K) and out (M, N) in bf16 or fp16, bias (N,) of x's dtype or absent. A chunk's
// tiles lie next to each other, so that all blocks read one stretch of memory at a time. A block of W warps takes R
// tiles; its warps split the chunks and add their sums through shared memory. The time goes to issuing
// instructions as much as to reading memory, so each warp copies its chunks S - 1 ahead into shared memory
// (cp.async: no registers held by the loads in flight), and COLS, the columns of x computed (1, 8 or 16), spends no
// work on columns beyond them: one row of x scales only the outputs of its own column, 9-16 rows take a second
// product on the same A operand.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "fragments.cuh"

// The launches built: (warps, tiles, stages), as ``quant.LAUNCHES`` lists them.
#ifndef SPARSEKV_LAUNCHES
#define SPARSEKV_LAUNCHES SPARSEKV_LAUNCH(16, 1, 2) SPARSEKV_LAUNCH(16, 2, 2) SPARSEKV_LAUNCH(16, 4, 2) \
  SPARSEKV_LAUNCH(8, 2, 2) SPARSEKV_LAUNCH(4, 4, 3) SPARSEKV_LAUNCH(4, 8, 2)
#endif

namespace {

using sparsekv::commit_copies;
using sparsekv::copy16;
using sparsekv::mma;
using sparsekv::or_and;
using sparsekv::wait_copies;

// Conversions by the 16-bit type, with the intrinsics (torch's extension build turns off the implicit ones).
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(__nv_bfloat16* at, float v) { *at = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* at, float v) { *at = __float2half(v); }

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A warp's shared memory per stage and tile: 32 words of codes, then 4 of scales and 4 of minima (8 bytes a g).
constexpr int SLOT = 40;

template <bool BF16, int COLS, int W, int R, int S>
__global__ void __launch_bounds__(W * 32) int4_products(const uint16_t* __restrict__ x, const uint4* __restrict__ codes,
    const uint4* __restrict__ scale, const uint4* __restrict__ minimum, const uint16_t* __restrict__ bias,
    uint16_t* __restrict__ out, int M, int N, int K, int chunk_tiles) {
  static_assert(S >= 2, "a stage is read while the next ones load");
  constexpr bool ONE = COLS == 1;
  constexpr int NB = COLS > 8 ? 2 : 1;  // B operands of 8 columns
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  extern __shared__ uint4 staged[];  // [W][S][R][SLOT]; after the loop, the warps' sums [W][R][NB * 4][32] floats
  const int chunks = K >> 6;
  const int tile0 = blockIdx.x * R, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // the fragment's row (B's column) and column pair
  const uint32_t magic = sparsekv::magic<BF16>(0) * 0x10001u;  // two L
  const uint32_t ones = BF16 ? 0x3F803F80u : 0x3C003C00u;
  const float level = BF16 ? 128.f : 1024.f;
  bool has_row[NB];
  const uint32_t* xr[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    has_row[nb] = g + 8 * nb < M;
    xr[nb] = reinterpret_cast<const uint32_t*>(x + (size_t)(has_row[nb] ? g + 8 * nb : 0) * K) + t;
  }
  // Warp w takes chunks w, w + W, ...: step i is chunk w + i W, whose R tiles lie next to each other. Lanes 0-3
  // copy the tile's scales, 4-7 its minima.
  const int steps = warp < chunks ? (chunks - warp + W - 1) / W : 0;
  const uint4* cp = codes + ((size_t)warp * chunk_tiles + tile0) * 32 + lane;
  const uint4* sp = (lane < 4 ? scale : minimum) + ((size_t)warp * chunk_tiles + tile0) * 4 + (lane & 3);
  const size_t code_step = (size_t)W * chunk_tiles * 32, scale_step = (size_t)W * chunk_tiles * 4;
  uint4* mine = staged + warp * (S * R * SLOT);
  auto issue = [&](int i) {
    if (i < steps) {
      uint4* slot = mine + (i % S) * (R * SLOT);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        copy16(shared_address(slot + r * SLOT + lane), cp + i * code_step + r * 32);
        if (lane < 8) copy16(shared_address(slot + r * SLOT + 32 + lane), sp + i * scale_step + r * 4);
      }
    }
    commit_copies();  // an empty group past the end keeps the count of groups in flight the same
  };
  uint32_t b_next[NB][4][2];
  auto load_x = [&](int i) {  // x is small and read by every block: from L1
    const int c = warp + i * W;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int at = (c * 64 + j * 16) >> 1;
        b_next[nb][j][0] = has_row[nb] && i < steps ? __ldg(xr[nb] + at) : 0u;
        b_next[nb][j][1] = has_row[nb] && i < steps ? __ldg(xr[nb] + at + 4) : 0u;
      }
  };
  float acc[R][NB][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[r][nb][j] = 0.f;
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);  // weights: no kernel of the step writes them, so before the wait
  sparsekv::dependent_launch();
  load_x(0);
  for (int i = 0; i < steps; ++i) {
    wait_copies<S - 2>();
    __syncwarp();  // lanes 0-7's scales, seen by the whole warp
    const uint4* slot = mine + (i % S) * (R * SLOT);
    uint4 w[R];
    uint2 s[R], m[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w[r] = slot[r * SLOT + lane];
      s[r] = reinterpret_cast<const uint2*>(slot + r * SLOT + 32)[g];
      m[r] = reinterpret_cast<const uint2*>(slot + r * SLOT + 36)[g];
    }
    uint32_t b[NB][4][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        b[nb][j][0] = b_next[nb][j][0];
        b[nb][j][1] = b_next[nb][j][1];
      }
    __syncwarp();  // every lane has read the stage that the next copy overwrites
    issue(i + S - 1);
    load_x(i + 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the chunk's two groups
      float xs[NB][4], start[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const float zero[4] = {0.f, 0.f, 0.f, 0.f};
        mma<BF16>(xs[nb], zero, ones, ones, ones, ones, b[nb][2 * h][0], b[nb][2 * h][1]);
        mma<BF16>(xs[nb], ones, ones, ones, ones, b[nb][2 * h + 1][0], b[nb][2 * h + 1][1]);
#pragma unroll
        for (int j = 0; j < 4; ++j) start[nb][j] = -level * xs[nb][j];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t words[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
        float p[NB][4];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t q = words[2 * h + k];
          const uint32_t a0 = or_and(q, 0x000F000Fu, magic), a1 = or_and(q >> 4, 0x000F000Fu, magic),
                         a2 = or_and(q >> 8, 0x000F000Fu, magic), a3 = or_and(q >> 12, 0x000F000Fu, magic);
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
            mma<BF16>(p[nb], k ? p[nb] : start[nb], a0, a1, a2, a3, b[nb][2 * h + k][0], b[nb][2 * h + k][1]);
        }
        // Group h's scales and minima of rows g and g + 8: f0 = (scale, minimum) of row g, f1 of row g + 8.
        const uint32_t sc = h ? s[r].y : s[r].x, mn = h ? m[r].y : m[r].x;
        const __half2 sh = *reinterpret_cast<const __half2*>(&sc), mh = *reinterpret_cast<const __half2*>(&mn);
        const float2 f0 = make_float2(__low2float(sh), __low2float(mh));
        const float2 f1 = make_float2(__high2float(sh), __high2float(mh));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          acc[r][nb][0] = fmaf(f0.x, p[nb][0], fmaf(f0.y, xs[nb][0], acc[r][nb][0]));
          acc[r][nb][2] = fmaf(f1.x, p[nb][2], fmaf(f1.y, xs[nb][2], acc[r][nb][2]));
          if constexpr (!ONE) {
            acc[r][nb][1] = fmaf(f0.x, p[nb][1], fmaf(f0.y, xs[nb][1], acc[r][nb][1]));
            acc[r][nb][3] = fmaf(f1.x, p[nb][3], fmaf(f1.y, xs[nb][3], acc[r][nb][3]));
          }
        }
      }
    }
  }
  wait_copies<0>();
  if constexpr (W > 1) {
    __syncthreads();  // every warp is past its stages
    float* partial = reinterpret_cast<float*>(staged);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int j = 0; j < 4; ++j) partial[(((warp * R + r) * NB + nb) * 4 + j) * 32 + lane] = acc[r][nb][j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int v = 1; v < W; ++v)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[r][nb][j] += partial[(((v * R + r) * NB + nb) * 4 + j) * 32 + lane];
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = 8 * nb + 2 * t + (j & 1), n = (tile0 + r) * 16 + g + (j >> 1) * 8;
        if (col < M) {
          const float b = bias == nullptr ? 0.f : to_float(reinterpret_cast<const T*>(bias)[n]);
          store(reinterpret_cast<T*>(out) + (size_t)col * N + n, acc[r][nb][j] + b);
        }
      }
}

template <bool BF16, int COLS, int W, int R, int S>
void launch(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
            const torch::Tensor& minimum, const uint16_t* bias, torch::Tensor& out, bool pdl) {
  const int M = x.size(0), K = x.size(1), N = out.size(1);
  constexpr int bytes = W * S * R * SLOT * 16;
  static_assert(bytes <= 227 * 1024 && bytes >= W * R * (COLS > 8 ? 2 : 1) * 512,
                "a block's stages must fit in shared memory and hold the warps' sums");
  const auto kernel = int4_products<BF16, COLS, W, R, S>;
  static const cudaError_t sized = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  TORCH_CHECK(sized == cudaSuccess, "int4_products: ", bytes, " bytes of shared memory: ", cudaGetErrorString(sized));
  sparsekv::launch_kernel(kernel, N / (16 * R), W * 32, bytes, pdl,
      reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint4*>(codes.data_ptr()),
      reinterpret_cast<const uint4*>(scale.data_ptr()), reinterpret_cast<const uint4*>(minimum.data_ptr()), bias,
      reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K, (int)(codes.stride(0) / 128));
}

template <bool BF16, int COLS>
void dispatch(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
              const torch::Tensor& minimum, const uint16_t* bias, torch::Tensor& out, int64_t warps, int64_t tiles,
              int64_t stages, bool pdl) {
#define SPARSEKV_LAUNCH(W, R, S)                 \
  if (warps == W && tiles == R && stages == S) \
    return launch<BF16, COLS, W, R, S>(x, codes, scale, minimum, bias, out, pdl);
  SPARSEKV_LAUNCHES
#undef SPARSEKV_LAUNCH
  TORCH_CHECK(false, "int4_products: no launch of ", warps, " warps, ", tiles, " tiles and ", stages, " stages");
}

}  // namespace

// out (M, N) = x (M, K) times the tiled weight (plus bias); warps, tiles and stages: one of the launches built;
// pdl: programmatic dependent launch.
void int4_products(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                   const torch::Tensor& minimum, const c10::optional<torch::Tensor>& bias, torch::Tensor& out,
                   int64_t warps, int64_t tiles, int64_t stages, bool pdl) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && (x.scalar_type() == torch::kBFloat16 ||
              x.scalar_type() == torch::kHalf), "int4_products: x must be a contiguous bf16 or fp16 CUDA tensor");
  TORCH_CHECK(M >= 1 && M <= 16 && K % 64 == 0 && N % (16 * tiles) == 0, "int4_products: M must be 1-16, K a ",
              "multiple of 64 and N of 16 times tiles; got M ", M, ", K ", K, ", N ", N);
  // The N / 16 tiles of chunks of chunk_tiles (more: a view of stacked weights' tiles), laid out as in a contiguous
  // (K / 64, chunk_tiles, ...) tensor, aligned to 16 bytes.
  const int64_t chunk_tiles = codes.dim() == 4 ? codes.stride(0) / 128 : 0;
  auto tiles_of = [&](const torch::Tensor& t, std::vector<int64_t> sizes) {
    std::vector<int64_t> strides(sizes.size());
    int64_t stride = 1;
    for (size_t i = sizes.size(); i-- > 1;) strides[i] = stride, stride *= sizes[i];
    strides[0] = stride / sizes[1] * chunk_tiles;
    return t.sizes() == sizes && t.strides() == strides && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  TORCH_CHECK(codes.scalar_type() == torch::kInt && scale.scalar_type() == torch::kHalf &&
              minimum.scalar_type() == torch::kHalf && chunk_tiles >= N / 16 &&
              tiles_of(codes, {K / 64, N / 16, 32, 4}) && tiles_of(scale, {K / 64, N / 16, 8, 2, 2}) &&
              tiles_of(minimum, {K / 64, N / 16, 8, 2, 2}) &&
              out.scalar_type() == x.scalar_type(), "int4_products: the tiled operands or out do not match x");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "int4_products: bias must be (N,) of x's dtype");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const auto run = M == 1 ? (bf16 ? dispatch<true, 1> : dispatch<false, 1>)
                 : M <= 8 ? (bf16 ? dispatch<true, 8> : dispatch<false, 8>)
                          : (bf16 ? dispatch<true, 16> : dispatch<false, 16>);
  run(x, codes, scale, minimum, b, out, warps, tiles, stages, pdl);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_products", &int4_products, "products of tiled 4-bit weights with 1-16 rows");
}
