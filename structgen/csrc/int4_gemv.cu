// The int4 GEMV for 1-4 rows of bf16 x: y = x @ W.T (+ bias), W kept as int32 words of 8
// K-contiguous nibbles (models/packed.py's "words" layout) with a float scale (and offset) per
// group of columns.
//
// Why CUDA and not Triton: at Hopper's bandwidth an SM may spend only a few instructions on
// each int4 weight, and the Triton stream GEMV spent about twice that: a float32 conversion and
// product per nibble, and x moved between register layouts through shared memory every chunk
// (docs/performance.md, "Int4 at one row: a CUDA GEMV", has the counts). Here a lane keeps x in
// registers in the order its nibbles come out, and a word's 8 products are bf16x2 arithmetic:
//
// - `(w >> 4i) & 0x000F000F | 0x43004300` is the bf16 pair (128 + q[i], 128 + q[i + 4]) (a
//   nibble inside a bf16's 7 mantissa bits), one fused-multiply-add takes the 128 (and the
//   centre, 8, where the weight has offsets) off exactly;
// - the pair times x's (x[i], x[i + 4]) is added up over the word's four pairs in bf16x2, the
//   two halves added, and the word's sum goes to a float32 sum of the lane's 32 columns (one
//   scale group);
// - that sum is scaled in float32; offsets multiply x's float32 sum over the same columns
//   (with the centre folded into them: offset + 8 * scale).
//
// A block owns kRows output features; its warps take turns over the words (warp w reads the
// 4,096-column steps w, w + kWarps, ...), a lane 16 bytes of each feature a step, so a short
// row still spreads over every warp; lanes meet by shuffles, warps through shared memory in a
// fixed order (the same sum every run). Launched with programmatic dependent launch where
// asked: the first words are read before waiting for the kernel that writes x.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace {

constexpr int kWarps = 4;       // warps a block
constexpr int kRows = 8;        // output features a block
constexpr int kLaneWords = 4;   // words a lane loads at once (16 bytes: 32 columns)
constexpr int kBlockWords = kWarps * 32 * kLaneWords;  // words a block reads a step (4,096 columns)

struct Int4GemvArgs {
  const int32_t* words;   // [n, word_stride]
  int64_t word_stride;
  int64_t units;          // words holding columns (cols / 8), a multiple of kLaneWords
  const void* scales;     // [n, scale_stride] float16 or float32
  const void* offsets;    // same shape, float16 or float32, or null
  int64_t scale_stride;   // scales and offsets hold fewer than 2^31 values
  int group_shift;        // log2 of the words a scale group holds (at least kLaneWords)
  int scales_half;
  int offsets_half;
  const __nv_bfloat16* x;  // [rows, x_stride]
  int64_t x_stride;
  int rows;
  const __nv_bfloat16* bias;  // [n] or null
  __nv_bfloat16* y;           // [rows, y_stride]
  int64_t y_stride;
  int64_t n;
  int pdl;
};

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
  // read once: keep the words out of L1 so x stays there
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t lop_nibbles(uint32_t w) {
  // (w & 0x000F000F) | 0x43004300: two nibbles inside the mantissas of a bf16 pair of 128s
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
  return r;
}

__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// x's 8 columns of one word as the bf16 pairs (x[i], x[i + 4]), i = 0..3, the order in which
// lop_nibbles hands out a word's nibbles.
struct WordX {
  __nv_bfloat162 pair[4];
};

__device__ __forceinline__ WordX pair_up(uint4 raw) {
  WordX out;
  out.pair[0] = as_bf162(__byte_perm(raw.x, raw.z, 0x5410));
  out.pair[1] = as_bf162(__byte_perm(raw.x, raw.z, 0x7632));
  out.pair[2] = as_bf162(__byte_perm(raw.y, raw.w, 0x5410));
  out.pair[3] = as_bf162(__byte_perm(raw.y, raw.w, 0x7632));
  return out;
}

__device__ __forceinline__ float sum_bf16(uint4 raw) {
  // the 8 bf16 of a 16-byte load added in float32 (a bf16 is a float32's top half)
  const uint32_t v[4] = {raw.x, raw.y, raw.z, raw.w};
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo += __uint_as_float(v[i] << 16);
    hi += __uint_as_float(v[i] & 0xFFFF0000u);
  }
  return lo + hi;
}

// One word's 8 products with x: bf16x2 products of exact (q - centre) values, the two halves
// added in bf16, returned as float32.
__device__ __forceinline__ float word_dot(const __nv_bfloat162 (&q)[4], const WordX& x) {
  __nv_bfloat162 s = __hmul2(q[0], x.pair[0]);
  s = __hfma2(q[1], x.pair[1], s);
  s = __hfma2(q[2], x.pair[2], s);
  s = __hfma2(q[3], x.pair[3], s);
  return __bfloat162float(__hadd(__low2bfloat16(s), __high2bfloat16(s)));
}

// A word's nibbles as the bf16 pairs (q[i] - c, q[i + 4] - c): `minus` is -(128 + c), exact.
__device__ __forceinline__ void nibbles(uint32_t w, __nv_bfloat162 minus, __nv_bfloat162 (&q)[4]) {
  const __nv_bfloat162 one = __float2bfloat162_rn(1.f);
  q[0] = __hfma2(as_bf162(lop_nibbles(w)), one, minus);
  q[1] = __hfma2(as_bf162(lop_nibbles(w >> 4)), one, minus);
  q[2] = __hfma2(as_bf162(lop_nibbles(w >> 8)), one, minus);
  q[3] = __hfma2(as_bf162(lop_nibbles(w >> 12)), one, minus);
}

// No offsets: w = scale * q.
struct NoOffsets {};

template <int M, typename Scale, typename Offset>
__global__ void __launch_bounds__(kWarps * 32) int4_gemv_kernel(const Int4GemvArgs a) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRows;
  const int last = static_cast<int>(min(static_cast<int64_t>(kRows), a.n - first)) - 1;  // rows past n: re-read
  // the block's warps take turns over the words: the lane's start at `word` + `lane_word`
  const int lane_word = (warp * 32 + lane) * kLaneWords;
  const uint4* words = reinterpret_cast<const uint4*>(a.words + first * a.word_stride + lane_word);
  const int64_t word_stride = a.word_stride / kLaneWords;
  constexpr bool OFFSETS = !std::is_same_v<Offset, NoOffsets>;
  // the centre c = 8 makes (q - c) small where offsets follow (less cancellation in bf16)
  const __nv_bfloat162 minus = __float2bfloat162_rn(OFFSETS ? -136.f : -128.f);
  const int words_left = static_cast<int>(a.units) - lane_word;  // > 0: the lane has words
  const Scale* scales = static_cast<const Scale*>(a.scales);
  const Offset* offsets = static_cast<const Offset*>(a.offsets);
  int group_row[kRows];  // each feature's first scale
#pragma unroll
  for (int r = 0; r < kRows; ++r) group_row[r] = static_cast<int>((first + min(r, last)) * a.scale_stride);

  uint4 w[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) w[r] = words_left > 0 ? load_streaming(words + min(r, last) * word_stride) : uint4{};
  if (a.pdl) asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");

  float acc[kRows][M] = {};
  for (int word = 0; words_left - word > 0; word += kBlockWords) {
    if (word > 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) w[r] = load_streaming(words + min(r, last) * word_stride + word / kLaneWords);
    }
    const int group = (word + lane_word) >> a.group_shift;
    float scale[kRows], offset[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      scale[r] = to_float(scales[group_row[r] + group]);
      if constexpr (OFFSETS) offset[r] = fmaf(8.f, scale[r], to_float(offsets[group_row[r] + group]));
    }
    WordX x[M][kLaneWords];
    float xsum[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4* xr = reinterpret_cast<const uint4*>(a.x + min(m, a.rows - 1) * a.x_stride + (word + lane_word) * 8);
      xsum[m] = 0.f;
#pragma unroll
      for (int k = 0; k < kLaneWords; ++k) {
        const uint4 raw = __ldg(xr + k);
        x[m][k] = pair_up(raw);
        if (OFFSETS) xsum[m] += sum_bf16(raw);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint32_t ws[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
      float dot[M] = {};
#pragma unroll
      for (int k = 0; k < kLaneWords; ++k) {
        __nv_bfloat162 q[4];
        nibbles(ws[k], minus, q);
#pragma unroll
        for (int m = 0; m < M; ++m) dot[m] += word_dot(q, x[m][k]);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[r][m] = fmaf(scale[r], dot[m], acc[r][m]);
        if (OFFSETS) acc[r][m] = fmaf(offset[r], xsum[m], acc[r][m]);
      }
    }
  }

  // lanes, then warps (in order: the same sum every run)
  __shared__ float partial[kWarps][kRows * M];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = acc[r][m];
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, d);
      if (lane == 0) partial[warp][r * M + m] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x < kRows * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float s = partial[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s += partial[w][threadIdx.x];
    if (first + r < a.n && m < a.rows) {
      if (a.bias) s += __bfloat162float(a.bias[first + r]);
      a.y[m * a.y_stride + first + r] = __float2bfloat16_rn(s);
    }
  }
}

template <int M, typename Scale, typename Offset>
cudaError_t launch(const Int4GemvArgs& a, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((a.n + kRows - 1) / kRows));
  config.blockDim = dim3(kWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = a.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, int4_gemv_kernel<M, Scale, Offset>, a);
}

template <typename Scale, typename Offset>
cudaError_t launch_rows(const Int4GemvArgs& a, cudaStream_t stream) {
  switch (a.rows) {
    case 1: return launch<1, Scale, Offset>(a, stream);
    case 2: return launch<2, Scale, Offset>(a, stream);
    case 3: return launch<3, Scale, Offset>(a, stream);
    case 4: return launch<4, Scale, Offset>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Scale>
cudaError_t launch_typed(const Int4GemvArgs& a, cudaStream_t stream) {
  if (!a.offsets) return launch_rows<Scale, NoOffsets>(a, stream);
  return a.offsets_half ? launch_rows<Scale, __half>(a, stream) : launch_rows<Scale, float>(a, stream);
}

}  // namespace

// Launches the kernel on `stream`; returns a cudaError_t (0 = launched). The Python wrapper
// (structgen/engine/kernels/int4_gemv.py) checks shapes, alignment and dtypes; this refuses
// only what the kernel cannot express.
int sg_int4_gemv(const int32_t* words, int64_t word_stride, int64_t units, const void* scales,
                 const void* offsets, int64_t scale_stride, int group_shift, int scales_half,
                 int offsets_half, const void* x, int64_t x_stride, int rows, const void* bias, void* y,
                 int64_t y_stride, int64_t n, int pdl, void* stream) {
  if (n <= 0 || units <= 0) return cudaSuccess;
  if (rows < 1 || rows > 4 || units % kLaneWords || units >= (int64_t(1) << 30) || group_shift < 2 ||
      group_shift > 30 || n * scale_stride >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  Int4GemvArgs a{words, word_stride, units, scales, offsets, scale_stride, group_shift, scales_half, offsets_half,
                 static_cast<const __nv_bfloat16*>(x), x_stride, rows,
                 static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y), y_stride, n, pdl};
  auto s = static_cast<cudaStream_t>(stream);
  return scales_half ? launch_typed<__half>(a, s) : launch_typed<float>(a, s);
}
