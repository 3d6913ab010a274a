//! The tile instructions themselves (inline assembly: stable Rust has no
//! AMX intrinsics), and whether this process may run them.
//!
//! Linux keeps the tile data (8 KB of state) off until a process asks for
//! it: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once a
//! process ([`status`], asked once). A kernel older than 5.16, a sandbox or
//! a seccomp filter refuses it; the kernel is then not `supported`, and
//! `detect` picks `avx512` instead and says why (`engram_context_info`'s
//! kernel note).

use super::{Config, Tiles};
use std::arch::asm;
use std::sync::OnceLock;

/// The instructions (a worker thread's tiles: configured by each task).
pub(crate) struct Hw;

/// Run `$body` with the tile register `$t` (`0..8`) as an immediate.
macro_rules! with_tile {
    ($t:expr, $body:ident) => {
        match $t {
            0 => $body!("0"),
            1 => $body!("1"),
            2 => $body!("2"),
            3 => $body!("3"),
            4 => $body!("4"),
            5 => $body!("5"),
            6 => $body!("6"),
            7 => $body!("7"),
            _ => unreachable!("palette 1 has 8 tiles"),
        }
    };
}

impl Tiles for Hw {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &Config) {
        // SAFETY: the caller's contract (AMX granted); `cfg` is 64 bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg as *const Config, options(nostack)) };
    }

    #[inline(always)]
    unsafe fn zero(&mut self, t: u8) {
        macro_rules! z {
            ($n:literal) => {
                // SAFETY: the caller's contract (a configured tile).
                unsafe { asm!(concat!("tilezero tmm", $n), options(nostack)) }
            };
        }
        with_tile!(t, z)
    }

    #[inline(always)]
    unsafe fn load(&mut self, t: u8, p: *const u8, stride: usize) {
        macro_rules! l {
            ($n:literal) => {
                // SAFETY: the caller's contract: `p` holds the tile's rows.
                unsafe {
                    asm!(concat!("tileloadd tmm", $n, ", [{p} + {s}*1]"),
                        p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
                }
            };
        }
        with_tile!(t, l)
    }

    #[inline(always)]
    unsafe fn dp(&mut self, c: u8, a: u8, b: u8) {
        // SAFETY: in every arm, the caller's contract (configured tiles
        // whose shapes the instruction accepts).
        unsafe {
            match (c, a, b) {
                (0, 4, 6) => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack)),
                (1, 4, 7) => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack)),
                (2, 5, 6) => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack)),
                (3, 5, 7) => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack)),
                _ => unreachable!("the driver's tiles are C[h][b] = A[h] x B[b]"),
            }
        }
    }

    #[inline(always)]
    unsafe fn store(&mut self, t: u8, p: *mut u8, stride: usize) {
        macro_rules! s {
            ($n:literal) => {
                // SAFETY: the caller's contract: `p` has room for the rows.
                unsafe {
                    asm!(concat!("tilestored [{p} + {s}*1], tmm", $n),
                        p = in(reg) p, s = in(reg) stride, options(nostack))
                }
            };
        }
        with_tile!(t, s)
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        // SAFETY: the caller's contract (the CPU has AMX-TILE).
        unsafe { asm!("tilerelease", options(nostack)) };
    }
}

/// Whether this process runs AMX: `Ok` once the CPU has AMX-TILE and
/// AMX-BF16, the OS enables their state, and Linux granted the tile data;
/// else why not (asked once a process).
pub(crate) fn status() -> &'static Result<(), String> {
    static STATUS: OnceLock<Result<(), String>> = OnceLock::new();
    STATUS.get_or_init(ask)
}

/// CPUID leaf 7 EDX: AMX-BF16 and AMX-TILE.
const AMX_BF16: u32 = 1 << 22;
const AMX_TILE: u32 = 1 << 24;
/// The tile data's XSAVE state component (XFEATURE_XTILEDATA), after
/// XTILECFG's.
const XTILECFG: u32 = 17;
const XTILEDATA: u32 = XTILECFG + 1;
/// XCR0: XTILECFG and XTILEDATA.
const XCR0_TILE: u64 = (1 << XTILECFG) | (1 << XTILEDATA);
/// `arch_prctl` codes (asm/prctl.h).
const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XFEATURE_XTILEDATA: libc::c_long = XTILEDATA as libc::c_long;

fn ask() -> Result<(), String> {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID exists on every x86-64 CPU (the intrinsics are safe); leaf 7 is
    // read only when leaf 0 says it exists.
    let edx7 = (__cpuid(0).eax >= 7).then(|| __cpuid_count(7, 0).edx);
    if edx7.is_none_or(|d| d & (AMX_TILE | AMX_BF16) != AMX_TILE | AMX_BF16) {
        return Err("the CPU has no AMX-TILE and AMX-BF16".into());
    }
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    // SAFETY: XGETBV runs only when CPUID.1:ECX.OSXSAVE says the OS
    // enabled it.
    let xcr0 = osxsave.then(|| unsafe { std::arch::x86_64::_xgetbv(0) });
    if xcr0.is_none_or(|x| x & XCR0_TILE != XCR0_TILE) {
        return Err("the OS does not enable the tile state (XCR0 bits 17-18)".into());
    }
    request()
}

#[cfg(target_os = "linux")]
fn request() -> Result<(), String> {
    // SAFETY: `arch_prctl` with these codes reads and writes only the
    // integers passed (the GET form writes the u64 at `&mut perm`).
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            let e = std::io::Error::last_os_error();
            return Err(format!("Linux refused the tile data (arch_prctl: {e})"));
        }
        let mut perm = 0u64;
        let got = libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut perm as *mut u64,
        );
        if got != 0 || perm & (1 << XFEATURE_XTILEDATA) == 0 {
            return Err("Linux did not grant the tile data (ARCH_GET_XCOMP_PERM)".into());
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn request() -> Result<(), String> {
    Err("tile data is asked for on Linux only".into())
}
