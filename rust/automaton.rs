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

/// Positions, states and edges are `u32`; this bound keeps `3n` edges below `2^29`, which frees the
/// top three bits of a hash slot for a fingerprint.
pub const MAX_TOKENS: usize = 1 << 27;

const EDGE_BITS: u32 = 29;
const EDGE_MASK: u32 = (1 << EDGE_BITS) - 1;

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

/// One state, kept together so that a visit costs one cache miss.
#[derive(Debug, Clone, Copy)]
struct State {
    len: u32,
    link: u32,
    first: u32,
    head: u32,
}

/// One transition: the hash table compares `src` and `tok` and reads `to` in one cache miss.
#[derive(Debug, Clone, Copy)]
struct Edge {
    src: u32,
    tok: u32,
    to: u32,
}

#[derive(Debug, Clone)]
pub struct Automaton {
    st: Vec<State>,
    recent: Vec<u32>,
    count: Vec<u32>,
    edges: Vec<Edge>,
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

/// Three hash bits not used by the slot index, in the slot's top bits.
#[inline]
fn fingerprint(h: u64) -> u32 {
    ((h >> 61) as u32) << EDGE_BITS
}

impl Automaton {
    pub fn new(tracking: Tracking) -> Self {
        let mut a = Automaton {
            st: Vec::new(),
            recent: Vec::new(),
            count: Vec::new(),
            edges: Vec::new(),
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
        self.st.len()
    }

    pub fn edges(&self) -> usize {
        self.edges.len()
    }

    /// Bytes held, counting allocated capacity.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<State>() * self.st.capacity()
            + std::mem::size_of::<Edge>() * self.edges.capacity()
            + 4 * (self.recent.capacity()
                + self.count.capacity()
                + self.e_next.capacity()
                + self.slots.capacity())
    }

    pub fn reserve(&mut self, tokens: usize) {
        // On text, about 1.6 states and 1.6 edges per token.
        let s = tokens + tokens / 2;
        self.st.reserve(s);
        if self.tracking.recent {
            self.recent.reserve(s);
        }
        if self.tracking.count {
            self.count.reserve(s);
        }
        self.edges.reserve(s);
        self.e_next.reserve(s);
    }

    /// The longest string of `state` has this many tokens.
    #[inline]
    pub fn len_of(&self, state: u32) -> u32 {
        self.st[state as usize].len
    }

    #[inline]
    pub fn link_of(&self, state: u32) -> u32 {
        self.st[state as usize].link
    }

    /// The earliest end position of the strings of `state`.
    #[inline]
    pub fn first_end(&self, state: u32) -> u32 {
        self.st[state as usize].first
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
        let mut e = self.st[state as usize].head;
        std::iter::from_fn(move || {
            if e == NONE {
                return None;
            }
            let edge = self.edges[e as usize];
            let item = (edge.tok, edge.to);
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
        let h = hash(src, tok);
        let mut i = (h >> 20) as usize & mask;
        let fp = fingerprint(h);
        loop {
            let slot = self.slots[i];
            if slot == NONE {
                return (i, NONE);
            }
            // The fingerprint skips most wrong slots without touching their edge (a cache miss).
            if slot & !EDGE_MASK == fp {
                let e = slot & EDGE_MASK;
                let edge = &self.edges[e as usize];
                if edge.src == src && edge.tok == tok {
                    return (i, e);
                }
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
            Some(self.edges[e as usize].to)
        }
    }

    fn grow_slots(&mut self) {
        let cap = self.slots.len() * 2;
        self.slots = vec![NONE; cap];
        let mask = cap - 1;
        for (e, edge) in self.edges.iter().enumerate() {
            let h = hash(edge.src, edge.tok);
            let mut i = (h >> 20) as usize & mask;
            while self.slots[i] != NONE {
                i = (i + 1) & mask;
            }
            self.slots[i] = e as u32 | fingerprint(h);
        }
    }

    fn add_edge(&mut self, src: u32, tok: u32, to: u32) {
        // Load factor at most 3/4.
        if (self.edges.len() + 1) * 4 > self.slots.len() * 3 {
            self.grow_slots();
        }
        let (i, _) = self.find_slot(src, tok);
        let fp = fingerprint(hash(src, tok));
        let e = self.edges.len() as u32;
        self.edges.push(Edge { src, tok, to });
        self.e_next.push(self.st[src as usize].head);
        self.st[src as usize].head = e;
        self.slots[i] = e | fp;
    }

    fn set_edge(&mut self, src: u32, tok: u32, to: u32) {
        let (_, e) = self.find_slot(src, tok);
        if e != NONE {
            self.edges[e as usize].to = to;
        }
    }

    fn new_state(&mut self, len: u32, link: u32, first: u32, recent: u32, count: u32) -> u32 {
        let s = self.st.len() as u32;
        self.st.push(State {
            len,
            link,
            first,
            head: NONE,
        });
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
        let (first, recent, count) = (self.st[qi].first, self.recent_end(q), self.count_of(q));
        let c = self.new_state(len, self.st[qi].link, first, recent, count);
        let mut e = self.st[qi].head;
        while e != NONE {
            let Edge { tok, to, .. } = self.edges[e as usize];
            self.add_edge(c, tok, to);
            e = self.e_next[e as usize];
        }
        self.st[qi].link = c;
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
            state = self.st[s].link;
        }
    }

    /// Indexes one token at the end of the current document. The caller keeps the total below
    /// [`MAX_TOKENS`].
    pub fn push(&mut self, c: u32) {
        let pos = self.n;
        self.n += 1;
        let last = self.last;
        let want = self.st[last as usize].len + 1;
        // Generalised automaton: a new document can repeat a string already indexed.
        if let Some(q) = self.next(last, c) {
            let state = if self.st[q as usize].len == want {
                q
            } else {
                let clone = self.clone_state(q, want);
                let mut p = last;
                while p != NONE && self.next(p, c) == Some(q) {
                    self.set_edge(p, c, clone);
                    p = self.st[p as usize].link;
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
            p = self.st[p as usize].link;
        }
        if p != NONE {
            let q = self.next(p, c).unwrap_or(ROOT);
            if self.st[p as usize].len + 1 == self.st[q as usize].len {
                self.st[cur as usize].link = q;
            } else {
                let clone = self.clone_state(q, self.st[p as usize].len + 1);
                while p != NONE && self.next(p, c) == Some(q) {
                    self.set_edge(p, c, clone);
                    p = self.st[p as usize].link;
                }
                self.st[cur as usize].link = clone;
            }
        }
        self.last = cur;
        self.recent_before = self.recent_end(self.st[cur as usize].link);
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
