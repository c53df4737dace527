// Page log-sum-exps of logits estimated from low-bit key codes (``reference.coded_page_lse``) on tensor cores
// (mma.sync, sm_80 and later).
//
// A key is min + level * (max - min) / L on its page's range (L = 2^BITS - 1), so a head's logit splits into a part
// per page and a part per token: q . k = q . min + (w . level) / L with w = q * (max - min) per channel, both in
// m16n8k16 products of the cache's 16-bit type T (bf16 or fp16) summed in fp32. q . min is a product of the page
// minima (A, read by ldmatrix; every row of a page the same) with q (B), exact. w is computed once per page and
// head in T (the range and the product each rounded once) and is the B operand of one product per 16 tokens and 16
// channels, whose A operand is the levels, read as they are stored: one or-and (lop3) puts two of them in the
// mantissas of two floats of T, magic + level with a power of two magic per field, exactly. What the magics add
// (their product with w, the same for every token of a page) is one more product per page, subtracted. The
// channels of a product need not be consecutive: a lane takes the levels its 32-bit words hold and the w of the
// same channels, since a dot product does not depend on the order of its terms.
//
// Columns: with R = 2 (at most 4 query heads per KV head) a product covers two pages, columns 0-3 the heads of
// the first and 4-7 those of the second, A's rows 0-7 the first page's tokens and 8-15 the second's, so that w is
// computed by every lane for a (page, head) of its own; with R = 1 (5-8 heads) one page and its 8 head columns.
//
// Operands: q (B, H, D), kmin and kmax (B, Hkv, C, D) of the same strides, in bf16 or fp16; codes (B, Hkv, C, P,
// D * BITS / 8) uint8 with (P, bytes) contiguous; slot_page (B, Hkv, C), seq_len and first (B,) int64. Output out
// (B, H, C) float32, each head's log-sum-exp of each page's logits (-inf for free slots), and part (B * H, blocks)
// float32, the log-sum-exp of each block's pages. A block of W warps takes ``chunk`` slots of one (row, KV head),
// each warp a group of R pages at a time; a warp copies the bounds and codes of its next groups into shared memory
// (cp.async, STAGES groups ahead) while it computes the current one, so that enough bytes are in flight with few
// registers. Given the keys (B, Hkv, C, P, D) and cur_slot (B, Hkv), the warp whose groups hold a row's current page
// codes it first (``reference.code_page``), so that lowbit's step needs no launch for it.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>
#include <utility>

#include "fragments.cuh"

namespace {

using sparsekv::commit_copies;
using sparsekv::copy16;
using sparsekv::copy8;
using sparsekv::ex2;
using sparsekv::magic;
using sparsekv::mma;
using sparsekv::or_and;
using sparsekv::wait_copies;

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr int kMaxChunk = 256;  // slots a block may take: its pages' log-sum-exps are kept in shared memory

// One word of a 16-bit half of a (its low half) and one of b (its high half): the high halves where HIGH_A, HIGH_B.
template <bool HIGH_A, bool HIGH_B>
__device__ __forceinline__ uint32_t halves(uint32_t a, uint32_t b) {
  return __byte_perm(a, b, (HIGH_A ? 0x0032 : 0x0010) | (HIGH_B ? 0x7600 : 0x5400));
}

// Arithmetic on two 16-bit floats of the cache's type.
template <bool BF16>
struct Half {
  using T2 = std::conditional_t<BF16, __nv_bfloat162, __half2>;
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) {
    const T2 r = __hsub2(*reinterpret_cast<const T2*>(&a), *reinterpret_cast<const T2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }

  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    const T2 r = __hmul2(*reinterpret_cast<const T2*>(&a), *reinterpret_cast<const T2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
};

// Field j of both 16-bit halves of a word of BITS-bit codes (channels j and 16 / BITS + j of the word), at mantissa
// bit LOW once the word is shifted down by SH (a multiple of S, so that LOW + BITS <= 7: a field fits a bf16
// mantissa, and an fp16 one).
template <int BITS, int J>
struct Field {
  static constexpr int S = ((8 - BITS) / BITS) * BITS, SH = (J * BITS / S) * S, LOW = J * BITS - SH;
  static constexpr uint32_t mask = (((1u << BITS) - 1) << LOW) * 0x10001u;
};

// The levels of every field of a word as 16-bit pairs magic + level (one or-and each: the field in the mantissa
// of the magic's float), out[j] for field j.
template <bool BF16, int BITS, int... J>
__device__ __forceinline__ void all_levels(uint32_t word, uint32_t* out, std::integer_sequence<int, J...>) {
  ((out[J] = or_and(word >> Field<BITS, J>::SH, Field<BITS, J>::mask,
                    magic<BF16>(Field<BITS, J>::LOW) * 0x10001u)), ...);
}

template <bool BF16, int BITS, int... J>
__device__ __forceinline__ void all_magic(uint32_t* out, std::integer_sequence<int, J...>) {
  ((out[J] = magic<BF16>(Field<BITS, J>::LOW) * 0x10001u), ...);
}

__device__ __forceinline__ float lg2(float x) {  // log2 x, -inf for 0
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

template <int BITS, int D, int R, int P>
struct Coded {
  static constexpr int GP = 8 / R;                  // head columns per page
  static constexpr int NI = P * R / 16;             // products (of 16 rows) per group of R pages
  static constexpr int WL = D * BITS / 128;         // 32-bit words of codes per lane and token
  static constexpr int NW = D / 8;                  // words (two channels each) of a page's bounds per lane
  static constexpr int FW = 16 / BITS;              // fields per 16-bit half of a word of codes
  static constexpr int NV = R == 2 ? 2 : 4;         // a lane's logits per product: (token, column) pairs it outputs
  static constexpr int ROW = D * BITS / 8;          // bytes of codes per token
  static constexpr int BOUNDS = R * 2 * D / 8;      // 16-byte chunks of a group's bounds: page, (min, max), dim
  static constexpr int CHUNKS = BOUNDS + R * P * ROW / 16;  // then its codes: page, token, byte
  static constexpr int STAGES = BITS == 4 ? 3 : 4;  // groups in flight per warp (within 48 KB a block of 4 warps)
  static constexpr int COPIES = (CHUNKS + 31) / 32;  // 16-byte copies per lane and group
  static_assert(NI >= 1 && (P * R) % 16 == 0 && WL >= 1 && D % 64 == 0, "unsupported shape");
};

__device__ __forceinline__ void load16(const uint16_t* p, uint32_t* out) {  // 8 values, 16-byte aligned
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}

template <bool BF16>
__device__ __forceinline__ float half_at(const uint32_t* words, int i) {  // value i of 16-bit values in words
  const uint32_t bits = (words[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
  if constexpr (BF16) return __uint_as_float(bits << 16);
  else return __half2float(__ushort_as_half((unsigned short)bits));
}

// The codes of one page (``reference.key_codes``, rounded as it rounds: a float32 division rounded to nearest, then
// half to even) by one warp: keys (P, D) of row stride sk_p, its minima and maxima (D), codes (P, D * BITS / 8). A
// lane takes one 32-bit word of codes (N channels) of every 32 / WORDS-th token: its bounds are read once, and all
// its keys before any is coded, so that the warp waits for memory once.
template <bool BF16, int BITS, int D, int P>
__device__ __noinline__ void code_page(const uint16_t* keys, int64_t sk_p, const uint16_t* lo,
                                       const uint16_t* hi, uint8_t* codes, int lane) {
  constexpr int N = 32 / BITS, WORDS = D / N, TOKENS = 32 / WORDS, ITER = P / TOKENS;
  static_assert(32 % WORDS == 0 && P % TOKENS == 0, "unsupported shape");
  constexpr float L = (1 << BITS) - 1;
  const int d0 = lane % WORDS * N, j0 = lane / WORDS;
  uint32_t lw[N / 2], hw[N / 2], kw[ITER][N / 2];
#pragma unroll
  for (int i = 0; i < N / 8; ++i) load16(lo + d0 + 8 * i, lw + 4 * i), load16(hi + d0 + 8 * i, hw + 4 * i);
#pragma unroll
  for (int it = 0; it < ITER; ++it)
#pragma unroll
    for (int i = 0; i < N / 8; ++i) load16(keys + (j0 + it * TOKENS) * sk_p + d0 + 8 * i, kw[it] + 4 * i);
  uint32_t word[ITER] = {};
#pragma unroll
  for (int c = 0; c < N; ++c) {  // channel by channel: its bounds are unpacked once
    const float l = half_at<BF16>(lw, c), width = half_at<BF16>(hw, c) - l, inv = __frcp_rn(width);
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
      const float a = half_at<BF16>(kw[it], c) - l;
      // (a / width) * L rounded to an integer, from the reciprocal: its error (a few ulps, under 2^-10 for
      // |x| < 1024) changes the integer only near a half, where (or when x is not finite) the division is done.
      float x = a * inv * L, level = rintf(x);
      if (!(fabsf(x - level) < 0.5f - 0x1p-10f && fabsf(x) < 1024.f)) {
        x = __fdiv_rn(a, width) * L;
        level = x == x ? rintf(x) : 0.f;  // NaN codes 0
      }
      word[it] |= (width > 0.f ? (uint32_t)fminf(fmaxf(level, 0.f), L) : 0u) << (c * BITS);
    }
  }
#pragma unroll
  for (int it = 0; it < ITER; ++it)
    reinterpret_cast<uint32_t*>(codes + (j0 + it * TOKENS) * (D * BITS / 8))[lane % WORDS] = word[it];
}

// The current pages to code first (keys null: none): keys (B, Hkv, C, P, D) and cur_slot (B, Hkv) with their strides.
struct Coding {
  const uint16_t* keys;
  const int64_t* cur_slot;
  int64_t sk_b, sk_h, sk_c, sk_p, su_b, su_h;
};

template <bool BF16, int BITS, int D, int R, int P, int W>
__global__ void __launch_bounds__(W * 32) lse_kernel(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ kmin, const uint16_t* __restrict__ kmax,
    uint8_t* codes, const Coding coding, const int64_t* __restrict__ slot_page, const int64_t* __restrict__ seq_len,
    const int64_t* __restrict__ first, float* __restrict__ out, float* __restrict__ part, int HKV, int G, int C,
    int chunk, int n_parts, float qscale, int reuse, int64_t sq_b, int64_t sq_h, int64_t sm_b, int64_t sm_h,
    int64_t sm_c, int64_t sc_b, int64_t sc_h, int64_t sc_c, int64_t ss_b, int64_t ss_h, int64_t so_b, int64_t so_h) {
  using K = Coded<BITS, D, R, P>;
  using H = Half<BF16>;
  constexpr int GP = K::GP, NI = K::NI, WL = K::WL, NW = K::NW, FW = K::FW, STAGES = K::STAGES;
  // Per warp and stage: a group's bounds and codes, and its pages' numbers (cp.async); the block's page values.
  __shared__ uint4 stage[W][STAGES][K::CHUNKS];
  __shared__ int64_t pages[W][STAGES][R];
  __shared__ float values[kMaxChunk][8];  // log2-sum-exp per slot of the block and head
  const int row = blockIdx.x, b = row / HKV, kvh = row % HKV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int s0 = blockIdx.y * chunk, s1 = min(C, s0 + chunk), groups = (s1 - s0 + R - 1) / R;
  sparsekv::dependent_launch();
  if (coding.keys != nullptr) {
    // The warp whose groups hold the current page (slot 0 for a row without pages) codes it before it copies any
    // codes, at every step, whether or not the row chooses this step.
    const int64_t cur = max(coding.cur_slot[b * coding.su_b + kvh * coding.su_h], (int64_t)0);
    if (cur >= s0 && cur < s1 && (cur - s0) / R % W == warp) {
      const int64_t bounds = b * sm_b + kvh * sm_h + cur * sm_c;
      code_page<BF16, BITS, D, P>(coding.keys + b * coding.sk_b + kvh * coding.sk_h + cur * coding.sk_c, coding.sk_p,
                                  kmin + bounds, kmax + bounds, codes + b * sc_b + kvh * sc_h + cur * sc_c, lane);
      __threadfence();  // the codes are in memory before the warp's copies read them
      __syncwarp();
    }
  }
  const int64_t n = seq_len[b];
  if (reuse > 1 && (n - 1) % reuse != 0 && n - 1 != first[b]) return;  // the row keeps its choice
  for (int i = threadIdx.x; i < kMaxChunk * 8; i += W * 32) (&values[0][0])[i] = -INFINITY;
  // B column g: page g / GP of a group, head g % GP; output columns 2t, 2t + 1: page 2t / GP, heads 2t % GP + 0, 1.
  const int bpage = g / GP, bhead = g % GP, opage = (2 * t) / GP, ohead = (2 * t) % GP;
  // Lane t's channels: in the product of q with the minima (A from ldmatrix), 16s + 2t, 16s + 2t + 1 and
  // 16s + 8 + 2t, 16s + 9 + 2t at step s (q's words 8s + t and 8s + 4 + t: qb); in the products of the levels,
  // D / 4 * t .. D / 4 * (t + 1) - 1, paired as its words of codes pair them, channels j and FW + j of each word's
  // 2 * FW (qp).
  uint32_t qb[NW], qp[NW];
  {
    const uint32_t* qh = reinterpret_cast<const uint32_t*>(q + b * sq_b + (int64_t)(kvh * G + bhead) * sq_h);
#pragma unroll
    for (int i = 0; i < NW; ++i) qb[i] = bhead < G ? qh[8 * (i / 2) + 4 * (i % 2) + t] : 0u;
#pragma unroll
    for (int r = 0; r < NW; ++r) {
      const int e0 = r / FW * 2 * FW + r % FW, e1 = e0 + FW;  // channels of pair r
      const uint32_t w0 = bhead < G ? qh[t * NW + e0 / 2] : 0u, w1 = bhead < G ? qh[t * NW + e1 / 2] : 0u;
      qp[r] = e0 % 2 ? halves<true, true>(w0, w1) : halves<false, false>(w0, w1);
    }
  }
  uint32_t magics[FW];  // the A operand whose product with w is what the levels' magics add, as the quads of a step
  all_magic<BF16, BITS>(magics, std::make_integer_sequence<int, FW>{});
  uint32_t quad[FW / 2][4];
#pragma unroll
  for (int i = 0; i < FW / 2; ++i)
    quad[i][0] = quad[i][1] = magics[2 * i], quad[i][2] = quad[i][3] = magics[2 * i + 1];
  const int mine = warp < groups ? (groups - warp + W - 1) / W : 0;  // groups warp, warp + W, ... of the block
  // This lane's copies of a group: chunk x = lane + 32 j of its stage, from src[j], which moves on by the warp's
  // stride (W groups) at each issue.
  const char* src[K::COPIES];
  int64_t step[K::COPIES];
  int at_page[K::COPIES];
#pragma unroll
  for (int j = 0; j < K::COPIES; ++j) {
    const int x = lane + 32 * j;
    if (x < K::BOUNDS) {
      const int page = x / (2 * D / 8), kind = (x / (D / 8)) % 2;
      src[j] = reinterpret_cast<const char*>((kind ? kmax : kmin) + b * sm_b + kvh * sm_h + x % (D / 8) * 8);
      step[j] = sm_c * 2, at_page[j] = page;
    } else {
      const int y = x - K::BOUNDS, page = y / (P * K::ROW / 16);
      src[j] = reinterpret_cast<const char*>(codes + b * sc_b + kvh * sc_h) + y % (P * K::ROW / 16) * 16;
      step[j] = sc_c, at_page[j] = x < K::CHUNKS ? page : R;  // R: no chunk
    }
    src[j] += (s0 + warp * R + at_page[j] % R) * step[j];
    step[j] *= W * R;
  }
  const int64_t* sp = slot_page + b * ss_b + kvh * ss_h;
  float* const out_row = out + b * so_b + (int64_t)(kvh * G + ohead) * so_h;
  const uint32_t stage0 = (uint32_t)__cvta_generic_to_shared(stage[warp][0]);
  // ldmatrix's rows: lanes 0-7 (8-15) the first (second) page's minima of a step's first 8 channels, lanes 16-31
  // the same for its last 8 (rows g of the A operand a page's minima, rows g + 8 the next page's).
  const uint32_t minima = ((lane >> 3) & (R - 1)) * 2 * D * 2 + (lane >> 4) * 16;
  const uint32_t pages0 = (uint32_t)__cvta_generic_to_shared(pages[warp][0]);

  auto issue = [&](int k) {  // the copies of the warp's k-th group into stage k % STAGES
    if (k < mine) {
      const int c0 = s0 + (warp + k * W) * R;
      const uint32_t dst = stage0 + (k % STAGES) * K::CHUNKS * 16 + lane * 16;
#pragma unroll
      for (int j = 0; j < K::COPIES; ++j)
        if (at_page[j] < R && c0 + at_page[j] < C) copy16(dst + j * 512, src[j]);
      if (lane < R && c0 + lane < C) copy8(pages0 + ((k % STAGES) * R + lane) * 8, sp + c0 + lane);
    }
#pragma unroll
    for (int j = 0; j < K::COPIES; ++j) src[j] += step[j];
    commit_copies();
  };

  __syncthreads();  // the values' -inf are written
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) issue(k);
  for (int k = 0; k < mine; ++k) {
    wait_copies<STAGES - 2>();
    __syncwarp();  // every lane's copies of group k have landed; every lane is done with group k - 1's stage
    issue(k + STAGES - 1);
    const uint4* st = stage[warp][k % STAGES];
    const int c0 = s0 + (warp + k * W) * R;
    // w = q * (max - min) on the lane's channels of B column g's page and head, paired as the levels are (the B
    // operand).
    uint32_t w[NW];
    {
      uint32_t diff[NW];
#pragma unroll
      for (int i = 0; i < NW / 4; ++i) {
        const uint4* row = st + 2 * bpage * (D / 8) + t * (NW / 4) + i;  // its minima, then D / 8 chunks on its maxima
        const uint4 l = row[0], h = row[D / 8];
        diff[4 * i] = H::sub(h.x, l.x), diff[4 * i + 1] = H::sub(h.y, l.y);
        diff[4 * i + 2] = H::sub(h.z, l.z), diff[4 * i + 3] = H::sub(h.w, l.w);
      }
#pragma unroll
      for (int r = 0; r < NW; ++r) {
        const int e0 = r / FW * 2 * FW + r % FW, e1 = e0 + FW;
        const uint32_t d = e0 % 2 ? halves<true, true>(diff[e0 / 2], diff[e1 / 2])
                                  : halves<false, false>(diff[e0 / 2], diff[e1 / 2]);
        w[r] = H::mul(d, qp[r]);
      }
    }
    // The page part q . min (rows g: the first page's minima, g + 8: the second's) and what the magics add.
    float base[4] = {0.f, 0.f, 0.f, 0.f}, offset[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t rows = stage0 + (k % STAGES) * K::CHUNKS * 16 + minima;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      uint32_t a0, a1, a2, a3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(rows + 32 * s));
      mma<BF16>(base, a0, a1, a2, a3, qb[2 * s], qb[2 * s + 1]);
      const uint32_t* m = quad[s % (FW / 2)];
      mma<BF16>(offset, m[0], m[1], m[2], m[3], w[2 * s], w[2 * s + 1]);
    }
    // The token part, and each output value's logit (log2 units).
    const uint8_t* cs = reinterpret_cast<const uint8_t*>(st + K::BOUNDS) + t * WL * 4;
    constexpr float levels = (1 << BITS) - 1;
    float x[NI][K::NV];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      uint32_t a[2][NW];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // A row g + 8r: with R = 2 page r of the group, token 8i + g; with R = 1 token 16i + 8r + g.
        const int at = (R == 2 ? r * P + 8 * i + g : 16 * i + 8 * r + g) * K::ROW;
        uint32_t words[WL];
        if constexpr (WL == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(cs + at);
          words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
        } else if constexpr (WL == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(cs + at);
          words[0] = v.x, words[1] = v.y;
        } else {
          words[0] = *reinterpret_cast<const uint32_t*>(cs + at);
        }
#pragma unroll
        for (int u = 0; u < WL; ++u)
          all_levels<BF16, BITS>(words[u], a[r] + u * FW, std::make_integer_sequence<int, FW>{});
      }
      float d[4] = {0.f, 0.f, 0.f, 0.f};  // not -offset: the token products need not wait for the page products
#pragma unroll
      for (int s = 0; s < D / 16; ++s)
        mma<BF16>(d, a[0][2 * s], a[1][2 * s], a[0][2 * s + 1], a[1][2 * s + 1], w[2 * s], w[2 * s + 1]);
      // This lane's useful rows: with R = 2 row g (first page) or g + 8 (second), by its columns' page: a select,
      // not an index, so that d, base and offset stay in registers.
#pragma unroll
      for (int v = 0; v < K::NV; ++v) {
        const bool second = R == 2 && opage;
        const float page_part = fmaf(second ? offset[v + 2] : offset[v], -1.f / levels, second ? base[v + 2] : base[v]);
        x[i][v] = fmaf(second ? d[v + 2] : d[v], qscale / levels, qscale * page_part);
      }
    }
    // Mask (free slot, past the row's length, padded head), then each column's log-sum-exp over the page's tokens.
    const int slot = c0 + opage;
    const int64_t page = slot < C ? pages[warp][k % STAGES][opage] : -1;
    const int64_t left = page < 0 ? 0 : n - page * P;  // the page holds min(left, P) tokens when positive
    const int held = left < 0 ? 0 : left < P ? (int)left : P;
    float m[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int v = 0; v < K::NV; ++v) {
        const int col = v % 2, token = R == 2 ? 8 * i + g : 16 * i + 8 * (v / 2) + g;
        x[i][v] = token < held && ohead + col < G ? x[i][v] : -INFINITY;
        m[col] = fmaxf(m[col], x[i][v]);
      }
#pragma unroll
    for (int col = 0; col < 2; ++col) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) m[col] = fmaxf(m[col], __shfl_xor_sync(0xFFFFFFFFu, m[col], off));
    }
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NI; ++i)
#pragma unroll
      for (int v = 0; v < K::NV; ++v) s[v % 2] += ex2(x[i][v] - (m[v % 2] == -INFINITY ? 0.f : m[v % 2]));
#pragma unroll
    for (int col = 0; col < 2; ++col) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) s[col] += __shfl_xor_sync(0xFFFFFFFFu, s[col], off);
      if (g == 0 && slot < s1 && ohead + col < G) {
        const float lse = m[col] + lg2(s[col]);  // -inf for a page without tokens
        out_row[col * so_h + slot] = lse * kLn2;
        values[slot - s0][ohead + col] = lse;
      }
    }
  }
  wait_copies<0>();
  __syncthreads();
  // Each head's log-sum-exp over the block's pages.
  for (int head = warp; head < G; head += W) {
    float v[kMaxChunk / 32], top = -INFINITY, sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxChunk / 32; ++i) top = fmaxf(top, v[i] = values[lane + 32 * i][head]);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, off));
    const float safe = top == -INFINITY ? 0.f : top;
#pragma unroll
    for (int i = 0; i < kMaxChunk / 32; ++i) sum += ex2(v[i] - safe);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    if (lane == 0) part[(int64_t)(row * G + head) * n_parts + blockIdx.y] = (safe + lg2(sum)) * kLn2;
  }
}

template <bool BF16, int BITS, int D, int R>
void launch(const torch::Tensor& q, const torch::Tensor& kmin, const torch::Tensor& kmax, const torch::Tensor& codes,
            const Coding& coding, const torch::Tensor& slot_page, const torch::Tensor& seq_len,
            const torch::Tensor& first, torch::Tensor& out, torch::Tensor& part, double scale, int64_t reuse,
            int64_t chunk, bool pdl) {
  constexpr int P = 16, W = 4;
  const int B = q.size(0), H = q.size(1), HKV = kmin.size(1), C = kmin.size(2);
  const dim3 grid(B * HKV, part.size(1));
  sparsekv::launch_kernel(lse_kernel<BF16, BITS, D, R, P, W>, grid, W * 32, 0, pdl,
      reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(kmin.data_ptr()),
      reinterpret_cast<const uint16_t*>(kmax.data_ptr()), codes.data_ptr<uint8_t>(), coding,
      slot_page.data_ptr<int64_t>(), seq_len.data_ptr<int64_t>(), first.data_ptr<int64_t>(), out.data_ptr<float>(),
      part.data_ptr<float>(), HKV, H / HKV, C, chunk, part.size(1), (float)scale * kLog2e, reuse, q.stride(0),
      q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), codes.stride(0), codes.stride(1), codes.stride(2),
      slot_page.stride(0), slot_page.stride(1), out.stride(0), out.stride(1));
}

template <bool BF16, int BITS>
void by_shape(int D, int R, const torch::Tensor& q, const torch::Tensor& kmin, const torch::Tensor& kmax,
              const torch::Tensor& codes, const Coding& coding, const torch::Tensor& slot_page,
              const torch::Tensor& seq_len, const torch::Tensor& first, torch::Tensor& out, torch::Tensor& part,
              double scale, int64_t reuse, int64_t chunk, bool pdl) {
#define SPARSEKV_CODED(DD, RR) \
  if (D == DD && R == RR)        \
  return launch<BF16, BITS, DD, RR>(q, kmin, kmax, codes, coding, slot_page, seq_len, first, out, part, scale, reuse, \
                                    chunk, pdl)
  if constexpr (BITS >= 2) {
    SPARSEKV_CODED(64, 1);
    SPARSEKV_CODED(64, 2);
  }
  SPARSEKV_CODED(128, 1);
  SPARSEKV_CODED(128, 2);
#undef SPARSEKV_CODED
  TORCH_CHECK(false, "coded_lse: no kernel for head_dim ", D, " at ", BITS, " bits");
}

}  // namespace

// (out, part) of the codes' page log-sum-exps; chunk: slots a block takes (even, at most kMaxChunk). With keys and
// cur_slot, each row's current page is coded first (``reference.code_page``), in codes. pdl: programmatic dependent
// launch.
std::vector<torch::Tensor> coded_lse(const torch::Tensor& q, const torch::Tensor& kmin, const torch::Tensor& kmax,
                                     const torch::Tensor& codes, const std::optional<torch::Tensor>& keys,
                                     const std::optional<torch::Tensor>& cur_slot, const torch::Tensor& slot_page,
                                     const torch::Tensor& seq_len, const torch::Tensor& first, double scale,
                                     int64_t bits, int64_t reuse, int64_t chunk, bool pdl) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), HKV = kmin.size(1), C = kmin.size(2);
  const auto type = q.scalar_type();
  TORCH_CHECK(q.is_cuda() && (type == torch::kBFloat16 || type == torch::kHalf) && kmin.scalar_type() == type &&
              kmax.scalar_type() == type, "coded_lse: q, kmin and kmax must be bf16 or fp16 CUDA tensors of one dtype");
  // The kernel copies the bounds and codes in 16-byte pieces (cp.async).
  auto aligned = [](const torch::Tensor& x, int64_t items) {
    return x.data_ptr() != nullptr && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % items == 0
           && x.stride(1) % items == 0 && x.stride(2) % items == 0;
  };
  TORCH_CHECK(q.stride(2) == 1 && kmin.strides() == kmax.strides() && kmin.stride(3) == 1 && aligned(kmin, 8) &&
              aligned(kmax, 8) && aligned(codes, 16), "coded_lse: q and the bounds must have a contiguous head dim, "
              "the bounds one layout, the bounds and codes aligned to 16 bytes");
  TORCH_CHECK(H % HKV == 0 && H / HKV <= 8 && (D == 64 || D == 128) && D * bits >= 128 && codes.size(3) == 16 &&
              codes.size(4) == D * bits / 8 && codes.stride(4) == 1 && codes.stride(3) == D * bits / 8 &&
              slot_page.scalar_type() == torch::kLong && seq_len.scalar_type() ==
              torch::kLong && first.scalar_type() == torch::kLong && chunk % 2 == 0 &&
              chunk >= 2 && chunk <= kMaxChunk,
              "coded_lse: unsupported shape (head_dim ", D, ", ", bits, " bits, ", H / HKV, " heads per KV head)");
  Coding coding{nullptr, nullptr, 0, 0, 0, 0, 0, 0};
  if (keys) {
    const torch::Tensor& k = *keys;
    TORCH_CHECK(cur_slot && cur_slot->scalar_type() == torch::kLong && k.scalar_type() == type && k.dim() == 5 &&
                k.size(2) == C && k.size(3) == 16 && k.size(4) == D && k.stride(4) == 1 && aligned(k, 8) &&
                k.stride(3) % 8 == 0, "coded_lse: keys must be (B, Hkv, C, 16, D) of q's dtype with a contiguous "
                "head dim, aligned to 16 bytes, and cur_slot (B, Hkv) int64");
    coding = Coding{reinterpret_cast<const uint16_t*>(k.data_ptr()), cur_slot->data_ptr<int64_t>(), k.stride(0),
                    k.stride(1), k.stride(2), k.stride(3), cur_slot->stride(0), cur_slot->stride(1)};
  }
  auto options = q.options().dtype(torch::kFloat);
  auto out = torch::empty({B, H, C}, options);
  auto part = torch::empty({B * H, (C + chunk - 1) / chunk}, options);
  const int R = H / HKV <= 4 ? 2 : 1;
  const bool bf16 = type == torch::kBFloat16;
#define SPARSEKV_BITS(BB)                                                                                       \
  if (bits == BB) {                                                                                           \
    if (bf16) by_shape<true, BB>(D, R, q, kmin, kmax, codes, coding, slot_page, seq_len, first, out, part,      \
                                 scale, reuse, chunk, pdl);                                                   \
    else by_shape<false, BB>(D, R, q, kmin, kmax, codes, coding, slot_page, seq_len, first, out, part, scale,  \
                             reuse, chunk, pdl);                                                              \
    return {out, part};                                                                                       \
  }
  SPARSEKV_BITS(1)
  SPARSEKV_BITS(2)
  SPARSEKV_BITS(4)
#undef SPARSEKV_BITS
  TORCH_CHECK(false, "coded_lse: bits must be 1, 2 or 4, got ", bits);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("coded_lse", &coded_lse, "page log-sum-exps of logits estimated from low-bit key codes");
}
