// A CPU emulator of the subset of the Metal Shading Language, the Metal standard library
// and the Metal Performance Primitives tensor API that the kernels in shaders/ use.
//
// This file holds everything but the address-space keyword macros (metal_emu.h adds them), so
// that the runtime can include it next to the C++ standard library.
//
// What is modelled, and what is not, is listed in docs/metal.md. In short: every thread of a
// threadgroup is a fiber; threadgroup_barrier waits until every thread of the threadgroup has
// reached the same barrier; simdgroup functions exchange values between the 32 lanes of a
// simdgroup; a cooperative tensor spreads its elements over the threads of its execution
// scope in a layout chosen at run time (a kernel may rely only on the documented queries:
// capacity, validity, coordinates); matmul2d reads its operands from memory when each thread
// enters run(), so it is not a barrier.
#pragma once

#include <array>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <type_traits>

// ---- scalar types ------------------------------------------------------------------------

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;  // 64 bits, as in Metal (LP64 hosts only)
static_assert(sizeof(ulong) == 8, "the emulator needs an LP64 host");

namespace metal_emu {

// IEEE binary16 <-> binary32, round to nearest even (Metal's conversion rounding).
inline uint16_t float_to_half_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t exp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (exp == 0xff) {  // inf or NaN (keep NaN quiet and non-zero)
        return uint16_t(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
    }
    const int e = int(exp) - 127 + 15;
    if (e >= 31) return uint16_t(sign | 0x7c00u);  // overflow
    if (e <= 0) {                                  // subnormal half or zero
        if (e < -10) return uint16_t(sign);
        mant |= 0x800000u;
        const int shift = 14 - e;  // 14..24
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
        return uint16_t(sign | h);
    }
    uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent
    return uint16_t(sign | h);
}

float half_bits_to_float_slow(uint16_t h);
extern const float* const half_table;  // all 65536 values, filled before any kernel runs

inline float half_bits_to_float(uint16_t h) { return half_table[h]; }

}  // namespace metal_emu

// Metal's half: stored as binary16; arithmetic between halves rounds to half after each
// operation (single operations of binary16 values are exact in binary32 before rounding, so
// this equals a native binary16 operation). Mixed half/float arithmetic is float.
struct half {
    uint16_t bits;
    half() = default;
    half(float f) : bits(metal_emu::float_to_half_bits(f)) {}
    template <class T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, float>, int> = 0>
    half(T v) : bits(metal_emu::float_to_half_bits(float(v))) {}
    operator float() const { return metal_emu::half_bits_to_float(bits); }
    static half from_bits(uint16_t b) {
        half h;
        h.bits = b;
        return h;
    }
    half& operator+=(half o) { return *this = half(float(*this) + float(o)); }
    half& operator-=(half o) { return *this = half(float(*this) - float(o)); }
    half& operator*=(half o) { return *this = half(float(*this) * float(o)); }
    half& operator/=(half o) { return *this = half(float(*this) / float(o)); }
    half operator-() const { return from_bits(uint16_t(bits ^ 0x8000u)); }
};
static_assert(sizeof(half) == 2, "half is two bytes");

inline half operator+(half a, half b) { return half(float(a) + float(b)); }
inline half operator-(half a, half b) { return half(float(a) - float(b)); }
inline half operator*(half a, half b) { return half(float(a) * float(b)); }
inline half operator/(half a, half b) { return half(float(a) / float(b)); }
#define METAL_EMU_HALF_MIXED(op)                                                    \
    template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>          \
    inline auto operator op(half a, T b) { return float(a) op b; }                  \
    template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>          \
    inline auto operator op(T a, half b) { return a op float(b); }
METAL_EMU_HALF_MIXED(+)
METAL_EMU_HALF_MIXED(-)
METAL_EMU_HALF_MIXED(*)
METAL_EMU_HALF_MIXED(/)
METAL_EMU_HALF_MIXED(<)
METAL_EMU_HALF_MIXED(>)
METAL_EMU_HALF_MIXED(<=)
METAL_EMU_HALF_MIXED(>=)
METAL_EMU_HALF_MIXED(==)
METAL_EMU_HALF_MIXED(!=)
#undef METAL_EMU_HALF_MIXED
inline bool operator<(half a, half b) { return float(a) < float(b); }
inline bool operator>(half a, half b) { return float(a) > float(b); }
inline bool operator<=(half a, half b) { return float(a) <= float(b); }
inline bool operator>=(half a, half b) { return float(a) >= float(b); }
inline bool operator==(half a, half b) { return float(a) == float(b); }
inline bool operator!=(half a, half b) { return float(a) != float(b); }

// Metal's bfloat (MSL 3.1): the upper 16 bits of a binary32. Widening to float is exact;
// narrowing rounds to nearest even (NaN stays NaN). Only storage and conversions are
// modelled (arithmetic on bfloat values is done in float).
struct bfloat {
    uint16_t bits;
    bfloat() = default;
    bfloat(float f) {
        uint32_t x;
        std::memcpy(&x, &f, 4);
        bits = (x & 0x7fffffffu) > 0x7f800000u ? uint16_t((x >> 16) | 0x40u)
                                               : uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
    operator float() const {
        const uint32_t x = uint32_t(bits) << 16;
        float f;
        std::memcpy(&f, &x, 4);
        return f;
    }
};
static_assert(sizeof(bfloat) == 2, "bfloat is two bytes");

// ---- vector types ------------------------------------------------------------------------
// Components as named members (x, y, z, w); the aligned types are aligned to their size
// (rounded up to a power of two) as in Metal, the packed ones to their scalar.

namespace metal_emu {

template <class T, int N, bool Packed>
struct vec_storage;
template <class T, bool P>
struct vec_storage<T, 2, P> { T x, y; };
template <class T, bool P>
struct vec_storage<T, 3, P> { T x, y, z; };
template <class T, bool P>
struct vec_storage<T, 4, P> { T x, y, z, w; };

constexpr std::size_t vec_align(std::size_t scalar, int n, bool packed) {
    return packed ? scalar : scalar * std::size_t(n == 3 ? 4 : n);
}

template <class T, int N, bool Packed = false>
struct alignas(vec_align(sizeof(T), N, Packed)) vec : vec_storage<T, N, Packed> {
    using value_type = T;
    static constexpr int size = N;
    vec() = default;
    // A scalar fills every component (Metal allows this for initialisation).
    template <class S, std::enable_if_t<std::is_arithmetic_v<S> || std::is_same_v<S, half>, int> = 0>
    vec(S s) {
        for (int i = 0; i < N; ++i) (*this)[i] = T(s);
    }
    template <class... S, std::enable_if_t<sizeof...(S) == N && (N > 1), int> = 0>
    vec(S... s) {
        T v[N] = {T(s)...};
        for (int i = 0; i < N; ++i) (*this)[i] = v[i];
    }
    // Same component type, other packing: implicit (packed <-> aligned assignment).
    template <bool P2, std::enable_if_t<P2 != Packed, int> = 0>
    vec(const vec<T, N, P2>& o) {
        for (int i = 0; i < N; ++i) (*this)[i] = o[i];
    }
    // Other component type: explicit conversion, componentwise (Metal's half4(float4)).
    template <class U, bool P2, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
    explicit vec(const vec<U, N, P2>& o) {
        for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
    }
    T& operator[](int i) { return (&this->x)[i]; }
    const T& operator[](int i) const { return (&this->x)[i]; }
};

#define METAL_EMU_VEC_OP(op)                                                                \
    template <class T, int N, bool P>                                                       \
    inline vec<T, N, P> operator op(const vec<T, N, P>& a, const vec<T, N, P>& b) {         \
        vec<T, N, P> r;                                                                     \
        for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                                 \
        return r;                                                                           \
    }                                                                                       \
    template <class T, int N, bool P, class S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0> \
    inline vec<T, N, P> operator op(const vec<T, N, P>& a, S s) {                           \
        vec<T, N, P> r;                                                                     \
        for (int i = 0; i < N; ++i) r[i] = T(a[i] op T(s));                                 \
        return r;                                                                           \
    }                                                                                       \
    template <class T, int N, bool P, class S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0> \
    inline vec<T, N, P> operator op(S s, const vec<T, N, P>& a) {                           \
        vec<T, N, P> r;                                                                     \
        for (int i = 0; i < N; ++i) r[i] = T(T(s) op a[i]);                                 \
        return r;                                                                           \
    }
METAL_EMU_VEC_OP(+)
METAL_EMU_VEC_OP(-)
METAL_EMU_VEC_OP(*)
METAL_EMU_VEC_OP(/)
#undef METAL_EMU_VEC_OP

}  // namespace metal_emu

#define METAL_EMU_VECTORS(T)                               \
    typedef metal_emu::vec<T, 2> T##2;                     \
    typedef metal_emu::vec<T, 3> T##3;                     \
    typedef metal_emu::vec<T, 4> T##4;                     \
    typedef metal_emu::vec<T, 2, true> packed_##T##2;      \
    typedef metal_emu::vec<T, 3, true> packed_##T##3;      \
    typedef metal_emu::vec<T, 4, true> packed_##T##4;
METAL_EMU_VECTORS(float)
METAL_EMU_VECTORS(half)
METAL_EMU_VECTORS(int)
METAL_EMU_VECTORS(uint)
METAL_EMU_VECTORS(short)
METAL_EMU_VECTORS(ushort)
METAL_EMU_VECTORS(uchar)
#undef METAL_EMU_VECTORS

// ---- the execution model (implemented in runtime.cpp) ------------------------------------

namespace metal_emu {

constexpr int SIMD_WIDTH = 32;

// What a thread knows about itself; the attribute bindings read it.
struct ThreadInfo {
    uint3 threadgroup_position_in_grid;
    uint3 threadgroups_per_grid;
    uint3 thread_position_in_threadgroup;
    uint3 threads_per_threadgroup;
    uint thread_index_in_threadgroup;
    uint thread_index_in_simdgroup;
    uint simdgroup_index_in_threadgroup;
    uint threads_in_threadgroup;
};

// The running thread (fiber) of the calling OS thread.
const ThreadInfo& self();
// The buffer bound at `index` ([[buffer(index)]]), and the threadgroup memory block `index`.
void* bound_buffer(int index);
void* bound_threadgroup_memory(int index);

[[noreturn]] void fail(const char* fmt, ...);

// Blocks the calling thread until every thread of its threadgroup has reached the same
// barrier (same source line); any other arrival is reported as non-uniform control flow.
void threadgroup_barrier_wait(const std::source_location& where);
// Deposits `bytes` bytes and blocks until the 32 lanes of the simdgroup have deposited for the
// same call; returns the 32 deposits (lane order), valid until this lane's next call.
const unsigned char* simd_exchange(const void* value, int bytes, int op, const std::source_location& where);

// matmul2d bookkeeping: every thread of the execution scope must enter each run() with the
// same operation and operands; checked at each barrier and at the end of the threadgroup.
struct MatmulSignature {
    int m, n, k, flags;
    const void* left;
    const void* right;
    const void* destination;  // memory destination; null for a cooperative one
    int left_extents[2], right_extents[2], left_strides[2], right_strides[2];
};
void matmul_enter(const MatmulSignature& sig, int scope_threads);

// The element layout of a cooperative tensor of rows x cols elements spread over `threads`
// threads with `capacity` slots each: slot s of thread t holds element coord[t*capacity+s]
// (row * cols + col), or -1 when the slot is not a valid element. Chosen at run time (the
// layout seed), so a kernel that assumes one layout gives different results under another.
const int32_t* cooperative_layout(int rows, int cols, int threads, int capacity);

}  // namespace metal_emu

// ---- the Metal standard library subset -----------------------------------------------------

namespace metal {

using ::half;
using ::bfloat;

template <class T, std::size_t N>
struct array {
    T v[N];
    constexpr T& operator[](std::size_t i) { return v[i]; }
    constexpr const T& operator[](std::size_t i) const { return v[i]; }
    static constexpr std::size_t size() { return N; }
};

enum class mem_flags : uint {
    mem_none = 0,
    mem_device = 1,
    mem_threadgroup = 2,
    mem_texture = 4,
    mem_threadgroup_imageblock = 8,
    mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

inline void threadgroup_barrier(mem_flags, std::source_location where = std::source_location::current()) {
    metal_emu::threadgroup_barrier_wait(where);
}
inline void simdgroup_barrier(mem_flags, std::source_location where = std::source_location::current()) {
    int dummy = 0;
    metal_emu::simd_exchange(&dummy, sizeof dummy, 0, where);
}

template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float tanh(float x) { return std::tanh(x); }
// Leading zero bits of a 32-bit value (32 for 0), as MSL's clz.
inline uint clz(uint x) { return x == 0 ? 32u : uint(__builtin_clz(x)); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fabs(float x) { return std::fabs(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
namespace fast { using metal::exp; using metal::exp2; using metal::log; using metal::tanh; }
namespace precise { using metal::exp; using metal::exp2; using metal::log; using metal::tanh; }

template <class To, class From>
inline To as_type(From f) {
    static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
    To t;
    std::memcpy(&t, &f, sizeof t);
    return t;
}

// Simdgroup functions: the calling lane's value and the 32 lanes' results.
namespace detail {
enum simd_op { op_barrier, op_sum, op_max, op_min, op_all, op_any, op_shuffle, op_shuffle_xor, op_broadcast };
template <class T>
inline const T* exchange(T v, simd_op op, const std::source_location& where) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16, "simd value too large");
    return reinterpret_cast<const T*>(metal_emu::simd_exchange(&v, sizeof(T), op, where));
}
}  // namespace detail

// Reductions combine the lanes in lane order (Apple does not document the order).
template <class T>
inline T simd_sum(T v, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_sum, where);
    T acc = all[0];
    for (int i = 1; i < metal_emu::SIMD_WIDTH; ++i) acc = acc + all[i];
    return acc;
}
template <class T>
inline T simd_max(T v, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_max, where);
    T acc = all[0];
    for (int i = 1; i < metal_emu::SIMD_WIDTH; ++i) acc = max(acc, all[i]);
    return acc;
}
template <class T>
inline T simd_min(T v, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_min, where);
    T acc = all[0];
    for (int i = 1; i < metal_emu::SIMD_WIDTH; ++i) acc = min(acc, all[i]);
    return acc;
}
inline bool simd_all(bool v, std::source_location where = std::source_location::current()) {
    const bool* all = detail::exchange(v, detail::op_all, where);
    for (int i = 0; i < metal_emu::SIMD_WIDTH; ++i)
        if (!all[i]) return false;
    return true;
}
inline bool simd_any(bool v, std::source_location where = std::source_location::current()) {
    const bool* all = detail::exchange(v, detail::op_any, where);
    for (int i = 0; i < metal_emu::SIMD_WIDTH; ++i)
        if (all[i]) return true;
    return false;
}
template <class T>
inline T simd_shuffle(T v, ushort lane, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_shuffle, where);
    return all[lane % metal_emu::SIMD_WIDTH];
}
template <class T>
inline T simd_shuffle_xor(T v, ushort mask, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_shuffle_xor, where);
    return all[(metal_emu::self().thread_index_in_simdgroup ^ mask) % metal_emu::SIMD_WIDTH];
}
template <class T>
inline T simd_broadcast(T v, ushort lane, std::source_location where = std::source_location::current()) {
    const T* all = detail::exchange(v, detail::op_broadcast, where);
    return all[lane % metal_emu::SIMD_WIDTH];
}

// ---- tensors (metal_tensor) ------------------------------------------------------------------

inline constexpr std::size_t dynamic_extent = std::size_t(-1);
template <class I>
inline constexpr I dynamic_length_v = I(-1);

template <class I, std::size_t R>
struct dextents {
    I e[R];
    template <class... S, std::enable_if_t<sizeof...(S) == R, int> = 0>
    constexpr dextents(S... s) : e{I(s)...} {}
    static constexpr std::size_t rank() { return R; }
    constexpr I extent(std::size_t d) const { return e[d]; }
};

struct tensor_handle {};
struct tensor_offset {};
struct tensor_inline {};

template <class T, class Extents, class Layout = tensor_handle>
struct tensor;

// A non-owning view: element (i0, i1, ...) is data[i0*stride0 + i1*stride1 + ...]; index 0
// is the fastest-moving coordinate (for a matrix: the column).
template <class T, class I, std::size_t R, class L>
struct tensor<T, dextents<I, R>, L> {
    using element_type = T;
    using index_type = I;
    T* data_;
    I ext_[R];
    I str_[R];

    tensor(T* data, dextents<I, R> ext, array<I, R> strides) : data_(data) {
        for (std::size_t d = 0; d < R; ++d) {
            ext_[d] = ext.e[d];
            str_[d] = strides[d];
        }
    }
    // Without strides the tensor is packed: stride 1 on coordinate 0.
    tensor(T* data, dextents<I, R> ext) : data_(data) {
        I s = 1;
        for (std::size_t d = 0; d < R; ++d) {
            ext_[d] = ext.e[d];
            str_[d] = s;
            s *= ext.e[d];
        }
    }
    static constexpr std::size_t get_rank() { return R; }
    I get_extent(std::size_t d) const { return ext_[d]; }
    I get_stride(std::size_t d) const { return str_[d]; }
    T* get_data_pointer() const { return data_; }
    // The element at (c0, c1) of a rank-2 tensor, or null outside its extents.
    T* element(long c0, long c1) const {
        static_assert(R == 2, "rank-2 tensors only");
        if (c0 < 0 || c1 < 0 || c0 >= long(ext_[0]) || c1 >= long(ext_[1])) return nullptr;
        return data_ + c0 * long(str_[0]) + c1 * long(str_[1]);
    }
};

// A cooperative tensor: each thread of the execution scope holds `capacity` slots; which
// element of the rows x cols tensor a slot holds is the emulator's run-time layout.
template <int Rows, int Cols, int Threads>
struct cooperative_layout {
    static constexpr int rows = Rows, cols = Cols, threads = Threads;
    // Two spare slots per thread, so some slots of every layout are not valid elements.
    static constexpr int capacity = (Rows * Cols + Threads - 1) / Threads + 2;
};

template <class T, class Extents, class Layout>
struct cooperative_tensor {
    using element_type = T;
    T slots_[Layout::capacity];
    const int32_t* coord_;  // this thread's row of the layout table

    cooperative_tensor() {
        const uint t = metal_emu::self().thread_index_in_threadgroup;
        coord_ = metal_emu::cooperative_layout(Layout::rows, Layout::cols, Layout::threads, Layout::capacity) +
                 std::size_t(t) * Layout::capacity;
        // Thread-private storage starts undefined: poison it (NaN) so reads before writes show.
        for (int i = 0; i < Layout::capacity; ++i) std::memset(&slots_[i], 0xff, sizeof(T));
    }
    static constexpr ushort get_capacity() { return ushort(Layout::capacity); }
    static constexpr int get_rank() { return 2; }
    bool is_valid_element(ushort i) const { return i < Layout::capacity && coord_[i] >= 0; }
    T& operator[](ushort i) { return slots_[i]; }
    const T& operator[](ushort i) const { return slots_[i]; }
    // (column, row) of slot i in the tensor's own coordinates (index 0 moves fastest).
    array<int, 2> get_multidimensional_index(ushort i) const {
        if (!is_valid_element(i)) metal_emu::fail("get_multidimensional_index of an invalid slot %d", int(i));
        return array<int, 2>{{coord_[i] % Layout::cols, coord_[i] / Layout::cols}};
    }

    // Iteration visits this thread's valid elements.
    struct iterator {
        cooperative_tensor* t;
        ushort i;
        void skip() {
            while (i < Layout::capacity && !t->is_valid_element(i)) ++i;
        }
        T& operator*() const { return t->slots_[i]; }
        iterator& operator++() {
            ++i;
            skip();
            return *this;
        }
        bool operator!=(const iterator& o) const { return i != o.i; }
        bool operator==(const iterator& o) const { return i == o.i; }
        ushort get_index() const { return i; }
    };
    iterator begin() {
        iterator it{this, 0};
        it.skip();
        return it;
    }
    iterator end() { return iterator{this, ushort(Layout::capacity)}; }

    // Copy this thread's elements from / to a tensor of the same shape (elements outside the
    // tensor's extents: loaded as zero, not stored).
    template <class U, class E, class L>
    void load(const tensor<U, E, L>& src) {
        for (ushort i = 0; i < Layout::capacity; ++i) {
            if (!is_valid_element(i)) continue;
            const auto c = get_multidimensional_index(i);
            const U* p = src.element(c[0], c[1]);
            slots_[i] = p ? T(float(*p)) : T(0);
        }
    }
    template <class U, class E, class L>
    void store(const tensor<U, E, L>& dst) const {
        for (ushort i = 0; i < Layout::capacity; ++i) {
            if (!is_valid_element(i)) continue;
            const auto c = get_multidimensional_index(i);
            if (U* p = dst.element(c[0], c[1])) *p = U(slots_[i]);
        }
    }
};

// Execution scopes of tensor operations.
struct execution_thread {
    static constexpr int threads = 1;
};
struct execution_simdgroup {
    static constexpr int threads = metal_emu::SIMD_WIDTH;
};
template <int N>
struct execution_simdgroups {
    static constexpr int threads = N * metal_emu::SIMD_WIDTH;
};

}  // namespace metal

// ---- Metal Performance Primitives: mpp::tensor_ops::matmul2d -----------------------------------

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
    enum class mode { multiply, multiply_accumulate };
    int m, n, k;
    bool transpose_left, transpose_right;
    bool relaxed_precision;
    mode matmul_mode;
    constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                  bool tl = false, bool tr = false, bool relaxed = false,
                                  mode md = mode::multiply)
        : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed),
          matmul_mode(md) {}
};

namespace detail {
template <class X>
struct is_cooperative : std::false_type {};
template <class T, class E, class L>
struct is_cooperative<metal::cooperative_tensor<T, E, L>> : std::true_type {};

template <class T>
inline float to_float(T v) { return float(v); }

// Left operand element (row r, reduction index kk); zero outside the tensor's extents.
template <class TA>
inline float left_at(const TA& a, bool transposed, int r, int kk) {
    const auto* p = transposed ? a.element(r, kk) : a.element(kk, r);
    return p ? to_float(*p) : 0.0f;
}
// Right operand element (reduction index kk, column c).
template <class TB>
inline float right_at(const TB& b, bool transposed, int kk, int c) {
    const auto* p = transposed ? b.element(kk, c) : b.element(c, kk);
    return p ? to_float(*p) : 0.0f;
}
}  // namespace detail

// C = A * B (multiply) or C = C + A * B (multiply_accumulate), C of m x n. A is m x k (a tensor
// of extents (k, m), or (m, k) when transpose_left), B is k x n (extents (n, k), or (k, n) when
// transpose_right). Each thread computes the elements it owns (its slots of a cooperative
// destination, or the same share of a destination in memory) from the operands as they are in
// memory when it enters run(): run() is not a barrier. Products are summed in float in k order.
template <matmul2d_descriptor Desc, class Scope>
struct matmul2d {
    static constexpr matmul2d_descriptor descriptor = Desc;
    using scope = Scope;
    static_assert(Desc.m > 0 && Desc.n > 0, "the emulator needs static m and n");
    using dest_layout = metal::cooperative_layout<Desc.m, Desc.n, Scope::threads>;

    template <class Left, class Right, class Elem, class Coord = int>
    metal::cooperative_tensor<Elem, metal::dextents<Coord, 2>, dest_layout> get_destination_cooperative_tensor() const {
        return metal::cooperative_tensor<Elem, metal::dextents<Coord, 2>, dest_layout>();
    }

    template <class Left, class Right, class Dest>
    void run(Left& a, Right& b, Dest& c) const {
        constexpr bool coop = detail::is_cooperative<Dest>::value;
        const int k = Desc.k >= 0 ? Desc.k : int(Desc.transpose_left ? a.get_extent(1) : a.get_extent(0));
        metal_emu::MatmulSignature sig{};
        sig.m = Desc.m;
        sig.n = Desc.n;
        sig.k = k;
        sig.flags = int(Desc.transpose_left) | int(Desc.transpose_right) << 1 | int(Desc.relaxed_precision) << 2 |
                    int(Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate) << 3;
        sig.left = a.get_data_pointer();
        sig.right = b.get_data_pointer();
        for (int d = 0; d < 2; ++d) {
            sig.left_extents[d] = int(a.get_extent(d));
            sig.right_extents[d] = int(b.get_extent(d));
            sig.left_strides[d] = int(a.get_stride(d));
            sig.right_strides[d] = int(b.get_stride(d));
        }
        const uint t = metal_emu::self().thread_index_in_threadgroup;
        const int32_t* coord = metal_emu::cooperative_layout(Desc.m, Desc.n, Scope::threads, dest_layout::capacity) +
                               std::size_t(t) * dest_layout::capacity;
        if constexpr (coop) {
            sig.destination = nullptr;
        } else {
            sig.destination = c.get_data_pointer();
        }
        metal_emu::matmul_enter(sig, Scope::threads);
        const bool accumulate = Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
        for (int s = 0; s < dest_layout::capacity; ++s) {
            if (coord[s] < 0) continue;
            const int col = coord[s] % Desc.n, row = coord[s] / Desc.n;
            float acc = 0.0f;
            for (int kk = 0; kk < k; ++kk)
                acc += detail::left_at(a, Desc.transpose_left, row, kk) * detail::right_at(b, Desc.transpose_right, kk, col);
            if constexpr (coop) {
                c[ushort(s)] = accumulate ? float(c[ushort(s)]) + acc : acc;
            } else {
                if (auto* p = c.element(col, row)) {
                    using E = std::remove_reference_t<decltype(*p)>;
                    *p = accumulate ? E(float(*p) + acc) : E(acc);
                }
            }
        }
    }
};

}  // namespace tensor_ops
}  // namespace mpp

// ---- kernel parameter bindings ---------------------------------------------------------------
// The emulator's translation turns `T name [[buffer(N)]]` into `T name = metal_emu::attr::bind_buffer(N)`
// (and likewise for the other attributes), so an entry point is called with no arguments and
// each parameter binds itself from the running thread.

namespace metal_emu {
namespace attr {

struct bound_pointer {
    void* p;
    template <class T>
    operator T*() const { return static_cast<T*>(p); }
    template <class T, std::enable_if_t<!std::is_pointer_v<T>, int> = 0>
    operator T&() const { return *static_cast<T*>(p); }
};
inline bound_pointer bind_buffer(int index) { return {bound_buffer(index)}; }
inline bound_pointer bind_threadgroup(int index) { return {bound_threadgroup_memory(index)}; }

// A position attribute may be declared with fewer components than three (uint2, uint).
struct bound_position {
    uint3 v;
    operator uint3() const { return v; }
    operator uint2() const { return uint2(v.x, v.y); }
    operator ushort3() const { return ushort3(v.x, v.y, v.z); }
    operator ushort2() const { return ushort2(v.x, v.y); }
    operator uint() const { return v.x; }
    operator ushort() const { return ushort(v.x); }
    operator int() const { return int(v.x); }
};
struct bound_index {
    uint v;
    operator uint() const { return v; }
    operator ushort() const { return ushort(v); }
    operator int() const { return int(v); }
    operator uchar() const { return uchar(v); }
};
inline bound_position bind_threadgroup_position_in_grid() { return {self().threadgroup_position_in_grid}; }
inline bound_position bind_threadgroups_per_grid() { return {self().threadgroups_per_grid}; }
inline bound_position bind_thread_position_in_threadgroup() { return {self().thread_position_in_threadgroup}; }
inline bound_position bind_threads_per_threadgroup() { return {self().threads_per_threadgroup}; }
inline bound_position bind_thread_position_in_grid() {
    const ThreadInfo& s = self();
    return {uint3(s.threadgroup_position_in_grid.x * s.threads_per_threadgroup.x + s.thread_position_in_threadgroup.x,
                  s.threadgroup_position_in_grid.y * s.threads_per_threadgroup.y + s.thread_position_in_threadgroup.y,
                  s.threadgroup_position_in_grid.z * s.threads_per_threadgroup.z + s.thread_position_in_threadgroup.z)};
}
inline bound_index bind_thread_index_in_threadgroup() { return {self().thread_index_in_threadgroup}; }
inline bound_index bind_thread_index_in_simdgroup() { return {self().thread_index_in_simdgroup}; }
inline bound_index bind_simdgroup_index_in_threadgroup() { return {self().simdgroup_index_in_threadgroup}; }
inline bound_index bind_threads_per_simdgroup() { return {uint(SIMD_WIDTH)}; }
inline bound_index bind_simdgroups_per_threadgroup() {
    return {(self().threads_in_threadgroup + SIMD_WIDTH - 1) / SIMD_WIDTH};
}

}  // namespace attr

// Entry points register themselves by name (the translation appends one registrar per kernel).
using entry_fn = void (*)();
struct entry_registrar {
    entry_registrar(const char* name, entry_fn fn);
};

}  // namespace metal_emu
