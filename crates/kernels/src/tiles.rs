//! Restoring llama.cpp's AMX tile configuration on the calling thread.
//!
//! ggml's AMX kernels (llama.cpp built for a CPU with AMX) load their tile configuration once per
//! thread and assume it stays loaded. torch's oneDNN kernels configure the tiles for each bf16
//! matrix product and release them afterwards, and in one process both run on the same OpenMP
//! threads (torch and libggml-cpu share the one libgomp.so.1 loaded), so ggml's next tile
//! instruction dies with SIGILL. [`restore_ggml_tiles`] loads ggml's configuration again; the
//! Python side runs it on every thread of the team before a llama_decode.

/// ggml's tile configuration (`ggml_tile_config_init` in ggml-cpu/amx/mmq.cpp of the llama.cpp
/// that llama-cpp-python 0.3.36 vendors): palette 1, tiles 0-1 of 8 rows x 64 bytes, 2-3 of 16 x
/// 32, 4-7 of 16 x 64. Laid out as LDTILECFG reads it: palette, start row, 14 reserved bytes, 16
/// little-endian u16 column widths in bytes, 16 row counts.
#[repr(C, align(64))]
pub struct TileConfig(pub [u8; 64]);

/// The AMX tile configuration llama.cpp's kernels expect.
pub const GGML_TILE_CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let colsb: [u8; 8] = [64, 64, 32, 32, 64, 64, 64, 64];
    let rows: [u8; 8] = [8, 8, 16, 16, 16, 16, 16, 16];
    let mut i = 0;
    while i < 8 {
        c[16 + 2 * i] = colsb[i];
        c[48 + i] = rows[i];
        i += 1;
    }
    TileConfig(c)
};

static CONFIG: TileConfig = GGML_TILE_CONFIG;

/// True when the CPU has AMX-TILE and the OS has enabled tile state (XCR0 bits 17 and 18).
pub fn amx_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let (max_leaf, osxsave) = (__cpuid(0).eax, __cpuid(1).ecx & (1 << 27) != 0);
    let amx_tile = max_leaf >= 7 && __cpuid_count(7, 0).edx & (1 << 24) != 0;
    // SAFETY: XGETBV is available when the OS has set CR4.OSXSAVE (CPUID.1:ECX bit 27).
    amx_tile && osxsave && unsafe { xcr0() } & (3 << 17) == 3 << 17
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
}

/// Loads [`GGML_TILE_CONFIG`] into this thread's tile configuration; does nothing without AMX.
/// A C function taking an unused pointer, so that it can be given to libgomp's `GOMP_parallel`
/// to run on every thread of a team.
pub extern "C" fn restore_ggml_tiles(_data: *mut std::ffi::c_void) {
    #[cfg(target_arch = "x86_64")]
    if amx_usable() {
        // SAFETY: the CPU has AMX-TILE and the OS enabled its state (checked above); LDTILECFG
        // reads 64 bytes of a valid palette-1 configuration and touches no other memory.
        unsafe {
            std::arch::asm!(
                "ldtilecfg [{}]",
                in(reg) CONFIG.0.as_ptr(),
                options(nostack, readonly, preserves_flags)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_layout_is_ldtilecfgs() {
        let c = &GGML_TILE_CONFIG.0;
        assert_eq!(c[0], 1);
        assert_eq!(u16::from_le_bytes([c[16], c[17]]), 64);
        assert_eq!(u16::from_le_bytes([c[20], c[21]]), 32);
        assert_eq!(&c[48..56], &[8, 8, 16, 16, 16, 16, 16, 16]);
        assert!(c[56..].iter().all(|&r| r == 0) && c[1..16].iter().all(|&b| b == 0));
        assert_eq!(std::mem::align_of::<TileConfig>(), 64);
    }

    #[test]
    fn restoring_runs_with_or_without_amx() {
        // With AMX the configuration really loads (a wrong one would fault: #GP); without, no-op.
        restore_ggml_tiles(std::ptr::null_mut());
    }
}
