// The emulator's execution model and its command line.
//
//   metal_emu --kernel NAME --grid X,Y,Z --threads X,Y,Z
//             [--bytes I=FILE]... [--buffer I=FILE]... [--tgmem I=BYTES]...
//             [--schedule forward|reverse|random:SEED] [--layout-seed N] [--jobs N]
//
// runs one dispatch of NAME over a grid of X*Y*Z threadgroups, like
// dispatchThreadgroups:threadsPerThreadgroup:. `--bytes` binds a constant block (setBytes),
// `--buffer` a device buffer (each is read from FILE and written back to it after the run),
// `--tgmem` a threadgroup memory block (setThreadgroupMemoryLength). Exit status 0 on success;
// any violation of the execution model is a message on stderr and status 2.
//
// Each threadgroup runs as one fiber per thread (ucontext) on one OS thread; fibers switch only
// at barriers and simdgroup functions, in the order the schedule gives (every fiber runs to its
// next synchronisation point, then the next one in order). Threadgroups are spread over --jobs
// OS threads. Device buffers and threadgroup memory end at an inaccessible page, so a read or
// write past their end faults; threadgroup memory starts filled with 0xff bytes (NaN).

#if defined(__APPLE__)
// The ucontext functions are hidden on macOS unless asked for (never tried there).
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE
#endif

#include "metal_emu_core.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace metal_emu {

// ---- errors, half table ------------------------------------------------------------------------

void fail(const char* fmt, ...) {
    std::fprintf(stderr, "metal_emu: error: ");
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
    _exit(2);
}

float half_bits_to_float_slow(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t x;
    if (exp == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            x = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                ++e;
                mant <<= 1;
            } while (!(mant & 0x400u));
            x = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
        }
    } else {
        x = sign | (exp + 127 - 15) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

static float g_half_table[65536];
const float* const half_table = g_half_table;
static void fill_half_table() {
    for (uint32_t h = 0; h < 65536; ++h) g_half_table[h] = half_bits_to_float_slow(uint16_t(h));
}

// ---- entry points ----------------------------------------------------------------------------

static std::map<std::string, entry_fn>& entries() {
    static std::map<std::string, entry_fn> m;
    return m;
}
entry_registrar::entry_registrar(const char* name, entry_fn fn) { entries()[name] = fn; }

// ---- memory with a guard page after its end -----------------------------------------------------

struct GuardedRegion {
    unsigned char* base = nullptr;
    std::size_t total = 0;
    unsigned char* data = nullptr;
    std::size_t len = 0;
};

static GuardedRegion guarded_alloc(std::size_t len) {
    const std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
    const std::size_t span = (len + 15) / 16 * 16;  // the data ends 16-byte aligned at the guard
    GuardedRegion r;
    r.total = (span + page - 1) / page * page + page;
    void* p = mmap(nullptr, r.total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("cannot map %zu bytes", r.total);
    r.base = static_cast<unsigned char*>(p);
    if (mprotect(r.base + r.total - page, page, PROT_NONE) != 0) fail("mprotect failed");
    r.data = r.base + r.total - page - span;
    r.len = len;
    return r;
}

// ---- the dispatch -------------------------------------------------------------------------------

enum class Order { forward, reverse, random };

struct BufferBinding {
    int index;
    std::string path;
    bool constant_block;  // --bytes: not written back
    GuardedRegion mem;
};

struct Dispatch {
    std::string kernel;
    entry_fn entry = nullptr;
    uint3 grid{1u, 1u, 1u};
    uint3 threads{1u, 1u, 1u};
    std::vector<BufferBinding> buffers;
    std::vector<std::pair<int, std::size_t>> tgmem;
    Order order = Order::forward;
    uint64_t schedule_seed = 0;
    int jobs = 1;
};

static Dispatch g_dispatch;
static uint64_t g_layout_seed = 0;

// ---- cooperative tensor layouts -----------------------------------------------------------------

const int32_t* cooperative_layout(int rows, int cols, int threads, int capacity) {
    static std::mutex mu;
    static std::map<std::tuple<int, int, int, int>, std::vector<int32_t>> cache;
    thread_local std::tuple<int, int, int, int> last_key{-1, -1, -1, -1};
    thread_local const int32_t* last = nullptr;
    const auto key = std::make_tuple(rows, cols, threads, capacity);
    if (last && key == last_key) return last;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it == cache.end()) {
        const std::size_t elems = std::size_t(rows) * cols, slots = std::size_t(threads) * capacity;
        if (slots < elems) fail("cooperative tensor of %dx%d does not fit %d threads x %d slots", rows, cols, threads, capacity);
        std::vector<int32_t> table(slots, -1);
        if (g_layout_seed == 0) {
            // Thread t holds elements t*base .. t*base+base-1 (row-major), then spare slots.
            const std::size_t base = (elems + threads - 1) / threads;
            for (std::size_t t = 0; t < std::size_t(threads); ++t)
                for (std::size_t s = 0; s < base; ++s)
                    if (t * base + s < elems) table[t * capacity + s] = int32_t(t * base + s);
        } else {
            // Elements scattered over all slots (spare ones included) at random.
            std::vector<std::size_t> order(slots);
            for (std::size_t i = 0; i < slots; ++i) order[i] = i;
            std::mt19937_64 rng(g_layout_seed * 0x9e3779b97f4a7c15ull + elems);
            std::shuffle(order.begin(), order.end(), rng);
            for (std::size_t e = 0; e < elems; ++e) table[order[e]] = int32_t(e);
        }
        it = cache.emplace(key, std::move(table)).first;
    }
    last_key = key;
    last = it->second.data();
    return last;
}

// ---- fibers and the scheduler -------------------------------------------------------------------

enum class State { ready, barrier, simd, done };

struct Fiber {
    ucontext_t ctx;
    unsigned char* stack = nullptr;
    std::size_t stack_size = 0;
    ThreadInfo info;
    State state = State::ready;
    unsigned line = 0;  // where it waits
    const char* function = "";
    uint32_t simd_seq = 0;
    int simd_op = 0;
    int simd_bytes = 0;
    uint32_t matmul_calls = 0;
};

constexpr int MAX_THREADS = 1024;
constexpr int MAX_SIMDGROUPS = MAX_THREADS / SIMD_WIDTH;
constexpr std::size_t STACK_BYTES = 256 * 1024;

struct Worker {
    std::vector<Fiber> fibers;
    ucontext_t sched;
    Fiber* running = nullptr;
    // Deposits of simdgroup functions: [simdgroup][call parity][32 lanes x up to 16 bytes].
    alignas(16) unsigned char simd_slots[MAX_SIMDGROUPS][2][SIMD_WIDTH * 16];
    std::vector<MatmulSignature> matmul_log;
    std::vector<GuardedRegion> tgmem;
    std::vector<int> tgmem_index;
    std::mt19937_64 rng;
    uint tg_linear = 0;

    void run_threadgroup(uint3 tg);
    void release_simd_if_complete(uint sg);
    void check_matmul_uniform(const char* when);
    [[noreturn]] void stuck();
};

static thread_local Worker* t_worker = nullptr;

static Worker& worker() {
    if (!t_worker || !t_worker->running) fail("a Metal function was called outside a kernel");
    return *t_worker;
}

const ThreadInfo& self() { return worker().running->info; }

void* bound_buffer(int index) {
    for (auto& b : g_dispatch.buffers)
        if (b.index == index) return b.mem.data;
    fail("the kernel reads buffer(%d), which is not bound", index);
}

void* bound_threadgroup_memory(int index) {
    Worker& w = worker();
    for (std::size_t i = 0; i < w.tgmem_index.size(); ++i)
        if (w.tgmem_index[i] == index) return w.tgmem[i].data;
    fail("the kernel uses threadgroup(%d), which has no length set", index);
}

static void fiber_main() {
    Worker& w = *t_worker;
    g_dispatch.entry();
    w.running->state = State::done;
    // returning resumes the scheduler through uc_link
}

static void yield_to_scheduler(Fiber& f) {
    Worker& w = *t_worker;
    if (swapcontext(&f.ctx, &w.sched) != 0) fail("swapcontext failed");
}

void threadgroup_barrier_wait(const std::source_location& where) {
    Worker& w = worker();
    Fiber& f = *w.running;
    f.state = State::barrier;
    f.line = where.line();
    f.function = where.function_name();
    yield_to_scheduler(f);
}

const unsigned char* simd_exchange(const void* value, int bytes, int op, const std::source_location& where) {
    Worker& w = worker();
    Fiber& f = *w.running;
    if (bytes > 16) fail("simdgroup value of %d bytes", bytes);
    const uint sg = f.info.simdgroup_index_in_threadgroup, lane = f.info.thread_index_in_simdgroup;
    unsigned char* slot = w.simd_slots[sg][f.simd_seq & 1u];
    std::memcpy(slot + std::size_t(lane) * bytes, value, std::size_t(bytes));
    f.simd_op = op;
    f.simd_bytes = bytes;
    f.line = where.line();
    f.function = where.function_name();
    f.state = State::simd;
    yield_to_scheduler(f);
    ++f.simd_seq;
    return slot;
}

void matmul_enter(const MatmulSignature& sig, int scope_threads) {
    Worker& w = worker();
    Fiber& f = *w.running;
    if (uint(scope_threads) != f.info.threads_in_threadgroup)
        fail("matmul2d with an execution scope of %d threads in a threadgroup of %u threads (the emulator "
             "supports a scope of the whole threadgroup only)",
             scope_threads, f.info.threads_in_threadgroup);
    const uint32_t call = f.matmul_calls++;
    if (call == w.matmul_log.size()) {
        w.matmul_log.push_back(sig);
    } else if (std::memcmp(&w.matmul_log[call], &sig, sizeof sig) != 0) {
        fail("matmul2d run #%u of thread %u differs from another thread's (operation or operands are not "
             "uniform over the execution scope)",
             call, f.info.thread_index_in_threadgroup);
    }
}

void Worker::check_matmul_uniform(const char* when) {
    for (auto& f : fibers)
        if (f.matmul_calls != matmul_log.size())
            fail("%s: thread %u entered matmul2d run %u times, another thread %zu times (every thread of the "
                 "execution scope must enter each run)",
                 when, f.info.thread_index_in_threadgroup, f.matmul_calls, matmul_log.size());
}

void Worker::release_simd_if_complete(uint sg) {
    const std::size_t first = std::size_t(sg) * SIMD_WIDTH;
    const Fiber& lane0 = fibers[first];
    for (int l = 0; l < SIMD_WIDTH; ++l) {
        const Fiber& f = fibers[first + l];
        if (f.state != State::simd) return;
        if (f.simd_seq != lane0.simd_seq || f.simd_op != lane0.simd_op || f.line != lane0.line ||
            f.simd_bytes != lane0.simd_bytes)
            fail("simdgroup %u: lane %d calls a simdgroup function at line %u, lane 0 at line %u (divergent "
                 "simdgroup functions are not emulated)",
                 sg, l, f.line, lane0.line);
    }
    for (int l = 0; l < SIMD_WIDTH; ++l) fibers[first + l].state = State::ready;
}

void Worker::stuck() {
    std::string msg;
    for (auto& f : fibers) {
        const char* s = f.state == State::done ? "finished" : f.state == State::barrier ? "at a barrier" : "in a simdgroup function";
        msg += "\n  thread " + std::to_string(f.info.thread_index_in_threadgroup) + ": " + s;
        if (f.state != State::done) msg += " (line " + std::to_string(f.line) + ")";
        if (msg.size() > 4000) {
            msg += "\n  ...";
            break;
        }
    }
    fail("threadgroup (%u, %u, %u) cannot proceed: a barrier or simdgroup function is not reached by every "
         "thread that must reach it:%s",
         fibers[0].info.threadgroup_position_in_grid.x, fibers[0].info.threadgroup_position_in_grid.y,
         fibers[0].info.threadgroup_position_in_grid.z, msg.c_str());
}

// A fresh context that runs the kernel on the fiber's stack, then resumes `sched`.
__attribute__((noinline)) static void start_fiber(Fiber& f, ucontext_t& sched) {
    if (getcontext(&f.ctx) != 0) fail("getcontext failed");
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = f.stack_size;
    f.ctx.uc_link = &sched;
    makecontext(&f.ctx, fiber_main, 0);
}

void Worker::run_threadgroup(uint3 tg) {
    const Dispatch& d = g_dispatch;
    const uint n = d.threads.x * d.threads.y * d.threads.z;
    for (uint i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        ThreadInfo& t = f.info;
        t.threadgroup_position_in_grid = tg;
        t.threadgroups_per_grid = d.grid;
        t.threads_per_threadgroup = d.threads;
        t.thread_position_in_threadgroup = uint3(i % d.threads.x, (i / d.threads.x) % d.threads.y, i / (d.threads.x * d.threads.y));
        t.thread_index_in_threadgroup = i;
        t.thread_index_in_simdgroup = i % SIMD_WIDTH;
        t.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
        t.threads_in_threadgroup = n;
        f.state = State::ready;
        f.simd_seq = 0;
        f.matmul_calls = 0;
        start_fiber(f, sched);
    }
    for (auto& r : tgmem) std::memset(r.data, 0xff, r.len);
    matmul_log.clear();

    std::vector<uint> order(n);
    for (uint i = 0; i < n; ++i) order[i] = i;
    if (d.order == Order::reverse) std::reverse(order.begin(), order.end());
    for (;;) {
        if (d.order == Order::random) std::shuffle(order.begin(), order.end(), rng);
        for (uint i : order) {
            Fiber& f = fibers[i];
            if (f.state != State::ready) continue;
            running = &f;
            if (swapcontext(&sched, &f.ctx) != 0) fail("swapcontext failed");
            running = nullptr;
            if (f.state == State::simd) release_simd_if_complete(f.info.simdgroup_index_in_threadgroup);
        }
        uint done = 0, at_barrier = 0, ready = 0;
        for (uint i = 0; i < n; ++i) {
            done += fibers[i].state == State::done;
            at_barrier += fibers[i].state == State::barrier;
            ready += fibers[i].state == State::ready;
        }
        if (done == n) {
            check_matmul_uniform("end of the threadgroup");
            return;
        }
        if (ready > 0) continue;
        if (at_barrier == n) {
            for (uint i = 1; i < n; ++i)
                if (fibers[i].line != fibers[0].line)
                    fail("thread %u waits at the barrier on line %u, thread 0 at the one on line %u (barriers must be "
                         "reached in uniform control flow)",
                         i, fibers[i].line, fibers[0].line);
            check_matmul_uniform("threadgroup_barrier");
            for (uint i = 0; i < n; ++i) fibers[i].state = State::ready;
            continue;
        }
        stuck();
    }
}

static void run_worker(int job) {
    const Dispatch& d = g_dispatch;
    Worker w;
    t_worker = &w;
    const uint n = d.threads.x * d.threads.y * d.threads.z;
    w.fibers.resize(n);
    const std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
    for (auto& f : w.fibers) {
        void* p = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) fail("cannot map a fiber stack");
        mprotect(p, page, PROT_NONE);  // the stack grows down into this page on overflow
        f.stack = static_cast<unsigned char*>(p) + page;
        f.stack_size = STACK_BYTES;
    }
    for (auto& [index, bytes] : d.tgmem) {
        w.tgmem.push_back(guarded_alloc(bytes));
        w.tgmem_index.push_back(index);
    }
    const uint64_t groups = uint64_t(d.grid.x) * d.grid.y * d.grid.z;
    for (uint64_t g = uint64_t(job); g < groups; g += uint64_t(d.jobs)) {
        const uint3 tg(uint(g % d.grid.x), uint((g / d.grid.x) % d.grid.y), uint(g / (uint64_t(d.grid.x) * d.grid.y)));
        w.rng.seed(d.schedule_seed * 0x9e3779b97f4a7c15ull + g);
        w.run_threadgroup(tg);
    }
    t_worker = nullptr;
}

// ---- command line -------------------------------------------------------------------------------

static uint3 parse_size(const std::string& s) {
    unsigned x = 0, y = 0, z = 0;
    if (std::sscanf(s.c_str(), "%u,%u,%u", &x, &y, &z) != 3) fail("bad size %s (expected X,Y,Z)", s.c_str());
    return uint3(x, y, z);
}

static std::vector<unsigned char> read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot read %s", path.c_str());
    return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

static int run(int argc, char** argv) {
    fill_half_table();
    Dispatch& d = g_dispatch;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (i + 1 >= argc) fail("%s needs a value", a.c_str());
        const std::string v = argv[++i];
        auto split = [&](int& index, std::string& rest) {
            const auto eq = v.find('=');
            if (eq == std::string::npos) fail("%s %s: expected INDEX=VALUE", a.c_str(), v.c_str());
            index = std::atoi(v.substr(0, eq).c_str());
            rest = v.substr(eq + 1);
        };
        if (a == "--kernel") {
            d.kernel = v;
        } else if (a == "--grid") {
            d.grid = parse_size(v);
        } else if (a == "--threads") {
            d.threads = parse_size(v);
        } else if (a == "--bytes" || a == "--buffer") {
            BufferBinding b;
            split(b.index, b.path);
            b.constant_block = a == "--bytes";
            d.buffers.push_back(std::move(b));
        } else if (a == "--tgmem") {
            int index;
            std::string bytes;
            split(index, bytes);
            d.tgmem.emplace_back(index, std::size_t(std::stoull(bytes)));
        } else if (a == "--schedule") {
            if (v == "forward") {
                d.order = Order::forward;
            } else if (v == "reverse") {
                d.order = Order::reverse;
            } else if (v.rfind("random:", 0) == 0) {
                d.order = Order::random;
                d.schedule_seed = std::stoull(v.substr(7));
            } else {
                fail("unknown schedule %s", v.c_str());
            }
        } else if (a == "--layout-seed") {
            g_layout_seed = std::stoull(v);
        } else if (a == "--jobs") {
            d.jobs = std::max(1, std::atoi(v.c_str()));
        } else {
            fail("unknown option %s", a.c_str());
        }
    }
    auto it = entries().find(d.kernel);
    if (it == entries().end()) {
        std::string names;
        for (auto& [n, f] : entries()) names += " " + n;
        fail("no kernel named '%s' (this build has:%s)", d.kernel.c_str(), names.c_str());
    }
    d.entry = it->second;
    const uint64_t n = uint64_t(d.threads.x) * d.threads.y * d.threads.z;
    if (n == 0 || n > MAX_THREADS) fail("%llu threads per threadgroup (1..%d)", (unsigned long long)n, MAX_THREADS);
    if (n % SIMD_WIDTH != 0) fail("threadgroups of %llu threads: the emulator needs whole simdgroups of %d", (unsigned long long)n, SIMD_WIDTH);
    std::size_t tg_total = 0;
    for (auto& [index, bytes] : d.tgmem) {
        if (bytes % 16 != 0) fail("threadgroup memory length %zu at index %d is not a multiple of 16", bytes, index);
        tg_total += bytes;
    }
    if (tg_total > 32768) fail("%zu bytes of threadgroup memory exceed the 32 KiB of Apple GPUs", tg_total);
    for (auto& b : d.buffers) {
        const auto bytes = read_file(b.path);
        if (b.constant_block && bytes.size() > 4096) fail("a setBytes block holds at most 4 KiB, got %zu", bytes.size());
        b.mem = guarded_alloc(bytes.size());
        if (!bytes.empty()) std::memcpy(b.mem.data, bytes.data(), bytes.size());
    }
    if (uint64_t(d.grid.x) * d.grid.y * d.grid.z > 0) {
        d.jobs = int(std::min<uint64_t>(uint64_t(d.jobs), uint64_t(d.grid.x) * d.grid.y * d.grid.z));
        std::vector<std::thread> pool;
        for (int j = 1; j < d.jobs; ++j) pool.emplace_back(run_worker, j);
        run_worker(0);
        for (auto& t : pool) t.join();
    }
    for (auto& b : d.buffers) {
        if (b.constant_block) continue;
        std::ofstream out(b.path, std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(b.mem.data), std::streamsize(b.mem.len));
        if (!out) fail("cannot write %s", b.path.c_str());
    }
    return 0;
}

}  // namespace metal_emu

int main(int argc, char** argv) { return metal_emu::run(argc, argv); }
