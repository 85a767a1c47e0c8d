/* A decode step's whole Llama (or Gemma 3) block stack in one call, for CPUs.
 *
 * Through the modules, a batch-1 decode step of a small model spent about half its time in
 * Python between kernels: per layer some twelve module calls and eight kernel calls, each with
 * its checks, output allocations and ctypes conversions. Here the same kernels run in the
 * same order from C, so the hidden states are bit for bit those of the module path, which stays
 * the oracle and serves every step this does not cover (engine/layers/fused_decode.py decides).
 *
 *   hidden [rows, hidden] float32: in, the token embeddings; out, the final norm's output
 *   positions, slots int64 [rows]: each token's position and the flat KV slot it writes
 *   block_tables int32 [rows, max_blocks], context_lens int32 [rows]: as for paged_decode
 *   KV caches [slots, num_kv_heads, head_dim], float32, bfloat16, fp8 e4m3 or e5m2 (kv_type: paged_cache.h's
 *   CACHE_F32 / CACHE_BF16 / CACHE_FP8 / CACHE_E5M2; fp8 also needs each layer's K and V tables)
 *
 * One translation unit with the kernels it calls (they stay separate libraries for the modules).
 */
#include "activation.c"
#include "paged_decode.c"
#include "panel_matmul.c"
#include "rms_norm.c"
#include "rotary.c"

/* A Linear's kernel and operands, as engine/layers/fused_decode.py describes them. */
enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_INT8 = 2, LINEAR_W8A8 = 3, LINEAR_FP8 = 4, LINEAR_FP8_DOT = 5,
       LINEAR_INT4 = 6, LINEAR_W4A8 = 7, LINEAR_FP8_DOT_GROUPS = 8 };

typedef struct {
    int32_t kind, n, k, group_size, act;
    int32_t act_group;    /* ACT_FP8_TOKEN: columns per input scale, 0 for the whole row */
    float input_scale;    /* ACT_FP8_STATIC */
    const void *weight;   /* panels in the kernel's layout */
    const void *scales;   /* int8, int4, fp8 and fp8 dot groups: scale panels; w8a8 and fp8 dot: per-channel */
    const int32_t *sums;  /* w8a8: 128 · row sums; w4a8: 128 · group sums */
    const float *zeros;   /* asymmetric int4: zero-point panels, else NULL */
    const float *bias;    /* or NULL */
    const struct LoRA *loras; /* per adapter group of the step (Model.lora_*): its factors here, or NULL */
} Linear;

/* An adapter's update on one Linear, y += (x A_catᵀ) B_fullᵀ (engine/lora.py): fp32 panels of
 * A_cat [rank, k] and B_full [n, rank], rank padded to whole panels; rank 0: the adapter does not
 * target this Linear. */
typedef struct LoRA {
    const float *a, *b;
    int32_t rank;
} LoRA;

typedef struct {
    const float *input_norm, *post_norm; /* OLMo 2 (Model.post_norms): no input norm; post_norm norms the attention output */
    const float *q_norm, *k_norm; /* Qwen3's and Gemma's per-head query and key norms [head_dim] (OLMo's: whole
                                   * [q_size] and [kv_size], Model.qk_norm_full), else NULL */
    const float *pre_mlp_norm, *post_mlp_norm; /* Gemma's sandwich: post_norm then norms the attention output */
    const float *cos, *sin; /* this layer's rotary tables (Gemma's local layers have their own), or NULL */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    const float *k_table, *v_table; /* fp8 caches, [num_kv_heads, 256]: the e4m3 values times each head's scale */
    int32_t window;                 /* sliding window, 0: none */
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, kv_type;
    float eps, attn_scale;
    int32_t rotary_dim; /* the leading dims of a head that rotate */
    int32_t gelu;       /* the MLP's gate: 0 silu (SwiGLU), 1 gelu with tanh (GeGLU) */
    float attn_softcap; /* > 0: attention scores capped (Gemma 2) */
    float residual_multiplier; /* each block's output scaled before its residual add (Granite; else 1) */
    int32_t post_norms;   /* OLMo 2: x + norm(attn(x)), then x + norm(mlp(x)) */
    int32_t qk_norm_full; /* q and k normed over all their heads at once */
    const float *final_norm;
    const Layer *layers;
    /* the step's rows grouped by adapter: group g holds lora_rows[lora_offsets[g] .. lora_offsets[g + 1]]
     * (ascending), and each Linear's loras[g] says what that adapter adds there */
    int32_t lora_groups, lora_rank; /* lora_rank: the largest rank of any adapter (the scratch it needs) */
    const int32_t *lora_offsets, *lora_rows;
} Model;

/* sum += x, as torch's fp32 add. */
static void add_rows(float *sum, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) sum[i] += x[i];
}

/* x *= s, as torch's fp32 multiply (a no-op for s = 1). */
static void scale_rows(float *x, size_t n, float s) {
    if (s == 1.0f) return;
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

enum { STEP_OK = 0, STEP_NO_MEMORY = -1, STEP_BAD_BLOCK_SIZE = -2, STEP_BAD_LINEAR = -3 };

/* The byte of v in format f, v a value round_to_fp8 returned: sign, biased exponent, the kept
 * mantissa bits (a subnormal: exponent field 0, v in steps of its smallest value). */
static inline uint8_t fp8_byte(float v, Fp8Format f) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    if (fabsf(v) < pow2f(1 - f.bias)) return sign | (uint8_t)(fabsf(v) / pow2f(1 - f.bias - f.mantissa));
    const uint32_t exponent = ((bits >> 23) & 0xFFu) - (uint32_t)(127 - f.bias);
    return sign | (uint8_t)(exponent << f.mantissa) | (uint8_t)((bits >> (23 - f.mantissa)) & ((1u << f.mantissa) - 1));
}

/* n floats into the cache as they are; rounded to bfloat16 (nearest, ties to even: torch's cast);
 * or, for fp8, divided by the KV head's scale (its table's entry for 1.0), saturated to the
 * format's range and rounded to e4m3 or e5m2 (attention.py's _store). */
static inline void store_kv(void *cache, int64_t slot_offset, const float *x, int n, int kv_type,
                            const float *fp8_tables, int head_dim) {
    if (kv_type == CACHE_F32) {
        memcpy((float *)cache + slot_offset, x, sizeof(float) * n);
        return;
    }
    if (is_fp8_cache(kv_type)) {
        uint8_t *dst = (uint8_t *)cache + slot_offset;
        const int one = fp8_one(kv_type);
        const Fp8Format f = kv_type == CACHE_E5M2 ? E5M2 : E4M3;
        for (int i = 0; i < n; i++) {
            const float scaled = x[i] / fp8_tables[(size_t)(i / head_dim) * 256 + one];
            dst[i] = fp8_byte(round_to_fp8(clamp_to(scaled, f.max), f), f);
        }
        return;
    }
    uint16_t *dst = (uint16_t *)cache + slot_offset;
    for (int i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        dst[i] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* y = x Wᵀ + b; `staging` holds rows × k floats for the FP8 kinds' rounded inputs. */
static int base_linear(const Linear *l, float *y, const float *x, float *staging, int rows, int threads) {
    switch (l->kind) {
    case LINEAR_F32:
        panel_matmul_f32(y, x, l->weight, l->bias, rows, l->n, l->k, threads);
        return STEP_OK;
    case LINEAR_BF16:
        panel_matmul_bf16(y, x, l->weight, l->bias, rows, l->n, l->k, threads);
        return STEP_OK;
    case LINEAR_INT8:
        panel_matmul_i8(y, x, l->weight, l->scales, l->bias, rows, l->n, l->k, l->group_size, threads);
        return STEP_OK;
    case LINEAR_INT4:
        if (l->zeros)
            panel_matmul_i4_zero(y, x, l->weight, l->scales, l->zeros, l->bias, rows, l->n, l->k, l->group_size,
                                 threads);
        else
            panel_matmul_i4(y, x, l->weight, l->scales, l->bias, rows, l->n, l->k, l->group_size, threads);
        return STEP_OK;
#ifdef W8A8_KERNELS
    case LINEAR_W8A8:
        return panel_matmul_w8a8(y, x, l->weight, l->sums, l->scales, l->bias, rows, l->n, l->k, threads);
    case LINEAR_W4A8:
        return panel_matmul_w4a8(y, x, l->weight, l->sums, l->scales, l->bias, rows, l->n, l->k, l->group_size,
                                 threads);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    case LINEAR_FP8_DOT:
        return panel_matmul_fp8_dot(y, x, l->weight, l->scales, l->bias, rows, l->n, l->k, l->act, l->input_scale,
                                    threads);
    case LINEAR_FP8_DOT_GROUPS:
        return panel_matmul_fp8_dot_groups(y, x, l->weight, l->scales, l->bias, rows, l->n, l->k, l->group_size,
                                           l->act_group, threads);
#endif
    case LINEAR_FP8:
        if (l->act != ACT_NONE) {
            fake_quantize_fp8(staging, x, rows, l->k, l->act, l->input_scale, l->act_group, threads);
            x = staging;
        }
        panel_matmul_fp8(y, x, l->weight, l->scales, l->bias, rows, l->n, l->k, l->group_size, threads);
        return STEP_OK;
    default:
        return STEP_BAD_LINEAR;
    }
}

/* y = x Wᵀ + b, plus each adapter group's update from the unrounded x of its rows: the module
 * path's arithmetic (LoRAFactors.delta on the group's rows, then one add per element).
 * `lora_scratch` holds rows × (k + lora_rank + n) floats. */
static int linear(const Model *m, const Linear *l, float *y, const float *x, float *staging, float *lora_scratch,
                  int rows, int threads) {
    const int status = base_linear(l, y, x, staging, rows, threads);
    if (status != STEP_OK || l->loras == NULL) return status;
    for (int g = 0; g < m->lora_groups; g++) {
        const LoRA *lora = &l->loras[g];
        const int32_t *group = m->lora_rows + m->lora_offsets[g];
        const int count = m->lora_offsets[g + 1] - m->lora_offsets[g];
        if (lora->rank == 0 || count == 0) continue;
        const int whole = count == rows; /* every row, in order: no gather */
        float *gathered = lora_scratch, *t = gathered + (size_t)count * l->k, *u = t + (size_t)count * lora->rank;
        if (!whole)
            for (int j = 0; j < count; j++)
                memcpy(gathered + (size_t)j * l->k, x + (size_t)group[j] * l->k, sizeof(float) * l->k);
        panel_matmul_f32(t, whole ? x : gathered, lora->a, NULL, count, lora->rank, l->k, threads);
        panel_matmul_f32(u, t, lora->b, NULL, count, l->n, lora->rank, threads);
        for (int j = 0; j < count; j++) {
            float *out = y + (size_t)(whole ? j : group[j]) * l->n;
            const float *add = u + (size_t)j * l->n;
            for (int i = 0; i < l->n; i++) out[i] += add[i];
        }
    }
    return STEP_OK;
}

/* Returns STEP_OK, or the first failure (no memory, a block size that is not a power of two, a
 * Linear kind this build lacks); hidden is then undefined. */
int decode_step(const Model *m, float *hidden, const int64_t *positions, const int64_t *slots,
                const int32_t *block_tables, const int32_t *context_lens, int rows, int max_blocks, int block_size,
                int threads) {
    const int width = m->hidden, q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int qkv_size = q_size + 2 * kv_size;
    const int widest_input = m->inter > width ? (m->inter > q_size ? m->inter : q_size) : (width > q_size ? width : q_size);
    const int widest_output = qkv_size > 2 * m->inter ? (qkv_size > width ? qkv_size : width)
                                                      : (2 * m->inter > width ? 2 * m->inter : width);
    const size_t lora_floats = m->lora_rank ? (size_t)widest_input + m->lora_rank + widest_output : 0;
    const size_t row_floats = (size_t)2 * width + qkv_size + 2 * q_size + 3 * (size_t)m->inter + widest_input +
                              lora_floats;
    float *scratch = malloc(sizeof(float) * row_floats * rows);
    if (scratch == NULL) return STEP_NO_MEMORY;
    float *residual = scratch, *normed = residual + (size_t)rows * width, *qkv = normed + (size_t)rows * width;
    float *q = qkv + (size_t)rows * qkv_size, *attn = q + (size_t)rows * q_size;
    float *gate_up = attn + (size_t)rows * q_size, *act = gate_up + (size_t)rows * 2 * m->inter;
    float *staging = act + (size_t)rows * m->inter, *lora_scratch = staging + (size_t)rows * widest_input;
    const size_t row_bytes = sizeof(float) * width;
    int status = STEP_OK;
    for (int i = 0; i < m->num_layers && status == STEP_OK; i++) {
        const Layer *layer = m->layers + i;
        if (m->post_norms) { /* the block's input is the residual stream itself: x = hidden + residual */
            if (i == 0)
                memcpy(residual, hidden, row_bytes * rows);
            else
                add_rows(residual, hidden, (size_t)rows * width);
        } else if (i == 0) { /* the embeddings are the first residual */
            memcpy(residual, hidden, row_bytes * rows);
            rms_norm_f32(normed, NULL, hidden, NULL, layer->input_norm, rows, width, m->eps, threads);
        } else {
            rms_norm_f32(normed, residual, hidden, residual, layer->input_norm, rows, width, m->eps, threads);
        }
        if ((status = linear(m, &layer->qkv, qkv, m->post_norms ? residual : normed, staging, lora_scratch, rows,
                             threads)))
            break;
        if (layer->q_norm) /* normalized in place, row by row as the modules' norms do it: each head, or all at once */
            for (int t = 0; t < rows; t++) {
                float *row = qkv + (size_t)t * qkv_size;
                const int q_rows = m->qk_norm_full ? 1 : m->num_heads, k_rows = m->qk_norm_full ? 1 : m->num_kv_heads;
                rms_norm_f32(row, NULL, row, NULL, layer->q_norm, q_rows, q_size / q_rows, m->eps, 1);
                rms_norm_f32(row + q_size, NULL, row + q_size, NULL, layer->k_norm, k_rows, kv_size / k_rows, m->eps,
                             1);
            }
        if (layer->cos) /* NULL: a layer without positions (SmolLM3's NoPE layers) */
            rotary_f32(qkv, positions, layer->cos, layer->sin, rows, qkv_size, m->num_heads + m->num_kv_heads,
                       m->head_dim, m->rotary_dim, threads);
        for (int t = 0; t < rows; t++) {
            const float *row = qkv + (size_t)t * qkv_size;
            memcpy(q + (size_t)t * q_size, row, sizeof(float) * q_size);
            store_kv(layer->k_cache, slots[t] * kv_size, row + q_size, kv_size, m->kv_type, layer->k_table,
                     m->head_dim);
            store_kv(layer->v_cache, slots[t] * kv_size, row + q_size + kv_size, kv_size, m->kv_type, layer->v_table,
                     m->head_dim);
        }
        status = paged_decode_attention(attn, q, layer->k_cache, layer->v_cache, block_tables, context_lens, rows,
                                        max_blocks, m->num_heads, m->num_kv_heads, m->head_dim, block_size,
                                        m->attn_scale, m->kv_type, layer->k_table, layer->v_table,
                                        layer->window, m->attn_softcap, threads);
        if (status || (status = linear(m, &layer->o, hidden, attn, staging, lora_scratch, rows, threads))) break;
        scale_rows(hidden, (size_t)rows * width, m->residual_multiplier);
        const float *mlp_input = normed;
        if (m->post_norms) { /* x + norm(attn(x)) feeds the MLP; norm(mlp(x)) is the block's output beside it */
            rms_norm_f32(hidden, NULL, hidden, NULL, layer->post_norm, rows, width, m->eps, threads);
            add_rows(residual, hidden, (size_t)rows * width);
            mlp_input = residual;
        } else if (layer->pre_mlp_norm) { /* the attention output normed, then added and normed for the MLP */
            rms_norm_f32(hidden, NULL, hidden, NULL, layer->post_norm, rows, width, m->eps, threads);
            rms_norm_f32(normed, residual, hidden, residual, layer->pre_mlp_norm, rows, width, m->eps, threads);
        } else {
            rms_norm_f32(normed, residual, hidden, residual, layer->post_norm, rows, width, m->eps, threads);
        }
        if ((status = linear(m, &layer->gate_up, gate_up, mlp_input, staging, lora_scratch, rows, threads))) break;
        (m->gelu ? gelu_tanh_mul_f32 : silu_mul_f32)(act, gate_up, rows, m->inter, threads);
        if ((status = linear(m, &layer->down, hidden, act, staging, lora_scratch, rows, threads))) break;
        scale_rows(hidden, (size_t)rows * width, m->residual_multiplier);
        if (layer->post_mlp_norm) rms_norm_f32(hidden, NULL, hidden, NULL, layer->post_mlp_norm, rows, width, m->eps, threads);
    }
    if (status == STEP_OK)
        rms_norm_f32(hidden, residual, hidden, residual, m->final_norm, rows, width, m->eps, threads);
    free(scratch);
    return status;
}
