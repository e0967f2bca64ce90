// Products with weights kept in GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) on the CPU:
// each weight block is de-quantized in registers or in a small stack buffer and multiplied
// into fp32 activations at once, so a decode step reads the packed bytes, not fp32 copies.
//
// Plain C ABI (loaded with ctypes by structgen/engine/kernels/cpu_quant.py); no Python or
// torch headers, so g++ builds it in a few seconds on first use. Output rows are spread over
// OpenMP threads: torch's own libgomp is already loaded when this library is, so the process
// keeps one OpenMP runtime. AVX2/FMA/F16C code is chosen at run time, with a scalar fallback;
// products of several rows may run on int8 activations (AVX512-VNNI or AVX-VNNI, see below).
//
// Block layouts are ggml's (ggml-common.h); types are passed as ggml type ids.
//
// The last section, sgq_decode_layers, runs a whole Llama-family decode step over these products
// (structgen/engine/kernels/cpu_decode.py).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SGQ_X86 1
#endif

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int kMaxBlock = 256;  // elements in the largest block (the K formats' super-block)
constexpr int kRowGroup = 4;    // activation rows multiplied together against one weight block
constexpr int kWeightRows = 4;  // weight rows multiplied together against one activation row
// Products smaller than this many multiply-adds run on the calling thread: waking the others
// costs more than they would save.
constexpr int64_t kParallelWork = 1 << 16;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

struct Format {
  int block_elems;
  int block_bytes;
};

bool FormatOf(int type, Format* f) {
  switch (type) {
    case kQ4_0: *f = {32, 18}; return true;
    case kQ4_1: *f = {32, 20}; return true;
    case kQ8_0: *f = {32, 34}; return true;
    case kQ4_K: *f = {256, 144}; return true;
    case kQ6_K: *f = {256, 210}; return true;
    default: return false;
  }
}

// ---- scalar de-quantization of one block (the reference the SIMD paths must match) ----

void DequantQ4_0(const uint8_t* b, float* y) {
  const float d = HalfToFloat(Load16(b));
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xf) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void DequantQ4_1(const uint8_t* b, float* y) {
  const float d = HalfToFloat(Load16(b)), m = HalfToFloat(Load16(b + 2));
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0xf) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void DequantQ8_0(const uint8_t* b, float* y) {
  const float d = HalfToFloat(Load16(b));
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void DequantQ4_K(const uint8_t* b, float* y) {
  const float d = HalfToFloat(Load16(b)), dmin = HalfToFloat(Load16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    uint8_t sc, m;
    ScaleMinK4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
  }
}

void DequantQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = HalfToFloat(Load16(b + 208));
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int8_t>((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int8_t>((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
  }
}

using BlockDequant = void (*)(const uint8_t*, float*);

BlockDequant ScalarDequant(int type) {
  switch (type) {
    case kQ4_0: return DequantQ4_0;
    case kQ4_1: return DequantQ4_1;
    case kQ8_0: return DequantQ8_0;
    case kQ4_K: return DequantQ4_K;
    case kQ6_K: return DequantQ6_K;
    default: return nullptr;
  }
}

// ---- portable path: de-quantize a block into a buffer, then dot it with each activation row ----

void MatmulRowBuffered(BlockDequant dequant, const Format& f, const uint8_t* row, int64_t cols,
                       const float* x, int64_t n, float* y, int64_t y_stride) {
  float buf[kMaxBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kRowGroup) {
    const int64_t g = n - i0 < kRowGroup ? n - i0 : kRowGroup;
    float acc[kRowGroup] = {0, 0, 0, 0};
    for (int64_t c = 0, blk = 0; c < cols; c += f.block_elems, ++blk) {
      dequant(row + blk * f.block_bytes, buf);
      for (int64_t k = 0; k < g; ++k) {
        const float* xk = x + (i0 + k) * cols + c;
        float s = 0;
        for (int e = 0; e < f.block_elems; ++e) s += buf[e] * xk[e];
        acc[k] += s;
      }
    }
    for (int64_t k = 0; k < g; ++k) y[(i0 + k) * y_stride] = acc[k];
  }
}

#ifdef SGQ_X86
#define SGQ_AVX2 __attribute__((target("avx2,fma,f16c")))
// Inlined into its caller whatever the heuristics say (small helpers of the vector loops).
#define SGQ_INLINE inline __attribute__((always_inline))

SGQ_AVX2 inline float HalfToFloatAvx(const uint8_t* p) { return _cvtsh_ss(Load16(p)); }

SGQ_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 weights of a Q4_0/Q4_1/Q8_0 block as four vectors of eight.
SGQ_AVX2 inline void Nibbles(const uint8_t* qs, __m256* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xf);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

template <int kType>
SGQ_AVX2 inline void BlockAvx(const uint8_t* b, __m256* w) {
  if constexpr (kType == kQ8_0) {
    const __m256 d = _mm256_set1_ps(HalfToFloatAvx(b));
    for (int v = 0; v < 4; ++v) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
      w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else if constexpr (kType == kQ4_1) {
    const __m256 d = _mm256_set1_ps(HalfToFloatAvx(b)), m = _mm256_set1_ps(HalfToFloatAvx(b + 2));
    Nibbles(b + 4, w);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_fmadd_ps(w[v], d, m);
  } else {  // Q4_0: (q - 8) * d
    const __m256 d = _mm256_set1_ps(HalfToFloatAvx(b)), eight = _mm256_set1_ps(8.0f);
    Nibbles(b + 2, w);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(_mm256_sub_ps(w[v], eight), d);
  }
}

// One weight row of 32-element blocks against up to kRowGroup activation rows per pass.
template <int kType, int kBytes>
SGQ_AVX2 void MatmulRowAvx(const uint8_t* row, int64_t cols, const float* x, int64_t n, float* y,
                           int64_t y_stride) {
  for (int64_t i0 = 0; i0 < n; i0 += kRowGroup) {
    const int64_t g = n - i0 < kRowGroup ? n - i0 : kRowGroup;
    __m256 acc[kRowGroup] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
    const float* x0 = x + i0 * cols;
    for (int64_t c = 0, blk = 0; c < cols; c += 32, ++blk) {
      __m256 w[4];
      BlockAvx<kType>(row + blk * kBytes, w);
      for (int64_t k = 0; k < g; ++k) {
        const float* xk = x0 + k * cols + c;
        __m256 a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xk), acc[k]);
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xk + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xk + 16), a);
        acc[k] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xk + 24), a);
      }
    }
    for (int64_t k = 0; k < g; ++k) y[(i0 + k) * y_stride] = HorizontalSum(acc[k]);
  }
}

// The K formats: the scalar block de-quantization into a buffer, then vector dots.
SGQ_AVX2 void MatmulRowBufferedAvx(BlockDequant dequant, const Format& f, const uint8_t* row,
                                   int64_t cols, const float* x, int64_t n, float* y,
                                   int64_t y_stride) {
  alignas(32) float buf[kMaxBlock];
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * cols;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0, blk = 0; c < cols; c += f.block_elems, ++blk) {
      dequant(row + blk * f.block_bytes, buf);
      for (int e = 0; e < f.block_elems; e += 8)
        acc = _mm256_fmadd_ps(_mm256_load_ps(buf + e), _mm256_loadu_ps(xi + c + e), acc);
    }
    y[i * y_stride] = HorizontalSum(acc);
  }
}

SGQ_AVX2 void DequantRowAvx(int type, const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t blk = 0; blk < blocks; ++blk, out += 32) {
    __m256 w[4];
    if (type == kQ8_0) BlockAvx<kQ8_0>(row + blk * 34, w);
    else if (type == kQ4_1) BlockAvx<kQ4_1>(row + blk * 20, w);
    else BlockAvx<kQ4_0>(row + blk * 18, w);
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + 8 * v, w[v]);
  }
}

#define SGQ_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// The 32 weights of a Q4_0/Q4_1/Q8_0 block as two vectors of sixteen.
template <int kType>
SGQ_AVX512 inline void BlockAvx512(const uint8_t* b, __m512* w) {
  const float d = _cvtsh_ss(Load16(b));
  if constexpr (kType == kQ8_0) {
    for (int v = 0; v < 2; ++v) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v));
      w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d));
    }
    return;
  }
  const uint8_t* qs = b + (kType == kQ4_1 ? 4 : 2);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0xf);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  // q * d is exact in fp32 (4-bit q, 11-bit d), so one fma rounds like the scalar q * d + m.
  const __m512 vd = _mm512_set1_ps(d);
  const __m512 offset = _mm512_set1_ps(kType == kQ4_1 ? _cvtsh_ss(Load16(b + 2)) : -8.0f * d);
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, offset);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, offset);
}

template <int kType, int kBytes>
SGQ_AVX512 void MatmulRowAvx512(const uint8_t* row, int64_t cols, const float* x, int64_t n, float* y,
                                int64_t y_stride) {
  for (int64_t i0 = 0; i0 < n; i0 += kRowGroup) {
    const int64_t g = n - i0 < kRowGroup ? n - i0 : kRowGroup;
    __m512 acc[kRowGroup] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                             _mm512_setzero_ps()};
    const float* x0 = x + i0 * cols;
    for (int64_t c = 0, blk = 0; c < cols; c += 32, ++blk) {
      __m512 w[2];
      BlockAvx512<kType>(row + blk * kBytes, w);
      for (int64_t k = 0; k < g; ++k) {
        const float* xk = x0 + k * cols + c;
        acc[k] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xk + 16),
                                 _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xk), acc[k]));
      }
    }
    for (int64_t k = 0; k < g; ++k) y[(i0 + k) * y_stride] = _mm512_reduce_add_ps(acc[k]);
  }
}

// Groups of weight rows a single-row product prefetches ahead: one group ahead left a cold
// weight (the LM head after a forward) read well below the memory's bandwidth.
constexpr int64_t kPrefetchGroups = 4;

// Block `blk`'s share of the bytes of the weight group kPrefetchGroups ahead of the group at `w`
// (the group's rows are contiguous, so its blocks' shares cover it all).
inline void PrefetchAhead(const uint8_t* w, int64_t row_bytes, int64_t blk, int block_bytes) {
  const uint8_t* ahead = w + kPrefetchGroups * kWeightRows * row_bytes + blk * kWeightRows * block_bytes;
  for (int byte = 0; byte < kWeightRows * block_bytes; byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + byte), _MM_HINT_T0);
}

// One activation row against kWeightRows weight rows: independent accumulator chains (one
// row's chain alone waits on each FMA's latency), each summing in MatmulRowAvx's order, so a
// row's result is the same as MatmulRowAvx's whatever its neighbours.
template <int kType, int kBytes>
SGQ_AVX2 void WeightRowsAvx(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, float* y) {
  __m256 acc[kWeightRows];
  for (int r = 0; r < kWeightRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0, blk = 0; c < cols; c += 32, ++blk) {
    const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
    const __m256 x2 = _mm256_loadu_ps(x + c + 16), x3 = _mm256_loadu_ps(x + c + 24);
    PrefetchAhead(w, row_bytes, blk, kBytes);
    for (int r = 0; r < kWeightRows; ++r) {
      __m256 wv[4];
      BlockAvx<kType>(w + r * row_bytes + blk * kBytes, wv);
      __m256 a = _mm256_fmadd_ps(wv[0], x0, acc[r]);
      a = _mm256_fmadd_ps(wv[1], x1, a);
      a = _mm256_fmadd_ps(wv[2], x2, a);
      acc[r] = _mm256_fmadd_ps(wv[3], x3, a);
    }
  }
  for (int r = 0; r < kWeightRows; ++r) y[r] = HorizontalSum(acc[r]);
}

template <int kType, int kBytes>
SGQ_AVX512 void WeightRowsAvx512(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, float* y) {
  __m512 acc[kWeightRows];
  for (int r = 0; r < kWeightRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0, blk = 0; c < cols; c += 32, ++blk) {
    const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
    PrefetchAhead(w, row_bytes, blk, kBytes);
    for (int r = 0; r < kWeightRows; ++r) {
      __m512 wv[2];
      BlockAvx512<kType>(w + r * row_bytes + blk * kBytes, wv);
      acc[r] = _mm512_fmadd_ps(wv[1], x1, _mm512_fmadd_ps(wv[0], x0, acc[r]));
    }
  }
  for (int r = 0; r < kWeightRows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

// 2 where AVX-512F kernels run, 1 for AVX2/FMA/F16C, 0 for the scalar code.
int SimdLevel() {
  static const int level = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c"))
                               ? 0
                               : (__builtin_cpu_supports("avx512f") ? 2 : 1);
  return level;
}
#else
int SimdLevel() { return 0; }
#endif

bool SmallBlocks(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

// Attention's two vector operations over one head's dims: q . k, and out += p * v. Vectorized
// where the CPU allows (the sums then run in another order than the scalar loop's, the same for
// every row of every step).
#ifdef SGQ_X86
SGQ_AVX2 float DotAvx2(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
  float sum = HorizontalSum(acc);
  for (; e < d; ++e) sum += a[e] * b[e];
  return sum;
}

SGQ_AVX2 void AxpyAvx2(float p, const float* v, float* out, int64_t d) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) _mm256_storeu_ps(out + e, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + e), _mm256_loadu_ps(out + e)));
  for (; e < d; ++e) out[e] += p * v[e];
}

SGQ_AVX512 float DotAvx512(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; e < d; ++e) sum += a[e] * b[e];
  return sum;
}

SGQ_AVX512 void AxpyAvx512(float p, const float* v, float* out, int64_t d) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t e = 0;
  for (; e + 16 <= d; e += 16)
    _mm512_storeu_ps(out + e, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + e), _mm512_loadu_ps(out + e)));
  for (; e < d; ++e) out[e] += p * v[e];
}
#endif

float Dot(const float* a, const float* b, int64_t d, int simd) {
#ifdef SGQ_X86
  if (simd >= 2) return DotAvx512(a, b, d);
  if (simd >= 1) return DotAvx2(a, b, d);
#endif
  float sum = 0;
  for (int64_t e = 0; e < d; ++e) sum += a[e] * b[e];
  return sum;
}

void Axpy(float p, const float* v, float* out, int64_t d, int simd) {
#ifdef SGQ_X86
  if (simd >= 2) return AxpyAvx512(p, v, out, d);
  if (simd >= 1) return AxpyAvx2(p, v, out, d);
#endif
  for (int64_t e = 0; e < d; ++e) out[e] += p * v[e];
}

// e^x by x = k ln2 + r and a degree-6 polynomial in r (Cephes' expf, within 2 ulp), for the
// softmax and SiLU of the native step, whose std::exp calls cost more than its products.
constexpr float kExpMax = 88.3762626647949f, kExpMin = -87.3365447504f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 split for an exact k ln2
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};

#ifdef SGQ_X86
SGQ_AVX512 inline __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpMax)), _mm512_set1_ps(kExpMin));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[c]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f))), k);
}

// s[t] = e^(s[t] - shift) for t < count; returns their sum.
SGQ_AVX512 float ExpShiftedAvx512(float* s, int64_t count, float shift) {
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = count - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (count - t)) - 1);
    const __m512 e = Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vshift));
    _mm512_mask_storeu_ps(s + t, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(total);
}

// out[c] = silu(gate[c]) * up[c] for c < count.
SGQ_AVX512 void SiluMulAvx512(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t c = 0; c < count; c += 16) {
    const __mmask16 mask = count - c >= 16 ? 0xffff : static_cast<__mmask16>((1u << (count - c)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + c);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), Exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(out + c, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + c)));
  }
}

#endif

float ExpShifted(float* s, int64_t count, float shift, int simd) {
#ifdef SGQ_X86
  if (simd >= 2) return ExpShiftedAvx512(s, count, shift);
#endif
  (void)simd;
  float total = 0;
  for (int64_t t = 0; t < count; ++t) total += (s[t] = std::exp(s[t] - shift));
  return total;
}

void SiluMul(const float* gate, const float* up, int64_t count, float* out, int simd) {
#ifdef SGQ_X86
  if (simd >= 2) return SiluMulAvx512(gate, up, count, out);
#endif
  (void)simd;
  for (int64_t c = 0; c < count; ++c) out[c] = gate[c] / (1.0f + std::exp(-gate[c])) * up[c];
}

void MatmulRow(int type, const Format& f, const uint8_t* row, int64_t cols, const float* x,
               int64_t n, float* y, int64_t y_stride, int simd) {
#ifdef SGQ_X86
  if (simd >= 2 && SmallBlocks(type)) {
    if (type == kQ4_1) return MatmulRowAvx512<kQ4_1, 20>(row, cols, x, n, y, y_stride);
    if (type == kQ4_0) return MatmulRowAvx512<kQ4_0, 18>(row, cols, x, n, y, y_stride);
    return MatmulRowAvx512<kQ8_0, 34>(row, cols, x, n, y, y_stride);
  }
  if (simd >= 1) {
    if (type == kQ4_1) return MatmulRowAvx<kQ4_1, 20>(row, cols, x, n, y, y_stride);
    if (type == kQ4_0) return MatmulRowAvx<kQ4_0, 18>(row, cols, x, n, y, y_stride);
    if (type == kQ8_0) return MatmulRowAvx<kQ8_0, 34>(row, cols, x, n, y, y_stride);
    return MatmulRowBufferedAvx(ScalarDequant(type), f, row, cols, x, n, y, y_stride);
  }
#endif
  MatmulRowBuffered(ScalarDequant(type), f, row, cols, x, n, y, y_stride);
}

// Rows [begin, end) of W (rows `row_bytes` apart from `w`) against x [n, cols] into y[i * y_stride + r];
// a single activation row takes the weight rows kWeightRows at a time.
void MatmulRows(int type, const Format& f, const uint8_t* w, int64_t row_bytes, int64_t begin, int64_t end,
                int64_t cols, const float* x, int64_t n, float* y, int64_t y_stride, int simd) {
  int64_t r = begin;
#ifdef SGQ_X86
  if (n == 1 && simd >= 1 && SmallBlocks(type)) {
    for (; r + kWeightRows <= end; r += kWeightRows) {
      const uint8_t* rw = w + r * row_bytes;
      if (simd >= 2) {
        if (type == kQ4_1) WeightRowsAvx512<kQ4_1, 20>(rw, row_bytes, cols, x, y + r);
        else if (type == kQ4_0) WeightRowsAvx512<kQ4_0, 18>(rw, row_bytes, cols, x, y + r);
        else WeightRowsAvx512<kQ8_0, 34>(rw, row_bytes, cols, x, y + r);
      } else {
        if (type == kQ4_1) WeightRowsAvx<kQ4_1, 20>(rw, row_bytes, cols, x, y + r);
        else if (type == kQ4_0) WeightRowsAvx<kQ4_0, 18>(rw, row_bytes, cols, x, y + r);
        else WeightRowsAvx<kQ8_0, 34>(rw, row_bytes, cols, x, y + r);
      }
    }
  }
#endif
  for (; r < end; ++r) MatmulRow(type, f, w + r * row_bytes, cols, x, n, y + r, y_stride, simd);
}

// The row groups of a product of `rows` rows, and group g's rows.
int64_t RowGroups(int64_t rows) { return (rows + kWeightRows - 1) / kWeightRows; }
int64_t GroupEnd(int64_t g, int64_t rows) { return (g + 1) * kWeightRows < rows ? (g + 1) * kWeightRows : rows; }

void DequantRow(int type, const Format& f, const uint8_t* row, int64_t cols, float* out,
                int simd) {
#ifdef SGQ_X86
  if (simd && SmallBlocks(type)) return DequantRowAvx(type, row, cols / 32, out);
#endif
  const BlockDequant dequant = ScalarDequant(type);
  for (int64_t c = 0, blk = 0; c < cols; c += f.block_elems, ++blk)
    dequant(row + blk * f.block_bytes, out + c);
}

// ---- int8 activations: products of several rows on VNNI integer dot products ----
//
// Each activation row is quantized per 32-block (scale d = max|x| / 127, int8 q, and d * sum(q)),
// each weight block unpacked to unsigned bytes u with its scale and an offset m (Q4_0: the
// nibbles, m = -8 d; Q4_1: the nibbles, m = the block's min; Q8_0: q + 128, m = -128 d), so a
// block's product is d_w d_x (u . q) + m d_x sum(q): u . q is an exact int32 dot product
// (vpdpbusd, four times the fp32 multiply rate), and the result equals the product of the
// de-quantized operands up to float rounding. Only the quantized activations differ from the fp32 path.
// With two planes an activation is q + q_low / 256 (q_low rounding what q left, in [-0.5, 0.5]
// quanta): 16-bit activations, whose block dot 256 (u . q) + u . q_low is two int8 dot products.
// A thread takes a share of the weight rows: it unpacks them four at a time, runs the tiles of
// the first term over every activation row (Int8TileAvx512), and adds the second term, the
// offsets', for its whole share at the end as one small fp32 GEMM (AddOffsetsAvx512).

#if defined(SGQ_X86) && ((!defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define SGQ_VNNI 1
#define SGQ_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
#define SGQ_AVXVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#endif

constexpr int kInt8TileRows = 4;  // activation rows of a tile; the AVX-VNNI tile takes 2 (16 registers)

// Cache-line aligned storage for the tiles' operands: their 64-byte loads, unaligned, would
// each touch two lines (which halved the tiles' speed).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// Activation rows quantized per 32-block; rows padded to a tile multiple and blocks to an even
// count (a multiple of 4 for the sums) with zeros, so vector loads need no tail.
struct Int8Rows {
  AlignedVector<int8_t> q;      // [rows, pair_blocks * 32]
  AlignedVector<int8_t> q_low;  // [rows, pair_blocks * 32] with two planes, else empty
  AlignedVector<float> scale8;  // [rows, pair_blocks * 8]: each block's scale of its integer codes, once per int32 lane
  std::vector<float> sums;    // [rows, blocks]: each block's scale * sum(codes), for the offsets' term
  int64_t n = 0, rows = 0, blocks = 0, pair_blocks = 0;
  int64_t wide = 0, grouped = 0;  // the blocks in units of 16, then those up to the last pair (PlaceOf)
  int planes = 1;
};

// Up to kWeightRows weight rows unpacked for the tiles, in Int8Rows' block layout.
struct Int8Weights {
  AlignedVector<uint8_t> u;      // [kWeightRows, pair_blocks * 32]
  AlignedVector<float> scale8;   // [kWeightRows, pair_blocks * 8]
  std::vector<float> offsets_t;  // [blocks, offsets_stride]: the offsets m of a share's rows, block by block
  int64_t offsets_stride = 0;
};
static_assert(kWeightRows == 4, "the int8 tiles' offsets and sums interleave four weight rows");
static_assert(kInt8TileRows == kWeightRows, "activation and weight rows share one tile layout (PlaceOf)");

// Where a block's codes and scales sit in Int8Rows / Int8Weights. Four rows (a tile's) go together,
// unit by unit: a unit is a wide unit of 16 blocks (AVX-512 only), a group of four blocks, or a
// last pair that fills no group, and holds the unit's codes of the tile's first row, then of its
// second, and so on, so that a tile reads its rows' operands from one place. A wide unit's 512
// bytes of one row are 8 steps of 64: step s holds codes 4s .. 4s + 3 of each of its 16 blocks,
// so that 8 dot products (16 with two planes) chain in one accumulator, one int32 lane per block,
// before one fp32 conversion, scale and FMA serve the 16 blocks (scales once each). A group's 128
// bytes of one row hold the first 16 codes of each of its blocks, then the last 16: two dot
// products into one accumulator sum 8 codes per int32 lane, and one conversion, scale and FMA
// serve four blocks (16 lanes, 4 per block; scales repeated 4 times). A pair keeps block order
// (8 lanes per block, scales 8 times).
struct BlockPlace {
  int64_t first, second;  // bytes of codes 0-15 and 16-31 from the tile's start
  int64_t scale;          // first float of the scale's copies from the tile's start
  int copies;             // 1: a wide unit's block, its codes 4 bytes a step (kWideStep apart)
};

constexpr int kWideBlocks = 16, kWideStep = 64;

// The blocks in wide units and in whole groups of four of a row of `blocks` blocks padded to
// `pair_blocks`: wide units where the AVX512-VNNI tiles run (`level` 2), the AVX-VNNI tiles
// take groups and pairs only.
struct BlockLayout {
  int64_t wide, grouped;
};

BlockLayout LayoutOf(int64_t blocks, int64_t pair_blocks, int level) {
  const int64_t wide = level == 2 ? blocks / kWideBlocks * kWideBlocks : 0;
  return {wide, wide + (pair_blocks - wide) / 4 * 4};
}

// Where the unit that starts at block b sits in a tile: its first row's codes and scales from
// the tile's start, and how far apart its rows are (bytes, floats).
struct UnitPlace {
  int64_t codes, row_bytes, scales, row_floats;
};

inline UnitPlace UnitAt(int64_t b, const BlockLayout& at) {
  const int64_t blocks = b < at.wide ? kWideBlocks : b < at.grouped ? 4 : 2;
  return {kInt8TileRows * 32 * b, 32 * blocks, kInt8TileRows * 8 * b, 8 * blocks};
}

// Block b of a tile's row k.
inline BlockPlace PlaceOf(int64_t b, const BlockLayout& layout, int64_t k) {
  if (b < layout.wide) {
    const int64_t start = b / kWideBlocks * kWideBlocks, j = b - start;
    const UnitPlace unit = UnitAt(start, layout);
    const int64_t first = unit.codes + k * unit.row_bytes + 4 * j;
    return {first, first + 4 * kWideStep, unit.scales + k * unit.row_floats + j, 1};
  }
  const int64_t grouped = layout.grouped;
  if (b >= grouped) {
    const int64_t start = b & ~int64_t{1};
    const UnitPlace unit = UnitAt(start, layout);
    const int64_t first = unit.codes + k * unit.row_bytes + 32 * (b - start);
    return {first, first + 16, unit.scales + k * unit.row_floats + 8 * (b - start), 8};
  }
  const int64_t start = b & ~int64_t{3}, j = b & 3;
  const UnitPlace unit = UnitAt(start, layout);
  const int64_t first = unit.codes + k * unit.row_bytes + 16 * j;
  return {first, first + 64, unit.scales + k * unit.row_floats + 4 * j, 4};
}

// 2 where the AVX512-VNNI tiles run, 1 for the AVX-VNNI ones, 0 where neither may (the fp32 kernels).
int Int8Level(int simd) {
#ifdef SGQ_VNNI
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vnni");
  static const bool avx256 = __builtin_cpu_supports("avxvnni");
  if (simd >= 2 && avx512) return 2;
  if (simd >= 1 && avx256) return 1;
#endif
  (void)simd;
  return 0;
}

#ifdef SGQ_VNNI
// Four vectors of eight int32 (each within int8) as 32 bytes in order, the block's place's two halves.
SGQ_AVX2 inline void StoreBytes(const __m256i* n, int8_t* row, const BlockPlace& at) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])), order);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(row + at.first), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(row + at.second), _mm256_extracti128_si256(bytes, 1));
}

SGQ_AVX2 inline void StoreScale(float scale, float* row, const BlockPlace& at) {
  if (at.copies == 1) row[at.scale] = scale;
  for (int c = 0; c + 4 <= at.copies; c += 4) _mm_storeu_ps(row + at.scale + c, _mm_set1_ps(scale));
}

// 16 codes in order at `at` (the place's first or second half, `half`): contiguous, or a wide
// unit's 4 a step.
SGQ_AVX2 inline void StoreHalf(__m128i codes, int8_t* row, const BlockPlace& at, int half) {
  int8_t* out = row + (half ? at.second : at.first);
  if (at.copies != 1) return _mm_storeu_si128(reinterpret_cast<__m128i*>(out), codes);
  alignas(16) int8_t bytes[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(bytes), codes);
  for (int s = 0; s < 4; ++s) std::memcpy(out + s * kWideStep, bytes + 4 * s, 4);
}

// One activation row's blocks: q = round(x / d) and, with `q_low`, q_low = round(256 (x / d - q)),
// placed as PlaceOf says for row k of a tile (q, q_low and scale8 at the tile's start).
// Its layout has no wide units (the AVX-VNNI tiles'; StoreBytes writes contiguous halves).
SGQ_AVX2 void QuantizeBlocks(const float* x, int64_t blocks, const BlockLayout& layout, int64_t k, int8_t* q,
                             int8_t* q_low, float* scale8, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b, x += 32) {
    const BlockPlace at = PlaceOf(b, layout, k);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256 scaled[4];
    __m256i n[4], low[4];
    for (int k = 0; k < 4; ++k) n[k] = _mm256_cvtps_epi32(scaled[k] = _mm256_mul_ps(v[k], inverse));  // nearest even
    StoreBytes(n, q, at);
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    float scale = d;
    if (q_low) {  // what q left, in 1/256 quanta, clamped to int8 as the reference clamps
      for (int k = 0; k < 4; ++k) {
        low[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled[k], _mm256_cvtepi32_ps(n[k])), _mm256_set1_ps(256.0f)));
        low[k] = _mm256_max_epi32(_mm256_min_epi32(low[k], _mm256_set1_epi32(127)), _mm256_set1_epi32(-128));
      }
      StoreBytes(low, q_low, at);
      const __m256i low_total = _mm256_add_epi32(_mm256_add_epi32(low[0], low[1]), _mm256_add_epi32(low[2], low[3]));
      total = _mm256_add_epi32(_mm256_slli_epi32(total, 8), low_total);
      scale = d / 256.0f;
    }
    StoreScale(scale, scale8, at);
    sums[b] = scale * HorizontalSum(_mm256_cvtepi32_ps(total));
  }
}

// x [n, cols] quantized into `out` in `planes` int8 planes, its buffers grown as needed and its padding zeroed.
// `out` sized for n rows of `cols` in `planes` planes, zeroed (its padding stays so).
// `level`: the int8 products' (the layout's wide units are AVX-512's).
void SizeRows(int64_t n, int64_t cols, int planes, int level, Int8Rows* out) {
  out->n = n;
  out->planes = planes;
  out->rows = (n + kInt8TileRows - 1) / kInt8TileRows * kInt8TileRows;
  out->blocks = cols / 32;
  out->pair_blocks = (out->blocks + 1) / 2 * 2;
  const BlockLayout layout = LayoutOf(out->blocks, out->pair_blocks, level);
  out->wide = layout.wide;
  out->grouped = layout.grouped;
  out->q.assign(out->rows * out->pair_blocks * 32, 0);
  out->q_low.assign(planes == 2 ? out->q.size() : 0, 0);
  out->scale8.assign(out->rows * out->pair_blocks * 8, 0.0f);
  out->sums.assign(out->rows * out->blocks, 0.0f);
}

// QuantizeBlocks with AVX-512: the same operations on 16 lanes, the codes narrowed by vpmovsdb.
SGQ_VNNI512 void QuantizeBlocksAvx512(const float* x, int64_t blocks, const BlockLayout& layout, int64_t k,
                                      int8_t* q, int8_t* q_low, float* scale8, float* sums) {
  for (int64_t b = 0; b < blocks; ++b, x += 32) {
    const BlockPlace at = PlaceOf(b, layout, k);
    const __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))) / 127.0f;
    const __m512 inverse = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m512 scaled[2] = {_mm512_mul_ps(v[0], inverse), _mm512_mul_ps(v[1], inverse)};
    const __m512i n[2] = {_mm512_cvtps_epi32(scaled[0]), _mm512_cvtps_epi32(scaled[1])};  // nearest even
    StoreHalf(_mm512_cvtsepi32_epi8(n[0]), q, at, 0);
    StoreHalf(_mm512_cvtsepi32_epi8(n[1]), q, at, 1);
    __m512i total = _mm512_add_epi32(n[0], n[1]);
    float scale = d;
    if (q_low) {  // what q left, in 1/256 quanta, clamped to int8 as the reference clamps
      __m512i low[2];
      for (int h = 0; h < 2; ++h) {
        low[h] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled[h], _mm512_cvtepi32_ps(n[h])), _mm512_set1_ps(256.0f)));
        low[h] = _mm512_max_epi32(_mm512_min_epi32(low[h], _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
      }
      StoreHalf(_mm512_cvtsepi32_epi8(low[0]), q_low, at, 0);
      StoreHalf(_mm512_cvtsepi32_epi8(low[1]), q_low, at, 1);
      total = _mm512_add_epi32(_mm512_slli_epi32(total, 8), _mm512_add_epi32(low[0], low[1]));
      scale = d / 256.0f;
    }
    StoreScale(scale, scale8, at);
    // The codes' sum is an integer below 2^24: exact in fp32 whatever the order it is summed in.
    sums[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
}

// Rows [begin, end) of x [out->n, cols] quantized into `out` (sized by SizeRows), with the int8
// products' `level`'s instructions.
void QuantizeRowRange(const float* x, int64_t cols, int64_t begin, int64_t end, Int8Rows* out, int level) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t tile = i - i % kInt8TileRows;
    (level == 2 ? QuantizeBlocksAvx512 : QuantizeBlocks)(x + i * cols, out->blocks, {out->wide, out->grouped}, i % kInt8TileRows,
                   out->q.data() + tile * out->pair_blocks * 32,
                   out->planes == 2 ? out->q_low.data() + tile * out->pair_blocks * 32 : nullptr,
                   out->scale8.data() + tile * out->pair_blocks * 8, out->sums.data() + i * out->blocks);
  }
}

void QuantizeRows(const float* x, int64_t n, int64_t cols, int planes, Int8Rows* out, int level) {
  SizeRows(n, cols, planes, level, out);
  QuantizeRowRange(x, cols, 0, n, out, level);
}

constexpr int BlockBytes(int type) { return type == kQ8_0 ? 34 : type == kQ4_1 ? 20 : 18; }

// The four fp16 at p, p + step, p + 2 step, p + 3 step as floats.
SGQ_VNNI512 SGQ_INLINE __m128 FourHalves(const uint8_t* p, int step) {
  return _mm_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(Load16(p)), static_cast<int16_t>(Load16(p + step)),
                                     static_cast<int16_t>(Load16(p + 2 * step)),
                                     static_cast<int16_t>(Load16(p + 3 * step)), 0, 0, 0, 0));
}

// 16 bytes at p, p + step, p + 2 step, p + 3 step side by side.
SGQ_VNNI512 SGQ_INLINE __m512i FourLanes(const uint8_t* p, int step) {
  const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i v1 = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + step)), 1);
  const __m512i v2 = _mm512_inserti32x4(v1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * step)), 2);
  return _mm512_inserti32x4(v2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * step)), 3);
}

// A whole group of four blocks at `blocks` unpacked at once, as UnpackRowOf would block by block:
// codes at `u` (the group's 128 bytes of this row), scales at `scale` (16 floats), offsets m at
// offsets_t, offsets_stride apart.
template <int type>
SGQ_VNNI512 void UnpackGroupAvx512(const uint8_t* blocks, uint8_t* u, float* scale, float* offsets_t,
                                  int64_t offsets_stride) {
  constexpr int bytes = BlockBytes(type);
  const __m128 d = FourHalves(blocks, bytes);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  _mm512_storeu_ps(scale, _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d)));
  __m512i first, second;
  __m128 m;
  if constexpr (type == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(-128);
    first = _mm512_xor_si512(FourLanes(blocks + 2, bytes), flip);
    second = _mm512_xor_si512(FourLanes(blocks + 18, bytes), flip);
    m = _mm_mul_ps(d, _mm_set1_ps(-128.0f));
  } else {
    const __m512i raw = FourLanes(blocks + (type == kQ4_1 ? 4 : 2), bytes), low = _mm512_set1_epi8(0xf);
    first = _mm512_and_si512(raw, low);
    second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    m = type == kQ4_1 ? FourHalves(blocks + 2, bytes) : _mm_mul_ps(d, _mm_set1_ps(-8.0f));
  }
  _mm512_storeu_si512(u, first);
  _mm512_storeu_si512(u + 64, second);
  alignas(16) float ms[4];
  _mm_store_ps(ms, m);
  for (int j = 0; j < 4; ++j) offsets_t[offsets_stride * j] = ms[j];
}

// The 4 bytes at p, p + step, ... p + 15 step as 16 int32 lanes: scalar loads through the stack,
// a seventh of vpgatherdd's time on Zen 4 (whose gathers took 15% of a prompt's products).
SGQ_VNNI512 SGQ_INLINE __m512i SixteenDwords(const uint8_t* p, int step) {
  alignas(64) uint32_t lanes[kWideBlocks];
  for (int j = 0; j < kWideBlocks; ++j) std::memcpy(lanes + j, p + j * step, 4);
  return _mm512_load_si512(lanes);
}

// A wide unit of 16 blocks at `blocks` unpacked at once: codes at `u` (the unit's 512 bytes of
// this row), scales at `scale` (16 floats), offsets m at offsets_t, offsets_stride apart.
template <int type>
SGQ_VNNI512 void UnpackWideAvx512(const uint8_t* blocks, uint8_t* u, float* scale, float* offsets_t,
                                  int64_t offsets_stride) {
  constexpr int bytes = BlockBytes(type);
  const __m512i head = SixteenDwords(blocks, bytes);  // d, then Q4_1's m (or the codes' first bytes)
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
  _mm512_storeu_ps(scale, d);
  __m512 m;
  if constexpr (type == kQ8_0) {
    m = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
    for (int s = 0; s < 8; ++s)
      _mm512_storeu_si512(u + s * kWideStep,
                          _mm512_xor_si512(SixteenDwords(blocks + 2 + 4 * s, bytes), _mm512_set1_epi8(-128)));
  } else {
    m = type == kQ4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    const __m512i low = _mm512_set1_epi8(0xf);
    for (int s = 0; s < 4; ++s) {  // byte t's low nibble is code t, its high nibble code t + 16
      const __m512i raw = SixteenDwords(blocks + (type == kQ4_1 ? 4 : 2) + 4 * s, bytes);
      _mm512_storeu_si512(u + s * kWideStep, _mm512_and_si512(raw, low));
      _mm512_storeu_si512(u + (s + 4) * kWideStep, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  }
  alignas(64) float ms[kWideBlocks];
  _mm512_store_ps(ms, m);
  for (int j = 0; j < kWideBlocks; ++j) offsets_t[offsets_stride * j] = ms[j];
}

// Weight row `row` unpacked as row k of Int8Weights' tile in `layout`, its blocks' offsets m into
// offsets_t, offsets_stride apart; wide units and whole groups at once where AVX-512 runs
// (`avx512`, which a layout with wide units needs).
template <int type>
SGQ_AVX2 void UnpackRowOf(const uint8_t* row, int64_t blocks, int64_t pair_blocks, const BlockLayout& layout,
                          int64_t k, uint8_t* u, float* scale8, float* offsets_t, int64_t offsets_stride,
                          bool avx512) {
  constexpr int bytes = BlockBytes(type);
  const __m128i low = _mm_set1_epi8(0xf);
  const int64_t grouped = layout.grouped;
  int64_t b = 0;
  if (avx512) {
    for (; b < layout.wide; b += kWideBlocks, row += kWideBlocks * bytes) {
      const BlockPlace at = PlaceOf(b, layout, k);
      UnpackWideAvx512<type>(row, u + at.first, scale8 + at.scale, offsets_t + offsets_stride * b, offsets_stride);
    }
    for (; b + 4 <= blocks && b < grouped; b += 4, row += 4 * bytes) {
      const BlockPlace at = PlaceOf(b, layout, k);
      UnpackGroupAvx512<type>(row, u + at.first, scale8 + at.scale, offsets_t + offsets_stride * b, offsets_stride);
    }
  }
  for (; b < blocks; ++b, row += bytes) {
    const float d = _cvtsh_ss(Load16(row));
    const BlockPlace at = PlaceOf(b, layout, k);
    __m128i first, second;
    if constexpr (type == kQ8_0) {
      const __m128i flip = _mm_set1_epi8(-128);
      first = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2)), flip);
      second = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18)), flip);
      offsets_t[offsets_stride * b] = -128.0f * d;
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (type == kQ4_1 ? 4 : 2)));
      first = _mm_and_si128(raw, low);
      second = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
      offsets_t[offsets_stride * b] = type == kQ4_1 ? _cvtsh_ss(Load16(row + 2)) : -8.0f * d;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + at.first), first);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + at.second), second);
    StoreScale(d, scale8, at);
  }
  if (blocks < pair_blocks) {  // the padding block multiplies zero activations; keep it finite
    const BlockPlace at = PlaceOf(blocks, layout, k);  // never in a wide unit
    std::memset(u + at.first, 0, 16);
    std::memset(u + at.second, 0, 16);
    std::memset(scale8 + at.scale, 0, at.copies * sizeof(float));
  }
}

void UnpackRow(int type, const uint8_t* row, const Int8Rows& x, int64_t k, uint8_t* u, float* scale8,
               float* offsets_t, int64_t offsets_stride, bool avx512) {
  const BlockLayout layout = {x.wide, x.grouped};
  if (type == kQ4_1)
    return UnpackRowOf<kQ4_1>(row, x.blocks, x.pair_blocks, layout, k, u, scale8, offsets_t, offsets_stride, avx512);
  if (type == kQ4_0)
    return UnpackRowOf<kQ4_0>(row, x.blocks, x.pair_blocks, layout, k, u, scale8, offsets_t, offsets_stride, avx512);
  UnpackRowOf<kQ8_0>(row, x.blocks, x.pair_blocks, layout, k, u, scale8, offsets_t, offsets_stride, avx512);
}

// The unpacked weight rows' operands (a tile's layout, PlaceOf): rows first, first + 1, ... of the
// tile at u and scale8.
struct Int8Operands {
  const uint8_t* u;
  const float* scale8;
  int64_t first;
};

// y[i, c] += sum_b m[c, b] d_x[i, b] sum(q)[i, b], the offsets' term, for activation rows i < x.n and
// columns c < cols whose offsets m `m_t` holds ([blocks, stride]). One GEMM after a share's tiles,
// as broadcast FMAs into y: in each tile it cost as much as a sixth of the tile's dot products.
SGQ_AVX2 void AddOffsetsAvx2(const Int8Rows& x, const float* m_t, int64_t stride, int64_t cols, float* y,
                             int64_t y_stride) {
  constexpr int kRows = 4, kVectors = 2;  // 8 accumulators and their operands in AVX2's 16 registers
  int64_t c = 0;
  for (; c + 8 * kVectors <= cols; c += 8 * kVectors)
    for (int64_t i0 = 0; i0 < x.n; i0 += kRows) {
      const int rows = x.n - i0 < kRows ? static_cast<int>(x.n - i0) : kRows;
      __m256 acc[kRows][kVectors];
      for (int i = 0; i < rows; ++i)
        for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_loadu_ps(y + (i0 + i) * y_stride + c + 8 * v);
      for (int64_t b = 0; b < x.blocks; ++b) {
        __m256 m[kVectors];
        for (int v = 0; v < kVectors; ++v) m[v] = _mm256_loadu_ps(m_t + b * stride + c + 8 * v);
        for (int i = 0; i < rows; ++i) {
          const __m256 sum = _mm256_set1_ps(x.sums[(i0 + i) * x.blocks + b]);
          for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm256_fmadd_ps(sum, m[v], acc[i][v]);
        }
      }
      for (int i = 0; i < rows; ++i)
        for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(y + (i0 + i) * y_stride + c + 8 * v, acc[i][v]);
    }
  for (; c < cols; ++c)  // the vector loops' FMAs in their order, so a column's sum is the same wherever a share ends
    for (int64_t i = 0; i < x.n; ++i) {
      float total = y[i * y_stride + c];
      for (int64_t b = 0; b < x.blocks; ++b) total = std::fma(x.sums[i * x.blocks + b], m_t[b * stride + c], total);
      y[i * y_stride + c] = total;
    }
}

// AddOffsetsAvx2 in AVX-512's 32 registers: 4 rows of 64 columns a tile.
SGQ_AVX512 void AddOffsetsAvx512(const Int8Rows& x, const float* m_t, int64_t stride, int64_t cols, float* y,
                                 int64_t y_stride) {
  constexpr int kRows = 4, kVectors = 4;
  const int64_t whole = cols / (16 * kVectors) * (16 * kVectors);
  for (int64_t c = 0; c < whole; c += 16 * kVectors)
    for (int64_t i0 = 0; i0 < x.n; i0 += kRows) {
      const int rows = x.n - i0 < kRows ? static_cast<int>(x.n - i0) : kRows;
      __m512 acc[kRows][kVectors];
      for (int i = 0; i < rows; ++i)
        for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm512_loadu_ps(y + (i0 + i) * y_stride + c + 16 * v);
      for (int64_t b = 0; b < x.blocks; ++b) {
        __m512 m[kVectors];
        for (int v = 0; v < kVectors; ++v) m[v] = _mm512_loadu_ps(m_t + b * stride + c + 16 * v);
        for (int i = 0; i < rows; ++i) {
          const __m512 sum = _mm512_set1_ps(x.sums[(i0 + i) * x.blocks + b]);
          for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm512_fmadd_ps(sum, m[v], acc[i][v]);
        }
      }
      for (int i = 0; i < rows; ++i)
        for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(y + (i0 + i) * y_stride + c + 16 * v, acc[i][v]);
    }
  AddOffsetsAvx2(x, m_t + whole, stride, cols - whole, y + whole, y_stride);
}

// The sums of 4 vectors, as y's 4 floats at one activation row.
SGQ_AVX512 inline __m128 SumsOfFour(const __m512* acc) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512d p0 = _mm512_castps_pd(t0), p1 = _mm512_castps_pd(t1);
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)), _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One unit of blocks at block b (kChunks 2: a group of four, 1: the last pair; PlaceOf) of
// activation rows i0 .. i0 + 4 against weight rows r < R, added into acc.
template <int R, int kPlanes, int kChunks, int kRows>
SGQ_VNNI512 inline void Int8UnitAvx512(const Int8Rows& x, int64_t i0, const Int8Operands& w, int64_t b,
                                       __m512 (*acc)[R]) {
  const UnitPlace unit = UnitAt(b, {x.wide, x.grouped});
  const int8_t* q = x.q.data() + i0 * x.pair_blocks * 32 + unit.codes;
  const int8_t* q_low = kPlanes == 2 ? x.q_low.data() + i0 * x.pair_blocks * 32 + unit.codes : nullptr;
  const float* da = x.scale8.data() + i0 * x.pair_blocks * 8 + unit.scales;
  const uint8_t* wu = w.u + unit.codes + w.first * unit.row_bytes;
  const float* dw = w.scale8 + unit.scales + w.first * unit.row_floats;
  __m512i u[R][kChunks];  // loaded once for the tile's rows: the loads, not the dots, would bound it
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChunks; ++c) u[r][c] = _mm512_loadu_si512(wu + r * unit.row_bytes + 64 * c);
  for (int i = 0; i < kRows; ++i) {
    __m512i a[kChunks], a_low[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      a[c] = _mm512_loadu_si512(q + i * unit.row_bytes + 64 * c);
      if constexpr (kPlanes == 2) a_low[c] = _mm512_loadu_si512(q_low + i * unit.row_bytes + 64 * c);
    }
    const __m512 da_i = _mm512_loadu_ps(da + i * unit.row_floats);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(da_i, _mm512_loadu_ps(dw + r * unit.row_floats));
      __m512i dot = _mm512_setzero_si512();
      for (int c = 0; c < kChunks; ++c) dot = _mm512_dpbusd_epi32(dot, u[r][c], a[c]);
      if constexpr (kPlanes == 2) {
        dot = _mm512_slli_epi32(dot, 8);
        for (int c = 0; c < kChunks; ++c) dot = _mm512_dpbusd_epi32(dot, u[r][c], a_low[c]);
      }
      acc[i][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[i][r]);
    }
  }
}

// Rows i0 + p .. i0 + p + kPair of the wide unit `unit` against weight rows r < R, added into
// acc[p ..]: each lane's int32 chain sums one block's codes (the high plane's, shifted, then the
// low plane's), so one conversion, scale and FMA serve 8 (16) dot products. Two rows at a time:
// their 8 chains, the 4 weight vectors and the tile's 16 fp32 sums fit the 32 registers.
template <int R, int kPlanes, int kPair>
SGQ_VNNI512 SGQ_INLINE void Int8WideRowsAvx512(const Int8Rows& x, int64_t i0, int p, const UnitPlace& unit,
                                               const Int8Operands& w, __m512 (*acc)[R]) {
  const int64_t codes = i0 * x.pair_blocks * 32 + unit.codes + p * unit.row_bytes;
  const uint8_t* wu = w.u + unit.codes + w.first * unit.row_bytes;
  __m512i dot[kPair][R], low[kPair][R];  // the planes' chains side by side: each weight load serves both
  for (int i = 0; i < kPair; ++i)
    for (int r = 0; r < R; ++r) dot[i][r] = low[i][r] = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    __m512i u[R];
    for (int r = 0; r < R; ++r) u[r] = _mm512_loadu_si512(wu + r * unit.row_bytes + s * kWideStep);
    for (int i = 0; i < kPair; ++i) {
      const int64_t at = codes + i * unit.row_bytes + s * kWideStep;
      const __m512i a = _mm512_loadu_si512(x.q.data() + at);
      for (int r = 0; r < R; ++r) dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], u[r], a);
      if constexpr (kPlanes == 2) {
        const __m512i a_low = _mm512_loadu_si512(x.q_low.data() + at);
        for (int r = 0; r < R; ++r) low[i][r] = _mm512_dpbusd_epi32(low[i][r], u[r], a_low);
      }
    }
  }
  if constexpr (kPlanes == 2)
    for (int i = 0; i < kPair; ++i)
      for (int r = 0; r < R; ++r) dot[i][r] = _mm512_add_epi32(_mm512_slli_epi32(dot[i][r], 8), low[i][r]);
  const float* da = x.scale8.data() + i0 * x.pair_blocks * 8 + unit.scales + p * unit.row_floats;
  const float* dw = w.scale8 + unit.scales + w.first * unit.row_floats;
  for (int i = 0; i < kPair; ++i) {
    const __m512 da_i = _mm512_loadu_ps(da + i * unit.row_floats);
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(da_i, _mm512_loadu_ps(dw + r * unit.row_floats));
      acc[p + i][r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot[i][r]), acc[p + i][r]);
    }
  }
}

// The wide unit at block b (PlaceOf) of activation rows i0 .. i0 + kRows against weight rows r < R.
template <int R, int kPlanes, int kRows>
SGQ_VNNI512 inline void Int8WideUnitAvx512(const Int8Rows& x, int64_t i0, const Int8Operands& w, int64_t b,
                                           __m512 (*acc)[R]) {
  const UnitPlace unit = UnitAt(b, {x.wide, x.grouped});
  if constexpr (kPlanes == 2) {  // one row at a time: its 8 chains of each plane
    for (int p = 0; p < kRows; ++p) Int8WideRowsAvx512<R, kPlanes, 1>(x, i0, p, unit, w, acc);
    return;
  }
  if constexpr (kRows >= 2) Int8WideRowsAvx512<R, kPlanes, 2>(x, i0, 0, unit, w, acc);
  if constexpr (kRows == 4) Int8WideRowsAvx512<R, kPlanes, 2>(x, i0, 2, unit, w, acc);
  if constexpr (kRows == 1 || kRows == 3) Int8WideRowsAvx512<R, kPlanes, 1>(x, i0, kRows - 1, unit, w, acc);
}

// y[i * y_stride + r] for activation rows i0 .. i0 + 4 (those below x.n) and weight rows r < R,
// the activations in kPlanes int8 planes.
// kRows of them: a step's last tile takes only the rows it has.
template <int R, int kPlanes, int kRows = kInt8TileRows>
SGQ_VNNI512 void Int8TileAvx512(const Int8Rows& x, int64_t i0, const Int8Operands& w, float* y, int64_t y_stride) {
  __m512 acc[kRows][R];
  for (int i = 0; i < kRows; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t grouped = x.grouped;
  for (int64_t b = 0; b < x.wide; b += kWideBlocks) Int8WideUnitAvx512<R, kPlanes, kRows>(x, i0, w, b, acc);
  for (int64_t b = x.wide; b < grouped; b += 4) Int8UnitAvx512<R, kPlanes, 2, kRows>(x, i0, w, b, acc);
  if (grouped < x.pair_blocks) Int8UnitAvx512<R, kPlanes, 1, kRows>(x, i0, w, grouped, acc);
  for (int i = 0; i < kRows && i0 + i < x.n; ++i) {
    if constexpr (R == kWeightRows) {
      _mm_storeu_ps(y + (i0 + i) * y_stride, SumsOfFour(acc[i]));
    } else {
      for (int r = 0; r < R; ++r) y[(i0 + i) * y_stride + r] = _mm512_reduce_add_ps(acc[i][r]);
    }
  }
}

constexpr int kAvxVnniTileRows = 2;

// Int8UnitAvx512's unit in 256-bit halves: `half` 0 or 1, the unit's first or second 8 lanes.
template <int R, int kPlanes, int kChunks>
SGQ_AVXVNNI inline void Int8UnitAvxVnni(const Int8Rows& x, int64_t i0, const Int8Operands& w, int64_t b, int half,
                                        __m256 (*acc)[R]) {
  const UnitPlace unit = UnitAt(b, {x.wide, x.grouped});
  const int64_t tile = i0 - i0 % kInt8TileRows, k0 = i0 % kInt8TileRows;  // this tile's rows in the layout's tile
  const int64_t codes = tile * x.pair_blocks * 32 + unit.codes + k0 * unit.row_bytes + 32 * half;
  const float* da = x.scale8.data() + tile * x.pair_blocks * 8 + unit.scales + k0 * unit.row_floats + 8 * half;
  const uint8_t* wu = w.u + unit.codes + w.first * unit.row_bytes + 32 * half;
  const float* dw = w.scale8 + unit.scales + w.first * unit.row_floats + 8 * half;
  for (int i = 0; i < kAvxVnniTileRows; ++i) {
    __m256i a[kChunks], a_low[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const int64_t at = codes + i * unit.row_bytes + 64 * c;
      a[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + at));
      if constexpr (kPlanes == 2) a_low[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q_low.data() + at));
    }
    const __m256 da_i = _mm256_loadu_ps(da + i * unit.row_floats);
    for (int r = 0; r < R; ++r) {
      const uint8_t* u = wu + r * unit.row_bytes;
      const __m256 scale = _mm256_mul_ps(da_i, _mm256_loadu_ps(dw + r * unit.row_floats));
      __m256i dot = _mm256_setzero_si256();
      for (int c = 0; c < kChunks; ++c)
        dot = _mm256_dpbusd_avx_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * c)), a[c]);
      if constexpr (kPlanes == 2) {
        dot = _mm256_slli_epi32(dot, 8);
        for (int c = 0; c < kChunks; ++c)
          dot = _mm256_dpbusd_avx_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * c)), a_low[c]);
      }
      acc[i][r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[i][r]);
    }
  }
}

template <int R, int kPlanes>
SGQ_AVXVNNI void Int8TileAvxVnni(const Int8Rows& x, int64_t i0, const Int8Operands& w, float* y, int64_t y_stride) {
  __m256 acc[kAvxVnniTileRows][R];
  for (int i = 0; i < kAvxVnniTileRows; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t grouped = x.grouped;  // no wide units at this level (LayoutOf)
  for (int64_t b = 0; b < grouped; b += 4)
    for (int half = 0; half < 2; ++half) Int8UnitAvxVnni<R, kPlanes, 2>(x, i0, w, b, half, acc);
  if (grouped < x.pair_blocks)
    for (int half = 0; half < 2; ++half) Int8UnitAvxVnni<R, kPlanes, 1>(x, i0, w, grouped, half, acc);
  for (int i = 0; i < kAvxVnniTileRows && i0 + i < x.n; ++i)
    for (int r = 0; r < R; ++r)
      y[(i0 + i) * y_stride + r] = HorizontalSum(acc[i][r]);
}

// One tile at the CPU's level and the activations' plane count.
template <int R>
void Int8Tile(const Int8Rows& x, int64_t i0, const Int8Operands& w, float* y, int64_t y_stride, int level) {
  if (level == 2) {
    const int64_t rows = x.n - i0;  // fewer than a tile's in the last
    if (x.planes == 2) {
      if (rows == 1) Int8TileAvx512<R, 2, 1>(x, i0, w, y, y_stride);
      else if (rows == 2) Int8TileAvx512<R, 2, 2>(x, i0, w, y, y_stride);
      else Int8TileAvx512<R, 2>(x, i0, w, y, y_stride);
    } else {
      if (rows == 1) Int8TileAvx512<R, 1, 1>(x, i0, w, y, y_stride);
      else if (rows == 2) Int8TileAvx512<R, 1, 2>(x, i0, w, y, y_stride);
      else Int8TileAvx512<R, 1>(x, i0, w, y, y_stride);
    }
  }
  else if (x.planes == 2) Int8TileAvxVnni<R, 2>(x, i0, w, y, y_stride);
  else Int8TileAvxVnni<R, 1>(x, i0, w, y, y_stride);
}

// Every activation row of `x` against the `count` unpacked weight rows of `w`.
// Every activation row of `x` against the `count` unpacked weight rows of `w`.
void Int8Tiles(const Int8Rows& x, const Int8Operands& w, int64_t count, float* y, int64_t y_stride, int level) {
  const int step = level == 2 ? kInt8TileRows : kAvxVnniTileRows;
  for (int64_t i0 = 0; i0 < x.n; i0 += step) {
    if (count == kWeightRows) {
      Int8Tile<kWeightRows>(x, i0, w, y, y_stride, level);
      continue;
    }
    for (int64_t r = 0; r < count; ++r) {
      const Int8Operands row = {w.u, w.scale8, w.first + r};
      Int8Tile<1>(x, i0, row, y + r, y_stride, level);
    }
  }
}

// Weight rows [begin, end) against the quantized rows `x`, kWeightRows rows unpacked at a time into `scratch`.
void Int8MatmulRows(int type, const uint8_t* w, int64_t row_bytes, int64_t begin, int64_t end, const Int8Rows& x,
                    float* y, int64_t y_stride, int level, Int8Weights* scratch) {
  scratch->u.resize(kWeightRows * x.pair_blocks * 32);
  scratch->scale8.resize(kWeightRows * x.pair_blocks * 8);
  // A cache line more than the rows: columns a multiple of 4 KB apart would share one L1 set.
  const int64_t stride = (end - begin + 15) / 16 * 16 + 16;
  scratch->offsets_t.resize(x.blocks * stride);
  float* m_t = scratch->offsets_t.data();
  const Int8Operands ops = {scratch->u.data(), scratch->scale8.data(), 0};
  for (int64_t r0 = begin; r0 < end; r0 += kWeightRows) {
    const int64_t count = end - r0 < kWeightRows ? end - r0 : kWeightRows;
    for (int64_t k = 0; k < count; ++k)
      UnpackRow(type, w + (r0 + k) * row_bytes, x, k, scratch->u.data(), scratch->scale8.data(), m_t + r0 + k - begin,
                stride, level == 2);
    // The next group's packed bytes come from memory while this group's tiles run.
    const int64_t next = end - r0 - count < kWeightRows ? end - r0 - count : kWeightRows;
    for (int64_t byte = 0; byte < next * row_bytes; byte += 64)
      __builtin_prefetch(w + (r0 + count) * row_bytes + byte);
    Int8Tiles(x, ops, count, y + r0, y_stride, level);
  }
  if (level == 2) AddOffsetsAvx512(x, m_t, stride, end - begin, y + begin, y_stride);
  else AddOffsetsAvx2(x, m_t, stride, end - begin, y + begin, y_stride);
}
#else
void SizeRows(int64_t, int64_t, int, int, Int8Rows*) {}
void QuantizeRowRange(const float*, int64_t, int64_t, int64_t, Int8Rows*, int) {}
void QuantizeRows(const float*, int64_t, int64_t, int, Int8Rows*, int) {}
void Int8MatmulRows(int, const uint8_t*, int64_t, int64_t, int64_t, const Int8Rows&, float*, int64_t, int,
                    Int8Weights*) {}
#endif

// Work split of a parallel loop over `count` items: this thread's [begin, end).
struct Share {
  int64_t begin, end;
};

Share ShareOf(int64_t count, int thread, int threads) {
  const int64_t per = count / threads, extra = count % threads;
  const int64_t begin = thread * per + (thread < extra ? thread : extra);
  return {begin, begin + per + (thread < extra ? 1 : 0)};
}

struct Team {
  int thread, threads;
};

Team ThisTeam() {
#ifdef _OPENMP
  return {omp_get_thread_num(), omp_get_num_threads()};
#else
  return {0, 1};
#endif
}

void Barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

// The int8 level a product of `n` rows of format `type` runs at: 0 (the fp32 kernels) below
// `int8_rows` rows (0: never), for the K formats, or without VNNI.
int Int8LevelFor(int type, int64_t n, int64_t int8_rows, int simd) {
  return int8_rows > 0 && n >= int8_rows && SmallBlocks(type) ? Int8Level(simd) : 0;
}

}  // namespace

extern "C" {

// Bytes of one block and elements in it for ggml type `type`; 0 if unsupported.
int sgq_block_bytes(int type) {
  Format f;
  return FormatOf(type, &f) ? f.block_bytes : 0;
}

int sgq_block_elems(int type) {
  Format f;
  return FormatOf(type, &f) ? f.block_elems : 0;
}

// The best SIMD level this CPU runs: 2 AVX-512F, 1 AVX2/FMA/F16C, 0 scalar only.
int sgq_simd() { return SimdLevel(); }

// The int8 products' level under SIMD cap `simd`: 2 AVX512-VNNI, 1 AVX-VNNI, 0 none (fp32 kernels).
int sgq_int8_level(int simd) { return Int8Level(simd < SimdLevel() ? simd : SimdLevel()); }

// y[i * y_stride + r] = sum_c x[i * cols + c] * W[r, c] for i < n, r < rows, where W's rows are
// `row_bytes` apart in `w`. `simd` caps the SIMD level (0: the scalar path); products of at least
// `int8_rows` rows (0: none) run on activations in `planes` int8 planes (1: int8, 2: 16-bit) where
// the CPU has VNNI. Returns 0, or -1 for a bad type.
int sgq_matmul(int type, const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes, const float* x,
               int64_t n, float* y, int64_t y_stride, int threads, int simd, int64_t int8_rows, int planes) {
  Format f;
  if (!FormatOf(type, &f) || cols % f.block_elems != 0 || planes < 1 || planes > 2) return -1;
  const int vec = simd < SimdLevel() ? simd : SimdLevel();
  const int int8 = Int8LevelFor(type, n, int8_rows, vec);
  if (int8) {
    Int8Rows quantized;
    QuantizeRows(x, n, cols, planes, &quantized, int8);
#pragma omp parallel num_threads(threads) if (rows * cols * n >= kParallelWork)
    {
      Int8Weights scratch;
      const Team team = ThisTeam();
      const Share s = ShareOf(RowGroups(rows), team.thread, team.threads);  // whole shares: one offsets GEMM each
      if (s.begin < s.end)
        Int8MatmulRows(type, w, row_bytes, s.begin * kWeightRows, GroupEnd(s.end - 1, rows), quantized, y, y_stride,
                       int8, &scratch);
    }
    return 0;
  }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols * n >= kParallelWork)
  for (int64_t g = 0; g < RowGroups(rows); ++g)
    MatmulRows(type, f, w, row_bytes, g * kWeightRows, GroupEnd(g, rows), cols, x, n, y, y_stride, vec);
  return 0;
}

// out[i, :] = W[ids[i], :] de-quantized, for i < n (a row gather: embeddings).
int sgq_dequantize_rows(int type, const uint8_t* w, int64_t cols, int64_t row_bytes,
                        const int64_t* ids, int64_t n, float* out, int threads, int simd) {
  Format f;
  if (!FormatOf(type, &f) || cols % f.block_elems != 0) return -1;
  const int vec = simd < SimdLevel() ? simd : SimdLevel();
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 16)
  for (int64_t i = 0; i < n; ++i) DequantRow(type, f, w + ids[i] * row_bytes, cols, out + i * cols, vec);
  return 0;
}

// out[r, :] = W[r, :] de-quantized for every r < rows.
int sgq_dequantize(int type, const uint8_t* w, int64_t rows, int64_t cols, int64_t row_bytes,
                   float* out, int threads, int simd) {
  Format f;
  if (!FormatOf(type, &f) || cols % f.block_elems != 0) return -1;
  const int vec = simd < SimdLevel() ? simd : SimdLevel();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) DequantRow(type, f, w + r * row_bytes, cols, out + r * cols, vec);
  return 0;
}

}  // extern "C"

// ---- one decode step of a Llama-family decoder: every layer in one call ----
//
// A CPU decode step of a small model is bound by the host cost of its many small torch ops, not
// by its weights, so the step's per-layer work (norms, packed products, RoPE, the KV write,
// attention over the paged cache, SiLU * up, residual adds) runs here in one OpenMP region.

namespace {

// A packed weight, as sgq_matmul takes it, with an optional fp32 bias.
struct Linear {
  int32_t type;
  int32_t pad;
  const uint8_t* w;
  int64_t rows, cols, row_bytes;
  const float* bias;  // [rows] or null
};

struct DecoderLayer {
  Linear qkv, o, gate_up, down;
  const float* attn_norm;  // [hidden]
  const float* mlp_norm;   // [hidden]
  float* k_cache;          // [cache rows, kv_heads, head_dim]
  float* v_cache;
  int64_t window;          // sliding window in keys, 0: none
};

struct ModelShape {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  float eps;
  int32_t pad;
};

// `n` new tokens (rows) of any sequences: each attends to its sequence's keys up to its own
// position, the step's new keys included (decode rows, draft rows to verify, short prompts).
struct DecodeRows {
  int64_t n;
  const int64_t* positions;     // [n]
  const int64_t* token_slots;   // [n] cache row of each new token
  const int64_t* slots;         // [n] page-table row of each row's sequence
  const int64_t* page_table;    // [slots + 1, table_stride]
  int64_t table_stride, page_size;
  const float* cos;  // [positions, head_dim] (rotate-half layout)
  const float* sin;
};

// Where a step's time goes, on one thread (sgq_profile_phases; benchmarks/profile_cpu_decode.py):
// the phases in the order sgq_phase_seconds reports them. Off, a lap is one branch.
enum Phase { kNormPhase, kQuantizePhase, kQkvPhase, kOPhase, kGateUpPhase, kDownPhase, kRopePhase,
             kAttentionPhase, kSiluPhase, kResidualPhase, kWaitPhase, kStartPhase, kPhases };
bool g_profiling = false;
int g_profiled_thread = 0;
double g_phase_seconds[kPhases];

struct PhaseClock {
  bool on;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();

  // The time since the last lap goes to `phase`.
  void Lap(Phase phase) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }

  // `phase` ends and the thread waits for the others (the wait counted apart).
  void Wait(Phase phase) {
    Lap(phase);
    Barrier();
    Lap(kWaitPhase);
  }
};

// What each thread keeps for the int8 products: the weight rows it unpacks, the fewest rows a
// product runs on int8 activations (0: never) and how many of a step's leading rows may (the
// rest stay on fp32 whatever the step's size).
struct Int8Scratch {
  Int8Weights weights;
  int64_t int8_rows;
  int planes;
  int64_t lead;
};

// A product's leading rows that multiply integer activations (0: none) and the int8 level they run at.
struct IntegerPart {
  int64_t rows;
  int level;
};

IntegerPart IntegerPartOf(const Linear& l, int64_t n, const Int8Scratch& int8, int simd) {
  const int64_t lead = int8.lead < n ? int8.lead : n;
  const int level = Int8LevelFor(l.type, lead, int8.int8_rows, simd);
  return {level ? lead : 0, level};
}

// This thread's weight rows of `l`: whole groups of kWeightRows, the threads' shares about equal.
Share WeightShare(const Linear& l, Team team) {
  const Share s = ShareOf(RowGroups(l.rows), team.thread, team.threads);
  const int64_t begin = s.begin * kWeightRows;
  return {begin, s.begin < s.end ? GroupEnd(s.end - 1, l.rows) : begin};
}

// Weight row `r` of the fused qkv moved to the start of the k head it falls inside, if any.
int64_t OutsideKHeads(const ModelShape& m, int64_t r) {
  const int64_t k_begin = m.heads * m.head_dim, k_end = k_begin + m.kv_heads * m.head_dim;
  return r <= k_begin || r >= k_end ? r : k_begin + (r - k_begin) / m.head_dim * m.head_dim;
}

// WeightShare of the fused qkv with no k head split between two threads, so that each thread
// can rotate and cache the k heads of its own share without waiting for the others.
Share QkvShare(const ModelShape& m, const Linear& l, Team team) {
  const Share s = WeightShare(l, team);
  const int64_t end = team.thread + 1 == team.threads ? l.rows : OutsideKHeads(m, s.end);
  return {team.thread == 0 ? 0 : OutsideKHeads(m, s.begin), end};
}

// y[i, r] = x[i, :] . W[r, :] (+ bias[r]) for the weight rows r in `share`.
// `codes`, shared by the threads and sized for the step's integer rows and x's columns, takes x's
// integer rows, each thread quantizing its share, unless the caller has `quantized` them already.
void LinearShare(const Linear& l, const float* x, int64_t n, float* y, int simd, Team team, Share share,
                 Int8Scratch* int8, Int8Rows* codes, bool quantized, PhaseClock* clock) {
  Format f;
  FormatOf(l.type, &f);
  const int64_t begin = share.begin, end = share.end;
  const IntegerPart part = IntegerPartOf(l, n, *int8, simd);
  if (part.level) {
    if (!quantized) {
      const Share mine = ShareOf(part.rows, team.thread, team.threads);
      QuantizeRowRange(x, l.cols, mine.begin, mine.end, codes, part.level);
      clock->Wait(kQuantizePhase);  // every row quantized before any tile reads it
    }
    Int8MatmulRows(l.type, l.w, l.row_bytes, begin, end, *codes, y, l.rows, part.level, &int8->weights);
    if (part.rows < n)
      MatmulRows(l.type, f, l.w, l.row_bytes, begin, end, l.cols, x + part.rows * l.cols, n - part.rows,
                 y + part.rows * l.rows, l.rows, simd);
  } else {
    MatmulRows(l.type, f, l.w, l.row_bytes, begin, end, l.cols, x, n, y, l.rows, simd);
  }
  if (l.bias)
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; ++i) y[i * l.rows + r] += l.bias[r];
}

// out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) * weight, row by row.
void RmsNorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps, float* out, int simd) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * dim;
    const float sum = Dot(xi, xi, dim, simd);
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (int64_t c = 0; c < dim; ++c) out[i * dim + c] = weight[c] * (xi[c] * scale);
  }
}

// x (one head, head_dim wide) rotated in place by the rotate-half RoPE at one position.
void Rope(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] - b * sin[j];
    x[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// Whether q or k head `head` lies wholly in one thread's QkvShare (else attention rotates it).
bool InOneShare(const ModelShape& m, const Linear& qkv, int threads, int64_t head) {
  for (int t = 0; t < threads; ++t) {
    const Share s = QkvShare(m, qkv, {t, threads});
    if (s.begin <= head * m.head_dim && (head + 1) * m.head_dim <= s.end) return true;
  }
  return false;
}

// RoPE on the q and k heads wholly inside the qkv columns `share` (k heads always are,
// QkvShare) of every row, and those columns' k and v written to the rows' cache rows.
void RopeAndCache(const ModelShape& m, const DecoderLayer& l, const DecodeRows& b, float* qkv, Share share) {
  const int64_t width = (m.heads + 2 * m.kv_heads) * m.head_dim, kv = m.kv_heads * m.head_dim;
  const int64_t k_begin = m.heads * m.head_dim, v_begin = k_begin + kv;
  const int64_t first_head = (share.begin + m.head_dim - 1) / m.head_dim;
  const int64_t end_head = std::min(share.end / m.head_dim, m.heads + m.kv_heads);
  const int64_t k_first = std::max(share.begin, k_begin), k_last = std::min(share.end, v_begin);
  const int64_t v_first = std::max(share.begin, v_begin), v_last = share.end;
  for (int64_t i = 0; i < b.n; ++i) {
    float* row = qkv + i * width;
    const float* cos = b.cos + b.positions[i] * m.head_dim;
    const float* sin = b.sin + b.positions[i] * m.head_dim;
    for (int64_t h = first_head; h < end_head; ++h) Rope(row + h * m.head_dim, cos, sin, m.head_dim);
    if (k_first < k_last)
      std::memcpy(l.k_cache + b.token_slots[i] * kv + (k_first - k_begin), row + k_first, (k_last - k_first) * sizeof(float));
    if (v_first < v_last)
      std::memcpy(l.v_cache + b.token_slots[i] * kv + (v_first - v_begin), row + v_first, (v_last - v_first) * sizeof(float));
  }
}

// Where a row's keys and values are: its page table, and one kv head's place in a cache row.
struct KvSpan {
  const float *k_cache, *v_cache;
  const int64_t* pages;
  int64_t page_size, row_floats, head_offset;

  int64_t Offset(int64_t t) const { return (pages[t / page_size] * page_size + t % page_size) * row_floats + head_offset; }
};

#ifdef SGQ_X86
// AttendHead's loops for a head of D dims (a multiple of 16) with q and the output in registers:
// the same operations in the same order as Dot, ExpShifted and Axpy make there, without their
// loads and stores of q and the output at every key.
template <int D>
SGQ_AVX512 void AttendHeadAvx512(const float* q, const KvSpan& kv, int64_t first, int64_t ctx, float scale, float* s,
                                 float* out) {
  constexpr int kVectors = D / 16;
  __m512 qv[kVectors], o[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    qv[v] = _mm512_loadu_ps(q + 16 * v);
    o[v] = _mm512_setzero_ps();
  }
  float top = -INFINITY;
  for (int64_t t = first; t < ctx; ++t) {
    const float* k = kv.k_cache + kv.Offset(t);
    __m512 acc = _mm512_setzero_ps();
    for (int v = 0; v < kVectors; ++v) acc = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), acc);
    s[t - first] = _mm512_reduce_add_ps(acc) * scale;
    top = s[t - first] > top ? s[t - first] : top;
  }
  const float total = ExpShiftedAvx512(s, ctx - first, top);
  for (int64_t t = first; t < ctx; ++t) {
    const float* value = kv.v_cache + kv.Offset(t);
    const __m512 p = _mm512_set1_ps(s[t - first] / total);
    for (int v = 0; v < kVectors; ++v) o[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * v), o[v]);
  }
  for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(out + 16 * v, o[v]);
}
#endif

// Attention of query head `head` of row `i` over its sequence's cached keys up to its position
// (the window's last keys where the layer has one): softmax(q . k / sqrt(d)) . v into `out`;
// q rotated by RoPE in place first unless `rotated` (each row's head is one job's).
void AttendHead(const ModelShape& m, const DecoderLayer& l, const DecodeRows& b, float* qkv, int64_t i,
                int64_t head, bool rotated, int simd, std::vector<float>* scores, float* out) {
  const int64_t d = m.head_dim, kv = m.kv_heads * d;
  const int64_t kv_head = head / (m.heads / m.kv_heads), ctx = b.positions[i] + 1;
  const int64_t first = l.window > 0 && ctx > l.window ? ctx - l.window : 0;
  float* q = qkv + i * (m.heads + 2 * m.kv_heads) * d + head * d;
  if (!rotated) Rope(q, b.cos + b.positions[i] * d, b.sin + b.positions[i] * d, d);
  const int64_t* pages = b.page_table + b.slots[i] * b.table_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  scores->resize(ctx - first);
  float* s = scores->data();
#ifdef SGQ_X86
  const KvSpan span = {l.k_cache, l.v_cache, pages, b.page_size, kv, kv_head * d};
  if (simd >= 2 && d == 64) return AttendHeadAvx512<64>(q, span, first, ctx, scale, s, out);
  if (simd >= 2 && d == 128) return AttendHeadAvx512<128>(q, span, first, ctx, scale, s, out);
#endif
  float top = -INFINITY;
  for (int64_t t = first; t < ctx; ++t) {
    const int64_t cache_row = pages[t / b.page_size] * b.page_size + t % b.page_size;
    const float* k = l.k_cache + cache_row * kv + kv_head * d;
    s[t - first] = Dot(q, k, d, simd) * scale;
    top = s[t - first] > top ? s[t - first] : top;
  }
  const float total = ExpShifted(s, ctx - first, top, simd);
  for (int64_t e = 0; e < d; ++e) out[e] = 0;
  for (int64_t t = first; t < ctx; ++t) {
    const int64_t cache_row = pages[t / b.page_size] * b.page_size + t % b.page_size;
    const float* v = l.v_cache + cache_row * kv + kv_head * d;
    Axpy(s[t - first] / total, v, out, d, simd);
  }
}

// Buffers the threads share: the products each thread writes its share of rows into, and the
// integer codes of the products' inputs (the normed stream, attention's output, SiLU * up) for
// the step's first `lead` rows where they multiply integer activations (unsized otherwise).
struct SharedBuffers {
  std::vector<float> qkv, attn, proj, gate_up, act;
  Int8Rows normed_codes, attn_codes, act_codes;
  SharedBuffers(const ModelShape& m, int64_t n, int64_t lead, bool integer, int planes, int level)
      : qkv(n * (m.heads + 2 * m.kv_heads) * m.head_dim), attn(n * m.heads * m.head_dim), proj(n * m.hidden),
        gate_up(n * 2 * m.inter), act(n * m.inter) {
    if (!integer) return;
    SizeRows(lead, m.hidden, planes, level, &normed_codes);
    SizeRows(lead, m.heads * m.head_dim, planes, level, &attn_codes);
    SizeRows(lead, m.inter, planes, level, &act_codes);
  }
};

// What every thread keeps for itself: its copy of the residual stream and of the small
// element-wise results, computed redundantly (a few thousand floats) instead of once behind
// a barrier; every copy sees the same operations, so the copies stay equal.
struct ThreadState {
  std::vector<float> hidden, normed, scores;
  std::vector<char> rotated;  // per q head: whether the qkv phase has rotated it
  Int8Scratch int8;
  PhaseClock clock;
  ThreadState(const ModelShape& m, int64_t n, const float* stream, int64_t int8_rows, int planes, int64_t lead,
              bool timed)
      : hidden(stream, stream + n * m.hidden), normed(n * m.hidden), int8{{}, int8_rows, planes, lead},
        clock{timed} {}
};

// Attention of every row and head into buf->attn, the rows that o multiplies on integers
// quantized as they finish: those rows dealt whole to the threads, back and forth (a prompt's
// later rows attend to more keys), the other rows' jobs (row, head) round-robin.
void Attention(const ModelShape& m, const DecoderLayer& l, const DecodeRows& b, SharedBuffers* buf, ThreadState* own,
               int simd, Team team) {
  const IntegerPart part = IntegerPartOf(l.o, b.n, own->int8, simd);
  const int64_t width = m.heads * m.head_dim;
  std::vector<char>& rotated = own->rotated;
  rotated.resize(m.heads);
  for (int64_t head = 0; head < m.heads; ++head) rotated[head] = InOneShare(m, l.qkv, team.threads, head);
  for (int64_t round = 0; round * team.threads < part.rows; ++round) {
    const int64_t i = round * team.threads + (round % 2 ? team.threads - 1 - team.thread : team.thread);
    if (i >= part.rows) continue;
    for (int64_t head = 0; head < m.heads; ++head)
      AttendHead(m, l, b, buf->qkv.data(), i, head, rotated[head], simd, &own->scores,
                 buf->attn.data() + i * width + head * m.head_dim);
    own->clock.Lap(kAttentionPhase);
    QuantizeRowRange(buf->attn.data(), width, i, i + 1, &buf->attn_codes, part.level);
    own->clock.Lap(kQuantizePhase);
  }
  for (int64_t job = part.rows * m.heads + team.thread; job < b.n * m.heads; job += team.threads)
    AttendHead(m, l, b, buf->qkv.data(), job / m.heads, job % m.heads, rotated[job % m.heads], simd, &own->scores,
               buf->attn.data() + job * m.head_dim);
}

// hidden += o(attention(norm(hidden))), the residual stream of this thread's copy.
void AttentionBlock(const ModelShape& m, const DecoderLayer& l, const DecodeRows& b, SharedBuffers* buf,
                    ThreadState* own, int simd, Team team) {
  PhaseClock* clock = &own->clock;
  RmsNorm(own->hidden.data(), l.attn_norm, b.n, m.hidden, m.eps, own->normed.data(), simd);
  clock->Lap(kNormPhase);
  const Share qkv_rows = QkvShare(m, l.qkv, team);
  LinearShare(l.qkv, own->normed.data(), b.n, buf->qkv.data(), simd, team, qkv_rows, &own->int8, &buf->normed_codes,
              false, clock);
  clock->Lap(kQkvPhase);
  RopeAndCache(m, l, b, buf->qkv.data(), qkv_rows);
  clock->Wait(kRopePhase);  // every key cached before any row attends to it
  Attention(m, l, b, buf, own, simd, team);
  clock->Wait(kAttentionPhase);
  LinearShare(l.o, buf->attn.data(), b.n, buf->proj.data(), simd, team, WeightShare(l.o, team), &own->int8,
              &buf->attn_codes, true, clock);
  clock->Wait(kOPhase);
  for (int64_t e = 0; e < b.n * m.hidden; ++e) own->hidden[e] += buf->proj[e];
  clock->Lap(kResidualPhase);
}

// act = silu(gate) * up, the rows that down multiplies on integers quantized as they finish
// (those rows split between the threads, the others' columns).
void SiluMulRows(const ModelShape& m, int64_t n, SharedBuffers* buf, ThreadState* own, int simd, Team team,
                 const IntegerPart& part) {
  const Share rows = ShareOf(part.rows, team.thread, team.threads);
  for (int64_t i = rows.begin; i < rows.end; ++i) {
    const float* gate = buf->gate_up.data() + i * 2 * m.inter;
    SiluMul(gate, gate + m.inter, m.inter, buf->act.data() + i * m.inter, simd);
  }
  own->clock.Lap(kSiluPhase);
  QuantizeRowRange(buf->act.data(), m.inter, rows.begin, rows.end, &buf->act_codes, part.level);
  own->clock.Lap(kQuantizePhase);
  const Share cols = ShareOf(m.inter, team.thread, team.threads);  // SiLU's exps cost too much to repeat per thread
  for (int64_t i = part.rows; i < n; ++i) {
    const float* gate = buf->gate_up.data() + i * 2 * m.inter + cols.begin;
    SiluMul(gate, gate + m.inter, cols.end - cols.begin, buf->act.data() + i * m.inter + cols.begin, simd);
  }
}

// hidden += down(silu(gate) * up) of norm(hidden), the residual stream of this thread's copy.
void MlpBlock(const ModelShape& m, const DecoderLayer& l, int64_t n, SharedBuffers* buf, ThreadState* own,
              int simd, Team team) {
  PhaseClock* clock = &own->clock;
  RmsNorm(own->hidden.data(), l.mlp_norm, n, m.hidden, m.eps, own->normed.data(), simd);
  clock->Lap(kNormPhase);
  LinearShare(l.gate_up, own->normed.data(), n, buf->gate_up.data(), simd, team, WeightShare(l.gate_up, team),
              &own->int8, &buf->normed_codes, false, clock);
  clock->Wait(kGateUpPhase);
  SiluMulRows(m, n, buf, own, simd, team, IntegerPartOf(l.down, n, own->int8, simd));
  clock->Wait(kSiluPhase);
  LinearShare(l.down, buf->act.data(), n, buf->proj.data(), simd, team, WeightShare(l.down, team), &own->int8,
              &buf->act_codes, true, clock);
  clock->Wait(kDownPhase);
  for (int64_t e = 0; e < n * m.hidden; ++e) own->hidden[e] += buf->proj[e];
  clock->Lap(kResidualPhase);
}

}  // namespace

extern "C" {

// Runs `num_layers` decoder layers over the residual stream `hidden` [n, hidden] of `rows` in
// place; where its first `lead` rows are at least `int8_rows` (0: none), their products multiply
// activations in `planes` int8 planes where the CPU has VNNI (as sgq_matmul), the other rows'
// stay fp32. Returns 0, or -1 for an unsupported layer.
int sgq_decode_layers(const ModelShape* shape, const DecoderLayer* layers, int64_t num_layers,
                      const DecodeRows* rows, float* hidden, int threads, int simd, int64_t int8_rows,
                      int planes, int64_t lead) {
  const ModelShape& m = *shape;
  Format f;
  for (int64_t i = 0; i < num_layers; ++i)
    for (const Linear* l : {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down})
      if (!FormatOf(l->type, &f) || l->cols % f.block_elems != 0) return -1;
  if (m.heads % m.kv_heads != 0 || m.head_dim % 2 != 0 || planes < 1 || planes > 2) return -1;
  const int vec = simd < SimdLevel() ? simd : SimdLevel();
  const auto called = std::chrono::steady_clock::now();
  const int64_t integer_rows = lead < rows->n ? lead : rows->n;
  SharedBuffers buf(m, rows->n, integer_rows, int8_rows > 0 && integer_rows >= int8_rows, planes, Int8Level(vec));
#pragma omp parallel num_threads(threads)
  {
    const Team team = ThisTeam();
    ThreadState own(m, rows->n, hidden, int8_rows, planes, lead, g_profiling && team.thread == g_profiled_thread);
    if (g_profiling) {  // the call's set-up and the team's start, up to every thread's arrival
      Barrier();
      own.clock.last = called;
      own.clock.Lap(kStartPhase);
    }
    for (int64_t i = 0; i < num_layers; ++i) {
      AttentionBlock(m, layers[i], *rows, &buf, &own, vec, team);
      MlpBlock(m, layers[i], rows->n, &buf, &own, vec, team);
    }
    Barrier();  // every thread has read `hidden` into its copy before thread 0 overwrites it
    if (team.thread == 0) std::memcpy(hidden, own.hidden.data(), own.hidden.size() * sizeof(float));
  }
  return 0;
}

// Profiling of sgq_decode_layers' phases on its thread `on` - 1 on (`on` >= 1, the sums reset)
// or off (`on` 0, the sums kept).
void sgq_profile_phases(int on) {
  g_profiling = on > 0;
  if (!g_profiling) return;
  g_profiled_thread = on - 1;
  for (double& t : g_phase_seconds) t = 0;
}

// The seconds each phase took since profiling began, into `out` (up to `capacity`); returns the
// number of phases.
int sgq_phase_seconds(double* out, int capacity) {
  for (int p = 0; p < kPhases && p < capacity; ++p) out[p] = g_phase_seconds[p];
  return kPhases;
}

}  // extern "C"
