// What the CUDA kernels share: building tensor-core operands from codes in registers, and the m16n8k16 product.
#pragma once

#include <cuda_runtime.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <utility>

namespace sparsekv {

// (a & mask) | bits in one instruction: a field of a code word or-ed into the mantissa of a magic float.
__device__ __forceinline__ uint32_t or_and(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

// The 16-bit float 2^(M - low) (M: its mantissa bits, 7 for bf16, 10 for fp16), whose bits or-ed with a field at
// mantissa bit ``low`` make the float 2^(M - low) + field, exactly.
template <bool BF16>
__host__ __device__ constexpr uint32_t magic(int low) {
  return BF16 ? (134u - low) << 7 : (25u - low) << 10;
}

// d = c + a b for the A fragment a0..a3 and the B fragment b0, b1 of 16-bit floats, bf16 or fp16, summed in fp32
// (d and c may be the same registers).
template <bool BF16>
__device__ __forceinline__ void mma(float* d, const float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

// d += a b, as above.
template <bool BF16>
__device__ __forceinline__ void mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  mma<BF16>(d, d, a0, a1, a2, a3, b0, b1);
}

// 2^x (0 for -inf), approximate as the softmax's own.
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Asynchronous copies from global to shared memory (cp.async): 16 bytes to the shared address ``shared``, past L1;
// the copies since the last commit form a group; waits until at most N of this thread's groups are in flight.
__device__ __forceinline__ void copy16(uint32_t shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared), "l"(global));
}

// The same for 8 bytes, through L1.
__device__ __forceinline__ void copy8(uint32_t shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(shared), "l"(global));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Programmatic dependent launch (``kernels.set_programmatic_launch``), where a kernel begins to touch memory the
// kernel before it in the stream writes or reads: waits until that kernel has finished and its writes are visible,
// then lets the kernel after this one launch. Both instructions do nothing in a launch without the attribute.
__device__ __forceinline__ void dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, shared, the current stream>>>(args...), with programmatic dependent launch if pdl.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, bool pdl, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = c10::cuda::getCurrentCUDAStream();
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace sparsekv
