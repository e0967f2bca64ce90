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
//   argmax_out : argmax_out[r] = t(argmax_j v(j)) taken before the temperature divide (which
//                is monotonic: greedy picks the same token, and a read-only pass divides
//                nothing); NaN counts as -inf, ties go to the lowest j (torch.argmax's rule).
//                t() maps it, so a drafter gets a target-vocabulary id directly.
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

// Each thread owns STEPS vectors of VEC tokens, kThreads * VEC apart (coalesced); it issues
// all of its loads before using any, so STEPS * 16 bytes per thread are in flight.
// PURE: no temperature and no argmax anywhere in the launch (the common in-place mask), so the
// compiler drops those paths and their registers (bf16, STEPS=4: 36 instead of 63 per thread),
// which keeps more threads resident and more loads in flight.
template <typename T, int VEC, int STEPS, bool PURE>
__global__ void __launch_bounds__(kThreads) mask_kernel(Args a) {
  const int64_t row = blockIdx.y;
  bool masked = true;
  if (a.flag_kind == kFlagI32) masked = static_cast<const int32_t*>(a.flags)[row] != 0;
  if (a.flag_kind == kFlagU8) masked = static_cast<const uint8_t*>(a.flags)[row] != 0;
  const float temp = PURE ? 1.0f : (a.temperature ? a.temperature[row] : 0.0f);
  const bool write = a.write != 0 && (masked || (!PURE && temp > 0.0f));
  const bool scale = !PURE && write && temp > 0.0f;  // the divide only matters for written values
  const bool want_max = !PURE && a.argmax_out != nullptr;
  if (!write && !want_max) return;  // an unconstrained row with nothing to compute

  T* x = static_cast<T*>(a.logits) + row * a.logits_stride;
  const int32_t* bm = a.bitmask + row * a.bitmask_stride;
  const int64_t words_end = a.bitmask_words * 32;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * (kThreads * VEC * STEPS);
  constexpr uint32_t kFull = (VEC == 32) ? 0xFFFFFFFFu : ((1u << VEC) - 1u);
  const bool pure_mask = PURE || (!scale && !want_max);

  alignas(16) T v[STEPS][VEC];
  uint32_t allow[STEPS];
  int n[STEPS];
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int64_t j0 = begin + (static_cast<int64_t>(s) * kThreads + threadIdx.x) * VEC;
    n[s] = static_cast<int>(max(int64_t(0), min(static_cast<int64_t>(VEC), a.vocab - j0)));
    const uint32_t lanes = n[s] == VEC ? kFull : ((1u << n[s]) - 1u);
    uint32_t ok = lanes;
    if (masked && n[s] > 0) {
      if (a.d2t == nullptr) {
        // VEC divides 32 and j0 is a multiple of VEC: one word covers all VEC tokens or none.
        ok = j0 < words_end ? (static_cast<uint32_t>(bm[j0 >> 5]) >> (j0 & 31)) & lanes : 0u;
      } else {
        ok = 0u;
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (i < n[s] && bit_allowed(bm, a.bitmask_words, target_id(a, j0 + i))) ok |= 1u << i;
      }
    }
    allow[s] = ok;
    // A pure mask skips the read of an all-allowed or all-masked vector (xgrammar's trick).
    const bool read = n[s] > 0 && !(pure_mask && (ok == lanes || (ok == 0u && n[s] == VEC)));
    if (!read) {
      if (pure_mask && ok == lanes) n[s] = 0;  // nothing to write either
      continue;
    }
    if constexpr (VEC > 1) {
      if (n[s] == VEC) {
        *reinterpret_cast<uint4*>(v[s]) = *reinterpret_cast<const uint4*>(x + j0);
        continue;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (i < n[s]) v[s][i] = x[j0 + i];  // constant indices keep v in registers
  }

  const T neg_inf = from_float<T>(-INFINITY);
  float best_v = -INFINITY;
  int64_t best_j = -1;  // the first token this thread saw: its answer if all it saw is -inf/NaN
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    if (n[s] == 0) continue;
    const int64_t j0 = begin + (static_cast<int64_t>(s) * kThreads + threadIdx.x) * VEC;
    if (pure_mask) {
      // Only masked lanes change, to -inf, in T itself: no conversions on the hot path.
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (!((allow[s] >> i) & 1u)) v[s][i] = neg_inf;
    } else {
      float f[VEC];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        f[i] = (i < n[s] && ((allow[s] >> i) & 1u)) ? to_float(v[s][i]) : -INFINITY;
        m = fmaxf(m, f[i]);  // fmaxf drops NaN, so NaN never wins
      }
      if (want_max) {
        if (best_j < 0) best_j = j0;
        if (m > best_v) {  // strict: on ties the earlier (lower) token stays
          best_v = m;
          int first = 0;
#pragma unroll
          for (int i = VEC - 1; i >= 0; --i)
            if (f[i] == m) first = i;
          best_j = j0 + first;
        }
      }
      if (write) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[s][i] = from_float<T>(scale ? f[i] / temp : f[i]);
      }
    }
    if (!write) continue;
    if constexpr (VEC > 1) {
      if (n[s] == VEC) {
        *reinterpret_cast<uint4*>(x + j0) = *reinterpret_cast<const uint4*>(v[s]);
        continue;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      if (i < n[s]) x[j0 + i] = v[s][i];
  }

  if (!want_max) return;
  unsigned long long best = best_j < 0 ? 0ull : argmax_key(best_v, best_j);
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

template <typename T, int VEC, bool PURE>
cudaError_t launch_steps(const Args& a, int64_t rows, cudaStream_t stream) {
  // Few rows: one vector per thread, so a single row still spreads over many SMs. Many rows:
  // four per thread, for more bytes in flight and fewer blocks.
  const int64_t one = static_cast<int64_t>(kThreads) * VEC;
  const bool many = rows * ((a.vocab + one - 1) / one) >= 4096;
  const int64_t per_block = one * (many ? 4 : 1);
  const dim3 grid(static_cast<unsigned>((a.vocab + per_block - 1) / per_block), static_cast<unsigned>(rows));
  if (many)
    mask_kernel<T, VEC, 4, PURE><<<grid, kThreads, 0, stream>>>(a);
  else
    mask_kernel<T, VEC, 1, PURE><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const Args& a, int64_t rows, bool vector_ok, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (a.temperature == nullptr && a.argmax_out == nullptr)
    return vector_ok ? launch_steps<T, kVec, true>(a, rows, stream) : launch_steps<T, 1, true>(a, rows, stream);
  return vector_ok ? launch_steps<T, kVec, false>(a, rows, stream) : launch_steps<T, 1, false>(a, rows, stream);
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
