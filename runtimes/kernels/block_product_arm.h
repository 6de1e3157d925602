/* block_product.c's Arm paths: dotprod (sdot) and i8mm (smmla). Activations are int8 q (4 bits: per
   sub-block [even values | odd values], the order one 16-byte load of its codes unpacks), weights signed
   code - zp, so no offset. Each superblock's sum is one exact int32 (|sum| <= 256 x 8 x 127 x 2047 at 4
   bits, 64 x 128 x 127 x 2047 at 8 bits, both below 2^31), scaled as the portable path scales it
   (fmaf(sum, unit x dx, acc)): the bits are the portable path's whatever the row count. */

#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#ifdef __clang__
#define TARGET_DOTPROD __attribute__((target("dotprod")))
#define TARGET_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define TARGET_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif

/* Sub-block J's 32 signed weights as two int8x16: 4 bits [even | odd] values, 8 bits in order. */
static inline void sub_block_weights(const uint8_t *codes, int j, int bits, int8x16_t *first, int8x16_t *second) {
    if (bits == 4) {
        const uint8x16_t c = vld1q_u8(codes + j * 16);
        *first = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(c, vdupq_n_u8(15))), vdupq_n_s8(8));
        *second = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(c, 4)), vdupq_n_s8(8));
    } else {
        *first = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + j * SUB), vdupq_n_u8(0x80)));
        *second = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + j * SUB + 16), vdupq_n_u8(0x80)));
    }
}

/* dotprod: rows R0 .. R0 + ROWS - 1 of feature N; per sub-block two sdot into 4 lanes and one
   multiply-add by its step, one lane sum per superblock. */
static inline __attribute__((always_inline)) TARGET_DOTPROD
void feature_rows_dotprod(const product_t *p, int64_t n, int64_t r0, const int rows, const int bits) {
    const int super = super_of(bits);
    const int64_t width = p->supers * SUB * super;
    const int16_t *steps = p->steps + n * p->supers * super;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint8_t tail[SUPER_MAX * SUB];
    for (int64_t s = 0; s < p->supers; s++) {
        const uint8_t *codes = superblock_codes(p, n, s, bits, tail);
        int32x4_t lanes[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int j = 0; j < super; j++) {
            int8x16_t w0, w1;
            sub_block_weights(codes, j, bits, &w0, &w1);
            const int32_t step = steps[s * super + j];
            for (int i = 0; i < rows; i++) {
                const int8_t *x = (const int8_t *)p->q + (r0 + i) * width + (s * super + j) * SUB;
                const int32x4_t d = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(x), w0), vld1q_s8(x + 16), w1);
                lanes[i] = vmlaq_n_s32(lanes[i], d, step);
            }
        }
        for (int i = 0; i < rows; i++) {
            const float scale = p->units[n * p->supers + s] * p->dx[(r0 + i) * p->supers + s];
            acc[i] = fmaf((float)vaddvq_s32(lanes[i]), scale, acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) p->y[(r0 + i) * p->n + n] = acc[i];
}

static TARGET_DOTPROD void features_dotprod(const product_t *p, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < p->m; r += 4) {
            switch (p->m - r < 4 ? p->m - r : 4) {  /* each case its own unrolled copy */
                case 4: feature_rows_dotprod(p, n, r, 4, p->bits); break;
                case 3: feature_rows_dotprod(p, n, r, 3, p->bits); break;
                case 2: feature_rows_dotprod(p, n, r, 2, p->bits); break;
                default: feature_rows_dotprod(p, n, r, 1, p->bits); break;
            }
        }
    }
}

/* i8mm: features NA, NB and rows RA, RB as one 2 x 2 tile (NB == NA or RB == RA where a pair is short).
   smmla multiplies rows [a0 | a1] (8 values each) by columns [b0 | b1] into [a0.b0, a0.b1, a1.b0, a1.b1]:
   per sub-block the rows' and features' 8-value pieces are zipped in 64-bit halves, 4 smmla sum its 32
   values, one multiply-add by [step_a, step_b, step_a, step_b] scales them. */
static inline __attribute__((always_inline)) TARGET_I8MM
void tile_i8mm(const product_t *p, int64_t na, int64_t nb, int64_t ra, int64_t rb, const int bits) {
    const int super = super_of(bits);
    const int64_t width = p->supers * SUB * super;
    const int16_t *steps_a = p->steps + na * p->supers * super, *steps_b = p->steps + nb * p->supers * super;
    const int8_t *xa = (const int8_t *)p->q + ra * width, *xb = (const int8_t *)p->q + rb * width;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* [ra na, ra nb, rb na, rb nb] */
    uint8_t tail_a[SUPER_MAX * SUB], tail_b[SUPER_MAX * SUB];
    for (int64_t s = 0; s < p->supers; s++) {
        const uint8_t *codes_a = superblock_codes(p, na, s, bits, tail_a), *codes_b = superblock_codes(p, nb, s, bits, tail_b);
        int32x4_t sums = vdupq_n_s32(0);
        for (int j = 0; j < super; j++) {
            int8x16_t a0, a1, b0, b1;
            sub_block_weights(codes_a, j, bits, &a0, &a1);
            sub_block_weights(codes_b, j, bits, &b0, &b1);
            const int64_t at = (s * super + j) * SUB;
            const int64x2_t x0 = vreinterpretq_s64_s8(vld1q_s8(xa + at)), x1 = vreinterpretq_s64_s8(vld1q_s8(xa + at + 16));
            const int64x2_t y0 = vreinterpretq_s64_s8(vld1q_s8(xb + at)), y1 = vreinterpretq_s64_s8(vld1q_s8(xb + at + 16));
            const int64x2_t wa0 = vreinterpretq_s64_s8(a0), wa1 = vreinterpretq_s64_s8(a1);
            const int64x2_t wb0 = vreinterpretq_s64_s8(b0), wb1 = vreinterpretq_s64_s8(b1);
            int32x4_t t = vdupq_n_s32(0);
            t = vmmlaq_s32(t, vreinterpretq_s8_s64(vzip1q_s64(x0, y0)), vreinterpretq_s8_s64(vzip1q_s64(wa0, wb0)));
            t = vmmlaq_s32(t, vreinterpretq_s8_s64(vzip2q_s64(x0, y0)), vreinterpretq_s8_s64(vzip2q_s64(wa0, wb0)));
            t = vmmlaq_s32(t, vreinterpretq_s8_s64(vzip1q_s64(x1, y1)), vreinterpretq_s8_s64(vzip1q_s64(wa1, wb1)));
            t = vmmlaq_s32(t, vreinterpretq_s8_s64(vzip2q_s64(x1, y1)), vreinterpretq_s8_s64(vzip2q_s64(wa1, wb1)));
            const int32_t sa = steps_a[s * super + j], sb = steps_b[s * super + j];
            const int32x4_t tile_steps = {sa, sb, sa, sb};
            sums = vmlaq_s32(sums, t, tile_steps);
        }
        const float ua = p->units[na * p->supers + s], ub = p->units[nb * p->supers + s];
        const float da = p->dx[ra * p->supers + s], db = p->dx[rb * p->supers + s];
        acc[0] = fmaf((float)vgetq_lane_s32(sums, 0), ua * da, acc[0]);
        acc[1] = fmaf((float)vgetq_lane_s32(sums, 1), ub * da, acc[1]);
        acc[2] = fmaf((float)vgetq_lane_s32(sums, 2), ua * db, acc[2]);
        acc[3] = fmaf((float)vgetq_lane_s32(sums, 3), ub * db, acc[3]);
    }
    p->y[ra * p->n + na] = acc[0];
    p->y[ra * p->n + nb] = acc[1];
    p->y[rb * p->n + na] = acc[2];
    p->y[rb * p->n + nb] = acc[3];
}

/* A single row runs on sdot (a tile would spend half its products on a copy of the row); the bits are
   the same either way. */
static TARGET_I8MM void features_i8mm(const product_t *p, int64_t n0, int64_t n1) {
    if (p->m == 1) { features_dotprod(p, n0, n1); return; }
    for (int64_t n = n0; n < n1; n += 2) {
        const int64_t nb = n + 1 < n1 ? n + 1 : n;
        for (int64_t r = 0; r < p->m; r += 2) {
            const int64_t rb = r + 1 < p->m ? r + 1 : r;
            if (p->bits == 4) tile_i8mm(p, n, nb, r, rb, 4);
            else tile_i8mm(p, n, nb, r, rb, 8);
        }
    }
}

static int has_feature(unsigned long hwcap, unsigned long bit, const char *apple_name) {
#if defined(__linux__)
    (void)apple_name;
    return (getauxval(hwcap) & bit) != 0;
#elif defined(__APPLE__)
    (void)hwcap; (void)bit;
    int value = 0;
    size_t size = sizeof value;
    return sysctlbyname(apple_name, &value, &size, NULL, 0) == 0 && value != 0;
#else
    (void)hwcap; (void)bit; (void)apple_name;
    return 0;
#endif
}

/* The Arm paths this CPU runs (a bit per PATH_*): HWCAP_ASIMDDP (AT_HWCAP bit 20), HWCAP2_I8MM (AT_HWCAP2
   bit 13) on Linux, hw.optional.arm.FEAT_* on macOS. */
static unsigned arm_paths(void) {
#if defined(__linux__)
    const unsigned long hwcap = AT_HWCAP, hwcap2 = AT_HWCAP2;
#else
    const unsigned long hwcap = 0, hwcap2 = 0;
#endif
    unsigned paths = 0;
    if (has_feature(hwcap, 1ul << 20, "hw.optional.arm.FEAT_DotProd")) {
        paths |= 1u << PATH_DOTPROD;
        if (has_feature(hwcap2, 1ul << 13, "hw.optional.arm.FEAT_I8MM")) paths |= 1u << PATH_I8MM;
    }
    return paths;
}
