/* Paged decode attention for CPUs: one query token per sequence, keys and values read in place
 * from the block-paged cache.
 *
 * The torch path gathers every sequence's K and V into a dense copy before SDPA, so each cached
 * byte crosses memory three times (read, write, read again); at batch 32 that traffic is as large
 * as the weights'. Here each (sequence, KV head) task walks its block table once for K (scores)
 * and once for V (weighted sum), with the G = H / KV query heads of that group sharing every load.
 * When there are fewer such pairs than threads can share evenly (batch 1 has 3 on 2 threads),
 * each context is cut into ranges whose partial softmax sums merge exactly afterwards.
 *
 * Layouts (all contiguous):
 *   q, out       float32 [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_slots, num_kv_heads, head_dim] in float32, bfloat16 or fp8 e4m3
 *                (slot = block_id * block_size + offset)
 *   block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs]
 * fp8 values decode through 256-entry tables that already hold the dequantization scale.
 *
 * Built at first use by engine/layers/cpu_kernels.py with the system C compiler; OpenMP
 * resolves to the runtime torch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector expf: the softmax runs 16 lanes at a time (batch 32, context 300, cold caches:
 * 1.53 -> 1.28 ms per layer against scalar expf). */
#ifdef HAVE_LIBMVEC
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_FP8 = 2 };

static const int ELEMENT_BYTES[] = {4, 2, 1};

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
    } else {
        const uint8_t *src = (const uint8_t *)cache + index * head_dim;
        for (int d = 0; d < head_dim; d++) dst[d] = fp8_table[src[d]];
    }
    return dst;
}

typedef float vec16 __attribute__((vector_size(64), aligned(4)));
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

/* How far ahead (in tokens) rows are prefetched: without it the kernel waits on DRAM for every
 * row; with it the loads overlap the arithmetic on the rows before (measured: 2x at batch 32). */
enum { PREFETCH_DISTANCE = 8 };

/* Where a sequence's token t sits in the [slot, kv_head] row space (block_size = 1 << block_shift). */
typedef struct {
    const int32_t *table;
    int block_shift, num_kv_heads, kv_head;
} RowMap;

static inline int64_t row_of(const RowMap *m, int t) {
    const int64_t slot = ((int64_t)m->table[t >> m->block_shift] << m->block_shift) + (t & ((1 << m->block_shift) - 1));
    return slot * m->num_kv_heads + m->kv_head;
}

static inline void prefetch_row(const void *cache, int64_t row, int row_bytes) {
    const char *p = (const char *)cache + row * row_bytes;
    for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
}

/* One (sequence, KV head) over its tokens [begin, end), for each of the G query heads g sharing
 * that KV head: the largest score m[g], the sum l[g] of exp(score - m[g]), and
 * acc[g] = sum over t of exp(score_t - m[g]) * v_t, not yet divided by l[g]. Ranges of one
 * sequence merge exactly (flash-decoding), so a short batch can split its context across threads. */
static inline __attribute__((always_inline)) void attend_range_body(
    const float *q, const void *k_cache, const void *v_cache, const RowMap *map, int begin, int end, int group,
    int head_dim, float scale, int cache_type, const float *k_table, const float *v_table, float *scores,
    float *upcast, float *m, float *l, float *acc) {
    const int row_bytes = head_dim * ELEMENT_BYTES[cache_type];
    const int span = end - begin;
    /* pass 1: scores[g][t] = q_g · k_t * scale */
    for (int t = begin; t < end; t++) {
        if (t + PREFETCH_DISTANCE < end) prefetch_row(k_cache, row_of(map, t + PREFETCH_DISTANCE), row_bytes);
        const float *k = cache_row(k_cache, row_of(map, t), head_dim, cache_type, k_table, upcast);
        for (int g = 0; g < group; g++)
            scores[(int64_t)g * span + (t - begin)] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    /* exp(score - max) per query head */
    for (int g = 0; g < group; g++) {
        float *s = scores + (int64_t)g * span;
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int t = 0; t < span; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < span; t++) {
            s[t] = expf(s[t] - max);
            sum += s[t];
        }
        m[g] = max;
        l[g] = sum;
    }
    /* pass 2: acc_g = Σ_t p[g][t] · v_t, summed in a local array rather than the shared partials */
    float o[group * head_dim];
    memset(o, 0, sizeof(o));
    for (int t = begin; t < end; t++) {
        if (t + PREFETCH_DISTANCE < end) prefetch_row(v_cache, row_of(map, t + PREFETCH_DISTANCE), row_bytes);
        const float *v = cache_row(v_cache, row_of(map, t), head_dim, cache_type, v_table, upcast);
        for (int g = 0; g < group; g++) {
            const float p = scores[(int64_t)g * span + (t - begin)];
#pragma omp simd
            for (int d = 0; d < head_dim; d++) o[g * head_dim + d] += p * v[d];
        }
    }
    memcpy(acc, o, sizeof(o));
}

/* attend_range_body compiled for common (query heads per KV head, head_dim) pairs as constants,
 * so its loops have fixed trip counts and unroll (batch 32, context 300, cold caches: 1.45 ->
 * 1.21 ms per layer for SmolLM2's 3 x 64); other shapes take the general loop. */
static void attend_range(const float *q, const void *k_cache, const void *v_cache, const RowMap *map, int begin,
                         int end, int group, int head_dim, float scale, int cache_type, const float *k_table,
                         const float *v_table, float *scores, float *upcast, float *m, float *l, float *acc) {
#define FIXED_SHAPE(G, D)                                                                                          \
    if (group == G && head_dim == D) {                                                                             \
        attend_range_body(q, k_cache, v_cache, map, begin, end, G, D, scale, cache_type, k_table, v_table, scores, \
                          upcast, m, l, acc);                                                                      \
        return;                                                                                                    \
    }
    FIXED_SHAPE(1, 64) FIXED_SHAPE(3, 64) FIXED_SHAPE(4, 64) FIXED_SHAPE(1, 128) FIXED_SHAPE(4, 128) FIXED_SHAPE(8, 128)
#undef FIXED_SHAPE
    attend_range_body(q, k_cache, v_cache, map, begin, end, group, head_dim, scale, cache_type, k_table, v_table,
                      scores, upcast, m, l, acc);
}

/* How many ranges to cut each sequence's context into: enough tasks to keep every thread busy
 * (batch 1 has only num_kv_heads tasks), never ranges shorter than MIN_SPLIT_TOKENS. */
enum { MIN_SPLIT_TOKENS = 64 };

static int context_splits(int num_seqs, int num_kv_heads, int max_context, int num_threads) {
    const int tasks = num_seqs * num_kv_heads, wanted = 2 * num_threads;
    if (tasks >= wanted) return 1;
    int splits = (wanted + tasks - 1) / tasks;
    const int most = max_context / MIN_SPLIT_TOKENS;
    return splits < most ? splits : (most > 1 ? most : 1);
}

/* Returns 0; -1 when the scratch allocation failed, -2 when block_size is not a power of two
 * (nothing is written then). */
int paged_decode_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *context_lens, int num_seqs,
                           int max_blocks, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int cache_type, const float *k_table, const float *v_table,
                           int num_threads) {
    int max_context = 0;
    for (int i = 0; i < num_seqs; i++) max_context = context_lens[i] > max_context ? context_lens[i] : max_context;
    const int group = num_heads / num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (block_size < 1 || (block_size & (block_size - 1))) return -2;
    int block_shift = 0;
    while ((1 << block_shift) < block_size) block_shift++;
    const int splits = context_splits(num_seqs, num_kv_heads, max_context, num_threads);
    const int num_tasks = num_seqs * num_kv_heads * splits;
    /* per-thread scratch: scores [group, max_context] and one upcast row [head_dim];
     * per task: m and l [group], acc [group, head_dim] */
    const size_t per_thread = (size_t)group * max_context + head_dim;
    const size_t per_task = (size_t)group * (2 + head_dim);
    float *scratch = malloc(sizeof(float) * (per_thread * (size_t)num_threads + per_task * (size_t)num_tasks));
    if (scratch == NULL) return -1;
    float *partials = scratch + per_thread * (size_t)num_threads;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = scratch + per_thread * (size_t)omp_get_thread_num();
        float *upcast = scores + (size_t)group * max_context;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_tasks; task++) {
            const int split = task % splits, pair = task / splits;
            const int seq = pair / num_kv_heads, kv_head = pair % num_kv_heads;
            const RowMap map = {block_tables + (int64_t)seq * max_blocks, block_shift, num_kv_heads, kv_head};
            const int chunk = (context_lens[seq] + splits - 1) / splits;
            const int begin = split * chunk;
            const int end = begin + chunk < context_lens[seq] ? begin + chunk : context_lens[seq];
            float *m = partials + per_task * (size_t)task, *l = m + group, *acc = l + group;
            if (begin >= end) { /* a short sequence leaves some ranges empty: they weigh nothing */
                for (int g = 0; g < group; g++) m[g] = -INFINITY, l[g] = 0.0f;
                memset(acc, 0, sizeof(float) * (size_t)group * head_dim);
                continue;
            }
            const int64_t first_head = ((int64_t)seq * num_heads + (int64_t)kv_head * group) * head_dim;
            attend_range(q + first_head, k_cache, v_cache, &map, begin, end, group, head_dim, scale, cache_type,
                         k_table, v_table, scores, upcast, m, l, acc);
        }
        /* merge each (sequence, query head)'s ranges: rescale to the common max, divide by the total weight */
#pragma omp for
        for (int pair = 0; pair < num_seqs * num_kv_heads; pair++) {
            const int seq = pair / num_kv_heads, kv_head = pair % num_kv_heads;
            for (int g = 0; g < group; g++) {
                float top = -INFINITY, total = 0.0f;
                for (int s = 0; s < splits; s++) {
                    const float m = partials[per_task * (size_t)(pair * splits + s) + g];
                    top = m > top ? m : top;
                }
                float *o = out + ((int64_t)seq * num_heads + (int64_t)kv_head * group + g) * head_dim;
                memset(o, 0, sizeof(float) * (size_t)head_dim);
                for (int s = 0; s < splits; s++) {
                    const float *part = partials + per_task * (size_t)(pair * splits + s);
                    if (part[group + g] == 0.0f) continue; /* an empty range */
                    const float weight = expf(part[g] - top);
                    total += weight * part[group + g];
                    const float *acc = part + 2 * group + (size_t)g * head_dim;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) o[d] += weight * acc[d];
                }
                const float inv = 1.0f / total;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) o[d] *= inv;
            }
        }
    }
    free(scratch);
    return 0;
}
