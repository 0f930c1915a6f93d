/* Peak multiply-add rates of one core's 512-bit dot-product instructions, register-only:
 * AVX512-BF16 `vdpbf16ps` (32 bfloat16 pairs), AVX-512 VNNI `vpdpbusd` (64 u8 x s8 pairs) and
 * float32 `vfmadd` (16), each over 12 independent accumulators so that throughput, not
 * latency, binds. Decides `engine.kernels.isa.slow_bf16_dot` (docs/quantization.md):
 *
 *   gcc -O2 -march=native -o /tmp/dot_peak benchmarks/dot_peak.c && /tmp/dot_peak
 *
 * Needs AVX512-BF16 and VNNI (SIGILL without). Out: one line per instruction, G multiply-adds
 * a second on one core and instructions per nanosecond. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 200000000L
int main(){
  __m512 acc[12]; for(int i=0;i<12;i++) acc[i]=_mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi16(0x3f80), b=(__m512bh)_mm512_set1_epi16(0x3f80);
  double t=now();
  for(long n=0;n<N/12;n++){
#pragma GCC unroll 12
    for(int i=0;i<12;i++) acc[i]=_mm512_dpbf16_ps(acc[i],a,b);
    __asm__ volatile("" : "+v"(a));
  }
  double dt=now()-t; float s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_ps(acc[i]);
  printf("vdpbf16ps zmm: %.1f GMAC/s/core (instr/ns %.2f) %g\n", N*32/dt/1e9, N/dt/1e9, s);
  __m512i ia[12]; for(int i=0;i<12;i++) ia[i]=_mm512_setzero_si512();
  __m512i u=_mm512_set1_epi8(1), v=_mm512_set1_epi8(1);
  t=now();
  for(long n=0;n<N/12;n++){
#pragma GCC unroll 12
    for(int i=0;i<12;i++) ia[i]=_mm512_dpbusd_epi32(ia[i],u,v);
    __asm__ volatile("" : "+v"(u));
  }
  dt=now()-t; long si=0; for(int i=0;i<12;i++) si+=_mm512_reduce_add_epi32(ia[i]);
  printf("vpdpbusd zmm: %.1f GMAC/s/core (instr/ns %.2f) %ld\n", N*64/dt/1e9, N/dt/1e9, si);
  __m512 f[12]; for(int i=0;i<12;i++) f[i]=_mm512_setzero_ps();
  __m512 x=_mm512_set1_ps(1.0f), y=_mm512_set1_ps(1e-9f);
  t=now();
  for(long n=0;n<N/12;n++){
#pragma GCC unroll 12
    for(int i=0;i<12;i++) f[i]=_mm512_fmadd_ps(x,y,f[i]);
    __asm__ volatile("" : "+v"(x));
  }
  dt=now()-t; s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_ps(f[i]);
  printf("vfmadd zmm: %.1f GMAC/s/core (instr/ns %.2f) %g\n", N*16/dt/1e9, N/dt/1e9, s);
}
