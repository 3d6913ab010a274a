//! [`Partial::finish`]: the model completed with the companion files, the pad
//! settled, and every tensor's shape checked.

use super::*;
use std::borrow::Cow;

impl Partial {
    /// Complete the model: geometry (keys, else the companion config), hash
    /// constants (the file's, the companion's, or derived from the file's
    /// config keys and a tokenizer), the pad, and every tensor's shape.
    /// `tables` holds each layer's table (the file's, or an external one the
    /// loader resolved), in layer order. Runs no cross-checks of the hash
    /// layout: [`EngramModel::check`] does.
    pub fn finish(mut self, tables: Vec<TableBlobs>, comp: Companions<'_>) -> Result<EngramModel> {
        let cfg = comp.tables.map(|t| &t.config);
        let (n, h) = self.ngram_geometry(cfg)?;
        self.check_constant_lengths(n, h)?;
        let consts = self.constants(comp, n, h)?;
        let geo = self.tensor_geometry(cfg, &tables, n, h)?;
        let partial_layers = std::mem::take(&mut self.layers);
        let layers = self.check_layers(partial_layers, &geo, tables)?;
        Ok(self.into_model(geo, n, h, consts, layers))
    }

    /// N and H: the file's keys, else the companion config's, in range.
    fn ngram_geometry(&self, cfg: Option<&EngramConfig>) -> Result<(usize, usize)> {
        let geo = |v: &Option<Named<u64>>, from_cfg: Option<usize>| {
            v.as_ref().map(|n| n.value).or(from_cfg.map(|x| x as u64))
        };
        let (n_heads, max_ngram) = match (
            geo(&self.n_heads, cfg.map(|c| c.n_heads)),
            geo(&self.max_ngram, cfg.map(|c| c.max_ngram)),
        ) {
            (Some(h), Some(n)) => (h, n),
            (h, n) => {
                let p = self.geometry_key_prefix();
                let missing: Vec<String> = [("head_count", h), ("max_ngram_size", n)]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| format!("{p}{k}"))
                    .collect();
                bail!(
                    ErrFormat,
                    "the file lacks {} and no config.json was given",
                    missing.join(", ")
                );
            }
        };
        if !(2..=64).contains(&max_ngram) || !(1..=1024).contains(&n_heads) {
            bail!(
                ErrFormat,
                "{} = {max_ngram}, {} = {n_heads}: out of range (N 2 to 64, H 1 to 1024)",
                key_or(&self.max_ngram, "max n-gram size"),
                key_or(&self.n_heads, "head count")
            );
        }
        Ok((max_ngram as usize, n_heads as usize))
    }

    /// The prefix of this dialect's geometry keys (for naming missing ones).
    fn geometry_key_prefix(&self) -> String {
        match self.dialect {
            Dialect::Vcruz305Prefix => "deepseek4.engram.".to_string(),
            _ => self
                .layer_ids
                .key
                .rsplit_once('.')
                .map_or(String::new(), |x| format!("{}.", x.0)),
        }
    }

    /// The constant arrays the file has hold one entry per layer and
    /// n-gram (or column), and a token map is not empty.
    fn check_constant_lengths(&self, n: usize, h: usize) -> Result<()> {
        let nl = self.layer_ids.value.len();
        let cols = (n - 1) * h;
        let len_check = |v: &Option<Named<Vec<u64>>>, want: usize, what: &str| -> Result<()> {
            if let Some(x) = v {
                if x.value.len() != want {
                    bail!(
                        ErrFormat,
                        "{} has {} entries, expected {want} ({what})",
                        x.key,
                        x.value.len()
                    );
                }
            }
            Ok(())
        };
        len_check(&self.multipliers, nl * n, &format!("{nl} layers x N = {n}"))?;
        len_check(
            &self.primes,
            nl * cols,
            &format!("{nl} layers x C = {cols}"),
        )?;
        len_check(
            &self.offsets,
            nl * cols,
            &format!("{nl} layers x C = {cols}"),
        )?;
        len_check(
            &self.rows,
            nl,
            &format!("one per engram layer of {}", self.layer_ids.key),
        )?;
        if let Some(t) = &self.token_map {
            if t.value.is_empty() {
                bail!(ErrFormat, "{} is empty", t.key);
            }
        }
        Ok(())
    }

    /// D and hc from the first layer's q, Hd from a key, the companion
    /// config or the first table; checked against the keys that state
    /// them, and in range.
    fn tensor_geometry(
        &self,
        cfg: Option<&EngramConfig>,
        tables: &[TableBlobs],
        n: usize,
        h: usize,
    ) -> Result<Geometry> {
        let first = self.layers.first().expect("at least one layer");
        let (d, hc) = (dim(&first.q.blob, 0), dim(&first.q.blob, 1));
        let hd = match &self.hd {
            Some(x) => x.value,
            None => match (cfg.and_then(|c| c.head_dim), tables.first()) {
                (Some(x), _) => x as u64,
                (None, Some(t)) => dim(&t.codes, 0),
                (None, None) => bail!(ErrFormat, "no table to take the row width from"),
            },
        };
        for (v, what, got) in [(&self.d_key, "D", d), (&self.hc_key, "hc", hc)] {
            if let Some(k) = v {
                if k.value != got {
                    bail!(
                        ErrFormat,
                        "{} = {}, but tensor {} has shape {:?} ([D, hc]: {what} = {got})",
                        k.key,
                        k.value,
                        first.q.blob.name,
                        first.q.blob.dims
                    );
                }
            }
        }
        if d == 0 || hc == 0 || hd == 0 || d > 1 << 20 || hc > 64 || hd > 1 << 16 {
            bail!(
                ErrFormat,
                "geometry D = {d}, hc = {hc} (from {}) and Hd = {hd} (from {}) out of range",
                first.q.blob.name,
                key_or(&self.hd, "the tables")
            );
        }
        Ok(Geometry {
            d: d as usize,
            hc: hc as usize,
            hd: hd as usize,
            cols: (n - 1) * h,
        })
    }

    /// Every layer's q, k, wkv and table in the shapes the geometry asks
    /// for, q and k of one type; paired with its table.
    fn check_layers(
        &self,
        partial_layers: Vec<PartialLayer>,
        g: &Geometry,
        tables: Vec<TableBlobs>,
    ) -> Result<Vec<EngramTensors>> {
        let nl = self.layer_ids.value.len();
        let Geometry { d, hc, hd, cols } = *g;
        let mut out_layers = Vec::with_capacity(nl);
        if tables.len() != nl {
            bail!(ErrInternal, "{} tables for {nl} layers", tables.len());
        }
        for (l, table) in partial_layers.into_iter().zip(tables) {
            g.check_shape(&l.q.blob, d as u64, Some(hc as u64), "q [hc, D]")?;
            g.check_shape(&l.k.blob, d as u64, Some(hc as u64), "k [hc, D]")?;
            g.check_shape(
                &l.wkv.blob,
                (cols * hd) as u64,
                Some(((hc + 1) * d) as u64),
                "wkv [D*(hc+1), C*Hd]",
            )?;
            let ne0 = match table.format {
                EngramType::Fp8E4m3E8m0 => (hd + hd / FP8_SCALE_BLOCK) as u64,
                _ => hd as u64,
            };
            g.check_shape(&table.codes, ne0, Some(table.rows), "table [Hd, rows]")
                .map_err(|e| {
                    // Name the key the row width came from.
                    Error::new(
                        e.status,
                        format!("{} (Hd from {})", e.message, key_or(&self.hd, "the tables")),
                    )
                })?;
            EngramType::row_format(table.format as u32, hd).map_err(|e| {
                Error::new(e.status, format!("{}: {}", table.codes.name, e.message))
            })?;
            if l.q.source != l.k.source {
                bail!(
                    ErrFormat,
                    "{} and {} have different types",
                    l.q.blob.name,
                    l.k.blob.name
                );
            }
            out_layers.push(EngramTensors {
                layer_id: l.layer_id,
                table,
                wkv: l.wkv,
                q: l.q,
                k: l.k,
            });
        }
        Ok(out_layers)
    }

    /// The completed model from its checked parts.
    fn into_model(
        self,
        g: Geometry,
        n: usize,
        h: usize,
        consts: Consts,
        layers: Vec<EngramTensors>,
    ) -> EngramModel {
        let Consts {
            token_map,
            pad,
            multipliers,
            primes,
            offsets,
            offsets_stored,
            source,
            keys,
        } = consts;
        EngramModel {
            dialect: self.dialect,
            d: g.d,
            hc: g.hc,
            hd: g.hd,
            layer_ids: self.layer_ids.value,
            max_ngram: n,
            n_heads: h,
            token_map,
            pad_id: pad.compressed,
            pad,
            multipliers,
            primes,
            offsets,
            offsets_stored,
            stated_rows: self.rows.map(|r| r.value),
            compressed_vocab: self.compressed_vocab.map(|c| c.value),
            hash_source: source,
            keys,
            layers,
        }
    }

    /// The hash constants, from the file, the companion files, or derived.
    fn constants(&self, comp: Companions<'_>, n: usize, h: usize) -> Result<Consts> {
        let have = [
            self.multipliers.is_some(),
            self.primes.is_some(),
            self.offsets.is_some(),
            self.token_map.is_some(),
            self.pad.is_some(),
        ];
        // Offsets may be absent (prefix sums); the other four make the hash.
        let complete = have[0] && have[1] && have[3] && have[4];
        let mut keys = self.constant_keys();
        let derived = self.derived_tables(comp, complete, n, h)?;
        self.check_companions(comp, derived.as_deref(), n, h)?;
        let chosen = if complete {
            self.file_constants(derived.as_deref(), (n - 1) * h)?
        } else {
            let d = self.require_derived(derived, have)?;
            self.derived_constants(&d, comp, &mut keys)?
        };
        let pad = self.pad(&chosen.token_map, chosen.pad_from_derived)?;
        Ok(Consts {
            token_map: chosen.token_map,
            pad,
            multipliers: chosen.multipliers,
            primes: chosen.primes,
            offsets: chosen.offsets,
            offsets_stored: chosen.offsets_stored,
            source: chosen.source,
            keys,
        })
    }

    /// The names of the keys the constants come from (the file's).
    fn constant_keys(&self) -> Keys {
        let ck = &self.const_keys;
        Keys {
            layer_ids: self.layer_ids.key.clone(),
            multipliers: ck[0].clone(),
            primes: ck[1].clone(),
            offsets: ck[2].clone(),
            token_map: ck[3].clone(),
            rows: self.rows.as_ref().map(|r| r.key.clone()),
            compressed_vocab: self.compressed_vocab.as_ref().map(|c| c.key.clone()),
        }
    }

    /// What a config + tokenizer (or a tokenizer and the file's own config
    /// keys) derive, when given.
    fn derived_tables<'c>(
        &self,
        comp: Companions<'c>,
        complete: bool,
        n: usize,
        h: usize,
    ) -> Result<Option<Cow<'c, EngramTables>>> {
        Ok(match (comp.tables, comp.token_map) {
            (Some(t), _) => Some(Cow::Borrowed(t)),
            (None, Some(tm)) if !complete => Some(Cow::Owned(self.derive(tm, n, h)?)),
            _ => None,
        })
    }

    /// A config.json given alongside describes the file's geometry, and a
    /// tokenizer.json given alongside the file's token map.
    fn check_companions(
        &self,
        comp: Companions<'_>,
        derived: Option<&EngramTables>,
        n: usize,
        h: usize,
    ) -> Result<()> {
        if let (Some(d), true) = (derived, comp.tables.is_some()) {
            // A config.json given alongside must describe the same geometry.
            let c = &d.config;
            if c.layer_ids != self.layer_ids.value || c.max_ngram != n || c.n_heads != h {
                bail!(
                    ErrInvalidConfig,
                    "config.json describes layers {:?}, N = {}, H = {}; the file has {:?}, N = {n}, H = {h}",
                    c.layer_ids,
                    c.max_ngram,
                    c.n_heads,
                    self.layer_ids.value
                );
            }
        }
        if let Some(tm) = comp.token_map {
            if let Some(f) = &self.token_map {
                if f.value != tm.map {
                    bail!(
                        ErrInvalidConfig,
                        "{} differs from the token map of the tokenizer.json given",
                        f.key
                    );
                }
            }
        }
        Ok(())
    }

    /// A complete file's own constants (offsets derived as prefix sums when
    /// absent), equal to the derived ones where those were given.
    fn file_constants(&self, derived: Option<&EngramTables>, cols: usize) -> Result<Chosen> {
        let ck = &self.const_keys;
        let mult = self.multipliers.as_ref().expect("complete").value.clone();
        let pr = self.primes.as_ref().expect("complete").value.clone();
        let (offs, stored) = match &self.offsets {
            Some(o) => (o.value.clone(), true),
            None => (derive_offsets(&pr, cols), false),
        };
        let tm = self.token_map.as_ref().expect("complete").value.clone();
        if let Some(d) = derived {
            let differs: Vec<&str> = [
                (ck[0].as_str(), d.multipliers != mult),
                (ck[1].as_str(), d.primes != pr),
                (ck[2].as_str(), stored && d.offsets != offs),
                (ck[3].as_str(), d.token_map != tm),
            ]
            .into_iter()
            .filter(|(_, x)| *x)
            .map(|(k, _)| k)
            .collect();
            if !differs.is_empty() {
                bail!(
                    ErrInvalidConfig,
                    "the file's {} differ from those derived from the config.json + tokenizer.json given alongside",
                    differs.join(", ")
                );
            }
        }
        Ok(Chosen {
            token_map: tm,
            multipliers: mult,
            primes: pr,
            offsets: offs,
            offsets_stored: stored,
            source: self.const_source,
            pad_from_derived: derived.map(|d| d.pad_id),
        })
    }

    /// The derived constants an incomplete file needs; refused, naming what
    /// the file lacks and what to pass, when none were derived.
    fn require_derived<'c>(
        &self,
        derived: Option<Cow<'c, EngramTables>>,
        have: [bool; 5],
    ) -> Result<Cow<'c, EngramTables>> {
        let any = have[0] || have[1] || have[2] || have[3];
        let missing: Vec<&str> = self
            .const_keys
            .iter()
            .zip(have)
            .filter(|(_, h)| !h)
            .map(|(k, _)| k.as_str())
            .collect();
        let Some(d) = derived else {
            if any {
                bail!(
                    ErrFormat,
                    "the file has some hash constants but lacks {}; pass the model's config.json and \
                     tokenizer.json to derive them",
                    missing.join(", ")
                );
            }
            if self.dialect == Dialect::Deepstrix {
                bail!(
                    ErrInvalidConfig,
                    "a deepstrix file carries no hash constants (no token map, multipliers, primes or offsets): \
                     pass the model's tokenizer.json (engram_gguf_options.tokenizer_json, or a tokenizer.json \
                     in tables_dir) to derive them from the file's {} keys",
                    self.layer_ids.key.trim_end_matches("layer_ids")
                );
            }
            bail!(
                ErrInvalidConfig,
                "the file lacks the hash constants {}: pass the model's config.json and tokenizer.json to derive them",
                missing.join(", ")
            );
        };
        Ok(d)
    }

    /// The derived constants, which the ones the file has must equal; the
    /// keys renamed to say where they came from.
    fn derived_constants(
        &self,
        d: &EngramTables,
        comp: Companions<'_>,
        keys: &mut Keys,
    ) -> Result<Chosen> {
        // The constants the file has must agree with the derived ones.
        let check = |v: &Option<Named<Vec<u64>>>, want: &[u64]| -> Result<()> {
            if let Some(x) = v {
                if x.value != want {
                    bail!(
                        ErrInvalidConfig,
                        "{} in the file differs from the one derived from config.json + tokenizer.json",
                        x.key
                    );
                }
            }
            Ok(())
        };
        check(&self.multipliers, &d.multipliers)?;
        check(&self.primes, &d.primes)?;
        check(&self.offsets, &d.offsets)?;
        let source = if comp.tables.is_some() {
            "config+tokenizer"
        } else {
            "tokenizer+file keys"
        };
        keys.multipliers = format!("multipliers (derived, {source})");
        keys.primes = format!("primes (derived, {source})");
        keys.offsets = format!("offsets (derived, {source})");
        keys.token_map = format!("token_map (derived, {source})");
        Ok(Chosen {
            token_map: d.token_map.clone(),
            multipliers: d.multipliers.clone(),
            primes: d.primes.clone(),
            offsets: d.offsets.clone(),
            offsets_stored: false,
            source,
            pad_from_derived: Some(d.pad_id),
        })
    }

    /// Hash tables from a tokenizer's map and the file's own config keys.
    fn derive(&self, tm: &TokenMap, n: usize, h: usize) -> Result<EngramTables> {
        let Some(ev) = &self.engram_vocab else {
            bail!(
                ErrInvalidConfig,
                "a tokenizer alone cannot complete this file: it has no engram vocabulary size key to derive \
                 the primes from; pass its config.json too"
            );
        };
        let Some((pad, reading)) = &self.pad else {
            bail!(ErrFormat, "the file has no pad key");
        };
        if *reading != PadReading::Raw {
            bail!(
                ErrInvalidConfig,
                "a tokenizer alone cannot complete this file: pass its config.json too"
            );
        }
        let config = EngramConfig {
            layer_ids: self.layer_ids.value.clone(),
            max_ngram: n,
            n_heads: h,
            vocab_per_ngram: vec![ev.value; n - 1],
            pad_token_id: u32::try_from(pad.value).map_err(|_| {
                fmt_err(format!(
                    "{} = {} does not fit a token id",
                    pad.key, pad.value
                ))
            })?,
            seed: 0,
            head_dim: self.hd.as_ref().map(|x| x.value as usize),
            hidden_size: self.d_key.as_ref().map(|x| x.value as usize),
            hc: self.hc_key.as_ref().map(|x| x.value as usize),
            num_embeddings: None,
            compressed_vocab: None,
            weight_block_size: None,
        };
        if let Some(cv) = &self.compressed_vocab {
            if cv.value != tm.compressed as u64 {
                bail!(
                    ErrInvalidConfig,
                    "{} = {}, but the tokenizer.json given compresses to {} ids: a different tokenizer than the model's?",
                    cv.key,
                    cv.value,
                    tm.compressed
                );
            }
        }
        EngramTables::derive(config, tm.clone())
    }

    /// The compressed pad, read as the dialect stores it; `from_companion`
    /// is the pad the companion files give, which it must equal.
    fn pad(&self, token_map: &[i32], from_companion: Option<i64>) -> Result<PadInfo> {
        let Some((p, reading)) = &self.pad else {
            // No pad key (derived constants only): the companion's.
            let c = from_companion.ok_or_else(|| fmt_err("no pad key and no config".into()))?;
            return Ok(PadInfo {
                key: "pad (derived)".into(),
                stored: c as u64,
                reading: PadReading::Compressed,
                compressed: c,
                how: "from the config.json + tokenizer.json given".into(),
            });
        };
        let v = p.value;
        let key = PadKey { p, token_map };
        let (compressed, how) = match reading {
            PadReading::Compressed => (
                key.as_compressed()?,
                "a compressed id in this dialect".to_string(),
            ),
            PadReading::Raw => (
                key.as_raw()?,
                format!("a raw token id in this dialect: token_map[{v}]"),
            ),
            PadReading::Ambiguous => key.ambiguous(from_companion)?,
        };
        if let Some(x) = from_companion {
            if x != compressed {
                bail!(
                    ErrInvalidConfig,
                    "{} = {v} gives the compressed pad {compressed} ({how}), but the config.json + tokenizer.json \
                     given give {x}",
                    p.key
                );
            }
        }
        Ok(PadInfo {
            key: p.key.clone(),
            stored: v,
            reading: *reading,
            compressed,
            how,
        })
    }
}

/// The file's pad key and the token map it may index: its two readings.
struct PadKey<'a> {
    p: &'a Named<u64>,
    token_map: &'a [i32],
}

impl PadKey<'_> {
    /// The pad read as a raw token id: its entry in the token map.
    fn as_raw(&self) -> Result<i64> {
        let (p, v) = (self.p, self.p.value);
        let Some(&c) = usize::try_from(v).ok().and_then(|i| self.token_map.get(i)) else {
            bail!(
                ErrFormat,
                "{} = {v} is a raw token id outside the token map's {} tokens",
                p.key,
                self.token_map.len()
            );
        };
        if c < 0 {
            bail!(
                ErrFormat,
                "{} = {v} is a raw token id that the token map leaves out (-1)",
                p.key
            );
        }
        Ok(c as i64)
    }

    /// The pad read as a compressed id.
    fn as_compressed(&self) -> Result<i64> {
        let (p, v) = (self.p, self.p.value);
        i64::try_from(v)
            .ok()
            .filter(|&c| c <= i32::MAX as i64)
            .ok_or_else(|| fmt_err(format!("{} = {v} is not a compressed id", p.key)))
    }

    /// A key that is a compressed id in one dialect and a raw token id in
    /// another: the reading both agree on, or the one the companion files
    /// confirm; refused when neither settles it.
    fn ambiguous(&self, from_companion: Option<i64>) -> Result<(i64, String)> {
        let (p, v) = (self.p, self.p.value);
        let c = self.as_compressed()?;
        let r = self.as_raw().ok();
        Ok(match (r, from_companion) {
            (Some(r), _) if r == c => (
                c,
                format!("ambiguous in this dialect; both readings give {c} (token_map[{v}] = {v})"),
            ),
            (_, Some(x)) if x == c => (c, "ambiguous in this dialect; the config + tokenizer say compressed".into()),
            (Some(r), Some(x)) if x == r => (r, format!("ambiguous in this dialect; the config + tokenizer say raw: token_map[{v}]")),
            (r, _) => bail!(
                ErrInvalidConfig,
                "{} = {v} is ambiguous in this dialect (the same key holds a compressed id in vcruz305's files \
                 and a raw token id in deepstrix's): read as a compressed id the pad is {c}, read as a raw \
                 token id it is {}; the two differ, so the loader will not guess: pass the model's \
                 config.json and tokenizer.json to decide",
                p.key,
                r.map_or("outside the token map".into(), |r| format!("token_map[{v}] = {r}"))
            ),
        })
    }
}

struct Consts {
    token_map: Vec<i32>,
    pad: PadInfo,
    multipliers: Vec<u64>,
    primes: Vec<u64>,
    offsets: Vec<u64>,
    offsets_stored: bool,
    source: &'static str,
    keys: Keys,
}

/// The hash constants chosen (the file's or the derived ones), before the
/// pad is settled against them.
struct Chosen {
    token_map: Vec<i32>,
    multipliers: Vec<u64>,
    primes: Vec<u64>,
    offsets: Vec<u64>,
    offsets_stored: bool,
    source: &'static str,
    /// The pad the companion files give, when they were given.
    pad_from_derived: Option<i64>,
}

/// The model's geometry: hidden size, streams, row width, hash columns.
#[derive(Clone, Copy)]
struct Geometry {
    d: usize,
    hc: usize,
    hd: usize,
    cols: usize,
}

impl Geometry {
    /// A tensor has shape `[ne0, ne1]` (ggml order; `ne1` any when `None`).
    fn check_shape(&self, b: &Blob, ne0: u64, ne1: Option<u64>, what: &str) -> Result<()> {
        let Geometry { d, hc, hd, cols } = *self;
        if b.dims.iter().skip(2).any(|&x| x != 1)
            || dim(b, 0) != ne0
            || ne1.is_some_and(|r| dim(b, 1) != r)
        {
            bail!(
                ErrFormat,
                "tensor {} has shape {:?}, expected [{ne0}, {}] (ggml order; {what}) for D = {d}, hc = {hc}, \
                 Hd = {hd}, C = {cols}",
                b.name,
                b.dims,
                ne1.map_or("rows".into(), |r| r.to_string())
            );
        }
        Ok(())
    }
}

/// A key's name, or `dflt` when the value did not come from a key.
fn key_or(v: &Option<Named<u64>>, dflt: &str) -> String {
    v.as_ref().map_or(dflt.to_string(), |n| n.key.clone())
}
