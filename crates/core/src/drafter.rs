//! The n-gram drafter: finds the longest suffix of the live sequence that occurred before, in the
//! live sequence itself or in a corpus of earlier documents, and proposes what followed it.
//!
//! Rules, which the brute-force oracle in the tests restates:
//! - **Live matches.** The longest suffix of the live sequence that also ends at an earlier
//!   position. The proposal copies the tokens after that earlier occurrence; where the copy runs
//!   past the end of the sequence it continues from the proposal itself (an overlapping copy, as
//!   LZ77 does), so a repeating pattern is extended by whole periods.
//! - **Corpus matches.** The longest suffix of the live sequence that occurs inside one corpus
//!   document. The proposal copies the tokens after it and stops at the end of that document.
//! - **Combining.** A match counts only if it is at least `min_match` tokens long. The longer of the
//!   live and corpus matches wins; on a tie, the live one.
//! - **Policies** choose among the occurrences of the match: `Earliest` (first occurrence; corpus
//!   order is document order), `Recent` (latest earlier occurrence), or `Frequent` (at each step
//!   the token that most often followed the text matched so far, ties to the smallest id, as
//!   SuffixDecoding does; it stops when the text matched so far was never followed).
//! - **Evidence cap.** At most `min(k, floor(k_factor * match_length + k_offset))` tokens.
//! - **Corpus memory.** At most `max_corpus_tokens` indexed corpus tokens. A document longer than
//!   that keeps its last `max_corpus_tokens` tokens. When a new document does not fit, the oldest
//!   documents are dropped until the kept ones hold at most half the limit, and the corpus
//!   automaton is rebuilt; each rebuild follows at least `max_corpus_tokens / 2` new tokens, so
//!   its cost is amortised O(1) per token.
//!
//! Costs: `extend` is amortised O(1) per token for `Earliest`. `Recent` and `Frequent` also walk
//! the suffix links of each new token's state to keep the latest end position and the
//! occurrence count exact: O(d) per token where d is the depth of that state in the suffix-link
//! tree, small on natural text but up to the length of a run for long periodic runs (n copies of
//! one token cost O(n) each). `propose` is O(1) plus the tokens copied for `Earliest` and
//! `Recent`; `Frequent` costs O(out-degree) per proposed token.

use crate::automaton::{Automaton, Tracking, MAX_TOKENS, ROOT};
use crate::bigvec::BigVec;
use crate::error::{Error, Result};
use crate::{prefetch, L1};

/// The largest `k` that `propose` accepts.
pub const MAX_K: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// Which earlier occurrence of the matched suffix a proposal copies from.
pub enum Policy {
    /// The most recent occurrence (llama.cpp, SGLang).
    Recent,
    /// The earliest occurrence (transformers, vLLM).
    Earliest,
    /// The continuation seen most often (Arctic SuffixDecoding).
    Frequent,
}

impl Policy {
    /// The policy named `name` ("recent", "earliest" or "frequent").
    pub fn parse(name: &str) -> Result<Policy> {
        match name {
            "recent" => Ok(Policy::Recent),
            "earliest" => Ok(Policy::Earliest),
            "frequent" => Ok(Policy::Frequent),
            other => Err(Error::value(format!(
                "unknown policy {other:?}; allowed: \"earliest\", \"recent\", \"frequent\""
            ))),
        }
    }

    /// The policy's name, as `parse` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Recent => "recent",
            Policy::Earliest => "earliest",
            Policy::Frequent => "frequent",
        }
    }

    fn tracking(self) -> Tracking {
        Tracking {
            recent: self == Policy::Recent,
            count: self == Policy::Frequent,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
/// The drafter's options.
pub struct Config {
    /// The shortest match a proposal is made from.
    pub min_match: usize,
    /// Which occurrence a proposal copies from.
    pub policy: Policy,
    /// A proposal holds at most floor(k_factor x match length + k_offset) tokens (and k).
    pub k_factor: f64,
    /// See `k_factor`.
    pub k_offset: f64,
    /// The most corpus tokens kept; the oldest documents go first.
    pub max_corpus_tokens: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            min_match: 1,
            policy: Policy::Earliest,
            k_factor: f64::INFINITY,
            k_offset: 0.0,
            max_corpus_tokens: 1 << 22,
        }
    }
}

impl Config {
    /// Ok, or an error naming the option that is out of range.
    pub fn validate(&self) -> Result<()> {
        if self.min_match == 0 {
            return Err(Error::value("min_match must be at least 1"));
        }
        if self.k_factor.is_nan() || self.k_factor < 0.0 {
            return Err(Error::value(format!(
                "k_factor must be a number >= 0 (inf allowed), got {}",
                self.k_factor
            )));
        }
        if !self.k_offset.is_finite() {
            return Err(Error::value(format!(
                "k_offset must be a finite number, got {}",
                self.k_offset
            )));
        }
        if self.max_corpus_tokens > MAX_TOKENS {
            return Err(Error::value(format!(
                "max_corpus_tokens must be at most {MAX_TOKENS}, got {}",
                self.max_corpus_tokens
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
/// The n-gram drafter: the automaton over the committed tokens and the corpus documents.
pub struct Drafter {
    config: Config,
    live: BigVec<u32>,
    live_sam: Automaton,
    corpus: Vec<u32>,
    /// Start offset of each kept corpus document in `corpus`, in order.
    doc_starts: Vec<u32>,
    corpus_sam: Automaton,
    /// The corpus state holding the longest suffix of the live sequence found in the corpus.
    corpus_state: u32,
    corpus_len: u32,
}

/// Where the current best match is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Live,
    Corpus,
}

impl Drafter {
    /// A drafter with `config`, or an error naming the bad option.
    pub fn new(config: Config) -> Result<Drafter> {
        config.validate()?;
        let tracking = config.policy.tracking();
        Ok(Drafter {
            config,
            live: BigVec::new(),
            live_sam: Automaton::new(tracking),
            corpus: Vec::new(),
            doc_starts: Vec::new(),
            corpus_sam: Automaton::new(tracking),
            corpus_state: ROOT,
            corpus_len: 0,
        })
    }

    /// The options it was made with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Tokens in the live sequence.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// True before any token was indexed.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Tokens indexed in the corpus.
    pub fn corpus_len(&self) -> usize {
        self.corpus.len()
    }

    /// Corpus documents added.
    pub fn corpus_documents(&self) -> usize {
        self.doc_starts.len()
    }

    /// Bytes the index holds (automaton, tokens, corpus).
    pub fn memory_bytes(&self) -> usize {
        self.live_sam.memory_bytes()
            + self.corpus_sam.memory_bytes()
            + 4 * (self.live.capacity() + self.corpus.capacity() + self.doc_starts.capacity())
    }

    /// Clears the live sequence. The corpus stays.
    pub fn reset(&mut self) {
        self.live = BigVec::new();
        self.live_sam = Automaton::new(self.config.policy.tracking());
        self.corpus_state = ROOT;
        self.corpus_len = 0;
    }

    /// Appends committed tokens to the live sequence and indexes them.
    pub fn extend(&mut self, tokens: &[u32]) -> Result<()> {
        if self.live.len() + tokens.len() > MAX_TOKENS {
            return Err(Error::value(format!(
                "the live sequence would hold {} tokens; at most {MAX_TOKENS} are allowed",
                self.live.len() + tokens.len()
            )));
        }
        if tokens.len() > 64 {
            // A long extend is usually a prompt, and generation follows: leave room for it, or the
            // first round after the prompt pays for moving the whole sequence. (The automaton's
            // reserve already leaves room.)
            self.live
                .reserve_touched(tokens.len() + tokens.len() / 4, 0);
            self.live_sam.reserve(tokens.len());
        }
        for &t in tokens {
            self.live.push(t);
            self.live_sam.push(t);
            self.step_corpus(t);
        }
        self.prefetch_proposal();
        Ok(())
    }

    /// Follows the live sequence through the corpus automaton (amortised O(1) per token).
    fn step_corpus(&mut self, t: u32) {
        if self.corpus.is_empty() {
            return;
        }
        let sam = &self.corpus_sam;
        let mut s = self.corpus_state;
        let mut l = self.corpus_len;
        loop {
            if let Some(q) = sam.next(s, t) {
                self.corpus_state = q;
                self.corpus_len = l + 1;
                return;
            }
            if s == ROOT {
                self.corpus_state = ROOT;
                self.corpus_len = 0;
                return;
            }
            s = sam.link_of(s);
            l = sam.len_of(s);
        }
    }

    /// Re-finds the corpus match after the corpus changed. No match is longer than the longest
    /// document, so walking that many trailing tokens suffices.
    fn rematch_corpus(&mut self) {
        self.corpus_state = ROOT;
        self.corpus_len = 0;
        let mut longest = 0usize;
        for (i, &s) in self.doc_starts.iter().enumerate() {
            let end = self
                .doc_starts
                .get(i + 1)
                .map_or(self.corpus.len(), |&e| e as usize);
            longest = longest.max(end - s as usize);
        }
        let from = self.live.len().saturating_sub(longest);
        for i in from..self.live.len() {
            let t = self.live[i];
            self.step_corpus(t);
        }
    }

    /// Adds a document to the corpus (see the module docs for the memory rule).
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        let cap = self.config.max_corpus_tokens;
        let doc = &tokens[tokens.len().saturating_sub(cap)..];
        if doc.is_empty() {
            return Ok(());
        }
        if self.corpus.len() + doc.len() > cap {
            // Drop the oldest documents until the kept ones and this one fit in half the limit
            // (or nothing older is left), then rebuild.
            let target = (cap / 2).saturating_sub(doc.len());
            let mut drop = 0;
            while drop < self.doc_starts.len()
                && self.corpus.len() - self.doc_starts[drop] as usize > target
            {
                drop += 1;
            }
            let keep_from = self
                .doc_starts
                .get(drop)
                .map_or(self.corpus.len(), |&s| s as usize);
            let kept: Vec<u32> = self.corpus[keep_from..].to_vec();
            let starts: Vec<u32> = self.doc_starts[drop..]
                .iter()
                .map(|&s| s - keep_from as u32)
                .collect();
            self.corpus = Vec::new();
            self.doc_starts = Vec::new();
            self.corpus_sam = Automaton::new(self.config.policy.tracking());
            self.corpus_sam.reserve(kept.len() + doc.len());
            for (i, &s) in starts.iter().enumerate() {
                let end = starts.get(i + 1).map_or(kept.len(), |&e| e as usize);
                self.index_document(&kept[s as usize..end]);
            }
        }
        self.corpus_sam.reserve(doc.len());
        self.index_document(doc);
        self.rematch_corpus();
        Ok(())
    }

    /// The kept corpus documents, oldest first.
    pub fn documents(&self) -> impl Iterator<Item = &[u32]> + '_ {
        self.doc_starts.iter().enumerate().map(|(i, &s)| {
            let end = self
                .doc_starts
                .get(i + 1)
                .map_or(self.corpus.len(), |&e| e as usize);
            &self.corpus[s as usize..end]
        })
    }

    /// A drafter with an empty live sequence whose corpus is what adding `docs` in order with
    /// [`add_document`](Self::add_document) would keep, indexed once: time linear in the tokens
    /// kept, however many documents the memory rule drops on the way.
    pub fn from_documents<'a>(
        config: Config,
        docs: impl Iterator<Item = &'a [u32]> + Clone,
    ) -> Result<Drafter> {
        let mut d = Drafter::new(config)?;
        let cap = config.max_corpus_tokens;
        // The memory rule on lengths alone: `kept` holds (index, kept length) of the documents
        // that survive, `total` their tokens.
        let mut kept = std::collections::VecDeque::new();
        let mut total = 0usize;
        for (i, doc) in docs.clone().enumerate() {
            let n = doc.len().min(cap);
            if n == 0 {
                continue;
            }
            if total + n > cap {
                let target = (cap / 2).saturating_sub(n);
                while total > target {
                    let Some((_, m)) = kept.pop_front() else {
                        break;
                    };
                    total -= m;
                }
            }
            kept.push_back((i, n));
            total += n;
        }
        d.corpus.reserve_exact(total);
        d.doc_starts.reserve_exact(kept.len());
        d.corpus_sam.reserve(total);
        let mut next = kept.iter().peekable();
        for (i, doc) in docs.enumerate() {
            match next.peek() {
                Some(&&(j, n)) if j == i => {
                    d.index_document(&doc[doc.len() - n..]);
                    next.next();
                }
                Some(_) => {}
                None => break,
            }
        }
        Ok(d)
    }

    fn index_document(&mut self, doc: &[u32]) {
        self.doc_starts.push(self.corpus.len() as u32);
        self.corpus.extend_from_slice(doc);
        self.corpus_sam.start_document();
        for &t in doc {
            self.corpus_sam.push(t);
        }
    }

    /// Starts loading the tokens that `propose` would copy for the live match. They sit at a
    /// random place in a long sequence, a cache miss that can overlap the return to the caller.
    fn prefetch_proposal(&self) {
        let (length, v) = self.live_match();
        if length == 0 {
            return;
        }
        let end = match self.config.policy {
            Policy::Earliest => self.live_sam.first_end(v),
            Policy::Recent => self.live_sam.recent_before(),
            Policy::Frequent => return,
        };
        if let Some(t) = self.live.get(end as usize + 1) {
            prefetch::<L1, _>(std::ptr::from_ref(t));
        }
    }

    /// The live match: (length, state).
    fn live_match(&self) -> (usize, u32) {
        if self.live.is_empty() {
            return (0, ROOT);
        }
        let v = self.live_sam.link_of(self.live_sam.last_state());
        (self.live_sam.len_of(v) as usize, v)
    }

    /// The best match under the combining rule, or None below `min_match`.
    fn best(&self) -> Option<(Source, usize)> {
        let (live_len, _) = self.live_match();
        let corpus_len = self.corpus_len as usize;
        let m = self.config.min_match;
        if live_len >= m && live_len >= corpus_len {
            Some((Source::Live, live_len))
        } else if corpus_len >= m {
            Some((Source::Corpus, corpus_len))
        } else {
            None
        }
    }

    /// Length of the longest suffix of the live sequence that occurred earlier, in the live
    /// sequence or the corpus (0 if none), whatever `min_match` says.
    pub fn match_length(&self) -> usize {
        self.live_match().0.max(self.corpus_len as usize)
    }

    /// The number of tokens the evidence allows for a match of `length`, at most `k`.
    pub fn k_cap(&self, k: usize, length: usize) -> usize {
        let allowed = self.config.k_factor * length as f64 + self.config.k_offset;
        if allowed.is_nan() || allowed <= 0.0 {
            0
        } else if allowed >= k as f64 {
            k
        } else {
            allowed.floor() as usize
        }
    }

    /// Up to `k` tokens that followed the longest earlier match of the live sequence's suffix.
    pub fn propose(&self, k: usize) -> Result<Vec<u32>> {
        if k > MAX_K {
            return Err(Error::value(format!(
                "k must be between 0 and {MAX_K}, got {k}"
            )));
        }
        let Some((source, length)) = self.best() else {
            return Ok(Vec::new());
        };
        let k = self.k_cap(k, length);
        if k == 0 {
            return Ok(Vec::new());
        }
        match (self.config.policy, source) {
            (Policy::Frequent, Source::Live) => {
                Ok(frequent(&self.live_sam, self.live_match().1, k))
            }
            (Policy::Frequent, Source::Corpus) => {
                Ok(frequent(&self.corpus_sam, self.corpus_state, k))
            }
            (policy, Source::Live) => {
                let v = self.live_match().1;
                let end = if policy == Policy::Recent {
                    self.live_sam.recent_before()
                } else {
                    self.live_sam.first_end(v)
                };
                Ok(self.copy_live(end as usize, k))
            }
            (policy, Source::Corpus) => {
                let s = self.corpus_state;
                let end = if policy == Policy::Recent {
                    self.corpus_sam.recent_end(s)
                } else {
                    self.corpus_sam.first_end(s)
                } as usize;
                let doc = self.doc_starts.partition_point(|&st| st as usize <= end);
                let doc_end = self
                    .doc_starts
                    .get(doc)
                    .map_or(self.corpus.len(), |&e| e as usize);
                let from = (end + 1).min(doc_end);
                let to = (from + k).min(doc_end);
                Ok(self.corpus[from..to].to_vec())
            }
        }
    }

    /// Copies k tokens after the occurrence ending at `end`, continuing into the copy itself.
    fn copy_live(&self, end: usize, k: usize) -> Vec<u32> {
        let n = self.live.len();
        let mut out = Vec::with_capacity(k);
        let mut i = end + 1;
        while out.len() < k {
            let t = if i < n {
                self.live[i]
            } else {
                match out.get(i - n) {
                    Some(&t) => t,
                    None => break,
                }
            };
            out.push(t);
            i += 1;
        }
        out
    }
}

/// The most frequent continuation, step by step, ties to the smallest token id.
fn frequent(sam: &Automaton, mut state: u32, k: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(k);
    while out.len() < k {
        let mut best: Option<(u32, u32, u32)> = None; // (count, token, target)
        for (tok, to) in sam.out_edges(state) {
            let c = sam.count_of(to);
            let better = match best {
                None => true,
                Some((bc, bt, _)) => c > bc || (c == bc && tok < bt),
            };
            if better {
                best = Some((c, tok, to));
            }
        }
        let Some((_, tok, to)) = best else { break };
        out.push(tok);
        state = to;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // ---- the brute-force oracle

    fn occurs_at(hay: &[u32], end: usize, needle: &[u32]) -> bool {
        end + 1 >= needle.len() && hay[end + 1 - needle.len()..=end] == *needle
    }

    /// Longest suffix of `live` ending earlier in `live`: (length, earliest end, latest end).
    fn oracle_live(live: &[u32]) -> (usize, usize, usize) {
        let n = live.len();
        for l in (1..n).rev() {
            let suf = &live[n - l..];
            let ends: Vec<usize> = (0..n - 1).filter(|&j| occurs_at(live, j, suf)).collect();
            if let (Some(&a), Some(&b)) = (ends.first(), ends.last()) {
                return (l, a, b);
            }
        }
        (0, 0, 0)
    }

    /// Occurrence ends of `w` inside one of `docs`, as (doc, end) in corpus order.
    fn oracle_doc_ends(docs: &[Vec<u32>], w: &[u32]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (d, doc) in docs.iter().enumerate() {
            for j in 0..doc.len() {
                if occurs_at(doc, j, w) {
                    out.push((d, j));
                }
            }
        }
        out
    }

    fn oracle_frequent(texts: &[&[u32]], mut w: Vec<u32>, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        while out.len() < k {
            let mut counts = std::collections::BTreeMap::<u32, u32>::new();
            for text in texts {
                for j in 0..text.len().saturating_sub(1) {
                    if occurs_at(text, j, &w) {
                        *counts.entry(text[j + 1]).or_default() += 1;
                    }
                }
            }
            let Some((&t, _)) = counts.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) else {
                break;
            };
            out.push(t);
            w.push(t);
        }
        out
    }

    fn oracle(cfg: &Config, docs: &[Vec<u32>], live: &[u32], k: usize) -> Vec<u32> {
        let n = live.len();
        let (live_len, first, latest) = oracle_live(live);
        let mut corpus_len = 0;
        for l in (1..=n).rev() {
            if !oracle_doc_ends(docs, &live[n - l..]).is_empty() {
                corpus_len = l;
                break;
            }
        }
        let m = cfg.min_match;
        let use_live = live_len >= m && live_len >= corpus_len;
        let length = if use_live { live_len } else { corpus_len };
        if length < m {
            return Vec::new();
        }
        let allowed = cfg.k_factor * length as f64 + cfg.k_offset;
        let k = if allowed <= 0.0 {
            0
        } else {
            k.min(allowed.floor().min(1e18) as usize)
        };
        let w = live[n - length..].to_vec();
        if cfg.policy == Policy::Frequent {
            let texts: Vec<&[u32]> = if use_live {
                vec![live]
            } else {
                docs.iter().map(Vec::as_slice).collect()
            };
            return oracle_frequent(&texts, w, k);
        }
        if use_live {
            let end = if cfg.policy == Policy::Recent {
                latest
            } else {
                first
            };
            let mut ext = live.to_vec();
            for i in 0..k {
                let t = ext[end + 1 + i];
                ext.push(t);
            }
            return ext[n..].to_vec();
        }
        let ends = oracle_doc_ends(docs, &w);
        let (d, j) = if cfg.policy == Policy::Recent {
            ends[ends.len() - 1]
        } else {
            ends[0]
        };
        docs[d][j + 1..].iter().take(k).copied().collect()
    }

    /// The documents the drafter keeps under the eviction rule.
    fn oracle_kept(cap: usize, added: &[Vec<u32>]) -> Vec<Vec<u32>> {
        let mut kept: Vec<Vec<u32>> = Vec::new();
        for doc in added {
            let doc = doc[doc.len().saturating_sub(cap)..].to_vec();
            if doc.is_empty() {
                continue;
            }
            let total: usize = kept.iter().map(Vec::len).sum();
            if total + doc.len() > cap {
                let target = (cap / 2).saturating_sub(doc.len());
                let mut total = total;
                while !kept.is_empty() && total > target {
                    total -= kept.remove(0).len();
                }
            }
            kept.push(doc);
        }
        kept
    }

    // ---- unit tests

    fn drafter(policy: Policy) -> Drafter {
        Drafter::new(Config {
            policy,
            ..Config::default()
        })
        .unwrap()
    }

    #[test]
    fn proposes_what_followed() {
        let mut d = drafter(Policy::Recent);
        d.extend(&[1, 2, 3, 4, 9, 1, 2]).unwrap();
        assert_eq!(d.propose(2).unwrap(), vec![3, 4]);
        assert_eq!(d.match_length(), 2);
        d.extend(&[7]).unwrap();
        assert!(d.propose(4).unwrap().is_empty());
        assert_eq!(d.match_length(), 0);
    }

    #[test]
    fn policies_differ() {
        let s = [1, 6, 2, 1, 6, 3, 1, 5, 4, 1];
        let p = |policy| {
            let mut d = drafter(policy);
            d.extend(&s).unwrap();
            d.propose(1).unwrap()
        };
        assert_eq!(p(Policy::Earliest), vec![6]);
        assert_eq!(p(Policy::Recent), vec![5]);
        assert_eq!(p(Policy::Frequent), vec![6]);
    }

    #[test]
    fn periodic_copy_runs_on() {
        let mut d = drafter(Policy::Recent);
        d.extend(&[4, 4, 4]).unwrap();
        assert_eq!(d.propose(5).unwrap(), vec![4; 5]);
    }

    #[test]
    fn min_match_and_cap() {
        let mut d = Drafter::new(Config {
            min_match: 3,
            k_factor: 1.0,
            k_offset: 1.0,
            ..Config::default()
        })
        .unwrap();
        d.extend(&[1, 2, 3, 4, 5, 6, 7, 1, 2]).unwrap();
        assert!(d.propose(8).unwrap().is_empty());
        d.extend(&[3]).unwrap();
        assert_eq!(d.propose(8).unwrap(), vec![4, 5, 6, 7]);
        assert_eq!(d.propose(0).unwrap(), Vec::<u32>::new());
        assert!(d.propose(MAX_K + 1).is_err());
    }

    #[test]
    fn corpus_matches_and_reset() {
        let mut d = drafter(Policy::Earliest);
        d.add_document(&[10, 11, 12, 13]).unwrap();
        d.add_document(&[20, 21]).unwrap();
        d.extend(&[11, 12]).unwrap();
        assert_eq!(d.propose(5).unwrap(), vec![13]);
        d.extend(&[13, 20]).unwrap();
        // [13, 20] spans a boundary in the corpus: only [20] matches.
        assert_eq!(d.match_length(), 1);
        assert_eq!(d.propose(5).unwrap(), vec![21]);
        d.reset();
        assert_eq!(d.len(), 0);
        assert!(d.propose(3).unwrap().is_empty());
        d.extend(&[10]).unwrap();
        assert_eq!(d.propose(2).unwrap(), vec![11, 12]);
    }

    #[test]
    fn eviction_keeps_memory_bounded() {
        let mut d = Drafter::new(Config {
            max_corpus_tokens: 1000,
            ..Config::default()
        })
        .unwrap();
        for i in 0..200u32 {
            let doc: Vec<u32> = (0..37).map(|j| i * 100 + j).collect();
            d.add_document(&doc).unwrap();
            assert!(d.corpus_len() <= 1000);
        }
        d.add_document(&vec![7; 5000]).unwrap();
        assert_eq!(d.corpus_len(), 1000);
        assert_eq!(d.corpus_documents(), 1);
    }

    #[test]
    fn bad_config() {
        let bad = |c: Config| Drafter::new(c).is_err();
        assert!(bad(Config {
            min_match: 0,
            ..Config::default()
        }));
        assert!(bad(Config {
            k_factor: f64::NAN,
            ..Config::default()
        }));
        assert!(bad(Config {
            k_factor: -1.0,
            ..Config::default()
        }));
        assert!(bad(Config {
            k_offset: f64::INFINITY,
            ..Config::default()
        }));
        assert!(Policy::parse("best").is_err());
    }

    #[test]
    fn memory_per_token_on_text_like_ids() {
        // Zipf-ish ids with repeats: a rough stand-in for text.
        let mut x = 12345u64;
        let mut s = Vec::new();
        for _ in 0..200_000 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let r = (x >> 33) % 1000 + 1;
            s.push((300_000 / r) as u32);
        }
        let mut d = drafter(Policy::Earliest);
        d.extend(&s).unwrap();
        let per = d.memory_bytes() as f64 / s.len() as f64;
        assert!(per < 120.0, "{per} bytes per token");
    }

    // ---- property tests against the oracle

    #[derive(Debug, Clone)]
    struct Case {
        alphabet: u32,
        base: u32,
        docs: Vec<Vec<u32>>,
        live: Vec<u32>,
        min_match: usize,
        k_factor: f64,
        k_offset: f64,
        cap: usize,
        k: usize,
    }

    fn check(policy: Policy, c: &Case) -> std::result::Result<(), TestCaseError> {
        // Small symbols spread over the whole alphabet, so large alphabets get large sparse ids.
        let stride = (c.alphabet / 6).max(1);
        let map = |v: &[u32]| v.iter().map(|&t| t * stride + c.base).collect::<Vec<u32>>();
        let cfg = Config {
            min_match: c.min_match,
            policy,
            k_factor: c.k_factor,
            k_offset: c.k_offset,
            max_corpus_tokens: c.cap,
        };
        let mut d = Drafter::new(cfg).unwrap();
        let docs: Vec<Vec<u32>> = c.docs.iter().map(|v| map(v)).collect();
        let live = map(&c.live);
        for doc in &docs {
            d.add_document(doc).unwrap();
        }
        let kept = oracle_kept(c.cap, &docs);
        prop_assert_eq!(d.corpus_len(), kept.iter().map(Vec::len).sum::<usize>());
        // Check after every chunk of the live sequence, as the generate loop would call it.
        let mut i = 0;
        while i < live.len() {
            let step = 1 + (c.live[i] as usize % 3);
            let j = (i + step).min(live.len());
            d.extend(&live[i..j]).unwrap();
            i = j;
            let got = d.propose(c.k).unwrap();
            let want = oracle(&cfg, &kept, &live[..i], c.k);
            prop_assert_eq!(got, want, "prefix {:?} docs {:?}", &live[..i], &kept);
        }
        Ok(())
    }

    fn seqs(alphabet: u32, max_len: usize) -> impl Strategy<Value = Vec<u32>> {
        prop::collection::vec(0..alphabet, 0..max_len)
    }

    fn case() -> impl Strategy<Value = Case> {
        (
            prop_oneof![Just(2u32), Just(3), Just(5), Just(300_000)],
            any::<bool>(),
        )
            .prop_flat_map(|(alphabet, high)| {
                let base = if high { u32::MAX - alphabet } else { 0 };
                (
                    prop::collection::vec(seqs(alphabet.min(6), 16), 0..5),
                    seqs(alphabet.min(6), 40),
                    1usize..4,
                    prop_oneof![Just(f64::INFINITY), Just(1.0), Just(0.5)],
                    prop_oneof![Just(0.0), Just(1.0), Just(-1.0)],
                    prop_oneof![Just(1usize << 22), Just(8), Just(20)],
                    0usize..12,
                )
                    .prop_map(
                        move |(docs, live, min_match, k_factor, k_offset, cap, k)| Case {
                            alphabet,
                            base,
                            docs,
                            live,
                            min_match,
                            k_factor,
                            k_offset,
                            cap,
                            k,
                        },
                    )
            })
    }

    macro_rules! policy_prop {
        ($name:ident, $policy:expr) => {
            proptest! {
                #![proptest_config(ProptestConfig::with_cases(10_000))]
                #[test]
                fn $name(c in case()) {
                    check($policy, &c)?;
                }
            }
        };
    }

    policy_prop!(oracle_recent, Policy::Recent);
    policy_prop!(oracle_earliest, Policy::Earliest);
    policy_prop!(oracle_frequent_policy, Policy::Frequent);
}
