//! The floating-point mode the library computes in, whatever the caller's.
//!
//! The kernels' results are exact only in the default IEEE mode: subnormals
//! kept (no flush-to-zero, no denormals-are-zero), round to nearest even,
//! every exception masked. An engine may run its threads in another mode
//! (`torch.set_flush_denormal(True)`, a `-ffast-math` binary's start-up code
//! set MXCSR's FTZ and DAZ bits), and a thread started by a call inherits
//! the mode of the thread that started it. So every export sets this mode
//! for its body ([`FpMode::enter`], in `ffi_boundary!`) and restores the
//! caller's on return, and the pool's threads set it for every task they
//! run (docs/numerics.md, "The floating-point mode").
//!
//! x86_64: MXCSR (the SSE/AVX control and status register) becomes
//! `0x1F80`. aarch64: FPCR becomes 0 (no flush-to-zero, default NaN off,
//! round to nearest, no traps). Other targets: nothing is changed.

/// The library's mode while alive; the mode found at [`FpMode::enter`] is
/// put back when dropped (also when a panic unwinds through it).
#[must_use = "the mode is restored when the guard is dropped"]
pub struct FpMode {
    /// The caller's control register, `None` when it was already the
    /// library's (nothing to restore).
    saved: Option<u64>,
}

/// MXCSR at reset: the six exceptions masked, round to nearest, FTZ and
/// DAZ off, no flag raised.
#[cfg(target_arch = "x86_64")]
const LIBRARY_MXCSR: u32 = 0x1F80;

/// MXCSR's exception flags (sticky status bits, not part of the mode).
#[cfg(target_arch = "x86_64")]
const MXCSR_FLAGS: u32 = 0x3F;

#[cfg(target_arch = "x86_64")]
fn read() -> u64 {
    let mut v: u32 = 0;
    // SAFETY: `stmxcsr` stores the 4-byte register into `v`, a live local
    // of that size; SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags));
    }
    v as u64
}

#[cfg(target_arch = "x86_64")]
fn write(v: u64) {
    let v = v as u32;
    // SAFETY: `ldmxcsr` loads 4 bytes from `v`, a live local; every value
    // written is one read from the register or `LIBRARY_MXCSR` (no
    // reserved bit set, which would fault).
    unsafe {
        std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly));
    }
}

#[cfg(target_arch = "x86_64")]
fn is_library(v: u64) -> bool {
    (v as u32) & !MXCSR_FLAGS == LIBRARY_MXCSR
}

#[cfg(target_arch = "x86_64")]
const LIBRARY: u64 = LIBRARY_MXCSR as u64;

#[cfg(target_arch = "aarch64")]
fn read() -> u64 {
    let v: u64;
    // SAFETY: reading FPCR has no side effect and is allowed at EL0.
    unsafe {
        std::arch::asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags));
    }
    v
}

#[cfg(target_arch = "aarch64")]
fn write(v: u64) {
    // SAFETY: writing FPCR at EL0 is allowed; every value written is one
    // read from the register or 0 (the architecture's default mode).
    unsafe {
        std::arch::asm!("msr fpcr, {}", in(reg) v, options(nomem, nostack, preserves_flags));
    }
}

#[cfg(target_arch = "aarch64")]
fn is_library(v: u64) -> bool {
    v == LIBRARY
}

#[cfg(target_arch = "aarch64")]
const LIBRARY: u64 = 0;

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn read() -> u64 {
    0
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn write(_: u64) {}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn is_library(_: u64) -> bool {
    true
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const LIBRARY: u64 = 0;

impl FpMode {
    /// Switch the calling thread to the library's mode until the guard is
    /// dropped. Costs a register read when the mode is already the
    /// library's.
    pub fn enter() -> FpMode {
        let cur = read();
        if is_library(cur) {
            return FpMode { saved: None };
        }
        write(LIBRARY);
        FpMode { saved: Some(cur) }
    }

    /// Set the library's mode on the calling thread for good (the pool's
    /// threads, which run nothing else).
    pub fn set_for_thread() {
        if !is_library(read()) {
            write(LIBRARY);
        }
    }
}

impl Drop for FpMode {
    fn drop(&mut self) {
        if let Some(v) = self.saved {
            write(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_callers_mode_is_restored() {
        const FTZ_DAZ: u64 = (1 << 15) | (1 << 6);
        let before = read();
        write(LIBRARY | FTZ_DAZ);
        {
            let _g = FpMode::enter();
            assert!(is_library(read()));
            // Subnormals survive in the library's mode.
            let tiny = std::hint::black_box(f32::MIN_POSITIVE);
            assert_ne!(std::hint::black_box(tiny * 0.5), 0.0);
        }
        assert_eq!(read(), LIBRARY | FTZ_DAZ);
        write(before);
    }
}
