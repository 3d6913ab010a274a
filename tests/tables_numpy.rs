//! numpy's `default_rng(seed).integers(..., dtype=int64)` reproduced bit for
//! bit: the golden generator's captures of numpy 2.4.6 (the V4.1 multiplier
//! draws in `v41_hash.json`, and `gen_tables.py`'s wider set: the 32-bit
//! Lemire path, ranges at the 2^32 boundary, several calls on one generator,
//! seeds above 2^32 and 2^64).

mod common;

use common::*;
use engram::tables::{multiplier_half, multipliers, numpy_rng::default_rng};

#[test]
fn v41_multiplier_draws_equal_numpys() {
    let g = load_json("v41_hash.json");
    let half = g["multiplier_half"].as_i64().unwrap();
    assert_eq!(half, multiplier_half(99_092));
    let caps = g["numpy_integers"].as_array().unwrap();
    assert!(caps.len() >= 5);
    for c in caps {
        let seed = c["seed"].as_u64().unwrap();
        let want = ints(&c["values"]);
        let got = default_rng(seed as u128).integers_i64(0, half, 4).unwrap();
        assert_eq!(got, want, "seed {seed} (layer {})", c["layer_id"]);
    }
}

#[test]
fn v41_multipliers_equal_the_generators() {
    let g = load_json("v41_hash.json");
    let got = multipliers(&[1, 14], 4, 99_092, 0).unwrap();
    assert_eq!(got, u64s(&g["multipliers"]));
    assert!(got.iter().all(|m| m % 2 == 1 && *m < 1 << 63));
}

#[test]
fn wider_numpy_captures() {
    let g = load_json("tables_expected.json");
    let mut n = 0;
    for case in g["numpy_integers"].as_array().unwrap() {
        let seed: u128 = case["seed"].as_str().unwrap().parse().unwrap();
        let mut rng = default_rng(seed);
        for call in case["calls"].as_array().unwrap() {
            let low = call["low"].as_i64().unwrap();
            let high = call["high"].as_i64().unwrap();
            let size = call["size"].as_u64().unwrap() as usize;
            let got = rng.integers_i64(low, high, size).unwrap();
            assert_eq!(
                got,
                ints(&call["values"]),
                "seed {seed}, integers({low}, {high}, {size})"
            );
            n += 1;
        }
    }
    assert!(n >= 14, "{n} calls checked");
}
