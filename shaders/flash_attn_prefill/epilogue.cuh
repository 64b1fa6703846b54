// Part of shaders/flash_attn_prefill_tensor.cu: O written in its dtype, and lse.
#pragma once

#include "flash_attn_prefill/params.cuh"

// Two output elements (columns c, c + 1) of row r of O in its dtype, and, where the
// element pair is aligned, in one store.
__device__ __forceinline__ void store_out2(void* __restrict__ out, int dt, i64 e, float x0, float x1, bool aligned) {
    if (dt == DT_F32) {
        float* o = reinterpret_cast<float*>(out) + e;
        if (aligned) {
            *reinterpret_cast<float2*>(o) = make_float2(x0, x1);
        } else {
            o[0] = x0;
            o[1] = x1;
        }
        return;
    }
    u32 h;
    if (dt == DT_F16) {
        h = pack_half2(x0, x1);
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(h) : "f"(x1), "f"(x0));
    }
    u16* o = reinterpret_cast<u16*>(out) + e;
    if (aligned) {
        *reinterpret_cast<u32*>(o) = h;
    } else {
        o[0] = (u16)(h & 0xffffu);
        o[1] = (u16)(h >> 16);
    }
}

// lse = M + ln(S) of one (row, head), -inf where the row saw nothing (SPEC 8).
__device__ __forceinline__ float lse_of(float m, float l) { return l > 0.f ? m + logf(l) : -__int_as_float(0x7f800000); }
