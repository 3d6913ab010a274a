//! The projection's thread pool, joined when it is dropped.
//!
//! A `rayon::ThreadPool` only asks its threads to stop when dropped; they
//! exit later, on their own. `engram_free` promises that the context's
//! threads are gone when it returns, so this pool spawns rayon's threads
//! itself (`spawn_handler`), keeps their handles, and joins them in `Drop`.

use std::thread::JoinHandle;

/// A rayon pool whose threads are joined when it is dropped.
pub struct Pool {
    /// `Some` until `Drop` takes it (dropping it tells the threads to stop).
    pool: Option<rayon::ThreadPool>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `n` threads named `engram-{i}`. A thread that cannot be
    /// started is an error; the ones already started are joined.
    pub fn new(n: usize) -> std::io::Result<Pool> {
        let handles = std::sync::Mutex::new(Vec::with_capacity(n));
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .spawn_handler(|t| {
                let h = std::thread::Builder::new()
                    .name(format!("engram-{}", t.index()))
                    .spawn(move || t.run())?;
                handles.lock().unwrap_or_else(|p| p.into_inner()).push(h);
                Ok(())
            })
            .build();
        let threads = handles.into_inner().unwrap_or_else(|p| p.into_inner());
        match built {
            Ok(pool) => Ok(Pool {
                pool: Some(pool),
                threads,
            }),
            Err(e) => {
                // rayon has let go of the threads it started: they see the
                // registry terminate and exit.
                for h in threads {
                    let _ = h.join();
                }
                Err(std::io::Error::other(e))
            }
        }
    }

    /// The pool's threads.
    pub fn current_num_threads(&self) -> usize {
        self.threads.len()
    }

    /// Run `f` in the pool (see `rayon::ThreadPool::install`).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool
            .as_ref()
            .expect("the pool is alive until Drop")
            .install(f)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Dropping the pool terminates its registry; each thread then leaves
        // its loop, and the joins wait for that.
        drop(self.pool.take());
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}
