// Does vector work run alongside the AMX tile unit on one core? A measurement, not part of
// the library (issue 26; docs/benchmarks.md, "The CPU on AMX tiles: the P V product over
// several steps, and the softmax between other tiles' products"). Each iteration: mode 0
// four tile loads and four TDPBF16PS; mode 1 K vector steps; mode 2 both, in that order.
// Where mode 2's time is the larger of modes 0 and 1 the vector work is hidden; where it is
// their sum, nothing overlaps. Two kinds of vector step: "regs", FMAs on four independent
// chains in registers; "mem", a load, three operations and a half store, as the softmax
// does (its stores are what the tile loads wait behind).
//
//   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -o /tmp/amx_overlap scripts/amx_overlap.c && /tmp/amx_overlap
//
// Linux only (the tile state must be asked for); a CPU without AMX dies on the first tile
// instruction.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for an extended state component */
#define XFEATURE_XTILEDATA 18      /* the tiles' data */
#define ITERS 1000000

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static uint16_t ab[4][16 * 32] __attribute__((aligned(64))); /* bf16 1.0: tiles 4-7 */
static float src[4096] __attribute__((aligned(64))), dst[4096] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void tiles(void) {
    _tile_loadd(4, ab[0], 64);
    _tile_loadd(5, ab[1], 64);
    _tile_loadd(6, ab[2], 64);
    _tile_loadd(7, ab[3], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
        return 1;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    for (int i = 0; i < 16 * 32; i++)
        ab[0][i] = ab[1][i] = ab[2][i] = ab[3][i] = 0x3f80;
    for (int i = 0; i < 4096; i++)
        src[i] = i * 1e-3f;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);

    const int ks[] = {8, 16, 32, 64};
    __m512 keep = _mm512_setzero_ps(); /* the register chains' results, printed: not dead */
    for (int mem = 0; mem < 2; mem++) {
        for (int ki = 0; ki < 4; ki++) {
            const int k = ks[ki];
            for (int mode = 0; mode < 3; mode++) {
                const __m512 c = _mm512_set1_ps(1.0001f), d = _mm512_set1_ps(0.5f);
                __m512 x0 = _mm512_set1_ps(1.0f), x1 = x0, x2 = x0, x3 = x0;
                int off = 0;
                const double t = now();
                for (int n = 0; n < ITERS; n++) {
                    if (mode != 1)
                        tiles();
                    if (mode == 0)
                        continue;
                    if (mem) {
                        for (int j = 0; j < k; j++) {
                            const int at = (off + j * 16) & 4095;
                            __m512 x = _mm512_load_ps(src + at);
                            x = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(x, x, x), x, x), x);
                            _mm256_store_si256((__m256i *)(dst + at), _mm512_cvtps_ph(x, 0));
                        }
                        off += k * 16;
                    } else {
                        for (int j = 0; j < k; j += 4) {
                            x0 = _mm512_fmadd_ps(x0, c, d);
                            x1 = _mm512_fmadd_ps(x1, c, d);
                            x2 = _mm512_fmadd_ps(x2, c, d);
                            x3 = _mm512_fmadd_ps(x3, c, d);
                        }
                    }
                }
                const double ns = (now() - t) / ITERS * 1e9;
                keep = _mm512_add_ps(keep, _mm512_add_ps(_mm512_add_ps(x0, x1), _mm512_add_ps(x2, x3)));
                printf("%s K=%2d mode %d (%s): %6.2f ns an iteration\n", mem ? "mem " : "regs", k, mode,
                       mode == 0 ? "tiles" : mode == 1 ? "vector" : "both", ns);
            }
        }
    }
    float out[16], c00[256];
    _mm512_storeu_ps(out, keep);
    _tile_stored(0, c00, 64);
    printf("(kept: %g %g %g)\n", out[0], dst[17], c00[0]);
    _tile_release();
    return 0;
}
