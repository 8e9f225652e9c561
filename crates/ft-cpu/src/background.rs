//! A background thread that runs submitted jobs in order, so a caller can submit expert work
//! and do something else (drive the GPU) until it waits for the result.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// One worker thread with a job queue.
pub struct Background {
    tx: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The result of a submitted job; [`Ticket::wait`] blocks until it is ready.
pub struct Ticket<T> {
    rx: Receiver<std::thread::Result<T>>,
}

impl<T> Ticket<T> {
    /// Blocks until the job has run; re-raises its panic.
    pub fn wait(self) -> T {
        match self
            .rx
            .recv()
            .expect("the background thread outlives its tickets")
        {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl Background {
    /// Starts the thread.
    pub fn new(name: &str) -> Background {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("spawn the background thread");
        Background {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Queues `f`; its result (or panic) comes back through the ticket.
    pub fn submit<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Ticket<T> {
        let (rtx, rx) = channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = rtx.send(r);
        });
        self.tx
            .as_ref()
            .expect("sender lives until drop")
            .send(job)
            .expect("the background thread runs until drop");
        Ticket { rx }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_and_returns_results() {
        let bg = Background::new("test");
        let a = bg.submit(|| 2 + 2);
        let b = bg.submit(|| "x".repeat(3));
        assert_eq!(b.wait(), "xxx");
        assert_eq!(a.wait(), 4);
    }

    #[test]
    fn panics_come_back_to_the_waiter() {
        let bg = Background::new("test");
        let t = bg.submit(|| panic!("boom"));
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.wait())).is_err());
        assert_eq!(bg.submit(|| 1).wait(), 1);
    }
}
