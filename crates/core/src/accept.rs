//! Exact acceptance for speculative decoding: greedy verification and residual rejection sampling.
//!
//! Everything here works on plain slices. A probability matrix is row-major, `rows × vocab`.
//!
//! # The rule (Leviathan et al. 2023, Chen et al. 2023)
//!
//! At draft position i, with target row `p = p_i` and draft row `q = q_i`:
//! - accept `d_i` with probability `a = min(1, p(d_i) / q(d_i))`;
//! - on rejection, emit a sample from `norm(max(0, p − q))` and stop;
//! - when all k drafts are accepted, emit a bonus sample from row k.
//!
//! A one-hot drafter (n-gram) has `q = δ(d_i)`, so `a = p(d_i)` and the residual is `p` with `d_i`
//! zeroed. Marginalised over `d ~ q`, the emitted token is distributed exactly as `p`.
//!
//! # Randomness
//!
//! The random draws are uniforms in [0, 1): `accept_u[i]` decides position i (accept iff
//! `accept_u[i] < p(d_i) / q(d_i)`), `sample_u[j]` draws the correction or bonus token at position
//! j by inverse CDF. [`accept_sampled_with_uniforms`] takes them explicitly, so another
//! implementation (the torch path) can be checked against this one with identical draws. The seeded
//! entry point takes them from a counter-based SplitMix64 stream ([`uniform`]): `accept_u[i]` is
//! draw `2i` and `sample_u[j]` is draw `2j + 1`, so a draw never depends on k or on how many other
//! draws were used.
//!
//! # Numerics
//!
//! Every row of the target (and draft) matrix is validated in full before anything is drawn, so an
//! error never depends on the seed: entries must be finite and ≥ 0 and each row must sum to 1
//! within [`ROW_SUM_TOLERANCE`]. A row summing to 0 (everything masked) is an error. A residual
//! that is all zero while a rejection happened can only come from rounding (see [`residual`]); we
//! then sample from `p`.

use crate::error::{Error, Result};

/// How far a row's sum may be from 1. Generous for float32 softmax over large vocabularies (its
/// error is ~1e-6), tight enough to catch logits or unnormalised scores passed by mistake.
pub const ROW_SUM_TOLERANCE: f64 = 1e-3;

/// A probability type the sampler works over: `f32` or `f64`. Arithmetic that must agree
/// bit-for-bit with the torch path (the residual `max(0, p − q)`) is done in the native type;
/// sums and ratios are done in `f64`.
pub trait Prob: Copy + PartialOrd + std::ops::Add<Output = Self> + Send + Sync + 'static {
    /// The value 0.
    const ZERO: Self;
    /// Positive infinity.
    const INFINITY: Self;
    /// The value as an f64, exactly.
    fn to_f64(self) -> f64;
    /// `max(0, self − other)` in the native precision.
    #[must_use]
    fn positive_part_of_difference(self, other: Self) -> Self;
}

impl Prob for f32 {
    const ZERO: Self = 0.0;
    const INFINITY: Self = f32::INFINITY;
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline]
    fn positive_part_of_difference(self, other: Self) -> Self {
        let diff = self - other;
        if diff > 0.0 {
            diff
        } else {
            0.0
        }
    }
}

impl Prob for f64 {
    const ZERO: Self = 0.0;
    const INFINITY: Self = f64::INFINITY;
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn positive_part_of_difference(self, other: Self) -> Self {
        let diff = self - other;
        if diff > 0.0 {
            diff
        } else {
            0.0
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Greedy verification

/// Greedy verification: `target[i]` is the target's choice at position i (k + 1 of them). Returns
/// the longest prefix of `draft` that agrees with `target`, then the target's own token at the
/// first mismatch, or the bonus `target[k]` when all k agree. Always 1..=k+1 tokens.
pub fn accept_greedy(draft: &[u32], target: &[u32]) -> Result<Vec<u32>> {
    if target.len() != draft.len() + 1 {
        return Err(Error::value(format!(
            "target_ids must have len(draft) + 1 = {} entries (the target's choice after each \
             draft token, plus the bonus); got {}",
            draft.len() + 1,
            target.len()
        )));
    }
    let accepted = draft.iter().zip(target).take_while(|(d, t)| d == t).count();
    let mut out = Vec::with_capacity(accepted + 1);
    out.extend_from_slice(&draft[..accepted]);
    out.push(target[accepted]);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Randomness: counter-based SplitMix64

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function (Steele, Lea, Flood 2014; the seeder of the xoshiro family).
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Draw `index` of the stream for `seed`: the `index + 1`-th output of SplitMix64 started at
/// `seed`, as a uniform in [0, 1) with 53 random bits. Counter-based, so any draw is O(1).
#[inline]
pub fn uniform(seed: u64, index: u64) -> f64 {
    let z = mix64(seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The uniforms the seeded sampler uses for k draft tokens: `(accept_u, sample_u)` with k and
/// k + 1 entries.
pub fn uniforms(seed: u64, k: usize) -> (Vec<f64>, Vec<f64>) {
    let accept = (0..k as u64).map(|i| uniform(seed, 2 * i)).collect();
    let sample = (0..=k as u64).map(|j| uniform(seed, 2 * j + 1)).collect();
    (accept, sample)
}

// ---------------------------------------------------------------------------------------------
// Primitives (public so tests can enumerate the implemented rule exactly)

/// The implemented acceptance probability `min(1, p_d / q_d)`. `q_d > 0` is checked by the caller.
#[inline]
pub fn acceptance_probability(p_d: f64, q_d: f64) -> f64 {
    (p_d / q_d).min(1.0)
}

/// The implemented accept test for one uniform: accept iff `u < p_d / q_d`. For `u ∈ [0, 1)` this
/// happens with probability exactly [`acceptance_probability`].
#[inline]
fn accepts(u: f64, p_d: f64, q_d: f64) -> bool {
    u < p_d / q_d
}

/// The unnormalised residual `max(0, p − q)` for draft row `q`, or `p` with `d` zeroed for a
/// one-hot draft (`q = None`). Computed in the native precision.
///
/// If it sums to zero while a rejection happened, that rejection came from rounding: `p ≤ q`
/// everywhere means `Σ(q − p)`, the rejection probability's upper bound, equals `Σq − Σp`, which is
/// only normalisation error (≤ [`ROW_SUM_TOLERANCE`], in practice ~1e-7). The sampler then draws
/// from `p`; that choice moves the output distribution by at most that much. For a one-hot draft
/// it only happens when `p = δ(d)`, and sampling `p` returns `d`, which is the exact answer.
pub fn residual<T: Prob>(p: &[T], q: Option<&[T]>, d: usize) -> Vec<T> {
    if let Some(q) = q {
        p.iter()
            .zip(q)
            .map(|(&pi, &qi)| pi.positive_part_of_difference(qi))
            .collect()
    } else {
        let mut r = p.to_vec();
        r[d] = T::ZERO;
        r
    }
}

/// Inverse-CDF sample from non-negative weights with uniform `u ∈ [0, 1)`: the first index whose
/// running sum (sequential, in f64) exceeds `u × total`. Zero-weight entries are never returned.
/// `None` when the weights sum to zero.
pub fn sample_index<T: Prob>(weights: &[T], u: f64) -> Option<usize> {
    let total: f64 = weights.iter().fold(0.0, |acc, &w| acc + w.to_f64());
    if total <= 0.0 {
        return None;
    }
    // u < 1, but u × total can round up to total; stay strictly below it so the search below
    // always ends on an entry with positive weight.
    let mut target = u * total;
    if target >= total {
        target = f64::from_bits(total.to_bits() - 1);
    }
    let mut acc = 0.0;
    for (i, &w) in weights.iter().enumerate() {
        acc += w.to_f64();
        if acc > target {
            return Some(i);
        }
    }
    // Unreachable: the last positive entry brings acc to total > target.
    weights.iter().rposition(|&w| w.to_f64() > 0.0)
}

// ---------------------------------------------------------------------------------------------
// Validation

/// A validated (rows × vocab) probability matrix view.
struct Matrix<'a, T> {
    data: &'a [T],
    vocab: usize,
}

impl<'a, T: Prob> Matrix<'a, T> {
    fn row(&self, i: usize) -> &'a [T] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Sum of a row plus its smallest entry, in the native type with 16 independent lanes so it
/// vectorises (this scan is most of a call's cost). NaN or infinity anywhere makes the sum
/// non-finite. Lane sums hold ~V/16 terms each, so float32 error stays far below the tolerance.
fn row_stats<T: Prob>(row: &[T]) -> (f64, f64) {
    const LANES: usize = 16;
    let mut sums = [T::ZERO; LANES];
    let mut mins = [T::INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for lane in 0..LANES {
            let x = chunk[lane];
            sums[lane] = sums[lane] + x;
            mins[lane] = if x < mins[lane] { x } else { mins[lane] };
        }
    }
    for (lane, &x) in rest.iter().enumerate() {
        sums[lane] = sums[lane] + x;
        mins[lane] = if x < mins[lane] { x } else { mins[lane] };
    }
    let sum = sums.iter().map(|x| x.to_f64()).sum();
    let min = mins
        .iter()
        .map(|x| x.to_f64())
        .fold(f64::INFINITY, f64::min);
    (sum, min)
}

fn validate_matrix<'a, T: Prob>(
    name: &str,
    data: &'a [T],
    rows: usize,
    vocab: usize,
) -> Result<Matrix<'a, T>> {
    if vocab == 0 {
        return Err(Error::value(format!(
            "{name} has an empty vocabulary axis; it must have shape (rows, V) with V ≥ 1"
        )));
    }
    if rows.checked_mul(vocab) != Some(data.len()) {
        return Err(Error::value(format!(
            "{name} has {} values, expected {rows} × {vocab}",
            data.len()
        )));
    }
    let m = Matrix { data, vocab };
    for i in 0..rows {
        let (sum, min) = row_stats(m.row(i));
        if !sum.is_finite() {
            return Err(Error::value(format!(
                "{name} row {i} contains NaN or infinity; probabilities must be finite"
            )));
        }
        if min < 0.0 {
            return Err(Error::value(format!(
                "{name} row {i} contains a negative value ({min}); probabilities must be ≥ 0"
            )));
        }
        if sum <= 0.0 {
            return Err(Error::value(format!(
                "{name} row {i} is all zero: every token is masked, nothing can be sampled"
            )));
        }
        if (sum - 1.0).abs() > ROW_SUM_TOLERANCE {
            return Err(Error::value(format!(
                "{name} row {i} sums to {sum}, not 1 (tolerance {ROW_SUM_TOLERANCE}); pass \
                 probabilities (e.g. from specfast.logits_to_probs), not logits"
            )));
        }
    }
    Ok(m)
}

/// Checks shapes and values and the draft ids; returns the validated (target, draft) matrices.
fn validate<'a, T: Prob>(
    target: &'a [T],
    vocab: usize,
    draft: &[u32],
    draft_probs: Option<&'a [T]>,
) -> Result<(Matrix<'a, T>, Option<Matrix<'a, T>>)> {
    let k = draft.len();
    // Checked products: a (0, 2**60) array has no values but a vocabulary axis whose product
    // with k + 1 overflows, and a wrapped product could pass the length check.
    if vocab == 0 || (k + 1).checked_mul(vocab) != Some(target.len()) {
        return Err(Error::value(format!(
            "target_probs must have shape (len(draft) + 1, V) = ({}, V); got {} values for V = \
             {vocab}",
            k + 1,
            target.len()
        )));
    }
    if let Some(q) = draft_probs {
        if k.checked_mul(vocab) != Some(q.len()) {
            return Err(Error::value(format!(
                "draft_probs must have shape (len(draft), V) = ({k}, {vocab}); got {} values",
                q.len()
            )));
        }
    }
    if let Some((i, &d)) = draft.iter().enumerate().find(|(_, &d)| d as usize >= vocab) {
        return Err(Error::value(format!(
            "draft[{i}] = {d} is outside the vocabulary: ids must be in [0, {vocab})"
        )));
    }
    let p = validate_matrix("target_probs", target, k + 1, vocab)?;
    let q = match draft_probs {
        Some(q) => {
            let q = validate_matrix("draft_probs", q, k, vocab)?;
            for (i, &d) in draft.iter().enumerate() {
                if q.row(i)[d as usize].to_f64() <= 0.0 {
                    return Err(Error::value(format!(
                        "draft[{i}] = {d} has draft probability 0, so it cannot have been \
                         sampled from draft_probs; pass the (transformed) probabilities the draft \
                         was actually sampled from"
                    )));
                }
            }
            Some(q)
        }
        None => None,
    };
    Ok((p, q))
}

fn check_uniform(name: &str, i: usize, u: f64) -> Result<()> {
    if (0.0..1.0).contains(&u) {
        Ok(())
    } else {
        Err(Error::value(format!(
            "{name}[{i}] = {u} is not a uniform in [0, 1)"
        )))
    }
}

// ---------------------------------------------------------------------------------------------
// Speculative sampling

fn run<T: Prob>(
    p: &Matrix<'_, T>,
    q: Option<&Matrix<'_, T>>,
    draft: &[u32],
    accept_u: impl Fn(usize) -> f64,
    sample_u: impl Fn(usize) -> f64,
) -> Vec<u32> {
    let k = draft.len();
    let mut out = Vec::with_capacity(k + 1);
    for (i, &d) in draft.iter().enumerate() {
        let di = d as usize;
        let p_row = p.row(i);
        let q_row = q.map(|q| q.row(i));
        let p_d = p_row[di].to_f64();
        let q_d = q_row.map_or(1.0, |q| q[di].to_f64());
        if accepts(accept_u(i), p_d, q_d) {
            out.push(d);
            continue;
        }
        let r = residual(p_row, q_row, di);
        let u = sample_u(i);
        // Validation guarantees p_row has positive mass, so the fallback always samples.
        let x = sample_index(&r, u)
            .or_else(|| sample_index(p_row, u))
            .unwrap_or(di);
        out.push(x as u32);
        return out;
    }
    // All accepted: the bonus token from row k. Validated rows always have positive mass.
    let x = sample_index(p.row(k), sample_u(k)).unwrap_or(0);
    out.push(x as u32);
    out
}

/// Speculative sampling with seeded randomness (see the module docs for the stream layout).
///
/// `target` is (k + 1) × `vocab`, row-major, already transformed (temperature, top-k, ...).
/// `draft_probs` is k × `vocab` for a draft model, or `None` for a one-hot (deterministic) drafter.
/// Returns the accepted prefix of `draft` plus one correction or bonus token.
pub fn accept_sampled<T: Prob>(
    target: &[T],
    vocab: usize,
    draft: &[u32],
    draft_probs: Option<&[T]>,
    seed: u64,
) -> Result<Vec<u32>> {
    let (p, q) = validate(target, vocab, draft, draft_probs)?;
    Ok(run(
        &p,
        q.as_ref(),
        draft,
        |i| uniform(seed, 2 * i as u64),
        |j| uniform(seed, 2 * j as u64 + 1),
    ))
}

/// [`accept_sampled`] with explicit uniforms: `accept_u` has k entries, `sample_u` k + 1, all in
/// [0, 1). With `uniforms(seed, k)` it returns exactly what `accept_sampled(.., seed)` does.
pub fn accept_sampled_with_uniforms<T: Prob>(
    target: &[T],
    vocab: usize,
    draft: &[u32],
    draft_probs: Option<&[T]>,
    accept_u: &[f64],
    sample_u: &[f64],
) -> Result<Vec<u32>> {
    let k = draft.len();
    if accept_u.len() != k || sample_u.len() != k + 1 {
        return Err(Error::value(format!(
            "need len(draft) = {k} accept uniforms and len(draft) + 1 = {} sample uniforms; got \
             {} and {}",
            k + 1,
            accept_u.len(),
            sample_u.len()
        )));
    }
    for (i, &u) in accept_u.iter().enumerate() {
        check_uniform("accept_uniforms", i, u)?;
    }
    for (i, &u) in sample_u.iter().enumerate() {
        check_uniform("sample_uniforms", i, u)?;
    }
    let (p, q) = validate(target, vocab, draft, draft_probs)?;
    Ok(run(&p, q.as_ref(), draft, |i| accept_u[i], |j| sample_u[j]))
}

/// The implemented rule, spelled out for exact enumeration: for each draft position i the
/// acceptance probability, and for each position 0..=k the normalised distribution the correction
/// (or, at k, the bonus) token is drawn from, in f64. Validates exactly as [`accept_sampled`].
pub fn rule_tables<T: Prob>(
    target: &[T],
    vocab: usize,
    draft: &[u32],
    draft_probs: Option<&[T]>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (p, q) = validate(target, vocab, draft, draft_probs)?;
    let k = draft.len();
    let mut accept = Vec::with_capacity(k);
    let mut dists = Vec::with_capacity((k + 1) * vocab);
    let normalised = |w: &[T], out: &mut Vec<f64>| {
        let total: f64 = w.iter().fold(0.0, |acc, &x| acc + x.to_f64());
        out.extend(w.iter().map(|&x| x.to_f64() / total));
    };
    for (i, &d) in draft.iter().enumerate() {
        let di = d as usize;
        let p_row = p.row(i);
        let q_row = q.as_ref().map(|q| q.row(i));
        accept.push(acceptance_probability(
            p_row[di].to_f64(),
            q_row.map_or(1.0, |q| q[di].to_f64()),
        ));
        let r = residual(p_row, q_row, di);
        if r.iter().any(|&x| x.to_f64() > 0.0) {
            normalised(&r, &mut dists);
        } else {
            normalised(p_row, &mut dists);
        }
    }
    normalised(p.row(k), &mut dists);
    Ok((accept, dists))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn overflowing_shape_is_an_error_not_a_panic() {
        // Found by fuzz/accept: 16 × 2^60 wraps to 0, which matched an empty target and then
        // sliced past its end. Python reaches this with np.zeros((0, 2**60)) and a 15-token draft.
        let v = 1usize << 60;
        let draft = [1u32; 15];
        assert!(accept_sampled::<f32>(&[], v, &draft, None, 0).is_err());
        assert!(accept_sampled::<f32>(&[], v, &draft, Some(&[]), 0).is_err());
        assert!(rule_tables::<f64>(&[], v, &draft, None).is_err());
        assert!(accept_sampled::<f32>(&[], usize::MAX, &[], None, 0).is_err());
    }

    #[test]
    fn greedy_prefix_and_correction() {
        assert_eq!(
            accept_greedy(&[1, 2, 3], &[1, 2, 9, 4]).unwrap(),
            vec![1, 2, 9]
        );
        assert_eq!(
            accept_greedy(&[1, 2, 3], &[1, 2, 3, 4]).unwrap(),
            vec![1, 2, 3, 4]
        );
        assert_eq!(accept_greedy(&[1, 2, 3], &[7, 2, 3, 4]).unwrap(), vec![7]);
        assert_eq!(accept_greedy(&[], &[5]).unwrap(), vec![5]);
        assert!(accept_greedy(&[1], &[1]).is_err());
        assert!(accept_greedy(&[1], &[1, 2, 3]).is_err());
    }

    #[test]
    fn splitmix_matches_reference() {
        // SplitMix64 seeded with 0: the first output is 0xE220A8397B1DCDAF.
        let first = 0xE220_A839_7B1D_CDAFu64;
        assert_eq!(mix64(GOLDEN_GAMMA), first);
        assert_eq!(
            uniform(0, 0).to_bits(),
            ((first >> 11) as f64 / (1u64 << 53) as f64).to_bits()
        );
        let (a, s) = uniforms(7, 3);
        assert_eq!(a, vec![uniform(7, 0), uniform(7, 2), uniform(7, 4)]);
        assert_eq!(s.len(), 4);
        assert!(a.iter().chain(&s).all(|u| (0.0..1.0).contains(u)));
    }

    #[test]
    fn seeded_equals_explicit_uniforms() {
        let p = [0.2f32, 0.3, 0.5, 0.1, 0.1, 0.8, 0.25, 0.25, 0.5];
        for seed in 0..200 {
            let (a, s) = uniforms(seed, 2);
            assert_eq!(
                accept_sampled(&p, 3, &[2, 0], None, seed).unwrap(),
                accept_sampled_with_uniforms(&p, 3, &[2, 0], None, &a, &s).unwrap()
            );
        }
    }

    #[test]
    fn one_hot_decisions_follow_the_uniforms() {
        let p = [0.25f64, 0.5, 0.25, 0.0, 0.0, 1.0];
        // p(d = 1) = 0.5: u = 0.49 accepts, then the bonus row is a point mass on 2.
        assert_eq!(
            accept_sampled_with_uniforms(&p, 3, &[1], None, &[0.49], &[0.9, 0.3]).unwrap(),
            vec![1, 2]
        );
        // u = 0.5 rejects; residual (0.25, 0, 0.25): u = 0.49 → 0, u = 0.5 → 2.
        assert_eq!(
            accept_sampled_with_uniforms(&p, 3, &[1], None, &[0.5], &[0.49, 0.0]).unwrap(),
            vec![0]
        );
        assert_eq!(
            accept_sampled_with_uniforms(&p, 3, &[1], None, &[0.5], &[0.5, 0.0]).unwrap(),
            vec![2]
        );
    }

    #[test]
    fn equal_disjoint_and_zero_probability() {
        // p == q: always accepted.
        let p = [0.3f64, 0.7, 0.5, 0.5];
        let q = [0.3f64, 0.7];
        assert_eq!(
            accept_sampled_with_uniforms(&p, 2, &[1], Some(&q), &[0.999_999], &[0.0, 0.0]).unwrap(),
            vec![1, 0]
        );
        // Disjoint supports: always rejected, residual = p.
        let p = [0.0f64, 0.0, 1.0, 0.5, 0.5, 0.0];
        let q = [0.5f64, 0.5, 0.0];
        assert_eq!(
            accept_sampled_with_uniforms(&p, 3, &[0], Some(&q), &[0.0], &[0.7, 0.0]).unwrap(),
            vec![2]
        );
        // p(d) = 0 with a one-hot draft: rejected even at u = 0.
        let p = [0.0f32, 1.0, 1.0, 0.0];
        assert_eq!(
            accept_sampled_with_uniforms(&p, 2, &[0], None, &[0.0], &[0.0, 0.0]).unwrap(),
            vec![1]
        );
    }

    #[test]
    fn zero_residual_falls_back_to_p() {
        // p ≤ q everywhere (normalisation error only), p(d) < q(d): a rejection leaves no residual.
        let p = [0.5f64, 0.499_9, 1.0, 0.0];
        let q = [0.5f64, 0.5];
        let (_, dists) = rule_tables(&p, 2, &[1], Some(&q)).unwrap();
        assert!((dists[0] - 0.5 / 0.9999).abs() < 1e-15);
        assert_eq!(
            accept_sampled_with_uniforms(&p, 2, &[1], Some(&q), &[0.9999], &[0.9, 0.0]).unwrap(),
            vec![1]
        );
        // One-hot draft on a point mass that rounds below 1.
        let p = [0.0f32, 0.999_999_9, 0.0, 1.0, 0.0, 0.0];
        assert_eq!(
            accept_sampled_with_uniforms(&p, 3, &[1], None, &[0.999_999_99], &[0.3, 0.0]).unwrap(),
            vec![1]
        );
    }

    #[test]
    fn sample_index_edges() {
        assert_eq!(sample_index(&[0.0f64, 0.0], 0.5), None);
        assert_eq!(sample_index(&[0.0f64, 1.0, 0.0], 0.0), Some(1));
        assert_eq!(sample_index(&[0.5f64, 0.0, 0.5], 0.5), Some(2));
        assert_eq!(
            sample_index(&[0.5f64, 0.5, 0.0], 1.0 - f64::EPSILON / 2.0),
            Some(1)
        );
    }

    #[test]
    fn errors_are_values_not_panics() {
        let p = [0.5f32, 0.5, 0.5, 0.5];
        assert!(accept_sampled(&p, 2, &[2], None, 0).is_err()); // id out of range
        assert!(accept_sampled(&p, 2, &[0, 1], None, 0).is_err()); // too few rows
        assert!(accept_sampled(&p, 0, &[], None, 0).is_err()); // empty vocabulary
        assert!(accept_sampled(&[f32::NAN, 1.0, 0.5, 0.5], 2, &[0], None, 0).is_err());
        assert!(accept_sampled(&[f32::INFINITY, 1.0, 0.5, 0.5], 2, &[0], None, 0).is_err());
        assert!(accept_sampled(&[-0.5f32, 1.5, 0.5, 0.5], 2, &[0], None, 0).is_err());
        assert!(accept_sampled(&[0.0f32, 0.0, 0.5, 0.5], 2, &[0], None, 0).is_err()); // all masked
        assert!(accept_sampled(&[3.0f32, 2.0, 0.5, 0.5], 2, &[0], None, 0).is_err()); // logits
        assert!(accept_sampled(&p, 2, &[0], Some(&[0.0f32, 1.0]), 0).is_err()); // q(d) = 0
        assert!(accept_sampled(&p, 2, &[0], Some(&[1.0f32]), 0).is_err()); // q shape
        assert!(accept_sampled_with_uniforms(&p, 2, &[0], None, &[1.0], &[0.0, 0.0]).is_err());
        assert!(accept_sampled_with_uniforms(&p, 2, &[0], None, &[0.0], &[0.0]).is_err());
    }

    /// Exact enumeration of the implemented rule at one position: Σ_d q(d)[a δ_d + (1 − a) r_d].
    fn implied_distribution(
        p: &[f64],
        q: Option<&[f64]>,
        draft_support: &[(usize, f64)],
    ) -> Vec<f64> {
        let v = p.len();
        let mut out = vec![0.0; v];
        for &(d, qd) in draft_support {
            let mut target = p.to_vec();
            target.extend_from_slice(p); // row 1: any valid row, unused here
            let (a, dists) = rule_tables(&target, v, &[d as u32], q).unwrap();
            out[d] += qd * a[0];
            for x in 0..v {
                out[x] += qd * (1.0 - a[0]) * dists[x];
            }
        }
        out
    }

    fn normalise(mut w: Vec<f64>) -> Vec<f64> {
        let s: f64 = w.iter().sum();
        for x in &mut w {
            *x /= s;
        }
        w
    }

    proptest! {
        #[test]
        fn enumeration_recovers_p(
            pw in prop::collection::vec(prop_oneof![Just(0.0), 0.0f64..1.0], 2..12),
            qw in prop::collection::vec(prop_oneof![Just(0.0), 0.0f64..1.0], 12),
        ) {
            let v = pw.len();
            prop_assume!(pw.iter().sum::<f64>() > 0.0 && qw[..v].iter().sum::<f64>() > 0.0);
            let p = normalise(pw);
            let q = normalise(qw[..v].to_vec());
            // Draft model.
            let support: Vec<(usize, f64)> = (0..v).filter(|&d| q[d] > 0.0).map(|d| (d, q[d])).collect();
            let got = implied_distribution(&p, Some(&q), &support);
            for x in 0..v { prop_assert!((got[x] - p[x]).abs() < 1e-12); }
            // One-hot drafts: every d, conditioned on d.
            for d in 0..v {
                let got = implied_distribution(&p, None, &[(d, 1.0)]);
                for x in 0..v { prop_assert!((got[x] - p[x]).abs() < 1e-12); }
            }
        }

        #[test]
        fn never_panics_and_never_emits_zero_probability(
            v in 1usize..6,
            k in 0usize..4,
            raw in prop::collection::vec(prop_oneof![Just(0.0f32), Just(f32::NAN), Just(-1.0), 0.0f32..1.0], 0..40),
            draft in prop::collection::vec(0u32..8, 0..4),
            seed in any::<u64>(),
        ) {
            let _ = accept_sampled(&raw, v, &draft, None, seed);
            let _ = accept_sampled(&raw, v, &draft, Some(&raw), seed);
            // On valid input: emitted tokens are accepted drafts or have positive probability.
            let mut p = vec![0.0f32; (k + 1) * v];
            for (i, row) in p.chunks_mut(v).enumerate() {
                row[(i * 7 + seed as usize) % v] = 0.5;
                row[(i + seed as usize / 3) % v] += 0.5;
            }
            let draft: Vec<u32> = draft.iter().take(k).map(|&d| d % v as u32).collect();
            let k = draft.len();
            let out = accept_sampled(&p[..(k + 1) * v], v, &draft, None, seed).unwrap();
            prop_assert!(!out.is_empty() && out.len() <= k + 1);
            let last = out.len() - 1;
            prop_assert_eq!(&out[..last], &draft[..last]);
            prop_assert!(p[last * v + out[last] as usize] > 0.0);
        }
    }
}
