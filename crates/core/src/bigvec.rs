//! A growable array of `Copy` items whose large buffers start on 2 MiB boundaries and are marked
//! for transparent huge pages.
//!
//! The automaton's arrays are read at random places: past a few MB, with 4 KiB pages nearly every
//! read also misses the TLB, and the page walk that follows evicts the interpreter's own entries,
//! so the Python side of a round gets slower too. Linux backs memory with 2 MiB pages only where a
//! whole aligned 2 MiB range lies inside a region advised with `MADV_HUGEPAGE`, and a `Vec`'s
//! buffer starts wherever the allocator puts it (bench_drafter.py; docs/benchmarks.md §14).

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The huge page size, 2 MiB: the alignment of large buffers and of the advised ranges.
pub const HUGE: usize = 2 << 20;

/// A growable array of `Copy` items on 2 MiB-aligned buffers advised for huge pages.
pub struct BigVec<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
}

// SAFETY: a BigVec owns its buffer, as a Vec does.
unsafe impl<T: Copy + Send> Send for BigVec<T> {}
// SAFETY: shared access only reads, as with a Vec.
unsafe impl<T: Copy + Sync> Sync for BigVec<T> {}

impl<T: Copy> BigVec<T> {
    /// An empty array; nothing is allocated until the first push.
    pub const fn new() -> Self {
        BigVec {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// `n` copies of `fill`.
    pub fn from_elem(fill: T, n: usize) -> Self {
        let mut v = Self::new();
        v.reserve_touched(n, fill);
        v.len = n;
        v
    }

    /// Items the buffer holds before it grows.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The buffer for `cap` items: below 2 MiB as a Vec would have it; from 2 MiB on, whole
    /// 2 MiB pages on a 2 MiB boundary.
    fn layout(cap: usize) -> Layout {
        let size = cap
            .checked_mul(size_of::<T>())
            .expect("BigVec capacity overflow");
        let (size, align) = if size >= HUGE {
            (size.next_multiple_of(HUGE), HUGE)
        } else {
            (size, align_of::<T>())
        };
        Layout::from_size_align(size, align).expect("BigVec layout")
    }

    fn grow_to(&mut self, cap: usize) {
        assert!(size_of::<T>() > 0, "BigVec does not hold zero-sized items");
        let layout = Self::layout(cap);
        // A size rounded up to whole 2 MiB pages fits more items: count them, so that
        // layout(self.cap) gives this layout back when the buffer is freed.
        let cap = if layout.align() == HUGE {
            layout.size() / size_of::<T>()
        } else {
            cap
        };
        self.move_to(cap, layout);
    }

    fn move_to(&mut self, cap: usize, layout: Layout) {
        // SAFETY: the layout has a non-zero size (cap > 0 and T is not zero-sized).
        let raw = unsafe { alloc(layout) }.cast::<T>();
        let Some(new) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        if layout.align() == HUGE {
            advise_huge_pages(new.as_ptr().cast(), layout.size());
        }
        // SAFETY: both buffers hold at least `len` items and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), new.as_ptr(), self.len) };
        self.free();
        self.ptr = new;
        self.cap = cap;
    }

    fn free(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated in move_to with this very layout (it depends on cap only).
            unsafe { dealloc(self.ptr.as_ptr().cast(), Self::layout(self.cap)) };
        }
    }

    /// Makes room for `extra` more items, growing by half at least (a Vec doubles: these
    /// buffers are large, and grow while a long context is generated into).
    pub fn reserve(&mut self, extra: usize) {
        let need = self
            .len
            .checked_add(extra)
            .expect("BigVec capacity overflow");
        if need > self.cap {
            self.grow_to(need.max(self.cap + self.cap / 2).max(16));
        }
    }

    /// Reserves room for `extra` more items and writes `fill` there. The first write to a page is
    /// a page fault, microseconds in a virtual machine: a bulk call takes them all at once here,
    /// so that the pushes of the small calls after it do not take them one by one.
    pub fn reserve_touched(&mut self, extra: usize, fill: T) {
        self.reserve(extra);
        for i in self.len..self.len + extra {
            // SAFETY: i < cap after the reserve.
            unsafe { self.ptr.as_ptr().add(i).write(fill) };
        }
    }

    /// Appends `item`, growing the buffer when it is full.
    pub fn push(&mut self, item: T) {
        if self.len == self.cap {
            self.reserve(1);
        }
        // SAFETY: len < cap.
        unsafe { self.ptr.as_ptr().add(self.len).write(item) };
        self.len += 1;
    }
}

impl<T: Copy> Drop for BigVec<T> {
    fn drop(&mut self) {
        self.free();
    }
}

impl<T: Copy> Default for BigVec<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy> Deref for BigVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the first len items are initialised; ptr is dangling only when len == 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for BigVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Clone for BigVec<T> {
    fn clone(&self) -> Self {
        let mut v = Self::new();
        if self.len > 0 {
            v.reserve(self.len);
            // SAFETY: v has room for len items; the buffers are distinct.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.ptr.as_ptr(), self.len) };
            v.len = self.len;
        }
        v
    }
}

impl<T: Copy + fmt::Debug> fmt::Debug for BigVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Asks Linux to back `[ptr, ptr + len)` (2 MiB-aligned) with 2 MiB pages; elsewhere a no-op.
/// Public for `specfast-kernels`' weight slabs.
pub fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: the range is a live allocation of ours; the advice changes no contents.
    unsafe {
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// Asks for 2 MiB pages on the whole 2 MiB-aligned ranges inside `[addr, addr + len)`, memory
/// allocated elsewhere (a torch tensor's): pages touched after the advice come as huge pages
/// where the kernel has them. Advice only, which changes no contents, so any range is safe; a
/// range that is not mapped is refused by the kernel. Returns the bytes advised: 0 where no
/// whole aligned range lies inside, or off Linux.
pub fn advise_huge_range(addr: usize, len: usize) -> usize {
    let Some(start) = addr.checked_next_multiple_of(HUGE) else {
        return 0;
    };
    let end = addr.saturating_add(len) / HUGE * HUGE;
    if end <= start || cfg!(not(target_os = "linux")) {
        return 0;
    }
    advise_huge_pages(start as *mut u8, end - start);
    end - start
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_advised_on_its_whole_aligned_pages_only() {
        let buf = vec![0u8; 3 * HUGE];
        let addr = buf.as_ptr() as usize;
        let inside = (addr + 3 * HUGE) / HUGE * HUGE - addr.next_multiple_of(HUGE);
        assert_eq!(advise_huge_range(addr, 3 * HUGE), inside);
        assert!(
            inside >= HUGE,
            "3 MiB-wide pages hold at least one aligned 2 MiB range"
        );
        assert_eq!(advise_huge_range(addr, HUGE - 1), 0);
        assert_eq!(advise_huge_range(usize::MAX - 10, 100), 0);
    }

    #[test]
    fn behaves_like_a_vec_across_the_huge_boundary() {
        let mut v: BigVec<u32> = BigVec::new();
        let mut w: Vec<u32> = Vec::new();
        for i in 0..1_200_000u32 {
            v.push(i.wrapping_mul(2_654_435_761));
            w.push(i.wrapping_mul(2_654_435_761));
        }
        assert_eq!(&v[..], &w[..]);
        assert_eq!(v.as_ptr() as usize % HUGE, 0);
        let c = v.clone();
        assert_eq!(&c[..], &w[..]);
        v.reserve_touched(10, 7);
        assert_eq!(v.len(), w.len());
        let e = BigVec::from_elem(3u64, 5);
        assert_eq!(&e[..], &[3; 5]);
        assert!(BigVec::<u8>::new().is_empty());
    }
}
