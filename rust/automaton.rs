//! An online suffix automaton over `u32` token ids, with sparse transitions.
//!
//! It accepts several documents (a generalised suffix automaton: each document starts again from
//! the root, so no indexed string spans a document boundary). Every state knows the first end
//! position of its strings; optionally it also tracks the most recent end position and the number
//! of end positions, which the "recent" and "frequent" policies need.
//!
//! Layout, chosen for memory (every figure is per state or per transition):
//! - states: `len`, `link`, `first`, `head` as four `u32` arrays (16 bytes), plus `recent` and
//!   `count` (4 bytes each) only when tracked;
//! - transitions: one global open-addressing hash table keyed by `(state, token)` whose slots hold
//!   an edge index (4 bytes per slot), and edges stored as `src`, `token`, `target`, `next` arrays
//!   (16 bytes). `next` threads each state's out-edges into a list, which cloning and the
//!   "frequent" policy walk.
//!
//! A suffix automaton over n tokens has at most 2n states and 3n transitions; on real text it is
//! about 1.5n of each.

const NONE: u32 = u32::MAX;

/// Positions, states and edges are `u32`; this bound keeps `2n` states and `3n` edges below
/// `u32::MAX`.
pub const MAX_TOKENS: usize = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracking {
    /// Keep the most recent end position of every state (costs a walk up the suffix links).
    pub recent: bool,
    /// Keep the number of end positions of every state (costs a walk up the suffix links).
    pub count: bool,
}

impl Tracking {
    fn any(self) -> bool {
        self.recent || self.count
    }
}

#[derive(Debug, Clone)]
pub struct Automaton {
    len: Vec<u32>,
    link: Vec<u32>,
    first: Vec<u32>,
    head: Vec<u32>,
    recent: Vec<u32>,
    count: Vec<u32>,
    e_src: Vec<u32>,
    e_tok: Vec<u32>,
    e_to: Vec<u32>,
    e_next: Vec<u32>,
    slots: Vec<u32>,
    tracking: Tracking,
    /// The state holding the whole current document.
    last: u32,
    /// Tokens indexed so far, over all documents: the next end position.
    n: u32,
    /// Before the last push's propagation: the most recent end position of `link(last)`.
    recent_before: u32,
}

pub const ROOT: u32 = 0;

#[inline]
fn hash(src: u32, tok: u32) -> u64 {
    let x = ((src as u64) << 32 | tok as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

impl Automaton {
    pub fn new(tracking: Tracking) -> Self {
        let mut a = Automaton {
            len: Vec::new(),
            link: Vec::new(),
            first: Vec::new(),
            head: Vec::new(),
            recent: Vec::new(),
            count: Vec::new(),
            e_src: Vec::new(),
            e_tok: Vec::new(),
            e_to: Vec::new(),
            e_next: Vec::new(),
            slots: vec![NONE; 16],
            tracking,
            last: ROOT,
            n: 0,
            recent_before: NONE,
        };
        a.new_state(0, NONE, NONE, NONE, 0);
        a
    }

    /// Tokens indexed, over all documents.
    pub fn tokens(&self) -> usize {
        self.n as usize
    }

    pub fn states(&self) -> usize {
        self.len.len()
    }

    pub fn edges(&self) -> usize {
        self.e_to.len()
    }

    /// Bytes held, counting allocated capacity.
    pub fn memory_bytes(&self) -> usize {
        4 * (self.len.capacity()
            + self.link.capacity()
            + self.first.capacity()
            + self.head.capacity()
            + self.recent.capacity()
            + self.count.capacity()
            + self.e_src.capacity()
            + self.e_tok.capacity()
            + self.e_to.capacity()
            + self.e_next.capacity()
            + self.slots.capacity())
    }

    pub fn reserve(&mut self, tokens: usize) {
        // On text, about 1.6 states and 1.6 edges per token.
        let s = tokens + tokens / 2;
        self.len.reserve(s);
        self.link.reserve(s);
        self.first.reserve(s);
        self.head.reserve(s);
        if self.tracking.recent {
            self.recent.reserve(s);
        }
        if self.tracking.count {
            self.count.reserve(s);
        }
        self.e_src.reserve(s);
        self.e_tok.reserve(s);
        self.e_to.reserve(s);
        self.e_next.reserve(s);
    }

    /// The longest string of `state` has this many tokens.
    #[inline]
    pub fn len_of(&self, state: u32) -> u32 {
        self.len[state as usize]
    }

    #[inline]
    pub fn link_of(&self, state: u32) -> u32 {
        self.link[state as usize]
    }

    /// The earliest end position of the strings of `state`.
    #[inline]
    pub fn first_end(&self, state: u32) -> u32 {
        self.first[state as usize]
    }

    /// The most recent end position of the strings of `state` (needs `Tracking::recent`).
    #[inline]
    pub fn recent_end(&self, state: u32) -> u32 {
        self.recent.get(state as usize).copied().unwrap_or(NONE)
    }

    /// How many times the strings of `state` occur (needs `Tracking::count`).
    #[inline]
    pub fn count_of(&self, state: u32) -> u32 {
        self.count.get(state as usize).copied().unwrap_or(0)
    }

    /// The state holding the whole current document.
    pub fn last_state(&self) -> u32 {
        self.last
    }

    /// The most recent end position of `link(last)` before the last token was indexed, that is,
    /// the most recent *earlier* occurrence of the longest repeated suffix (single-document use).
    pub fn recent_before(&self) -> u32 {
        self.recent_before
    }

    /// Out-edges of `state` as `(token, target)`.
    pub fn out_edges(&self, state: u32) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut e = self.head[state as usize];
        std::iter::from_fn(move || {
            if e == NONE {
                return None;
            }
            let item = (self.e_tok[e as usize], self.e_to[e as usize]);
            e = self.e_next[e as usize];
            Some(item)
        })
    }

    /// Starts a new document: later tokens extend no string of the earlier ones.
    pub fn start_document(&mut self) {
        self.last = ROOT;
    }

    #[inline]
    fn find_slot(&self, src: u32, tok: u32) -> (usize, u32) {
        let mask = self.slots.len() - 1;
        let mut i = (hash(src, tok) >> 20) as usize & mask;
        loop {
            let e = self.slots[i];
            if e == NONE || (self.e_src[e as usize] == src && self.e_tok[e as usize] == tok) {
                return (i, e);
            }
            i = (i + 1) & mask;
        }
    }

    /// The target of `state`'s transition on `tok`.
    #[inline]
    pub fn next(&self, state: u32, tok: u32) -> Option<u32> {
        let (_, e) = self.find_slot(state, tok);
        if e == NONE {
            None
        } else {
            Some(self.e_to[e as usize])
        }
    }

    fn grow_slots(&mut self) {
        let cap = self.slots.len() * 2;
        self.slots = vec![NONE; cap];
        let mask = cap - 1;
        for e in 0..self.e_src.len() {
            let mut i = (hash(self.e_src[e], self.e_tok[e]) >> 20) as usize & mask;
            while self.slots[i] != NONE {
                i = (i + 1) & mask;
            }
            self.slots[i] = e as u32;
        }
    }

    fn add_edge(&mut self, src: u32, tok: u32, to: u32) {
        // Load factor at most 3/4.
        if (self.e_src.len() + 1) * 4 > self.slots.len() * 3 {
            self.grow_slots();
        }
        let (i, _) = self.find_slot(src, tok);
        let e = self.e_src.len() as u32;
        self.e_src.push(src);
        self.e_tok.push(tok);
        self.e_to.push(to);
        self.e_next.push(self.head[src as usize]);
        self.head[src as usize] = e;
        self.slots[i] = e;
    }

    fn set_edge(&mut self, src: u32, tok: u32, to: u32) {
        let (_, e) = self.find_slot(src, tok);
        if e != NONE {
            self.e_to[e as usize] = to;
        }
    }

    fn new_state(&mut self, len: u32, link: u32, first: u32, recent: u32, count: u32) -> u32 {
        let s = self.len.len() as u32;
        self.len.push(len);
        self.link.push(link);
        self.first.push(first);
        self.head.push(NONE);
        if self.tracking.recent {
            self.recent.push(recent);
        }
        if self.tracking.count {
            self.count.push(count);
        }
        s
    }

    /// Splits `q`: a new state with `q`'s transitions, end positions and suffix link, and length
    /// `len`; `q` then links to it.
    fn clone_state(&mut self, q: u32, len: u32) -> u32 {
        let qi = q as usize;
        let (first, recent, count) = (self.first[qi], self.recent_end(q), self.count_of(q));
        let c = self.new_state(len, self.link[qi], first, recent, count);
        let mut e = self.head[qi];
        while e != NONE {
            let (tok, to) = (self.e_tok[e as usize], self.e_to[e as usize]);
            self.add_edge(c, tok, to);
            e = self.e_next[e as usize];
        }
        self.link[qi] = c;
        c
    }

    /// Adds end position `pos` to `state` and all its suffix-link ancestors.
    fn propagate(&mut self, mut state: u32, pos: u32) {
        while state != NONE && state != ROOT {
            let s = state as usize;
            if self.tracking.recent {
                self.recent[s] = pos;
            }
            if self.tracking.count {
                self.count[s] += 1;
            }
            state = self.link[s];
        }
    }

    /// Indexes one token at the end of the current document. The caller keeps the total below
    /// [`MAX_TOKENS`].
    pub fn push(&mut self, c: u32) {
        let pos = self.n;
        self.n += 1;
        let last = self.last;
        let want = self.len[last as usize] + 1;
        // Generalised automaton: a new document can repeat a string already indexed.
        if let Some(q) = self.next(last, c) {
            let state = if self.len[q as usize] == want {
                q
            } else {
                let clone = self.clone_state(q, want);
                let mut p = last;
                while p != NONE && self.next(p, c) == Some(q) {
                    self.set_edge(p, c, clone);
                    p = self.link[p as usize];
                }
                clone
            };
            self.last = state;
            self.recent_before = self.recent_end(state);
            if self.tracking.any() {
                self.propagate(state, pos);
            }
            return;
        }
        let cur = self.new_state(want, ROOT, pos, pos, 0);
        let mut p = last;
        while p != NONE && self.next(p, c).is_none() {
            self.add_edge(p, c, cur);
            p = self.link[p as usize];
        }
        if p != NONE {
            let q = self.next(p, c).unwrap_or(ROOT);
            if self.len[p as usize] + 1 == self.len[q as usize] {
                self.link[cur as usize] = q;
            } else {
                let clone = self.clone_state(q, self.len[p as usize] + 1);
                while p != NONE && self.next(p, c) == Some(q) {
                    self.set_edge(p, c, clone);
                    p = self.link[p as usize];
                }
                self.link[cur as usize] = clone;
            }
        }
        self.last = cur;
        self.recent_before = self.recent_end(self.link[cur as usize]);
        if self.tracking.any() {
            self.propagate(cur, pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(s: &[u32], tracking: Tracking) -> Automaton {
        let mut a = Automaton::new(tracking);
        for &c in s {
            a.push(c);
        }
        a
    }

    fn all() -> Tracking {
        Tracking {
            recent: true,
            count: true,
        }
    }

    fn walk(a: &Automaton, w: &[u32]) -> Option<u32> {
        let mut s = ROOT;
        for &c in w {
            s = a.next(s, c)?;
        }
        Some(s)
    }

    #[test]
    fn recognises_exactly_the_substrings() {
        let s = [1, 2, 1, 2, 3, 1, 2, 1];
        let a = build(&s, all());
        for i in 0..s.len() {
            for j in i + 1..=s.len() {
                assert!(walk(&a, &s[i..j]).is_some());
            }
        }
        assert!(walk(&a, &[3, 3]).is_none());
        assert!(walk(&a, &[2, 2]).is_none());
        assert!(a.states() < 2 * s.len());
    }

    #[test]
    fn tracks_first_recent_and_count() {
        let s = [5, 7, 5, 7, 5];
        let a = build(&s, all());
        let st = walk(&a, &[5, 7]).unwrap();
        assert_eq!(a.first_end(st), 1);
        assert_eq!(a.recent_end(st), 3);
        assert_eq!(a.count_of(st), 2);
        let st = walk(&a, &[5]).unwrap();
        assert_eq!(
            (a.first_end(st), a.recent_end(st), a.count_of(st)),
            (0, 4, 3)
        );
    }

    #[test]
    fn documents_do_not_join() {
        let mut a = Automaton::new(all());
        a.push(1);
        a.push(2);
        a.start_document();
        a.push(3);
        a.push(4);
        assert!(walk(&a, &[2, 3]).is_none());
        assert!(walk(&a, &[3, 4]).is_some());
        a.start_document();
        a.push(1);
        a.push(2);
        let st = walk(&a, &[1, 2]).unwrap();
        assert_eq!(
            (a.first_end(st), a.recent_end(st), a.count_of(st)),
            (1, 5, 2)
        );
    }

    #[test]
    fn large_ids_and_many_tokens() {
        let s: Vec<u32> = (0..20_000u32)
            .map(|i| (i * 7919) % 300_000 + u32::MAX - 300_000)
            .collect();
        let a = build(
            &s,
            Tracking {
                recent: false,
                count: false,
            },
        );
        assert!(walk(&a, &s[100..200]).is_some());
        assert_eq!(a.tokens(), s.len());
    }
}
