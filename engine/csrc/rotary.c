/* Rotary position embedding applied in place, for CPUs.
 *
 * torch spells RoPE as x * cos + rotate_half(x) * sin: six ops and two temporaries per layer,
 * about 40 us at batch 1 where the arithmetic is a few hundred nanoseconds. Here it is one pass.
 *
 * Layout: x float32, T rows of `row_stride` floats; each row starts with `heads` vectors of
 * head_dim (the q and k heads side by side in the fused qkv output, v after them untouched), of
 * which the first rotary_dim rotate (all of them but in partially rotary models, Phi-4-mini).
 * cos/sin float32 [max_positions, rotary_dim], the two halves repeated (as the torch path builds
 * them); positions int64 [T]. With half = rotary_dim / 2, for d < half:
 *   x[d]        = x[d] * cos[d]               - x[d + half] * sin[d]
 *   x[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half]
 */
#include <stdint.h>

enum { ROWS_PER_THREAD_MIN = 16 }; /* below this, threads cost more than they save */

void rotary_f32(float *x, const int64_t *positions, const float *cos, const float *sin, int num_tokens,
                int64_t row_stride, int heads, int head_dim, int rotary_dim, int num_threads) {
    const int half = rotary_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= ROWS_PER_THREAD_MIN * num_threads)
    for (int t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * rotary_dim, *s = sin + positions[t] * rotary_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * row_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] - b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
