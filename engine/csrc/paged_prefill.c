/* Paged prefill attention for CPUs: prompt chunks (many query tokens per sequence) attend causally
 * to their sequence's keys and values, read in place from the block-paged cache.
 *
 * torch's SDPA needs each sequence's K and V gathered into dense tensors first, and on this
 * shape (three query heads of 64 per KV head, a few hundred tokens) runs near 50 GFLOP/s, a
 * quarter of the FMA peak the matmuls reach. Here a task takes 16 query tokens of one sequence
 * and every query head of one KV head, holds their queries transposed (a vector per head and
 * dimension, one lane per token), and walks the keys 16 at a time with an online softmax
 * (FlashAttention): scores are lane-wise FMAs of those vectors with each key's broadcast
 * elements, and the output accumulates the same way from each value's elements, so no
 * horizontal sums and no transposes of K or V are needed. Key tiles past a task's last query
 * are skipped; the one crossing the diagonal masks scores above it.
 *
 * Layouts (all contiguous):
 *   q, out        float32 [rows, num_heads, head_dim]: sequence s owns rows [query_start[s], query_start[s + 1])
 *   k/v cache     see paged_cache.h
 *   block_tables  int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs], this step's tokens
 *                 included: a sequence's queries are its last query_start[s + 1] - query_start[s]
 *                 tokens, so query i sits at position context_len - num_queries + i and sees keys
 *                 up to and including that position.
 *
 * Built at first use by engine/layers/cpu_kernels.py; OpenMP shares torch's thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"

#ifdef HAVE_LIBMVEC
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

enum { LANES = 16, QUERY_TILE = LANES, KEY_TILE = 16, KEY_BLOCK = 8, DIM_BLOCK = 8 };

/* Per-thread scratch, in floats: queries and output accumulators transposed ([G * D] vectors
 * each), scores [KEY_TILE * G] vectors, running max and sum [G] vectors, the tile's new max
 * and rescale factor, upcast K and V tiles [KEY_TILE, D] and one zero row [D]. */
static size_t scratch_floats(int group, int head_dim) {
    return (size_t)LANES * (2 * group * head_dim + KEY_TILE * group + 2 * group + 2) +
           (size_t)(2 * KEY_TILE + 1) * head_dim;
}

/* One task: `num_queries` (<= 16) query tokens of one sequence, the first at position
 * `first_pos`, and query heads [kv * G, (kv + 1) * G). q and out point at the first token's row. */
static inline __attribute__((always_inline)) void attend_tile_body(
    const float *q, float *out, int num_queries, int first_pos, const void *k_cache, const void *v_cache,
    const int32_t *table, int block_shift, int kv, int kv_heads, int group, int head_dim, float scale,
    int cache_type, const float *k_tables, const float *v_tables, float *scratch) {
    const int G = group, D = head_dim, row = kv_heads * G * D;
    vec16 *qt = (vec16 *)scratch, *ot = qt + G * D, *scores = ot + G * D;
    float *run_max = (float *)(scores + KEY_TILE * G), *run_sum = run_max + LANES * G;
    float *tile_max = run_sum + LANES * G, *rescale = tile_max + LANES;
    float *k_upcast = rescale + LANES, *v_upcast = k_upcast + KEY_TILE * D, *zero_row = v_upcast + KEY_TILE * D;

    float *qt_f = (float *)qt;
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++)
            for (int t = 0; t < LANES; t++)
                qt_f[((size_t)g * D + d) * LANES + t] = t < num_queries ? q[(size_t)t * row + (kv * G + g) * D + d] * scale : 0.0f;
    memset(ot, 0, sizeof(vec16) * (size_t)G * D);
    memset(zero_row, 0, sizeof(float) * (size_t)D);
    for (int i = 0; i < LANES * G; i++) run_max[i] = -INFINITY, run_sum[i] = 0.0f;

    const int last_pos = first_pos + num_queries - 1;
    for (int k0 = 0; k0 <= last_pos; k0 += KEY_TILE) {
        const float *krow[KEY_TILE], *vrow[KEY_TILE];
        for (int j = 0; j < KEY_TILE; j++) {
            if (k0 + j > last_pos) {
                krow[j] = vrow[j] = zero_row;
                continue;
            }
            const int64_t slot = slot_of(table, block_shift, k0 + j);
            krow[j] = head_row(k_cache, slot, kv, kv_heads, D, cache_type, k_tables, k_upcast + j * D);
            vrow[j] = head_row(v_cache, slot, kv, kv_heads, D, cache_type, v_tables, v_upcast + j * D);
        }
        /* scores[j * G + g] (lane t) = q_t,g · k_j, KEY_BLOCK keys at a time to reuse each query load */
        for (int g = 0; g < G; g++)
            for (int j0 = 0; j0 < KEY_TILE; j0 += KEY_BLOCK) {
                vec16 acc[KEY_BLOCK] = {0};
                for (int d = 0; d < D; d++) {
                    const vec16 qd = qt[g * D + d];
#pragma GCC unroll 8
                    for (int jb = 0; jb < KEY_BLOCK; jb++) acc[jb] += qd * krow[j0 + jb][d];
                }
#pragma GCC unroll 8
                for (int jb = 0; jb < KEY_BLOCK; jb++) scores[(j0 + jb) * G + g] = acc[jb];
            }
        float *s = (float *)scores;
        if (k0 + KEY_TILE - 1 > first_pos) /* the tile crosses the diagonal: key j is hidden from queries before it */
            for (int j = 0; j < KEY_TILE; j++)
                for (int g = 0; g < G; g++)
                    for (int t = 0; t < LANES; t++)
                        if (k0 + j > first_pos + t) s[((size_t)j * G + g) * LANES + t] = -INFINITY;
        /* online softmax per (head, token) lane: new max, rescale what came before, exponentiate */
        for (int g = 0; g < G; g++) {
            float *m = run_max + g * LANES, *l = run_sum + g * LANES;
#pragma omp simd
            for (int t = 0; t < LANES; t++) tile_max[t] = m[t];
            for (int j = 0; j < KEY_TILE; j++) {
                const float *sj = s + ((size_t)j * G + g) * LANES;
#pragma omp simd
                for (int t = 0; t < LANES; t++) tile_max[t] = sj[t] > tile_max[t] ? sj[t] : tile_max[t];
            }
#pragma omp simd
            for (int t = 0; t < LANES; t++) {
                rescale[t] = expf(m[t] - tile_max[t]);
                l[t] *= rescale[t];
                m[t] = tile_max[t];
            }
            for (int j = 0; j < KEY_TILE; j++) {
                float *sj = s + ((size_t)j * G + g) * LANES;
#pragma omp simd
                for (int t = 0; t < LANES; t++) {
                    sj[t] = expf(sj[t] - tile_max[t]);
                    l[t] += sj[t];
                }
            }
            vec16 r;
            memcpy(&r, rescale, sizeof r);
            for (int d = 0; d < D; d++) ot[g * D + d] *= r;
        }
        /* ot[g * D + d] (lane t) += Σ_j p_t,g,j · v_j[d], DIM_BLOCK dimensions at a time */
        for (int g = 0; g < G; g++)
            for (int d0 = 0; d0 < D; d0 += DIM_BLOCK) {
                vec16 acc[DIM_BLOCK];
#pragma GCC unroll 8
                for (int db = 0; db < DIM_BLOCK; db++) acc[db] = ot[g * D + d0 + db];
                for (int j = 0; j < KEY_TILE; j++) {
                    const vec16 p = scores[j * G + g];
#pragma GCC unroll 8
                    for (int db = 0; db < DIM_BLOCK; db++) acc[db] += p * vrow[j][d0 + db];
                }
#pragma GCC unroll 8
                for (int db = 0; db < DIM_BLOCK; db++) ot[g * D + d0 + db] = acc[db];
            }
    }
    const float *ot_f = (const float *)ot;
    for (int t = 0; t < num_queries; t++)
        for (int g = 0; g < G; g++) {
            const float inv = 1.0f / run_sum[g * LANES + t];
            float *o = out + (size_t)t * row + (kv * G + g) * D;
            for (int d = 0; d < D; d++) o[d] = ot_f[((size_t)g * D + d) * LANES + t] * inv;
        }
}

/* attend_tile_body with common (query heads per KV head, head_dim) pairs as constants, so its
 * loops over heads and dimensions have fixed trip counts; other shapes take the general code. */
static void attend_tile(const float *q, float *out, int num_queries, int first_pos, const void *k_cache,
                        const void *v_cache, const int32_t *table, int block_shift, int kv, int kv_heads, int group,
                        int head_dim, float scale, int cache_type, const float *k_tables, const float *v_tables,
                        float *scratch) {
#define FIXED_SHAPE(G, D)                                                                                          \
    if (group == G && head_dim == D) {                                                                             \
        attend_tile_body(q, out, num_queries, first_pos, k_cache, v_cache, table, block_shift, kv, kv_heads, G, D, \
                         scale, cache_type, k_tables, v_tables, scratch);                                          \
        return;                                                                                                    \
    }
    FIXED_SHAPE(1, 64) FIXED_SHAPE(3, 64) FIXED_SHAPE(4, 64) FIXED_SHAPE(1, 128) FIXED_SHAPE(4, 128) FIXED_SHAPE(8, 128)
#undef FIXED_SHAPE
    attend_tile_body(q, out, num_queries, first_pos, k_cache, v_cache, table, block_shift, kv, kv_heads, group,
                     head_dim, scale, cache_type, k_tables, v_tables, scratch);
}

typedef struct {
    int32_t seq, first_query, last_pos;
} Tile;

/* Longest key ranges first, so the threads finish together. */
static int by_work_descending(const void *a, const void *b) {
    return ((const Tile *)b)->last_pos - ((const Tile *)a)->last_pos;
}

/* Returns 0; -1 when the scratch allocation failed, -2 when block_size is not a power of two, -3
 * when head_dim is not a multiple of DIM_BLOCK (nothing is written then). */
int paged_prefill_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                            int num_seqs, int max_blocks, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int cache_type, const float *k_tables,
                            const float *v_tables, int num_threads) {
    if (block_size < 1 || (block_size & (block_size - 1))) return -2;
    if (head_dim % DIM_BLOCK) return -3;
    if (num_threads < 1) num_threads = 1;
    int block_shift = 0;
    while ((1 << block_shift) < block_size) block_shift++;
    const int group = num_heads / num_kv_heads, row = num_heads * head_dim;
    int num_tiles = 0;
    for (int s = 0; s < num_seqs; s++) num_tiles += (query_start[s + 1] - query_start[s] + QUERY_TILE - 1) / QUERY_TILE;
    Tile *tiles = malloc(sizeof(Tile) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    const size_t per_thread = (scratch_floats(group, head_dim) + LANES - 1) / LANES * LANES;
    float *scratch = aligned_alloc(64, sizeof(float) * per_thread * (size_t)num_threads);
    if (tiles == NULL || scratch == NULL) {
        free(tiles);
        free(scratch);
        return -1;
    }
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int num_queries = query_start[s + 1] - query_start[s], first_pos = context_lens[s] - num_queries;
        for (int i = 0; i < num_queries; i += QUERY_TILE) {
            const int count = num_queries - i < QUERY_TILE ? num_queries - i : QUERY_TILE;
            tiles[n++] = (Tile){s, i, first_pos + i + count - 1};
        }
    }
    qsort(tiles, (size_t)num_tiles, sizeof(Tile), by_work_descending);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < num_tiles * num_kv_heads; task++) {
        const Tile tile = tiles[task / num_kv_heads];
        const int kv = task % num_kv_heads, s = tile.seq;
        const int num_queries = query_start[s + 1] - query_start[s];
        const int count = num_queries - tile.first_query < QUERY_TILE ? num_queries - tile.first_query : QUERY_TILE;
        const int64_t first_row = query_start[s] + tile.first_query;
        attend_tile(q + first_row * row, out + first_row * row, count, tile.last_pos - count + 1, k_cache, v_cache,
                    block_tables + (int64_t)s * max_blocks, block_shift, kv, num_kv_heads, group, head_dim, scale,
                    cache_type, k_tables, v_tables, scratch + per_thread * (size_t)omp_get_thread_num());
    }
    free(tiles);
    free(scratch);
    return 0;
}
