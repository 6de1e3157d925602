/* speedc's attention over the runtime's KV-cache pool (runtimes/kernels/ort_op.py, SpeedcAttention): one call
   a layer for every row of a prefill or of a SPEED step, each row at its own position over its own cache
   rows, the cache read and written in place as float16 (or float32). Included by block_product.c (its
   thread pool and path checks).

   For row r and token i < len[r] of its chunk, at position p = pos[r] + i, over cache row row_of[r]:
       k, v   the token's kv heads (the packed q|k|v input); k rotated at p (half-split rope, the cos / sin
              tables given); both written at position p, rounded to the cache's type, before any token reads
       out    per query head h (its kv head h / (heads / kv_heads)), q rotated at p:
              softmax over t = 0..p of scale * q . K[t], times V[t]
   Tokens past len[r] (a right-padded chunk) are neither written nor read: their output is 0.

   Why our own: a SPEED step reads as much cache as a whole plain token (each slot attends over its own loop's
   cache) while it reads the weights once, so at 512 positions attention over an fp32 cache was the largest
   part of what a step adds (docs/benchmarks.md); a float16 cache halves those bytes, and ONNX Runtime's CPU
   GroupQueryAttention is no faster on one. Here each row also reads only its own positions, not the pool's length.

   One order of operations for a token whatever the rows beside it, its chunk or the thread count (work is
   split over (row, kv head)), and the same on the portable and AVX2 paths (explicit fused multiply-
   adds, an exp of our own), so a token attends bitwise the same in plain decoding and in a step:
       q . k   8 lanes, lane l += q[d] * k[d] for d = l, l + 8, ... (fma); then lane l += lane l + 4, + 2, + 1
       exp     exp_approx: a degree-6 polynomial and 2^n, the same fmas on every path
       sum     of e_t: lane t % 8 in order of t, then reduced as the dot
       out[d]  fma of e_t * v_t[d] in order of t, divided by the sum */

#define ATTN_LANES 8
#define ATTN_MAX_HEAD_DIM 512
enum { KV_FP32 = 0, KV_FP16 = 1 };

typedef struct {
    const float *qkv;               /* [rows, chunk, (heads + 2 kv_heads) * hd] */
    int64_t rows, chunk;
    int heads, kv_heads, hd, kv_dtype, wide;
    const int64_t *row_of, *pos, *len;  /* [rows] each */
    char *k_cache, *v_cache;        /* element (row, g, t, d) at ((row * row_stride + g * head_stride + t * hd) + d) */
    int64_t row_stride, head_stride;
    const float *cos, *sin;         /* [positions, hd / 2] */
    float scale;
    float *out;                     /* [rows, chunk, heads * hd] */
    atomic_int failed;              /* a part could not allocate its scores */
} attention_t;

/* float32 -> float16, rounded to nearest even (what F16C's vcvtps2ph does with _MM_FROUND_TO_NEAREST_INT) */
static inline uint16_t float_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00 | (uint16_t)((a >> 13) & 0x3FF);  /* NaN, quieted */
    if (a >= 0x477FF000u) return sign | 0x7C00;  /* 65520 and above round to infinity */
    if (a >= 0x38800000u) return sign | (uint16_t)((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1)) >> 13);  /* normal */
    float m;  /* below 2^-14: a multiple of 2^-24; a * 2^24 is exact, then rounded to an integer (even on ties) */
    memcpy(&m, &a, sizeof m);
    return sign | (uint16_t)nearbyintf(m * 16777216.0f);
}

static inline float kv_load(const char *cache, int64_t index, int dtype) {
    return dtype == KV_FP16 ? fp16_to_float(((const uint16_t *)cache)[index]) : ((const float *)cache)[index];
}

static inline void kv_store(char *cache, int64_t index, float value, int dtype) {
    if (dtype == KV_FP16) ((uint16_t *)cache)[index] = float_to_fp16(value);
    else ((float *)cache)[index] = value;
}

/* e^x for x <= 0 (scores minus their maximum), to about 1 ulp: n = rint(x log2 e), r = x - n ln 2 (in two
   parts), e^r by its degree-6 polynomial, times 2^n. Every operation is IEEE-exact or one fma, so the
   scalar and vector forms give the same bits. */
#define EXP_LOW (-87.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
static const float exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
    x = x < EXP_LOW ? EXP_LOW : x;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = exp_poly[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, exp_poly[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two;
    memcpy(&two, &bits, sizeof two);
    return y * two;
}

static inline float lanes_reduce(float *lane) {
    for (int width = ATTN_LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    return lane[0];
}

/* v[0..hd) rotated at table row COS / SIN (hd / 2 each): the first half x1 cos - x2 sin, the second x2 cos + x1 sin */
static inline void rope(const float *v, const float *cos, const float *sin, int hd, float *out) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        out[i] = v[i] * cos[i] - v[i + half] * sin[i];
        out[i + half] = v[i + half] * cos[i] + v[i] * sin[i];
    }
}

/* ---- the portable path: the order above, one value at a time */
static void attend_portable(const attention_t *a, const float *q, const char *k, const char *v, int64_t count,
                            float *scores, float *out) {
    const int hd = a->hd;
    float m = -INFINITY;
    for (int64_t t = 0; t < count; t++) {
        float lane[ATTN_LANES] = {0};
        for (int d = 0; d < hd; d++) lane[d % ATTN_LANES] = fmaf(q[d], kv_load(k, t * hd + d, a->kv_dtype), lane[d % ATTN_LANES]);
        scores[t] = lanes_reduce(lane) * a->scale;
        m = scores[t] > m ? scores[t] : m;
    }
    float lane[ATTN_LANES] = {0};
    for (int64_t t = 0; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_LANES] += scores[t];
    }
    const float sum = lanes_reduce(lane);
    float acc[ATTN_MAX_HEAD_DIM];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < count; t++)
        for (int d = 0; d < hd; d++) acc[d] = fmaf(scores[t], kv_load(v, t * hd + d, a->kv_dtype), acc[d]);
    for (int d = 0; d < hd; d++) out[d] = acc[d] / sum;
}

#ifdef SPEEDC_X86
/* ---- the AVX2 path (with FMA and F16C): the same operations, 8 lanes a register */
#define ATTN256_TARGET "avx2,fma,f16c"

static inline __attribute__((always_inline, target(ATTN256_TARGET))) __m256 kv8(const char *cache, int64_t index, int dtype) {
    if (dtype == KV_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index)));
    return _mm256_loadu_ps((const float *)cache + index);
}

static inline __attribute__((always_inline, target(ATTN256_TARGET))) float reduce8(__m256 x) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));  /* lane l + lane l + 4 */
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));                       /* + 2 */
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));                   /* + 1 */
}

static inline __attribute__((always_inline, target(ATTN256_TARGET))) __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOW));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static __attribute__((target(ATTN256_TARGET))) void attend_avx2(const attention_t *a, const float *q, const char *k,
                                                                const char *v, int64_t count, float *scores, float *out) {
    const int hd = a->hd, dtype = a->kv_dtype;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {  /* four positions at once: four independent chains */
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int d = 0; d < hd; d += ATTN_LANES) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            s0 = _mm256_fmadd_ps(qd, kv8(k, t * hd + d, dtype), s0);
            s1 = _mm256_fmadd_ps(qd, kv8(k, (t + 1) * hd + d, dtype), s1);
            s2 = _mm256_fmadd_ps(qd, kv8(k, (t + 2) * hd + d, dtype), s2);
            s3 = _mm256_fmadd_ps(qd, kv8(k, (t + 3) * hd + d, dtype), s3);
        }
        scores[t] = reduce8(s0) * a->scale;
        scores[t + 1] = reduce8(s1) * a->scale;
        scores[t + 2] = reduce8(s2) * a->scale;
        scores[t + 3] = reduce8(s3) * a->scale;
    }
    for (; t < count; t++) {
        __m256 s = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += ATTN_LANES) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(k, t * hd + d, dtype), s);
        scores[t] = reduce8(s) * a->scale;
    }
    float m = -INFINITY;
    for (t = 0; t < count; t++) m = scores[t] > m ? scores[t] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    for (t = 0; t + ATTN_LANES <= count; t += ATTN_LANES) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
        _mm256_storeu_ps(scores + t, e);
        total = _mm256_add_ps(total, e);
    }
    float lane[ATTN_LANES];
    _mm256_storeu_ps(lane, total);
    for (; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_LANES] += scores[t];
    }
    const float sum = lanes_reduce(lane);
    for (int d0 = 0; d0 < hd; d0 += 64) {  /* 64 values of out in 8 registers, all positions in order */
        const int width = hd - d0 < 64 ? hd - d0 : 64;
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (t = 0; t < count; t++) {
            const __m256 e = _mm256_set1_ps(scores[t]);
            for (int c = 0; c * ATTN_LANES < width; c++) acc[c] = _mm256_fmadd_ps(e, kv8(v, t * hd + d0 + c * ATTN_LANES, dtype), acc[c]);
        }
        const __m256 s = _mm256_set1_ps(sum);
        for (int c = 0; c * ATTN_LANES < width; c++) _mm256_storeu_ps(out + d0 + c * ATTN_LANES, _mm256_div_ps(acc[c], s));
    }
}
#endif

/* Units (row, kv head) of the part's share: the row's tokens' K and V of that head written, then each token's
   attention for every query head of the group. A token reads only its own row's cache at that head, so the
   units are independent: one parallel region, no barrier between the writes and the reads. */
static void attention_part(const void *job, int part, int parts) {
    const attention_t *a = job;
    const int hd = a->hd, width = (a->heads + 2 * a->kv_heads) * hd, group = a->heads / a->kv_heads;
    const int item = a->kv_dtype == KV_FP16 ? 2 : 4;
    const int64_t units = a->rows * a->kv_heads, u0 = units * part / parts, u1 = units * (part + 1) / parts;
    static __thread float *scores = NULL;
    static __thread int64_t capacity = 0;
    float rotated[ATTN_MAX_HEAD_DIM];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t r = u / a->kv_heads;
        const int g = (int)(u % a->kv_heads);
        const int64_t at = a->row_of[r] * a->row_stride + g * a->head_stride, tokens = a->len[r] < a->chunk ? a->len[r] : a->chunk;
        for (int64_t i = 0; i < tokens; i++) {  /* the writes: rotated key and value at p */
            const int64_t p = a->pos[r] + i;
            const float *token = a->qkv + (r * a->chunk + i) * width;
            rope(token + (a->heads + g) * hd, a->cos + p * (hd / 2), a->sin + p * (hd / 2), hd, rotated);
            const float *value = token + (a->heads + a->kv_heads + g) * hd;
            for (int d = 0; d < hd; d++) {
                kv_store(a->k_cache, at + p * hd + d, rotated[d], a->kv_dtype);
                kv_store(a->v_cache, at + p * hd + d, value[d], a->kv_dtype);
            }
        }
        const char *k = a->k_cache + at * item, *v = a->v_cache + at * item;
        for (int64_t i = 0; i < a->chunk; i++) {
            float *out = a->out + (r * a->chunk + i) * a->heads * hd + g * group * hd;
            if (i >= tokens) {  /* right padding: nothing read, 0 out */
                memset(out, 0, sizeof(float) * group * hd);
                continue;
            }
            const int64_t p = a->pos[r] + i, count = p + 1;
            if (count > capacity) {
                free(scores);
                capacity = count < 4096 ? 4096 : count;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) { capacity = 0; atomic_store(&((attention_t *)job)->failed, 1); return; }
            }
            const float *cos = a->cos + p * (hd / 2), *sin = a->sin + p * (hd / 2);
            for (int h = 0; h < group; h++) {
                rope(a->qkv + (r * a->chunk + i) * width + (g * group + h) * hd, cos, sin, hd, rotated);
#ifdef SPEEDC_X86
                if (a->wide) { attend_avx2(a, rotated, k, v, count, scores, out + h * hd); continue; }
#endif
                attend_portable(a, rotated, k, v, count, scores, out + h * hd);
            }
        }
    }
}

/* Whether this CPU runs the AVX2 attention (with FMA and F16C) for block-product PATH (not the portable one). */
static int attention_wide(int path) {
#ifdef SPEEDC_X86
    __builtin_cpu_init();
    return path != PATH_PORTABLE && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    (void)path;
    return 0;
#endif
}
