/* Decoding fp8 bytes in vector registers, shared by the panel matmul (fp8 e4m3 weights) and
 * paged decode attention (fp8 e4m3 or e5m2 KV caches), and rounding floats to them. */
#ifndef DRIFTGATE_FP8_H
#define DRIFTGATE_FP8_H

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>

typedef float fp8_vec __attribute__((vector_size(16 * sizeof(float)), aligned(sizeof(float))));

#if defined(__AVX2__) && defined(__F16C__)
/* 8 fp8 e4m3 bytes as floats / 256, as widen_fp8 below explains. */
static inline __attribute__((always_inline)) __m256 widen_fp8_8(const int8_t *p) {
    const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7),
                                        _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8)));
}
#endif

/* 16 fp8 e4m3 bytes as floats, each divided by 256 (exactly): the 7 magnitude bits shifted
 * into an fp16's exponent and mantissa make an fp16 of value v / 256, subnormals included, and the
 * hardware fp16 → fp32 conversion does the rest. The caller's scales carry the 256 back.
 * (Byte 0x7F, e4m3's NaN, comes out as 480 / 256: never stored from a finite value.) */
static inline __attribute__((always_inline)) fp8_vec widen_fp8(const int8_t *p) {
#if defined(__AVX512F__)
    __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), 7),
                                _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8));
    return (fp8_vec)_mm512_cvtph_ps(h);
#elif defined(__AVX2__) && defined(__F16C__)
    union { fp8_vec v; __m256 half[2]; } out;
    for (int i = 0; i < 2; i++) out.half[i] = widen_fp8_8(p + 8 * i);
    return out.v;
#else
    fp8_vec v;
    for (int i = 0; i < 16; i++) {
        uint8_t b = (uint8_t)p[i];
        int e = (b >> 3) & 15, m = b & 7;
        float mag = e ? ldexpf(8 + m, e - 18) : ldexpf(m, -17);  /* (1 + m/8)·2^(e-7) / 256, or m·2^-9 / 256 */
        v[i] = b & 0x80 ? -mag : mag;
    }
    return v;
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
/* 8 fp8 e5m2 bytes as floats, as widen_e5m2 below explains. */
static inline __attribute__((always_inline)) __m256 widen_e5m2_8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
#endif

/* 16 fp8 e5m2 bytes as floats: an e5m2 byte is the high byte of the fp16 of the same value (same
 * exponent bias, two of fp16's ten mantissa bits), so shifting it up makes that fp16 exactly. */
static inline __attribute__((always_inline)) fp8_vec widen_e5m2(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
    return (fp8_vec)_mm512_cvtph_ps(h);
#elif defined(__AVX2__) && defined(__F16C__)
    union { fp8_vec v; __m256 half[2]; } out;
    for (int i = 0; i < 2; i++) out.half[i] = widen_e5m2_8(p + 8 * i);
    return out.v;
#else
    fp8_vec v;
    for (int i = 0; i < 16; i++) {
        int e = (p[i] >> 2) & 31, m = p[i] & 3;
        float mag = e ? ldexpf(4 + m, e - 17) : ldexpf(m, -16); /* (1 + m/4)·2^(e-15), or m·2^-16 */
        v[i] = p[i] & 0x80 ? -mag : mag;
    }
    return v;
#endif
}

/* How an FP8 W8A8 Linear rounds its inputs (engine/layers/panel_matmul.py's ACT_*): not at all, or
 * through fp8 with a scale per token (or per token and group of columns, for block FP8), one scale
 * for the whole batch, or a fixed one. */
enum { ACT_NONE = 0, ACT_FP8_TOKEN = 1, ACT_FP8_TENSOR = 2, ACT_FP8_STATIC = 3 };

enum { FP8_SUBNORMAL_STEPS = 512 }; /* e4m3's subnormals are multiples of 2^-9, below 2^-6 */

/* An fp8 format: its mantissa bits, exponent bias and largest finite value. The functions taking
 * one are always inlined with a constant format, so they compile to that format's own constants. */
typedef struct { int mantissa, bias; float max; } Fp8Format;
static const Fp8Format E4M3 = {3, 7, 448.0f}, E5M2 = {2, 15, 57344.0f};

/* 2^e as a float, for -126 <= e <= 127. */
static inline __attribute__((always_inline)) float pow2f(int e) {
    const uint32_t bits = (uint32_t)(127 + e) << 23;
    float v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

/* v saturated to ±max (comparisons, not fmaxf/fminf: those stay libm calls at -O3); torch's casts
 * would overflow instead (e4m3 to NaN, e5m2 to infinity). */
static inline float clamp_to(float v, float max) { return v < -max ? -max : v > max ? max : v; }

static inline float clamp_fp8(float v) { return clamp_to(v, E4M3.max); }

/* v (within the format's range) to the nearest value of format f, ties to even, as torch's casts
 * do: below the smallest normal, 2^(1 - bias), the values are multiples of 2^(1 - bias - mantissa). */
static inline __attribute__((always_inline)) float round_to_fp8(float v, Fp8Format f) {
    const float step = pow2f(1 - f.bias - f.mantissa);
    if (fabsf(v) < pow2f(1 - f.bias)) return rintf(v / step) * step;
    const int dropped = 23 - f.mantissa; /* of float32's mantissa bits */
    uint32_t bits;
    __builtin_memcpy(&bits, &v, sizeof bits);
    bits += ((1u << (dropped - 1)) - 1) + ((bits >> dropped) & 1u);
    bits &= ~((1u << dropped) - 1);
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float round_to_e4m3(float v) { return round_to_fp8(v, E4M3); }

/* quant.fp8.fp8_scale's: absmax / 448, never below float32's epsilon (an all-zero row must not divide by 0). */
static inline float fp8_scale_of(float absmax) { return fmaxf(absmax / 448.0f, FLT_EPSILON); }

static inline float absmax_of(const float *x, int64_t n) {
    float amax = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

#if defined(__AVX512F__)
/* round_to_e4m3 on 16 lanes. */
static inline __m512 round_to_e4m3_16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    const __m512i kept = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFFF))),
                                          _mm512_set1_epi32((int)0xFFF00000u));
    const __m512 steps = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(FP8_SUBNORMAL_STEPS)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 subnormal = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(subnormal, _mm512_castsi512_ps(kept),
                                _mm512_mul_ps(steps, _mm512_set1_ps(1.0f / FP8_SUBNORMAL_STEPS)));
}
#endif

#endif
