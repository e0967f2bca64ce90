// Fused grammar-mask kernel: packed bitmask -> logits, with per-row skip flags, an optional
// draft->target vocabulary map (d2t), optional temperature scaling and optional greedy argmax.
//
// Why one kernel: at batch 1 the mask, the temperature divide and the argmax are three or more
// launches of a few microseconds each over a few hundred KB; fused they are one pass over the
// logits and one launch. It is graph-capturable: it allocates nothing, reads every per-row
// input (flags, temperature) from device memory, and launches on the stream it is given.
//
// Semantics, for each row r < rows and token j < vocab:
//   allowed(j) = !flags || flags[r] != 0 ? bit(bitmask[r], t(j)) : true, where t(j) = d2t ? d2t[j] : j
//                (bit t of word t/32 set = allowed, xgrammar's layout; t past the mask's words
//                 is disallowed, so a padded vocabulary can never be sampled)
//   v(j)       = allowed(j) ? x(j) : -inf, then divided by temperature[r] when it is > 0
//   write      : logits[r, j] = v(j) (only where it changes)
//   argmax_out : argmax_out[r] = t(argmax_j v(j)), NaN counts as -inf, ties go to the lowest j
//                (torch.argmax's rule), so a drafter gets a target-vocabulary id directly.
// The argmax crosses blocks through a per-row 64-bit key (ordered float << 32 | ~index) and a
// per-row arrival counter in `workspace` (rows * 12 bytes, zero on first use): the last block to
// arrive writes the answer and puts both back to zero, so the next launch (or graph replay)
// finds them clean without a memset launch.
//
// No torch headers: the launcher takes raw pointers, which keeps this translation unit quick to
// build and lets `nvcc -c` check it anywhere.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum FlagKind : int { kNoFlags = 0, kFlagI32 = 1, kFlagU8 = 2 };

struct Args {
  void* logits;
  int64_t vocab;
  int64_t logits_stride;
  const int32_t* bitmask;
  int64_t bitmask_stride;
  int64_t bitmask_words;
  const void* flags;
  int flag_kind;
  const void* d2t;
  int d2t_is64;
  const float* temperature;
  int64_t* argmax_out;
  unsigned long long* keys;
  unsigned int* counters;
  int write;
  int64_t tokens_per_block;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ int64_t target_id(const Args& a, int64_t j) {
  if (a.d2t == nullptr) return j;
  return a.d2t_is64 ? static_cast<const int64_t*>(a.d2t)[j]
                    : static_cast<int64_t>(static_cast<const int32_t*>(a.d2t)[j]);
}

__device__ __forceinline__ bool bit_allowed(const int32_t* row_mask, int64_t words, int64_t t) {
  if (t < 0 || t >= words * 32) return false;
  return (static_cast<uint32_t>(row_mask[t >> 5]) >> (t & 31)) & 1u;
}

// Larger key = larger value; among equal values the lower token index wins.
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t j) {
  if (v != v) v = -INFINITY;  // NaN never wins
  v += 0.0f;                  // -0 -> +0, so the two zeros tie as torch.argmax sees them
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}

__device__ __forceinline__ unsigned long long max_key(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) mask_kernel(Args a) {
  const int64_t row = blockIdx.y;
  bool masked = true;
  if (a.flag_kind == kFlagI32) masked = static_cast<const int32_t*>(a.flags)[row] != 0;
  if (a.flag_kind == kFlagU8) masked = static_cast<const uint8_t*>(a.flags)[row] != 0;
  const float temp = a.temperature ? a.temperature[row] : 0.0f;
  const bool scale = temp > 0.0f;
  const bool want_max = a.argmax_out != nullptr;
  const bool write = a.write != 0 && (masked || scale);
  if (!write && !want_max) return;  // an unconstrained row with nothing to compute

  T* x = static_cast<T*>(a.logits) + row * a.logits_stride;
  const int32_t* bm = a.bitmask + row * a.bitmask_stride;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * a.tokens_per_block;
  const int64_t end = min(begin + a.tokens_per_block, a.vocab);
  constexpr uint32_t kFull = (VEC == 32) ? 0xFFFFFFFFu : ((1u << VEC) - 1u);
  unsigned long long best = 0;

  for (int64_t j0 = begin + static_cast<int64_t>(threadIdx.x) * VEC; j0 < end;
       j0 += static_cast<int64_t>(kThreads) * VEC) {
    const int n = static_cast<int>(min(static_cast<int64_t>(VEC), end - j0));
    // Which of the VEC tokens are allowed, as bits. Without d2t the VEC tokens share one word
    // (VEC divides 32 and j0 is a multiple of VEC).
    uint32_t allow = kFull;
    if (masked) {
      if (a.d2t == nullptr) {
        // A word covers all VEC tokens or none of them, so the mask's end needs no lane check.
        allow = (j0 < a.bitmask_words * 32)
                    ? (static_cast<uint32_t>(bm[j0 >> 5]) >> (j0 & 31)) & kFull
                    : 0u;
      } else {
        allow = 0u;
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (i < n && bit_allowed(bm, a.bitmask_words, target_id(a, j0 + i))) allow |= 1u << i;
      }
    }
    const uint32_t lanes = (n == VEC) ? kFull : ((1u << n) - 1u);
    allow &= lanes;

    if (!scale && !want_max) {
      // Pure mask: skip the read when nothing or everything is masked (xgrammar's trick).
      if (allow == lanes) continue;
      if constexpr (VEC > 1) {
        if (allow == 0u && n == VEC) {
          alignas(16) T v[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] = from_float<T>(-INFINITY);
          *reinterpret_cast<uint4*>(x + j0) = *reinterpret_cast<const uint4*>(v);
          continue;
        }
      }
    }

    alignas(16) T v[VEC];
    if constexpr (VEC > 1) {
      if (n == VEC) {
        *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(x + j0);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (i < n) v[i] = x[j0 + i];  // constant indices keep v in registers
      }
    } else {
      v[0] = x[j0];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (i >= n) break;
      float f = ((allow >> i) & 1u) ? to_float(v[i]) : -INFINITY;
      if (scale) f = f / temp;
      if (want_max) best = max_key(best, argmax_key(f, j0 + i));
      v[i] = from_float<T>(f);
    }
    if (write) {
      if constexpr (VEC > 1) {
        if (n == VEC) {
          *reinterpret_cast<uint4*>(x + j0) = *reinterpret_cast<const uint4*>(v);
        } else {
#pragma unroll
          for (int i = 0; i < VEC; ++i)
            if (i < n) x[j0 + i] = v[i];
        }
      } else {
        x[j0] = v[0];
      }
    }
  }

  if (!want_max) return;
  // Block max of the keys: warp shuffles, then one warp over the warps' results.
  __shared__ unsigned long long warp_best[kWarps];
  for (int off = 16; off > 0; off >>= 1) best = max_key(best, __shfl_xor_sync(0xFFFFFFFFu, best, off));
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x >= 32) return;
  best = threadIdx.x < kWarps ? warp_best[threadIdx.x] : 0ull;
  for (int off = 16; off > 0; off >>= 1) best = max_key(best, __shfl_xor_sync(0xFFFFFFFFu, best, off));
  if (threadIdx.x != 0) return;
  atomicMax(&a.keys[row], best);
  __threadfence();
  const unsigned int arrived = atomicAdd(&a.counters[row], 1u);
  if (arrived == gridDim.x - 1) {  // the last block of this row: publish and reset
    const unsigned long long key = atomicExch(&a.keys[row], 0ull);
    const int64_t j = static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFFFull));
    a.argmax_out[row] = target_id(a, j);
    a.counters[row] = 0u;
  }
}

template <typename T>
cudaError_t launch_typed(Args a, int64_t rows, bool vector_ok, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int vec = vector_ok ? kVec : 1;
  // One vector per thread per block-step; at least 4 steps per block once the grid is large,
  // so small batches still spread over many SMs and big ones do not pay per-block overheads.
  const int64_t step = static_cast<int64_t>(kThreads) * vec;
  const int64_t blocks_1 = (a.vocab + step - 1) / step;
  const int64_t steps = (rows * blocks_1 >= 4096) ? 4 : 1;
  a.tokens_per_block = step * steps;
  const dim3 grid(static_cast<unsigned>((a.vocab + a.tokens_per_block - 1) / a.tokens_per_block),
                  static_cast<unsigned>(rows));
  if (vector_ok)
    mask_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(a);
  else
    mask_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

// Launches the kernel on `stream`; returns a cudaError_t (0 = launched). Arguments are checked
// by the Python wrapper (structgen/engine/kernels/mask_apply.py); this only refuses shapes the
// grid cannot express.
int sg_mask_apply(void* logits, int dtype, int64_t rows, int64_t vocab, int64_t logits_stride,
                  const int32_t* bitmask, int64_t bitmask_stride, int64_t bitmask_words,
                  const void* flags, int flag_kind, const void* d2t, int d2t_is64,
                  const float* temperature, int64_t* argmax_out, void* workspace, int write,
                  void* stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  if (rows > 65535 || vocab >= (int64_t(1) << 32)) return cudaErrorInvalidValue;
  if (argmax_out != nullptr && workspace == nullptr) return cudaErrorInvalidValue;
  Args a;
  a.logits = logits;
  a.vocab = vocab;
  a.logits_stride = logits_stride;
  a.bitmask = bitmask;
  a.bitmask_stride = bitmask_stride;
  a.bitmask_words = bitmask_words;
  a.flags = flags;
  a.flag_kind = flags ? flag_kind : kNoFlags;
  a.d2t = d2t;
  a.d2t_is64 = d2t_is64;
  a.temperature = temperature;
  a.argmax_out = argmax_out;
  a.keys = static_cast<unsigned long long*>(workspace);
  a.counters = workspace ? reinterpret_cast<unsigned int*>(a.keys + rows) : nullptr;
  a.write = write;
  a.tokens_per_block = 0;
  auto s = static_cast<cudaStream_t>(stream);
  const uintptr_t base = reinterpret_cast<uintptr_t>(logits);
  const int elt = dtype == kF32 ? 4 : 2;
  const int vec = 16 / elt;
  const bool vector_ok = base % 16 == 0 && logits_stride % vec == 0;
  switch (dtype) {
    case kF32: return launch_typed<float>(a, rows, vector_ok, s);
    case kF16: return launch_typed<__half>(a, rows, vector_ok, s);
    case kBF16: return launch_typed<__nv_bfloat16>(a, rows, vector_ok, s);
    default: return cudaErrorInvalidValue;
  }
}
