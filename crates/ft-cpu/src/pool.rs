//! A persistent thread pool: workers are created once, poll for a while after each job and
//! then park, so back-to-back products of a decode step (microseconds apart) start at once
//! instead of paying a wake-up each, and an idle pool costs nothing. How long they poll is
//! the pool's `poll` (llama.cpp's `--poll`): on a VM a wake-up is an interrupt through the
//! hypervisor, tens of microseconds per thread. A job does not wait for a worker that has
//! not joined it by the time the caller has finished the tasks: on a loaded host a worker may
//! not get a CPU for hundreds of microseconds, and the small products of a decode step would
//! each pay that (the caller runs whatever the workers have not claimed).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker (or the caller waiting for workers) polls before it sleeps, by default.
pub const DEFAULT_POLL: Duration = Duration::from_micros(100);

/// Polls `ready` for up to `poll`; true if it turned true.
fn spin_until(poll: Duration, ready: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > poll {
            return ready();
        }
    }
}

/// [`Shared::joined`]'s closed bit.
const CLOSED: u64 = 1 << 31;

/// [`Shared::joined`] for an open job of `generation` that no worker has joined yet.
fn open_job(generation: u64) -> u64 {
    generation << 32
}

/// A borrowed task body whose lifetime `run` erases: `run` does not return before every
/// worker has finished with it.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is Sync and outlives every use (see `ThreadPool::run`).
unsafe impl Send for Job {}

/// A published job: its body, its look-ahead and task count, on `run`'s stack while workers
/// use it.
struct Desc {
    job: Job,
    ahead: Option<Job>,
    n_tasks: usize,
}

struct State {
    shutdown: bool,
    /// Workers parked on `wake`, and whether the caller is parked on `done`: the notifying
    /// side makes the futex call only then (a wake-up call is a system call, microseconds on
    /// a VM, which every job paid twice).
    sleepers: usize,
    caller_waits: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Bumped (under the lock) each time a job is published; workers poll it while spinning
    /// and then read `desc` without taking the lock.
    generation: AtomicU64,
    /// The current job's `Desc`, stored before `generation` is bumped; valid while a worker
    /// is counted in `joined`.
    desc: AtomicPtr<Desc>,
    /// The current job's generation (its low 32 bits, in the high half), whether the caller
    /// has closed it ([`CLOSED`]) and the workers inside it (the low bits). A worker counts
    /// itself in only while the job is the one it saw published and still open; the caller
    /// closes it once it has no task left to claim and waits for the count to be zero.
    joined: AtomicU64,
    wake: Condvar,
    done: Condvar,
    next: AtomicUsize,
    panicked: AtomicBool,
    poll: Duration,
}

/// Workers that run `f(0..n_tasks)` together with the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    submit: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` in all (the caller counts as one; `n_threads - 1` workers) that
    /// polls for [`DEFAULT_POLL`].
    pub fn new(n_threads: usize) -> ThreadPool {
        ThreadPool::with_poll(n_threads, DEFAULT_POLL)
    }

    /// A pool of `n_threads` whose idle workers poll for `poll` before they park.
    pub fn with_poll(n_threads: usize, poll: Duration) -> ThreadPool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                shutdown: false,
                sleepers: 0,
                caller_waits: false,
            }),
            generation: AtomicU64::new(0),
            desc: AtomicPtr::new(std::ptr::null_mut()),
            joined: AtomicU64::new(0),
            wake: Condvar::new(),
            done: Condvar::new(),
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            poll,
        });
        let workers = (1..n_threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ft-cpu-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawn a thread-pool worker")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            submit: Mutex::new(()),
        }
    }

    /// Threads that take part in a job, the caller included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// How long idle workers poll before they park.
    pub fn poll(&self) -> Duration {
        self.shared.poll
    }

    /// Calls `f(i)` for every `i` in `0..n_tasks`, spread over the workers and the caller;
    /// returns when all calls have returned. A panic in `f` is re-raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_inner(n_tasks, f, None);
    }

    /// [`run`](Self::run) where each thread claims its next task before it runs the current
    /// one and calls `ahead(next)` first, so that the next task's first memory reads can be
    /// on their way (a prefetch) while this one computes: with several threads a thread's
    /// next task is rarely adjacent to its last, and its first reads would otherwise stall.
    /// A pool of one thread (or a single task) runs the tasks in order and never calls
    /// `ahead`: adjacent tasks need no announcement.
    pub fn run_with_ahead(
        &self,
        n_tasks: usize,
        f: &(dyn Fn(usize) + Sync),
        ahead: &(dyn Fn(usize) + Sync),
    ) {
        self.run_inner(n_tasks, f, Some(ahead));
    }

    fn run_inner(
        &self,
        n_tasks: usize,
        f: &(dyn Fn(usize) + Sync),
        ahead: Option<&(dyn Fn(usize) + Sync)>,
    ) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let _exclusive = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the lifetimes are erased only for the duration of this call: we close the
        // job below and wait until no worker is inside it, after which none touches it again.
        let erase = |f: &(dyn Fn(usize) + Sync)| {
            Job(unsafe {
                std::mem::transmute::<
                    *const (dyn Fn(usize) + Sync + '_),
                    *const (dyn Fn(usize) + Sync + 'static),
                >(f)
            })
        };
        let shared = &*self.shared;
        shared.next.store(0, Ordering::Relaxed);
        shared.panicked.store(false, Ordering::Relaxed);
        let mut desc = Desc {
            job: erase(f),
            ahead: ahead.map(erase),
            n_tasks,
        };
        {
            let st = shared.state.lock().unwrap();
            shared.desc.store(&mut desc, Ordering::SeqCst);
            let generation = shared.generation.load(Ordering::SeqCst) + 1;
            shared.joined.store(open_job(generation), Ordering::SeqCst);
            shared.generation.store(generation, Ordering::SeqCst);
            if st.sleepers > 0 {
                shared.wake.notify_all();
            }
        }
        drain(shared, &desc);
        // Every task is claimed: workers that have not joined yet stay out, and those inside
        // finish theirs.
        shared.joined.fetch_or(CLOSED, Ordering::SeqCst);
        let idle = || shared.joined.load(Ordering::SeqCst) & (CLOSED - 1) == 0;
        if !spin_until(shared.poll, idle) {
            let mut st = shared.state.lock().unwrap();
            st.caller_waits = true;
            while !idle() {
                st = shared.done.wait(st).unwrap();
            }
            st.caller_waits = false;
        }
        // No worker reads `desc` any more (each read it before leaving `joined`).
        shared.desc.store(std::ptr::null_mut(), Ordering::SeqCst);
        if shared.panicked.load(Ordering::Relaxed) {
            panic!("a thread-pool task panicked");
        }
    }
}

/// Takes task indices until none are left (with a look-ahead, one task ahead).
fn drain(shared: &Shared, desc: &Desc) {
    // SAFETY: `run` keeps the job alive until every worker has left this function.
    let f = unsafe { &*desc.job.0 };
    let ahead = desc.ahead.map(|a| unsafe { &*a.0 });
    let claim = || shared.next.fetch_add(1, Ordering::Relaxed);
    let call = |g: &(dyn Fn(usize) + Sync), i: usize| {
        if catch_unwind(AssertUnwindSafe(|| g(i))).is_err() {
            shared.panicked.store(true, Ordering::Relaxed);
        }
    };
    let mut i = claim();
    while i < desc.n_tasks {
        // With a look-ahead, the next task is claimed (and announced) before this one runs.
        let next = ahead.map(|a| {
            let next = claim();
            if next < desc.n_tasks {
                call(a, next);
            }
            next
        });
        call(f, i);
        i = next.unwrap_or_else(claim);
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let published = || shared.generation.load(Ordering::SeqCst) != seen;
        // Spinning workers see the job without the lock (eleven of them taking it at once
        // would queue on it); parked ones wait on the condition variable.
        if !spin_until(shared.poll, published) {
            let mut st = shared.state.lock().unwrap();
            while !published() && !st.shutdown {
                st.sleepers += 1;
                st = shared.wake.wait(st).unwrap();
                st.sleepers -= 1;
            }
            if st.shutdown {
                return;
            }
        }
        seen = shared.generation.load(Ordering::SeqCst);
        // Join the job if it is still the one published and open.
        let open = open_job(seen);
        let mut state = shared.joined.load(Ordering::SeqCst);
        let joined = loop {
            if state & !(CLOSED - 1) != open {
                break false;
            }
            match shared.joined.compare_exchange_weak(
                state,
                state + 1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break true,
                Err(now) => state = now,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: `run` stored the job's `Desc` before publishing it and keeps it alive
        // until no worker is counted in `joined`, as this one is until below.
        let desc = unsafe { &*shared.desc.load(Ordering::SeqCst) };
        drain(shared, desc);
        if shared.joined.fetch_sub(1, Ordering::SeqCst) == open | CLOSED | 1 {
            // Taking the lock orders this check after the caller's check-then-wait.
            if shared.state.lock().unwrap().caller_waits {
                shared.done.notify_one();
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap().shutdown = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        // Polling for nothing parks the workers after every job: the wake-up path.
        for poll in [Duration::ZERO, DEFAULT_POLL, Duration::from_millis(2)] {
            let pool = ThreadPool::with_poll(4, poll);
            assert_eq!(pool.poll(), poll);
            for n in [1, 3, 4, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn look_ahead_names_the_next_task_of_the_same_thread() {
        let pool = ThreadPool::new(3);
        for n in [2, 7, 100] {
            let ran: Vec<Mutex<Option<std::thread::ThreadId>>> =
                (0..n).map(|_| Mutex::new(None)).collect();
            let told: Vec<Mutex<Vec<std::thread::ThreadId>>> =
                (0..n).map(|_| Mutex::new(vec![])).collect();
            pool.run_with_ahead(
                n,
                &|i| {
                    let me = std::thread::current().id();
                    // Told before it runs, by the thread that runs it, if at all.
                    assert!(told[i].lock().unwrap().iter().all(|t| *t == me));
                    assert!(ran[i].lock().unwrap().replace(me).is_none());
                },
                &|j| {
                    assert!(ran[j].lock().unwrap().is_none());
                    told[j].lock().unwrap().push(std::thread::current().id());
                },
            );
            assert!(ran.iter().all(|r| r.lock().unwrap().is_some()));
            assert!(told.iter().all(|t| t.lock().unwrap().len() <= 1));
        }
    }

    #[test]
    fn workers_persist_across_jobs() {
        let pool = ThreadPool::new(3);
        let ids = Mutex::new(std::collections::HashSet::new());
        for _ in 0..50 {
            pool.run(64, &|_| {
                ids.lock().unwrap().insert(std::thread::current().id());
            });
        }
        // Only the caller and the two workers ever ran tasks: nothing was spawned per job.
        assert!(ids.lock().unwrap().len() <= 3);
    }

    #[test]
    fn task_panic_is_reraised() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| assert_ne!(i, 5));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let n = AtomicUsize::new(0);
        pool.run(8, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
