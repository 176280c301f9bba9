//! A second thread for splitting a short job in two, woken in well under a microsecond.
//!
//! A decode pass makes over a hundred matrix products of tens of microseconds each, with
//! torch's own ops between them. A general pool (rayon) parks its workers after a few
//! microseconds idle, and waking one costs about as much as a split saves
//! (docs/benchmarks.md §14). This helper spins for a while after each
//! job (`SPIN`, a few milliseconds: longer than the gaps between passes) before it
//! parks, so during a generation it is always awake, and when generation stops it sleeps.
//!
//! A job the helper has not started by the time the caller finishes its own half is taken back
//! and run by the caller: on a loaded machine the helper may not be scheduled for milliseconds,
//! and the caller then loses nothing by having posted it.
//!
//! One caller at a time: a second concurrent caller runs its whole job on its own thread.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

const IDLE: u8 = 0;
const POSTED: u8 = 1;
const RUNNING: u8 = 2;
const DONE: u8 = 3;
/// How long the helper spins after a job before it parks: longer than the gaps between the
/// passes of a generation (the Python round between them), so that it is awake all through
/// one; waking a parked thread can take milliseconds on a VM whose other vCPU has gone idle.
/// (A count of spin-loop hints is no measure of time: PAUSE's latency differs between CPU
/// makers by tens of times.)
const SPIN: Duration = Duration::from_millis(3);

type Job = *const (dyn Fn() + Sync);

struct Helper {
    state: AtomicU8,
    sleeping: AtomicBool,
    panicked: AtomicBool,
    job: UnsafeCell<Option<Job>>,
    thread: Thread,
    caller: Mutex<()>,
}

// SAFETY: `job` is written only by the caller holding `caller`, before it publishes POSTED
// (release), and read only by the helper after it sees POSTED (acquire).
unsafe impl Sync for Helper {}
unsafe impl Send for Helper {}

static HELPER: OnceLock<Option<&'static Helper>> = OnceLock::new();

fn helper() -> Option<&'static Helper> {
    *HELPER.get_or_init(|| {
        if thread::available_parallelism().map_or(1, std::num::NonZero::get) < 2 {
            return None;
        }
        let (tx, rx) = std::sync::mpsc::channel::<&'static Helper>();
        let handle = thread::Builder::new()
            .name("specfast-int8".into())
            .spawn(move || {
                let Ok(h) = rx.recv() else { return };
                serve(h);
            })
            .ok()?;
        let h: &'static Helper = Box::leak(Box::new(Helper {
            state: AtomicU8::new(IDLE),
            sleeping: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            job: UnsafeCell::new(None),
            thread: handle.thread().clone(),
            caller: Mutex::new(()),
        }));
        tx.send(h).ok()?;
        Some(h)
    })
}

fn serve(h: &Helper) {
    loop {
        let mut deadline = Instant::now() + SPIN;
        let mut spins = 0u32;
        while h.state.load(Ordering::Acquire) != POSTED {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || Instant::now() < deadline {
                std::hint::spin_loop();
            } else {
                h.sleeping.store(true, Ordering::SeqCst);
                if h.state.load(Ordering::SeqCst) != POSTED {
                    thread::park();
                }
                h.sleeping.store(false, Ordering::SeqCst);
                deadline = Instant::now() + SPIN;
            }
        }
        // Claim the job, unless the caller took it back first.
        if h.state
            .compare_exchange(POSTED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        // SAFETY: POSTED was published after the job was written, and the claim above makes
        // this thread its only reader; the caller keeps the closure alive until it sees DONE.
        let job = unsafe { (*h.job.get()).take() };
        if let Some(job) = job {
            let ok = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() })).is_ok();
            h.panicked.store(!ok, Ordering::Relaxed);
        }
        h.state.store(DONE, Ordering::Release);
    }
}

/// Runs `f(0)`, ..., `f(units - 1)` on this thread and the helper, and returns when all are
/// done. This thread takes units from the front and the helper from the back, each the next one
/// as it finishes one, until they meet: a split into fixed halves waits for the slower half (on
/// a shared machine either thread can be the slow one), and taking units in turn would give
/// each thread every other unit, where neighbours share data (attention's units of one kv head
/// read its keys and values) that one core's caches then hold for the next.
pub fn for_each(units: usize, f: impl Fn(usize) + Sync) {
    for_each_from_ends(units, |unit, _| f(unit));
}

/// Runs `run` over the ranges that cut 0..total into at most `units` pieces: on this thread
/// alone where `serial` (a small job, which a split costs more than it saves), else on this
/// thread and the helper ([`for_each`]).
pub fn in_pieces(total: usize, units: usize, serial: bool, run: impl Fn(Range<usize>) + Sync) {
    if serial || total == 0 {
        run(0..total);
        return;
    }
    let per = total.div_ceil(units);
    for_each(total.div_ceil(per), |u| {
        run(u * per..((u + 1) * per).min(total));
    });
}

/// [`for_each`], telling `f` which end each unit came from: `f(unit, true)` for the units this
/// thread takes from the front (its next is `unit + 1`), `f(unit, false)` for the helper's from
/// the back (its next is `unit - 1`), so that a unit can fetch ahead what its thread runs next.
pub fn for_each_from_ends(units: usize, f: impl Fn(usize, bool) + Sync) {
    assert!(u32::try_from(units).is_ok(), "at most 2^32 - 1 units");
    // The next front unit in the low half, one past the next back unit in the high half.
    let ends = AtomicU64::new((units as u64) << 32);
    let take = |front: bool| -> Option<usize> {
        let mut now = ends.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (now & 0xffff_ffff, now >> 32);
            if lo >= hi {
                return None;
            }
            let (next, unit) = if front {
                (now + 1, lo)
            } else {
                (now - (1 << 32), hi - 1)
            };
            match ends.compare_exchange_weak(now, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(unit as usize),
                Err(seen) => now = seen,
            }
        }
    };
    join(
        || {
            while let Some(i) = take(true) {
                f(i, true);
            }
        },
        || {
            while let Some(i) = take(false) {
                f(i, false);
            }
        },
    );
}

/// Runs `f` over `0..n` cut into contiguous ranges of at least `min` rows, on this thread and
/// the helper (`for_each`); fewer than `2 · min` rows run here as one range. For per-row work
/// (norms, activation rounding, SiLU) between a pass's products, whose rows are independent:
/// which thread takes a row cannot change it.
pub fn for_row_ranges(n: usize, min: usize, f: impl Fn(Range<usize>) + Sync) {
    let pieces = (n / min.max(1)).min(ROW_PIECES);
    if pieces < 2 {
        f(0..n);
        return;
    }
    for_each(pieces, |u| f(u * n / pieces..(u + 1) * n / pieces));
}

/// Ranges `for_row_ranges` cuts at most: a few each, so neither thread waits long.
const ROW_PIECES: usize = 8;

/// `for_row_ranges` for work that writes its own rows of `out` (rows of `row_len` values):
/// `f(rows, part)` gets those rows' part of `out`.
pub fn for_row_parts<T: Send>(
    out: &mut [T],
    row_len: usize,
    min: usize,
    f: impl Fn(Range<usize>, &mut [T]) + Sync,
) {
    let n = out.len().checked_div(row_len).unwrap_or(0);
    let shared = Shared::new(out);
    for_row_ranges(n, min, |rows| {
        // SAFETY: the ranges of rows are disjoint, and so are their parts.
        let part = unsafe { shared.part(rows.start * row_len..rows.end * row_len) };
        f(rows, part);
    });
}

/// A mutable slice that the pieces of a job on both threads (`for_each`, `for_row_ranges`)
/// write into, each its own part.
pub struct Shared<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: PhantomData<&'a mut [T]>,
}

// SAFETY: shared between threads only to hand out disjoint parts (`part`'s contract).
unsafe impl<T: Send> Sync for Shared<'_, T> {}

impl<'a, T> Shared<'a, T> {
    /// Views `slice` for the helper thread.
    pub fn new(slice: &'a mut [T]) -> Self {
        Shared {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            _slice: PhantomData,
        }
    }

    /// Values `range` of the slice.
    ///
    /// # Safety
    /// No two parts in use at once may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "part out of range"
        );
        // SAFETY: inside the slice (asserted); disjoint from other live parts (the contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

/// Runs `a` on this thread and `b` on the helper at once, and returns when both are done.
/// Without a helper (one CPU, or another caller using it) both run here, `a` then `b`.
pub fn join(a: impl Fn() + Sync, b: impl Fn() + Sync) {
    let Some(h) = helper() else {
        a();
        b();
        return;
    };
    let Ok(_guard) = h.caller.try_lock() else {
        a();
        b();
        return;
    };
    let job: &(dyn Fn() + Sync) = &b;
    // SAFETY: the helper only calls the job after claiming it and before storing DONE, and this
    // function does not return (or unwind: `a` is caught below) before it has seen DONE or
    // taken the job back unclaimed, so the borrow outlives every use. The transmute only
    // erases that lifetime.
    let job: Job = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), Job>(job) };
    unsafe { *h.job.get() = Some(job) };
    h.state.store(POSTED, Ordering::SeqCst);
    if h.sleeping.load(Ordering::SeqCst) {
        h.thread.unpark();
    }
    let mine = catch_unwind(AssertUnwindSafe(&a));
    if h.state
        .compare_exchange(POSTED, IDLE, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // Taken back before the helper claimed it: it will not touch the job now.
        unsafe { *h.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        b();
        return;
    }
    while h.state.load(Ordering::Acquire) != DONE {
        std::hint::spin_loop();
    }
    h.state.store(IDLE, Ordering::Release);
    let theirs_panicked = h.panicked.swap(false, Ordering::Relaxed);
    if let Err(p) = mine {
        std::panic::resume_unwind(p);
    }
    assert!(
        !theirs_panicked,
        "the int8 helper thread's half of a job panicked"
    );
}

/// The median time of `joins` empty jobs handed to the helper and back (after a few more that
/// wake it), or None without a helper: the least that splitting work between the threads costs.
/// It also tells how far apart the two threads sit, which split kernels' times follow
/// (core_rates in bench_runtime.py prints it first; docs/benchmarks.md §14).
pub fn round_trip(joins: usize) -> Option<Duration> {
    helper()?;
    let mut times: Vec<Duration> = (0..joins + 16)
        .map(|_| {
            let t = Instant::now();
            join(|| {}, || {});
            t.elapsed()
        })
        .collect();
    let times = &mut times[16..];
    times.sort_unstable();
    times.get(times.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_round_trip_is_measured_where_there_is_a_helper() {
        let trip = round_trip(11);
        assert_eq!(trip.is_some(), helper().is_some());
        // Well under the helper's spin: it stays awake through the joins.
        assert!(trip.is_none_or(|t| t > Duration::ZERO && t < SPIN));
    }

    #[test]
    fn both_halves_run_every_time() {
        let n = AtomicUsize::new(0);
        for _ in 0..10_000 {
            join(
                || {
                    n.fetch_add(1, Ordering::Relaxed);
                },
                || {
                    n.fetch_add(1_000_000, Ordering::Relaxed);
                },
            );
        }
        assert_eq!(n.load(Ordering::Relaxed), 10_000 * 1_000_001);
    }

    #[test]
    fn row_ranges_cover_every_row_once() {
        for (n, min) in [
            (0, 1),
            (1, 0),
            (7, 7),
            (13, 7),
            (14, 7),
            (100, 3),
            (1000, 1),
        ] {
            let seen: Vec<AtomicU8> = (0..n).map(|_| AtomicU8::new(0)).collect();
            for_row_ranges(n, min, |rows| {
                assert!(rows.len() >= min.min(n).max(1) || n == 0);
                for r in rows {
                    seen[r].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "{n} rows, {min}"
            );
        }
    }

    #[test]
    fn for_each_runs_every_unit_once() {
        for units in [0, 1, 2, 7, 100] {
            let seen: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            for_each(units, |i| {
                seen[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "{units} units"
            );
        }
    }

    #[test]
    fn units_from_the_front_ascend_and_from_the_back_descend() {
        for units in [1, 2, 7, 100] {
            let order = Mutex::new(Vec::new());
            for_each_from_ends(units, |i, front| order.lock().unwrap().push((i, front)));
            let order = order.into_inner().unwrap();
            let front: Vec<usize> = order.iter().filter(|u| u.1).map(|u| u.0).collect();
            let back: Vec<usize> = order.iter().filter(|u| !u.1).map(|u| u.0).collect();
            // The front takes 0, 1, ... and the back units - 1, units - 2, ... until they meet.
            assert_eq!(front, (0..front.len()).collect::<Vec<_>>(), "{units} units");
            assert_eq!(
                back,
                (front.len()..units).rev().collect::<Vec<_>>(),
                "{units} units"
            );
        }
    }

    #[test]
    fn after_the_helper_slept() {
        let n = AtomicUsize::new(0);
        join(|| (), || ());
        std::thread::sleep(std::time::Duration::from_millis(50)); // long past SPIN: parked
        join(
            || (),
            || {
                n.fetch_add(1, Ordering::Relaxed);
            },
        );
        assert_eq!(n.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_slow_first_half_still_runs_both() {
        let n = AtomicUsize::new(0);
        for _ in 0..200 {
            join(
                || std::thread::sleep(std::time::Duration::from_micros(50)),
                || {
                    n.fetch_add(1, Ordering::Relaxed);
                },
            );
            join(
                || {
                    n.fetch_add(1, Ordering::Relaxed);
                },
                || (),
            );
        }
        assert_eq!(n.load(Ordering::Relaxed), 400);
    }

    #[test]
    fn concurrent_callers() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..2_000 {
                        join(
                            || {
                                total.fetch_add(1, Ordering::Relaxed);
                            },
                            || {
                                total.fetch_add(1, Ordering::Relaxed);
                            },
                        );
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 2_000 * 2);
    }
}
