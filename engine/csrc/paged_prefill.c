/* Paged prefill attention for CPUs: prompt chunks (many query tokens per sequence) attend causally
 * to their sequence's keys and values, read in place from the block-paged cache.
 *
 * torch's SDPA needs each sequence's K and V gathered into dense tensors first, and on this
 * shape (three query heads of 64 per KV head, a few hundred tokens) runs near 50 GFLOP/s, a
 * quarter of the FMA peak the matmuls reach. Here a task takes LANES query tokens of one sequence
 * and every query head of one KV head, holds their queries transposed (a vector per head and
 * dimension, one lane per token; register transposes in and out), and walks the keys 16
 * at a time with an online softmax (FlashAttention): scores are lane-wise FMAs of those vectors
 * with each key's broadcast elements, and the output accumulates the same way from each value's
 * elements, so no horizontal sums and no transposes of K or V are needed. A head's scores of
 * a key tile stay in registers from the dot products through the softmax (an inline exp) to the
 * weighted sum; the FMA loops then run near the core's peak and the softmax is most of the rest.
 * Key tiles past a task's last query are skipped; the one crossing the diagonal masks scores
 * above it.
 *
 * Layouts (all contiguous):
 *   q, out        float32 [rows, num_heads, head_dim]: sequence s owns rows [query_start[s], query_start[s + 1])
 *   k/v cache     see paged_cache.h
 *   block_tables  int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs], this step's tokens
 *                 included: a sequence's queries are its last query_start[s + 1] - query_start[s]
 *                 tokens, so query i sits at position context_len - num_queries + i and sees keys
 *                 up to and including that position; with a sliding window (window > 0), only
 *                 the last `window` of them.
 *   softcap       > 0: scores become softcap · tanh(score / softcap) before the softmax (Gemma 2).
 *
 * Built at first use by engine/layers/cpu_kernels.py; OpenMP shares torch's thread pool.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"

/* Query tokens a vector holds: 16 with AVX-512, 8 elsewhere (GCC keeps a 64-byte vector in memory
 * where no register is that wide, and the kernel ran 8x slower on an AVX2 build). A lane is one
 * query over the same tiles of keys either way, so its floats are the same. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
enum { QUERY_TILE = LANES, KEY_TILE = 16, KEY_BLOCK = 8, DIM_BLOCK = 8 };

typedef float lane_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t lane_int __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Per-thread scratch, in floats: each query head's queries and output accumulators transposed
 * ([D] vectors each) and its running max and sum (a vector each), upcast K and V tiles
 * [KEY_TILE, D] and one zero row [D]. */
static size_t scratch_floats(int group, int head_dim) {
    return (size_t)LANES * group * (2 * head_dim + 2) + (size_t)(2 * KEY_TILE + 1) * head_dim;
}

static inline lane_vec select_lanes(lane_int mask, lane_vec if_set, lane_vec if_clear) {
    return (lane_vec)(((lane_int)if_set & mask) | ((lane_int)if_clear & ~mask));
}

/* e^x for x <= 0 (softmax exponents), a vector's lanes in registers: 2^n · e^r with n = round(x / ln 2),
 * e^r by its Taylor series to r^7 (|r| <= ln 2 / 2, relative error under 1e-8 before rounding).
 * Below -87 (e^-87 is near the smallest normal float) the result is 0, which covers -inf; those
 * lanes are clamped first so none computes with infinities or denormals. A call into the vector
 * libm per vector cost a tenth of the kernel's time. */
static inline lane_vec exp_lanes(lane_vec x) {
    const lane_int underflow = x < -87.0f;
    x = select_lanes(underflow, (lane_vec){0} - 87.0f, x);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const lane_vec shifted = x * 1.44269504f + magic, n = shifted - magic;
    const lane_vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln 2 in two parts, so r stays exact */
    lane_vec p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const lane_int two_to_n = (((lane_int)shifted - (lane_int)((lane_vec){0} + magic)) + 127) << 23;
    return select_lanes(underflow, (lane_vec){0}, p * (lane_vec)two_to_n);
}

/* LANES vectors of LANES lanes transposed in place (m[i][j] <-> m[j][i]): rounds that swap the
 * off-diagonal halves of ever smaller blocks (8, 4, 2, 1 lanes wide), two-source shuffles
 * (KEEP_b / TAKE_b, KEEP8_b / TAKE8_b: paged_cache.h). */
static inline __attribute__((always_inline)) void transpose_lanes(lane_vec *m) {
#define SWAP_BLOCKS(b, keep, take)                              \
    for (int i = 0; i < LANES; i++)                             \
        if (!(i & (b))) {                                       \
            const lane_vec x = m[i], y = m[i + (b)];            \
            m[i] = __builtin_shufflevector(x, y, keep);         \
            m[i + (b)] = __builtin_shufflevector(x, y, take);   \
        }
#if LANES == 16
    SWAP_BLOCKS(8, KEEP_8, TAKE_8) SWAP_BLOCKS(4, KEEP_4, TAKE_4) SWAP_BLOCKS(2, KEEP_2, TAKE_2)
    SWAP_BLOCKS(1, KEEP_1, TAKE_1)
#else
    SWAP_BLOCKS(4, KEEP8_4, TAKE8_4) SWAP_BLOCKS(2, KEEP8_2, TAKE8_2) SWAP_BLOCKS(1, KEEP8_1, TAKE8_1)
#endif
#undef SWAP_BLOCKS
}

/* dst[d] (lane t) = scale * src[t * stride + d] for the first n of LANES rows (zero lanes after). */
static inline __attribute__((always_inline)) void load_transposed(lane_vec *dst, const float *src, int64_t stride,
                                                                  int n, int D, float scale) {
    int d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES) {
        lane_vec m[LANES];
        for (int t = 0; t < LANES; t++) m[t] = t < n ? *(const lane_vec *)(src + t * stride + d0) * scale : (lane_vec){0};
        transpose_lanes(m);
        for (int i = 0; i < LANES; i++) dst[d0 + i] = m[i];
    }
    for (; d0 < D; d0++) /* dimensions past the last multiple of LANES */
        for (int t = 0; t < LANES; t++) ((float *)&dst[d0])[t] = t < n ? src[t * stride + d0] * scale : 0.0f;
}

/* dst[t * stride + d] = src[d] (lane t) * factor (lane t) for the first n of LANES rows. */
static inline __attribute__((always_inline)) void store_transposed(float *dst, int64_t stride, const lane_vec *src,
                                                                   lane_vec factor, int n, int D) {
    int d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES) {
        lane_vec m[LANES];
        for (int i = 0; i < LANES; i++) m[i] = src[d0 + i];
        transpose_lanes(m);
        for (int t = 0; t < n; t++) *(lane_vec *)(dst + t * stride + d0) = m[t] * factor[t];
    }
    for (; d0 < D; d0++)
        for (int t = 0; t < n; t++) dst[t * stride + d0] = ((const float *)&src[d0])[t] * factor[t];
}

/* softcap · tanh(x / softcap), lane by lane: tanh from exp_lanes of -2|y|, which stays in its domain. */
static inline lane_vec softcap_lanes(lane_vec x, float softcap) {
    const lane_vec y = x / softcap, negative_y = (lane_vec){0} - y;
    const lane_int negative = y < 0.0f;
    const lane_vec t = exp_lanes(select_lanes(negative, y, negative_y) * 2.0f); /* e^(-2|y|) */
    const lane_vec magnitude = (1.0f - t) / (1.0f + t);
    return select_lanes(negative, (lane_vec){0} - magnitude, magnitude) * softcap;
}

/* One query head's LANES query tokens against one tile of keys (rows krow/vrow; the first
 * `keys` are real): scores, online-softmax update of its running max and sum, and the weighted
 * sum of values into ot, with the tile's scores kept in registers throughout. `hidden` lanes
 * (keys after a query's position) score -inf. */
static inline __attribute__((always_inline)) void attend_keys(const lane_vec *qt, lane_vec *ot, lane_vec *run_max,
                                                              lane_vec *run_sum, const float *const *krow,
                                                              const float *const *vrow, int keys,
                                                              const lane_int *hidden, float softcap, int D) {
    const lane_vec minus_inf = (lane_vec){0} - INFINITY;
    lane_vec s[KEY_TILE];
#pragma GCC unroll 2
    for (int j0 = 0; j0 < KEY_TILE; j0 += KEY_BLOCK) {
        lane_vec acc[KEY_BLOCK] = {0};
        if (j0 < keys)
            for (int d = 0; d < D; d++) {
                const lane_vec qd = qt[d];
#pragma GCC unroll 8
                for (int jb = 0; jb < KEY_BLOCK; jb++) acc[jb] += qd * krow[j0 + jb][d];
            }
#pragma GCC unroll 8
        for (int jb = 0; jb < KEY_BLOCK; jb++)
            s[j0 + jb] = j0 >= keys ? minus_inf : softcap > 0.0f ? softcap_lanes(acc[jb], softcap) : acc[jb];
    }
    if (hidden != NULL)
#pragma GCC unroll 16
        for (int j = 0; j < KEY_TILE; j++) s[j] = select_lanes(hidden[j], minus_inf, s[j]);
    lane_vec tile_max = *run_max;
#pragma GCC unroll 16
    for (int j = 0; j < KEY_TILE; j++) tile_max = select_lanes(s[j] > tile_max, s[j], tile_max);
    const lane_vec rescale = exp_lanes(*run_max - tile_max);
    lane_vec sum = *run_sum * rescale;
#pragma GCC unroll 16
    for (int j = 0; j < KEY_TILE; j++) {
        s[j] = exp_lanes(s[j] - tile_max);
        sum += s[j];
    }
    *run_max = tile_max;
    *run_sum = sum;
    for (int d0 = 0; d0 < D; d0 += DIM_BLOCK) {
        lane_vec acc[DIM_BLOCK];
#pragma GCC unroll 8
        for (int db = 0; db < DIM_BLOCK; db++) acc[db] = ot[d0 + db] * rescale;
#pragma GCC unroll 2
        for (int j0 = 0; j0 < KEY_TILE; j0 += KEY_BLOCK)
            if (j0 < keys)
#pragma GCC unroll 8
                for (int jb = 0; jb < KEY_BLOCK; jb++) {
                    const lane_vec p = s[j0 + jb];
                    const float *v = vrow[j0 + jb] + d0;
#pragma GCC unroll 8
                    for (int db = 0; db < DIM_BLOCK; db++) acc[db] += p * v[db];
                }
#pragma GCC unroll 8
        for (int db = 0; db < DIM_BLOCK; db++) ot[d0 + db] = acc[db];
    }
}

/* One task: `num_queries` (<= LANES) query tokens of one sequence, the first at position
 * `first_pos`, and query heads [kv * G, (kv + 1) * G). q and out point at the first token's row.
 * Each tile of keys is read (upcast for narrow caches) once and serves the G heads in turn. */
static inline __attribute__((always_inline)) void attend_tile_body(
    const float *q, float *out, int num_queries, int first_pos, const void *k_cache, const void *v_cache,
    const int32_t *table, int block_shift, int kv, int kv_heads, int group, int head_dim, float scale,
    int cache_type, const float *k_tables, const float *v_tables, int window, float softcap, float *scratch) {
    const int G = group, D = head_dim, row = kv_heads * G * D;
    lane_vec *qt = (lane_vec *)scratch, *ot = qt + G * D, *run_max = ot + G * D, *run_sum = run_max + G;
    float *k_upcast = (float *)(run_sum + G), *v_upcast = k_upcast + KEY_TILE * D, *zero_row = v_upcast + KEY_TILE * D;
    for (int g = 0; g < G; g++) {
        load_transposed(qt + g * D, q + (kv * G + g) * D, row, num_queries, D, scale);
        /* finite, so a lane whose first tiles all lie before its window rescales by exp(0), not exp(NaN) */
        run_max[g] = (lane_vec){0} - FLT_MAX;
        run_sum[g] = (lane_vec){0};
    }
    memset(ot, 0, sizeof(lane_vec) * (size_t)G * D);
    memset(zero_row, 0, sizeof(float) * (size_t)D);
    lane_int positions; /* lane t: query t's position */
    for (int t = 0; t < LANES; t++) positions[t] = first_pos + t;

    const int last_pos = first_pos + num_queries - 1;
    /* the first tile any query's window reaches */
    const int first_key = window > 0 && first_pos >= window ? (first_pos - window + 1) / KEY_TILE * KEY_TILE : 0;
    for (int k0 = first_key; k0 <= last_pos; k0 += KEY_TILE) {
        const int keys = last_pos - k0 + 1 < KEY_TILE ? last_pos - k0 + 1 : KEY_TILE;
        const float *krow[KEY_TILE], *vrow[KEY_TILE];
        for (int j = 0; j < KEY_TILE; j++) {
            if (j >= keys) {
                krow[j] = vrow[j] = zero_row;
                continue;
            }
            const int64_t slot = slot_of(table, block_shift, k0 + j);
            krow[j] = head_row(k_cache, slot, kv, kv_heads, D, cache_type, k_tables, k_upcast + j * D);
            vrow[j] = head_row(v_cache, slot, kv, kv_heads, D, cache_type, v_tables, v_upcast + j * D);
        }
        /* key j is hidden from queries before it (the tile crosses the diagonal) and from those
         * `window` or more tokens after it (the tile crosses a window's start) */
        lane_int hidden[KEY_TILE];
        const int crosses = k0 + KEY_TILE - 1 > first_pos, leaves_window = window > 0 && k0 <= last_pos - window;
        for (int j = 0; j < KEY_TILE && (crosses || leaves_window); j++)
            hidden[j] = (positions < k0 + j) | (leaves_window ? positions - window >= k0 + j : (lane_int){0});
        for (int g = 0; g < G; g++)
            attend_keys(qt + g * D, ot + g * D, run_max + g, run_sum + g, krow, vrow, keys,
                        crosses || leaves_window ? hidden : NULL, softcap, D);
    }
    for (int g = 0; g < G; g++)
        store_transposed(out + (kv * G + g) * D, row, ot + g * D, 1.0f / run_sum[g], num_queries, D);
}

/* attend_tile_body with common (query heads per KV head, head_dim) pairs as constants, so its
 * loops over heads and dimensions have fixed trip counts; other shapes take the general code. */
static void attend_tile(const float *q, float *out, int num_queries, int first_pos, const void *k_cache,
                        const void *v_cache, const int32_t *table, int block_shift, int kv, int kv_heads, int group,
                        int head_dim, float scale, int cache_type, const float *k_tables, const float *v_tables,
                        int window, float softcap, float *scratch) {
#define FIXED_SHAPE(G, D)                                                                                          \
    if (group == G && head_dim == D) {                                                                             \
        attend_tile_body(q, out, num_queries, first_pos, k_cache, v_cache, table, block_shift, kv, kv_heads, G, D, \
                         scale, cache_type, k_tables, v_tables, window, softcap, scratch);                         \
        return;                                                                                                    \
    }
    FIXED_SHAPE(1, 64) FIXED_SHAPE(3, 64) FIXED_SHAPE(4, 64) FIXED_SHAPE(1, 128) FIXED_SHAPE(4, 128) FIXED_SHAPE(8, 128)
#undef FIXED_SHAPE
    attend_tile_body(q, out, num_queries, first_pos, k_cache, v_cache, table, block_shift, kv, kv_heads, group,
                     head_dim, scale, cache_type, k_tables, v_tables, window, softcap, scratch);
}

/* A task: one sequence's query tile (first_query, last_pos) against one KV head. */
typedef struct {
    int32_t seq_len, seq, kv, first_query, last_pos;
} Task;

/* Longest sequences first, so the threads finish together; within one, a KV head's tiles in a row
 * from the last, so the keys and values they share stay in cache between them (reading them
 * from L3 each time, in order of tile length alone, cost a fifth of the kernel's time). */
static int by_sequence_then_tile(const void *a, const void *b) {
    const Task *x = a, *y = b;
    if (x->seq_len != y->seq_len) return y->seq_len - x->seq_len;
    if (x->seq != y->seq) return x->seq - y->seq;
    if (x->kv != y->kv) return x->kv - y->kv;
    return y->last_pos - x->last_pos;
}

/* Returns 0; -1 when the scratch allocation failed, -2 when block_size is not a power of two, -3
 * when head_dim is not a multiple of DIM_BLOCK (nothing is written then). */
int paged_prefill_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                            int num_seqs, int max_blocks, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int cache_type, const float *k_tables,
                            const float *v_tables, int window, float softcap, int num_threads) {
    if (block_size < 1 || (block_size & (block_size - 1))) return -2;
    if (head_dim % DIM_BLOCK) return -3;
    if (num_threads < 1) num_threads = 1;
    int block_shift = 0;
    while ((1 << block_shift) < block_size) block_shift++;
    const int group = num_heads / num_kv_heads, row = num_heads * head_dim;
    int num_tasks = 0;
    for (int s = 0; s < num_seqs; s++)
        num_tasks += (query_start[s + 1] - query_start[s] + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;
    Task *tasks = malloc(sizeof(Task) * (size_t)(num_tasks > 0 ? num_tasks : 1));
    const size_t per_thread = (scratch_floats(group, head_dim) + LANES - 1) / LANES * LANES;
    float *scratch = aligned_alloc(64, sizeof(float) * per_thread * (size_t)num_threads);
    if (tasks == NULL || scratch == NULL) {
        free(tasks);
        free(scratch);
        return -1;
    }
    int n = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int num_queries = query_start[s + 1] - query_start[s], first_pos = context_lens[s] - num_queries;
        for (int kv = 0; kv < num_kv_heads; kv++)
            for (int i = 0; i < num_queries; i += QUERY_TILE) {
                const int count = num_queries - i < QUERY_TILE ? num_queries - i : QUERY_TILE;
                tasks[n++] = (Task){context_lens[s], s, kv, i, first_pos + i + count - 1};
            }
    }
    qsort(tasks, (size_t)num_tasks, sizeof(Task), by_sequence_then_tile);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int i = 0; i < num_tasks; i++) {
        const Task task = tasks[i];
        const int s = task.seq, num_queries = query_start[s + 1] - query_start[s];
        const int count = num_queries - task.first_query < QUERY_TILE ? num_queries - task.first_query : QUERY_TILE;
        const int64_t first_row = query_start[s] + task.first_query;
        attend_tile(q + first_row * row, out + first_row * row, count, task.last_pos - count + 1, k_cache, v_cache,
                    block_tables + (int64_t)s * max_blocks, block_shift, task.kv, num_kv_heads, group, head_dim,
                    scale, cache_type, k_tables, v_tables, window, softcap,
                    scratch + per_thread * (size_t)omp_get_thread_num());
    }
    free(tasks);
    free(scratch);
    return 0;
}
