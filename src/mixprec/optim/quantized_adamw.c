/* AdamW's step on one param with 8-bit blockwise state (int8: the dynamic maps; fp8: E4M3 m, E5M2 v), fused:
 * each block of 256 elements is decoded, updated, written back and requantized while it sits in the L1 cache.
 *
 * The arithmetic is mixprec.optim.quantized_adamw.reference_step_ op for op: every operation is one correctly
 * rounded IEEE fp32 operation in the same order (built with -ffp-contract=off, no fast-math), and the codes
 * come from the same lookup arrays, so the result equals the torch ops bit for bit in every finite block
 * (a block holding a NaN or inf reads NaN in both). Random numbers: either passed in (drawn by Python from a
 * torch generator, or from the stream where a run of indices crosses 2**32), or computed here from the
 * counter-based stream's key words (mixprec.optim.sr_stream: the same hash, sr_bits below; a test and the
 * load-time check pin them equal).
 * Built and loaded by mixprec.c_kernels; called by mixprec.optim.quantized_adamw.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256

typedef struct {
    int shift;                /* bin = (bits >> shift) & mask */
    uint32_t mask;
    const uint8_t *counts;    /* boundaries below each bin */
    const float *bound;       /* the first boundary at or above the bin's lowest value (+inf: none) */
} lookup_t;

typedef struct {                /* how one moment is coded (mixprec.optim.quantized_state.Code) */
    const float *decode;        /* 256: code byte -> value in table units (fp8: the fp8 value; NaN patterns NaN) */
    const float *table;         /* the code's values, ascending: stochastic rounding's neighbours */
    const uint8_t *bytes;       /* table index -> code byte */
    lookup_t nearest;           /* the midpoints (fp8: of the magnitudes) */
    lookup_t neighbours;        /* the table's values */
    int table_len;
    float qmax, floor;          /* fp8: unit = max(scale, floor) / qmax; dynamic maps: unit = scale */
    float lowest;               /* the signed map's |lowest value| (0.99297); 0: scale = the largest magnitude */
} codec_t;

typedef struct {
    int64_t n;                          /* elements */
    void *param; int param_bf16;        /* fp32 or bf16, updated in place */
    const void *grad; int grad_bf16;    /* fp32 or bf16, read */
    uint8_t *m_codes; float *m_absmax;  /* int8: signed dynamic map; fp8: E4M3 */
    uint8_t *v_codes; float *v_absmax;  /* int8: unsigned dynamic map of sqrt(v); fp8: v in E5M2 */
    codec_t m_codec, v_codec;
    int fp8;                            /* 0: int8 codes, 1: fp8 codes */
    const float *m_rand, *v_rand;       /* NULL: nearest; else one uniform [0, 1) per element (padded blocks) */
    const int32_t *p_noise;             /* bf16 params: NULL rounds to nearest even, else stochastic bits */
    float decay, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size;
    int64_t block_begin, block_end;
    int state_keyed, param_keyed;       /* 1: stochastic bits from the stream's keys below, not m_rand / p_noise */
    uint32_t m_k1, m_k2, v_k1, v_k2, p_k1, p_k2;   /* the key words of exp_avg, exp_avg_sq and the param */
    uint32_t offset;                    /* the param's first element's global index (the run stays below 2**32) */
} step_args;

/* mixprec.optim.sr_stream: lowbias32 of (index ^ k1) with k2 injected between its rounds */
static inline uint32_t sr_bits(uint32_t k1, uint32_t k2, uint32_t i) {
    uint32_t x = i ^ k1;
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= k2; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

static inline __attribute__((always_inline)) void stream_uniform(const int len, uint32_t k1, uint32_t k2, uint32_t first,
                                                                  float *restrict out) {
    for (int j = 0; j < len; ++j) out[j] = (float)(sr_bits(k1, k2, first + (uint32_t)j) >> 8) * 0x1p-24f;
}

static inline __attribute__((always_inline)) void stream_noise(const int len, uint32_t k1, uint32_t k2, uint32_t first,
                                                                int32_t *restrict out) {
    for (int j = 0; j < len; ++j) out[j] = (int32_t)sr_bits(k1, k2, first + (uint32_t)j);
}

static inline uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float load(const void *p, int bf16, int64_t i) {
    if (bf16) return float_of((uint32_t)((const uint16_t *)p)[i] << 16);
    return ((const float *)p)[i];
}

/* torch's CPU float -> bf16: round to nearest even, any NaN -> 0xFFFF (its vectorised conversion) */
static inline uint16_t bf16_nearest(float x) {
    uint32_t u = bits_of(x);
    if (x != x) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* mixprec.optim.rounding.stochastic_round_to_bf16 with the drawn int32 noise */
static inline uint16_t bf16_stochastic(float x, int32_t noise) {
    if (x != x) return bf16_nearest(x);   /* NaN passes through (as its RNE conversion: torch's .to(bf16)) */
    uint32_t r = (((uint32_t)noise & 0xFFFFu) + bits_of(x)) & ~0xFFFFu;
    return (uint16_t)(r >> 16);
}

/* A block's scale from its largest positive value and largest negative magnitude (bit patterns of
 * non-negative floats order as integers), as quantized_state._block_absmax and quantize: NaN when the
 * block holds a non-finite value or its scale overflows; the signed map (lowest > 0) scales by
 * max(largest, |most negative| / 0.99297), the others by the largest magnitude. */
static inline float block_absmax(uint32_t pos_bits, uint32_t neg_bits, float lowest) {
    if (pos_bits >= 0x7F800000u || neg_bits >= 0x7F800000u) return NAN;
    if (lowest == 0.0f) return float_of(pos_bits > neg_bits ? pos_bits : neg_bits);
    float pos = float_of(pos_bits);
    float neg = float_of(neg_bits) / lowest;   /* overflows to inf for |value| > 0.99297 * FLT_MAX */
    float scale = neg > pos ? neg : pos;
    return bits_of(scale) >= 0x7F800000u ? NAN : scale;   /* quantize: an inf scale is NaN too */
}

/* What one table unit is worth in a block of scale `scale` (quantized_state._unit). */
static inline float unit_of(float scale, const codec_t *c, const int fp8) {
    if (!fp8) return scale;
    return (scale < c->floor ? c->floor : scale) / c->qmax;   /* NaN stays NaN */
}

/* The AdamW update of one block (len <= 256), into p_new, m_new and x_new, v's coded value: sqrt(max(v, 0))
 * under int8, v itself under fp8; the denominator takes sqrt(v) unclamped, as the reference. */
static inline __attribute__((always_inline)) void update_block(
        const int len, const int param_bf16, const int grad_bf16, const int fp8, const void *restrict param,
        const void *restrict grad, const uint8_t *restrict m_codes, const uint8_t *restrict v_codes,
        const float *restrict m_decode, const float *restrict v_decode, const float m_unit, const float v_unit,
        const step_args *restrict a, float *restrict p_new, float *restrict m_new, float *restrict x_new) {
    const float decay = a->decay, omb1 = a->one_minus_beta1, beta2 = a->beta2, omb2 = a->one_minus_beta2;
    const float inv_bc2_sqrt = a->inv_bc2_sqrt, eps = a->eps, neg_step_size = a->neg_step_size;
    for (int j = 0; j < len; ++j) {
        float g = grad_bf16 ? float_of((uint32_t)((const uint16_t *)grad)[j] << 16) : ((const float *)grad)[j];
        float p = param_bf16 ? float_of((uint32_t)((const uint16_t *)param)[j] << 16) : ((const float *)param)[j];
        p = p * decay;
        float m = m_decode[m_codes[j]] * m_unit;
        float s = v_decode[v_codes[j]] * v_unit;
        float v = fp8 ? s : s * s;
        m = m + (g - m) * omb1;
        v = v * beta2 + (omb2 * g) * g;
        /* v < 0 (a negative E5M2 code: no quantize makes one) gives torch's CPU sqrt's NaN, +NaN (sqrtf's is -NaN) */
        float c = v < 0.0f ? NAN : sqrtf(v);
        float denom = c * inv_bc2_sqrt + eps;
        p_new[j] = p + (neg_step_size * m) / denom;
        m_new[j] = m;
        x_new[j] = fp8 ? v : (v < 0.0f ? 0.0f : c);   /* int8 codes sqrt(max(v, 0)), as quantize */
    }
}

/* Largest positive value's and largest negative magnitude's bit patterns (non-negative floats order as
 * integers; a NaN's pattern is above every finite one and inf's), branch-free so that it vectorises. */
static inline __attribute__((always_inline)) void block_extremes(const int len, const float *restrict x,
                                                                  uint32_t *pos_out, uint32_t *neg_out) {
    uint32_t pos = 0, neg = 0;
    for (int j = 0; j < len; ++j) {
        uint32_t b = bits_of(x[j]), mag = b & 0x7FFFFFFFu, is_neg = b >> 31;
        uint32_t p = mag & (is_neg - 1u), q = mag & (0u - is_neg);
        pos = p > pos ? p : pos;
        neg = q > neg ? q : neg;
    }
    *pos_out = pos; *neg_out = neg;
}

/* Nearest: the dynamic maps' index is the code (a tie goes to the lower value, as torch.bucketize); fp8
 * rounds the magnitude to nearest, ties to even (the byte's last bit), and keeps the sign (-0 included),
 * as torch's float -> fp8 conversion. */
static inline __attribute__((always_inline)) void encode_nearest(const int len, const int fp8, const float *restrict x,
                                                                  const float unit, const lookup_t l,
                                                                  const uint8_t *restrict counts,
                                                                  const float *restrict bound, uint8_t *restrict codes) {
    for (int j = 0; j < len; ++j) {
        float y = x[j] / unit;
        if (!fp8) {
            uint32_t bin = (bits_of(y) >> l.shift) & l.mask;
            codes[j] = (uint8_t)(counts[bin] + (bound[bin] < y));
        } else {
            uint32_t yb = bits_of(y);
            float mag = float_of(yb & 0x7FFFFFFFu);
            uint32_t bin = (bits_of(mag) >> l.shift) & l.mask;
            uint32_t idx = counts[bin] + (bound[bin] < mag);
            idx += (bound[bin] == mag) & idx & 1u;
            codes[j] = (uint8_t)(idx | ((yb >> 24) & 0x80u));
        }
    }
}

static inline __attribute__((always_inline)) void encode_stochastic(const int len, const float *restrict x, const float unit,
                                                                     const codec_t *restrict c, const float *restrict rand,
                                                                     uint8_t *restrict codes) {
    const lookup_t l = c->neighbours;
    const uint8_t *restrict counts = l.counts, *restrict bytes = c->bytes;
    const float *restrict bound = l.bound, *restrict table = c->table;
    const int32_t top = c->table_len - 2;
    for (int j = 0; j < len; ++j) {
        float y = x[j] / unit;
        uint32_t bin = (bits_of(y) >> l.shift) & l.mask;
        int32_t lower = counts[bin] + (bound[bin] <= y) - 1;
        lower = lower < 0 ? 0 : (lower > top ? top : lower);
        float lo = table[lower], hi = table[lower + 1];
        codes[j] = bytes[lower + (rand[j] < (y - lo) / (hi - lo))];
    }
}

static inline __attribute__((always_inline)) void store_param(const int len, const int param_bf16, const float *restrict p_new,
                                                               const int32_t *restrict noise, void *restrict param) {
    if (!param_bf16) {
        float *restrict pf = (float *)param;
        for (int j = 0; j < len; ++j) pf[j] = p_new[j];
    } else if (noise) {
        uint16_t *restrict pb = (uint16_t *)param;
        for (int j = 0; j < len; ++j) pb[j] = bf16_stochastic(p_new[j], noise[j]);
    } else {
        uint16_t *restrict pb = (uint16_t *)param;
        for (int j = 0; j < len; ++j) pb[j] = bf16_nearest(p_new[j]);
    }
}

/* One block: update, write the param, then requantize both moments. Inlined into one specialisation per
 * (param, grad, rounding, code) format, so that every loop is branch-free. */
static inline __attribute__((always_inline)) void step_block(const step_args *a, int64_t b, const int param_bf16,
                                                              const int grad_bf16, const int stochastic, const int fp8) {
    const int64_t start = b * BLOCK;
    const int len = (int)(a->n - start < BLOCK ? a->n - start : BLOCK);
    const size_t pbytes = param_bf16 ? 2 : 4, gbytes = grad_bf16 ? 2 : 4;
    const codec_t *mc = &a->m_codec, *vc = &a->v_codec;
    float m_new[BLOCK], x_new[BLOCK], p_new[BLOCK], m_r[BLOCK], v_r[BLOCK];
    int32_t p_n[BLOCK];
    const uint32_t first = a->offset + (uint32_t)start;
    const int32_t *noise = a->p_noise ? a->p_noise + start : NULL;
    if (a->param_keyed) { stream_noise(len, a->p_k1, a->p_k2, first, p_n); noise = p_n; }
    update_block(len, param_bf16, grad_bf16, fp8, (const char *)a->param + start * pbytes,
                 (const char *)a->grad + start * gbytes, a->m_codes + start, a->v_codes + start, mc->decode,
                 vc->decode, unit_of(a->m_absmax[b], mc, fp8), unit_of(a->v_absmax[b], vc, fp8), a, p_new, m_new, x_new);
    store_param(len, param_bf16, p_new, noise, (char *)a->param + start * pbytes);
    uint32_t m_pos, m_neg, x_pos, x_neg;
    block_extremes(len, m_new, &m_pos, &m_neg);
    block_extremes(len, x_new, &x_pos, &x_neg);   /* x >= 0, or NaN of either sign */
    const float m_abs = block_absmax(m_pos, m_neg, mc->lowest);
    const float x_abs = block_absmax(x_pos, x_neg, 0.0f);
    a->m_absmax[b] = m_abs;
    a->v_absmax[b] = x_abs;
    /* NaN > 0 is false: a NaN block is coded against a scale of 1, as quantize does */
    const float m_unit = unit_of(m_abs > 0.0f ? m_abs : 1.0f, mc, fp8);
    const float x_unit = unit_of(x_abs > 0.0f ? x_abs : 1.0f, vc, fp8);
    if (!stochastic) {
        encode_nearest(len, fp8, m_new, m_unit, mc->nearest, mc->nearest.counts, mc->nearest.bound, a->m_codes + start);
        encode_nearest(len, fp8, x_new, x_unit, vc->nearest, vc->nearest.counts, vc->nearest.bound, a->v_codes + start);
    } else {
        const float *m_rand = a->m_rand ? a->m_rand + start : m_r, *v_rand = a->v_rand ? a->v_rand + start : v_r;
        if (a->state_keyed) {
            stream_uniform(len, a->m_k1, a->m_k2, first, m_r);
            stream_uniform(len, a->v_k1, a->v_k2, first, v_r);
        }
        encode_stochastic(len, m_new, m_unit, mc, m_rand, a->m_codes + start);
        encode_stochastic(len, x_new, x_unit, vc, v_rand, a->v_codes + start);
    }
}

#define BLOCKS(PB, GB, SR, F8) \
    for (int64_t b = a->block_begin; b < a->block_end; ++b) step_block(a, b, PB, GB, SR, F8)
#define BY_CODE(PB, GB, SR) \
    if (a->fp8) { BLOCKS(PB, GB, SR, 1); } else { BLOCKS(PB, GB, SR, 0); }

static void step_blocks(const step_args *a) {
    const int sr = a->m_rand != NULL || a->state_keyed, pb = a->param_bf16, gb = a->grad_bf16;
    if (pb && gb && !sr) { BY_CODE(1, 1, 0) }
    else if (pb && gb) { BY_CODE(1, 1, 1) }
    else if (!pb && !gb && !sr) { BY_CODE(0, 0, 0) }
    else if (!pb && !gb) { BY_CODE(0, 0, 1) }
    else if (pb && !sr) { BY_CODE(1, 0, 0) }
    else if (pb) { BY_CODE(1, 0, 1) }
    else if (!sr) { BY_CODE(0, 1, 0) }
    else { BY_CODE(0, 1, 1) }
}

static void *run_thread(void *arg) { step_blocks((const step_args *)arg); return NULL; }

#define MAX_THREADS 64

/* One AdamW step over all blocks of one param, on up to nthreads threads (contiguous ranges of blocks).
 * Returns 0, or -1 when a thread could not be started (the caller's blocks are then all done on this one). */
int mixprec_adamw8bit_step(const step_args *args, int nthreads) {
    int64_t nblocks = (args->n + BLOCK - 1) / BLOCK;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > nblocks / 16) nthreads = (int)(nblocks / 16);   /* >= 16 blocks per thread */
    if (nthreads < 1) nthreads = 1;
    step_args parts[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; ++t) {
        parts[t] = *args;
        parts[t].block_begin = nblocks * t / nthreads;
        parts[t].block_end = nblocks * (t + 1) / nthreads;
    }
    for (int t = 1; t < nthreads; ++t)
        started[t] = pthread_create(&threads[t], NULL, run_thread, &parts[t]) == 0;
    step_blocks(&parts[0]);
    int rc = 0;
    for (int t = 1; t < nthreads; ++t) {
        if (started[t]) pthread_join(threads[t], NULL);
        else { step_blocks(&parts[t]); rc = -1; }
    }
    return rc;
}

/* mixprec.optim.rounding.stochastic_round_to_bf16 of n fp32 values with the stream's bits (key words k1, k2;
 * element j takes global index first + j, the run below 2**32): one pass, no noise tensor. */
void mixprec_sr_bf16(const float *restrict x, uint16_t *restrict out, int64_t n, uint32_t k1, uint32_t k2,
                     uint32_t first) {
    for (int64_t j = 0; j < n; ++j) out[j] = bf16_stochastic(x[j], (int32_t)sr_bits(k1, k2, first + (uint32_t)j));
}

/* The size of step_args as this compiler lays it out: the caller checks it against its own. */
int64_t mixprec_adamw8bit_args_size(void) { return (int64_t)sizeof(step_args); }
