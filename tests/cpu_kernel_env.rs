//! `ENGRAM_CPU_KERNEL` names the CPU backend's projection kernel at
//! `engram_create`: a kernel this CPU runs is used (the context says so in
//! its info), an unknown name or a kernel the CPU lacks is refused with
//! `ERR_INVALID_CONFIG` and a message naming the variable. One test in its
//! own binary: the variable is process-wide, so no other test may create a
//! context while it is set.

use engram::cpu::projection::Kernel;
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{Context, ContextConfig, EngramBackend, EngramStatus, Geometry, HashTablesIn, Limits};

#[test]
fn the_environment_names_the_cpu_kernel() {
    let (ngram, heads) = (2usize, 2usize);
    let cols = (ngram - 1) * heads;
    let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let token_map: Vec<i32> = (0..48).collect();
    let mult = [1u64, 3];
    let cfg = ContextConfig {
        geometry: Geometry {
            d: 64,
            hc: 1,
            hd: 32,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &[1],
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 0,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 4,
            max_seqs: 1,
            max_positions: 8,
        },
        n_threads: 1,
        backend: EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };
    let kernel_of = |name: Option<&str>| {
        match name {
            Some(v) => std::env::set_var("ENGRAM_CPU_KERNEL", v),
            None => std::env::remove_var("ENGRAM_CPU_KERNEL"),
        }
        Context::new(&cfg).map(|c| c.info().kernel)
    };
    let best = format!("{:?}", Kernel::detect()).to_lowercase();
    assert_eq!(kernel_of(None).unwrap(), best);
    assert_eq!(kernel_of(Some("")).unwrap(), best, "empty is unset");
    assert_eq!(kernel_of(Some("portable")).unwrap(), "portable");
    assert_eq!(kernel_of(Some("PORTABLE")).unwrap(), "portable");
    for k in [
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Bf16,
        Kernel::Amx,
    ] {
        let name = format!("{k:?}").to_lowercase();
        match kernel_of(Some(&name)) {
            Ok(got) => {
                assert!(k.supported(), "{name} accepted on a CPU without it");
                assert_eq!(got, name);
            }
            Err(e) => {
                assert!(!k.supported(), "{name} refused on a CPU that runs it: {e}");
                assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
                assert!(e.message.contains("lacks"), "{e}");
                if k == Kernel::Amx {
                    // Why: no AMX on the CPU, no OS support, or Linux refused.
                    assert!(e.message.contains("; amx: "), "{e}");
                }
            }
        }
    }
    let e = kernel_of(Some("avx9\n")).map(|_| ()).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    assert!(
        e.message
            .contains("ENGRAM_CPU_KERNEL=avx9\\n: not a kernel"),
        "{}",
        e.message
    );
    std::env::remove_var("ENGRAM_CPU_KERNEL");
}
