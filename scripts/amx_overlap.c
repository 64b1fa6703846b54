// Does vector work run alongside the AMX tile unit on one core? A measurement, not part of
// the library (issue 26, docs/benchmarks.md "The CPU on AMX tiles: the softmax between
// other tiles' products"). Each iteration: mode 0 four tile loads and four TDPBF16PS; mode 1
// K vector steps (a load, three operations, a half store); mode 2 both, in that order.
// Where mode 2's time is the larger of modes 0 and 1 the vector work is hidden; where it is
// their sum, nothing overlaps.
//
//   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -o /tmp/amx_overlap scripts/amx_overlap.c && /tmp/amx_overlap
//
// Linux only (arch_prctl asks for the tile state); a CPU without AMX dies on the first
// tile instruction.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static uint16_t A[4][16*32] __attribute__((aligned(64)));
static float src[64*64] __attribute__((aligned(64))), dst[64*64] __attribute__((aligned(64)));
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t cfg; memset(&cfg,0,sizeof cfg); cfg.palette=1;
  for(int i=0;i<8;i++){cfg.colsb[i]=64;cfg.rows[i]=16;}
  _tile_loadconfig(&cfg);
  for(int i=0;i<16*32;i++){A[0][i]=A[1][i]=A[2][i]=A[3][i]=0x3f80;}
  for(int i=0;i<4096;i++)src[i]=i*1e-3f;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  const int N=1000000; int Ks[]={8,16,32};
  for(int ki=0;ki<3;ki++){int K=Ks[ki];
   for(int mode=0;mode<3;mode++){ int off=0;
    double t=now();
    for(int n=0;n<N;n++){
      if(mode!=1){ _tile_loadd(4,A[0],64);_tile_loadd(5,A[1],64);_tile_loadd(6,A[2],64);_tile_loadd(7,A[3],64);
        _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
      if(mode!=0){ for(int k=0;k<K;k++){ __m512 x=_mm512_load_ps(src+((off+k*16)&4095)); x=_mm512_fmadd_ps(x,x,x); x=_mm512_fmadd_ps(x,x,x); x=_mm512_mul_ps(x,x);
          _mm256_store_si256((__m256i*)(dst+((off+k*16)&4095)), _mm512_cvtps_ph(x,0)); } off+=K*16; }
    }
    t=now()-t;
    printf("K=%2d mode=%d %.2f ns/iter (4 tileload + 4 tdpbf16ps | %d x (load, 3 ops, store))\n",K,mode,t/N*1e9,K);
   }}
  _tile_release(); return 0;}
