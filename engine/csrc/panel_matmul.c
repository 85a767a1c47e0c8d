/* y = x Wᵀ + b for CPUs, on a weight laid out in 16-column panels.
 *
 * Decode multiplies a few activation rows by every weight, so the step is bound by how fast the
 * weights stream from memory. oneDNN's blocked layout reached 15–20 GB/s here at 1–8 rows; this
 * layout makes each thread's read one sequential stream (its own run of panels), and one weight
 * load serves up to ROW_TILE activation rows, so the same kernel also holds up at prefill sizes.
 *
 * Layouts (all contiguous, float32):
 *   x      [M, K]
 *   panels [N / 16, K, 16]: panel p, row k holds W[16p .. 16p + 15][k]  (N a multiple of 16)
 *   bias   [N] or NULL
 *   y      [M, N]
 *
 * Built at first use by engine/layers/cpu_kernels.py; OpenMP resolves to the runtime torch
 * already loaded, so both share one thread pool.
 */
#include <omp.h>
#include <stdint.h>

enum { PANEL = 16 };
typedef float panel_vec __attribute__((vector_size(PANEL * sizeof(float)), aligned(sizeof(float))));

/* Activation rows per register tile: ROW_TILE accumulators plus the weight vector must fit the
 * vector registers (32 with AVX-512, 16 with AVX2, where one panel_vec takes two). */
#ifdef __AVX512F__
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif

/* Bytes ahead in the panel stream to prefetch: 16 rows of k, enough to cover DRAM latency. */
enum { PREFETCH_BYTES = 1024 };

static inline __attribute__((always_inline)) void row_tile(float *restrict y, const float *restrict x,
                                                           const float *restrict panel, const float *bias,
                                                           int rows, int K, int N) {
    panel_vec acc[ROW_TILE];
    for (int i = 0; i < rows; i++) acc[i] = (panel_vec){0};
    for (int k = 0; k < K; k++, panel += PANEL) {
        __builtin_prefetch((const char *)panel + PREFETCH_BYTES);
        panel_vec w = *(const panel_vec *)panel;
        for (int i = 0; i < rows; i++) acc[i] += x[(int64_t)i * K + k] * w;
    }
    panel_vec b = bias ? *(const panel_vec *)bias : (panel_vec){0};
    for (int i = 0; i < rows; i++) *(panel_vec *)(y + (int64_t)i * N) = acc[i] + b;
}

/* Rows come in tiles of ROW_TILE; the leftover tile gets its own constant size so the
 * accumulators stay in registers. */
#define TAIL(r) case r: row_tile(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, bias_p, r, K, N); break;

void panel_matmul_f32(float *y, const float *x, const float *panels, const float *bias, int M, int N, int K,
                      int threads) {
    int num_panels = N / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < num_panels; p++) {
        const float *panel = panels + (int64_t)p * K * PANEL;
        const float *bias_p = bias ? bias + p * PANEL : 0;
        float *y_p = y + p * PANEL;
        int m = 0;
        for (; m + ROW_TILE <= M; m += ROW_TILE)
            row_tile(y_p + (int64_t)m * N, x + (int64_t)m * K, panel, bias_p, ROW_TILE, K, N);
        switch (M - m) {
            TAIL(1) TAIL(2) TAIL(3)
#if ROW_TILE > 4
            TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#endif
            default: break;
        }
    }
}
