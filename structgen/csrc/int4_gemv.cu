// The int4 GEMV for 1-8 rows of bf16 x: y = x @ W.T (+ bias), W kept as int32 words of 8
// K-contiguous nibbles (models/packed.py's "words" layout) with a float scale (and offset) per
// group of columns. Two forms, both starting from the same trick: `(w >> 4i) & 0x000F000F |
// 0x43004300` is the bf16 pair (128 + q[i], 128 + q[i + 4]) (a nibble inside a bf16's 7
// mantissa bits), so a word's nibbles become bf16 arithmetic in 7 instructions.
//
// - The CUDA-core form (one row; and 2-4 rows with groups under 128 columns, as GGUF's Q4
//   formats have): bf16x2 products on the CUDA cores. Why CUDA and not Triton: at Hopper's
//   bandwidth an SM may spend only a few instructions on each int4 weight, and the Triton stream
//   GEMV spent about twice that (docs/performance.md, "Int4 at one row: a CUDA GEMV").
// - The tensor-core form (2-8 rows, groups of 128 columns or more, as AWQ / GPTQ have): the
//   pairs go to mma.m16n8k16 whose n holds x's rows, so 2 and 8 rows cost about the same
//   (docs/performance.md, "Int4 at 2-8 rows: a tensor-core GEMV"). Its comment is below.
//
// The CUDA-core form:
// - one fused-multiply-add takes 128 + 8 off the pair exactly: (q - 8) is small, so the bf16
//   products and their sums round less;
// - the pair times x's (x[i], x[i + 4]) is added up over the word's four pairs in bf16x2, the
//   two halves added, and the word's sum goes to a float32 sum of the lane's 32 columns (one
//   scale group);
// - that sum is scaled in float32; x's float32 sum over the same columns times
//   (offset + 8 * scale) puts the centre and the offset back.
// A block owns kRows output features; its warps take turns over the words (warp w reads the
// 4,096-column steps w, w + kWarps, ...), a lane 16 bytes of each feature a step, so a short
// row still spreads over every warp; lanes meet by shuffles, warps through shared memory in a
// fixed order (the same sum every run). Both forms launch with programmatic dependent launch
// where asked: the first words are read before waiting for the kernel that writes x.

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
  // the centre 8 makes (q - 8) small: the bf16 products and their sums round less
  const __nv_bfloat162 minus = __float2bfloat162_rn(-136.f);
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
      offset[r] = 8.f * scale[r];  // the centre
      if constexpr (OFFSETS) offset[r] += to_float(offsets[group_row[r] + group]);
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
        xsum[m] += sum_bf16(raw);
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
        acc[r][m] = fmaf(offset[r], xsum[m], acc[r][m]);
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

// The tensor-core form, for 2-8 rows of x and groups of 128 columns or more: a warp multiplies
// 16 features by 128-column tiles of x with mma.m16n8k16 (x's rows are the mma's n, so 2 and 8
// rows cost about the same; 5-8 rows share the 8-row build), its A operand the nibbles as the bf16 pairs (128 + q[i], 128 + q[i + 4])
// straight out of lop3, nothing subtracted: the products are exact in the mma's float32 sums,
// and a second mma of ones by the same x gives the tile's sum of x, so that per tile (inside one
// scale group)
//     sum(w * x) = scale * sum((128 + q) * x) + (offset - 128 * scale) * sum(x).
// Lane (g, t) reads 16 bytes of feature g and of feature g + 8 a tile (the tile's columns
// 32t..32t+31, with their scales) and x's row g (clamped to the last row) at the same columns; a
// word's pairs 0, 1 feed one mma and its pairs 2, 3 the next, and the tiles of a chunk keep
// their own sums so their mma chains interleave. At one row the CUDA-core form stays faster
// (a Llama-8B layer 53.7 against 60.4 us on an H100; docs/performance.md, "Int4 at 2-4 rows:
// a tensor-core GEMV", has the variants timed).
constexpr int kMmaWarps = 8;     // warps a block: they take turns over chunks of kChunkTiles tiles
constexpr int kMmaRows = 16;     // features a block (an mma's m)
constexpr int kTileWords = 16;   // words a row has in a 128-column tile
constexpr int kChunkTiles = 2;   // tiles a warp reads at once (32 bytes a lane a feature)
constexpr int kCudaCoreRows = 4;  // rows of x the CUDA-core form takes (its products are per row)
constexpr int kMaxRows = 8;       // rows of x the tensor-core form takes (the mma's n)

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// A chunk of a warp's words and their groups' scales, loaded together.
struct MmaChunk {
  uint4 wa[kChunkTiles], wb[kChunkTiles];  // 16 bytes of features g and g + 8 a tile
  float scale[kChunkTiles][2], shift[kChunkTiles][2];
};

template <int M, typename Scale, typename Offset>
__global__ void __launch_bounds__(kMmaWarps * 32, 2) int4_mma_kernel(const Int4GemvArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const int last = static_cast<int>(min(static_cast<int64_t>(kMmaRows), a.n - first)) - 1;
  const int64_t row_g = first + min(g, last), row_h = first + min(g + 8, last);
  const int tiles = static_cast<int>(a.units / kTileWords);
  const uint4* wg = reinterpret_cast<const uint4*>(a.words + row_g * a.word_stride) + t;
  const uint4* wh = reinterpret_cast<const uint4*>(a.words + row_h * a.word_stride) + t;
  const __nv_bfloat16* xrow = a.x + min(g, a.rows - 1) * a.x_stride + t * 32;
  constexpr bool OFFSETS = !std::is_same_v<Offset, NoOffsets>;
  const Scale* sg = static_cast<const Scale*>(a.scales) + row_g * a.scale_stride;
  const Scale* sh = static_cast<const Scale*>(a.scales) + row_h * a.scale_stride;
  const Offset* og = static_cast<const Offset*>(a.offsets) + (OFFSETS ? row_g * a.scale_stride : 0);
  const Offset* oh = static_cast<const Offset*>(a.offsets) + (OFFSETS ? row_h * a.scale_stride : 0);
  const uint32_t ones = 0x3F803F80u;
  const uint32_t ones_a[4] = {ones, ones, ones, ones};
  const int chunks = (tiles + kChunkTiles - 1) / kChunkTiles;

  auto load = [&](int chunk, MmaChunk& c) {
#pragma unroll
    for (int i = 0; i < kChunkTiles; ++i) {
      const int tile = min(chunk * kChunkTiles + i, tiles - 1);
      c.wa[i] = load_streaming(wg + tile * (kTileWords / 4));
      c.wb[i] = load_streaming(wh + tile * (kTileWords / 4));
      const int group = (tile * kTileWords) >> a.group_shift;
      c.scale[i][0] = to_float(sg[group]);
      c.scale[i][1] = to_float(sh[group]);
      c.shift[i][0] = -128.f * c.scale[i][0];
      c.shift[i][1] = -128.f * c.scale[i][1];
      if constexpr (OFFSETS) {
        c.shift[i][0] += to_float(og[group]);
        c.shift[i][1] += to_float(oh[group]);
      }
    }
  };
  float acc[4] = {};
  auto multiply = [&](int chunk, const MmaChunk& c) {
    float d[kChunkTiles][4] = {}, dx[kChunkTiles][4] = {};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int i = 0; i < kChunkTiles; ++i) {
        const int tile = min(chunk * kChunkTiles + i, tiles - 1);
        const WordX x = pair_up(__ldg(reinterpret_cast<const uint4*>(xrow + tile * 128) + k));
        const uint32_t wgk = k == 0 ? c.wa[i].x : k == 1 ? c.wa[i].y : k == 2 ? c.wa[i].z : c.wa[i].w;
        const uint32_t whk = k == 0 ? c.wb[i].x : k == 1 ? c.wb[i].y : k == 2 ? c.wb[i].z : c.wb[i].w;
        const uint32_t lo[4] = {lop_nibbles(wgk), lop_nibbles(whk), lop_nibbles(wgk >> 4), lop_nibbles(whk >> 4)};
        const uint32_t hi[4] = {lop_nibbles(wgk >> 8), lop_nibbles(whk >> 8), lop_nibbles(wgk >> 12),
                                lop_nibbles(whk >> 12)};
        mma_bf16(d[i], lo, bits(x.pair[0]), bits(x.pair[1]));
        mma_bf16(d[i], hi, bits(x.pair[2]), bits(x.pair[3]));
        mma_bf16(dx[i], ones_a, bits(x.pair[0]), bits(x.pair[1]));
        mma_bf16(dx[i], ones_a, bits(x.pair[2]), bits(x.pair[3]));
      }
    }
#pragma unroll
    for (int i = 0; i < kChunkTiles; ++i) {
      if (chunk * kChunkTiles + i >= tiles) break;
      acc[0] = fmaf(c.scale[i][0], d[i][0], fmaf(c.shift[i][0], dx[i][0], acc[0]));
      acc[1] = fmaf(c.scale[i][0], d[i][1], fmaf(c.shift[i][0], dx[i][1], acc[1]));
      acc[2] = fmaf(c.scale[i][1], d[i][2], fmaf(c.shift[i][1], dx[i][2], acc[2]));
      acc[3] = fmaf(c.scale[i][1], d[i][3], fmaf(c.shift[i][1], dx[i][3], acc[3]));
    }
  };
  MmaChunk chunk_words;
  if (warp < chunks) load(warp, chunk_words);
  if (a.pdl) asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
  for (int chunk = warp; chunk < chunks; chunk += kMmaWarps) {
    if (chunk != warp) load(chunk, chunk_words);
    multiply(chunk, chunk_words);
  }

  // each (feature, row) sum is one lane's: warps meet through shared memory, in order
  __shared__ float partial[kMmaWarps][kMmaRows][M];
  if (2 * t < M) {
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g + 8][2 * t] = acc[2];
  }
  if (2 * t + 1 < M) {
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t + 1] = acc[3];
  }
  __syncthreads();
  if (threadIdx.x < kMmaRows * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) s += partial[w][r][m];
    if (first + r < a.n && m < a.rows) {
      if (a.bias) s += __bfloat162float(a.bias[first + r]);
      a.y[m * a.y_stride + first + r] = __float2bfloat16_rn(s);
    }
  }
}

// The mma form takes whole 128-column tiles, each inside one scale group.
bool takes_mma(const Int4GemvArgs& a) { return a.units % kTileWords == 0 && a.group_shift >= 4; }

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
  if constexpr (M > 1) {
    if (takes_mma(a)) {
      config.gridDim = dim3(static_cast<unsigned>((a.n + kMmaRows - 1) / kMmaRows));
      config.blockDim = dim3(kMmaWarps * 32);
      return cudaLaunchKernelEx(&config, int4_mma_kernel<M, Scale, Offset>, a);
    }
  }
  if constexpr (M > kCudaCoreRows) {
    return cudaErrorInvalidValue;  // only the tensor-core form takes more rows
  } else {
    return cudaLaunchKernelEx(&config, int4_gemv_kernel<M, Scale, Offset>, a);
  }
}

template <typename Scale, typename Offset>
cudaError_t launch_rows(const Int4GemvArgs& a, cudaStream_t stream) {
  switch (a.rows) {
    case 1: return launch<1, Scale, Offset>(a, stream);
    case 2: return launch<2, Scale, Offset>(a, stream);
    case 3: return launch<3, Scale, Offset>(a, stream);
    case 4: return launch<4, Scale, Offset>(a, stream);
    case 5: case 6: case 7: case 8: return launch<8, Scale, Offset>(a, stream);  // rows past x's are not written
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
  // more than kCudaCoreRows rows: the launch refuses a weight the tensor-core form cannot take
  if (rows < 1 || rows > kMaxRows || units % kLaneWords || units >= (int64_t(1) << 30) || group_shift < 2 ||
      group_shift > 30 || n * scale_stride >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  Int4GemvArgs a{words, word_stride, units, scales, offsets, scale_stride, group_shift, scales_half, offsets_half,
                 static_cast<const __nv_bfloat16*>(x), x_stride, rows,
                 static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y), y_stride, n, pdl};
  auto s = static_cast<cudaStream_t>(stream);
  return scales_half ? launch_typed<__half>(a, s) : launch_typed<float>(a, s);
}
