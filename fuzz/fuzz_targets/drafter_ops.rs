//! Arbitrary configs and sequences of extend / propose / add_document / reset on the n-gram
//! drafter. Any panic is a bug (Python would see a PanicException). Also checks what must hold
//! after every operation: the proposal respects k and the evidence cap, proposes only tokens the
//! drafter has seen, and `len()` counts the live tokens since the last reset.
#![no_main]

use std::collections::HashSet;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use specfast_core::drafter::{Config, Drafter, Policy};

#[derive(Arbitrary, Debug)]
enum Op {
    Extend(Vec<u8>),
    ExtendWide(Vec<u32>),
    Propose(u16),
    ProposeHuge(usize),
    AddDocument(Vec<u8>),
    Reset,
}

#[derive(Arbitrary, Debug)]
struct Input {
    min_match: u8,
    policy: u8,
    k_factor: f64,
    k_offset: f64,
    max_corpus_tokens: u16,
    /// Tokens are byte % alphabet, so small alphabets make long repeats.
    alphabet: u8,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let policy = [Policy::Earliest, Policy::Recent, Policy::Frequent][input.policy as usize % 3];
    let config = Config {
        min_match: input.min_match as usize % 9, // 0 is invalid: the error path is fuzzed too
        policy,
        k_factor: input.k_factor,
        k_offset: input.k_offset,
        max_corpus_tokens: input.max_corpus_tokens as usize % 200,
    };
    let Ok(mut d) = Drafter::new(config) else {
        assert!(config.validate().is_err());
        return;
    };
    let alphabet = u32::from(input.alphabet.max(1));
    let mut live = 0usize;
    let mut seen: HashSet<u32> = HashSet::new();
    for op in input.ops.into_iter().take(64) {
        match op {
            Op::Extend(bytes) => {
                let toks: Vec<u32> = bytes.iter().map(|&b| u32::from(b) % alphabet).collect();
                d.extend(&toks).expect("extend of a short sequence");
                live += toks.len();
                seen.extend(toks);
            }
            Op::ExtendWide(toks) => {
                d.extend(&toks).expect("extend of a short sequence");
                live += toks.len();
                seen.extend(toks);
            }
            Op::AddDocument(bytes) => {
                let toks: Vec<u32> = bytes.iter().map(|&b| u32::from(b) % alphabet).collect();
                d.add_document(&toks)
                    .expect("add_document of a short document");
                seen.extend(toks);
            }
            Op::Reset => {
                d.reset();
                live = 0;
            }
            Op::Propose(k) => {
                let k = k as usize % 300;
                let p = d.propose(k).expect("k below MAX_K");
                assert!(p.len() <= d.k_cap(k, d.match_length()));
                assert!(p.len() <= k);
                assert!(
                    p.iter().all(|t| seen.contains(t)),
                    "proposed an unseen token"
                );
            }
            Op::ProposeHuge(k) => {
                // Anything up to usize::MAX: an error or a bounded proposal, never a panic.
                if let Ok(p) = d.propose(k) {
                    assert!(p.len() <= k);
                }
            }
        }
        assert_eq!(d.len(), live);
        assert!(d.match_length() <= live);
        assert!(d.corpus_len() <= config.max_corpus_tokens);
    }
});
