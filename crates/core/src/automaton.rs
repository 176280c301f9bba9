//! An online suffix automaton over `u32` token ids, with sparse transitions.
//!
//! It accepts several documents (a generalised suffix automaton: each document starts again from
//! the root, so no indexed string spans a document boundary). Every state knows the first end
//! position of its strings; optionally it also tracks the most recent end position and the number
//! of end positions, which the "recent" and "frequent" policies need.
//!
//! Layout, chosen so that indexing a token costs few cache misses once the index outgrows the
//! caches (every figure is per state or per transition):
//! - states: `len`, `link`, `first`, the state's first transition inline (`tok0`, `to0`) and
//!   `head`, the start of the list of its other transitions (24 bytes); plus `recent` and `count`
//!   (4 bytes each, in arrays of their own) only when tracked;
//! - other transitions: one open-addressing hash table keyed by `(state, token)` whose slots hold
//!   the whole edge, `src`, `tok`, `to` and `next` (16 bytes), so a lookup reads one slot. `next`
//!   threads each state's table edges into a list, which cloning and the "frequent" policy walk;
//!   growing the table rebuilds the lists;
//! - the root's transitions (one per distinct token): a small table of their own keyed by token
//!   (8 bytes a slot), which stays in cache;
//! - states and the big table live in [`BigVec`]s, on 2 MiB pages once they are that large.
//!
//! On text most states have a single transition: adding it, or looking up a transition of
//! such a state, reads nothing but the state record, which the walk along suffix links reads
//! anyway. Other lookups and additions read one table slot more. A suffix automaton over n tokens
//! has at most 2n states and 3n transitions; on text it has about 1.3n states and 2.1n
//! transitions, 0.9n of them in the table.

use crate::bigvec::BigVec;
use crate::{prefetch, L1};

const NONE: u32 = u32::MAX;

/// Positions, states and table slots are `u32`; this bound keeps the at most `2n` states and `3n`
/// transitions, and the table holding them, well below `2^32`.
pub const MAX_TOKENS: usize = 1 << 27;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// What each state records beyond its transitions, by match policy.
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

/// One state with its first transition, kept together so that a visit costs one cache miss
/// (24 bytes: a quarter of them straddle two lines, fetched together).
#[derive(Debug, Clone, Copy)]
struct State {
    len: u32,
    link: u32,
    first: u32,
    /// The first transition added: on `tok0` to `to0`, which is NONE while the state has none.
    tok0: u32,
    to0: u32,
    /// The table slot of the state's most recently added other transition, or NONE.
    head: u32,
}

/// A table slot: the transition of `src` on `tok` to `to`, and the slot of `src`'s next table
/// transition. `src == NONE` marks an empty slot. Aligned so that a slot never spans two lines.
#[derive(Debug, Clone, Copy)]
#[repr(align(16))]
struct Edge {
    src: u32,
    tok: u32,
    to: u32,
    next: u32,
}

const NO_STATE: State = State {
    len: 0,
    link: NONE,
    first: NONE,
    tok0: 0,
    to0: NONE,
    head: NONE,
};

/// A root transition: on `tok` to `to`; `to == NONE` marks an empty slot.
#[derive(Debug, Clone, Copy)]
struct RootEdge {
    tok: u32,
    to: u32,
}

const NO_ROOT_EDGE: RootEdge = RootEdge { tok: 0, to: NONE };

const EMPTY: Edge = Edge {
    src: NONE,
    tok: 0,
    to: NONE,
    next: NONE,
};

#[derive(Debug, Clone)]
/// The suffix automaton of every token indexed so far, built online.
pub struct Automaton {
    st: BigVec<State>,
    recent: BigVec<u32>,
    count: BigVec<u32>,
    /// Every transition but the states' first ones and the root's; a power of two long, at most
    /// 3/4 full.
    table: BigVec<Edge>,
    /// The root's transitions, one per distinct token indexed, apart from the big table: nearly
    /// every token's walk ends at the root or passes it, and 8-byte slots in a table of their own
    /// (240 KiB for 30k distinct tokens) stay in cache where the big table's would not.
    /// A power of two long, at most 3/4 full.
    root: Vec<RootEdge>,
    root_edges: usize,
    /// Occupied slots of `table`.
    table_edges: usize,
    /// Transitions, inline and in the table.
    n_edges: usize,
    tracking: Tracking,
    /// The state holding the whole current document.
    last: u32,
    /// Tokens indexed so far, over all documents: the next end position.
    n: u32,
    /// Before the last push's propagation: the most recent end position of `link(last)`.
    recent_before: u32,
}

/// The state of the empty string.
pub const ROOT: u32 = 0;

#[inline]
fn hash(src: u32, tok: u32) -> u64 {
    let x = ((src as u64) << 32 | tok as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

impl Automaton {
    /// An empty automaton that records what `tracking` asks for.
    pub fn new(tracking: Tracking) -> Self {
        let mut a = Automaton {
            st: BigVec::new(),
            recent: BigVec::new(),
            count: BigVec::new(),
            table: BigVec::from_elem(EMPTY, 16),
            root: vec![NO_ROOT_EDGE; 16],
            root_edges: 0,
            table_edges: 0,
            n_edges: 0,
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

    /// States so far (the root included).
    pub fn states(&self) -> usize {
        self.st.len()
    }

    /// Transitions so far.
    pub fn edges(&self) -> usize {
        self.n_edges
    }

    /// Bytes held, counting allocated capacity.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<State>() * self.st.capacity()
            + std::mem::size_of::<Edge>() * self.table.capacity()
            + std::mem::size_of::<RootEdge>() * self.root.capacity()
            + 4 * (self.recent.capacity() + self.count.capacity())
    }

    /// Makes room for `tokens` more tokens, with some to spare, and touches it (see
    /// [`BigVec::reserve_touched`]).
    pub fn reserve(&mut self, tokens: usize) {
        // On text, about 1.3 states and 0.9 table transitions per token.
        let s = tokens + tokens / 2;
        self.st.reserve_touched(s, NO_STATE);
        if self.tracking.recent {
            self.recent.reserve_touched(s, NONE);
        }
        if self.tracking.count {
            self.count.reserve_touched(s, 0);
        }
        self.reserve_table(tokens);
    }

    /// The longest string of `state` has this many tokens.
    #[inline]
    pub fn len_of(&self, state: u32) -> u32 {
        self.st[state as usize].len
    }

    #[inline]
    /// The suffix link of `state`: the state of its longest suffix in another class.
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
        let root: &[RootEdge] = if state == ROOT { &self.root } else { &[] };
        let root = root.iter().filter(|e| e.to != NONE).map(|e| (e.tok, e.to));
        let s = self.st[state as usize];
        let first = (s.to0 != NONE).then_some((s.tok0, s.to0));
        let mut e = s.head;
        root.chain(first).chain(std::iter::from_fn(move || {
            if e == NONE {
                return None;
            }
            let edge = self.table[e as usize];
            e = edge.next;
            Some((edge.tok, edge.to))
        }))
    }

    /// Starts a new document: later tokens extend no string of the earlier ones.
    pub fn start_document(&mut self) {
        self.last = ROOT;
    }

    /// The slot holding `src`'s transition on `tok`, or the empty slot where it would go.
    #[inline]
    fn find_slot(&self, src: u32, tok: u32) -> usize {
        let mask = self.table.len() - 1;
        let mut i = self.home_slot(src, tok);
        loop {
            let edge = &self.table[i];
            if edge.src == NONE || (edge.src == src && edge.tok == tok) {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    /// Starts loading what [`next`](Self::next) or [`add_edge`](Self::add_edge) on `(state, tok)`
    /// will read: the state's record and the table slot where its search begins. Both addresses
    /// are known before either arrives, so the two misses overlap.
    #[inline]
    fn prefetch_visit(&self, state: u32, tok: u32) {
        if state == NONE {
            return;
        }
        if state == ROOT {
            prefetch::<L1, _>(std::ptr::from_ref(&self.root[self.root_home(tok)]));
        } else if let Some(s) = self.st.get(state as usize) {
            prefetch::<L1, _>(std::ptr::from_ref(s));
            prefetch::<L1, _>(std::ptr::from_ref(&self.table[self.home_slot(state, tok)]));
        }
    }

    #[inline]
    fn home_slot(&self, src: u32, tok: u32) -> usize {
        (hash(src, tok) >> 20) as usize & (self.table.len() - 1)
    }

    /// The slot holding the root's transition on `tok`, or the empty slot where it would go.
    #[inline]
    fn root_slot(&self, tok: u32) -> usize {
        let mask = self.root.len() - 1;
        let mut i = self.root_home(tok);
        loop {
            let e = &self.root[i];
            if e.to == NONE || e.tok == tok {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    fn root_home(&self, tok: u32) -> usize {
        (hash(ROOT, tok) >> 20) as usize & (self.root.len() - 1)
    }

    /// Puts the root's transition on `tok`, which it does not have yet.
    fn add_root_edge(&mut self, tok: u32, to: u32) {
        self.root_edges += 1;
        if self.root_edges * 4 > self.root.len() * 3 {
            let grown = vec![NO_ROOT_EDGE; self.root.len() * 2];
            let old = std::mem::replace(&mut self.root, grown);
            for e in old.into_iter().filter(|e| e.to != NONE) {
                let i = self.root_slot(e.tok);
                self.root[i] = e;
            }
        }
        let i = self.root_slot(tok);
        self.root[i] = RootEdge { tok, to };
    }

    /// The target of `state`'s transition on `tok`.
    #[inline]
    pub fn next(&self, state: u32, tok: u32) -> Option<u32> {
        if state == ROOT {
            let e = &self.root[self.root_slot(tok)];
            return (e.to != NONE).then_some(e.to);
        }
        let s = &self.st[state as usize];
        if s.to0 == NONE {
            return None;
        }
        if s.tok0 == tok {
            return Some(s.to0);
        }
        if s.head == NONE {
            return None;
        }
        let edge = &self.table[self.find_slot(state, tok)];
        (edge.src != NONE).then_some(edge.to)
    }

    /// Grows the table, if need be, so that `extra` more transitions keep it at most 3/4 full.
    fn reserve_table(&mut self, extra: usize) {
        let mut cap = self.table.len();
        while (self.table_edges + extra) * 4 > cap * 3 {
            cap *= 2;
        }
        if cap == self.table.len() {
            return;
        }
        let old = std::mem::replace(&mut self.table, BigVec::from_elem(EMPTY, cap));
        self.table_edges = 0;
        for s in self.st.iter_mut() {
            s.head = NONE;
        }
        for &edge in old.iter() {
            if edge.src != NONE {
                self.insert(edge.src, edge.tok, edge.to);
            }
        }
    }

    /// Puts a transition in the table, which has room for it.
    fn insert(&mut self, src: u32, tok: u32, to: u32) {
        let i = self.find_slot(src, tok);
        let s = &mut self.st[src as usize];
        self.table[i] = Edge {
            src,
            tok,
            to,
            next: s.head,
        };
        s.head = i as u32;
        self.table_edges += 1;
    }

    fn add_edge(&mut self, src: u32, tok: u32, to: u32) {
        self.n_edges += 1;
        if src == ROOT {
            self.add_root_edge(tok, to);
            return;
        }
        let s = &mut self.st[src as usize];
        if s.to0 == NONE {
            s.tok0 = tok;
            s.to0 = to;
        } else {
            self.reserve_table(1);
            self.insert(src, tok, to);
        }
    }

    /// Points `state`'s transition on `tok` at `to` if it leads to `from`; says whether it did.
    fn redirect(&mut self, state: u32, tok: u32, from: u32, to: u32) -> bool {
        if state == ROOT {
            let i = self.root_slot(tok);
            let e = &mut self.root[i];
            let hit = e.to == from;
            if hit {
                e.to = to;
            }
            return hit;
        }
        let s = &mut self.st[state as usize];
        if s.to0 != NONE && s.tok0 == tok {
            let hit = s.to0 == from;
            if hit {
                s.to0 = to;
            }
            return hit;
        }
        if s.head == NONE {
            return false;
        }
        let i = self.find_slot(state, tok);
        let edge = &mut self.table[i];
        let hit = edge.src != NONE && edge.to == from;
        if hit {
            edge.to = to;
        }
        hit
    }

    fn new_state(&mut self, len: u32, link: u32, first: u32, recent: u32, count: u32) -> u32 {
        let s = self.st.len() as u32;
        self.st.push(State {
            len,
            link,
            first,
            ..NO_STATE
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
        let qs = self.st[q as usize];
        let c = self.new_state(len, qs.link, qs.first, self.recent_end(q), self.count_of(q));
        // Make room first: growing the table while walking `q`'s list would move the list.
        let degree = self.out_edges(q).count();
        self.reserve_table(degree);
        self.n_edges += degree;
        let qs = self.st[q as usize];
        let cs = &mut self.st[c as usize];
        cs.tok0 = qs.tok0;
        cs.to0 = qs.to0;
        let mut e = qs.head;
        while e != NONE {
            let edge = self.table[e as usize];
            self.insert(c, edge.tok, edge.to);
            e = edge.next;
        }
        self.st[q as usize].link = c;
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
        // Generalised automaton: a new document can repeat a string already indexed. Within one
        // document `last` has no transitions yet, and its record is in cache: this check is free.
        if let Some(q) = self.next(last, c) {
            let state = if self.st[q as usize].len == want {
                q
            } else {
                let clone = self.clone_state(q, want);
                let mut p = last;
                while p != NONE && self.redirect(p, c, q, clone) {
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
        let mut q = NONE;
        while p != NONE {
            // The walk's cache misses: start the next state's while this one is handled.
            let link = self.st[p as usize].link;
            self.prefetch_visit(link, c);
            if let Some(t) = self.next(p, c) {
                q = t;
                break;
            }
            self.add_edge(p, c, cur);
            p = link;
        }
        if q != NONE {
            let len = self.st[p as usize].len + 1;
            if len == self.st[q as usize].len {
                self.st[cur as usize].link = q;
            } else {
                let clone = self.clone_state(q, len);
                while p != NONE && self.redirect(p, c, q, clone) {
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
            .map(|i| u32::MAX - 300_000 + (i * 7919) % 300_000)
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
