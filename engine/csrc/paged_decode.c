/* Paged decode attention for CPUs: one query token per sequence, keys and values read in place
 * from the block-paged cache.
 *
 * The torch path gathers every sequence's K and V into a dense copy before SDPA, so each cached
 * byte crosses memory three times (read, write, read again); at batch 32 that traffic is as large
 * as the weights'. Here each sequence's task walks its block table once for K (scores) and once
 * for V (weighted sum), a whole slot (every KV head) at a time, with the G = H / KV query heads
 * of a KV head sharing each of its loads. Each context is cut into ranges at fixed offsets whose
 * partial softmax sums merge exactly afterwards, so that a sequence's result does not depend on
 * its batch, and a batch of fewer sequences than threads can share evenly (batch 1) spreads each
 * context's ranges over several tasks.
 *
 * Layouts (all contiguous):
 *   q, out       float32 [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_slots, num_kv_heads, head_dim] in float32, bfloat16 or fp8 e4m3
 *                (slot = block_id * block_size + offset)
 *   block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs]
 * With a sliding window (window > 0) a sequence attends to its last `window` tokens only; its
 * ranges then start at the window's first token. With softcap > 0 scores become
 * softcap · tanh(score / softcap) before the softmax (Gemma 2).
 * fp8 values decode through 256-entry tables, one per KV head ([num_kv_heads, 256]), that already
 * hold that head's dequantization scale.
 *
 * Built at first use by engine/layers/cpu_kernels.py with the system C compiler; OpenMP
 * resolves to the runtime torch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"

/* glibc's vector expf: the softmax runs 16 lanes at a time (batch 32, context 300, cold caches:
 * 1.53 -> 1.28 ms per layer against scalar expf). */
#ifdef HAVE_LIBMVEC
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

/* Sum of the lanes as a tree (a plain loop compiles to 16 dependent scalar adds). */
static inline float lane_sum(vec16 v) {
    vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot(const float *a, const float *b, int n) {
    vec16 acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) acc += *(const vec16 *)(a + i) * *(const vec16 *)(b + i);
    float sum = lane_sum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Tokens are scored TILE at a time: their dot products with a query head reduce together, in one
 * vector, instead of one horizontal sum each. */
enum { TILE = 16 };

/* The tiled walk's vectors: runs of RUN dims, RUN partial dot products reduced at once, and
 * SUM_REGISTERS of them holding weighted sums in pass 2. 16 lanes with AVX-512; 8 elsewhere,
 * where GCC keeps a 16-float vector on the stack (the walk ran 5x slower on an AVX2 build). */
#ifdef __AVX512F__
#define RUN 16
enum { SUM_REGISTERS = 16 };
typedef vec16 run_vec;
#else
#define RUN 8
enum { SUM_REGISTERS = 12 };
typedef float run_vec __attribute__((vector_size(32), aligned(4)));
#endif

/* Lane i of the result is the sum of v[i]'s lanes: a transpose-and-add tree of two-source
 * shuffles and adds (45 for 16 sums), where summing each vector alone takes about 8 dependent steps. */
static inline __attribute__((always_inline)) run_vec lane_sums(const run_vec *v) {
#define SHUFFLE __builtin_shufflevector
#if RUN == 16
    vec16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* a[i]: 8 partial sums of v[2i], then 8 of v[2i+1] */
        a[i] = SHUFFLE(v[2 * i], v[2 * i + 1], KEEP_8) + SHUFFLE(v[2 * i], v[2 * i + 1], TAKE_8);
    for (int i = 0; i < 4; i++)
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], KEEP_4) + SHUFFLE(a[2 * i], a[2 * i + 1], TAKE_4);
    for (int i = 0; i < 2; i++)
        c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], KEEP_2) + SHUFFLE(b[2 * i], b[2 * i + 1], TAKE_2);
    const vec16 d = SHUFFLE(c[0], c[1], KEEP_1) + SHUFFLE(c[0], c[1], TAKE_1);
    return SHUFFLE(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15); /* d's lanes were bit-reversed */
#else
    run_vec a[4], b[2];
    for (int i = 0; i < 4; i++) /* a[i]: 4 partial sums of v[2i], then 4 of v[2i+1] */
        a[i] = SHUFFLE(v[2 * i], v[2 * i + 1], KEEP8_4) + SHUFFLE(v[2 * i], v[2 * i + 1], TAKE8_4);
    for (int i = 0; i < 2; i++)
        b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], KEEP8_2) + SHUFFLE(a[2 * i], a[2 * i + 1], TAKE8_2);
    const run_vec d = SHUFFLE(b[0], b[1], KEEP8_1) + SHUFFLE(b[0], b[1], TAKE8_1);
    return SHUFFLE(d, d, 0, 4, 2, 6, 1, 5, 3, 7); /* d's lanes were bit-reversed */
#endif
#undef SHUFFLE
}

/* The c-th run of RUN floats of a row of n; past n, zeros (so head_dim need not be a multiple of RUN). */
static inline __attribute__((always_inline)) run_vec load_run(const float *row, int c, int n) {
    if (RUN * (c + 1) <= n) return *(const run_vec *)(row + RUN * c);
    run_vec v = {0};
    memcpy(&v, row + RUN * c, sizeof(float) * (size_t)(n - RUN * c));
    return v;
}

/* How far ahead (in tokens) slots are prefetched: without it the kernel waits on DRAM for every
 * slot; with it the loads overlap the arithmetic on the slots before (measured: 2x at batch 32).
 * They are prefetched into L2 (locality hint 1), not L1: requests bound for L1 queue on its few
 * miss buffers, which capped a core near 8 GB/s; into L2, fp32 caches stream 1.5x faster
 * (batch 64, context 300, scattered blocks: 52 -> 33 ms a step over 30 layers; torch.sum reads
 * 52 GB/s here). */
enum { PREFETCH_DISTANCE = 8, PREFETCH_INTO_L2 = 1 };

/* The slot of token t, with the slot PREFETCH_DISTANCE tokens on (before `end`) on its way to the core. */
static inline int64_t slot_prefetching(const void *cache, const int32_t *table, int block_shift, int t, int end,
                                       int slot_bytes) {
    if (t + PREFETCH_DISTANCE < end) {
        const char *p = (const char *)cache + slot_of(table, block_shift, t + PREFETCH_DISTANCE) * slot_bytes;
        for (int b = 0; b < slot_bytes; b += 64) __builtin_prefetch(p + b, 0, PREFETCH_INTO_L2);
    }
    return slot_of(table, block_shift, t);
}

/* scores[h][t] ← exp(scores[h][t] - m[h]) over tokens t < n (rows `stride` apart), for every query
 * head h, with m[h] the largest score and l[h] the sum of the exponentials. */
static inline void softmax_rows(float *scores, int heads, int stride, int n, float *m, float *l) {
    for (int h = 0; h < heads; h++) {
        float *s = scores + (int64_t)h * stride;
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int t = 0; t < n; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < n; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        m[h] = max;
        l[h] = sum;
    }
}

/* The partial sums of each range of `range_tokens` in [begin, end) (begin on a range boundary) as
 * attend_range_body leaves them, `stride` floats apart: m [heads], l [heads], acc [heads, head_dim]. */
typedef struct {
    float *first;
    size_t stride;
    int range_tokens;
    float softcap; /* > 0: the scores are capped before each range's softmax */
} Partials;

static inline float *range_partials(Partials p, int r) { return p.first + p.stride * (size_t)r; }

/* Softmax of each range's scores on its own (scores [heads, end - begin]); its acc zeroed. */
static inline void softmax_ranges(float *scores, int heads, int head_dim, int begin, int end, Partials p) {
    const int span = end - begin;
    for (int r = 0; r * p.range_tokens < span; r++) {
        const int first = r * p.range_tokens, n = span - first < p.range_tokens ? span - first : p.range_tokens;
        float *m = range_partials(p, r);
        if (p.softcap > 0.0f)
            for (int h = 0; h < heads; h++)
                for (int t = first; t < first + n; t++) {
                    float *score = scores + (int64_t)h * span + t;
                    *score = p.softcap * tanhf(*score / p.softcap);
                }
        softmax_rows(scores + first, heads, span, n, m, m + heads);
        memset(m + 2 * heads, 0, sizeof(float) * (size_t)heads * head_dim);
    }
}

/* attend_range_body on a float32 cache: token by token, straight from the cache. Its loads stream at
 * 85-90% of what plain reads of the same scattered blocks reach here (batch 32, context 320, 30
 * layers: 19-20 ms a step against 17 ms), where the tiled walk below, which stalls on a tile's
 * loads before computing on them, took 23-25 ms. */
static inline __attribute__((always_inline)) void attend_streaming(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int block_shift, int begin,
    int end, int kv_heads, int group, int head_dim, float scale, int cache_type, const float *k_table,
    const float *v_table, float *scores, float *upcast, Partials partials) {
    const int heads = kv_heads * group, slot_bytes = kv_heads * head_dim * ELEMENT_BYTES[cache_type];
    const int span = end - begin;
    /* pass 1: scores[h][t] = q_h · k_t * scale */
    for (int t = begin; t < end; t++) {
        const int64_t slot = slot_prefetching(k_cache, table, block_shift, t, end, slot_bytes);
        for (int kv = 0; kv < kv_heads; kv++) {
            const float *k = head_row(k_cache, slot, kv, kv_heads, head_dim, cache_type, k_table, upcast);
            for (int h = kv * group; h < (kv + 1) * group; h++)
                scores[(int64_t)h * span + (t - begin)] = dot(q + h * head_dim, k, head_dim) * scale;
        }
    }
    softmax_ranges(scores, heads, head_dim, begin, end, partials);
    /* pass 2: acc_h = Σ_t p[h][t] · v_t, each range's in its own */
    for (int t = begin; t < end; t++) {
        const int64_t slot = slot_prefetching(v_cache, table, block_shift, t, end, slot_bytes);
        float *acc = range_partials(partials, (t - begin) / partials.range_tokens) + 2 * heads;
        for (int kv = 0; kv < kv_heads; kv++) {
            const float *v = head_row(v_cache, slot, kv, kv_heads, head_dim, cache_type, v_table, upcast);
            for (int h = kv * group; h < (kv + 1) * group; h++) {
                const float p = scores[(int64_t)h * span + (t - begin)];
                float *o = acc + (int64_t)h * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) o[d] += p * v[d];
            }
        }
    }
}

/* Tokens [t, t + n) of a sequence's K or V (a bf16 or fp8 cache) upcast into float32 rows
 * [n, kv_heads * head_dim] of `tile`, slot after slot in cache order, later slots on their way. */
static inline __attribute__((always_inline)) void stage_tile(const void *cache, const int32_t *table,
                                                             int block_shift, int t, int n, int end, int kv_heads,
                                                             int head_dim, int cache_type, const float *fp8_tables,
                                                             float *tile) {
    const int slot_bytes = kv_heads * head_dim * ELEMENT_BYTES[cache_type];
    for (int i = 0; i < n; i++) {
        const int64_t slot = slot_prefetching(cache, table, block_shift, t + i, end, slot_bytes);
        for (int kv = 0; kv < kv_heads; kv++)
            head_row(cache, slot, kv, kv_heads, head_dim, cache_type, fp8_tables,
                     tile + ((size_t)i * kv_heads + kv) * head_dim);
    }
}

/* attend_range_body on a bf16 or fp8 cache, whose upcasts bound the token-by-token walk: tiles of
 * TILE slots are upcast once into `tile` (float32, in cache order), then each KV head's G query
 * heads score the tile's keys together (lane_sums) and keep their weighted sums in registers
 * over it (batch 32, context 320, 30 layers: bf16 19-21 -> 18 ms a step, fp8 25-33 -> 18-19 ms,
 * no longer slower than float32). */
static inline __attribute__((always_inline)) void attend_tiled(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int block_shift, int begin,
    int end, int kv_heads, int group, int head_dim, float scale, int cache_type, const float *k_table,
    const float *v_table, float *scores, float *tile, Partials partials) {
    const int heads = kv_heads * group;
    const int span = end - begin, runs = (head_dim + RUN - 1) / RUN;
    const int slot_floats = kv_heads * head_dim;
    /* pass 1: scores[h][t] = q_h · k_t * scale */
    for (int t = begin; t < end; t += TILE) {
        const int n = end - t < TILE ? end - t : TILE;
        stage_tile(k_cache, table, block_shift, t, n, end, kv_heads, head_dim, cache_type, k_table, tile);
        for (int kv = 0; kv < kv_heads; kv++) {
            for (int h = kv * group; h < (kv + 1) * group; h++)
                for (int i0 = 0; i0 < n; i0 += RUN) { /* RUN keys' scores at a time */
                    run_vec products[RUN];
                    for (int i = 0; i < RUN; i++) { /* past the tile's end, its first row again: those lanes are dropped */
                        const float *k = tile + (size_t)(i0 + i < n ? i0 + i : 0) * slot_floats + kv * head_dim;
                        run_vec sum = {0};
                        for (int c = 0; c < runs; c++)
                            sum += load_run(q + h * head_dim, c, head_dim) * load_run(k, c, head_dim);
                        products[i] = sum;
                    }
                    const run_vec s = lane_sums(products) * scale;
                    memcpy(scores + (int64_t)h * span + (t - begin) + i0, &s,
                           sizeof(float) * (size_t)(n - i0 < RUN ? n - i0 : RUN));
                }
        }
    }
    softmax_ranges(scores, heads, head_dim, begin, end, partials);
    /* pass 2: acc_h = Σ_t p[h][t] · v_t, each range's in its own (a tile lies in one range) */
    for (int t = begin; t < end; t += TILE) {
        const int n = end - t < TILE ? end - t : TILE;
        float *acc = range_partials(partials, (t - begin) / partials.range_tokens) + 2 * heads;
        stage_tile(v_cache, table, block_shift, t, n, end, kv_heads, head_dim, cache_type, v_table, tile);
        for (int kv = 0; kv < kv_heads; kv++) {
            const float *p = scores + (int64_t)kv * group * span + (t - begin);
            float *o = acc + (int64_t)kv * group * head_dim;
            /* (query head, run of RUN dims) pairs, SUM_REGISTERS at a time, their sums in registers */
            for (int j0 = 0; j0 < group * runs; j0 += SUM_REGISTERS) {
                run_vec sums[SUM_REGISTERS] = {0};
                for (int i = 0; i < n; i++) {
                    const float *v = tile + (size_t)i * slot_floats + kv * head_dim;
                    for (int j = j0; j < j0 + SUM_REGISTERS && j < group * runs; j++)
                        sums[j - j0] += p[(int64_t)(j / runs) * span + i] * load_run(v, j % runs, head_dim);
                }
                for (int j = j0; j < j0 + SUM_REGISTERS && j < group * runs; j++) {
                    float *dst = o + (j / runs) * head_dim + RUN * (j % runs);
                    const int lanes = head_dim - RUN * (j % runs) < RUN ? head_dim - RUN * (j % runs) : RUN;
                    const run_vec total = load_run(dst, 0, lanes) + sums[j - j0];
                    memcpy(dst, &total, sizeof(float) * (size_t)lanes);
                }
            }
        }
    }
}

/* One sequence over its tokens [begin, end), range by range, for every query head h: the range's
 * largest score m[h], the sum l[h] of exp(score - m[h]), and acc[h] = sum over its t of
 * exp(score_t - m[h]) * v_t, not yet divided by l[h]. Ranges merge exactly (flash-decoding), so a
 * short batch can split a context across threads. The keys of all [begin, end) stream in one
 * walk, then the values in another (a walk per range missed its first tokens' prefetch: fp8,
 * batch 32, context 300, 64-token ranges: 1.3x slower). Both walks take every KV head of a slot
 * because a slot holds them side by side: reading whole slots, one contiguous run per block,
 * streams 1.2-1.6x faster than a task per KV head reading a third of each slot at a stride
 * (batch 22, context 400). */
static inline __attribute__((always_inline)) void attend_range_body(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int block_shift, int begin,
    int end, int kv_heads, int group, int head_dim, float scale, int cache_type, const float *k_table,
    const float *v_table, float *scores, float *tile, Partials partials) {
    if (cache_type == CACHE_F32)
        attend_streaming(q, k_cache, v_cache, table, block_shift, begin, end, kv_heads, group, head_dim, scale,
                         cache_type, k_table, v_table, scores, tile, partials);
    else
        attend_tiled(q, k_cache, v_cache, table, block_shift, begin, end, kv_heads, group, head_dim, scale,
                     cache_type, k_table, v_table, scores, tile, partials);
}

/* attend_range_body compiled for common (query heads per KV head, head_dim) pairs as constants,
 * so its loops have fixed trip counts and unroll (batch 32, context 300, cold caches: 1.45 ->
 * 1.21 ms per layer for SmolLM2's 3 x 64); other shapes take the general loop. */
static void attend_range(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                         int block_shift, int begin, int end, int kv_heads, int group, int head_dim, float scale,
                         int cache_type, const float *k_table, const float *v_table, float *scores, float *tile,
                         Partials partials) {
#define FIXED_SHAPE(G, D)                                                                                          \
    if (group == G && head_dim == D) {                                                                             \
        attend_range_body(q, k_cache, v_cache, table, block_shift, begin, end, kv_heads, G, D, scale, cache_type,  \
                          k_table, v_table, scores, tile, partials);                                               \
        return;                                                                                                    \
    }
    FIXED_SHAPE(1, 64) FIXED_SHAPE(3, 64) FIXED_SHAPE(4, 64) FIXED_SHAPE(1, 128) FIXED_SHAPE(4, 128) FIXED_SHAPE(8, 128)
#undef FIXED_SHAPE
    attend_range_body(q, k_cache, v_cache, table, block_shift, begin, end, kv_heads, group, head_dim, scale,
                      cache_type, k_table, v_table, scores, tile, partials);
}

/* Every context is cut into ranges of RANGE_TOKENS at fixed offsets (twice, four times... as many
 * tokens a range where that would make more than MAX_RANGES), each range's partial sums are kept,
 * and the merge folds them in order: a sequence's output depends on its own tokens alone, not on
 * which sequences share the batch or how many threads run it. Cutting a context by the batch's
 * needs (4 ranges at batch 1, 2 at batch 3, 1 from batch 4) gave last-bit differences that
 * per-token int8 activations amplify into different greedy tokens (W8A8, FP8). */
enum { RANGE_TOKENS = 64, MAX_RANGES = 64 };

static int tokens_per_range(int context) {
    int tokens = RANGE_TOKENS;
    while ((context + tokens - 1) / tokens > MAX_RANGES) tokens *= 2;
    return tokens;
}

/* How many tasks share each sequence's ranges (consecutive runs of them): enough to keep every
 * thread busy when the batch has few sequences; a task left without a range does nothing. */
static int tasks_per_sequence(int num_seqs, int num_threads) {
    const int wanted = 2 * num_threads;
    return num_seqs >= wanted ? 1 : (wanted + num_seqs - 1) / num_seqs;
}

/* The first token a query at the end of `context` tokens attends to. */
static inline int window_start(int context, int window) {
    return window > 0 && context > window ? context - window : 0;
}

/* Returns 0; -1 when the scratch allocation failed, -2 when block_size is not a power of two
 * (nothing is written then). */
int paged_decode_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                           int max_blocks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int cache_type, const float *k_table, const float *v_table, int window,
                           float softcap, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (block_size < 1 || (block_size & (block_size - 1))) return -2;
    int block_shift = 0;
    while ((1 << block_shift) < block_size) block_shift++;
    /* first_range[s]: where sequence s's ranges start among all sequences' (first_range[num_seqs]: their count) */
    int *first_range = malloc(sizeof(int) * ((size_t)num_seqs + 1));
    if (first_range == NULL) return -1;
    int widest_range = 0, widest_ranges = 0; /* the most tokens in a range, and ranges in a sequence */
    first_range[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int span = context_lens[s] - window_start(context_lens[s], window);
        const int tokens = tokens_per_range(span), ranges = (span + tokens - 1) / tokens;
        widest_range = tokens > widest_range ? tokens : widest_range;
        widest_ranges = ranges > widest_ranges ? ranges : widest_ranges;
        first_range[s + 1] = first_range[s] + ranges;
    }
    const int splits = tasks_per_sequence(num_seqs, num_threads);
    const int num_tasks = num_seqs * splits;
    /* per thread: scores [num_heads, the longest task] and a tile of slots [TILE, num_kv_heads, head_dim];
     * per range: m and l [num_heads], acc [num_heads, head_dim] */
    const int longest_task = ((widest_ranges + splits - 1) / splits) * widest_range;
    const size_t per_thread = (size_t)num_heads * longest_task + (size_t)TILE * num_kv_heads * head_dim;
    const size_t per_range = (size_t)num_heads * (2 + head_dim);
    float *scratch = malloc(sizeof(float) * (per_thread * (size_t)num_threads + per_range * (size_t)first_range[num_seqs]));
    if (scratch == NULL) {
        free(first_range);
        return -1;
    }
    float *partials = scratch + per_thread * (size_t)num_threads;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
        float *tile = scores + (size_t)num_heads * longest_task;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_tasks; task++) {
            const int seq = task / splits, split = task % splits, start = window_start(context_lens[seq], window);
            const int ranges = first_range[seq + 1] - first_range[seq];
            const int tokens = tokens_per_range(context_lens[seq] - start), per_task = (ranges + splits - 1) / splits;
            const int begin = start + split * per_task * tokens;
            const int end = begin + per_task * tokens < context_lens[seq] ? begin + per_task * tokens : context_lens[seq];
            if (begin >= end) continue; /* a short context leaves its last tasks nothing */
            const Partials mine = {partials + per_range * (size_t)(first_range[seq] + split * per_task), per_range,
                                   tokens, softcap};
            attend_range(q + (int64_t)seq * num_heads * head_dim, k_cache, v_cache,
                         block_tables + (int64_t)seq * max_blocks, block_shift, begin, end, num_kv_heads, group,
                         head_dim, scale, cache_type, k_table, v_table, scores, tile, mine);
        }
        /* merge each (sequence, query head)'s ranges in order: rescale to the common max, divide by the total weight */
#pragma omp for
        for (int pair = 0; pair < num_seqs * num_heads; pair++) {
            const int seq = pair / num_heads, h = pair % num_heads;
            const float *first = partials + per_range * (size_t)first_range[seq];
            const int ranges = first_range[seq + 1] - first_range[seq];
            float top = -INFINITY, total = 0.0f;
            for (int r = 0; r < ranges; r++) top = first[per_range * r + h] > top ? first[per_range * r + h] : top;
            float *o = out + (int64_t)pair * head_dim;
            memset(o, 0, sizeof(float) * (size_t)head_dim);
            for (int r = 0; r < ranges; r++) {
                const float *part = first + per_range * r;
                const float weight = expf(part[h] - top);
                total += weight * part[num_heads + h];
                const float *acc = part + 2 * num_heads + (size_t)h * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) o[d] += weight * acc[d];
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(scratch);
    free(first_range);
    return 0;
}
