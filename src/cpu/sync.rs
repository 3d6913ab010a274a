//! The stager's synchronisation: std's, or loom's when the stager's model
//! check runs (`cargo test --lib --features loom-model cpu::stager::model`),
//! so that loom explores the interleavings of the real code.

#[cfg(not(all(test, feature = "loom-model")))]
pub(crate) use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
};

#[cfg(all(test, feature = "loom-model"))]
pub(crate) use loom::{
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread,
};
