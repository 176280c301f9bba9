//! Fixed-length buffers for a model's weights, carved one after another out of shared slabs of
//! 2 MiB pages.
//!
//! A pass reads every weight matrix once, in the order the model was loaded. Each matrix in
//! its own heap allocation lies on 4 KiB pages: a pass walks tens of thousands of them, far
//! more than the TLB holds, and the cores' prefetchers stop at each page's end. Carved side by
//! side out of slabs that Linux backs with 2 MiB pages (`MADV_HUGEPAGE`), the weights read
//! faster (bench_runtime.py; docs/benchmarks.md §14).
//!
//! A slab lives as long as any buffer carved from it; the open slab, which new buffers come
//! from, is held only through them, so a dropped model frees its slabs.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use specfast_core::bigvec::{advise_huge_pages, HUGE};

/// Bytes a slab holds, unless one buffer needs more (it then gets a slab of its own).
const SLAB: usize = 32 << 20;
/// Buffers start on a cache line.
const LINE: usize = 64;

struct Slab {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a slab is plain memory that it owns; its buffers control who writes where.
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Slab {
    fn new(size: usize) -> Slab {
        let layout = Layout::from_size_align(size.next_multiple_of(HUGE), HUGE).expect("slab size");
        // SAFETY: the size is at least HUGE, not zero.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        advise_huge_pages(raw, layout.size());
        Slab { ptr, layout }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Where buffers come from: the open slab, which small buffers share, and how many of its
/// bytes are taken.
struct Slabs(Mutex<(Weak<Slab>, usize)>);

/// The process's slabs, which every weight buffer comes from (tests make their own).
static SLABS: Slabs = Slabs::new();

impl Slabs {
    const fn new() -> Slabs {
        Slabs(Mutex::new((Weak::new(), 0)))
    }

    /// `bytes` at a cache line of a slab: the open one where it has room, else a new one.
    fn carve(&self, bytes: usize) -> (Arc<Slab>, NonNull<u8>) {
        let bytes = bytes.next_multiple_of(LINE);
        if bytes > SLAB / 2 {
            // A slab of its own; the open one stays open for the small buffers.
            let slab = Arc::new(Slab::new(bytes));
            let ptr = slab.ptr;
            return (slab, ptr);
        }
        let mut open = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slab = match open.0.upgrade() {
            Some(slab) if open.1 + bytes <= slab.layout.size() => slab,
            _ => {
                let slab = Arc::new(Slab::new(SLAB));
                *open = (Arc::downgrade(&slab), 0);
                slab
            }
        };
        // SAFETY: open.1 + bytes is within the slab (checked above, or a fresh slab of SLAB
        // bytes).
        let ptr = unsafe { NonNull::new_unchecked(slab.ptr.as_ptr().add(open.1)) };
        open.1 += bytes;
        (slab, ptr)
    }
}

/// A fixed-length array of weights in a slab (see the module's documentation).
pub struct WeightBuf<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    /// Keeps the slab alive while this buffer is (None for an empty buffer): held for its
    /// drop, read only by the tests.
    #[cfg_attr(not(test), allow(dead_code))]
    slab: Option<Arc<Slab>>,
}

// SAFETY: a WeightBuf owns its items and its part of the slab, as a Vec owns its buffer.
unsafe impl<T: Copy + Send> Send for WeightBuf<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: Copy + Sync> Sync for WeightBuf<T> {}

impl<T: Copy> WeightBuf<T> {
    /// `len` copies of `fill`.
    pub fn from_elem(fill: T, len: usize) -> Self {
        Self::carved(&SLABS, len, |_| fill)
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[T]) -> Self {
        Self::carved(&SLABS, src.len(), |i| src[i])
    }

    /// `len` items out of `slabs`, item i written as `item(i)`.
    fn carved(slabs: &Slabs, len: usize, item: impl Fn(usize) -> T) -> Self {
        assert!(
            size_of::<T>() > 0 && align_of::<T>() <= LINE,
            "WeightBuf holds items of 1 to {LINE}-byte alignment"
        );
        if len == 0 {
            return WeightBuf {
                ptr: NonNull::dangling(),
                len: 0,
                slab: None,
            };
        }
        let bytes = len.checked_mul(size_of::<T>()).expect("WeightBuf size");
        let (slab, ptr) = slabs.carve(bytes);
        let ptr = ptr.cast::<T>();
        for i in 0..len {
            // SAFETY: the carved bytes hold len items, on a line, which T's alignment divides.
            unsafe { ptr.as_ptr().add(i).write(item(i)) };
        }
        WeightBuf {
            ptr,
            len,
            slab: Some(slab),
        }
    }
}

#[cfg(test)]
impl<T: Copy> WeightBuf<T> {
    fn slab_of(&self) -> &Arc<Slab> {
        self.slab.as_ref().expect("an empty buffer has no slab")
    }
}

impl<T: Copy> Deref for WeightBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: len items were written in `carved`; ptr is dangling only when len == 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for WeightBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref; no other buffer overlaps these bytes, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_hold_their_own_items_side_by_side() {
        let slabs = Slabs::new();
        // Several sizes, each filled with its own pattern, then read back after all are made:
        // buffers that overlapped, or a carve that did not move on, would mix the patterns.
        let lens = [1usize, 7, 64, 1000, 4096, 100_000, 3];
        let mut bufs: Vec<WeightBuf<u32>> = lens
            .iter()
            .map(|&n| WeightBuf::carved(&slabs, n, |_| 0))
            .collect();
        for (b, buf) in bufs.iter_mut().enumerate() {
            for (i, v) in buf.iter_mut().enumerate() {
                *v = (b as u32) << 24 | i as u32;
            }
        }
        for (b, (buf, &n)) in bufs.iter().zip(&lens).enumerate() {
            assert_eq!(buf.len(), n);
            assert!(buf
                .iter()
                .enumerate()
                .all(|(i, &v)| v == (b as u32) << 24 | i as u32));
            assert_eq!(
                buf.as_ptr() as usize % LINE,
                0,
                "buffer {b} is not on a cache line"
            );
        }
        // Small buffers made one after another lie one after another: the point of the slab.
        for pair in bufs.windows(2) {
            let bytes = (pair[0].len() * 4).next_multiple_of(LINE);
            assert_eq!(pair[1].as_ptr() as usize - pair[0].as_ptr() as usize, bytes);
        }
        assert_eq!(bufs[0].as_ptr() as usize % HUGE, 0);
    }

    #[test]
    fn a_full_slab_gives_way_to_a_new_one_and_big_buffers_get_their_own() {
        let slabs = Slabs::new();
        let half = WeightBuf::carved(&slabs, SLAB / 2, |_| 1u8);
        let most = WeightBuf::carved(&slabs, SLAB / 2 - LINE, |_| 2u8);
        let next = WeightBuf::carved(&slabs, 2 * LINE, |_| 3u8); // no room left in the first
        assert!(Arc::ptr_eq(half.slab_of(), most.slab_of()));
        assert!(!Arc::ptr_eq(half.slab_of(), next.slab_of()));
        assert!(half.iter().all(|&v| v == 1) && most.iter().all(|&v| v == 2));
        let src: Vec<f32> = (0..(SLAB / 4 + 5)).map(|i| i as f32 * 0.5).collect();
        let big = WeightBuf::from_slice(&src);
        assert_eq!(&big[..], &src[..]);
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        assert!(WeightBuf::<f32>::from_slice(&[]).is_empty());
    }

    #[test]
    fn a_slab_is_freed_with_its_last_buffer() {
        let slabs = Slabs::new();
        let a = WeightBuf::carved(&slabs, 1000, |_| 0u16);
        let b = WeightBuf::carved(&slabs, 10, |_| 0u16);
        let slab = Arc::downgrade(a.slab_of());
        drop(a);
        assert!(slab.upgrade().is_some(), "b still lies in the slab");
        drop(b);
        assert!(
            slab.upgrade().is_none(),
            "no buffer left, yet the slab lives"
        );
        // The next buffer then starts a new slab at its beginning.
        let c = WeightBuf::carved(&slabs, 10, |_| 0u16);
        assert_eq!(c.as_ptr() as usize % HUGE, 0);
    }
}
