/* Throughput of one core for the 512-bit operations the AVX-512 kernel's
 * quantised sources issue (vpermps, vpermt2ps, vpmovzxwd, vpsrld, vpternlogd,
 * vcvtdq2ps, vfmadd), each alone and mixed, 10 independent chains each so
 * latency is hidden; and vdpbf16ps against vfmadd, with a check that
 * vdpbf16ps rounds as fmaf(odd) then fmaf(even) on random normal bf16 data
 * (the order the AVX-512 kernel sums in; BENCHMARKS.md, issue 19).
 * Build: gcc -O2 -march=native bench/probes/zmm_mix.c -o zmm_mix
 * (needs avx512f, avx512bw; the bf16 part needs avx512_bf16). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static uint64_t s = 88172645463325252ull;
static uint64_t rnd(void) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}
static float bf(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#define R10(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define LOOP(body)                                   \
    do {                                             \
        for (long i = 0; i < N; i++) {               \
            R10(body) __asm__ volatile("" ::: "memory"); \
        }                                            \
    } while (0)
int main(void) {
    const long N = 50000000;
#define DI(i) __m512i v##i = _mm512_set1_epi32(i * 7 + 1); __m512 f##i = _mm512_set1_ps(i * 0.001f), g##i = f##i;
    R10(DI)
    __m512 tab = _mm512_set1_ps(0.5f), m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.25f);
    const char *names[] = {"vpermps", "vpermt2ps", "vpmovzxwd", "vpsrld", "vpternlogd", "vcvtdq2ps", "vfmadd",
                           "vpermps+vfmadd", "vpermps+vpsrld+vfmadd"};
    const int per[] = {1, 1, 1, 1, 1, 1, 1, 2, 3};
    double t[10];
    int k = 0;
    t[k++] = now();
#define P(i) f##i = _mm512_permutexvar_ps(v##i, f##i);
    LOOP(P);
    t[k++] = now();
#define P2(i) f##i = _mm512_permutex2var_ps(f##i, v##i, tab);
    LOOP(P2);
    t[k++] = now();
#define Z(i) v##i = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v##i));
    LOOP(Z);
    t[k++] = now();
#define SH(i) v##i = _mm512_srli_epi32(v##i, 1);
    LOOP(SH);
    t[k++] = now();
#define TL(i) v##i = _mm512_ternarylogic_epi32(v##i, v0, v1, 0xD8);
    LOOP(TL);
    t[k++] = now();
#define CV(i) f##i = _mm512_cvtepi32_ps(_mm512_castps_si512(f##i));
    LOOP(CV);
    t[k++] = now();
#define FM(i) g##i = _mm512_fmadd_ps(g##i, m, c);
    LOOP(FM);
    t[k++] = now();
#define PF(i) f##i = _mm512_permutexvar_ps(v##i, f##i); g##i = _mm512_fmadd_ps(g##i, m, c);
    LOOP(PF);
    t[k++] = now();
#define PSF(i) f##i = _mm512_permutexvar_ps(v##i, f##i); v##i = _mm512_srli_epi32(v##i, 1); g##i = _mm512_fmadd_ps(g##i, m, c);
    LOOP(PSF);
    t[k++] = now();
    for (int j = 0; j < 9; j++)
        printf("%-22s %.2f G zmm ops/s\n", names[j], per[j] * 10.0 * N / (t[j + 1] - t[j]) / 1e9);
#ifdef __AVX512BF16__
    long bad = 0, n = 0;
    for (int it = 0; it < 200000; it++) {
        uint16_t a[32], b[32];
        float acc[16], out[16];
        for (int i = 0; i < 32; i++) {
            a[i] = (uint16_t)((rnd() & 0x80ff) | ((100 + rnd() % 50) << 7));
            b[i] = (uint16_t)((rnd() & 0x80ff) | ((100 + rnd() % 50) << 7));
        }
        for (int i = 0; i < 16; i++) {
            uint32_t u = (uint32_t)((rnd() & 0x807fffff) | ((90 + rnd() % 70) << 23));
            memcpy(&acc[i], &u, 4);
        }
        __m512 r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
        _mm512_storeu_ps(out, r);
        for (int i = 0; i < 16; i++, n++) {
            float e = __builtin_fmaf(bf(a[2 * i]), bf(b[2 * i]), __builtin_fmaf(bf(a[2 * i + 1]), bf(b[2 * i + 1]), acc[i]));
            if (memcmp(&e, &out[i], 4)) bad++;
        }
    }
    printf("vdpbf16ps against fmaf(odd) then fmaf(even): %ld of %ld lanes differ\n", bad, n);
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    double t0 = now();
#define DP(i) f##i = _mm512_dpbf16_ps(f##i, x, x);
    LOOP(DP);
    double t1 = now();
    printf("vdpbf16ps              %.2f G zmm ops/s (%.0f GFLOP/s)\n", 10.0 * N / (t1 - t0) / 1e9, 64 * 10.0 * N / (t1 - t0) / 1e9);
#endif
    float sum = 0;
#define S(i) sum += _mm512_cvtss_f32(f##i) + _mm512_cvtss_f32(g##i) + (float)_mm512_cvtsi512_si32(v##i);
    R10(S)
    printf("(%g)\n", sum);
    return 0;
}
