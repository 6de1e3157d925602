/* Blocked int4 / int8 weight products with int8 dot products: y [M, N] = x [M, K] . dequant(W [N, K])^T.

   The weights are read in ONNX Runtime's MatMulNBits layout, byte for byte what the artifact stores
   (passes/block_quant.py): codes [N, blocks, block_size * bits / 8] uint8 (4 bits: two codes a byte, the
   lower K index in the low nibble), one float scale per block, zero point 2^(bits-1):
   w = (code - zp) * scale. Once per weight (speedc_block_prepare) the scales of each superblock (8
   sub-blocks of 32 values at 4 bits, 2 at 8 bits: super_of) become one float unit and integer steps:

       unit[n, s] = max |scale| over the superblock / 2047,   step[n, b] = rint(scale[n, b] / unit[n, s])

   Activations are quantized to int8 per superblock: dx = max|x| / 127, q = rint(x * 127 / max|x|). So a
   superblock's whole contribution is one exact integer, scaled once:

       y[m, n] = sum over superblocks s of  float(sum over its sub-blocks b of step[n, b] * dot_b(code - zp, q))
                                             * (unit[n, s] * dx[m, s])

   Why integer steps: the products of a superblock add up in integers (a multiply-add by the step, then
   an add), with one conversion and one float multiply-add per superblock instead of per sub-block, and
   at 4 bits two sub-blocks share one multiply-add (pair4_dot): per row, 3 multiply instructions for 64
   weights instead of 4, and no horizontal reduction. The steps hold each block scale to within 1/4094
   of its superblock's largest, far inside the weights' own int4 / int8 rounding.

   Why a kernel of our own (not MatMulNBits): SPEED is lossless only if a row is computed the same alone
   (plain decoding) and among the P rows of a step; MatMulNBits' 4-bit single-row kernel is not, so its
   graphs pad every product with a zero row. Here every row is summed in one fixed order whatever the
   row count, so 1 row and P rows give bitwise the same sums per row; the work is split over output
   features only, so the thread count does not change a sum either.

   Paths, chosen at run time from the CPU's features (each compiled with its own target attributes, so
   one build serves every CPU of its architecture); each is row-invariant on its own. Multiply
   instructions per 64 weights per row (4 bits / 8 bits; the weights' unpacking is shared by the rows):

       path          instructions per superblock per row                          4 bits   8 bits
       avx2          maddubs x2 + madd per pair of sub-blocks (256-bit)              3        4
       avx-vnni      dpbusd x4 + dpwssd per 4 sub-blocks (256-bit, AVX-VNNI)        2.5       4
       avx512-vnni   dpbusd x8 per sub-block and 16 features (512-bit), dpwssd    1.1      1.2
                     per pair of sub-blocks (4 bits) or mulld per sub-block (8)
       amx           tdpbssd / tdpbsud per sub-block, 16 features x up to 16 rows    -        -
       dotprod       sdot x2 + mla per sub-block (128-bit, Arm dotprod)              6        6
       i8mm          smmla x4 + mla per sub-block, 2 rows x 2 features (Arm i8mm)    2.5      2.5
       portable      C, one value at a time

   avx2 and avx-vnni keep a superblock's integer sum spread over vector lanes (one conversion and one
   float multiply-add per superblock for all lanes): they may differ from the others in the last bits.
   Every other path sums each superblock to one exact integer per (row, feature) and scales it as the
   portable path does: they give the portable path's bits exactly. avx512-vnni and amx read the weight
   repacked once at load, 16 features side by side (block_product_lanes.h; the artifact's codes are then
   not read again); amx runs products of amx_min_rows or more rows on AMX tiles and fewer on the
   avx512-vnni code, the same bits. avx-vnni-standin and amx-standin replace each AVX-VNNI or AMX
   instruction by an exact equivalent (AVX2, or AMX's tile operations in plain C): they test those
   paths' logic on any AVX2 CPU and are never chosen by themselves.
   Built by runtimes/kernels/native.py with the system C compiler; speedc falls back to ONNX Runtime's
   MatMulNBits where it cannot build or load this file. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPEEDC_X86 1
/* AVX-VNNI and AVX-512 VNNI intrinsics: GCC 11 and clang 12 on */
#if defined(__clang__) ? (__clang_major__ >= 12) : (defined(__GNUC__) && __GNUC__ >= 11)
#define SPEEDC_VNNI 1
#define SPEEDC_AMX 1  /* AMX intrinsics: the same compilers */
#include <unistd.h>
#include <sys/syscall.h>
#endif
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define SPEEDC_ARM 1
#endif

#define SUB 32          /* values per sub-block: one weight step each */
#define SUPER_MAX 8     /* sub-blocks per superblock (one activation scale and one weight unit each), see super_of */
#define STEP_LIMIT 2047 /* the largest |step|: a superblock's int32 lanes and 4-bit offset stay below 2^31 */
#define MAX_THREADS 64

/* The paths (runtimes/kernels/native.py PATHS names them). */
enum { PATH_AUTO = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX_VNNI = 3, PATH_AVX512_VNNI = 4, PATH_VNNI_STANDIN = 5,
       PATH_DOTPROD = 6, PATH_I8MM = 7, PATH_AMX = 8, PATH_AMX_STANDIN = 9, PATH_COUNT = 10 };

/* The paths that read the lanes16 layout (block_product_lanes.h): the weight repacked at load. */
static inline int lanes_layout(int path) { return path == PATH_AVX512_VNNI || path == PATH_AMX || path == PATH_AMX_STANDIN; }

/* One call's operands. Activations, rows padded with zeros to whole superblocks:
   q   [m, supers * 32 * super] bytes  4-bit weights: q + 128 as uint8 (x86) or q as int8 (Arm, portable),
                                each group of G sub-blocks j .. j + G - 1 as [j's even values | ... | j + G - 1's
                                even | j's odd | ... | j + G - 1's odd] (16 bytes each: the order in which one
                                load of their 16 G code bytes unpacks, low nibbles then high nibbles; G = 2 on
                                avx2 / avx-vnni, 1 on Arm, group_of); 8-bit: q as int8, in order; lanes16
                                paths: their own order (block_product_lanes.h)
   dx  [m, supers] float
   The prepared weight (speedc_block_prepare): steps [n, supers * super] int16 (0 past the row), units
   [n, supers] float, offsets [n, supers] int32 (4 bits: 128 * sum of step * (code - zp) over the
   superblock, what q + 128 adds; else 0). */
typedef struct {
    int64_t m, n, k, blocks, sub_blocks, supers;
    int block_size, bits, path, group;
    const uint8_t *codes;
    const int16_t *steps;
    const float *units;
    const int32_t *offsets;
    const uint8_t *q;
    const int16_t *qs;  /* lanes16 only: [m, supers * super] each sub-block's sum of q */
    const float *dx;
    float *y;
} product_t;

/* Sub-blocks per superblock. 4 bits: 8 (256 values); their products' error is the weights' (about 16x
   the activations' at 256), so the longest superblock, the fewest float steps. 8 bits: 2 (64 values),
   where the activations' rounding would otherwise exceed the weights' (measured: 0.59% against 0.70% of
   a product's RMS at 256 values, 0.94% against 1.67% with an outlier channel). */
static inline int super_of(int bits) { return bits == 4 ? SUPER_MAX : 2; }

/* The codes of sub-block B of feature N. */
static inline const uint8_t *sub_block_codes(const product_t *p, int64_t n, int64_t b) {
    return p->codes + (n * p->blocks) * (p->block_size * p->bits / 8) + b * (SUB * p->bits / 8);
}

/* Superblock S's codes of feature N; the last superblock of a row that does not fill it is copied into
   TAIL with zero weights (whose step is 0) past the row, so a vector path reads whole superblocks. */
static inline const uint8_t *superblock_codes(const product_t *p, int64_t n, int64_t s, int bits, uint8_t *tail) {
    const int super = super_of(bits), sub_bytes = SUB * bits / 8;
    const uint8_t *codes = sub_block_codes(p, n, s * super);
    if (s < p->sub_blocks / super) return codes;
    memset(tail, bits == 4 ? 0x88 : 0x80, SUPER_MAX * SUB);
    memcpy(tail, codes, (size_t)(p->sub_blocks - s * super) * sub_bytes);
    return tail;
}

/* ---------------------------------------------------------------- activations */

/* Sub-blocks per 4-bit activation group on PATH (see product_t), and whether its 4-bit activations are
   stored as q + 128 (unsigned, for x86's u8 x s8 products) or as q. */
static inline int group_of(int path) { return path == PATH_DOTPROD || path == PATH_I8MM ? 1 : 2; }
static inline int shifted_q4(int path) { return path != PATH_PORTABLE && path != PATH_DOTPROD && path != PATH_I8MM; }

/* Where value I of sub-block B of a superblock sits in its 4-bit activation bytes, groups of G (see product_t). */
static inline int q4_index(int b, int i, int g) { return (b / g) * g * SUB + (i & 1) * g * (SUB / 2) + (b % g) * (SUB / 2) + i / 2; }

/* Where value I of a 4-bit sub-block sits in the lanes16 paths' activations (block_product_lanes.h). */
static inline int lanes_q4_index(int i) { return 8 * (i / 8) + 4 * (i & 1) + (i % 8) / 2; }

/* A superblock's activations X [count] as integers: the largest |x| (returned), and V [values] = rint(x * 127 /
   largest) (nearbyintf's rounding, to nearest, ties to even), 0 past COUNT. One result on every CPU: the AVX2
   form does the same float multiply and rounds as the scalar one. */
static float superblock_codes_scalar(const float *x, int64_t count, int values, int32_t *v) {
    float largest = 0.0f;
    for (int64_t i = 0; i < count; i++) {
        const float a = fabsf(x[i]);
        largest = a > largest ? a : largest;  /* a NaN counts as none */
    }
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    for (int i = 0; i < values; i++) v[i] = i < count ? (int32_t)nearbyintf(x[i] * inverse) : 0;
    return largest;
}

#ifdef SPEEDC_X86
static __attribute__((target("avx2"))) float superblock_codes_avx2(const float *x, int64_t count, int values, int32_t *v) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), top);  /* NaN: top kept */
    float lane[8], largest = 0.0f;
    _mm256_storeu_ps(lane, top);
    for (int l = 0; l < 8; l++) largest = lane[l] > largest ? lane[l] : largest;
    for (; i < count; i++) largest = fabsf(x[i]) > largest ? fabsf(x[i]) : largest;
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    const __m256 scale = _mm256_set1_ps(inverse);
    for (i = 0; i + 8 <= count; i += 8)  /* the rounding mode's rint: to nearest, ties to even */
        _mm256_storeu_si256((__m256i *)(v + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale)));
    for (; i < values; i++) v[i] = i < count ? (int32_t)nearbyintf(x[i] * inverse) : 0;
    return largest;
}
#endif

/* The activations X [m, k] as int8 per superblock into Q (the path's order, see product_t) and DX; QS:
   each sub-block's sum of q (lanes16 paths, else NULL). */
static void quantize_rows(const float *x, const product_t *p, uint8_t *q, int16_t *qs, float *dx) {
    const int super = super_of(p->bits), values = SUB * super, shift = shifted_q4(p->path) ? 128 : 0;
    const int64_t width = p->supers * values;
    float (*codes_of)(const float *, int64_t, int, int32_t *) = superblock_codes_scalar;
#ifdef SPEEDC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) codes_of = superblock_codes_avx2;
#endif
    int32_t v[SUPER_MAX * SUB];
    for (int64_t r = 0; r < p->m; r++) {
        const float *row = x + r * p->k;
        for (int64_t s = 0; s < p->supers; s++) {
            const int64_t start = s * values;
            const float largest = codes_of(row + start, p->k - start < values ? p->k - start : values, values, v);
            uint8_t *out = q + r * width + start;
            for (int b = 0; b < super; b++) {
                int sum = 0;
                for (int i = 0; i < SUB; i++) {
                    const int c = v[b * SUB + i];
                    sum += c;
                    if (qs) out[b * SUB + (p->bits == 4 ? lanes_q4_index(i) : i)] = (uint8_t)(int8_t)c;
                    else if (p->bits == 4) out[q4_index(b, i, p->group)] = (uint8_t)(c + shift);
                    else out[b * SUB + i] = (uint8_t)(int8_t)c;
                }
                if (qs) qs[r * p->supers * super + s * super + b] = (int16_t)sum;  /* |sum| <= 32 x 127 */
            }
            dx[r * p->supers + s] = largest / 127.0f;
        }
    }
}

/* ---------------------------------------------------------------- the prepared weight */

typedef struct {
    const uint8_t *codes;
    const float *scales;
    int64_t n, blocks, sub_blocks, supers;
    int block_size, bits, scale_shift;
    int16_t *steps;
    float *units;
    int32_t *offsets;
    uint8_t *packed;  /* lanes16: the repacked codes */
} prepare_t;

/* The steps of superblock S of feature N (SUPER of them) and its unit, as every layout stores them:
   unit = largest |scale| / STEP_LIMIT, step = rint(scale / unit) (0 past the row). */
static void superblock_steps(const prepare_t *w, int64_t n, int64_t s, int16_t *steps, float *unit_out) {
    const int super = super_of(w->bits);
    float scale[SUPER_MAX], largest = 0.0f;
    for (int j = 0; j < super; j++) {
        const int64_t b = s * super + j;
        scale[j] = b < w->sub_blocks ? w->scales[n * w->blocks + (b >> w->scale_shift)] : 0.0f;
        if (fabsf(scale[j]) > largest) largest = fabsf(scale[j]);  /* a NaN scale counts as none */
    }
    const float unit = largest / (float)STEP_LIMIT;
    for (int j = 0; j < super; j++) {
        float step = unit > 0.0f ? nearbyintf(scale[j] / unit) : 0.0f;
        step = step > STEP_LIMIT ? STEP_LIMIT : (step < -STEP_LIMIT ? -STEP_LIMIT : (step == step ? step : 0.0f));
        steps[j] = (int16_t)step;
    }
    *unit_out = unit > 0.0f ? unit : 0.0f;
}

static void prepare_part(const void *job, int part, int parts) {
    const prepare_t *w = job;
    const int64_t n0 = w->n * part / parts, n1 = w->n * (part + 1) / parts;
    const int64_t row_bytes = w->blocks * (w->block_size * w->bits / 8), sub_bytes = SUB * w->bits / 8;
    const int super = super_of(w->bits);
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t s = 0; s < w->supers; s++) {
            int16_t *steps = w->steps + (n * w->supers + s) * super;
            superblock_steps(w, n, s, steps, w->units + n * w->supers + s);
            int64_t offset = 0;
            for (int j = 0; w->bits == 4 && j < super; j++) {
                if (!steps[j]) continue;
                const uint8_t *c = w->codes + n * row_bytes + (s * super + j) * sub_bytes;
                int32_t sum = 0;
                for (int i = 0; i < SUB / 2; i++) sum += (c[i] & 15) + (c[i] >> 4) - 16;
                offset += (int64_t)steps[j] * sum;
            }
            w->offsets[n * w->supers + s] = (int32_t)(128 * offset);  /* |.| <= 128 * 8 * 2047 * 256 < 2^31 */
        }
    }
}

/* ---------------------------------------------------------------- portable path */

/* Row-invariant on its own: each row sums each superblock exactly in integers, then one float
   multiply-add per superblock, in order. */
static void features_portable(const product_t *p, int64_t n0, int64_t n1) {
    const int zp = 1 << (p->bits - 1), super = super_of(p->bits);
    const int64_t width = p->supers * SUB * super;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < p->m; r++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < p->supers; s++) {
                int64_t total = 0;
                for (int j = 0; j < super && s * super + j < p->sub_blocks; j++) {
                    const int64_t b = s * super + j;
                    const int step = p->steps[(n * p->supers + s) * super + j];
                    if (!step) continue;
                    const uint8_t *c = sub_block_codes(p, n, b);
                    const uint8_t *q = p->q + r * width + s * SUB * super;
                    int32_t dot = 0;
                    if (p->bits == 4) {
                        for (int i = 0; i < SUB / 2; i++) {
                            dot += ((int32_t)(c[i] & 15) - zp) * (int8_t)q[q4_index(j, 2 * i, p->group)];
                            dot += ((int32_t)(c[i] >> 4) - zp) * (int8_t)q[q4_index(j, 2 * i + 1, p->group)];
                        }
                    } else {
                        for (int i = 0; i < SUB; i++) dot += ((int32_t)c[i] - zp) * (int8_t)q[j * SUB + i];
                    }
                    total += (int64_t)step * dot;
                }
                const float scale = p->units[n * p->supers + s] * p->dx[r * p->supers + s];
                acc = fmaf((float)total, scale, acc);
            }
            p->y[r * p->n + n] = acc;
        }
    }
}

/* ---------------------------------------------------------------- vector paths */
#ifdef SPEEDC_X86
#include "block_product_x86.h"
#include "block_product_lanes.h"
#endif
#ifdef SPEEDC_ARM
#include "block_product_arm.h"
#endif
#include "half_product.h"

/* ---------------------------------------------------------------- threads */

/* A small pool of persistent workers: a call hands each worker a range of output features. Workers stay
   ready for 200 us after a call (the next product of a step follows within microseconds), yielding
   their core meanwhile to ONNX Runtime's threads (which run the rest of the graph), then sleep. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;
    atomic_long generation;
    atomic_int pending;
    void (*run)(const void *job, int part, int parts);
    const void *job;
    int parts;
    pthread_t threads[MAX_THREADS];
    long born[MAX_THREADS];
} pool_t;

static pool_t pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_start = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time uses the pool */

static void product_part(const void *job, int part, int parts) {
    const product_t *p = job;
    const int64_t n0 = p->n * part / parts, n1 = p->n * (part + 1) / parts;
#ifdef SPEEDC_X86
    if (lanes_layout(p->path)) {  /* whole groups of 16 features a part */
        const int64_t groups = lanes_groups(p->n), g0 = groups * part / parts, g1 = groups * (part + 1) / parts;
        if (p->path == PATH_AMX_STANDIN) groups_amx_standin(p, g0, g1);
#ifdef SPEEDC_AMX
        else if (p->path == PATH_AMX && p->m >= amx_min_rows(p->bits)) groups_amx(p, g0, g1);
        else groups_avx512_vnni(p, g0, g1);  /* amx's single rows too: the same bits */
#endif
        return;
    }
#endif
    switch (p->path) {
#ifdef SPEEDC_X86
        case PATH_AVX2: features_avx2(p, n0, n1); break;
        case PATH_VNNI_STANDIN: features_vnni_standin(p, n0, n1); break;
#ifdef SPEEDC_VNNI
        case PATH_AVX_VNNI: features_avx_vnni(p, n0, n1); break;
#endif
#endif
#ifdef SPEEDC_ARM
        case PATH_DOTPROD: features_dotprod(p, n0, n1); break;
        case PATH_I8MM: features_i8mm(p, n0, n1); break;
#endif
        default: features_portable(p, n0, n1); break;
    }
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;  /* part index - 1 */
    long seen = pool.born[index];  /* the generation before the call that started it */
    for (;;) {
        const double until = seconds() + 200e-6;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen && seconds() < until) {
            sched_yield();  /* ready at once, yet the core goes to whoever needs it (ONNX Runtime's own workers) */
        }
        if (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        if (index + 1 < pool.parts) {
            pool.run(pool.job, index + 1, pool.parts);
        }
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

static void forget_workers(void) { pool.workers = 0; }  /* a forked child has none of the parent's threads */

static int ensure_workers(int wanted) {
    static int registered = 0;
    if (!registered) { pthread_atfork(NULL, NULL, forget_workers); registered = 1; }
    while (pool.workers < wanted && pool.workers < MAX_THREADS) {
        pool.born[pool.workers] = atomic_load(&pool.generation);
        if (pthread_create(&pool.threads[pool.workers], NULL, worker, (void *)(intptr_t)pool.workers) != 0) break;
        pthread_detach(pool.threads[pool.workers]);
        pool.workers++;
    }
    return pool.workers;
}

/* RUN(JOB, part, parts) for parts 0 .. parts - 1 on up to THREADS threads (the caller's one of them). */
static void run_parallel(void (*run)(const void *, int, int), const void *job, int threads) {
    threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (threads == 1) { run(job, 0, 1); return; }
    pthread_mutex_lock(&pool_start);
    const int workers = ensure_workers(threads - 1);
    const int parts = workers + 1 < threads ? workers + 1 : threads;
    pool.run = run;
    pool.job = job;
    pool.parts = parts;
    atomic_store(&pool.pending, workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run(job, 0, parts);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) {
#ifdef SPEEDC_X86
        _mm_pause();
#endif
    }
    pthread_mutex_unlock(&pool_start);
}

/* ---------------------------------------------------------------- entry points */

/* The paths this CPU runs, a bit per PATH_* (portable everywhere). */
unsigned speedc_block_product_paths(void) {
    static unsigned found = 0;
    if (!found) {
        unsigned paths = 1u << PATH_PORTABLE;
#ifdef SPEEDC_X86
        paths |= x86_paths();
#endif
#ifdef SPEEDC_ARM
        paths |= arm_paths();
#endif
        found = paths;
    }
    return found;
}

/* The path PATH_AUTO takes on this CPU: the widest int8 dot products it has. */
int speedc_block_product_path(void) {
    static const int preferred[] = {PATH_AMX, PATH_AVX512_VNNI, PATH_AVX_VNNI, PATH_AVX2, PATH_I8MM, PATH_DOTPROD};
    const unsigned paths = speedc_block_product_paths();
    for (size_t i = 0; i < sizeof preferred / sizeof preferred[0]; i++) {
        if (paths & 1u << preferred[i]) return preferred[i];
    }
    return PATH_PORTABLE;
}

/* The shape checks both entry points make: 0, or -1 bits not 4 / 8, -2 block size not 32 times a power
   of two up to 4096 (or blocks too few for k). Sets *SHIFT to log2(block_size / 32). */
static int check_shape(int64_t k, int64_t blocks, int block_size, int bits, int *shift) {
    if (bits != 4 && bits != 8) return -1;
    if (block_size < SUB || block_size > 4096 || blocks * block_size < k) return -2;
    *shift = 0;
    while ((SUB << *shift) < block_size) (*shift)++;
    return (SUB << *shift) == block_size ? 0 : -2;
}

/* Superblocks per row of K values at BITS. */
static int64_t supers_of(int64_t k, int bits) { return (k + SUB * super_of(bits) - 1) / (SUB * super_of(bits)); }

/* The sizes of one weight's prepared form on PATH: SIZES = {packed code bytes (0: the codes are read in
   place), steps (int16), units (float), offsets (int32)}. */
void speedc_block_prepared_sizes(int64_t n, int64_t k, int bits, int path, int64_t *sizes) {
    const int64_t supers = supers_of(k, bits), super = super_of(bits);
    if (path == PATH_AUTO) path = speedc_block_product_path();
#ifdef SPEEDC_X86
    if (lanes_layout(path)) {
        const int64_t padded = lanes_groups(n) * LANES;
        sizes[0] = lanes_groups(n) * supers * super * lanes_chunk(bits);
        sizes[1] = padded * supers * super;
        sizes[2] = padded * supers;
        sizes[3] = 0;
        return;
    }
#endif
    sizes[0] = 0;
    sizes[1] = n * supers * super;
    sizes[2] = sizes[3] = n * supers;
}

/* The prepared form of one weight (see the top of this file and block_product_lanes.h) for PATH, once
   before its products, into arrays of speedc_block_prepared_sizes: STEPS, UNITS, OFFSETS and, for a
   lanes16 path, the repacked codes PACKED. Returns 0 or check_shape's codes, -3 a path this CPU lacks. */
int speedc_block_prepare(const uint8_t *codes, const float *scales, int64_t n, int64_t k, int64_t blocks,
                         int block_size, int bits, int path, uint8_t *packed, int16_t *steps, float *units,
                         int32_t *offsets, int threads) {
    int shift;
    const int bad = check_shape(k, blocks, block_size, bits, &shift);
    if (bad) return bad;
    if (path == PATH_AUTO) path = speedc_block_product_path();
    if (path <= PATH_AUTO || path >= PATH_COUNT || !(speedc_block_product_paths() & 1u << path)) return -3;
    prepare_t w = {codes, scales, n, blocks, (k + SUB - 1) / SUB, supers_of(k, bits), block_size, bits, shift,
                   steps, units, offsets, packed};
    if (n <= 0) return 0;
#ifdef SPEEDC_X86
    if (lanes_layout(path)) { run_parallel(prepare_lanes_part, &w, threads); return 0; }
#endif
    run_parallel(prepare_part, &w, threads);
    return 0;
}

/* y [m, n] = x [m, k] . W^T over a prepared weight (CODES: its codes, or the packed ones on a lanes16
   path; its steps, units and offsets), see the top of this file. Returns 0, or a negative number for
   arguments it does not take: check_shape's, -3 a path this CPU lacks, -4 no memory. */
int speedc_block_product(const float *x, int64_t m, int64_t k, const uint8_t *codes, const int16_t *steps,
                         const float *units, const int32_t *offsets, int64_t n, int64_t blocks, int block_size,
                         int bits, float *y, int threads, int path) {
    int shift;
    const int bad = check_shape(k, blocks, block_size, bits, &shift);
    if (bad) return bad;
    if (path == PATH_AUTO) path = speedc_block_product_path();
    if (path <= PATH_AUTO || path >= PATH_COUNT || !(speedc_block_product_paths() & 1u << path)) return -3;
    if (m <= 0 || n <= 0) return 0;
    product_t p = {0};
    p.m = m; p.n = n; p.k = k; p.blocks = blocks; p.block_size = block_size; p.bits = bits; p.path = path;
    p.group = group_of(path);
    p.sub_blocks = (k + SUB - 1) / SUB;
    p.supers = supers_of(k, bits);
    p.codes = codes; p.steps = steps; p.units = units; p.offsets = offsets; p.y = y;
    /* per-thread scratch, kept between calls: a step's products reuse it */
    static __thread uint8_t *q_buf = NULL;
    static __thread float *dx_buf = NULL;
    static __thread int16_t *qs_buf = NULL;
    static __thread int64_t q_capacity = 0, dx_capacity = 0, qs_capacity = 0;
    const int lanes = lanes_layout(path);
    const int64_t width = p.supers * SUB * super_of(bits);
    const int64_t padded_rows = lanes && m > 16 ? (m + 15) / 16 * 16 : m;  /* whole tiles of rows */
    const int64_t q_need = padded_rows * width, dx_need = m * p.supers, qs_need = lanes ? m * p.supers * super_of(bits) : 1;
    if (q_need > q_capacity) {
        free(q_buf);
        q_buf = malloc((size_t)q_need);
        q_capacity = q_buf ? q_need : 0;
    }
    if (dx_need > dx_capacity) {
        free(dx_buf);
        dx_buf = malloc((size_t)dx_need * sizeof(float));
        dx_capacity = dx_buf ? dx_need : 0;
    }
    if (qs_need > qs_capacity) {
        free(qs_buf);
        qs_buf = malloc((size_t)qs_need * sizeof(int16_t));
        qs_capacity = qs_buf ? qs_need : 0;
    }
    if (!q_buf || !dx_buf || !qs_buf) return -4;
    quantize_rows(x, &p, q_buf, lanes ? qs_buf : NULL, dx_buf);
    memset(q_buf + m * width, 0, (size_t)((padded_rows - m) * width));  /* a tile's rows past m */
    p.q = q_buf; p.dx = dx_buf; p.qs = qs_buf;
    run_parallel(product_part, &p, m * n >= 2048 ? threads : 1);  /* tiny products: not worth a wake-up */
    return 0;
}

/* y [m, n] = x [m, k] . W^T over 16-bit weights W [n, k] (DTYPE 0: bfloat16, 1: float16) read in place,
   see half_product.h; PATH a block-product path (its width). Returns 0, -1 a dtype it does not take, -3
   a path this CPU lacks. */
int speedc_half_product(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int dtype, float *y,
                        int threads, int path) {
    if (dtype != HALF_BF16 && dtype != HALF_FP16) return -1;
    if (path == PATH_AUTO) path = speedc_block_product_path();
    if (path <= PATH_AUTO || path >= PATH_COUNT || !(speedc_block_product_paths() & 1u << path)) return -3;
    if (m <= 0 || n <= 0) return 0;
    const half_t h = {m, n, k, dtype, x, w, y};
    const half_job_t job = {&h, half_width(path)};
    run_parallel(half_part, &job, m * n >= 2048 ? threads : 1);  /* tiny products: not worth a wake-up */
    return 0;
}

#include "attention.h"

#define ATTN_PARALLEL_READS (1 << 16)  /* cache values a call reads before it takes the other threads */

/* out [rows, chunk, heads * hd] = attention of packed QKV [rows, chunk, (heads + 2 kv_heads) * hd] over the
   cache K_CACHE / V_CACHE (KV_DTYPE: 0 float32, 1 float16, 2 int8 in blocks of 32 (attention.h kv_row_bytes);
   CACHE_ROWS rows of ROW_STRIDE bytes, row r's at ROW_OF[r], each kv head of HEAD_STRIDE bytes, POSITIONS
   positions of kv_row_bytes each), row r's tokens at POS[r] + i for i < LEN[r], written there
   first; see attention.h. COS / SIN [TABLE_POSITIONS, hd / 2]. Returns 0, or -1 a head layout it does not
   take, -2 a row or position past the cache or the tables, -3 a path this CPU lacks, -4 no memory. */
int speedc_attention(const float *qkv, int64_t rows, int64_t chunk, int heads, int kv_heads, int hd,
                     const int64_t *row_of, const int64_t *pos, const int64_t *len, void *k_cache, void *v_cache,
                     int kv_dtype, int64_t cache_rows, int64_t row_stride, int64_t head_stride, int64_t positions, const float *cos,
                     const float *sin, int64_t table_positions, float scale, float *out, int threads, int path) {
    if (heads < 1 || kv_heads < 1 || heads % kv_heads || hd < 8 || hd % ATTN_LANES || hd > ATTN_MAX_HEAD_DIM
        || kv_dtype < KV_FP32 || kv_dtype > KV_INT8 || (kv_dtype == KV_INT8 && hd % KV_BLOCK) || chunk < 1) return -1;
    if (path == PATH_AUTO) path = speedc_block_product_path();
    if (path <= PATH_AUTO || path >= PATH_COUNT || !(speedc_block_product_paths() & 1u << path)) return -3;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t end = pos[r] + (len[r] < chunk ? len[r] : chunk);
        if (pos[r] < 0 || len[r] < 0 || end > positions || end > table_positions || row_of[r] < 0 || row_of[r] >= cache_rows) return -2;
    }
    if (rows <= 0) return 0;
    attention_t a = {qkv, rows, chunk, heads, kv_heads, hd, kv_dtype, attention_wide(path, hd), kv_row_bytes(hd, kv_dtype), row_of, pos, len,
                     k_cache, v_cache, row_stride, head_stride, cos, sin, scale, out, 0};
    int64_t reads = 0;  /* cache positions read, over the rows' tokens: a short call is not worth a wake-up */
    for (int64_t r = 0; r < rows; r++) reads += (len[r] < chunk ? len[r] : chunk) * (pos[r] + 1);
    run_parallel(attention_part, &a, reads * kv_heads * hd >= ATTN_PARALLEL_READS ? threads : 1);
    return atomic_load(&a.failed) ? -4 : 0;
}
