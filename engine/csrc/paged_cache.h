/* The block-paged KV cache as the CPU attention kernels read it (paged_decode.c, paged_prefill.c).
 *
 * A layer's K (or V) cache is [num_slots, num_kv_heads, head_dim] in float32, bfloat16, fp8 e4m3 or
 * fp8 e5m2, slot = block_id * block_size + offset; a sequence's block table lists its blocks in order.
 * fp8 values decode through 256-entry tables, one per KV head ([num_kv_heads, 256]), that already
 * hold that head's dequantization scale.
 */
#ifndef DRIFTGATE_PAGED_CACHE_H
#define DRIFTGATE_PAGED_CACHE_H

#include <stdint.h>
#include <string.h>

#include "fp8.h"

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_FP8 = 2, CACHE_E5M2 = 3 };

static const int ELEMENT_BYTES[] = {4, 2, 1, 1};

/* The byte of 1.0 in an fp8 cache type: its table entry is the head's scale itself. */
static inline int fp8_one(int cache_type) { return cache_type == CACHE_E5M2 ? 0x3C : 0x38; }

static inline int is_fp8_cache(int cache_type) { return cache_type >= CACHE_FP8; }

/* Row `index` of a cache as float32: a pointer into the cache itself for f32, else upcast into dst. */
static inline const float *cache_row(const void *cache, int64_t index, int head_dim, int cache_type,
                                     const float *fp8_table, float *dst) {
    if (cache_type == CACHE_F32) return (const float *)cache + index * head_dim;
    if (cache_type == CACHE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + index * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(&dst[d], &bits, sizeof(float));
        }
    } else { /* in registers: 2x faster than table lookups at batch 32 */
        const uint8_t *src = (const uint8_t *)cache + index * head_dim;
        const int e5m2 = cache_type == CACHE_E5M2;
        /* widen_fp8 gives an e4m3 value / 256, widen_e5m2 the value itself */
        const float scale = fp8_table[fp8_one(cache_type)] * (e5m2 ? 1.0f : 256.0f);
        int d = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
        /* 8 at a time: a 16-float vector would live on the stack here (8x slower, AVX2 build) */
        for (; d + 8 <= head_dim; d += 8) {
            const __m256 x = e5m2 ? widen_e5m2_8(src + d) : widen_fp8_8((const int8_t *)src + d);
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(x, _mm256_set1_ps(scale)));
        }
#else
        for (; d + 16 <= head_dim; d += 16) {
            const fp8_vec x = (e5m2 ? widen_e5m2(src + d) : widen_fp8((const int8_t *)src + d)) * scale;
            memcpy(dst + d, &x, sizeof x);
        }
#endif
        for (; d < head_dim; d++) dst[d] = fp8_table[src[d]];
    }
    return dst;
}

/* 16 floats; aligned(4) lets it load from any float's address. */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));

/* Shuffle indices that pair vectors x = v[i] and y = v[i + b] (b = 8, 4, 2, 1) for 16x16 lane
 * transposes: KEEP_b keeps x's lanes without bit b and takes y's lanes with bit b clear into the
 * others; TAKE_b gathers the remaining halves. Applied for b = 8, 4, 2, 1 they transpose 16 vectors
 * (the prefill kernel's transpose16); adding each KEEP and TAKE result instead sums 16 vectors'
 * lanes at once (the decode kernel's lane_sums). */
#define KEEP_8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define TAKE_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define KEEP_4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define TAKE_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define KEEP_2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define TAKE_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define KEEP_1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define TAKE_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
/* the same for vectors of 8 lanes (b = 4, 2, 1), where the kernels use 8-lane vectors (no AVX-512) */
#define KEEP8_4 0, 1, 2, 3, 8, 9, 10, 11
#define TAKE8_4 4, 5, 6, 7, 12, 13, 14, 15
#define KEEP8_2 0, 1, 8, 9, 4, 5, 12, 13
#define TAKE8_2 2, 3, 10, 11, 6, 7, 14, 15
#define KEEP8_1 0, 8, 2, 10, 4, 12, 6, 14
#define TAKE8_1 1, 9, 3, 11, 5, 13, 7, 15

/* The cache slot of a sequence's token t (block_size = 1 << block_shift). */
static inline int64_t slot_of(const int32_t *table, int block_shift, int t) {
    return ((int64_t)table[t >> block_shift] << block_shift) + (t & ((1 << block_shift) - 1));
}

/* KV head kv's row in a slot as float32 (fp8_tables: [kv_heads, 256], fp8 caches only). */
static inline const float *head_row(const void *cache, int64_t slot, int kv, int kv_heads, int head_dim,
                                    int cache_type, const float *fp8_tables, float *upcast) {
    return cache_row(cache, slot * kv_heads + kv, head_dim, cache_type,
                     is_fp8_cache(cache_type) ? fp8_tables + (size_t)kv * 256 : NULL, upcast);
}

#endif
