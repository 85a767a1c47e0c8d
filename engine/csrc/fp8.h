/* Decoding fp8 e4m3 bytes in vector registers, shared by the panel matmul (fp8 weights) and
 * paged decode attention (fp8 KV caches). */
#ifndef DRIFTGATE_FP8_H
#define DRIFTGATE_FP8_H

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>

typedef float fp8_vec __attribute__((vector_size(16 * sizeof(float)), aligned(sizeof(float))));

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
    for (int i = 0; i < 2; i++) {
        __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p + 8 * i)));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8));
        out.half[i] = _mm256_cvtph_ps(h);
    }
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

#endif
