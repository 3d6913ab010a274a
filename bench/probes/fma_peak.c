/* FMA throughput of one core, 256-bit against 512-bit (10 independent chains
 * each, so latency is hidden): tells whether the core has one or two 512-bit
 * FMA ports. Build: gcc -O2 -mavx512f -mfma bench/probes/fma_peak.c -o fma_peak
 * (BENCHMARKS.md, issue 19). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
int main(){
  long N=100000000;
#define D256(i) __m256 a##i=_mm256_set1_ps(i*0.001f);
#define D512(i) __m512 b##i=_mm512_set1_ps(i*0.001f);
  R8(D256) R8(D512)
  __m256 m=_mm256_set1_ps(0.9999f), c=_mm256_set1_ps(0.0001f);
  __m512 m5=_mm512_set1_ps(0.9999f), c5=_mm512_set1_ps(0.0001f);
#define F256(i) a##i=_mm256_fmadd_ps(a##i,m,c);
#define F512(i) b##i=_mm512_fmadd_ps(b##i,m5,c5);
  double t0=now();
  for(long i=0;i<N;i++){ R8(F256) }
  double t1=now();
  for(long i=0;i<N;i++){ R8(F512) }
  double t2=now();
#define S(i) s+=_mm256_cvtss_f32(a##i)+_mm512_cvtss_f32(b##i);
  float s=0; R8(S)
  double n=10.0*N;
  printf("ymm: %.2f G fma/s (%.1f G lanes/s); zmm: %.2f G fma/s (%.1f G lanes/s) %f\n", n/(t1-t0)/1e9, 8*n/(t1-t0)/1e9, n/(t2-t1)/1e9, 16*n/(t2-t1)/1e9, s);
}
