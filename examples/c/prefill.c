/* One causal prefill through the C ABI (include/mlx_native.h), as a C or C++ engine would
 * run it: the CPU device, a plan made on the shapes, one run on host arrays, and a check
 * against a float64 reference computed here (SPEC sections 2, 3 and 6).
 *
 *   cc -std=c11 -O2 -I include examples/c/prefill.c -L <dir of libmlx_native.so> -lmlx_native -lm
 *   ./a.out
 *
 * (On CUDA the same plan runs on device addresses, with a stream: mlxn_prefill_plan_run's
 * last argument.)
 * Exit status 0 when the result matches the reference (NMSE below 1e-5). */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mlx_native.h"

enum { ROWS = 100, KV = 150, HEADS = 4, KV_HEADS = 2, DIM = 256 };

/* IEEE half from float, rounded to nearest even (what the kernels' inputs are). */
static uint16_t half_of(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0));
    int ee = (int)e - 127 + 15;
    if (ee >= 31) return (uint16_t)(sign | 0x7c00u);
    if (ee <= 0) {
        if (ee < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - ee), half = m >> shift, rest = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)ee << 10) | (m >> 13), rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;
    return (uint16_t)half;
}

static double float_of_half(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}

static int fail(const char *what, int32_t status) {
    fprintf(stderr, "%s failed (status %d): %s\n", what, status, mlxn_last_error());
    return 1;
}

#define CHECK(call)                          \
    do {                                     \
        int32_t status_ = (call);            \
        if (status_ != 0) return fail(#call, status_); \
    } while (0)

int main(void) {
    const char *backend = "cpu";
    float *q = malloc(sizeof(float) * ROWS * HEADS * DIM);
    uint16_t *k = malloc(2 * KV * KV_HEADS * DIM), *v = malloc(2 * KV * KV_HEADS * DIM);
    float *out = malloc(sizeof(float) * ROWS * HEADS * DIM);
    float *lse = malloc(sizeof(float) * HEADS * ROWS);
    srand(1);
    for (int i = 0; i < ROWS * HEADS * DIM; ++i) q[i] = 2.0f * rand() / RAND_MAX - 1.0f;
    for (int i = 0; i < KV * KV_HEADS * DIM; ++i) {
        k[i] = half_of(2.0f * rand() / RAND_MAX - 1.0f);
        v[i] = half_of(2.0f * rand() / RAND_MAX - 1.0f);
    }
    const float scale = 1.0f / 16.0f; /* 1 / sqrt(DIM) */

    uint64_t dev;
    CHECK(mlxn_device_open(backend, &dev));

    /* q [ROWS, HEADS, DIM], k/v [KV, KV_HEADS, DIM], out like q, lse [HEADS, ROWS]; one
     * sequence whose prompt is the last ROWS rows of its cache, causal. */
    struct MlxnFlashAttnPrefillParams p;
    memset(&p, 0, sizeof p);
    p.q_strides[1] = HEADS * DIM;
    p.q_strides[2] = DIM;
    p.k_strides[1] = p.v_strides[1] = KV_HEADS * DIM;
    p.k_strides[2] = p.v_strides[2] = DIM;
    p.out_strides[1] = HEADS * DIM;
    p.out_strides[2] = DIM;
    p.lse_strides[1] = ROWS;
    p.batch = 1;
    p.rows = ROWS;
    p.kv_len = KV;
    p.n_heads = HEADS;
    p.n_kv_heads = KV_HEADS;
    p.head_dim = DIM;
    p.causal = 1;
    p.scale = scale;

    uint64_t plan;
    CHECK(mlxn_prefill_plan_new(dev, &p, 0 /* q F32 */, 1 /* k, v F16 */, 0 /* out F32 */, 0 /* mask */, 1 /* lse */,
                                0 /* sinks */, NULL, NULL, NULL /* no descale */, NULL /* run options: the library's */,
                                &plan));
    struct MlxnPrefillExtents e;
    CHECK(mlxn_prefill_plan_extents(plan, &e));
    if (e.q != (uint64_t)ROWS * HEADS * DIM || e.lse != (uint64_t)HEADS * ROWS) {
        fprintf(stderr, "unexpected extents: q %llu, lse %llu\n", (unsigned long long)e.q, (unsigned long long)e.lse);
        return 1;
    }
    CHECK(mlxn_prefill_plan_run(plan, (uint64_t)(uintptr_t)q, (uint64_t)(uintptr_t)k, (uint64_t)(uintptr_t)v, 0,
                                (uint64_t)(uintptr_t)out, (uint64_t)(uintptr_t)lse, 0 /* sinks */, 0 /* alibi_slopes */, 0, 0));
    /* A bad run: the plan has no mask, so a mask address is refused, and nothing is written. */
    if (mlxn_prefill_plan_run(plan, (uint64_t)(uintptr_t)q, (uint64_t)(uintptr_t)k, (uint64_t)(uintptr_t)v,
                              (uint64_t)(uintptr_t)k, (uint64_t)(uintptr_t)out, (uint64_t)(uintptr_t)lse, 0, 0, 0, 0) != 6) {
        fprintf(stderr, "a mask given to a plan without one was not refused\n");
        return 1;
    }

    /* The float64 reference: half(scale * q), causal with the prompt at the end of the cache. */
    double num = 0, den = 0, lse_err = 0;
    const int group = HEADS / KV_HEADS, off = KV - ROWS;
    static double s[KV];
    for (int r = 0; r < ROWS; ++r) {
        for (int h = 0; h < HEADS; ++h) {
            const int g = h / group, last = r + off;
            double m = -INFINITY;
            for (int j = 0; j <= last; ++j) {
                double acc = 0;
                for (int d = 0; d < DIM; ++d)
                    acc += float_of_half(half_of(scale * q[(r * HEADS + h) * DIM + d])) *
                           float_of_half(k[(j * KV_HEADS + g) * DIM + d]);
                s[j] = acc;
                if (acc > m) m = acc;
            }
            double sum = 0;
            for (int j = 0; j <= last; ++j) sum += exp(s[j] - m);
            for (int d = 0; d < DIM; ++d) {
                double o = 0;
                for (int j = 0; j <= last; ++j) o += exp(s[j] - m) * float_of_half(v[(j * KV_HEADS + g) * DIM + d]);
                o /= sum;
                const double got = out[(r * HEADS + h) * DIM + d];
                num += (got - o) * (got - o);
                den += o * o;
            }
            const double ref_lse = m + log(sum);
            const double el = fabs(lse[h * ROWS + r] - ref_lse);
            if (el > lse_err) lse_err = el;
        }
    }
    const double nmse = num / den;
    printf("prefill on %s: %d rows x %d heads, cache %d, causal; NMSE %.3e, worst lse error %.3e\n", backend, ROWS,
           HEADS, KV, nmse, lse_err);
    CHECK(mlxn_prefill_plan_free(plan));
    CHECK(mlxn_device_close(dev));
    free(q);
    free(k);
    free(v);
    free(out);
    free(lse);
    return (nmse < 1e-5 && lse_err < 2e-3) ? 0 : 1;
}
