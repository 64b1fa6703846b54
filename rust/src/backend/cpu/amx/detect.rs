//! Whether this process may use the AMX tiles: the CPU has AMX-TILE and AMX-BF16 (CPUID
//! leaf 7, EDX bits 24 and 22) and AVX-512 (the softmax between the products), the OS saves
//! the tile state (XCR0 bits 17 and 18, read with XGETBV), and Linux granted this process
//! the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: without it the
//! first tile instruction kills the process). Asked once; any "no" means the tiles are
//! never offered and the AVX-512 / AVX2 / portable kernels run as before.

use std::sync::OnceLock;

/// Whether the AMX kernels can run in this process (decided once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    cpu_and_os_have_tiles() && request_tile_data()
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// CPUID and XCR0: the instructions exist and the OS manages their state.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn cpu_and_os_have_tiles() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if !crate::backend::cpu::simd::has_avx512() {
        return false;
    }
    #[allow(unused_unsafe)] // CPUID is a safe function in newer toolchains
    let (max_leaf, leaf1, leaf7) = unsafe { (__cpuid(0).eax, __cpuid(1), __cpuid_count(7, 0)) };
    if max_leaf < 7 {
        return false;
    }
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    let amx_bf16 = leaf7.edx & (1 << 22) != 0;
    let amx_tile = leaf7.edx & (1 << 24) != 0;
    // XGETBV faults unless the OS enabled XSAVE (OSXSAVE); ask only then.
    osxsave && amx_bf16 && amx_tile && xcr0_has_tiles(read_xcr0())
}

/// XTILECFG (bit 17) and XTILEDATA (bit 18) of XCR0.
pub fn xcr0_has_tiles(xcr0: u64) -> bool {
    const TILES: u64 = (1 << 17) | (1 << 18);
    xcr0 & TILES == TILES
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn read_xcr0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: called only when CPUID says the OS enabled XSAVE (so XGETBV exists); it reads
    // a register and touches no memory.
    unsafe { std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    (hi as u64) << 32 | lo as u64
}

/// Linux (5.16 and later) gives the tile data state to a process that asks for it.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a syscall with two integer arguments; it changes only this process's
    // permission to use the tile state.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xcr0_needs_both_tile_bits() {
        assert!(xcr0_has_tiles(0x6_00e7));
        assert!(!xcr0_has_tiles(0x2_00e7), "XTILECFG alone");
        assert!(!xcr0_has_tiles(0x4_00e7), "XTILEDATA alone");
        assert!(!xcr0_has_tiles(0xe7));
    }

    /// The answer agrees with /proc/cpuinfo's flags on Linux: AMX is offered only where the
    /// kernel lists amx_tile and amx_bf16 (and the request for the tile data succeeded, which
    /// a kernel listing them grants) together with AVX-512.
    #[test]
    fn the_answer_agrees_with_the_kernels_cpu_flags() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else { return };
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        let listed = cfg!(target_arch = "x86_64") && has("amx_tile") && has("amx_bf16") && has("avx512f");
        assert_eq!(available(), listed, "AMX detected {} but /proc/cpuinfo says {listed}", available());
        assert_eq!(available(), available(), "asked once, the same answer after");
    }
}
