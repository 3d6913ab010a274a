//! The engine's memory as the library receives it: an address and, where the
//! caller knows it, a length, not yet known to be host or device memory.
//!
//! A C caller hands over bare pointers whose sizes follow from the geometry;
//! a Rust caller hands over slices. Both become a [`Region`] (read) or a
//! [`RegionMut`] (written in place), and the backend that uses one decides
//! what it is: the CPU backend reads host memory; the CUDA backend asks the
//! driver (device memory is never dereferenced on the host, host memory is
//! staged). This module holds the one `unsafe` step, turning a region into
//! a host slice, and says when it is sound.

use crate::error::{bail, Result};
use std::marker::PhantomData;

/// Memory the context may read for `'a`: `addr`, and `len` bytes when the
/// caller said how many (a slice) or `None` when the size follows from the
/// geometry (a C pointer).
#[derive(Clone, Copy, Debug)]
pub struct Region<'a> {
    addr: usize,
    len: Option<usize>,
    _p: PhantomData<&'a [u8]>,
}

impl<'a> Region<'a> {
    /// A host slice.
    pub fn of<T: Copy>(s: &'a [T]) -> Region<'a> {
        Region {
            addr: s.as_ptr() as usize,
            len: Some(std::mem::size_of_val(s)),
            _p: PhantomData,
        }
    }

    /// A bare address (a C pointer, or a device pointer), with its length if known.
    ///
    /// # Safety
    /// When the context's backend reads this region as host memory (the CPU
    /// backend always does; the CUDA backend only where the driver says it is
    /// host memory), `addr` must point to readable memory of `len` bytes (or,
    /// without `len`, of the size the context's geometry implies for its use)
    /// that stays valid and unchanged for `'a`.
    pub unsafe fn from_raw(addr: usize, len: Option<usize>) -> Region<'a> {
        Region {
            addr,
            len,
            _p: PhantomData,
        }
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn is_null(&self) -> bool {
        self.addr == 0
    }

    /// Check the region against the `bytes` its use needs (and its address
    /// against `align`), naming it `what`: NULL is `ErrNullArgument` unless
    /// no bytes are needed; a known length must equal `bytes`. Returns the
    /// region with its length set.
    pub fn sized(self, bytes: usize, align: usize, what: &str) -> Result<Region<'a>> {
        check(self.addr, self.len, bytes, align, what)?;
        Ok(Region {
            len: Some(bytes),
            ..self
        })
    }

    /// Bytes `[start, start + bytes)` of a sized region (a shard's part of a
    /// table or of `wkv`): `ErrInternal` if the region is unsized or the
    /// range passes its end (the context computes both from checked sizes).
    pub fn sub(self, start: usize, bytes: usize) -> Result<Region<'a>> {
        match (self.len, start.checked_add(bytes)) {
            (Some(len), Some(end)) if end <= len => Ok(Region {
                addr: self.addr + start,
                len: Some(bytes),
                _p: PhantomData,
            }),
            _ => bail!(
                ErrInternal,
                "a shard's range [{start}, +{bytes}) passes its region of {:?} bytes",
                self.len
            ),
        }
    }

    /// The bytes, as host memory (after [`Region::sized`]).
    ///
    /// # Safety
    /// The region must be host memory of the context's backend: a CPU
    /// backend's regions always are (see [`Region::from_raw`]); the CUDA
    /// backend calls this only for memory the driver reports as host memory.
    pub unsafe fn host(&self) -> &'a [u8] {
        let len = self.len.unwrap_or(0);
        if len == 0 {
            return &[];
        }
        // SAFETY: the caller's contract (above and at `from_raw`, or the slice
        // `of` was made from) makes `addr` valid for `len` bytes for `'a`.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, len) }
    }

    /// The region as host `T`s (after [`Region::sized`] with `T`'s alignment).
    ///
    /// # Safety
    /// As [`Region::host`]; `T` must be a type every bit pattern of which is
    /// valid (`u8`, `u16`, `i64`, `f32`, ...).
    pub unsafe fn host_as<T: Copy>(&self) -> &'a [T] {
        let len = self.len.unwrap_or(0);
        let n = len / std::mem::size_of::<T>();
        if n == 0 {
            return &[];
        }
        debug_assert_eq!(self.addr % std::mem::align_of::<T>(), 0);
        // SAFETY: as `host`; `sized` checked the alignment; `T` is plain data.
        unsafe { std::slice::from_raw_parts(self.addr as *const T, n) }
    }
}

/// Memory the context may write in place during one call (the highway).
#[derive(Debug)]
pub struct RegionMut<'a> {
    addr: usize,
    len: Option<usize>,
    _p: PhantomData<&'a mut [u8]>,
}

impl<'a> RegionMut<'a> {
    /// A host slice.
    pub fn of<T: Copy>(s: &'a mut [T]) -> RegionMut<'a> {
        RegionMut {
            addr: s.as_mut_ptr() as usize,
            len: Some(std::mem::size_of_val(s)),
            _p: PhantomData,
        }
    }

    /// A bare address (a C pointer, or a device pointer), with its length if known.
    ///
    /// # Safety
    /// As [`Region::from_raw`], for memory that is also writable and that
    /// nothing else reads or writes during the call.
    pub unsafe fn from_raw(addr: usize, len: Option<usize>) -> RegionMut<'a> {
        RegionMut {
            addr,
            len,
            _p: PhantomData,
        }
    }

    pub fn addr(&self) -> usize {
        self.addr
    }

    /// As [`Region::sized`].
    pub fn sized(self, bytes: usize, align: usize, what: &str) -> Result<RegionMut<'a>> {
        check(self.addr, self.len, bytes, align, what)?;
        Ok(RegionMut {
            len: Some(bytes),
            ..self
        })
    }

    /// The region as host `T`s, writable (after [`RegionMut::sized`]).
    ///
    /// # Safety
    /// As [`Region::host_as`], and nothing else may access the memory while
    /// the returned slice lives.
    pub unsafe fn host_as_mut<T: Copy>(&mut self) -> &'a mut [T] {
        let len = self.len.unwrap_or(0);
        let n = len / std::mem::size_of::<T>();
        if n == 0 {
            return &mut [];
        }
        debug_assert_eq!(self.addr % std::mem::align_of::<T>(), 0);
        // SAFETY: as `Region::host_as`, writable and unaliased by the contract.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, n) }
    }
}

fn check(addr: usize, len: Option<usize>, bytes: usize, align: usize, what: &str) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    if addr == 0 {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    if !addr.is_multiple_of(align) {
        bail!(ErrInvalidArgument, "{what} is not aligned to {align} bytes");
    }
    if bytes > isize::MAX as usize || addr.checked_add(bytes).is_none() {
        bail!(ErrInvalidArgument, "{what}: {bytes} bytes is too large");
    }
    if let Some(l) = len {
        if l != bytes {
            bail!(
                ErrInvalidArgument,
                "{what} holds {l} bytes, expected {bytes}"
            );
        }
    }
    Ok(())
}
