/* Runs speedc's block product kernel (runtimes/kernels/block_product.c, linked in) on operands a test
   wrote, on a CPU the test's Python cannot run on (Arm under qemu-aarch64; tests/numeric/test_block_product_arm.py):

       block_product_driver IN OUT PATH THREADS

   IN   int64 m, n, k, blocks; int32 block_size, bits; float x [m, k]; uint8 codes [n, blocks * block_size *
        bits / 8]; float scales [n, blocks]. Or bits 16: a 16-bit product (half_product.h), block_size its
        dtype (0 bf16, 1 fp16), then float x [m, k]; uint16 w [n, k]
   OUT  int32 the path PATH_AUTO takes; uint32 the paths this CPU runs (a bit each); float y [m, n] (all
        rows in one call); float y [m, n] (each row in a call of its own)
   Exit status: 0, or 1 with one line on stderr. */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int speedc_block_product_path(void);
unsigned speedc_block_product_paths(void);
void speedc_block_prepared_sizes(int64_t n, int64_t k, int bits, int path, int64_t *sizes);
int speedc_block_prepare(const uint8_t *codes, const float *scales, int64_t n, int64_t k, int64_t blocks, int block_size,
                         int bits, int path, uint8_t *packed, int16_t *steps, float *units, int32_t *offsets, int threads);
int speedc_half_product(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int dtype, float *y,
                        int threads, int path);
int speedc_block_product(const float *x, int64_t m, int64_t k, const uint8_t *codes, const int16_t *steps,
                         const float *units, const int32_t *offsets, int64_t n, int64_t blocks, int block_size, int bits,
                         float *y, int threads, int path);

static void *read_exactly(FILE *f, size_t size) {
    void *data = malloc(size ? size : 1);
    if (!data || fread(data, 1, size, f) != size) { fprintf(stderr, "driver: short input\n"); exit(1); }
    return data;
}

/* OUT: the path PATH_AUTO takes, the paths this CPU runs, then TOGETHER and ALONE (COUNT floats each). */
static int write_result(const char *name, const float *together, const float *alone, int64_t count) {
    FILE *out = fopen(name, "wb");
    const int32_t chosen = speedc_block_product_path();
    const uint32_t paths = speedc_block_product_paths();
    if (!out || fwrite(&chosen, sizeof chosen, 1, out) != 1 || fwrite(&paths, sizeof paths, 1, out) != 1
        || fwrite(together, sizeof(float), (size_t)count, out) != (size_t)count
        || fwrite(alone, sizeof(float), (size_t)count, out) != (size_t)count || fclose(out) != 0) {
        fprintf(stderr, "driver: cannot write %s\n", name);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: block_product_driver IN OUT PATH THREADS\n"); return 1; }
    FILE *in = fopen(argv[1], "rb");
    if (!in) { fprintf(stderr, "driver: cannot open %s\n", argv[1]); return 1; }
    int64_t *shape = read_exactly(in, 4 * sizeof(int64_t));
    int32_t *kind = read_exactly(in, 2 * sizeof(int32_t));
    const int64_t m = shape[0], n = shape[1], k = shape[2], blocks = shape[3];
    const int block_size = kind[0], bits = kind[1], path = atoi(argv[3]), threads = atoi(argv[4]);
    float *x = read_exactly(in, (size_t)(m * k) * sizeof(float));
    if (bits == 16) {  /* the 16-bit product: all rows in one call, then each alone */
        const uint16_t *w = read_exactly(in, (size_t)(n * k) * sizeof(uint16_t));
        fclose(in);
        float *together = malloc((size_t)(m * n) * sizeof(float) + 1), *alone = malloc((size_t)(m * n) * sizeof(float) + 1);
        int rc = speedc_half_product(x, m, k, w, n, block_size, together, threads, path);
        for (int64_t r = 0; r < m && !rc; r++) rc = speedc_half_product(x + r * k, 1, k, w, n, block_size, alone + r * n, threads, path);
        if (rc) { fprintf(stderr, "driver: the kernel refused its arguments (code %d)\n", rc); return 1; }
        return write_result(argv[2], together, alone, m * n);
    }
    uint8_t *codes = read_exactly(in, (size_t)(n * blocks * block_size * bits / 8));
    float *scales = read_exactly(in, (size_t)(n * blocks) * sizeof(float));
    fclose(in);

    int64_t sizes[4];  /* packed code bytes, steps, units, offsets */
    speedc_block_prepared_sizes(n, k, bits, path, sizes);
    uint8_t *packed = malloc((size_t)sizes[0] + 1);
    int16_t *steps = malloc((size_t)sizes[1] * sizeof(int16_t) + 1);
    float *units = malloc((size_t)sizes[2] * sizeof(float) + 1);
    int32_t *offsets = malloc((size_t)sizes[3] * sizeof(int32_t) + 1);
    float *together = malloc((size_t)(m * n) * sizeof(float)), *alone = malloc((size_t)(m * n) * sizeof(float));
    const uint8_t *read = sizes[0] ? packed : codes;  /* a lanes16 path reads its repacked codes */
    int rc = speedc_block_prepare(codes, scales, n, k, blocks, block_size, bits, path, packed, steps, units, offsets, threads);
    if (!rc) rc = speedc_block_product(x, m, k, read, steps, units, offsets, n, blocks, block_size, bits, together, threads, path);
    for (int64_t r = 0; r < m && !rc; r++) {
        rc = speedc_block_product(x + r * k, 1, k, read, steps, units, offsets, n, blocks, block_size, bits, alone + r * n,
                                  threads, path);
    }
    if (rc) { fprintf(stderr, "driver: the kernel refused its arguments (code %d)\n", rc); return 1; }

    return write_result(argv[2], together, alone, m * n);
}
