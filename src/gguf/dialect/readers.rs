//! Each dialect's reader: its keys and tensors into a [`Partial`].

use super::*;

fn layer_ids(m: &Meta<'_>, key: &str) -> Result<Named<Vec<u32>>> {
    let v = m
        .ints(key, to_u32, "a layer id (u32)")?
        .ok_or_else(|| fmt_err(format!("{key} is missing")))?;
    if v.value.is_empty() {
        bail!(ErrFormat, "{key} is empty: no engram layers");
    }
    Ok(v)
}

fn weight(m: &Meta<'_>, name: &str, what: &str) -> Result<WeightBlob> {
    let t = m.tensor_req(name, what)?;
    let blob = m.blob(t)?;
    let source = if t.1.ty == GGML_F16 {
        WeightSource::F16
    } else {
        WeightSource::Direct(t.1.ty)
    };
    Ok(WeightBlob { blob, source })
}

/// One layer: its table, then its wkv, q and k tensors (named in that
/// order), each required "for engram layer {lid}".
fn partial_layer(
    m: &Meta<'_>,
    lid: u32,
    table: TableSpec,
    [wkv, q, k]: [String; 3],
) -> Result<PartialLayer> {
    let what = format!("for engram layer {lid}");
    Ok(PartialLayer {
        layer_id: lid,
        table,
        wkv: weight(m, &wkv, &what)?,
        q: weight(m, &q, &what)?,
        k: weight(m, &k, &what)?,
    })
}

/// A table in a ggml row format (vcruz305): `[Hd, rows]`.
fn gguf_table(m: &Meta<'_>, name: &str, lid: u32) -> Result<TableBlobs> {
    let t = m.tensor_req(name, &format!("for engram layer {lid}"))?;
    let blob = m.blob(t)?;
    let ty = t.1.ty;
    let format = match EngramType::from_u32(ty) {
        Some(f)
            if ty != EngramType::Fp8E4m3E8m0 as u32
                && ty != EngramType::Fp8E4m3E8m0Split as u32 =>
        {
            f
        }
        _ => bail!(
            ErrUnsupported,
            "tensor {} has ggml type {ty}, which this library does not take as table rows \
             (f32, f16, bf16, q8_0, q4_0, q2_K .. q6_K)",
            t.1.name
        ),
    };
    Ok(TableBlobs {
        format,
        rows: dim(&blob, 1),
        codes: blob,
        scales: None,
    })
}

/// A split fp8 table (tarruda, JigSawPT): codes `I8 [Hd, rows]`, scales
/// `I8 [Hd/32, rows]`.
fn split_table(m: &Meta<'_>, codes: &str, scales: &str, lid: u32) -> Result<TableBlobs> {
    let c = m.tensor_req(codes, &format!("for engram layer {lid}"))?;
    let s = m.tensor_req(
        scales,
        &format!("for engram layer {lid} (its table's e8m0 scales)"),
    )?;
    for t in [c, s] {
        if t.1.ty != GGML_I8 {
            bail!(
                ErrFormat,
                "tensor {} has ggml type {}, expected i8 (fp8 {} bytes)",
                t.1.name,
                t.1.ty,
                if t.0 == c.0 && t.1.name == c.1.name {
                    "e4m3 code"
                } else {
                    "e8m0 scale"
                }
            );
        }
    }
    let (cb, sb) = (m.blob(c)?, m.blob(s)?);
    let (hd, rows) = (dim(&cb, 0), dim(&cb, 1));
    if !hd.is_multiple_of(FP8_SCALE_BLOCK as u64) || hd == 0 {
        bail!(
            ErrFormat,
            "tensor {} has rows of {hd} fp8 codes, not a positive multiple of {FP8_SCALE_BLOCK}",
            cb.name
        );
    }
    if cb.dims.len() > 2 || sb.dims.len() > 2 || dim(&sb, 0) != hd / 32 || dim(&sb, 1) != rows {
        bail!(
            ErrFormat,
            "tensor {} has shape {:?}, expected [{}, {rows}] (one e8m0 scale per {FP8_SCALE_BLOCK} of the {hd} codes \
             of each of the {rows} rows of {})",
            sb.name,
            sb.dims,
            hd / 32,
            cb.name
        );
    }
    Ok(TableBlobs {
        format: EngramType::Fp8E4m3E8m0Split,
        rows,
        codes: cb,
        scales: Some(sb),
    })
}

fn named<T>(key: &str, value: T) -> Named<T> {
    Named {
        key: key.to_string(),
        value,
    }
}

fn keys5(p: &str, names: [&str; 5]) -> [String; 5] {
    names.map(|n| format!("{p}{n}"))
}

pub(super) fn vcruz305(m: &Meta<'_>, dialect: Dialect) -> Result<Partial> {
    let arch = architecture(m.set)?;
    let own = format!("{arch}.engram.");
    let key = |k: &str| vcruz305_key(m, dialect, &own, k);
    let p = if dialect == Dialect::Vcruz305 {
        own.clone()
    } else {
        "deepseek4.engram.".to_string()
    };
    let layer_ids = layer_ids(m, &key("layer_ids")?)?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |n: &str| format!("blk.{lid}.{n}");
        let table = TableSpec::InFile(gguf_table(m, &t("engram_embd"), lid)?);
        let names = [t("engram_wkv"), t("engram_q"), t("engram_k")];
        layers.push(partial_layer(m, lid, table, names)?);
    }
    let pad = m
        .uint(&key("pad_id")?)?
        .map(|v| (v, vcruz305_pad_reading(dialect, &layers)));
    Ok(Partial {
        dialect,
        n_heads: m.uint(&key("head_count")?)?,
        max_ngram: m.uint(&key("max_ngram_size")?)?,
        hd: m.uint(&key("key_length")?)?,
        multipliers: m.ints(
            &key("multipliers")?,
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?,
        primes: m.ints(&key("primes")?, to_pos_i64, "a prime (a positive i64)")?,
        offsets: m.ints(
            &key("offsets")?,
            to_pos_i64,
            "an offset (a non-negative i64)",
        )?,
        token_map: m.ints(&key("token_map")?, to_token, "a compressed id or -1")?,
        pad,
        rows: None,
        compressed_vocab: None,
        engram_vocab: None,
        d_key: None,
        hc_key: None,
        const_keys: keys5(
            &p,
            ["multipliers", "primes", "offsets", "token_map", "pad_id"],
        ),
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

/// A vcruz305 key's name: `{arch}.engram.{k}`. The prefix variant's keys
/// are spelled deepseek4.engram.* (the first spelling taken where only it
/// is present); a key present under both spellings is refused.
fn vcruz305_key(m: &Meta<'_>, dialect: Dialect, own: &str, k: &str) -> Result<String> {
    let a = format!("{own}{k}");
    if dialect == Dialect::Vcruz305 {
        return Ok(a);
    }
    let b = format!("deepseek4.engram.{k}");
    match (m.has(&a), m.has(&b)) {
        (true, true) if a != b => bail!(ErrFormat, "{a} and {b} are both present"),
        (true, _) => Ok(a),
        _ => Ok(b),
    }
}

/// How a vcruz305 file's pad reads. The early prefix converter's pad key
/// shares its name with deepstrix's raw pad. A file that carries its tables
/// is not deepstrix's (deepstrix files never do): its pad is vcruz305's
/// compressed id. Only a file without that evidence would be ambiguous
/// (refused where the two readings differ and nothing else decides).
fn vcruz305_pad_reading(dialect: Dialect, layers: &[PartialLayer]) -> PadReading {
    let tables_inside = !layers.is_empty()
        && layers
            .iter()
            .all(|l| matches!(l.table, TableSpec::InFile(_)));
    if dialect == Dialect::Vcruz305 || tables_inside {
        PadReading::Compressed
    } else {
        PadReading::Ambiguous
    }
}

pub(super) fn ds4(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek41.engram.";
    let k = |s: &str| format!("{p}{s}");
    ds4_refuse_external(m, p)?;
    let enc_key = k("encoding");
    let enc = m.string(&enc_key)?.expect("detected by it");
    let row_bytes = ds4_row_bytes(&enc_key, &enc)?;
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    let encoding = Ds4Encoding {
        key: &enc_key,
        value: &enc,
        row_bytes,
    };
    let hd = ds4_hd(m, &encoding, &layer_ids)?;
    let Ds4Ngram {
        multipliers,
        primes,
        n,
        h,
    } = ds4_ngram(m, p, &layer_ids)?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        layers.push(ds4_layer(m, lid, &encoding)?);
    }
    Ok(Partial {
        dialect: Dialect::Ds4,
        n_heads: Some(named(&format!("{} (length)", primes.key), h as u64)),
        max_ngram: Some(named(&format!("{} (length)", multipliers.key), n as u64)),
        hd: Some(named(&enc_key, hd)),
        offsets: None,
        token_map: m.ints(&k("token_map"), to_token, "a compressed id or -1")?,
        pad: m.uint(&k("pad_id"))?.map(|v| (v, PadReading::Compressed)),
        rows: m.ints(&k("rows"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: m.uint("deepseek41.hidden_size")?,
        hc_key: m.uint("deepseek41.hc_mult")?,
        const_keys: keys5(
            p,
            ["multipliers", "primes", "offsets", "token_map", "pad_id"],
        ),
        const_source: "gguf",
        multipliers: Some(multipliers),
        primes: Some(primes),
        layer_ids,
        layers,
    })
}

/// ds4's table encoding: the key, its value, and the bytes a row it says.
struct Ds4Encoding<'a> {
    key: &'a str,
    value: &'a str,
    row_bytes: u64,
}

/// A ds4 file whose tables are in sidecar files is refused, saying what to
/// open instead.
fn ds4_refuse_external(m: &Meta<'_>, p: &str) -> Result<()> {
    let k = |s: &str| format!("{p}{s}");
    if let Some(st) = m.string(&k("storage"))? {
        if st == "external" {
            bail!(
                ErrUnsupported,
                "{} is \"external\": this ds4 file keeps its tables in sidecar files ({}, at {}), \
                 in an encoding this library does not read; open the original checkpoint with \
                 engram_create_from_safetensors instead",
                k("storage"),
                k("external_paths"),
                k("external_offsets")
            );
        }
    }
    Ok(())
}

/// The bytes a row from the encoding's name, `e4m3_e8m0_32_row<B>`.
fn ds4_row_bytes(enc_key: &str, enc: &str) -> Result<u64> {
    enc.strip_prefix("e4m3_e8m0_32_row")
        .and_then(|b| b.parse::<u64>().ok())
        .ok_or_else(|| {
            Error::new(
                EngramStatus::ErrUnsupported,
                format!(
                    "{enc_key} is {enc:?}; this library reads ds4's e4m3_e8m0_32_row<B> encoding (B bytes a row: \
                     Hd e4m3 codes, then Hd/32 e8m0 scales)"
                ),
            )
        })
}

/// Hd from the bytes a row (`Hd + Hd/32`), refused when none fits.
fn ds4_hd(m: &Meta<'_>, e: &Ds4Encoding<'_>, layer_ids: &Named<Vec<u32>>) -> Result<u64> {
    let (enc_key, enc, row_bytes) = (e.key, e.value, e.row_bytes);
    if row_bytes == 0 || !row_bytes.is_multiple_of(33) {
        let first = format!("blk.{}.engram_embd.weight", layer_ids.value[0]);
        let table = m
            .tensor(&first)
            .map_or(format!("{first} is missing"), |(_, t)| {
                format!("{} has rows of {} bytes", t.name, t.dims[0])
            });
        bail!(
            ErrFormat,
            "{enc_key} = {enc}: {row_bytes} bytes a row is not Hd + Hd/32 for any Hd ({table})"
        );
    }
    Ok(row_bytes / 33 * 32)
}

/// ds4's multipliers and primes, and N and H from their lengths.
struct Ds4Ngram {
    multipliers: Named<Vec<u64>>,
    primes: Named<Vec<u64>>,
    n: usize,
    h: usize,
}

/// The multipliers and primes, and N and H from their lengths.
fn ds4_ngram(m: &Meta<'_>, p: &str, layer_ids: &Named<Vec<u32>>) -> Result<Ds4Ngram> {
    let k = |s: &str| format!("{p}{s}");
    let nl = layer_ids.value.len();
    let multipliers = m
        .ints(
            &k("multipliers"),
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("multipliers"))))?;
    let primes = m
        .ints(&k("primes"), to_pos_i64, "a prime (a positive i64)")?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("primes"))))?;
    // N and H from the array lengths.
    let nm = multipliers.value.len();
    if nm == 0 || !nm.is_multiple_of(nl) || nm / nl < 2 {
        bail!(
            ErrFormat,
            "{} has {nm} entries: not a whole number (at least 2) of multipliers for each of the {nl} layers of {}",
            multipliers.key,
            layer_ids.key
        );
    }
    let n = nm / nl;
    let np = primes.value.len();
    if np == 0 || !np.is_multiple_of(nl * (n - 1)) {
        bail!(
            ErrFormat,
            "{} has {np} entries: not whole layers of (N-1) x H for {nl} layers and N = {n} (from {})",
            primes.key,
            multipliers.key
        );
    }
    let h = np / (nl * (n - 1));
    Ok(Ds4Ngram {
        multipliers,
        primes,
        n,
        h,
    })
}

/// One ds4 layer: its table (i8 rows of the encoding's bytes) and weights.
fn ds4_layer(m: &Meta<'_>, lid: u32, encoding: &Ds4Encoding<'_>) -> Result<PartialLayer> {
    let (enc_key, enc, row_bytes) = (encoding.key, encoding.value, encoding.row_bytes);
    let t = |s: &str| format!("blk.{lid}.{s}.weight");
    let what = format!("for engram layer {lid}");
    let e = m.tensor_req(&t("engram_embd"), &what)?;
    let blob = m.blob(e)?;
    if e.1.ty != GGML_I8 || blob.dims.len() > 2 || dim(&blob, 0) != row_bytes {
        bail!(
            ErrFormat,
            "tensor {} is {} {:?}, but {enc_key} = {enc} says rows of {row_bytes} bytes (i8 [{row_bytes}, rows])",
            blob.name,
            crate::formats::GGML_BLOCKS
                .iter()
                .find(|x| x.0 == e.1.ty)
                .map_or("unknown", |x| x.1),
            blob.dims
        );
    }
    let table = TableSpec::InFile(TableBlobs {
        format: EngramType::Fp8E4m3E8m0,
        rows: dim(&blob, 1),
        codes: blob,
        scales: None,
    });
    let names = [t("engram_kv"), t("engram_q_norm"), t("engram_k_norm")];
    partial_layer(m, lid, table, names)
}

pub(super) fn tarruda(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek41.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layers"))?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let codes = (t("engram_embd"), t("engram_embd_scale"));
        let table = TableSpec::InFile(split_table(m, &codes.0, &codes.1, lid)?);
        let names = [t("engram_kv"), t("engram_q_weight"), t("engram_k_weight")];
        layers.push(partial_layer(m, lid, table, names)?);
    }
    Ok(Partial {
        dialect: Dialect::Tarruda,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: m.ints(
            &k("multipliers"),
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?,
        primes: m.ints(
            &k("head_bucket_sizes"),
            to_pos_i64,
            "a prime (a positive i64)",
        )?,
        // tarruda's loader requires the offsets (exact prefix sums).
        offsets: Some(
            m.ints(
                &k("head_offsets"),
                to_pos_i64,
                "an offset (a non-negative i64)",
            )?
            .ok_or_else(|| fmt_err(format!("{} is missing", k("head_offsets"))))?,
        ),
        token_map: m.ints(&k("token_map"), to_token, "a compressed id or -1")?,
        pad: m.uint(&k("pad_token_id"))?.map(|v| (v, PadReading::Raw)),
        rows: m.ints(&k("embedding_counts"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: m.uint("deepseek41.embedding_length")?,
        hc_key: m.uint("deepseek41.hyper_connection.count")?,
        const_keys: keys5(
            p,
            [
                "multipliers",
                "head_bucket_sizes",
                "head_offsets",
                "token_map",
                "pad_token_id",
            ],
        ),
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

pub(super) fn jigsawpt(m: &Meta<'_>) -> Result<Partial> {
    if m.boolean("deepseek41.engram.present")? == Some(false) {
        bail!(
            ErrFormat,
            "deepseek41.engram.present is false: the converter ran without its engram option, so the \
             file has no engram tables; convert again with them, or open the checkpoint with \
             engram_create_from_safetensors"
        );
    }
    let f = |s: &str| format!("deepseek41.engram_{s}");
    let layer_ids = layer_ids(m, "deepseek41.engram.layer_ids")?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let codes = (t("engram_embd"), t("engram_embd_scale"));
        let table = TableSpec::InFile(split_table(m, &codes.0, &codes.1, lid)?);
        let names = [t("engram_wkv"), t("engram_q"), t("engram_k")];
        layers.push(partial_layer(m, lid, table, names)?);
    }
    let cname = |s: &str| {
        // The constants are tensors, with or without `.weight`.
        let w = format!("engram_{s}.weight");
        if m.tensor(&w).is_some() {
            w
        } else {
            format!("engram_{s}")
        }
    };
    let req = |s: &str| -> Result<String> {
        let n = cname(s);
        m.tensor_req(&n, "(a hash constant of this dialect)")?;
        Ok(n)
    };
    Ok(Partial {
        dialect: Dialect::JigSawPT,
        n_heads: Some(m.uint_req(&f("n_heads"))?),
        max_ngram: Some(m.uint_req(&f("max_ngram_size"))?),
        hd: Some(m.uint_req(&f("head_dim"))?),
        multipliers: m.tensor_ints(&req("multipliers")?, to_pos_i64, "a positive i64")?,
        primes: m.tensor_ints(&req("primes")?, to_pos_i64, "a positive i64")?,
        offsets: m.tensor_ints(&req("offsets")?, to_pos_i64, "a non-negative i64")?,
        token_map: m.tensor_ints(&req("token_map")?, to_token, "a compressed id or -1")?,
        pad: Some((m.uint_req(&f("pad_token_id"))?, PadReading::Raw)),
        rows: m.ints(
            "deepseek41.engram.num_embeddings",
            to_pos_i64,
            "a row count",
        )?,
        compressed_vocab: m.uint(&f("compressed_vocab_size"))?,
        engram_vocab: m.uint(&f("vocab_size"))?,
        d_key: None,
        hc_key: None,
        const_keys: [
            cname("multipliers"),
            cname("primes"),
            cname("offsets"),
            cname("token_map"),
            f("pad_token_id"),
        ],
        const_source: "gguf tensors",
        layer_ids,
        layers,
    })
}

pub(super) fn deepstrix(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek4.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    let shards_key = k("table_shards");
    let shards = m.strings(&shards_key)?.expect("detected by it");
    if shards.len() != layer_ids.value.len() {
        bail!(
            ErrFormat,
            "{shards_key} has {} paths for the {} engram layers of {}",
            shards.len(),
            layer_ids.value.len(),
            layer_ids.key
        );
    }
    let mut layers = Vec::new();
    for (&lid, recorded) in layer_ids.value.iter().zip(shards) {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let table = TableSpec::External(External::Shard {
            key: shards_key.clone(),
            recorded,
            layer_id: lid,
        });
        let names = [t("engram_wkv"), t("engram_q"), t("engram_k")];
        layers.push(partial_layer(m, lid, table, names)?);
    }
    Ok(Partial {
        dialect: Dialect::Deepstrix,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("max_ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: None,
        primes: None,
        offsets: None,
        token_map: None,
        pad: Some((m.uint_req(&k("pad_id"))?, PadReading::Raw)),
        rows: m.ints(&k("num_embeddings"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: Some(m.uint_req(&k("vocab_size"))?),
        d_key: m.uint("deepseek4.embedding_length")?,
        hc_key: m.uint("deepseek4.hyper_connection.count")?,
        const_keys: [
            "multipliers".into(),
            "primes".into(),
            "offsets".into(),
            "token_map".into(),
            k("pad_id"),
        ],
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

pub(super) fn ds4gw(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek4.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    let rows = m
        .ints(&k("num_embeddings"), to_pos_i64, "a row count")?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("num_embeddings"))))?;
    if rows.value.len() != layer_ids.value.len() {
        bail!(
            ErrFormat,
            "{} has {} entries for the {} engram layers of {}",
            rows.key,
            rows.value.len(),
            layer_ids.value.len(),
            layer_ids.key
        );
    }
    let mut layers = Vec::new();
    for (i, &lid) in layer_ids.value.iter().enumerate() {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let path_key = k(&format!("{i}.table_path"));
        let weight_key = k(&format!("{i}.weight_offset"));
        let scale_key = k(&format!("{i}.scale_offset"));
        let recorded = m
            .string(&path_key)?
            .ok_or_else(|| fmt_err(format!("{path_key} is missing")))?;
        let table = TableSpec::External(External::Offsets {
            recorded,
            layer_id: lid,
            weight_offset: m.uint_req(&weight_key)?.value,
            scale_offset: m.uint_req(&scale_key)?.value,
            rows: rows.value[i],
            path_key,
            weight_key,
            scale_key,
        });
        let names = [t("engram_wkv"), t("engram_q"), t("engram_k")];
        layers.push(partial_layer(m, lid, table, names)?);
    }
    let c = |s: &str| format!("engram.{s}");
    let req = |s: &str| -> Result<String> {
        m.tensor_req(&c(s), "(a hash constant of this dialect)")?;
        Ok(c(s))
    };
    Ok(Partial {
        dialect: Dialect::Ds4gw,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("max_ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: m.tensor_ints(&req("multipliers")?, to_pos_i64, "a positive i64")?,
        primes: m.tensor_ints(&req("primes")?, to_pos_i64, "a positive i64")?,
        offsets: m.tensor_ints(&req("offsets")?, to_pos_i64, "a non-negative i64")?,
        token_map: m.tensor_ints(&req("token_map")?, to_token, "a compressed id or -1")?,
        pad: Some((m.uint_req(&k("pad_id_compressed"))?, PadReading::Compressed)),
        rows: Some(rows),
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: None,
        hc_key: None,
        const_keys: [
            c("multipliers"),
            c("primes"),
            c("offsets"),
            c("token_map"),
            k("pad_id_compressed"),
        ],
        const_source: "gguf tensors",
        layer_ids,
        layers,
    })
}
