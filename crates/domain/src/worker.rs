//! Which worker a thread serves, where each worker thread runs a runtime
//! of its own (`worker_runtime = "per_thread"`, `docs/design.md` §12,
//! "Threads"). The PostgreSQL store keeps a share of its connections and
//! its batching queues for each worker, and the upstream pool hands a
//! worker the connections its own runtime drives, so that a request's
//! statements, its upstream call and the tasks that drive their
//! connections all stay on the request's thread: nothing is handed to
//! another thread and woken there. The domain's one piece of state: set
//! once by each worker thread, read by the layers above.
//!
//! Threads that never [`enter`] one (the main thread, tests, every thread
//! of a shared runtime) are worker 0.

use std::cell::Cell;

thread_local! {
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// Marks the calling thread as worker `index`; called once, by the thread
/// that runs that worker's runtime, before it serves anything.
pub fn enter(index: usize) {
    WORKER.with(|worker| worker.set(index));
}

/// The worker the calling thread serves.
pub fn current() -> usize {
    WORKER.with(Cell::get)
}
