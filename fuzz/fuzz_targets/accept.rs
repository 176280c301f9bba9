//! Arbitrary acceptance inputs: probabilities with NaN, infinities, negatives, zeros and rows
//! that do not sum to 1; draft ids outside the vocabulary; mismatched shapes; any uniforms and
//! seeds. Every call must return an error or a valid result (1..=k+1 tokens, an accepted prefix
//! of the draft, then one token inside the vocabulary), never panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use specfast_core::accept::{
    accept_greedy, accept_sampled, accept_sampled_with_uniforms, rule_tables, uniforms, Prob,
};

#[derive(Arbitrary, Debug)]
struct Input {
    vocab: u8,
    draft: Vec<u32>,
    /// Raw values; `normalise` makes most rows valid so the sampling paths are reached.
    target: Vec<f32>,
    draft_probs: Option<Vec<f32>>,
    normalise: bool,
    /// Off-by-some shape errors: the value lengths are changed by this much.
    skew: i8,
    seed: u64,
    accept_u: Vec<f64>,
    sample_u: Vec<f64>,
    greedy_target: Vec<u32>,
    huge_vocab: Option<usize>,
}

fn rows(values: &[f32], n: usize, vocab: usize, normalise: bool, skew: i8) -> Vec<f32> {
    let mut out: Vec<f32> = (0..n * vocab)
        .map(|i| values.get(i % values.len().max(1)).copied().unwrap_or(1.0))
        .collect();
    if normalise && vocab > 0 {
        for row in out.chunks_mut(vocab) {
            for x in row.iter_mut() {
                *x = if x.is_finite() { x.abs() } else { 0.0 };
            }
            let s: f32 = row.iter().sum();
            if s > 0.0 && s.is_finite() {
                row.iter_mut().for_each(|x| *x /= s);
            }
        }
    }
    let len = (out.len() as i64 + i64::from(skew % 3)).max(0) as usize;
    out.resize(len, 0.25);
    out
}

fn check_out(out: &[u32], draft: &[u32], vocab: usize) {
    assert!(!out.is_empty() && out.len() <= draft.len() + 1);
    let n = out.len() - 1;
    assert_eq!(&out[..n], &draft[..n]);
    assert!((out[n] as usize) < vocab);
}

fn run<T: Prob>(target: &[T], vocab: usize, draft: &[u32], q: Option<&[T]>, input: &Input) {
    if let Ok(out) = accept_sampled(target, vocab, draft, q, input.seed) {
        check_out(&out, draft, vocab);
    }
    if let Ok(out) =
        accept_sampled_with_uniforms(target, vocab, draft, q, &input.accept_u, &input.sample_u)
    {
        check_out(&out, draft, vocab);
    }
    if let Ok((acc, dists)) = rule_tables(target, vocab, draft, q) {
        assert_eq!(acc.len(), draft.len());
        assert!(acc.iter().all(|a| (0.0..=1.0).contains(a)));
        assert_eq!(dists.len(), (draft.len() + 1) * vocab);
    }
}

fuzz_target!(|input: Input| {
    let vocab = input.vocab as usize % 17; // 0 is invalid and fuzzed too
    let draft: Vec<u32> = input.draft.iter().take(8).map(|&d| d % 20).collect();
    let k = draft.len();
    let target = rows(&input.target, k + 1, vocab, input.normalise, input.skew);
    let q = input
        .draft_probs
        .as_ref()
        .map(|v| rows(v, k, vocab, input.normalise, input.skew / 3));
    run(&target, vocab, &draft, q.as_deref(), &input);
    let target64: Vec<f64> = target.iter().map(|&x| f64::from(x)).collect();
    let q64: Option<Vec<f64>> = q
        .as_ref()
        .map(|q| q.iter().map(|&x| f64::from(x)).collect());
    run(&target64, vocab, &draft, q64.as_deref(), &input);
    if let Some(v) = input.huge_vocab {
        // A vocabulary whose (k + 1) * V overflows must be an error, not a panic.
        let _ = accept_sampled(&target, v, &draft, q.as_deref(), input.seed);
        let _ = rule_tables(&target, v, &draft, q.as_deref());
    }
    if let Ok(out) = accept_greedy(&draft, &input.greedy_target) {
        assert!(!out.is_empty() && out.len() <= k + 1);
    }
    let (a, s) = uniforms(input.seed, k);
    assert!(a.iter().chain(&s).all(|u| (0.0..1.0).contains(u)));
});
