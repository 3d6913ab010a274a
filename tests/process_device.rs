//! `engram::cuda::set_process_device`, the SIMT emulation's entry point for
//! programs that reach the library only through its C ABI
//! (`tools/engram-emu`, which the Python distributed test loads): a CUDA
//! context whose tuning names no device runs on the process device, with the
//! bits of one given the same device explicitly; another ordinal is refused;
//! `None` goes back to opening the driver's devices. A test binary of its
//! own, since the process device is global.

mod common;

use common::device::{emulated, real, DevWeights};
use common::*;
use engram::{Context, EngramBackend, EngramStatus, RowIds};

const NULL: *mut std::ffi::c_void = std::ptr::null_mut();

/// Layer 0 of `tiny` applied on a fresh CUDA context of `cfg`: the highway's bits.
fn apply_layer0(
    tiny: &Tiny,
    cfg: &engram::ContextConfig<'_>,
    dev: &common::device::Dev,
) -> engram::Result<Vec<u32>> {
    let ctx = Context::new(cfg)?;
    let l = &tiny.layers[0];
    let w = DevWeights::upload(dev, l);
    ctx.set_layer_device(&w.layer_in(l))?;
    let n = 5;
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&[3, 1, -1, 4, 1], &[0; 5], &[0, 1, 2, 3, 4], &mut ids)?;
    let x = values("process_device highway", n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&x);
    ctx.apply_device(l.layer_id, RowIds::Host(&ids), n, hw.ptr, 0, NULL)?;
    ctx.check_device(NULL)?;
    Ok(hw
        .read::<f32>(x.len())
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect())
}

#[test]
fn a_context_without_a_device_runs_on_the_process_device() {
    let Some(dev) = emulated() else { return };
    let emu = dev.emu.clone().expect("the emulation");
    let tiny = Tiny::load();
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    let mut given = tiny.config(Tiny::limits());
    given.backend = EngramBackend::Cuda as u32;
    given.tuning.cuda.device = Some(dev.gpu.clone());
    let want = apply_layer0(&tiny, &given, &dev).expect("the device given in the tuning");

    assert!(cfg.tuning.cuda.device.is_none());
    assert!(engram::cuda::set_process_device(Some(dev.gpu.clone())).is_none());
    let before = emu.launches().values().sum::<u64>();
    let got = apply_layer0(&tiny, &cfg, &dev).expect("a context on the process device");
    assert!(
        emu.launches().values().sum::<u64>() > before,
        "the apply launched nothing on the emulation"
    );
    assert_eq!(got, want, "the process device's apply differs");

    // The emulation is device 0: another ordinal is refused, not opened.
    cfg.device = 1;
    let e = Context::new(&cfg).err().expect("device 1 refused");
    assert_eq!(e.status, EngramStatus::ErrDevice, "{}", e.message);
    assert!(e.message.contains("device 1"), "{}", e.message);
    cfg.device = 0;

    // Back to the driver's devices.
    let old = engram::cuda::set_process_device(None).expect("the emulation was set");
    assert_eq!(old.describe(), dev.gpu.describe());
    assert!(engram::cuda::process_device().is_none());
    if real().is_none() {
        let before = emu.launches().values().sum::<u64>();
        assert!(
            Context::new(&cfg).is_err(),
            "a CUDA context without a GPU or a process device"
        );
        assert_eq!(emu.launches().values().sum::<u64>(), before);
    }
}
