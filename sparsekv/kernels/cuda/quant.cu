// Products of 4-bit group-quantized weights with 1-8 input rows on tensor cores (mma.sync, sm_80 and later).
//
// A warp multiplies 16 output rows (a tile) by x in steps of 16 inputs with one m16n8k16 product: the tile's
// codes are the A operand and x's rows the B operand's 8 columns (unused columns are zero). Each lane's 32-bit
// word of codes (``pack_int4``) holds exactly the 8 codes its A fragment takes, so one or-and (lop3) puts two codes
// in the mantissas of two 16-bit floats, 128 + q in bf16 (1024 + q in fp16), with no shared memory and no
// conversion. The products of these exact levels with x are summed in fp32 per group of 32 inputs and scaled
// there: the group's sum is scale * (P - L * X) + minimum * X, with P the product of the levels, X the group's sum
// of x (a product of a matrix of ones with the same B operand) and L the level's offset.
//
// Operands: codes (N / 16, K / 64, 32, 4) int32: tile, chunk of 64 inputs, lane, step; sm (N / 16, K / 64, 8, 4)
// half2: (scale, minimum) of rows g and g + 8 of the chunk's two groups for lanes 4g..4g+3; x (M, K) and out
// (M, N) in bf16 or fp16, bias (N,) of x's dtype or absent. A block of W warps takes R tiles; its warps split the
// chunks and add their sums through shared memory. Each warp loads its next chunk before multiplying the current.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "fragments.cuh"

namespace {

using sparsekv::mma;
using sparsekv::or_and;

// Conversions by the 16-bit type, with the intrinsics (torch's extension build turns off the implicit ones).
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(__nv_bfloat16* at, float v) { *at = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half* at, float v) { *at = __float2half(v); }

template <bool BF16, int W, int R>
__global__ void __launch_bounds__(W * 32) int4_products(const uint16_t* __restrict__ x, const uint4* __restrict__ codes,
    const uint4* __restrict__ sm, const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int M, int N,
    int K) {
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  const int tile0 = blockIdx.x * R, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // the fragment's row (B's column) and column pair
  const int chunks = K >> 6;
  const uint32_t magic = sparsekv::magic<BF16>(0) * 0x10001u;  // two 128.0 (bf16) or 1024.0 (fp16)
  const uint32_t ones = BF16 ? 0x3F803F80u : 0x3C003C00u;
  const float level = BF16 ? 128.f : 1024.f;
  const bool has_row = g < M;
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (size_t)(has_row ? g : 0) * K) + t;
  const uint4* cp = codes + (size_t)tile0 * chunks * 32 + lane;
  const uint4* sp = sm + (size_t)tile0 * chunks * 8 + g;
  float acc[R][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[r][j] = 0.f;
  uint4 w_next[R], s_next[R];
  uint32_t b_next[4][2];
  auto load = [&](int c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {  // read once: streamed past the caches that keep x
      w_next[r] = __ldcs(cp + ((size_t)r * chunks + c) * 32);
      s_next[r] = __ldcs(sp + ((size_t)r * chunks + c) * 8);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int at = (c * 64 + i * 16) >> 1;
      b_next[i][0] = has_row ? __ldg(xr + at) : 0u;
      b_next[i][1] = has_row ? __ldg(xr + at + 4) : 0u;
    }
  };
  if (warp < chunks) load(warp);
  for (int c = warp; c < chunks; c += W) {
    uint4 w[R], s[R];
    uint32_t b[4][2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w[r] = w_next[r];
      s[r] = s_next[r];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      b[i][0] = b_next[i][0];
      b[i][1] = b_next[i][1];
    }
    if (c + W < chunks) load(c + W);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the chunk's two groups
      float xs[4] = {0.f, 0.f, 0.f, 0.f};
      mma<BF16>(xs, ones, ones, ones, ones, b[2 * h][0], b[2 * h][1]);
      mma<BF16>(xs, ones, ones, ones, ones, b[2 * h + 1][0], b[2 * h + 1][1]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t words[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
        float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 2 * h; i < 2 * h + 2; ++i) {
          const uint32_t q = words[i];
          mma<BF16>(p, or_and(q, 0x000F000Fu, magic), or_and(q >> 4, 0x000F000Fu, magic),
                    or_and(q >> 8, 0x000F000Fu, magic), or_and(q >> 12, 0x000F000Fu, magic), b[i][0], b[i][1]);
        }
        const uint32_t s0 = h ? s[r].z : s[r].x, s1 = h ? s[r].w : s[r].y;
        const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&s0));
        const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&s1));
        const float m0 = fmaf(-level, f0.x, f0.y), m1 = fmaf(-level, f1.x, f1.y);
        acc[r][0] = fmaf(f0.x, p[0], fmaf(m0, xs[0], acc[r][0]));
        acc[r][1] = fmaf(f0.x, p[1], fmaf(m0, xs[1], acc[r][1]));
        acc[r][2] = fmaf(f1.x, p[2], fmaf(m1, xs[2], acc[r][2]));
        acc[r][3] = fmaf(f1.x, p[3], fmaf(m1, xs[3], acc[r][3]));
      }
    }
  }
  if constexpr (W > 1) {
    __shared__ float partial[W][R * 4][32];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) partial[warp][r * 4 + j][lane] = acc[r][j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int v = 1; v < W; ++v)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[r][j] += partial[v][r * 4 + j][lane];
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = 2 * t + (j & 1), n = (tile0 + r) * 16 + g + (j >> 1) * 8;
      if (col < M) {
        const float b = bias == nullptr ? 0.f : to_float(reinterpret_cast<const T*>(bias)[n]);
        store(reinterpret_cast<T*>(out) + (size_t)col * N + n, acc[r][j] + b);
      }
    }
}

template <bool BF16, int W, int R>
void launch(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& sm, const uint16_t* bias,
            torch::Tensor& out) {
  const int M = x.size(0), K = x.size(1), N = out.size(1);
  int4_products<BF16, W, R><<<N / (16 * R), W * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint4*>(codes.data_ptr()),
      reinterpret_cast<const uint4*>(sm.data_ptr()), bias, reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool BF16>
void dispatch(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& sm, const uint16_t* bias,
              torch::Tensor& out, int64_t warps, int64_t tiles) {
  if (warps == 16 && tiles == 1) return launch<BF16, 16, 1>(x, codes, sm, bias, out);
  if (warps == 16 && tiles == 2) return launch<BF16, 16, 2>(x, codes, sm, bias, out);
  if (warps == 16 && tiles == 4) return launch<BF16, 16, 4>(x, codes, sm, bias, out);
  if (warps == 4 && tiles == 8) return launch<BF16, 4, 8>(x, codes, sm, bias, out);
  TORCH_CHECK(false, "int4_products: no launch of ", warps, " warps and ", tiles, " tiles");
}

}  // namespace

// out (M, N) = x (M, K) times the packed weight (plus bias); warps and tiles: one of the launches above.
void int4_products(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& sm,
                   const c10::optional<torch::Tensor>& bias, torch::Tensor& out, int64_t warps, int64_t tiles) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && (x.scalar_type() == torch::kBFloat16 ||
              x.scalar_type() == torch::kHalf), "int4_products: x must be a contiguous bf16 or fp16 CUDA tensor");
  TORCH_CHECK(M >= 1 && M <= 8 && K % 64 == 0 && N % (16 * tiles) == 0, "int4_products: M must be 1-8, K a ",
              "multiple of 64 and N of 16 times tiles; got M ", M, ", K ", K, ", N ", N);
  TORCH_CHECK(codes.numel() == N * K / 8 && sm.numel() == N * K / 32 * 2 && out.scalar_type() == x.scalar_type(),
              "int4_products: the packed operands or out do not match x");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "int4_products: bias must be (N,) of x's dtype");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (x.scalar_type() == torch::kBFloat16) {
    dispatch<true>(x, codes, sm, b, out, warps, tiles);
  } else {
    dispatch<false>(x, codes, sm, b, out, warps, tiles);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_products", &int4_products, "products of packed 4-bit weights with 1-8 rows");
}
