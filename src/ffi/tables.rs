//! Hash tables from a model's `config.json` and `tokenizer.json`.

use super::boundary::{give_object, non_null, object, path_arg, take_object};
use super::context::EngramConfig;
use crate::error::EngramStatus;
use std::ffi::c_char;

/// Hash tables derived from a model's `config.json` and `tokenizer.json`
/// (`engram_tables_from_files`). Free with `engram_tables_free`.
pub struct EngramTablesHandle {
    inner: crate::tables::EngramTables,
}

/// Derive the hash tables (token map, multipliers, primes, offsets) from a
/// model's `config.json` (its engram fields; docs/loading.md lists the
/// names accepted) and its Hugging Face `tokenizer.json`, as docs/math.md
/// states.
/// On success `*out` receives an object to pass to `engram_tables_fill_config`
/// and to free with `engram_tables_free`; on failure `*out` is left as it was
/// (`ENGRAM_STATUS_ERR_IO` for a file that cannot be read,
/// `ENGRAM_STATUS_ERR_INVALID_CONFIG` for missing or inconsistent fields).
///
/// `config_json` and `tokenizer_json` must be NULL or NUL-terminated paths;
/// `out` NULL or writable.
#[no_mangle]
pub extern "C" fn engram_tables_from_files(
    config_json: *const c_char,
    tokenizer_json: *const c_char,
    out: *mut *mut EngramTablesHandle,
) -> EngramStatus {
    ffi_boundary!({
        let c = path_arg(config_json, "config_json")?;
        let t = path_arg(tokenizer_json, "tokenizer_json")?;
        non_null(out, "out")?;
        let inner = crate::tables::EngramTables::from_files(c, t)?;
        give_object(out, EngramTablesHandle { inner });
        Ok(())
    })
}

/// Point `cfg`'s hash fields at the tables (`n_heads`, `max_ngram`,
/// `layer_ids`/`n_layers`, `token_map`/`token_map_len`, `pad_id`,
/// `multipliers`, `primes`, `offsets` and their counts) and set
/// `hidden_size`, `hc` and `head_dim` where the config.json gave them (the
/// other fields are left as they are). A `hidden_size`, `hc` or `head_dim`
/// above 2^32 - 1, which the 32-bit fields cannot hold, is
/// `ENGRAM_STATUS_ERR_INVALID_CONFIG` and `cfg` is left as it was. The pointers stay valid until
/// `engram_tables_free`; `engram_create` copies them, so the tables may be
/// freed once the context exists.
///
/// `tables` must be NULL or from `engram_tables_from_files`; `cfg` NULL or a
/// struct filled by `engram_config_init`.
#[no_mangle]
pub extern "C" fn engram_tables_fill_config(
    tables: *const EngramTablesHandle,
    cfg: *mut EngramConfig,
) -> EngramStatus {
    ffi_boundary!({
        let t = &object(tables, "tables")?.inner;
        let mut c = EngramConfig::read(cfg)?;
        // The config's sizes must fit the struct's u32 fields: one that does
        // not is refused (nothing written), never skipped.
        let small = |v: Option<usize>, name: &str| -> crate::error::Result<Option<u32>> {
            v.map(|x| {
                u32::try_from(x).map_err(|_| {
                    crate::error::Error::new(
                        EngramStatus::ErrInvalidConfig,
                        format!(
                            "config.json: {name} = {x} does not fit engram_config's 32-bit field"
                        ),
                    )
                })
            })
            .transpose()
        };
        let hidden_size = small(t.config.hidden_size, "hidden size")?;
        let hc = small(t.config.hc, "hc_mult")?;
        let head_dim = small(t.config.head_dim, "head dim")?;
        c.n_heads = t.config.n_heads as u32;
        c.max_ngram = t.config.max_ngram as u32;
        c.layer_ids = t.config.layer_ids.as_ptr();
        c.n_layers = t.config.layer_ids.len() as u32;
        c.token_map = t.token_map.as_ptr();
        c.token_map_len = t.token_map.len();
        c.pad_id = t.pad_id;
        c.multipliers = t.multipliers.as_ptr();
        c.n_multipliers = t.multipliers.len();
        c.primes = t.primes.as_ptr();
        c.n_primes = t.primes.len();
        c.offsets = t.offsets.as_ptr();
        c.n_offsets = t.offsets.len();
        if let Some(d) = hidden_size {
            c.hidden_size = d;
        }
        if let Some(h) = hc {
            c.hc = h;
        }
        if let Some(h) = head_dim {
            c.head_dim = h;
        }
        super::boundary::write_options(cfg, c, c.struct_size);
        Ok(())
    })
}

/// Rows the table of engram layer `layer_id` has (the sum of its primes), or 0
/// when `tables` is NULL or the layer is not an engram layer.
///
/// `tables` must be NULL or from `engram_tables_from_files`.
#[no_mangle]
pub extern "C" fn engram_tables_layer_rows(
    tables: *const EngramTablesHandle,
    layer_id: u32,
) -> u64 {
    ffi_boundary!({
        object(tables, "tables").map_or(0, |t| {
            let t = &t.inner;
            t.config
                .layer_ids
                .iter()
                .position(|&l| l == layer_id)
                .map_or(0, |i| t.rows[i])
        })
    })
}

/// Distinct compressed token ids of the tables' token map (0 for NULL).
///
/// `tables` must be NULL or from `engram_tables_from_files`.
#[no_mangle]
pub extern "C" fn engram_tables_compressed_vocab(tables: *const EngramTablesHandle) -> usize {
    ffi_boundary!({ object(tables, "tables").map_or(0, |t| t.inner.compressed_vocab) })
}

/// Free tables from `engram_tables_from_files`. NULL is a no-op.
///
/// `tables` must be NULL or from `engram_tables_from_files`, not yet freed.
#[no_mangle]
pub extern "C" fn engram_tables_free(tables: *mut EngramTablesHandle) {
    ffi_boundary!({ drop(take_object(tables)) })
}
