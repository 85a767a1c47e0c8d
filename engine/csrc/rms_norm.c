/* RMSNorm with the Llama block's residual add, fused, for float32 rows.
 *
 * torch.rms_norm is a composite on CPU (square, mean, add, rsqrt, two multiplies, and the
 * residual add before it): seven dispatches per call, about 45 us at decode sizes, and a
 * decode step calls it twice per layer. Here it is one pass per row.
 *
 *   x, out, sum [rows, hidden]; residual [rows, hidden] or NULL; weight [hidden]
 *   with residual: sum = x + residual, out = norm(sum) * weight
 *   without:       out = norm(x) * weight            (sum untouched)
 *
 * Built at first use by engine/layers/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>

/* Rows per call above which the rows are split across threads (prefill); below it the
 * thread wake-up costs more than the work. */
enum { PARALLEL_ROWS = 64 };

void rms_norm_f32(float *out, float *sum, const float *x, const float *residual, const float *weight, int rows,
                  int hidden, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *src = x + (int64_t)r * hidden;
        if (residual) {
            float *s = sum + (int64_t)r * hidden;
            const float *res = residual + (int64_t)r * hidden;
#pragma omp simd
            for (int i = 0; i < hidden; i++) s[i] = src[i] + res[i];
            src = s;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < hidden; i++) squares += src[i] * src[i];
        float inv_rms = 1.0f / sqrtf(squares / (float)hidden + eps);
        float *o = out + (int64_t)r * hidden;
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = src[i] * inv_rms * weight[i];
    }
}
