//! Allocations sized by a caller or a file, made fallibly: running out of
//! memory is `ErrCapacity` naming what was being allocated, never an abort.
//! Every module allocates through these (re-exported by [`crate::batch`]).

use crate::error::{bail, Result};

/// An empty `Vec` with room for `n` elements, allocated fallibly: running
/// out of memory for a size that came from a caller or a file is
/// `ErrCapacity` naming `what`, not an abort.
pub fn try_room<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(n).is_err() {
        bail!(
            ErrCapacity,
            "out of memory for {what} ({n} elements of {} bytes)",
            std::mem::size_of::<T>()
        );
    }
    Ok(v)
}

/// Bytes a `Vec` holds (its capacity), for memory reporting.
pub fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

/// A `Vec` of `n` copies of `fill`, allocated fallibly (see [`try_room`]).
pub fn try_vec<T: Clone>(n: usize, fill: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_room(n, what)?;
    v.resize(n, fill);
    Ok(v)
}

/// A `Vec` of `n` values made by `f`, allocated fallibly (see [`try_room`]).
pub fn try_vec_with<T>(n: usize, f: impl FnMut() -> T, what: &str) -> Result<Vec<T>> {
    let mut v = try_room(n, what)?;
    v.resize_with(n, f);
    Ok(v)
}

/// `src` mapped through `f`, allocated fallibly (see [`try_room`]).
pub fn try_map<S, T>(src: &[S], f: impl FnMut(&S) -> T, what: &str) -> Result<Vec<T>> {
    let mut v = try_room(src.len(), what)?;
    v.extend(src.iter().map(f));
    Ok(v)
}
