// Part of shaders/flash_attn_prefill_tensor.cu: the online softmax of SPEC section 2, steps
// 4 and 5, as both forms run it on the rows their threads hold: the lazy rescale and P =
// half(exp(s - M)) with the row sums of the rounded values.
#pragma once

#include "flash_attn_prefill/common.cuh"

// A running max moves only when a step's max exceeds it by more than this, so every
// exp(s - M) stays below e^8 and fits in half.
#define RESCALE_THRESHOLD 8.f

// The lazy rescale of one row: with the step's max `mx`, moves the running max `m` and
// sets the factor `ms` the row's sum and O are scaled by; whether it moved.
__device__ __forceinline__ bool softmax_rescale(float mx, float& m, float& ms) {
    ms = 1.f;
    if (mx > m + RESCALE_THRESHOLD) {
        ms = exp2_approx((m - mx) * LOG2E);
        m = mx;
        return true;
    }
    return false;
}

// P of two scores of one row, half(exp(s - m)), as a half2 (s0 in the low half), and their
// rounded values added to `sum`.
__device__ __forceinline__ u32 softmax_p2(float s0, float s1, float m, float& sum) {
    const float e0 = exp2_approx((s0 - m) * LOG2E);
    const float e1 = exp2_approx((s1 - m) * LOG2E);
    const u32 h2 = pack_half2(e0, e1);
    float r0, r1;
    unpack_half2(h2, r0, r1);
    sum += r0 + r1;
    return h2;
}
