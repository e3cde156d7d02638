//! The command's async runtime, with its worker threads pinned one per core when asked
//! (`--pin-threads` on `baton serve` and `baton bench serve`).
//!
//! Why pin: some kernels keep a woken thread on the core of the thread that woke it while
//! another core sits idle. Some VMs' kernels do so on purpose (they pack threads onto few vCPUs
//! to spare the host), and there, under a burst of requests, the server's workers take turns on
//! one core for milliseconds at a time. Pinned, each worker has a core of its own. It is off by
//! default: a pinned worker cannot leave its core when another busy program holds it, which on
//! a desktop shared with busy programs may cost more than it saves.
//!
//! Only the workers are pinned, each to a core no other worker holds; every other thread of
//! the runtime (for blocking calls) gets back every core the process may use, though the worker
//! that starts it is pinned. A worker that hands its place to another thread to run a blocking
//! call (`block_in_place`) keeps its core, and its successor runs unpinned until a core is free.
//! A thread that a library starts itself from a worker (not through the runtime) inherits that
//! worker's core.

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The runtime; with `pin`, its workers are one per core the process may use, each pinned to
/// its own. Returns the cores they are pinned to (none when not pinned: not asked, one core,
/// or a system without thread affinity, which is said on stderr).
pub fn build(pin: bool) -> std::io::Result<(tokio::runtime::Runtime, Vec<usize>)> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if !pin {
        return Ok((builder.build()?, Vec::new()));
    }
    let (allowed, cpus) = match affinity::allowed() {
        Ok(allowed) => {
            let cpus = affinity::cpus(&allowed);
            (allowed, cpus)
        }
        Err(e) => {
            eprintln!("warning: the server's threads are not pinned: {e}");
            return Ok((builder.build()?, Vec::new()));
        }
    };
    // A CPU quota (a container's, say) may allow less than the cores it spreads over.
    let workers = std::thread::available_parallelism().map_or(1, NonZeroUsize::get).min(cpus.len());
    if workers < 2 {
        eprintln!("warning: the server's threads are not pinned: this process may use one core only");
        return Ok((builder.build()?, Vec::new()));
    }
    let cores = Arc::new(Cores::new(&cpus[..workers]));
    let (claim, claim_again, release) = (cores.clone(), cores.clone(), cores.clone());
    builder
        .worker_threads(workers)
        .on_thread_start(move || {
            if let Err(e) = affinity::set(&allowed) {
                tracing::warn!("cannot let a runtime thread run on every core: {e}");
            }
        })
        // Only workers park: a worker takes its core when it first goes idle (a new one does
        // so at once) or, when none was free then, when it wakes.
        .on_thread_park(move || claim.claim())
        .on_thread_unpark(move || claim_again.claim())
        .on_thread_stop(move || release.release());
    Ok((builder.build()?, cpus[..workers].to_vec()))
}

/// The cores workers are pinned to, and whether a thread holds each.
#[derive(Debug)]
struct Cores {
    held: Mutex<Vec<(usize, bool)>>,
    /// How many are free: a worker without a core looks at the list only when one is, since it
    /// asks each time it wakes.
    free: AtomicUsize,
}

thread_local! {
    /// The core this thread holds, if it is a pinned worker (or was one).
    static HOLDS: Cell<Option<usize>> = const { Cell::new(None) };
}

impl Cores {
    fn new(cpus: &[usize]) -> Cores {
        Cores { held: Mutex::new(cpus.iter().map(|&c| (c, false)).collect()), free: AtomicUsize::new(cpus.len()) }
    }

    fn claim(&self) {
        if HOLDS.get().is_some() || self.free.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(slot) = held.iter_mut().find(|(_, taken)| !taken) else { return };
        match affinity::set(&affinity::only(slot.0)) {
            Ok(()) => {
                slot.1 = true;
                HOLDS.set(Some(slot.0));
                self.free.fetch_sub(1, Ordering::AcqRel);
            }
            Err(e) => tracing::warn!("cannot pin a worker thread to core {}: {e}", slot.0),
        }
    }

    fn release(&self) {
        let Some(cpu) = HOLDS.take() else { return };
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(slot) = held.iter_mut().find(|(c, _)| *c == cpu) {
            slot.1 = false;
            self.free.fetch_add(1, Ordering::AcqRel);
        }
    }
}

#[cfg(target_os = "linux")]
mod affinity {
    pub type Set = libc::cpu_set_t;

    /// The cores this thread may run on.
    pub fn allowed() -> std::io::Result<Set> {
        // SAFETY: `set` is a plain bit set that the call fills, of the size passed.
        #[allow(unsafe_code)]
        unsafe {
            let mut set: Set = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<Set>(), &mut set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(set)
        }
    }

    pub fn cpus(set: &Set) -> Vec<usize> {
        // SAFETY: reads a bit of a valid set, below its size.
        #[allow(unsafe_code)]
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, set) }).collect()
    }

    pub fn only(cpu: usize) -> Set {
        // SAFETY: a zeroed set is the empty one; `cpu` came from `cpus`, so is below its size.
        #[allow(unsafe_code)]
        unsafe {
            let mut set: Set = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            set
        }
    }

    /// Confines this thread to `set`.
    pub fn set(set: &Set) -> std::io::Result<()> {
        // SAFETY: `set` is a valid set of the size passed; pid 0 is this thread.
        #[allow(unsafe_code)]
        let failed = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<Set>(), set) != 0 };
        if failed { Err(std::io::Error::last_os_error()) } else { Ok(()) }
    }
}

#[cfg(not(target_os = "linux"))]
mod affinity {
    #[derive(Debug, Clone, Copy)]
    pub struct Set;

    pub fn allowed() -> std::io::Result<Set> {
        Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "pinning threads is supported on Linux only"))
    }

    pub fn cpus(_: &Set) -> Vec<usize> {
        Vec::new()
    }

    pub fn only(_: usize) -> Set {
        Set
    }

    pub fn set(_: &Set) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::{affinity, build};

    /// The cores of the thread that runs each of `n` tasks that wait for one another, so that
    /// each holds a worker of its own while it reads them.
    fn on_each_worker(runtime: &tokio::runtime::Runtime, n: usize) -> Vec<Vec<usize>> {
        let arrived = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let arrived = arrived.clone();
                runtime.spawn(async move {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while arrived.load(Ordering::SeqCst) < n && Instant::now() < deadline {
                        std::thread::yield_now();
                    }
                    assert!(arrived.load(Ordering::SeqCst) >= n, "the tasks never ran at once on {n} workers");
                    affinity::cpus(&affinity::allowed().expect("affinity"))
                })
            })
            .collect();
        runtime.block_on(async { futures::future::try_join_all(tasks).await.expect("a task panicked") })
    }

    #[test]
    fn pinned_workers_each_have_a_core_and_blocking_threads_have_them_all() {
        let all = affinity::cpus(&affinity::allowed().expect("affinity"));
        let (runtime, pinned) = build(true).expect("runtime");
        // Workers take their cores when they first go idle, which new ones do at once.
        std::thread::sleep(Duration::from_millis(100));
        if all.len() < 2 {
            assert!(pinned.is_empty(), "one core: nothing to pin");
            return;
        }
        assert!(pinned.len() >= 2 && pinned.iter().all(|c| all.contains(c)), "{pinned:?} of {all:?}");
        let mut seen = on_each_worker(&runtime, pinned.len());
        seen.sort();
        let expected: Vec<Vec<usize>> = pinned.iter().map(|&c| vec![c]).collect();
        assert_eq!(seen, expected, "each worker on its own core");
        // A blocking call's thread is started by a worker, yet may run anywhere.
        let blocking = runtime
            .block_on(async {
                tokio::spawn(async {
                    tokio::task::spawn_blocking(|| affinity::cpus(&affinity::allowed().expect("affinity"))).await
                })
                .await
            })
            .expect("spawned")
            .expect("blocking");
        assert_eq!(blocking, all);
        // The thread that built the runtime is untouched.
        assert_eq!(affinity::cpus(&affinity::allowed().expect("affinity")), all);
    }

    #[test]
    fn unpinned_workers_may_run_anywhere() {
        let all = affinity::cpus(&affinity::allowed().expect("affinity"));
        let (runtime, pinned) = build(false).expect("runtime");
        assert!(pinned.is_empty());
        for cpus in on_each_worker(&runtime, 2.min(all.len())) {
            assert_eq!(cpus, all);
        }
    }
}
