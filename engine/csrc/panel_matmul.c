/* y = x Wᵀ + b for CPUs, on a weight laid out in 16-column panels: float32 (or bf16-valued)
 * weights, int8 or fp8 weights with float32 scales per group of input columns (weight-only
 * W8A16 / W4A16, and FP8 with its activations already rounded), int8 or int4 weights times
 * per-token int8 activations (W8A8, W4A8), and, at the end of this file, bf16 or FP8 products on AVX-512 BF16;
 * where the CPU has AMX, the int8 products of many rows and the bf16 ones of any run on its tiles.
 *
 * Decode multiplies a few activation rows by every weight, so the step is bound by how fast the
 * weights stream from memory. oneDNN's blocked layout reached 15–20 GB/s here at 1–8 rows; this
 * layout makes each thread's read one sequential stream (its own run of panels), and one weight
 * load serves up to ROW_TILE activation rows, so the same kernel also holds up at prefill sizes.
 *
 * Layouts (all contiguous, float32 unless said):
 *   x      [M, K]
 *   panels [N / 16, K, 16]: panel p, row k holds W[16p .. 16p + 15][k]  (N a multiple of 16);
 *          float32, or bfloat16 for weights that are bf16 values

 *   int8 weights: the same panels of int8, and scales [N / 16, K / group, 16], so that
 *                 W[n][k] = panels[n / 16][k][n % 16] * scales[n / 16][k / group][n % 16]
 *   int4 weights: panels [N / 16, K / 2, 16] of bytes, each holding two signed 4-bit values:
 *                 W[n][2s] in the low nibble and W[n][2s + 1] in the high one of panels[n / 16][s][n % 16]
 *                 (half the bytes of int8, and batch-1 decode is bound by bytes), scales as int8;
 *                 asymmetric int4 adds zero points as floats in the scales' layout, and
 *                 W[n][k] = (nibble - zero) * scale
 *   bias   [N] or NULL
 *   y      [M, N]
 *
 * Built at first use by engine/layers/cpu_kernels.py; OpenMP resolves to the runtime torch
 * already loaded, so both share one thread pool.
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "fp8.h"

enum { PANEL = 16 };

/* A panel's 16 lanes as the vector registers hold them: one vector of 16 floats with AVX-512, two
 * parts of 8 elsewhere. (GCC keeps a 64-byte vector type in memory where no register is that
 * wide: the fp32 kernel written on one ran ~10x slower on an AVX2 build, bench/README.md.) Each
 * lane sums the same products in the same order either way, so the floats are the same. */
#ifdef __AVX512F__
#define PARTS 1
#else
#define PARTS 2
#endif
enum { PART = PANEL / PARTS };
typedef float part_vec __attribute__((vector_size(PART * sizeof(float)), aligned(sizeof(float))));

/* Part h of the 16 floats at p. */
static inline __attribute__((always_inline)) part_vec load_part(const float *p, int h) {
    return *(const part_vec *)(p + h * PART);
}

static inline __attribute__((always_inline)) void store_part(float *p, int h, part_vec v) {
    *(part_vec *)(p + h * PART) = v;
}

/* Part h of 16 int8 weights as floats. Spelled with intrinsics: GCC scalarizes the generic int8 →
 * float vector conversion into byte loads and inserts. */
static inline __attribute__((always_inline)) part_vec widen_int8(const int8_t *p, int h) {
#if defined(__AVX512F__)
    (void)h;
    return (part_vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (part_vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + h * PART))));
#else
    part_vec v;
    for (int i = 0; i < PART; i++) v[i] = p[h * PART + i];
    return v;
#endif
}

/* Part h of one nibble of 16 bytes of int4 pairs as floats: the high nibble is the sign-extended
 * byte shifted right by 4; the low one is shifted to the top of its lane and back. */
static inline __attribute__((always_inline)) part_vec widen_int4(const int8_t *p, int high, int h) {
#if defined(__AVX512F__)
    (void)h;
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    v = high ? _mm512_srai_epi32(v, 4) : _mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28);
    return (part_vec)_mm512_cvtepi32_ps(v);
#elif defined(__AVX2__)
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + h * PART)));
    v = high ? _mm256_srai_epi32(v, 4) : _mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28);
    return (part_vec)_mm256_cvtepi32_ps(v);
#else
    part_vec v;
    for (int i = 0; i < PART; i++) v[i] = high ? p[h * PART + i] >> 4 : (int8_t)(p[h * PART + i] << 4) >> 4;
    return v;
#endif
}

/* Part h of 16 fp8 e4m3 weights as floats / 256 (fp8.h's widen_fp8). */
static inline __attribute__((always_inline)) part_vec widen_fp8_part(const int8_t *p, int h) {
#if defined(__AVX512F__)
    (void)h;
    return (part_vec)widen_fp8(p);
#elif defined(__AVX2__) && defined(__F16C__)
    return (part_vec)widen_fp8_8(p + h * PART);
#else
    const fp8_vec all = widen_fp8(p);
    part_vec v;
    __builtin_memcpy(&v, (const float *)&all + h * PART, sizeof v);
    return v;
#endif
}

/* The weight-only kernel's byte formats (INT4_ZERO: int4 with a zero point per group). */
enum { WEIGHTS_INT8 = 0, WEIGHTS_FP8 = 1, WEIGHTS_INT4 = 2, WEIGHTS_INT4_ZERO = 3 };

static inline int is_int4(int format) { return format == WEIGHTS_INT4 || format == WEIGHTS_INT4_ZERO; }

/* Bytes of panel per input column: int4 packs two columns' weights into each PANEL bytes. */
static inline int panel_row_bytes(int format) { return is_int4(format) ? PANEL / 2 : PANEL; }

/* Part h of column c of a panel run (from an even column for int4) as floats. */
static inline __attribute__((always_inline)) part_vec widen(const int8_t *p, int c, int format, int h) {
    if (is_int4(format)) return widen_int4(p + (c >> 1) * PANEL, c & 1, h);
    return format == WEIGHTS_FP8 ? widen_fp8_part(p + c * PANEL, h) : widen_int8(p + c * PANEL, h);
}

/* Activation rows per register tile: ROW_TILE accumulators plus the weight vector must fit the
 * vector registers (32 with AVX-512, 16 with AVX2, where a panel's lanes take two). */
#ifdef __AVX512F__
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif

/* Bytes ahead in the panel stream to prefetch: 16 rows of k, enough to cover DRAM latency. */
enum { PREFETCH_BYTES = 1024 };

/* Row k of a float panel: float32, or bfloat16 (the upper half of a float32, so widening is
 * exact: a model whose weights are bf16 values computes the same fp32 products from half the bytes). */
static inline __attribute__((always_inline)) part_vec panel_row(const void *panel, int k, int bf16, int h) {
    if (!bf16) return load_part((const float *)panel + (int64_t)k * PANEL, h);
    const uint16_t *p = (const uint16_t *)panel + (int64_t)k * PANEL + h * PART;
#if defined(__AVX512F__)
    return (part_vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (part_vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    union { uint32_t bits[PART]; part_vec v; } u;
    for (int i = 0; i < PART; i++) u.bits[i] = (uint32_t)p[i] << 16;
    return u.v;
#endif
}

/* a · b + c in one rounding, spelled out where floats must not depend on how GCC contracts
 * (the int8 routes' epilogues, which builds for every CPU share). */
static inline __attribute__((always_inline)) part_vec fmadd(part_vec a, part_vec b, part_vec c) {
#if defined(__AVX512F__)
    return (part_vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (part_vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    part_vec r;
    for (int i = 0; i < PART; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* s in every lane */
static inline __attribute__((always_inline)) part_vec splat(float s) { return s + (part_vec){0}; }

/* Part h of the bias, or zeros. */
static inline __attribute__((always_inline)) part_vec bias_part(const float *bias, int h) {
    return bias ? load_part(bias, h) : (part_vec){0};
}

static inline __attribute__((always_inline)) void row_tile(float *restrict y, const float *restrict x,
                                                           const void *restrict panel, const float *bias,
                                                           int rows, int K, int N, int bf16) {
    const int row_bytes = PANEL * (bf16 ? 2 : 4);
    part_vec acc[ROW_TILE][PARTS];
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++) acc[i][h] = (part_vec){0};
    for (int k = 0; k < K; k++) {
        __builtin_prefetch((const char *)panel + (int64_t)k * row_bytes + PREFETCH_BYTES);
        for (int h = 0; h < PARTS; h++) {
            const part_vec w = panel_row(panel, k, bf16, h);
            for (int i = 0; i < rows; i++) acc[i][h] += x[(int64_t)i * K + k] * w;
        }
    }
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++) store_part(y + (int64_t)i * N, h, acc[i][h] + bias_part(bias, h));
}

/* Rows come in tiles of ROW_TILE; the leftover tile gets its own constant size so the
 * accumulators stay in registers. */
#define TAIL(r) case r: row_tile(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, bias_p, r, K, N, bf16); break;

static inline __attribute__((always_inline)) void panel_matmul(float *y, const float *x, const void *panels,
                                                               const float *bias, int M, int N, int K, int threads,
                                                               int bf16) {
    int num_panels = N / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < num_panels; p++) {
        const char *panel = (const char *)panels + (int64_t)p * K * PANEL * (bf16 ? 2 : 4);
        const float *bias_p = bias ? bias + p * PANEL : 0;
        float *y_p = y + p * PANEL;
        int m = 0;
        for (; m + ROW_TILE <= M; m += ROW_TILE)
            row_tile(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, bias_p, ROW_TILE, K, N, bf16);
        switch (M - m) {
            TAIL(1) TAIL(2) TAIL(3)
#if ROW_TILE > 4
            TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#endif
            default: break;
        }
    }
}

void panel_matmul_f32(float *y, const float *x, const float *panels, const float *bias, int M, int N, int K,
                      int threads) {
    panel_matmul(y, x, panels, bias, M, N, K, threads, 0);
}

/* panels hold bfloat16 values; x, bias and y are float32 as above. */
void panel_matmul_bf16(float *y, const float *x, const uint16_t *panels, const float *bias, int M, int N, int K,
                       int threads) {
    panel_matmul(y, x, panels, bias, M, N, K, threads, 1);
}

/* The weight-only tile (int8, fp8 and int4 panels): CHAINS independent accumulators per row,
 * chain c summing a group's columns c, c + CHAINS, ... With one chain a row's FMAs wait on each
 * other (4 cycles per 16 weights), which is 12 GB/s per core on int8 weights: slower than memory.
 * Every tile, whatever its rows, has the same CHAINS, so a row's floats do not depend on how many
 * rows share its call (greedy outputs must not depend on the batch); 4 chains for 1-7 rows broke
 * that and were no faster (bench/README.md, "Weight-only int8/int4"). */
#define CHAINS 2
#ifdef __AVX512F__
#define ROW_TILE_I8 8
#else
#define ROW_TILE_I8 2
#endif

/* As row_tile, on int8 / fp8 / int4 panels: each group of input columns sums on its own, then is
 * scaled. For int4 the group is a multiple of 4 (engine/layers/panel_matmul.py checks), so the
 * chains always start on a byte and the one-column tail loop never runs. With zero
 * points each widened weight has its group's zero subtracted: the same floats, in the same
 * order, as int8 panels holding q - zero, at half the bytes. */
static inline __attribute__((always_inline)) void row_tile_i8(float *restrict y, const float *restrict x,
                                                              const int8_t *restrict panel, const float *scales,
                                                              const float *zeros, const float *bias, int rows,
                                                              int K, int N, int group, int format) {
    const int row_bytes = panel_row_bytes(format);
    part_vec total[ROW_TILE_I8][PARTS];
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++) total[i][h] = (part_vec){0};
    for (int k0 = 0; k0 < K; k0 += group, scales += PANEL, zeros += format == WEIGHTS_INT4_ZERO ? PANEL : 0) {
        part_vec zero[PARTS], acc[CHAINS][ROW_TILE_I8][PARTS];
        for (int h = 0; h < PARTS; h++) {
            zero[h] = format == WEIGHTS_INT4_ZERO ? load_part(zeros, h) : (part_vec){0};
            for (int c = 0; c < CHAINS; c++)
                for (int i = 0; i < rows; i++) acc[c][i][h] = (part_vec){0};
        }
        int k = k0;
        for (; k + CHAINS <= k0 + group; k += CHAINS, panel += CHAINS * row_bytes) {
            __builtin_prefetch(panel + PREFETCH_BYTES);
            for (int c = 0; c < CHAINS; c++)
                for (int h = 0; h < PARTS; h++) {
                    part_vec w = widen(panel, c, format, h);
                    if (format == WEIGHTS_INT4_ZERO) w -= zero[h];
                    for (int i = 0; i < rows; i++) acc[c][i][h] += x[(int64_t)i * K + k + c] * w;
                }
        }
        for (; k < k0 + group; k++, panel += row_bytes)
            for (int h = 0; h < PARTS; h++) {
                const part_vec w = widen(panel, 0, format, h);
                for (int i = 0; i < rows; i++) acc[0][i][h] += x[(int64_t)i * K + k] * w;
            }
        for (int h = 0; h < PARTS; h++) {
            const part_vec scale = load_part(scales, h);
            for (int i = 0; i < rows; i++) {
                part_vec sum = acc[0][i][h];
                for (int c = 1; c < CHAINS; c++) sum += acc[c][i][h];
                total[i][h] += sum * scale;
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++) store_part(y + (int64_t)i * N, h, total[i][h] + bias_part(bias, h));
}

#define TAIL_I8(r) case r: row_tile_i8(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, scales_p, zeros_p, bias_p, \
                                       r, K, N, group, format); break;

static inline __attribute__((always_inline)) void panel_matmul_8bit(float *y, const float *x, const int8_t *panels,
                                                                    const float *scales, const float *zeros,
                                                                    const float *bias, int M, int N, int K, int group,
                                                                    int threads, int format) {
    int num_panels = N / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < num_panels; p++) {
        const int8_t *panel = panels + (int64_t)p * K * panel_row_bytes(format);
        const float *scales_p = scales + (int64_t)p * (K / group) * PANEL;
        const float *zeros_p = zeros ? zeros + (int64_t)p * (K / group) * PANEL : 0;
        const float *bias_p = bias ? bias + p * PANEL : 0;
        float *y_p = y + p * PANEL;
        int m = 0;
        for (; m + ROW_TILE_I8 <= M; m += ROW_TILE_I8)
            row_tile_i8(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, scales_p, zeros_p, bias_p, ROW_TILE_I8,
                        K, N, group, format);
        switch (M - m) {
            TAIL_I8(1)
#if ROW_TILE_I8 > 2
            TAIL_I8(2) TAIL_I8(3) TAIL_I8(4) TAIL_I8(5) TAIL_I8(6) TAIL_I8(7)
#endif
            default: break;
        }
    }
}

/* group must divide K (group = K: one scale per output channel). */
void panel_matmul_i8(float *y, const float *x, const int8_t *panels, const float *scales, const float *bias,
                     int M, int N, int K, int group, int threads) {
    panel_matmul_8bit(y, x, panels, scales, NULL, bias, M, N, K, group, threads, WEIGHTS_INT8);
}

/* The same on int4 pairs (K and group multiples of 4). */
void panel_matmul_i4(float *y, const float *x, const int8_t *panels, const float *scales, const float *bias,
                     int M, int N, int K, int group, int threads) {
    panel_matmul_8bit(y, x, panels, scales, NULL, bias, M, N, K, group, threads, WEIGHTS_INT4);
}

/* Asymmetric int4: zero points as floats in the scales' layout, [N / 16, K / group, 16]. */
void panel_matmul_i4_zero(float *y, const float *x, const int8_t *panels, const float *scales, const float *zeros,
                          const float *bias, int M, int N, int K, int group, int threads) {
    panel_matmul_8bit(y, x, panels, scales, zeros, bias, M, N, K, group, threads, WEIGHTS_INT4_ZERO);
}

/* The same on fp8 e4m3 weight bytes; the scales must be 256 times the weights' own (see widen_fp8). */
void panel_matmul_fp8(float *y, const float *x, const int8_t *panels, const float *scales, const float *bias,
                      int M, int N, int K, int group, int threads) {
    panel_matmul_8bit(y, x, panels, scales, NULL, bias, M, N, K, group, threads, WEIGHTS_FP8);
}

/* What an FP8 W8A8 kernel sees of x [rows, k]: x / scale saturated to ±448, rounded to e4m3,
 * times scale (quant.fp8.fake_quantize_fp8, operation for operation); act as panel_matmul_fp8_dot's.
 * ACT_FP8_TOKEN takes a scale per `act_group` columns of each row (0: the whole row; the last group
 * may be shorter), as block FP8's inputs are scaled per token and tile width. */
static void fake_quantize_fp8(float *out, const float *x, int rows, int k, int act, float static_scale,
                              int act_group, int threads) {
    const float batch_scale = act == ACT_FP8_STATIC ? static_scale
                              : act == ACT_FP8_TENSOR ? fp8_scale_of(absmax_of(x, (int64_t)rows * k)) : 0.0f;
    const int width = act == ACT_FP8_TOKEN && act_group > 0 ? act_group : k;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < k; g += width) {
            const int n = k - g < width ? k - g : width;
            const float *src = x + (int64_t)r * k + g;
            float *dst = out + (int64_t)r * k + g;
            const float scale = act == ACT_FP8_TOKEN ? fp8_scale_of(absmax_of(src, n)) : batch_scale;
            for (int i = 0; i < n; i++) dst[i] = round_to_e4m3(clamp_fp8(src[i] / scale)) * scale;
        }
}

/* FP8 W8A8 where the bf16 products below are missing: the rows rounded through fp8, then the fp8
 * weight-only kernel. Returns 0, or -1 when the row buffer could not be allocated. */
int panel_matmul_fp8_rounded(float *y, const float *x, const int8_t *panels, const float *scales, const float *bias,
                             int M, int N, int K, int group, int act, float static_scale, int act_group,
                             int threads) {
    float *rounded = malloc(sizeof(float) * (size_t)M * K);
    if (!rounded) return -1;
    fake_quantize_fp8(rounded, x, M, K, act, static_scale, act_group, threads);
    panel_matmul_8bit(y, rounded, panels, scales, NULL, bias, M, N, K, group, threads, WEIGHTS_FP8);
    free(rounded);
    return 0;
}

/* AMX (Intel's tile unit, from Sapphire Rapids on): eight tile registers of up to 16 rows x 64 bytes
 * and instructions that multiply two of them into a third. W8A8 from 16 rows and W4A8 from 32 take
 * its int8 tiles, the bf16 / FP8 dot products its bf16 tiles at every row count. Linux grants the
 * tile state only to a process that asks; DRIFTGATE_AMX=0 (or `use_amx(0)`) keeps to the vector
 * routes. */
enum { AMX_ROWS = 16, AMX_DEPTH = 64 }; /* a tile: 16 rows of 64 bytes */

/* The next pass over `left` rows of a unit, r0 rows (returned; 0: none) and r1: two blocks of 16
 * while 32 are left, then the rest in one pass, one block up to 16 rows and two of about half as
 * many above; with `whole_blocks` only blocks of 16 (the rest is left to the vector route). */
static inline int amx_pass_rows(int left, int whole_blocks, int *r1) {
    if (left >= 2 * AMX_ROWS) {
        *r1 = AMX_ROWS;
        return AMX_ROWS;
    }
    *r1 = 0;
    if (whole_blocks) return left >= AMX_ROWS ? AMX_ROWS : 0;
    if (left <= AMX_ROWS) return left;
    *r1 = left / 2;
    return left - *r1;
}

/* Row i of a pass's sums on panel q: the first block's rows, then the second's. */
#define PASS_SUMS(tiles, q, i, r0) ((i) < (r0) ? (tiles)[q][i] : (tiles)[2 + (q)][(i) - (r0)])

#if defined(__AMX_TILE__)
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_permitted = -1, amx_wanted = -1;

static int amx_on(void) {
    if (amx_permitted < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    if (amx_wanted < 0) {
        const char *env = getenv("DRIFTGATE_AMX");
        amx_wanted = !(env && strcmp(env, "0") == 0);
    }
    return amx_permitted && amx_wanted;
}

/* Turn the AMX routes on (1) or off (0, for comparisons), or only ask (-1); returns whether
 * products take them. */
int use_amx(int on) {
    if (on >= 0) amx_wanted = on;
    return amx_on();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles of 64 bytes a row. int8: tiles 0-3 the sums of row block r on panel q at 2r + q, 4-5 the
 * two row blocks' activations, 6-7 the two panels' 16 steps; bf16 the same with float sums and 32
 * k a tile. Each tile loaded serves two products. The first row block (its sums and activations)
 * is r0 rows deep, the second r1 (0: one block; its tiles then take r0 too, never used), up to 16;
 * the weights' tiles 16. */
static void amx_configure(int r0, int r1) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t >= 6 ? AMX_ROWS : (t == 2 || t == 3 || t == 5) && r1 ? r1 : r0;
        config.bytes_per_row[t] = AMX_DEPTH;
    }
    _tile_loadconfig(&config);
}

/* Loads the configuration for blocks of r0 and r1 rows unless the thread's `*current` is it. */
static inline void amx_use(int *current, int r0, int r1) {
    if (*current != r0 * 64 + r1) {
        amx_configure(r0, r1);
        *current = r0 * 64 + r1;
    }
}

static void amx_release(void) { _tile_release(); }

/* The sums tiles 0-3, zeroed, and stored to tiles[4][16 rows][64 bytes]. */
static inline __attribute__((always_inline)) void amx_zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline __attribute__((always_inline)) void amx_store_sums(void *tiles) {
    char *t = tiles;
    _tile_stored(0, t, AMX_DEPTH);
    _tile_stored(1, t + AMX_ROWS * AMX_DEPTH, AMX_DEPTH);
    _tile_stored(2, t + 2 * AMX_ROWS * AMX_DEPTH, AMX_DEPTH);
    _tile_stored(3, t + 3 * AMX_ROWS * AMX_DEPTH, AMX_DEPTH);
}

/* One step of a task's tile products: the activations of one or two row blocks (A0, and A1 when
 * BLOCKS is 2; rows STRIDE bytes apart) times the weight tiles of one or two panels (W0, and W1 when
 * TWO_PANELS; each evaluated only when used) into sums tile 2 * block + panel. DP is the product
 * (_tile_dpbusd for int8, _tile_dpbf16ps for bf16). */
#define AMX_STEP(DP, A0, A1, STRIDE, W0, W1, BLOCKS, TWO_PANELS) \
    do {                                                        \
        _tile_loadd(4, A0, STRIDE);                             \
        _tile_loadd(6, W0, AMX_DEPTH);                          \
        DP(0, 4, 6);                                            \
        if (TWO_PANELS) {                                       \
            _tile_loadd(7, W1, AMX_DEPTH);                      \
            DP(1, 4, 7);                                        \
        }                                                       \
        if ((BLOCKS) == 2) {                                    \
            _tile_loadd(5, A1, STRIDE);                         \
            DP(2, 5, 6);                                        \
            if (TWO_PANELS) DP(3, 5, 7);                        \
        }                                                       \
    } while (0)
#else
static int amx_on(void) { return 0; }
static inline void amx_use(int *current, int r0, int r1) {}
static void amx_release(void) {}
int use_amx(int on) {
    (void)on;
    return 0;
}
#endif

/* W8A8: int8 weights per output channel, activations quantized per row (token) to int8 here, an
 * exact integer dot product, then y = dot · row scale · channel scale + bias. This is the
 * arithmetic of vLLM's per-token dynamic int8 kernel, rounding included (x / scale rounded half
 * to even, scale = absmax / 127 clamped to FLT_EPSILON). The integers come from AVX-512 VNNI's
 * vpdpbusd (64 int8 products per instruction, four times the fp32 FMA rate) where the CPU has it,
 * elsewhere from pmaddubsw (AVX2, or AVX-512 without VNNI; see dot4): every route sums the same
 * integers, so its floats are the same on every x86 CPU from AVX2 on.
 *
 * Layouts:
 *   panels [N / 16, K / 4, 16, 4] int8: panel p, step s, lane j holds W[16p + j][4s .. 4s + 3]
 *   bias_sums [N] int32: 128 · Σ_k W[n][k] (vpdpbusd multiplies unsigned bytes, so rows are
 *                        stored as x_q + 128 and this term is taken back off; see dot4)
 *   weight_scales [N] float32
 * K must be a multiple of 4 and N of 16.
 */
#if defined(__AVX2__)
#define W8A8_KERNELS /* panel_matmul_w8a8 and panel_matmul_w4a8 are built (decode_step.c asks) */

int w8a8_available(void) { return 1; }

/* 64 bytes of a panel step: 16 int32 sums, or 16 lanes x 4 int8 weights: in one register with
 * AVX-512, in two with AVX2 (as PARTS says why). */
#if defined(__AVX512F__)
typedef __m512i lanes;

static inline __attribute__((always_inline)) lanes lanes_load(const void *p) { return _mm512_loadu_si512(p); }
static inline __attribute__((always_inline)) lanes lanes_zero(void) { return _mm512_setzero_si512(); }
static inline __attribute__((always_inline)) lanes lanes_add(lanes a, lanes b) { return _mm512_add_epi32(a, b); }

/* Part h of a - b, as floats */
static inline __attribute__((always_inline)) part_vec lanes_difference(lanes a, lanes b, int h) {
    (void)h;
    return (part_vec)_mm512_cvtepi32_ps(_mm512_sub_epi32(a, b));
}

/* One 64-byte block of nibbles → the two steps it holds, as bytes u = q + 8 in 0..15: low nibbles
 * are k .. k + 3, high ones k + 4 .. k + 7. */
static inline __attribute__((always_inline)) void unpack_nibbles(const uint8_t *block, lanes *first, lanes *second) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F), both = lanes_load(block);
    *first = _mm512_and_si512(both, low_nibbles);
    *second = _mm512_and_si512(_mm512_srli_epi16(both, 4), low_nibbles);
}
#else
typedef struct {
    __m256i lo, hi;
} lanes;

static inline __attribute__((always_inline)) lanes lanes_load(const void *p) {
    return (lanes){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
static inline __attribute__((always_inline)) lanes lanes_zero(void) {
    return (lanes){_mm256_setzero_si256(), _mm256_setzero_si256()};
}
static inline __attribute__((always_inline)) lanes lanes_add(lanes a, lanes b) {
    return (lanes){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}

static inline __attribute__((always_inline)) part_vec lanes_difference(lanes a, lanes b, int h) {
    return (part_vec)_mm256_cvtepi32_ps(h ? _mm256_sub_epi32(a.hi, b.hi) : _mm256_sub_epi32(a.lo, b.lo));
}

static inline __attribute__((always_inline)) void unpack_nibbles(const uint8_t *block, lanes *first, lanes *second) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    const lanes both = lanes_load(block);
    *first = (lanes){_mm256_and_si256(both.lo, low_nibbles), _mm256_and_si256(both.hi, low_nibbles)};
    *second = (lanes){_mm256_and_si256(_mm256_srli_epi16(both.lo, 4), low_nibbles),
                      _mm256_and_si256(_mm256_srli_epi16(both.hi, 4), low_nibbles)};
}
#endif

/* acc plus one row's four activation bytes (as an int32) times a 16-lane, 4-deep step of weights.
 * dot_start(sums) is where a sum starts, so that each route's sum, less the sums the epilogues
 * take off (128 · Σ w), is Σ x_q · w. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
enum { ACTIVATION_OFFSET = 128 }; /* vpdpbusd multiplies unsigned bytes */

static inline __attribute__((always_inline)) lanes dot4(lanes acc, int32_t four, lanes w) {
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(four), w);
}

static inline __attribute__((always_inline)) lanes dot_start(const int32_t *sums) {
    (void)sums;
    return lanes_zero();
}

/* W4A8 (below) on vpdpbusd: the nibbles as signed steps q = u - 8, the activations offset as W8A8's,
 * one instruction per step and row, summed in int32 all along (a run is the whole group).
 * `row_sums` is NULL: the offset's term is in the group sums. */
#define W4A8_ON_VNNI
enum { W4_BLOCKS_A_RUN = 1 << 20 };

static inline __attribute__((always_inline)) void w4a8_unpack(const uint8_t *block, lanes *first, lanes *second) {
    const __m512i eight = _mm512_set1_epi8(8);
    unpack_nibbles(block, first, second);
    *first = _mm512_sub_epi8(*first, eight);
    *second = _mm512_sub_epi8(*second, eight);
}

static inline __attribute__((always_inline)) lanes w4a8_block(lanes run, lanes first, int32_t lo, lanes second,
                                                              int32_t hi) {
    return dot4(dot4(run, lo, first), hi, second);
}

static inline __attribute__((always_inline)) lanes w4a8_run_start(lanes acc) { return acc; }
static inline __attribute__((always_inline)) lanes w4a8_run_end(lanes acc, lanes run) {
    (void)acc;
    return run;
}

static inline __attribute__((always_inline)) lanes w4a8_start(const int32_t *sums, int32_t row_sum) {
    (void)row_sum;
    return dot_start(sums);
}

#else
/* Without VNNI, pmaddubsw multiplies unsigned by signed bytes into int16 pairs, which x_q + 128
 * would overflow. Instead |w| times x_q with w's sign: each pair is at most 2 · 128 · 127, which
 * fits; pmaddwd then adds the pairs into the int32 lanes. That is Σ x_q · w, so the sum starts at
 * the 128 · Σ w the epilogue takes off. */
enum { ACTIVATION_OFFSET = 0 };

static inline __attribute__((always_inline)) lanes dot_start(const int32_t *sums) { return lanes_load(sums); }

#if defined(__AVX512BW__)
static inline __attribute__((always_inline)) lanes dot4(lanes acc, int32_t four, lanes w) {
    const __m512i q = _mm512_set1_epi32(four);
    const __m512i signed_q = _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(w), _mm512_setzero_si512(), q);
    const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_q);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#else
static inline __attribute__((always_inline)) __m256i dot4_half(__m256i acc, __m256i q, __m256i w) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) lanes dot4(lanes acc, int32_t four, lanes w) {
    const __m256i q = _mm256_set1_epi32(four);
    return (lanes){dot4_half(acc.lo, q, w.lo), dot4_half(acc.hi, q, w.hi)};
}
#endif

/* W4A8 (below) without VNNI: pmaddubsw multiplies the nibbles u = q + 8 as they lie (unsigned, at
 * most 15) by x_q (signed), so no sign trick is needed; each int16 pair is at most 2 · 15 · 127 =
 * 3810, so the pairs of a run of W4_BLOCKS_A_RUN blocks (8 products each, 30480 in all) add up in
 * int16 before pmaddwd widens them: about half dot4's instructions a step. The sum starts at the group
 * sum the epilogue takes off, less 8 · Σ x_q over the group (`row_sums`, computed per row), so it
 * ends as Σ x_q · q, as on VNNI. */
enum { W4_BLOCKS_A_RUN = 4 };

static inline __attribute__((always_inline)) void w4a8_unpack(const uint8_t *block, lanes *first, lanes *second) {
    unpack_nibbles(block, first, second);
}

static inline __attribute__((always_inline)) lanes w4a8_run_start(lanes acc) {
    (void)acc;
    return lanes_zero();
}

#if defined(__AVX512BW__)
static inline __attribute__((always_inline)) lanes nibble_pairs(lanes pairs, lanes u, int32_t four) {
    return _mm512_add_epi16(pairs, _mm512_maddubs_epi16(u, _mm512_set1_epi32(four)));
}

static inline __attribute__((always_inline)) lanes w4a8_run_end(lanes acc, lanes pairs) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}

static inline __attribute__((always_inline)) lanes w4a8_start(const int32_t *sums, int32_t row_sum) {
    return _mm512_sub_epi32(lanes_load(sums), _mm512_set1_epi32(8 * row_sum));
}
#else
static inline __attribute__((always_inline)) lanes nibble_pairs(lanes pairs, lanes u, int32_t four) {
    const __m256i q = _mm256_set1_epi32(four);
    return (lanes){_mm256_add_epi16(pairs.lo, _mm256_maddubs_epi16(u.lo, q)),
                   _mm256_add_epi16(pairs.hi, _mm256_maddubs_epi16(u.hi, q))};
}

static inline __attribute__((always_inline)) lanes w4a8_run_end(lanes acc, lanes pairs) {
    const __m256i ones = _mm256_set1_epi16(1);
    return (lanes){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, ones)),
                   _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, ones))};
}

static inline __attribute__((always_inline)) lanes w4a8_start(const int32_t *sums, int32_t row_sum) {
    const lanes s = lanes_load(sums);
    const __m256i offset = _mm256_set1_epi32(8 * row_sum);
    return (lanes){_mm256_sub_epi32(s.lo, offset), _mm256_sub_epi32(s.hi, offset)};
}
#endif

static inline __attribute__((always_inline)) lanes w4a8_block(lanes pairs, lanes first, int32_t lo, lanes second,
                                                              int32_t hi) {
    return nibble_pairs(nibble_pairs(pairs, first, lo), second, hi);
}
#endif

/* One row to bytes x_q + ACTIVATION_OFFSET; returns the row's scale. Plain C the compiler
 * vectorizes for any width: the absmax compares the magnitudes' bit patterns, which for floats
 * order as their values do. */
static float quantize_row(uint8_t *restrict out, const float *restrict x, int K) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t max_bits = 0;
    for (int k = 0; k < K; k++) {
        const uint32_t magnitude = bits[k] & 0x7FFFFFFFu;
        max_bits = magnitude > max_bits ? magnitude : max_bits;
    }
    float absmax;
    __builtin_memcpy(&absmax, &max_bits, sizeof absmax);
    const float scale = fmaxf(absmax / 127.0f, FLT_EPSILON);
    for (int k = 0; k < K; k++) {
        int q = (int)nearbyintf(x[k] / scale);
        q = q > -127 ? q : -127; /* clamped as integers, which vectorizes to vpmaxsd, vpminsd */
        q = q < 127 ? q : 127;
        out[k] = (uint8_t)(q + ACTIVATION_OFFSET);
    }
    return scale;
}

/* Σ x_q over n values of a quantized row (stored as the bytes of x_q + ACTIVATION_OFFSET). */
static int32_t group_sum(const uint8_t *xq, int n) {
    int32_t sum = 0;
    for (int k = 0; k < n; k++) sum += (int8_t)(xq[k] - ACTIVATION_OFFSET);
    return sum;
}

/* W8A8_ROW_BLOCK: rows per block of a prefill-sized product (a multiple of ROW_TILE_W8A8). Every
 * panel reads all rows' int8 activations, which at 2048 rows (1.2-3 MB) spill from L2; panels
 * sweeping one block at a time ran a layer's four products at 593-609 GOP/s against 554-571
 * (2048 rows, best of 25, alternated three times on a busy host). With AVX2 an accumulator takes
 * two of the 16 registers: 4 rows and one chain. */
#ifdef __AVX512F__
#define ROW_TILE_W8A8 8
#define W8A8_CHAINS 2
#else
#define ROW_TILE_W8A8 4
#define W8A8_CHAINS 1
#endif
enum { W8A8_ROW_BLOCK = 256 };

/* The W8A8 kernel's next panel, fetched a cache line per k-step by this task's first row tiles, so
 * it is in cache when its own first tile starts. At 32 decode rows a panel serves four 8-row
 * tiles: the first had waited on memory at the rate its loads came (two threads asking ~55 GB/s
 * of a ~28 GB/s machine) and the others found the panel in L1, memory and compute taking turns.
 * (The bf16 kernel's lm_head, memory-bound at 1-8 rows, got slower with it: not used there.) */
typedef struct {
    const char *next;
    int lines; /* not yet fetched */
} Lookahead;

static inline Lookahead lookahead(const void *next_panel, int64_t bytes) {
    return (Lookahead){next_panel, next_panel ? (int)(bytes / 64) : 0};
}

static inline void lookahead_step(Lookahead *ahead) {
    if (ahead->lines > 0) {
        __builtin_prefetch(ahead->next);
        ahead->next += 64;
        ahead->lines--;
    }
}

/* The 16 sums of one panel's W8A8 epilogue, loaded once for every row that ends there. */
typedef struct {
    lanes bias_sums;
    part_vec weight_scales[PARTS], bias[PARTS];
} W8A8Epilogue;

static inline __attribute__((always_inline)) W8A8Epilogue w8a8_epilogue(const int32_t *bias_sums,
                                                                        const float *weight_scales, const float *bias) {
    W8A8Epilogue e = {.bias_sums = lanes_load(bias_sums)};
    for (int h = 0; h < PARTS; h++) {
        e.weight_scales[h] = load_part(weight_scales, h);
        e.bias[h] = bias_part(bias, h);
    }
    return e;
}

/* y[0..15] = (acc - 128 · row sums) · channel scales · row scale + bias: every W8A8 route ends here,
 * so the same integers give the same floats whichever instructions summed them. */
static inline __attribute__((always_inline)) void store_w8a8_row(float *y, lanes acc, W8A8Epilogue e,
                                                                float row_scale) {
    for (int h = 0; h < PARTS; h++)
        store_part(y, h, fmadd(lanes_difference(acc, e.bias_sums, h) * e.weight_scales[h], splat(row_scale), e.bias[h]));
}

static inline __attribute__((always_inline)) void row_tile_w8a8(
    float *restrict y, const uint8_t *restrict xq, const float *restrict row_scales, const int8_t *restrict panel,
    const int32_t *bias_sums, const float *weight_scales, const float *bias, int rows, int K, int N,
    Lookahead *ahead) {
    lanes acc[W8A8_CHAINS][ROW_TILE_W8A8];
    for (int i = 0; i < rows; i++) {
        acc[0][i] = dot_start(bias_sums);
        for (int c = 1; c < W8A8_CHAINS; c++) acc[c][i] = lanes_zero();
    }
    int k = 0;
    for (; k + 4 * W8A8_CHAINS <= K; k += 4 * W8A8_CHAINS, panel += 64 * W8A8_CHAINS) {
        lookahead_step(ahead);
        for (int c = 0; c < W8A8_CHAINS; c++) {
            __builtin_prefetch(panel + 2 * PREFETCH_BYTES + 64 * c);  /* each step is one cache line */
            const lanes w = lanes_load(panel + 64 * c);
            for (int i = 0; i < rows; i++) {
                int32_t four;
                __builtin_memcpy(&four, xq + (int64_t)i * K + k + 4 * c, 4);
                acc[c][i] = dot4(acc[c][i], four, w);
            }
        }
    }
    for (; k < K; k += 4, panel += 64) {
        const lanes w = lanes_load(panel);
        for (int i = 0; i < rows; i++) {
            int32_t four;
            __builtin_memcpy(&four, xq + (int64_t)i * K + k, 4);
            acc[0][i] = dot4(acc[0][i], four, w);
        }
    }
    const W8A8Epilogue e = w8a8_epilogue(bias_sums, weight_scales, bias);
    for (int i = 0; i < rows; i++) {
        for (int c = 1; c < W8A8_CHAINS; c++) acc[0][i] = lanes_add(acc[0][i], acc[c][i]);
        store_w8a8_row(y + (int64_t)i * N, acc[0][i], e, row_scales[i]);
    }
}

/* W4A8's float steps, shared by every route so that the same integers give the same floats: a
 * group's integer dot, less 128 times its weight sum, times its scales onto the running total;
 * then the row's scale and the bias. */
static inline __attribute__((always_inline)) part_vec w4a8_add_group(part_vec total, lanes acc, lanes sums,
                                                                     part_vec scale, int h) {
    return fmadd(lanes_difference(acc, sums, h), scale, total);
}

static inline __attribute__((always_inline)) part_vec w4a8_row(part_vec total, float row_scale, part_vec bias) {
    return fmadd(total, splat(row_scale), bias);
}

/* acc[i] plus row i's integer dot with the steps of blocks k .. end - 1 (8 k a block) of a panel,
 * summed a run of up to W4_BLOCKS_A_RUN blocks at a time (each route's w4a8_block says how). */
static inline __attribute__((always_inline)) void w4a8_dots(lanes *acc, const uint8_t *panel, const uint8_t *xq,
                                                            int rows, int K, int k, int end, Lookahead *ahead) {
    while (k < end) {
        const int run_end = end - k > 8 * W4_BLOCKS_A_RUN ? k + 8 * W4_BLOCKS_A_RUN : end;
        lanes run[ROW_TILE_W8A8];
        for (int i = 0; i < rows; i++) run[i] = w4a8_run_start(acc[i]);
        for (; k < run_end; k += 8, panel += 64) {
            lookahead_step(ahead);
            __builtin_prefetch(panel + 2 * PREFETCH_BYTES);
            lanes first, second;
            w4a8_unpack(panel, &first, &second);
            for (int i = 0; i < rows; i++) {
                int32_t lo, hi;
                __builtin_memcpy(&lo, xq + (int64_t)i * K + k, 4);
                __builtin_memcpy(&hi, xq + (int64_t)i * K + k + 4, 4);
                run[i] = w4a8_block(run[i], first, lo, second, hi);
            }
        }
        for (int i = 0; i < rows; i++) acc[i] = w4a8_run_end(acc[i], run[i]);
    }
}

/* W4A8: symmetric int4 weights with a float32 scale per group of input columns (or per channel),
 * the same per-token int8 activations and integer products as W8A8; the integer dot of each
 * group is scaled by its group's scales before the next group adds in, and the row scale comes
 * last:  y = (Σ_g s_g · (Σ_{k∈g} x_q[k] · q[k])) · row scale + b.  Half W8A8's weight bytes, which
 * decode streams once a step; the arithmetic llama.cpp's 4-bit formats use with 8-bit activations.
 *
 * Layouts:
 *   panels [N / 16, K / 8, 64] uint8: panel p, block b, lane j, byte t holds u[16p + j][8b + t] in
 *          its low nibble and u[16p + j][8b + 4 + t] in its high one (t = 0..3), u = q + 8 in 0..15
 *   group_sums [N / 16, K / G, 16] int32: 128 · Σ_{k∈g} q[n][k] (as W8A8's bias_sums)
 *   group_scales [N / 16, K / G, 16] float32
 *   row_sums [rows, K / G] int32: Σ_{k∈g} x_q[k] where the route needs it (W4A8_ON_VNNI: NULL)
 * K and the group size G must be multiples of 8 (G = K: per channel), N of 16.
 */
static inline __attribute__((always_inline)) void row_tile_w4a8(
    float *restrict y, const uint8_t *restrict xq, const float *restrict row_scales, const uint8_t *restrict panel,
    const int32_t *group_sums, const float *group_scales, const float *bias, const int32_t *row_sums, int rows,
    int K, int N, int G, Lookahead *ahead) {
    part_vec total[ROW_TILE_W8A8][PARTS];
    lanes acc[ROW_TILE_W8A8];
    const int groups = K / G;
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++) total[i][h] = (part_vec){0};
    for (int g = 0; g < groups; g++, panel += (int64_t)G * 8) {
        const int32_t *sums = group_sums + g * PANEL;
        for (int i = 0; i < rows; i++) acc[i] = w4a8_start(sums, row_sums ? row_sums[i * groups + g] : 0);
        w4a8_dots(acc, panel, xq, rows, K, g * G, (g + 1) * G, ahead);
        const lanes group_sums_g = lanes_load(sums);
        for (int h = 0; h < PARTS; h++) {
            const part_vec scale = load_part(group_scales + g * PANEL, h);
            for (int i = 0; i < rows; i++) total[i][h] = w4a8_add_group(total[i][h], acc[i], group_sums_g, scale, h);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < PARTS; h++)
            store_part(y + (int64_t)i * N, h, w4a8_row(total[i][h], row_scales[i], bias_part(bias, h)));
}

/* AMX-INT8's tdpbusd multiplies a 16 x 64 tile of unsigned activation bytes by a 64 x 16 tile of
 * signed weight bytes given as 16 rows of 16 lanes x 4 consecutive k, into 16 x 16 int32 sums:
 * vpdpbusd's arithmetic, 16 rows at a time. That weight tile is 16 steps of a W8A8 panel as they
 * lie (W4A8's nibbles are unpacked into it), so prefill-sized products need no other layout, and
 * the integers, hence the floats after the shared epilogues, are the VNNI route's exactly. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
enum { AMX_INT8_BUILT = 1 };

/* The weight tile for k .. k + 63 of a panel: W8A8's bytes as they lie, or W4A8's 8 nibble
 * blocks unpacked into `buffer`. */
static inline const int8_t *amx_weight_tile(const uint8_t *panel, int k, int nibbles, int8_t buffer[AMX_ROWS][64]) {
    if (!nibbles) return (const int8_t *)panel + (int64_t)k * PANEL;
    const uint8_t *blocks = panel + (int64_t)k * PANEL / 2;
    for (int b = 0; b < AMX_DEPTH / 8; b++) {
        lanes first, second;
        w4a8_unpack(blocks + 64 * b, &first, &second);
        _mm512_store_si512((void *)buffer[2 * b], first);
        _mm512_store_si512((void *)buffer[2 * b + 1], second);
    }
    return buffer[0];
}

/* One pass of rows m .. m + r0 + r1 - 1 (blocks as configured) over a panel and the next (panels[1]
 * NULL: none). W8A8 (G = K): a K that is not a multiple of 64 ends on vpdpbusd steps. W4A8 (nibbles;
 * G a multiple of 64): each group's tiles are summed, then scaled onto float totals as row_tile_w4a8
 * does. `sums`, `scales` are the first panel's (the second's follow, `groups` x 16 on). */
static void amx_int8_pass(float *y, const uint8_t *xq, const float *row_scales, const uint8_t *panels[2],
                          const int32_t *sums, const float *scales, const float *bias, int m, int r0, int r1, int K,
                          int N, int G, int nibbles) {
    int32_t tiles[4][AMX_ROWS][PANEL] __attribute__((aligned(64)));
    int8_t unpacked[2][AMX_ROWS][64] __attribute__((aligned(64)));
    part_vec total[2][2 * AMX_ROWS]; /* one part: AMX builds have AVX-512 */
    const int deep = K / AMX_DEPTH * AMX_DEPTH, two_panels = panels[1] != 0, groups = K / G;
    /* what is summed in int32 before the floats: each W4A8 group, or all of W8A8's whole tiles */
    const int passes = nibbles ? groups : 1, span = nibbles ? G : deep, rows = r0 + r1;
    const uint8_t *a = xq + (int64_t)m * K;
    for (int g = 0; g < passes; g++) {
        amx_zero_sums();
        for (int k = g * span; k < (g + 1) * span; k += AMX_DEPTH)
            AMX_STEP(_tile_dpbusd, a + k, a + (int64_t)r0 * K + k, K, amx_weight_tile(panels[0], k, nibbles, unpacked[0]),
                     amx_weight_tile(panels[1], k, nibbles, unpacked[1]), r1 ? 2 : 1, two_panels);
        amx_store_sums(tiles);
        for (int q = 0; nibbles && q <= two_panels; q++) {
            const int64_t at = ((int64_t)q * groups + g) * PANEL;
            for (int i = 0; i < rows; i++)
                total[q][i] = w4a8_add_group(g ? total[q][i] : (part_vec){0}, lanes_load(PASS_SUMS(tiles, q, i, r0)),
                                             lanes_load(sums + at), load_part(scales + at, 0), 0);
        }
    }
    for (int q = 0; q <= two_panels; q++) {
        const float *bias_q = bias ? bias + q * PANEL : 0;
        if (nibbles) {
            const part_vec b = bias_part(bias_q, 0);
            for (int i = 0; i < rows; i++)
                store_part(y + (int64_t)(m + i) * N + q * PANEL, 0, w4a8_row(total[q][i], row_scales[m + i], b));
            continue;
        }
        const W8A8Epilogue e = w8a8_epilogue(sums + q * PANEL, scales + q * PANEL, bias_q);
        const int8_t *panel = (const int8_t *)panels[q];
        for (int i = 0; i < rows; i++) {
            lanes acc = lanes_load(PASS_SUMS(tiles, q, i, r0));
            for (int k = deep; k < K; k += 4) {
                int32_t four;
                __builtin_memcpy(&four, a + (int64_t)i * K + k, 4);
                acc = dot4(acc, four, lanes_load(panel + (int64_t)k * PANEL));
            }
            store_w8a8_row(y + (int64_t)(m + i) * N + q * PANEL, acc, e, row_scales[m + i]);
        }
    }
}

#else
enum { AMX_INT8_BUILT = 0 };
static void amx_int8_pass(float *y, const uint8_t *xq, const float *row_scales, const uint8_t *panels[2],
                          const int32_t *sums, const float *scales, const float *bias, int m, int r0, int r1, int K,
                          int N, int G, int nibbles) {}
#endif

/* One tile of rows on one panel, W4A8 (nibbles) or W8A8: the branch is the same for a whole call. */
#define TAIL_INT8(r) case r: TILE_INT8(r); break;
#define TILE_INT8(r)                                                                                                \
    do {                                                                                                            \
        if (nibbles)                                                                                                \
            row_tile_w4a8(y_p + (int64_t)m * N, xq + (int64_t)m * K, row_scales + m, panel, sums_p, scales_p,      \
                          bias_p, row_sums ? row_sums + (int64_t)m * (K / G) : 0, r, K, N, G, &ahead);              \
        else                                                                                                        \
            row_tile_w8a8(y_p + (int64_t)m * N, xq + (int64_t)m * K, row_scales + m, (const int8_t *)panel, sums_p, \
                          scales_p, bias_p, r, K, N, &ahead);                                                      \
    } while (0)

/* Rows m..end of one panel in tiles of up to ROW_TILE_W8A8 rows. */
static inline __attribute__((always_inline)) void int8_panel_rows(
    float *y_p, const uint8_t *xq, const float *row_scales, const int32_t *row_sums, const uint8_t *panel,
    const int32_t *sums_p, const float *scales_p, const float *bias_p, int m, int end, int K, int N, int G,
    int nibbles, Lookahead ahead) {
    for (; m + ROW_TILE_W8A8 <= end; m += ROW_TILE_W8A8) TILE_INT8(ROW_TILE_W8A8);
    switch (end - m) {
        TAIL_INT8(1) TAIL_INT8(2) TAIL_INT8(3)
#if ROW_TILE_W8A8 > 4
        TAIL_INT8(4) TAIL_INT8(5) TAIL_INT8(6) TAIL_INT8(7)
#endif
        default: break;
    }
}

/* W8A8 (G = K, bytes) and W4A8 (nibbles): each row quantized to int8, then the tiles. Returns 0, or
 * -1 when the row buffer could not be allocated. */
static int int8_rows_matmul(float *y, const float *x, const uint8_t *panels, const int32_t *sums,
                            const float *scales, const float *bias, int M, int N, int K, int G, int nibbles,
                            int threads) {
    const int groups = K / G;
#ifdef W4A8_ON_VNNI
    const int need_row_sums = 0;
#else
    const int need_row_sums = nibbles;
#endif
    float *row_scales = malloc((size_t)M * sizeof(float) + (need_row_sums ? (size_t)M * groups * sizeof(int32_t) : 0) +
                               (size_t)M * K);
    if (!row_scales) return -1;
    int32_t *row_sums = need_row_sums ? (int32_t *)(row_scales + M) : 0;
    uint8_t *xq = need_row_sums ? (uint8_t *)(row_sums + (size_t)M * groups) : (uint8_t *)(row_scales + M);
    /* tiles hold 64 k: W4A8 only where each group is whole tiles, and from 32 rows in blocks of 16
     * (its weight tiles are unpacked per pass: at 16 rows VNNI was faster, 6.0 vs 6.8 ms), the rows
     * after them on VNNI; W8A8 from 16 rows, every row (at 4-8 rows VNNI was faster: 8.6-9.1 against
     * 9.9-10.2 ms for SmolLM2's layers). The integers are the same either way. */
    const int amx = AMX_INT8_BUILT && M >= (nibbles ? 2 : 1) * AMX_ROWS && (!nibbles || G % AMX_DEPTH == 0) && amx_on();
    const int width = amx ? 2 : 1; /* panels a task takes */
#pragma omp parallel num_threads(threads)
    {
        int configured = 0; /* the thread's tile configuration (amx_use) */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            row_scales[m] = quantize_row(xq + (int64_t)m * K, x + (int64_t)m * K, K);
            for (int g = 0; row_sums && g < groups; g++)
                row_sums[(int64_t)m * groups + g] = group_sum(xq + (int64_t)m * K + g * G, G);
        }
        /* tasks in row-block-major order: each thread's contiguous share keeps one block of
         * activations in its L2 while every panel passes over it */
        const int num_panels = N / PANEL, row_blocks = (M + W8A8_ROW_BLOCK - 1) / W8A8_ROW_BLOCK;
        const int units = (num_panels + width - 1) / width;
        const int64_t panel_bytes = (int64_t)K * PANEL >> nibbles;
#pragma omp for schedule(static)
        for (int task = 0; task < row_blocks * units; task++) {
            const int first_panel = task % units * width, first = task / units * W8A8_ROW_BLOCK;
            const int end = first + W8A8_ROW_BLOCK < M ? first + W8A8_ROW_BLOCK : M;
            const int last_panel = first_panel + width < num_panels ? first_panel + width : num_panels;
            int m = first;
            if (amx) {
                const uint8_t *first_of_pair = panels + first_panel * panel_bytes;
                const uint8_t *pair[2] = {first_of_pair, last_panel - first_panel == 2 ? first_of_pair + panel_bytes : 0};
                const int64_t at = (int64_t)first_panel * groups * PANEL;
                for (int r0, r1; m < end && (r0 = amx_pass_rows(end - m, nibbles, &r1)) > 0; m += r0 + r1) {
                    amx_use(&configured, r0, r1);
                    amx_int8_pass(y + first_panel * PANEL, xq, row_scales, pair, sums + at, scales + at,
                                  bias ? bias + first_panel * PANEL : 0, m, r0, r1, K, N, G, nibbles);
                }
            }
            for (int p = first_panel; p < last_panel; p++) {
                const int has_next = p + 1 < num_panels || task + 1 < row_blocks * units;
                int8_panel_rows(y + p * PANEL, xq, row_scales, row_sums, panels + p * panel_bytes,
                                sums + (int64_t)p * groups * PANEL, scales + (int64_t)p * groups * PANEL,
                                bias ? bias + p * PANEL : 0, m, end, K, N, G, nibbles,
                                lookahead(has_next ? panels + (p + 1) % num_panels * panel_bytes : 0, panel_bytes));
            }
        }
        if (amx) amx_release();
    }
    free(row_scales);
    return 0;
}

int panel_matmul_w8a8(float *y, const float *x, const int8_t *panels, const int32_t *bias_sums,
                      const float *weight_scales, const float *bias, int M, int N, int K, int threads) {
    return int8_rows_matmul(y, x, (const uint8_t *)panels, bias_sums, weight_scales, bias, M, N, K, K, 0, threads);
}

int panel_matmul_w4a8(float *y, const float *x, const uint8_t *panels, const int32_t *group_sums,
                      const float *group_scales, const float *bias, int M, int N, int K, int G, int threads) {
    return int8_rows_matmul(y, x, panels, group_sums, group_scales, bias, M, N, K, G, 1, threads);
}
#else
int w8a8_available(void) { return 0; }
#endif

/* bf16 activations times bf16 weights, accumulated in float32 (AVX-512 BF16's vdpbf16ps: two
 * products per lane and instruction, twice the fp32 FMA rate). For the unquantized lm_head of a
 * quantized checkpoint, whose activations the checkpoint's dtype (bf16) already describes: at 32
 * decode rows the float32 kernel above spends as long on SmolLM2's 49152 x 576 lm_head as W8A8
 * spends on all 30 layers. Rows are rounded to bf16 here (nearest even, as torch's .bfloat16()).
 *
 * Layout: panels [N / 16, ceil(K / 2), 16, 2] bf16: panel p, step s, lane j holds W[16p + j][2s]
 * and W[16p + j][2s + 1] (a zero past K). N must be a multiple of 16.
 */
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)

int bf16_dot_available(void) { return 1; }

/* One float32 row of K as ceil(K / 2) pairs of bf16 (a zero pads an odd K). */
static void round_row_bf16(uint16_t *restrict out, const float *restrict x, int K) {
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k));
        __builtin_memcpy(out + k, &h, sizeof h);
    }
    for (; k < K; k++) {
        __m128bh h = _mm_cvtneps_pbh(_mm_set1_ps(x[k]));
        __builtin_memcpy(out + k, &h, sizeof(uint16_t));
    }
    if (K % 2) out[K] = 0;
}

/* 16 rows of accumulators, updated once per weight load, and 16 independent sums cover the
 * instruction's latency: at 32 rows, 8 rows in two chains took 5.9-6.0 ms on SmolLM2's lm_head,
 * 16 rows 4.8-5.4 (the float32 kernel: 8.7-9.6). */
enum { ROW_TILE_BF16 = 16 };

/* 32 fp8 e4m3 bytes as 32 bf16 values, exactly, in integer operations: sign, then exponent and
 * mantissa shifted into place with the exponent rebased (bias 7 → 127); a subnormal (exponent
 * field 0) is looked up instead, as bf16 has room to normalize it. */
static inline __attribute__((always_inline)) __m512i widen_fp8_bf16(const uint8_t *p, __m512i subnormals) {
    const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x7F)), 4),
                                 _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(u, _mm512_set1_epi16(0x78)), u, subnormals);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(u, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* v | (u<<8 & sign) */
}

/* widen_fp8_bf16's table: entry m (< 8) is m · 2^-9, e4m3's subnormal m, in bf16 bits. */
static __m512i fp8_subnormals_bf16(void) {
    uint16_t table[32] = {0};
    for (int m = 1; m < 8; m++) {
        float v = ldexpf((float)m, -9);
        uint32_t bits;
        __builtin_memcpy(&bits, &v, sizeof bits);
        table[m] = (uint16_t)(bits >> 16);
    }
    return _mm512_loadu_si512((const void *)table);
}

/* y[0..15] = dot (· channel scales · row scale, with col_scales) + bias: where every bf16 / FP8 dot
 * route ends. */
static inline __attribute__((always_inline)) void store_dot_row(float *y, __m512 dot, __m512 bias,
                                                               const float *col_scales, float row_scale) {
    if (col_scales) dot = _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_loadu_ps(col_scales)), _mm512_set1_ps(row_scale));
    _mm512_storeu_ps(y, _mm512_add_ps(dot, bias));
}

/* ROW_TILE_BF16 rows times one panel of bf16 pairs, or, with `subnormals`, of fp8 byte pairs
 * widened as they stream (32 bytes a step). With col_scales, each sum is scaled by its column's
 * and its row's scale. */
static inline __attribute__((always_inline)) void row_tile_bf16_dot(float *restrict y, const uint32_t *restrict xb,
                                                                    const void *restrict panel,
                                                                    const __m512i *subnormals, const float *bias,
                                                                    const float *row_scales, const float *col_scales,
                                                                    int rows, int steps, int N) {
    const char *w_p = panel;
    const int step_bytes = subnormals ? 32 : 64;
    __m512 acc[ROW_TILE_BF16];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int s = 0; s < steps; s++, w_p += step_bytes) {
        __builtin_prefetch(w_p + PREFETCH_BYTES);
        __m512bh w = (__m512bh)(subnormals ? widen_fp8_bf16((const uint8_t *)w_p, *subnormals)
                                           : _mm512_loadu_si512((const void *)w_p));
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)xb[(int64_t)i * steps + s]), w);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++) store_dot_row(y + (int64_t)i * N, acc[i], b, col_scales, row_scales ? row_scales[i] : 0);
}

#define TAIL_BF16(r) case r: row_tile_bf16_dot(y_p + (int64_t)m * N, xb + (int64_t)m * steps, panel, subnormals, bias_p, \
                                               row_scales ? row_scales + m : 0, col_p, r, steps, N); break;

/* The row tiles of one panel over M rows (row_scales and col_p: both or neither). */
static inline __attribute__((always_inline)) void panel_rows_bf16_dot(float *y_p, const uint32_t *xb, const void *panel,
                                                                      const __m512i *subnormals, const float *bias_p,
                                                                      const float *row_scales, const float *col_p,
                                                                      int M, int steps, int N) {
    int m = 0;
    for (; m + ROW_TILE_BF16 <= M; m += ROW_TILE_BF16)
        row_tile_bf16_dot(y_p + (int64_t)m * N, xb + (int64_t)m * steps, panel, subnormals, bias_p,
                          row_scales ? row_scales + m : 0, col_p, ROW_TILE_BF16, steps, N);
    switch (M - m) {
        TAIL_BF16(1) TAIL_BF16(2) TAIL_BF16(3) TAIL_BF16(4) TAIL_BF16(5) TAIL_BF16(6) TAIL_BF16(7)
        TAIL_BF16(8) TAIL_BF16(9) TAIL_BF16(10) TAIL_BF16(11) TAIL_BF16(12) TAIL_BF16(13) TAIL_BF16(14) TAIL_BF16(15)
        default: break;
    }
}

/* AMX-BF16's tdpbf16ps multiplies a 16 x 32 tile of bf16 activations by a 32 x 16 tile of bf16
 * weights given as 16 rows of 16 lanes x 2 consecutive k, into 16 x 16 float sums: 16 steps of a
 * pair panel as they lie, and 16 steps of 16 rows of xb. The products are vdpbf16ps's, but the
 * unit sums them in its own order, so the floats differ from the vector route's in the last bits
 * (tests hold them to a tolerance). Steps past the last whole tile end on vdpbf16ps. */
enum { AMX_BF16_STEPS = AMX_DEPTH / 4 }; /* k pairs a tile holds */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
enum { AMX_BF16_BUILT = 1 };

/* The weight tile for steps s .. s + 15 of a panel: bf16 pairs as they lie, or, with `subnormals`,
 * fp8 byte pairs widened into `buffer` as they stream. */
static inline __attribute__((always_inline)) const uint16_t *amx_bf16_weight_tile(const void *panel, int s,
                                                                                 const __m512i *subnormals,
                                                                                 uint16_t *buffer) {
    if (!subnormals) return (const uint16_t *)panel + (int64_t)s * 2 * PANEL;
    const uint8_t *bytes = (const uint8_t *)panel + (int64_t)s * 2 * PANEL;
    for (int t = 0; t < AMX_BF16_STEPS; t++)
        _mm512_store_si512((void *)(buffer + 2 * PANEL * t), widen_fp8_bf16(bytes + 2 * PANEL * t, *subnormals));
    return buffer;
}

/* One pass of rows m .. m + r0 + r1 - 1 (blocks as configured) over a panel and the next (panels[1]
 * NULL: none), bf16 pairs, or with `subnormals` fp8 byte pairs. row_scales and col_scales: both or
 * neither (col_scales are the first panel's; the second's follow). */
static void amx_bf16_pass(float *y, const uint32_t *xb, const void *panels[2], const __m512i *subnormals,
                          const float *bias, const float *row_scales, const float *col_scales, int m, int r0, int r1,
                          int steps, int N) {
    float tiles[4][AMX_ROWS][PANEL] __attribute__((aligned(64)));
    uint16_t widened[2][AMX_BF16_STEPS * 2 * PANEL] __attribute__((aligned(64)));
    const int deep = steps / AMX_BF16_STEPS * AMX_BF16_STEPS, two_panels = panels[1] != 0;
    const int64_t stride = (int64_t)steps * sizeof(uint32_t);
    const uint32_t *a = xb + (int64_t)m * steps;
    amx_zero_sums();
    for (int s = 0; s < deep; s += AMX_BF16_STEPS)
        AMX_STEP(_tile_dpbf16ps, a + s, a + (int64_t)r0 * steps + s, stride,
                 amx_bf16_weight_tile(panels[0], s, subnormals, widened[0]),
                 amx_bf16_weight_tile(panels[1], s, subnormals, widened[1]), r1 ? 2 : 1, two_panels);
    amx_store_sums(tiles);
    for (int q = 0; q <= two_panels; q++) {
        const __m512 b = bias ? _mm512_loadu_ps(bias + q * PANEL) : _mm512_setzero_ps();
        for (int i = 0; i < r0 + r1; i++) {
            __m512 acc = _mm512_load_ps(PASS_SUMS(tiles, q, i, r0));
            for (int s = deep; s < steps; s++) {
                const char *w = (const char *)panels[q] + (int64_t)s * 2 * PANEL * (subnormals ? 1 : 2);
                const __m512i wide = subnormals ? widen_fp8_bf16((const uint8_t *)w, *subnormals)
                                                : _mm512_loadu_si512((const void *)w);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a[(int64_t)i * steps + s]), (__m512bh)wide);
            }
            store_dot_row(y + (int64_t)(m + i) * N + q * PANEL, acc, b, col_scales ? col_scales + q * PANEL : 0,
                          row_scales ? row_scales[m + i] : 0);
        }
    }
}
#else
enum { AMX_BF16_BUILT = 0 };
static void amx_bf16_pass(float *y, const uint32_t *xb, const void *panels[2], const __m512i *subnormals,
                          const float *bias, const float *row_scales, const float *col_scales, int m, int r0, int r1,
                          int steps, int N) {}
#endif

/* Where the CPU has AMX, bf16 and FP8 products of every row count take the tiles, so that a row's
 * sums come in one order whatever else shares its batch (the engine's greedy outputs do not depend
 * on the batch): all M rows of a unit of one or two panels, pass by pass (`configured`: the
 * thread's tile configuration). */
static void amx_bf16_unit(float *y, const uint32_t *xb, const void *panels[2], const __m512i *subnormals,
                          const float *bias, const float *row_scales, const float *col_scales, int M, int steps,
                          int N, int *configured) {
    for (int m = 0, r0, r1; m < M; m += r0 + r1) {
        r0 = amx_pass_rows(M - m, 0, &r1);
        amx_use(configured, r0, r1);
        amx_bf16_pass(y, xb, panels, subnormals, bias, row_scales, col_scales, m, r0, r1, steps, N);
    }
}

/* Returns 0, or -1 when the row buffer could not be allocated. */
int panel_matmul_bf16_dot(float *y, const float *x, const uint16_t *panels, const float *bias, int M, int N, int K,
                          int threads) {
    const int steps = (K + 1) / 2;
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)M * steps);
    if (!xb) return -1;
    const int amx = AMX_BF16_BUILT && amx_on(), width = amx ? 2 : 1; /* panels a task takes */
    const int num_panels = N / PANEL, units = (num_panels + width - 1) / width;
#pragma omp parallel num_threads(threads)
    {
        int configured = 0; /* the thread's tile configuration (amx_use) */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) round_row_bf16((uint16_t *)(xb + (int64_t)m * steps), x + (int64_t)m * K, K);
#pragma omp for schedule(static)
        for (int u = 0; u < units; u++) {
            const int first = u * width, last = first + width < num_panels ? first + width : num_panels;
            const void *pair[2] = {panels + (int64_t)first * steps * 32,
                                   last - first == 2 ? panels + (int64_t)(first + 1) * steps * 32 : 0};
            const float *bias_u = bias ? bias + first * PANEL : 0;
            if (amx) {
                amx_bf16_unit(y + first * PANEL, xb, pair, 0, bias_u, 0, 0, M, steps, N, &configured);
                continue;
            }
            panel_rows_bf16_dot(y + first * PANEL, xb, pair[0], 0, bias_u, 0, 0, M, steps, N);
        }
        if (amx) amx_release();
    }
    free(xb);
    return 0;
}

/* FP8 W8A8 on the same products. Every e4m3 value is a bf16 value, so rows rounded to fp8 (per
 * token, one scale for the batch, or a fixed one: quant.fp8.fake_quantize_fp8's rounding) times
 * fp8 weights are exact bf16 products, summed in float32 at twice the fp32 FMA rate, then scaled
 * by the row's and the channel's scale. The weight streams as its fp8 bytes: tasks of up to one
 * row tile widen each step in registers; larger ones widen their panel once into the thread's
 * buffer (in L1/L2) for all their tiles. Where the CPU has AMX every row count runs on its tiles
 * instead (amx_bf16_unit). SmolLM2's 30 layers of products, 2 threads: 4.8-5.3 / 24 / 146-165 ms
 * at 1 / 32 / 256 rows on an AVX-512 BF16 CPU without AMX, where the fp32 route as it then was
 * (rows rounded through fp8 by torch, then panel_matmul_fp8) took 8.3 / 47 / 341 and the fp32
 * model's own bf16-valued weights 7.6 / 33 / 247; on a Xeon with AMX, whose vdpbf16ps is slower
 * (9.4 / 57 / 603 ms), the tiles take 8.5 / 13 / 156.
 *
 * Layout: panels [N / 16, ceil(K / 2), 16, 2] fp8 bytes, as the bf16 pairs above (a zero byte past
 * K); weight_scales [N]. act: ACT_FP8_TOKEN, ACT_FP8_TENSOR or ACT_FP8_STATIC (with static_scale).
 */

/* One row rounded to e4m3 values by scale, as ceil(K / 2) pairs of bf16 (exact). */
static void fp8_row_bf16(uint16_t *restrict out, const float *restrict x, int K, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-448.0f), hi = _mm512_set1_ps(448.0f);
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), vscale), lo), hi);
        __m256bh h = _mm512_cvtneps_pbh(round_to_e4m3_16(v));
        __builtin_memcpy(out + k, &h, sizeof h);
    }
    for (; k < K; k++) {
        float q = round_to_e4m3(clamp_fp8(x[k] / scale));
        uint32_t bits;
        __builtin_memcpy(&bits, &q, sizeof bits);
        out[k] = (uint16_t)(bits >> 16); /* an e4m3 value: its low 16 bits are zero */
    }
    if (K % 2) out[K] = 0;
}

/* A panel's steps of 32 fp8 bytes as bf16 pairs, for the tasks whose rows take several tiles. */
static void widen_fp8_panel(uint16_t *restrict out, const uint8_t *restrict panel, int steps, __m512i subnormals) {
    for (int s = 0; s < steps; s++, panel += 32, out += 32) {
        __builtin_prefetch(panel + PREFETCH_BYTES);
        _mm512_storeu_si512((void *)out, widen_fp8_bf16(panel, subnormals));
    }
}

/* Returns 0, or -1 when the row or panel buffers could not be allocated. */
int panel_matmul_fp8_dot(float *y, const float *x, const uint8_t *panels, const float *weight_scales,
                         const float *bias, int M, int N, int K, int act, float static_scale, int threads) {
    const int steps = (K + 1) / 2;
    const int amx = AMX_BF16_BUILT && amx_on(), width = amx ? 2 : 1; /* panels a task takes */
    /* up to one pass of row tiles (vdpbf16ps: one tile of 16 rows; AMX: two blocks) widen the bytes
     * as they stream; more widen each panel once into the thread's buffer for all their passes */
    const int stream = M <= (amx ? 2 * AMX_ROWS : ROW_TILE_BF16);
    const int num_panels = N / PANEL, units = (num_panels + width - 1) / width;
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)M * steps + sizeof(float) * (size_t)M);
    uint16_t *wide = stream ? 0 : malloc(sizeof(uint16_t) * 32 * (size_t)steps * width * threads);
    const __m512i subnormals = fp8_subnormals_bf16();
    if (!xb || (!stream && !wide)) {
        free(xb);
        free(wide);
        return -1;
    }
    float *row_scales = (float *)(xb + (size_t)M * steps);
#pragma omp parallel num_threads(threads)
    {
        uint16_t *panel_bf16 = stream ? 0 : wide + (size_t)32 * steps * width * omp_get_thread_num();
        int configured = 0; /* the thread's tile configuration (amx_use) */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) row_scales[m] = act == ACT_FP8_STATIC ? static_scale : absmax_of(x + (int64_t)m * K, K);
#pragma omp single
        if (act != ACT_FP8_STATIC) {
            float batch_max = 0.0f;
            for (int m = 0; m < M; m++) batch_max = row_scales[m] > batch_max ? row_scales[m] : batch_max;
            for (int m = 0; m < M; m++) row_scales[m] = fp8_scale_of(act == ACT_FP8_TENSOR ? batch_max : row_scales[m]);
        }
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) fp8_row_bf16((uint16_t *)(xb + (int64_t)m * steps), x + (int64_t)m * K, K, row_scales[m]);
#pragma omp for schedule(static)
        for (int u = 0; u < units; u++) {
            const int first = u * width, last = first + width < num_panels ? first + width : num_panels;
            const void *pair[2] = {0, 0};
            for (int p = first; p < last; p++) {
                const uint8_t *bytes = panels + (int64_t)p * steps * 32;
                if (stream) {
                    pair[p - first] = bytes;
                    continue;
                }
                uint16_t *widened = panel_bf16 + (int64_t)(p - first) * steps * 32;
                widen_fp8_panel(widened, bytes, steps, subnormals);
                pair[p - first] = widened;
            }
            const __m512i *fp8 = stream ? &subnormals : 0; /* the pair holds fp8 bytes, else bf16 pairs */
            const float *bias_u = bias ? bias + first * PANEL : 0;
            if (amx)
                amx_bf16_unit(y + first * PANEL, xb, pair, fp8, bias_u, row_scales, weight_scales + first * PANEL, M,
                              steps, N, &configured);
            else
                panel_rows_bf16_dot(y + first * PANEL, xb, pair[0], fp8, bias_u, row_scales,
                                    weight_scales + first * PANEL, M, steps, N);
        }
        if (amx) amx_release();
    }
    free(xb);
    free(wide);
    return 0;
}

/* Block FP8 (tiles of weights with a scale each, inputs scaled per token and tile width) on the
 * same exact products: each group of `group` columns sums on its own, then adds into the row's
 * total times its channel's and its row's scale for those columns, as row_tile_i8 adds its
 * groups. Rows are rounded to fp8 per token and `act_group` columns (the last group may be
 * shorter; act_group a multiple of group). The vector route only: a row's floats do not depend on
 * its batch, with or without AMX. Layout: panels as panel_matmul_fp8_dot's, group_scales [N / 16,
 * K / group, 16]; K, group and act_group even. */
static inline __attribute__((always_inline)) void row_tile_fp8_groups(float *restrict y, const uint32_t *restrict xb,
                                                                      const void *restrict panel,
                                                                      const __m512i *subnormals, const float *bias,
                                                                      const float *row_scales, int act_groups,
                                                                      const float *group_scales, int rows, int steps,
                                                                      int group_steps, int act_group_steps, int N) {
    const char *w_p = panel;
    const int step_bytes = subnormals ? 32 : 64;
    __m512 total[ROW_TILE_BF16];
    for (int i = 0; i < rows; i++) total[i] = _mm512_setzero_ps();
    for (int s0 = 0; s0 < steps; s0 += group_steps, group_scales += PANEL) {
        __m512 acc[ROW_TILE_BF16];
        for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
        for (int s = s0; s < s0 + group_steps; s++, w_p += step_bytes) {
            __builtin_prefetch(w_p + PREFETCH_BYTES);
            __m512bh w = (__m512bh)(subnormals ? widen_fp8_bf16((const uint8_t *)w_p, *subnormals)
                                               : _mm512_loadu_si512((const void *)w_p));
            for (int i = 0; i < rows; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)xb[(int64_t)i * steps + s]), w);
        }
        const __m512 col = _mm512_loadu_ps(group_scales);
        const float *row = row_scales + s0 / act_group_steps;
        for (int i = 0; i < rows; i++)
            total[i] = _mm512_fmadd_ps(_mm512_mul_ps(acc[i], col), _mm512_set1_ps(row[(int64_t)i * act_groups]), total[i]);
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + (int64_t)i * N, _mm512_add_ps(total[i], b));
}

#define TAIL_FP8_GROUPS(r) case r: row_tile_fp8_groups(y_p + (int64_t)m * N, xb + (int64_t)m * steps, panel, fp8, \
                                                       bias_p, row_scales + (int64_t)m * act_groups, act_groups, \
                                                       scales_p, r, steps, group_steps, act_group_steps, N); break;

/* Returns 0, or -1 when the row or panel buffers could not be allocated. */
int panel_matmul_fp8_dot_groups(float *y, const float *x, const uint8_t *panels, const float *group_scales,
                                const float *bias, int M, int N, int K, int group, int act_group, int threads) {
    const int steps = K / 2, group_steps = group / 2, act_group_steps = act_group / 2;
    const int act_groups = (K + act_group - 1) / act_group, num_panels = N / PANEL;
    const int stream = M <= ROW_TILE_BF16; /* else each panel is widened once for all row tiles */
    uint32_t *xb = malloc(sizeof(uint32_t) * (size_t)M * steps + sizeof(float) * (size_t)M * act_groups);
    uint16_t *wide = stream ? 0 : malloc(sizeof(uint16_t) * 32 * (size_t)steps * threads);
    const __m512i subnormals = fp8_subnormals_bf16();
    if (!xb || (!stream && !wide)) {
        free(xb);
        free(wide);
        return -1;
    }
    float *row_scales = (float *)(xb + (size_t)M * steps); /* [M, act_groups] */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            for (int a = 0; a < act_groups; a++) {
                const int k0 = a * act_group, n = K - k0 < act_group ? K - k0 : act_group;
                const float *src = x + (int64_t)m * K + k0;
                row_scales[(int64_t)m * act_groups + a] = fp8_scale_of(absmax_of(src, n));
                fp8_row_bf16((uint16_t *)(xb + (int64_t)m * steps) + k0, src, n,
                             row_scales[(int64_t)m * act_groups + a]);
            }
        uint16_t *widened = stream ? 0 : wide + (size_t)32 * steps * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int p = 0; p < num_panels; p++) {
            const uint8_t *bytes = panels + (int64_t)p * steps * 32;
            const void *panel = bytes;
            if (!stream) {
                widen_fp8_panel(widened, bytes, steps, subnormals);
                panel = widened;
            }
            const __m512i *fp8 = stream ? &subnormals : 0; /* the panel holds fp8 bytes, else bf16 pairs */
            const float *scales_p = group_scales + (int64_t)p * (K / group) * PANEL;
            const float *bias_p = bias ? bias + p * PANEL : 0;
            float *y_p = y + p * PANEL;
            int m = 0;
            for (; m + ROW_TILE_BF16 <= M; m += ROW_TILE_BF16)
                row_tile_fp8_groups(y_p + (int64_t)m * N, xb + (int64_t)m * steps, panel, fp8, bias_p,
                                    row_scales + (int64_t)m * act_groups, act_groups, scales_p, ROW_TILE_BF16, steps,
                                    group_steps, act_group_steps, N);
            switch (M - m) {
                TAIL_FP8_GROUPS(1) TAIL_FP8_GROUPS(2) TAIL_FP8_GROUPS(3) TAIL_FP8_GROUPS(4) TAIL_FP8_GROUPS(5)
                TAIL_FP8_GROUPS(6) TAIL_FP8_GROUPS(7) TAIL_FP8_GROUPS(8) TAIL_FP8_GROUPS(9) TAIL_FP8_GROUPS(10)
                TAIL_FP8_GROUPS(11) TAIL_FP8_GROUPS(12) TAIL_FP8_GROUPS(13) TAIL_FP8_GROUPS(14) TAIL_FP8_GROUPS(15)
                default: break;
            }
        }
    }
    free(xb);
    free(wide);
    return 0;
}
#else
int bf16_dot_available(void) { return 0; }
#endif
