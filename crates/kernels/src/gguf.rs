//! Weight products in a GGUF file's own block types, each tensor kept at its own values and
//! scales, so a pass reads what the file holds and no fewer bits.
//!
//! Every type is read as unsigned values u of 4 to 8 bits with integer sub-block scales and f16
//! scales, the file's own numbers:
//!
//! | type | bits | w | sub-block |
//! |---|---|---|---|
//! | Q4_K | 4.5 | d·sc·u - dmin·mn (u in 0..16, sc and mn in 0..64) | 32 |
//! | Q5_K | 5.5 | as Q4_K, u in 0..32 | 32 |
//! | Q6_K | 6.5625 | d·sc·(u - 32) (u in 0..64, sc an i8) | 16 |
//! | Q8_0 | 8.5 | d·(u - 128) (u = q + 128) | 32 |
//! | Q4_0, Q5_0 | 4.5, 5.5 | d·(u - 8), d·(u - 16) | 32 |
//! | Q4_1, Q5_1 | 5, 6 | d·u + m | 32 |
//!
//! Activations are int8, quantized at every call, each row on its own: for the small types
//! with one scale sx per group of 32 (as in [`crate::int8`]), for the K types with one per
//! super-block of 256 (as ggml's Q8_K does). A sub-block's integer sum s = Σ u·xq - offset ·
//! Σ xq (the offset above: 32 for Q6_K, 128 for Q8_0, 8 and 16 for Q4_0 and Q5_0) is exact.
//! Then, in every code path alike:
//! - small types, per group in order: `acc += (s as f32) * (d * sx)`, and for Q4_1 and Q5_1
//!   `acc += m * (sx · Σ xq)`;
//! - K types, per super-block in order: the integers S = Σ sc·s over its sub-blocks and (Q4_K,
//!   Q5_K) M = Σ mn·Σ xq over its groups, then `acc += (S as f32) * (d * sx)` and
//!   `acc -= (M as f32) * (dmin * sx)`. One float step a super-block, not one a group: in a
//!   pass of 9 rows the per-group steps had cost about a third of the kernels' time.
//!
//! So a row of a pass depends only on its own input row, and the scalar, AVX2 and AVX-512
//! VNNI paths give the same bits.
//!
//! A matrix is a stack of parts by rows, each of one type (a fused q/k/v matrix of a Q4_K_M file
//! holds Q4_K and Q6_K tensors, or Q5_0 and Q8_0); a part but the last holds whole blocks of 16
//! rows.
//!
//! Packed layout, per part: blocks of 16 output rows; a block is a run of records over the
//! input features, 256 of them for the K types, 64 (two groups) for the others, each a whole
//! number of 64-byte lines:
//! - a header of the 16 rows' f16 scales: d and dmin (K types; Q6_K's dmin unused), or each
//!   group's d (and m: a 128-byte header), each times 2^S (see `normal_shift`);
//! - the low nibbles, per group of 32 features 4 pairs of runs of 4 features, 64 bytes a pair:
//!   byte i holds row i / 4, feature i % 4 of the first run in its low nibble and of the second
//!   in its high one (as [`crate::q4`]);
//! - the high bits, in the same byte positions: five-bit types 64 bytes a group (bit j: run j's
//!   bit 4), Q6_K 64 bytes a sub-block of 16 (bits 2j and 2j+1: run j's bits 4 and 5), Q8_0 a
//!   second nibble plane (bits 4..8);
//! - Q4_K/Q5_K: per group, sc then mn of the 16 rows (u8); Q6_K: per group, each sub-block's sc
//!   of the 16 rows (i8).
//!
//! Record sizes give each type's own bits a weight, plus 1/32 for Q4_K/Q5_K (their f16 headers
//! padded to a line) and 1/16 for Q6_K.

use half::f16;
use specfast_core::error::Error;

use crate::helper::Shared;
use crate::int8::{check_product, Activations, Kernel, Product, GROUP, PARALLEL_MIN, ROW_VALUES};
#[cfg(target_arch = "x86_64")]
use crate::q4::has_f16c;
use crate::q4::{chunks, write_block};
use crate::slab::WeightBuf;

/// Output rows per packed block.
const BLOCK: usize = 16;
/// Pieces a product is cut into for the two threads (as [`crate::q4`]).
const UNITS: usize = 4;
/// Input rows the AVX2 and scalar kernels take at once.
const ROWS: usize = 4;
/// Input rows the AVX-512 VNNI kernel takes at once: a sum and a total a row, 20 of 32 zmm.
const VNNI_ROWS: usize = 10;
/// Header bytes of a record.
const HEADER: usize = 64;
/// Above this many input features the packing's indices could overflow (checked).
pub const MAX_COLS: usize = 1 << 20;

/// A GGUF block type the core holds as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockType {
    /// 256 values: d, dmin (f16), 8 groups' 6-bit sc and mn, 4-bit values.
    Q4K,
    /// As Q4_K with a fifth bit a value.
    Q5K,
    /// 256 values: 6-bit values, 16 sub-blocks' i8 scales, d (f16).
    Q6K,
    /// 32 values: d (f16) and 32 i8.
    Q8_0,
    /// 32 values: d and 4-bit values, w = d·(u - 8).
    Q4_0,
    /// 32 values: d, m and 4-bit values, w = d·u + m.
    Q4_1,
    /// 32 values: d and 5-bit values, w = d·(u - 16).
    Q5_0,
    /// 32 values: d, m and 5-bit values, w = d·u + m.
    Q5_1,
}

impl BlockType {
    /// Every type, in the order of their ids.
    pub const ALL: [BlockType; 8] = [
        BlockType::Q4K,
        BlockType::Q5K,
        BlockType::Q6K,
        BlockType::Q8_0,
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q5_1,
    ];

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            BlockType::Q4K => "Q4_K",
            BlockType::Q5K => "Q5_K",
            BlockType::Q6K => "Q6_K",
            BlockType::Q8_0 => "Q8_0",
            BlockType::Q4_0 => "Q4_0",
            BlockType::Q4_1 => "Q4_1",
            BlockType::Q5_0 => "Q5_0",
            BlockType::Q5_1 => "Q5_1",
        }
    }

    /// The type ggml calls `name`.
    pub fn from_name(name: &str) -> Result<BlockType, Error> {
        BlockType::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = BlockType::ALL.iter().map(|t| t.name()).collect();
                Error::value(format!(
                    "block type must be one of {}, got {name:?}",
                    names.join(", ")
                ))
            })
    }

    /// Values a ggml block holds.
    pub fn block_values(self) -> usize {
        if small(self.id()) {
            32
        } else {
            256
        }
    }

    /// Bytes a ggml block takes.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q4K => 144,
            BlockType::Q5K => 176,
            BlockType::Q6K => 210,
            BlockType::Q8_0 => 34,
            BlockType::Q4_0 => 18,
            BlockType::Q4_1 => 20,
            BlockType::Q5_0 => 22,
            BlockType::Q5_1 => 24,
        }
    }

    /// Input features a packed record covers.
    fn record_cols(self) -> usize {
        record_cols(self.id())
    }

    /// Bytes of a packed record (16 rows × record_cols).
    fn record_bytes(self) -> usize {
        record_bytes(self.id())
    }

    /// The kernels' const parameter for the type.
    fn id(self) -> u8 {
        self as u8
    }
}

const Q4K: u8 = BlockType::Q4K as u8;
const Q5K: u8 = BlockType::Q5K as u8;
const Q6K: u8 = BlockType::Q6K as u8;
const Q8_0: u8 = BlockType::Q8_0 as u8;
const Q4_0: u8 = BlockType::Q4_0 as u8;
const Q4_1: u8 = BlockType::Q4_1 as u8;
const Q5_0: u8 = BlockType::Q5_0 as u8;
const Q5_1: u8 = BlockType::Q5_1 as u8;

// What each type id `t` is made of, for the packing and the kernels (all const, so each
// kernel, built once a type, branches on none of it).

/// A type of 32-value blocks (a record holds two groups, each with its own header values).
const fn small(t: u8) -> bool {
    t >= Q8_0
}
/// Types with a minimum term: w = A·u + B (B = -dmin·mn, or m).
const fn has_min(t: u8) -> bool {
    matches!(t, Q4K | Q5K | Q4_1 | Q5_1)
}
/// Types whose values have a fifth bit (a bit plane, 64 bytes a group).
const fn five_bits(t: u8) -> bool {
    matches!(t, Q5K | Q5_0 | Q5_1)
}
/// What a type's values are offset by: w = A·(u - offset); its integer sums start at
/// -offset · Σ xq (Q6_K's per 16).
const fn offset(t: u8) -> i32 {
    match t {
        Q4_0 => 8,
        Q5_0 => 16,
        Q6K => 32,
        Q8_0 => 128,
        _ => 0,
    }
}
const fn record_cols(t: u8) -> usize {
    if small(t) {
        64
    } else {
        256
    }
}
/// Header bytes: d and dmin of the 16 rows (K types), or each group's d (and m).
const fn header_bytes(t: u8) -> usize {
    if matches!(t, Q4_1 | Q5_1) {
        2 * HEADER
    } else {
        HEADER
    }
}
/// Where the parts of a record start, for type id `t` (offsets from the record's start).
const fn high_at(t: u8) -> usize {
    header_bytes(t) + record_cols(t) / 32 * 256
}
const fn scales_at(t: u8) -> usize {
    high_at(t)
        + match t {
            Q6K => 16 * 64,
            Q8_0 => 2 * 256,
            _ if five_bits(t) => record_cols(t) / 32 * 64,
            _ => 0,
        }
}
const fn record_bytes(t: u8) -> usize {
    scales_at(t)
        + match t {
            Q4K | Q5K | Q6K => 8 * 32,
            _ => 0,
        }
}
/// Header slot of group j's (or the K types') d, and of its dmin or m.
const fn d_at(t: u8, j: usize) -> usize {
    if small(t) {
        32 * j
    } else {
        0
    }
}
const fn min_at(t: u8, j: usize) -> usize {
    if small(t) {
        HEADER + 32 * j
    } else {
        32
    }
}

/// A part's values as read from its blocks: u (rows, cols), per row and sub-block sc (and mn for
/// the K types with minimums), per row and ggml block d and dmin.
struct Unpacked {
    u: Vec<u8>,
    sc: Vec<i16>,
    mn: Vec<u8>,
    d: Vec<f16>,
    dmin: Vec<f16>,
}

/// The 6-bit scale and minimum of group j of a Q4_K/Q5_K block's 12 scale bytes (ggml's
/// get_scale_min_k4).
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn half_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// Decodes one ggml block of type `t` into its values `u`, sub-block scales and minimums, and
/// returns (d, dmin).
fn decode(t: BlockType, b: &[u8], u: &mut [u8], sc: &mut [i16], mn: &mut [u8]) -> (f16, f16) {
    match t {
        BlockType::Q4K | BlockType::Q5K => {
            let scales = &b[4..16];
            for j in 0..8 {
                let (s, m) = scale_min(j, scales);
                (sc[j], mn[j]) = (i16::from(s), m);
            }
            let (qh, qs) = if t == BlockType::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&[][..], &b[16..144])
            };
            for c in 0..4 {
                for l in 0..32 {
                    let byte = qs[32 * c + l];
                    let (mut lo, mut hi) = (byte & 0xF, byte >> 4);
                    if !qh.is_empty() {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    u[64 * c + l] = lo;
                    u[64 * c + 32 + l] = hi;
                }
            }
            (half_at(b, 0), half_at(b, 2))
        }
        BlockType::Q6K => {
            let (ql, qh) = (&b[..128], &b[128..192]);
            for (j, s) in sc.iter_mut().enumerate().take(16) {
                *s = i16::from(b[192 + j].cast_signed());
            }
            for n in 0..2 {
                let (ql, qh, u) = (&ql[64 * n..], &qh[32 * n..], &mut u[128 * n..]);
                for l in 0..32 {
                    u[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    u[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
            (half_at(b, 208), f16::ZERO)
        }
        BlockType::Q8_0 => {
            for (v, &q) in u.iter_mut().zip(&b[2..34]) {
                *v = q ^ 0x80; // q + 128
            }
            (half_at(b, 0), f16::ZERO)
        }
        BlockType::Q4_0 | BlockType::Q4_1 | BlockType::Q5_0 | BlockType::Q5_1 => {
            // d (and m), then for Q5 32 high bits, then 16 bytes: value j in byte j's low
            // nibble, value j + 16 in its high one
            let with_min = matches!(t, BlockType::Q4_1 | BlockType::Q5_1);
            let at = if with_min { 4 } else { 2 };
            let (qh, qs) = if five_bits(t.id()) {
                let h = &b[at..at + 4];
                (
                    u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
                    &b[at + 4..at + 20],
                )
            } else {
                (0, &b[at..at + 16])
            };
            for j in 0..16 {
                let top = |k: usize| (((qh >> k) & 1) as u8) << 4;
                u[j] = (qs[j] & 0xF) | top(j);
                u[j + 16] = (qs[j] >> 4) | top(j + 16);
            }
            let m = if with_min { half_at(b, 2) } else { f16::ZERO };
            (half_at(b, 0), m)
        }
    }
}

/// Sub-blocks of 16 (Q6_K) or 32 values a ggml block of `t` has.
fn subs_per_block(t: BlockType) -> usize {
    match t {
        BlockType::Q6K => 16,
        BlockType::Q4K | BlockType::Q5K => 8,
        _ => 1,
    }
}

fn unpack(t: BlockType, raw: &[u8], rows: usize, cols: usize) -> Unpacked {
    let per_row = cols / t.block_values();
    let subs = subs_per_block(t);
    let mut un = Unpacked {
        u: vec![0; rows * cols],
        sc: vec![0; rows * per_row * subs],
        mn: vec![0; rows * per_row * subs],
        d: vec![f16::ZERO; rows * per_row],
        dmin: vec![f16::ZERO; rows * per_row],
    };
    let (bv, bb) = (t.block_values(), t.block_bytes());
    for i in 0..rows * per_row {
        let b = &raw[i * bb..(i + 1) * bb];
        let (sc, mn) = (&mut un.sc[i * subs..], &mut un.mn[i * subs..]);
        (un.d[i], un.dmin[i]) = decode(t, b, &mut un.u[i * bv..(i + 1) * bv], sc, mn);
    }
    un
}

/// One part of a matrix: rows row0..row0 + rows, all of one type.
struct Part {
    kind: BlockType,
    row0: usize,
    rows: usize,
    packed: WeightBuf<u8>, // [ceil(rows / 16)][width / record_cols][record_bytes]
    /// 2^-S for the headers' two slots (d, and dmin; Q8_0: d for both): see `normal_shift`.
    unscale: [f32; 2],
}

/// The power of two S that lifts the f16 scales `values` clear of f16's subnormals: the
/// largest with max |v| · 2^S still finite in f16. The headers hold v · 2^S (exact: shifting
/// adds to the exponent only) and the kernels multiply by 2^-S after converting (exact too),
/// so every product is the same bits; but converting a subnormal f16 costs a microcode assist
/// on some CPUs (Zen 4: a Q6_K pass ran at half the memory's rate), and a GGUF's Q6_K scales
/// are nearly all subnormal.
fn normal_shift(values: &[f16]) -> i32 {
    let most = values
        .iter()
        .map(|v| v.to_f32().abs())
        .fold(0.0f32, f32::max);
    if most == 0.0 {
        return 0;
    }
    (65504.0 / most).log2().floor().clamp(0.0, 60.0) as i32
}

/// v · 2^s as f16 (exact for an f16 v, while the result is finite).
fn shifted(v: f16, s: i32) -> f16 {
    f16::from_f32(v.to_f32() * (s as f32).exp2())
}

impl Part {
    /// Part of rows row0..row0 + rows from its raw blocks, packed over `width` ≥ cols features
    /// (a small type's last record may hold a group past cols: zeros, as the activations there).
    fn new(t: BlockType, raw: &[u8], row0: usize, rows: usize, cols: usize, width: usize) -> Part {
        let un = unpack(t, raw, rows, cols);
        let (rc, rb) = (t.record_cols(), t.record_bytes());
        let records = width / rc;
        let blocks = rows.div_ceil(BLOCK);
        let mut packed = WeightBuf::from_elem(0u8, blocks * records * rb);
        let per_row = cols / t.block_values();
        let subs = subs_per_block(t);
        let sub_len = t.block_values() / subs;
        let id = t.id();
        let s0 = normal_shift(&un.d);
        let s1 = if has_min(id) {
            normal_shift(&un.dmin)
        } else {
            s0
        };
        for o in 0..rows {
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for s in 0..records {
                let rec = &mut packed[(b * records + s) * rb..(b * records + s + 1) * rb];
                let k0 = s * rc;
                // header: each group's d (and m), or the block's d and dmin
                for j in 0..rc / t.block_values() {
                    if k0 / t.block_values() + j >= per_row {
                        break;
                    }
                    let at = o * per_row + k0 / t.block_values() + j;
                    let d = shifted(un.d[at], s0).to_le_bytes();
                    rec[d_at(id, j) + 2 * lane..d_at(id, j) + 2 * lane + 2].copy_from_slice(&d);
                    if has_min(id) {
                        let m = shifted(un.dmin[at], s1).to_le_bytes();
                        let at = min_at(id, j) + 2 * lane;
                        rec[at..at + 2].copy_from_slice(&m);
                    }
                }
                for k in 0..rc.min(cols - k0) {
                    let u = un.u[o * cols + k0 + k];
                    let (g, in_group) = (k / GROUP, k % GROUP);
                    let (run, f) = (in_group / 4, in_group % 4);
                    let pos = lane * 4 + f;
                    let pair = g * 4 + run / 2;
                    rec[header_bytes(id) + pair * 64 + pos] |= (u & 15) << (4 * (run % 2));
                    let high = high_at(id);
                    match id {
                        Q6K => {
                            let (sub, r) = (in_group / 16, run % 4);
                            rec[high + (2 * g + sub) * 64 + pos] |= (u >> 4) << (2 * r);
                        }
                        Q8_0 => rec[high + pair * 64 + pos] |= (u >> 4) << (4 * (run % 2)),
                        _ if five_bits(id) => rec[high + g * 64 + pos] |= (u >> 4) << run,
                        _ => {}
                    }
                }
                let scales = scales_at(t.id());
                for g in 0..rc / GROUP {
                    let at = o * per_row * subs + (k0 + g * GROUP) / sub_len;
                    match t {
                        BlockType::Q4K | BlockType::Q5K => {
                            rec[scales + g * 32 + lane] = un.sc[at] as u8;
                            rec[scales + g * 32 + 16 + lane] = un.mn[at];
                        }
                        BlockType::Q6K => {
                            rec[scales + g * 32 + lane] = un.sc[at] as i8 as u8;
                            rec[scales + g * 32 + 16 + lane] = un.sc[at + 1] as i8 as u8;
                        }
                        _ => {}
                    }
                }
            }
        }
        Part {
            kind: t,
            row0,
            rows,
            packed,
            unscale: [(-s0 as f32).exp2(), (-s1 as f32).exp2()],
        }
    }

    fn blocks(&self) -> usize {
        self.rows.div_ceil(BLOCK)
    }
}

/// A weight matrix stacked from GGUF tensors by rows, each at its own block type.
pub struct GgufMatrix {
    rows: usize,
    cols: usize,
    width: usize, // cols, or for a small type's cols a multiple of 32 only, the next of 64
    parts: Vec<Part>,
}

impl GgufMatrix {
    /// A matrix of `cols` columns from parts (type, raw ggml blocks of its rows, its rows),
    /// stacked by rows in order.
    pub fn from_blocks(
        parts: &[(BlockType, &[u8], usize)],
        cols: usize,
    ) -> Result<GgufMatrix, Error> {
        if parts.is_empty() || cols == 0 {
            return Err(Error::value(
                "a GGUF matrix needs at least one part and one column".to_string(),
            ));
        }
        if cols > MAX_COLS {
            return Err(Error::value(format!(
                "a GGUF matrix takes at most {MAX_COLS} columns, got {cols}"
            )));
        }
        // the small types' records take 64 features: a last group past cols holds zeros
        let width = cols.next_multiple_of(64);
        let mut row0 = 0;
        let mut out = Vec::with_capacity(parts.len());
        for (i, &(t, raw, rows)) in parts.iter().enumerate() {
            if rows == 0 {
                return Err(Error::value(format!("part {i} has no rows")));
            }
            if !cols.is_multiple_of(t.block_values()) {
                return Err(Error::value(format!(
                    "a {} part needs a multiple of {} columns (its blocks' values), got {cols}",
                    t.name(),
                    t.block_values()
                )));
            }
            if i + 1 < parts.len() && !rows.is_multiple_of(BLOCK) {
                return Err(Error::value(format!(
                    "part {i} ({rows} rows) must hold a multiple of {BLOCK} rows: only the last \
                     part may end inside a block"
                )));
            }
            let want = rows * (cols / t.block_values()) * t.block_bytes();
            if raw.len() != want {
                return Err(Error::value(format!(
                    "part {i}: {rows} rows of {cols} {} values take {want} bytes, got {}",
                    t.name(),
                    raw.len()
                )));
            }
            out.push(Part::new(t, raw, row0, rows, cols, width));
            row0 += rows;
        }
        let (rows, parts) = (row0, out);
        let m = GgufMatrix {
            rows,
            cols,
            width,
            parts,
        };
        if let Some(bad) = m.first_bad_scale() {
            return Err(Error::value(format!(
                "scales must be finite, found {bad} in a block"
            )));
        }
        Ok(m)
    }

    fn first_bad_scale(&self) -> Option<f32> {
        for p in &self.parts {
            for rec in p.packed.chunks(p.kind.record_bytes()) {
                for h in rec[..header_bytes(p.kind.id())].chunks(2) {
                    let v = f16::from_le_bytes([h[0], h[1]]).to_f32();
                    if !v.is_finite() {
                        return Some(v);
                    }
                }
            }
        }
        None
    }

    /// Output rows n of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (the width of x).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes a pass reads.
    pub fn nbytes(&self) -> usize {
        self.parts.iter().map(|p| p.packed.len()).sum()
    }

    /// (type, rows) of each part.
    pub fn types(&self) -> Vec<(BlockType, usize)> {
        self.parts.iter().map(|p| (p.kind, p.rows)).collect()
    }

    /// The float32 (rows, cols) weights the blocks stand for, in ggml's dequantization order:
    /// (d·sc)·u - dmin·mn, (d·sc)·(u - 32), d·(u - 128).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0.0f32; self.rows * self.cols];
        for p in &self.parts {
            for o in 0..p.rows {
                let row = &mut w[(p.row0 + o) * self.cols..(p.row0 + o + 1) * self.cols];
                for (k, v) in row.iter_mut().enumerate() {
                    *v = self.weight(p, o, k);
                }
            }
        }
        w
    }

    /// Weight (o, k) of part p (o counted from the part's first row).
    fn weight(&self, p: &Part, o: usize, k: usize) -> f32 {
        let t = p.kind.id();
        let rec = self.record(p, o / BLOCK, k / p.kind.record_cols());
        let (lane, k) = (o % BLOCK, k % p.kind.record_cols());
        let u = f32::from(value(rec, t, lane, k));
        let (g, un) = (k / GROUP, p.unscale);
        let d = d_of(rec, t, g, lane, un);
        match t {
            Q4K | Q5K => {
                let (sc, mn) = (sub_scale(rec, t, g, 0, lane), sub_scale(rec, t, g, 1, lane));
                (d * sc as f32) * u - min_of(rec, t, g, lane, un) * mn as f32
            }
            Q6K => (d * sub_scale(rec, t, g, (k % GROUP) / 16, lane) as f32) * (u - 32.0),
            Q4_1 | Q5_1 => d * u + min_of(rec, t, g, lane, un),
            _ => d * (u - offset(t) as f32),
        }
    }

    /// Record s of block b of part p.
    fn record<'a>(&self, p: &'a Part, b: usize, s: usize) -> &'a [u8] {
        let (rb, records) = (p.kind.record_bytes(), self.width / p.kind.record_cols());
        &p.packed[(b * records + s) * rb..(b * records + s + 1) * rb]
    }

    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major. A row of x that holds NaN or ±inf
    /// gives a row of NaN.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        let n = check_product(x, out, self.rows, self.cols, kernel)?;
        if n == 0 {
            return Ok(());
        }
        let most = rows_per_call(kernel);
        // The K types take activations with a scale per 256 features, the others per 32: each
        // scheme quantized once a call, where some part needs it.
        let needs = |k: bool| self.parts.iter().any(|p| small(p.kind.id()) != k);
        let super_acts = needs(true).then(|| SuperActs::quantize(x, n, self.cols, self.width));
        let acts = needs(false).then(|| Activations::quantize(x, n, self.cols, self.width));
        let woven_k =
            (super_acts.as_ref()).map(|a| Woven::new_k(a, n, self.width, &self.parts, most));
        let woven = (acts.as_ref()).map(|a| Woven::new(a, n, self.width, &self.parts, most));
        let bad = match (&super_acts, &acts) {
            (Some(a), _) => &a.bad,
            (None, Some(a)) => &a.bad,
            (None, None) => unreachable!("a matrix has parts"),
        };
        let blocks: Vec<(usize, usize)> = (self.parts.iter().enumerate())
            .flat_map(|(i, p)| (0..p.blocks()).map(move |b| (i, b)))
            .collect();
        let out = Shared::new(out);
        let run = |range: std::ops::Range<usize>| {
            let mut acc = [0.0f32; VNNI_ROWS * BLOCK];
            for &(i, b) in &blocks[range] {
                let p = &self.parts[i];
                let mut r0 = 0;
                let woven = if small(p.kind.id()) { &woven } else { &woven_k };
                let woven = woven.as_ref().expect("quantized for every part's scheme");
                for m in chunks(n, most) {
                    self.dot_block(kernel, p, b, woven, r0, m, &mut acc);
                    write(self.rows, p, b, r0, m, &acc, bad, &out);
                    r0 += m;
                }
            }
        };
        let serial = self.rows * self.cols < PARALLEL_MIN || blocks.len() < 4;
        crate::helper::in_pieces(blocks.len(), UNITS, serial, run);
        Ok(())
    }

    /// acc[i * 16 + lane] = row r0 + i's product with block b of part p, for m rows.
    #[allow(clippy::too_many_arguments)]
    fn dot_block(
        &self,
        kernel: Kernel,
        p: &Part,
        b: usize,
        woven: &Woven,
        r0: usize,
        m: usize,
        acc: &mut [f32],
    ) {
        let records = self.width / p.kind.record_cols();
        let rb = p.kind.record_bytes();
        let w = &p.packed[b * records * rb..(b + 1) * records * rb];
        let groups = self.width / GROUP;
        let scales = if small(p.kind.id()) {
            groups
        } else {
            self.width / SUPER
        };
        let rows = Rows {
            xs: &woven.xs[r0 * self.width..(r0 + m) * self.width],
            sx: &woven.sx[r0 * scales..(r0 + m) * scales],
            xsum: (woven.xsum.get(r0 * groups..(r0 + m) * groups)).unwrap_or(&[]),
            pairs: (woven.pairs.get(4 * r0 * scales..4 * (r0 + m) * scales)).unwrap_or(&[]),
            start: match p.kind.id() {
                Q6K => &woven.start16[r0 * 2 * groups..(r0 + m) * 2 * groups],
                t if small(t) && offset(t) > 0 => &woven.start32[r0 * groups..(r0 + m) * groups],
                _ => &[],
            },
            width: self.width,
            unscale: p.unscale,
        };
        #[cfg(target_arch = "x86_64")]
        macro_rules! types {
            ($run:ident) => {
                match p.kind {
                    BlockType::Q4K => $run!(Q4K),
                    BlockType::Q5K => $run!(Q5K),
                    BlockType::Q6K => $run!(Q6K),
                    BlockType::Q8_0 => $run!(Q8_0),
                    BlockType::Q4_0 => $run!(Q4_0),
                    BlockType::Q4_1 => $run!(Q4_1),
                    BlockType::Q5_0 => $run!(Q5_0),
                    BlockType::Q5_1 => $run!(Q5_1),
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        macro_rules! vnni {
            ($t:ident) => {{
                macro_rules! call {
                    ($r:literal) => {
                        if small($t) {
                            x86::dot_vnni::<$r, $t>(w, &rows, acc)
                        } else {
                            x86::dot_vnni_k::<$r, $t>(w, &rows, acc)
                        }
                    };
                }
                match m {
                    1 => call!(1),
                    2 => call!(2),
                    3 => call!(3),
                    4 => call!(4),
                    5 => call!(5),
                    6 => call!(6),
                    7 => call!(7),
                    8 => call!(8),
                    9 => call!(9),
                    _ => call!(10),
                }
            }};
        }
        #[cfg(target_arch = "x86_64")]
        macro_rules! ymm {
            ($t:ident) => {{
                macro_rules! call {
                    ($r:literal, $half:expr) => {
                        if small($t) {
                            x86::dot_half::<$r, $t>(w, $half, &rows, acc)
                        } else {
                            x86::dot_half_k::<$r, $t>(w, $half, &rows, acc)
                        }
                    };
                }
                for half in 0..2 {
                    match m {
                        1 => call!(1, half),
                        2 => call!(2, half),
                        3 => call!(3, half),
                        _ => call!(4, half),
                    }
                }
            }};
        }
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the kernel passed `supported()` (AVX-512 BW and VNNI); F16C is checked by
            // rows_per_call. Slice lengths are as read.
            Kernel::Avx512Vnni if rows_per_call(kernel) == VNNI_ROWS => unsafe { types!(vnni) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every kernel but Scalar implies AVX2; F16C is checked here.
            Kernel::Avx2 | Kernel::AvxVnni | Kernel::Avx512Vnni if has_f16c() => unsafe {
                types!(ymm);
            },
            _ if small(p.kind.id()) => dot_scalar(w, p.kind.id(), &rows, m, acc),
            _ => dot_scalar_k(w, p.kind.id(), &rows, m, acc),
        }
    }
}

impl Product for GgufMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        GgufMatrix::matmul(self, x, out, kernel)
    }
}

/// Features a K type's activation scale covers: its super-block (a record).
const SUPER: usize = 256;

/// Activations for the K types: int8 with one scale a row and super-block of 256 features (as
/// ggml's Q8_K), so a super-block's sub-block sums meet their integer scales in integers, and
/// Σ xq per 16 features.
struct SuperActs {
    q: Vec<i8>,
    scales: Vec<f32>, // (n, width / 256)
    sums16: Vec<i32>, // (n, width / 16)
    bad: Vec<bool>,
}

impl SuperActs {
    /// Quantizes x (n, cols); the K types' cols are whole super-blocks, so width = cols. Rows
    /// are split between the threads as [`Activations::quantize`] splits them (a prefill's).
    fn quantize(x: &[f32], n: usize, cols: usize, width: usize) -> SuperActs {
        assert!(cols == width && width.is_multiple_of(SUPER));
        let sbs = width / SUPER;
        let mut a = SuperActs {
            q: vec![0; n * width],
            scales: vec![0.0; n * sbs],
            sums16: vec![0; n * width / 16],
            bad: vec![false; n],
        };
        let (qs, ss, us, bs) = (
            Shared::new(&mut a.q),
            Shared::new(&mut a.scales),
            Shared::new(&mut a.sums16),
            Shared::new(&mut a.bad),
        );
        crate::helper::for_row_ranges(n, ROW_VALUES / width, |rows| {
            // SAFETY: the ranges of rows are disjoint, and so are their parts of each array.
            let (q, scales, sums16, bad) = unsafe {
                (
                    qs.part(rows.start * width..rows.end * width),
                    ss.part(rows.start * sbs..rows.end * sbs),
                    us.part(rows.start * width / 16..rows.end * width / 16),
                    bs.part(rows.clone()),
                )
            };
            let x = &x[rows.start * cols..rows.end * cols];
            quantize_super_rows(x, width, q, scales, sums16, bad);
        });
        a
    }
}

/// Rows x (r, width) quantized per super-block into q, scales (r, width / 256), sums per 16
/// (r, width / 16) and whether each row is all finite.
fn quantize_super_rows(
    x: &[f32],
    width: usize,
    q: &mut [i8],
    scales: &mut [f32],
    sums16: &mut [i32],
    bad: &mut [bool],
) {
    #[cfg(target_arch = "x86_64")]
    let avx512 = is_x86_feature_detected!("avx512f");
    for (r, row) in x.chunks_exact(width).enumerate() {
        bad[r] = row.iter().any(|v| !v.is_finite());
        for (s, xs) in row.chunks_exact(SUPER).enumerate() {
            let at = r * width + s * SUPER;
            let (q, sums) = (
                &mut q[at..at + SUPER],
                &mut sums16[at / 16..(at + SUPER) / 16],
            );
            let scale = &mut scales[r * (width / SUPER) + s];
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                // SAFETY: the CPU has AVX-512F (checked above); the slices hold one super-block.
                *scale = unsafe { x86::quantize_super(xs, q, sums) };
                continue;
            }
            *scale = crate::int8::quantize(xs, q);
            for (sum, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
                *sum = q.iter().map(|&v| i32::from(v)).sum();
            }
        }
    }
}

/// A pass's activations as the kernels read them, each chunk of rows that one kernel call takes
/// (`chunks(n, most)`) woven together: for a chunk of m rows, the int8 values as [width / 4][m][4]
/// (a run of 4 features of every row side by side, so a kernel reaches row i's at a constant
/// offset from one pointer, not through a register a row), and per row, as [..][m]:
/// - for the small types ([`Woven::new`]): per group sx, sx · Σ xq (the minimum term's) and
///   -Σ xq (times the offset: Q4_0's, Q5_0's and Q8_0's start);
/// - for the K types ([`Woven::new_k`]): per super-block sx, the groups' Σ xq in i16 pairs (the
///   minimum term's, 4 a super-block) and -32 Σ xq per 16 (Q6_K's start);
///
/// each list empty where no part needs it.
struct Woven {
    xs: Vec<i8>,
    sx: Vec<f32>,
    xsum: Vec<f32>,
    pairs: Vec<i32>,
    start16: Vec<i32>,
    start32: Vec<i32>,
}

/// The int8 values of n rows (n, width), woven chunk by chunk as [width / 4][m][4].
fn weave(q: &[i8], n: usize, width: usize, most: usize) -> Vec<i8> {
    let mut xs = vec![0; n * width];
    let mut r0 = 0;
    for m in chunks(n, most) {
        for i in 0..m {
            let r = r0 + i;
            for k in (0..width).step_by(4) {
                let to = r0 * width + k * m + 4 * i;
                xs[to..to + 4].copy_from_slice(&q[r * width + k..r * width + k + 4]);
            }
        }
        r0 += m;
    }
    xs
}

fn sized(yes: bool, len: usize) -> usize {
    if yes {
        len
    } else {
        0
    }
}

impl Woven {
    /// The small types' scheme, from activations with a scale per group of 32.
    fn new(acts: &Activations, n: usize, width: usize, parts: &[Part], most: usize) -> Woven {
        let needs = |f: fn(u8) -> bool| parts.iter().any(|p| small(p.kind.id()) && f(p.kind.id()));
        let groups = width / GROUP;
        let (scales, sums) = (&acts.scales, &acts.sums);
        let mut w = Woven {
            xs: weave(&acts.q, n, width, most),
            sx: vec![0.0; n * groups],
            xsum: vec![0.0; sized(needs(has_min), n * groups)],
            pairs: Vec::new(),
            start16: Vec::new(),
            start32: vec![0; sized(needs(|t| offset(t) > 0), n * groups)],
        };
        let mut r0 = 0;
        for m in chunks(n, most) {
            for i in 0..m {
                for g in 0..groups {
                    let (to, at) = (r0 * groups + g * m + i, (r0 + i) * groups + g);
                    w.sx[to] = scales[at];
                    if !w.xsum.is_empty() {
                        w.xsum[to] = scales[at] * sums[at] as f32;
                    }
                    if !w.start32.is_empty() {
                        w.start32[to] = -sums[at];
                    }
                }
            }
            r0 += m;
        }
        w
    }

    /// The K types' scheme, from activations with a scale per super-block of 256.
    fn new_k(acts: &SuperActs, n: usize, width: usize, parts: &[Part], most: usize) -> Woven {
        let needs = |f: fn(u8) -> bool| parts.iter().any(|p| !small(p.kind.id()) && f(p.kind.id()));
        let (groups, sbs) = (width / GROUP, width / SUPER);
        let mut w = Woven {
            xs: weave(&acts.q, n, width, most),
            sx: vec![0.0; n * sbs],
            xsum: Vec::new(),
            pairs: vec![0; sized(needs(has_min), 4 * n * sbs)],
            start16: vec![0; sized(needs(|t| t == Q6K), 2 * n * groups)],
            start32: Vec::new(),
        };
        let mut r0 = 0;
        for m in chunks(n, most) {
            for i in 0..m {
                let r = r0 + i;
                let sum16 = |j: usize| acts.sums16[r * 2 * groups + j];
                let group = |g: usize| sum16(2 * g) + sum16(2 * g + 1);
                for s in 0..sbs {
                    w.sx[r0 * sbs + s * m + i] = acts.scales[r * sbs + s];
                }
                if !w.pairs.is_empty() {
                    for k in 0..4 * sbs {
                        // |Σ xq| of a group ≤ 32 · 127: an i16
                        let (lo, hi) = (group(2 * k) as i16, group(2 * k + 1) as i16);
                        w.pairs[4 * r0 * sbs + k * m + i] =
                            i32::from(lo as u16) | (i32::from(hi) << 16);
                    }
                }
                if !w.start16.is_empty() {
                    for j in 0..2 * groups {
                        w.start16[2 * r0 * groups + j * m + i] = -offset(Q6K) * sum16(j);
                    }
                }
            }
            r0 += m;
        }
        w
    }
}

/// Writes block b of part p's columns of rows r0..r0+m.
#[allow(clippy::too_many_arguments)]
fn write(
    rows: usize,
    p: &Part,
    b: usize,
    r0: usize,
    m: usize,
    acc: &[f32],
    bad: &[bool],
    out: &Shared<'_, f32>,
) {
    let width = BLOCK.min(p.rows - b * BLOCK);
    write_block(out, rows, p.row0 + b * BLOCK, width, r0, m, acc, bad);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn rows_per_call(kernel: Kernel) -> usize {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Vnni && has_f16c() {
        return VNNI_ROWS;
    }
    ROWS
}

/// The m activation rows of a kernel call, woven (see [`Woven`]): int8 values [width / 4][m][4],
/// sx per group (small types) or super-block (K types), sx · Σ xq per group (Q4_1, Q5_1), the
/// groups' Σ xq in i16 pairs (Q4_K, Q5_K), and the integer sums' starts (Q6_K: [2 · groups][m],
/// Q4_0, Q5_0, Q8_0: [groups][m]).
#[derive(Clone, Copy)]
struct Rows<'a> {
    xs: &'a [i8],
    sx: &'a [f32],
    xsum: &'a [f32],
    pairs: &'a [i32],
    start: &'a [i32],
    width: usize,
    unscale: [f32; 2],
}

/// Row `lane`'s d in a record (a small type's: group j's), as f32.
fn d_of(rec: &[u8], t: u8, j: usize, lane: usize, unscale: [f32; 2]) -> f32 {
    half_at(rec, d_at(t, j) + 2 * lane).to_f32() * unscale[0]
}

/// The same for group j's dmin (K types) or m (Q4_1, Q5_1).
fn min_of(rec: &[u8], t: u8, j: usize, lane: usize, unscale: [f32; 2]) -> f32 {
    half_at(rec, min_at(t, j) + 2 * lane).to_f32() * unscale[1]
}

/// Group g's sub-scale j of row `lane` (K types: j 0 is sc, 1 is mn; Q6_K: sub-block j's sc).
fn sub_scale(rec: &[u8], t: u8, g: usize, j: usize, lane: usize) -> i32 {
    let v = rec[scales_at(t) + g * 32 + 16 * j + lane];
    if t == Q6K {
        i32::from(v.cast_signed())
    } else {
        i32::from(v)
    }
}

/// Value u of row `lane`, feature k of a record.
fn value(rec: &[u8], t: u8, lane: usize, k: usize) -> u8 {
    let (g, in_group) = (k / GROUP, k % GROUP);
    let (run, pos) = (in_group / 4, lane * 4 + in_group % 4);
    let pair = g * 4 + run / 2;
    let low = (rec[header_bytes(t) + pair * 64 + pos] >> (4 * (run % 2))) & 15;
    let high = high_at(t);
    let top = match t {
        Q6K => (rec[high + (2 * g + in_group / 16) * 64 + pos] >> (2 * (run % 4))) & 3,
        Q8_0 => (rec[high + pair * 64 + pos] >> (4 * (run % 2))) & 15,
        _ if five_bits(t) => (rec[high + g * 64 + pos] >> run) & 1,
        _ => 0,
    };
    low | (top << 4)
}

/// Where row i's feature f lies in a woven chunk of m rows.
fn woven_at(f: usize, i: usize, m: usize) -> usize {
    (f / 4) * 4 * m + 4 * i + f % 4
}

/// The portable kernel for the small types, and the order every other one keeps: per group,
/// `acc += (s as f32) * (d * sx)`, then `acc += B * (sx · Σ xq)` (Q4_1, Q5_1).
fn dot_scalar(w: &[u8], t: u8, rows: &Rows<'_>, m: usize, acc: &mut [f32]) {
    let (rc, rb) = (record_cols(t), record_bytes(t));
    let (groups, un) = (rows.width / GROUP, rows.unscale);
    for i in 0..m {
        for lane in 0..BLOCK {
            let mut total = 0.0f32;
            for g in 0..groups {
                let (s, j) = (g * GROUP / rc, g % (rc / GROUP));
                let rec = &w[s * rb..(s + 1) * rb];
                let start = if offset(t) > 0 {
                    offset(t) * rows.start[g * m + i]
                } else {
                    0
                };
                let dot = group_dot(rec, t, rows, g, j, i, m, lane, 0..GROUP, start);
                total += (dot as f32) * (d_of(rec, t, j, lane, un) * rows.sx[g * m + i]);
                if has_min(t) {
                    total += min_of(rec, t, j, lane, un) * rows.xsum[g * m + i];
                }
            }
            acc[i * BLOCK + lane] = total;
        }
    }
}

/// start + Σ u · xq over features `k` of group j of a record (group g of the row), for row i
/// of m and output row `lane`.
#[allow(clippy::too_many_arguments)]
fn group_dot(
    rec: &[u8],
    t: u8,
    rows: &Rows<'_>,
    g: usize,
    j: usize,
    i: usize,
    m: usize,
    lane: usize,
    k: std::ops::Range<usize>,
    start: i32,
) -> i32 {
    k.fold(start, |acc, k| {
        acc + i32::from(value(rec, t, lane, j * GROUP + k))
            * i32::from(rows.xs[woven_at(g * GROUP + k, i, m)])
    })
}

/// The portable kernel for the K types, and the order every other one keeps. Per super-block:
/// the integers S = Σ sc · s over its sub-blocks and (Q4_K, Q5_K) M = Σ mn · Σ xq over its
/// groups, then `acc += (S as f32) * (d * sx)` and `acc -= (M as f32) * (dmin * sx)`.
fn dot_scalar_k(w: &[u8], t: u8, rows: &Rows<'_>, m: usize, acc: &mut [f32]) {
    let rb = record_bytes(t);
    let un = rows.unscale;
    for i in 0..m {
        for lane in 0..BLOCK {
            let mut total = 0.0f32;
            for s in 0..rows.width / SUPER {
                let rec = &w[s * rb..(s + 1) * rb];
                let (mut big_s, mut big_m) = (0i32, 0i32);
                for j in 0..SUPER / GROUP {
                    let g = s * (SUPER / GROUP) + j;
                    if t == Q6K {
                        for sub in 0..2 {
                            let start = rows.start[(2 * g + sub) * m + i];
                            let k = 16 * sub..16 * sub + 16;
                            let dot = group_dot(rec, t, rows, g, j, i, m, lane, k, start);
                            big_s += sub_scale(rec, t, j, sub, lane) * dot;
                        }
                        continue;
                    }
                    let dot = group_dot(rec, t, rows, g, j, i, m, lane, 0..GROUP, 0);
                    big_s += sub_scale(rec, t, j, 0, lane) * dot;
                    let pair = rows.pairs[(g / 2) * m + i];
                    let sum = i32::from((pair >> (16 * (g % 2))) as i16);
                    big_m += sub_scale(rec, t, j, 1, lane) * sum;
                }
                let sx = rows.sx[s * m + i];
                total += (big_s as f32) * (d_of(rec, t, 0, lane, un) * sx);
                if has_min(t) {
                    total -= (big_m as f32) * (min_of(rec, t, 0, lane, un) * sx);
                }
            }
            acc[i * BLOCK + lane] = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::wildcard_imports)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        d_at, five_bits, has_min, header_bytes, high_at, min_at, offset, record_bytes, record_cols,
        scales_at, Rows, BLOCK, GROUP, Q6K, Q8_0, SUPER,
    };

    /// The two runs of a pair as u8 values (w0, w1), from its nibble bytes `v` and the high bits
    /// `h` (five-bit types: shifted on by 2 for the next pair; Q6_K: by 4) or Q8_0's second
    /// nibble plane `hv`: 512-bit ($v: __m512i) or 256-bit (ymm) alike.
    macro_rules! unpack {
        (zmm, $t:expr, $v:expr, $h:expr, $hv:expr) => {{
            let low = _mm512_set1_epi8(15);
            let w0 = _mm512_and_si512($v, low);
            let w1 = _mm512_and_si512(_mm512_srli_epi16($v, 4), low);
            if five_bits($t) {
                let bit = _mm512_set1_epi8(0x10);
                let w0 = _mm512_or_si512(w0, _mm512_and_si512(_mm512_slli_epi16($h, 4), bit));
                let w1 = _mm512_or_si512(w1, _mm512_and_si512(_mm512_slli_epi16($h, 3), bit));
                $h = _mm512_srli_epi16($h, 2);
                (w0, w1)
            } else if $t == Q6K {
                let bits = _mm512_set1_epi8(0x30);
                let w0 = _mm512_or_si512(w0, _mm512_and_si512(_mm512_slli_epi16($h, 4), bits));
                let w1 = _mm512_or_si512(w1, _mm512_and_si512(_mm512_slli_epi16($h, 2), bits));
                $h = _mm512_srli_epi16($h, 4);
                (w0, w1)
            } else if $t == Q8_0 {
                let top = _mm512_set1_epi8(-16); // 0xF0
                let w0 = _mm512_or_si512(w0, _mm512_and_si512(_mm512_slli_epi16($hv, 4), top));
                (w0, _mm512_or_si512(w1, _mm512_and_si512($hv, top)))
            } else {
                (w0, w1)
            }
        }};
        (ymm, $t:expr, $v:expr, $h:expr, $hv:expr) => {{
            let low = _mm256_set1_epi8(15);
            let w0 = _mm256_and_si256($v, low);
            let w1 = _mm256_and_si256(_mm256_srli_epi16($v, 4), low);
            if five_bits($t) {
                let bit = _mm256_set1_epi8(0x10);
                let w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_slli_epi16($h, 4), bit));
                let w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_slli_epi16($h, 3), bit));
                $h = _mm256_srli_epi16($h, 2);
                (w0, w1)
            } else if $t == Q6K {
                let bits = _mm256_set1_epi8(0x30);
                let w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_slli_epi16($h, 4), bits));
                let w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_slli_epi16($h, 2), bits));
                $h = _mm256_srli_epi16($h, 4);
                (w0, w1)
            } else if $t == Q8_0 {
                // w = u - 128 as i8: u with its top bit flipped
                let (top, flip) = (_mm256_set1_epi8(-16), _mm256_set1_epi8(-128));
                let w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_slli_epi16($hv, 4), top));
                let w1 = _mm256_or_si256(w1, _mm256_and_si256($hv, top));
                (_mm256_xor_si256(w0, flip), _mm256_xor_si256(w1, flip))
            } else {
                (w0, w1)
            }
        }};
    }

    /// Prefetches group j's share of the record 4 KB ahead of `rec` (a record's nibbles, high
    /// bits and scales are apart, so each group fetches its share of every line): one or two
    /// rows read faster than the hardware prefetches, into L2; more rows, into L1 (2 KB ahead
    /// left a 9-row pass waiting on memory: 10 % slower).
    #[inline]
    unsafe fn prefetch(rec: *const u8, rb: usize, groups: usize, j: usize, rows: usize) {
        let share = (rb / 64).div_ceil(groups);
        for line in j * share..((j + 1) * share).min(rb / 64) {
            if rows <= 2 {
                _mm_prefetch::<_MM_HINT_T1>(rec.wrapping_add(4096 + line * 64).cast());
            } else {
                _mm_prefetch::<_MM_HINT_T0>(rec.wrapping_add(4096 + line * 64).cast());
            }
        }
    }

    /// AVX-512 VNNI for the small types, 16 output rows a zmm: per pair of runs the 64 nibble
    /// bytes (and the high bits) become two zmm of u8 values, each meeting a row's 4
    /// activations, broadcast, in one vpdpbusd into i32; one float step a group. The high bits
    /// are shifted into bit 4 by the pair's place, so one code serves every pair. Everything
    /// that depends on the type is a constant of `T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn dot_vnni<const R: usize, const T: u8>(
        w: &[u8],
        rows: &Rows<'_>,
        acc: &mut [f32],
    ) {
        let Rows {
            xs,
            sx,
            xsum,
            start,
            width,
            unscale,
            ..
        } = *rows;
        let (rc, rb) = (record_cols(T), record_bytes(T));
        let (un0, un1) = (_mm512_set1_ps(unscale[0]), _mm512_set1_ps(unscale[1]));
        let half = |p: *const u8, un: __m512| {
            _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast())), un)
        };
        let xp = xs.as_ptr();
        let mut total = [_mm512_setzero_ps(); R];
        for s in 0..width / rc {
            let rec = w.as_ptr().add(s * rb);
            for j in 0..rc / GROUP {
                let g = s * (rc / GROUP) + j;
                prefetch(rec, rb, rc / GROUP, j, R);
                let (nib, hi) = (rec.add(header_bytes(T) + j * 256), rec.add(high_at(T)));
                let d = half(rec.add(d_at(T, j)), un0);
                let mut h = if five_bits(T) {
                    _mm512_loadu_si512(hi.add(j * 64).cast())
                } else {
                    _mm512_setzero_si512()
                };
                let mut sums = [_mm512_setzero_si512(); R];
                if offset(T) > 0 {
                    for (i, si) in sums.iter_mut().enumerate() {
                        *si = _mm512_set1_epi32(offset(T) * *start.get_unchecked(g * R + i));
                    }
                }
                for p in 0..4 {
                    let v = _mm512_loadu_si512(nib.add(p * 64).cast());
                    let hv = if T == Q8_0 {
                        _mm512_loadu_si512(hi.add((j * 4 + p) * 64).cast())
                    } else {
                        _mm512_setzero_si512()
                    };
                    let (w0, w1) = unpack!(zmm, T, v, h, hv);
                    let at = g * GROUP + p * 8;
                    for (i, si) in sums.iter_mut().enumerate() {
                        let x = |at: usize| {
                            _mm512_set1_epi32(xp.add(at * R + 4 * i).cast::<i32>().read_unaligned())
                        };
                        *si = _mm512_dpbusd_epi32(*si, w0, x(at));
                        *si = _mm512_dpbusd_epi32(*si, w1, x(at + 4));
                    }
                }
                for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                    let s = _mm512_set1_ps(*sx.get_unchecked(g * R + i));
                    let exact = _mm512_cvtepi32_ps(*si);
                    *ti = _mm512_add_ps(*ti, _mm512_mul_ps(exact, _mm512_mul_ps(d, s)));
                }
                if has_min(T) {
                    let b = half(rec.add(min_at(T, j)), un1);
                    for (i, ti) in total.iter_mut().enumerate() {
                        let xs = _mm512_set1_ps(*xsum.get_unchecked(g * R + i));
                        *ti = _mm512_add_ps(*ti, _mm512_mul_ps(b, xs));
                    }
                }
            }
        }
        for (i, ti) in total.iter().enumerate() {
            _mm512_storeu_ps(acc.as_mut_ptr().add(i * BLOCK), *ti);
        }
    }

    /// AVX-512 VNNI for the K types: each group's (Q6_K: sub-block's) integer sums as in
    /// [`dot_vnni`], times their sub-block scales in i32 (vpmulld) into a super-block's S; its
    /// minimum term M in one vpdpwssd per pair of groups (mn against Σ xq, i16 pairs); and one
    /// float step a super-block. The running totals stay in `acc` (30 zmm would not fit).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn dot_vnni_k<const R: usize, const T: u8>(
        w: &[u8],
        rows: &Rows<'_>,
        acc: &mut [f32],
    ) {
        let Rows {
            xs,
            sx,
            pairs,
            start,
            width,
            unscale,
            ..
        } = *rows;
        let rb = record_bytes(T);
        let (un0, un1) = (_mm512_set1_ps(unscale[0]), _mm512_set1_ps(unscale[1]));
        let half = |p: *const u8, un: __m512| {
            _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast())), un)
        };
        let xp = xs.as_ptr();
        let out = acc.as_mut_ptr();
        for i in 0..R {
            _mm512_storeu_ps(out.add(i * BLOCK), _mm512_setzero_ps());
        }
        let subs = if T == Q6K { 2 } else { 1 };
        for s in 0..width / SUPER {
            let rec = w.as_ptr().add(s * rb);
            let (scales, hi) = (rec.add(scales_at(T)), rec.add(high_at(T)));
            let mut big = [_mm512_setzero_si512(); R];
            for j in 0..SUPER / GROUP {
                let g = s * (SUPER / GROUP) + j;
                prefetch(rec, rb, SUPER / GROUP, j, R);
                let nib = rec.add(header_bytes(T) + j * 256);
                let mut h = if five_bits(T) {
                    _mm512_loadu_si512(hi.add(j * 64).cast())
                } else {
                    _mm512_setzero_si512()
                };
                for sub in 0..subs {
                    let sc = _mm_loadu_si128(scales.add(j * 32 + 16 * sub).cast());
                    let sc = if T == Q6K {
                        _mm512_cvtepi8_epi32(sc)
                    } else {
                        _mm512_cvtepu8_epi32(sc)
                    };
                    let mut sums = [_mm512_setzero_si512(); R];
                    if T == Q6K {
                        h = _mm512_loadu_si512(hi.add((2 * j + sub) * 64).cast());
                        for (i, si) in sums.iter_mut().enumerate() {
                            *si = _mm512_set1_epi32(*start.get_unchecked((2 * g + sub) * R + i));
                        }
                    }
                    for p in sub * 4 / subs..(sub + 1) * 4 / subs {
                        let v = _mm512_loadu_si512(nib.add(p * 64).cast());
                        let (w0, w1) = unpack!(zmm, T, v, h, v);
                        let at = g * GROUP + p * 8;
                        for (i, si) in sums.iter_mut().enumerate() {
                            let x = |at: usize| {
                                _mm512_set1_epi32(
                                    xp.add(at * R + 4 * i).cast::<i32>().read_unaligned(),
                                )
                            };
                            *si = _mm512_dpbusd_epi32(*si, w0, x(at));
                            *si = _mm512_dpbusd_epi32(*si, w1, x(at + 4));
                        }
                    }
                    for (bi, si) in big.iter_mut().zip(&sums) {
                        *bi = _mm512_add_epi32(*bi, _mm512_mullo_epi32(*si, sc));
                    }
                }
            }
            let d = half(rec.add(d_at(T, 0)), un0);
            // mn of groups 2k and 2k + 1 as each lane's low and high i16
            let mut mn = [_mm512_setzero_si512(); 4];
            if has_min(T) {
                let at = |j: usize| _mm_loadu_si128(scales.add(j * 32 + 16).cast());
                for (k, mk) in mn.iter_mut().enumerate() {
                    let (lo, hi) = (at(2 * k), at(2 * k + 1));
                    *mk = _mm512_or_si512(
                        _mm512_cvtepu8_epi32(lo),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(hi), 16),
                    );
                }
            }
            let dmin = half(rec.add(min_at(T, 0)), un1);
            for (i, bi) in big.iter().enumerate() {
                let si = _mm512_set1_ps(*sx.get_unchecked(s * R + i));
                let o = out.add(i * BLOCK);
                let exact = _mm512_cvtepi32_ps(*bi);
                let mut t = _mm512_add_ps(
                    _mm512_loadu_ps(o),
                    _mm512_mul_ps(exact, _mm512_mul_ps(d, si)),
                );
                if has_min(T) {
                    let mut mi = _mm512_setzero_si512();
                    for (k, mk) in mn.iter().enumerate() {
                        let sums = *pairs.get_unchecked((4 * s + k) * R + i);
                        mi = _mm512_dpwssd_epi32(mi, *mk, _mm512_set1_epi32(sums));
                    }
                    let exact = _mm512_cvtepi32_ps(mi);
                    t = _mm512_sub_ps(t, _mm512_mul_ps(exact, _mm512_mul_ps(dmin, si)));
                }
                _mm512_storeu_ps(o, t);
            }
        }
    }

    /// AVX2 for the small types, half a block (8 output rows) a ymm, for R ≤ 4 rows. vpmaddubsw
    /// (u8 × s8) sums a run's products in i16 pairs, as many runs as cannot overflow (2 · 127 ·
    /// the largest value: 4-bit types 8 runs, 5-bit 4), then vpmaddwd widens them to i32. Q8_0's
    /// values reach 255, too many for an i16 pair: its runs are multiplied signed,
    /// |w| × sign(x, w) (w = u - 128, at most 128 · 127 · 2 < 2^15), each run widened at once,
    /// and its sums start at 0. The same integers as the other kernels, so the same bits.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dot_half<const R: usize, const T: u8>(
        w: &[u8],
        half: usize,
        rows: &Rows<'_>,
        acc: &mut [f32],
    ) {
        let Rows {
            xs,
            sx,
            xsum,
            start,
            width,
            unscale,
            ..
        } = *rows;
        let (rc, rb) = (record_cols(T), record_bytes(T));
        let (un0, un1) = (_mm256_set1_ps(unscale[0]), _mm256_set1_ps(unscale[1]));
        let ones = _mm256_set1_epi16(1);
        // Eight f16 (the half's rows) at p, as f32, times un.
        let eight = |p: *const u8, un: __m256| {
            _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * half).cast())),
                un,
            )
        };
        let xp = xs.as_ptr();
        let mut total = [_mm256_setzero_ps(); R];
        let span = if five_bits(T) { 2 } else { 4 };
        for s in 0..width / rc {
            let rec = w.as_ptr().add(s * rb);
            for j in 0..rc / GROUP {
                let g = s * (rc / GROUP) + j;
                let nib = rec.add(header_bytes(T) + j * 256 + 32 * half);
                let hi = rec.add(high_at(T) + 32 * half);
                let d = eight(rec.add(d_at(T, j)), un0);
                let mut h = if five_bits(T) {
                    _mm256_loadu_si256(hi.add(j * 64).cast())
                } else {
                    _mm256_setzero_si256()
                };
                let mut sums = [_mm256_setzero_si256(); R];
                if offset(T) > 0 && T != Q8_0 {
                    for (i, si) in sums.iter_mut().enumerate() {
                        *si = _mm256_set1_epi32(offset(T) * *start.get_unchecked(g * R + i));
                    }
                }
                let mut short = [_mm256_setzero_si256(); R];
                for p in 0..4 {
                    let v = _mm256_loadu_si256(nib.add(p * 64).cast());
                    let hv = if T == Q8_0 {
                        _mm256_loadu_si256(hi.add((j * 4 + p) * 64).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    let (w0, w1) = unpack!(ymm, T, v, h, hv);
                    let at = g * GROUP + p * 8;
                    for (i, (si, sh)) in sums.iter_mut().zip(short.iter_mut()).enumerate() {
                        let x = |at: usize| {
                            _mm256_set1_epi32(xp.add(at * R + 4 * i).cast::<i32>().read_unaligned())
                        };
                        let (x0, x1) = (x(at), x(at + 4));
                        if T == Q8_0 {
                            let p0 = _mm256_maddubs_epi16(
                                _mm256_sign_epi8(w0, w0),
                                _mm256_sign_epi8(x0, w0),
                            );
                            let p1 = _mm256_maddubs_epi16(
                                _mm256_sign_epi8(w1, w1),
                                _mm256_sign_epi8(x1, w1),
                            );
                            *si = _mm256_add_epi32(*si, _mm256_madd_epi16(p0, ones));
                            *si = _mm256_add_epi32(*si, _mm256_madd_epi16(p1, ones));
                        } else {
                            let two = _mm256_add_epi16(
                                _mm256_maddubs_epi16(w0, x0),
                                _mm256_maddubs_epi16(w1, x1),
                            );
                            *sh = _mm256_add_epi16(*sh, two);
                            if (p + 1) % span == 0 {
                                *si = _mm256_add_epi32(*si, _mm256_madd_epi16(*sh, ones));
                                *sh = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                    let s = _mm256_set1_ps(*sx.get_unchecked(g * R + i));
                    let exact = _mm256_cvtepi32_ps(*si);
                    *ti = _mm256_add_ps(*ti, _mm256_mul_ps(exact, _mm256_mul_ps(d, s)));
                }
                if has_min(T) {
                    let b = eight(rec.add(min_at(T, j)), un1);
                    for (i, ti) in total.iter_mut().enumerate() {
                        let xs = _mm256_set1_ps(*xsum.get_unchecked(g * R + i));
                        *ti = _mm256_add_ps(*ti, _mm256_mul_ps(b, xs));
                    }
                }
            }
        }
        for (i, ti) in total.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(i * BLOCK + 8 * half), *ti);
        }
    }

    /// AVX2 for the K types, half a block a ymm, for R ≤ 4 rows: the integer sums as
    /// [`dot_half`]'s (Q6_K's runs widened one pair at a time: 2 · 63 · 127 · 2 < 2^15), then
    /// [`dot_vnni_k`]'s order: sub-block scales in i32 (vpmulld), the minimum term by vpmaddwd
    /// on i16 pairs, one float step a super-block.
    #[target_feature(enable = "avx2,f16c")]
    #[allow(clippy::too_many_lines)]
    pub unsafe fn dot_half_k<const R: usize, const T: u8>(
        w: &[u8],
        half: usize,
        rows: &Rows<'_>,
        acc: &mut [f32],
    ) {
        let Rows {
            xs,
            sx,
            pairs,
            start,
            width,
            unscale,
            ..
        } = *rows;
        let rb = record_bytes(T);
        let (un0, un1) = (_mm256_set1_ps(unscale[0]), _mm256_set1_ps(unscale[1]));
        let ones = _mm256_set1_epi16(1);
        let eight = |p: *const u8, un: __m256| {
            _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * half).cast())),
                un,
            )
        };
        // Eight bytes (the half's rows) at p as i32, unsigned or (Q6_K) signed.
        let bytes = |p: *const u8| {
            let v = _mm_loadl_epi64(p.add(8 * half).cast());
            if T == Q6K {
                _mm256_cvtepi8_epi32(v)
            } else {
                _mm256_cvtepu8_epi32(v)
            }
        };
        let xp = xs.as_ptr();
        let out = acc.as_mut_ptr().add(8 * half);
        for i in 0..R {
            _mm256_storeu_ps(out.add(i * BLOCK), _mm256_setzero_ps());
        }
        let (subs, span) = match T {
            Q6K => (2, 1),
            _ if five_bits(T) => (1, 2),
            _ => (1, 4),
        };
        for s in 0..width / SUPER {
            let rec = w.as_ptr().add(s * rb);
            let (scales, hi) = (rec.add(scales_at(T)), rec.add(high_at(T) + 32 * half));
            let mut big = [_mm256_setzero_si256(); R];
            for j in 0..SUPER / GROUP {
                let g = s * (SUPER / GROUP) + j;
                let nib = rec.add(header_bytes(T) + j * 256 + 32 * half);
                let mut h = if five_bits(T) {
                    _mm256_loadu_si256(hi.add(j * 64).cast())
                } else {
                    _mm256_setzero_si256()
                };
                for sub in 0..subs {
                    let sc = bytes(scales.add(j * 32 + 16 * sub));
                    let mut sums = [_mm256_setzero_si256(); R];
                    if T == Q6K {
                        h = _mm256_loadu_si256(hi.add((2 * j + sub) * 64).cast());
                        for (i, si) in sums.iter_mut().enumerate() {
                            *si = _mm256_set1_epi32(*start.get_unchecked((2 * g + sub) * R + i));
                        }
                    }
                    let mut short = [_mm256_setzero_si256(); R];
                    for q in 0..4 / subs {
                        let p = sub * 4 / subs + q;
                        let v = _mm256_loadu_si256(nib.add(p * 64).cast());
                        let (w0, w1) = unpack!(ymm, T, v, h, v);
                        let at = g * GROUP + p * 8;
                        for (i, (si, sh)) in sums.iter_mut().zip(short.iter_mut()).enumerate() {
                            let x = |at: usize| {
                                _mm256_set1_epi32(
                                    xp.add(at * R + 4 * i).cast::<i32>().read_unaligned(),
                                )
                            };
                            let two = _mm256_add_epi16(
                                _mm256_maddubs_epi16(w0, x(at)),
                                _mm256_maddubs_epi16(w1, x(at + 4)),
                            );
                            *sh = _mm256_add_epi16(*sh, two);
                            if (q + 1) % span == 0 {
                                *si = _mm256_add_epi32(*si, _mm256_madd_epi16(*sh, ones));
                                *sh = _mm256_setzero_si256();
                            }
                        }
                    }
                    for (bi, si) in big.iter_mut().zip(&sums) {
                        *bi = _mm256_add_epi32(*bi, _mm256_mullo_epi32(*si, sc));
                    }
                }
            }
            let d = eight(rec.add(d_at(T, 0)), un0);
            let mut mn = [_mm256_setzero_si256(); 4];
            if has_min(T) {
                for (k, mk) in mn.iter_mut().enumerate() {
                    let (lo, hi) = (
                        bytes(scales.add(64 * k + 16)),
                        bytes(scales.add(64 * k + 48)),
                    );
                    *mk = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
                }
            }
            let dmin = eight(rec.add(min_at(T, 0)), un1);
            for (i, bi) in big.iter().enumerate() {
                let si = _mm256_set1_ps(*sx.get_unchecked(s * R + i));
                let o = out.add(i * BLOCK);
                let exact = _mm256_cvtepi32_ps(*bi);
                let mut t = _mm256_add_ps(
                    _mm256_loadu_ps(o),
                    _mm256_mul_ps(exact, _mm256_mul_ps(d, si)),
                );
                if has_min(T) {
                    let mut mi = _mm256_setzero_si256();
                    for (k, mk) in mn.iter().enumerate() {
                        let sums = _mm256_set1_epi32(*pairs.get_unchecked((4 * s + k) * R + i));
                        mi = _mm256_add_epi32(mi, _mm256_madd_epi16(*mk, sums));
                    }
                    let exact = _mm256_cvtepi32_ps(mi);
                    t = _mm256_sub_ps(t, _mm256_mul_ps(exact, _mm256_mul_ps(dmin, si)));
                }
                _mm256_storeu_ps(o, t);
            }
        }
    }

    /// One super-block of 256 values quantized as [`crate::int8::quantize`] does (the same
    /// operations lane by lane: amax / 127, clamp, round half to even), with Σ q per 16.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn quantize_super(x: &[f32], q: &mut [i8], sums16: &mut [i32]) -> f32 {
        assert!(x.len() == SUPER && q.len() == SUPER && sums16.len() == SUPER / 16);
        let (p, out) = (x.as_ptr(), q.as_mut_ptr());
        let mut m = _mm512_setzero_ps();
        for c in 0..SUPER / 16 {
            m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(p.add(16 * c))));
        }
        let amax = _mm512_reduce_max_ps(m);
        if amax == 0.0 {
            q.fill(0);
            sums16.fill(0);
            return 0.0;
        }
        let scale = amax / 127.0;
        let (s, hi, lo) = (
            _mm512_set1_ps(scale),
            _mm512_set1_ps(127.0),
            _mm512_set1_ps(-127.0),
        );
        for (c, sum) in sums16.iter_mut().enumerate() {
            let v = _mm512_div_ps(_mm512_loadu_ps(p.add(16 * c)), s);
            let v = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, hi), lo));
            _mm_storeu_si128(out.add(16 * c).cast(), _mm512_cvtepi32_epi8(v));
            *sum = _mm512_reduce_add_epi32(v);
        }
        scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int8::tests::{kernels, lcg};

    /// Random but valid raw blocks of `t` for a (rows, cols) tensor: random bytes, with every
    /// f16 scale set to a finite value of about 1e-3 to 1e-2 (signed for d).
    pub(crate) fn random_blocks(t: BlockType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let n = rows * cols / t.block_values();
        let bb = t.block_bytes();
        let noise = lcg(seed, n * bb);
        let mut raw: Vec<u8> = noise.iter().map(|v| ((v + 0.5) * 256.0) as u8).collect();
        let scales = lcg(seed + 1, 2 * n);
        for (i, b) in raw.chunks_exact_mut(bb).enumerate() {
            let d = f16::from_f32(0.001 + scales[2 * i] * 0.01);
            let dmin = f16::from_f32(0.001 + scales[2 * i + 1].abs() * 0.01);
            match t {
                BlockType::Q6K => b[208..210].copy_from_slice(&d.to_le_bytes()),
                BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => {
                    b[..2].copy_from_slice(&d.to_le_bytes());
                }
                _ => {
                    b[..2].copy_from_slice(&f16::from_f32(d.to_f32().abs()).to_le_bytes());
                    b[2..4].copy_from_slice(&dmin.to_le_bytes());
                }
            }
        }
        raw
    }

    /// The blocks with every f16 scale divided by 2^12: about 2.4e-7 to 2.7e-6, f16 subnormals.
    fn tiny(t: BlockType, mut raw: Vec<u8>) -> Vec<u8> {
        let fields: &[usize] = match t {
            BlockType::Q6K => &[208],
            BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => &[0],
            _ => &[0, 2],
        };
        for b in raw.chunks_exact_mut(t.block_bytes()) {
            for &at in fields {
                let v = half_at(b, at).to_f32() / 4096.0;
                b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        raw
    }

    #[test]
    fn headers_hold_no_subnormal_scales() {
        for t in BlockType::ALL {
            let raw = tiny(t, random_blocks(t, 16, 256, 8));
            let m = matrix(&[(t, raw.clone(), 16)], 256);
            let p = &m.parts[0];
            assert!(p.unscale[0] < 1.0 / 4096.0, "{t:?}: no shift");
            for h in p.packed[..HEADER].chunks(2) {
                let v = f16::from_le_bytes([h[0], h[1]]);
                assert!(v == f16::ZERO || v.is_normal(), "{t:?}: {v} in a header");
            }
            let un = unpack(t, &raw, 16, 256);
            assert!(
                un.d.iter().any(|v| *v != f16::ZERO && !v.is_normal()),
                "{t:?}: the control has none"
            );
        }
    }

    /// The product from the decoded values, each sub-block's integer sum in i64, then the
    /// documented f32 order: independent of the packing. The small types take activations
    /// quantized per group of 32, the K types per super-block of 256.
    fn reference(
        parts: &[(BlockType, Vec<u8>, usize)],
        cols: usize,
        x: &[f32],
        n: usize,
    ) -> Vec<f32> {
        let rows: usize = parts.iter().map(|p| p.2).sum();
        let mut out = vec![0.0; n * rows];
        let quantized = |row: &[f32], per: usize| {
            let mut xq = vec![0i8; cols];
            let scales: Vec<f32> = (0..cols / per)
                .map(|g| {
                    crate::int8::quantize(
                        &row[g * per..(g + 1) * per],
                        &mut xq[g * per..(g + 1) * per],
                    )
                })
                .collect();
            (xq, scales)
        };
        for r in 0..n {
            let row = &x[r * cols..(r + 1) * cols];
            let bad = row.iter().any(|v| !v.is_finite());
            let mut o0 = 0;
            for (t, raw, prow) in parts {
                let k_type = !small(t.id());
                let (xq, scales) = quantized(row, if k_type { SUPER } else { GROUP });
                let un = unpack(*t, raw, *prow, cols);
                let per_row = cols / t.block_values();
                let subs = subs_per_block(*t);
                let sub_len = t.block_values() / subs;
                for o in 0..*prow {
                    // (Σ u · xq, Σ xq) over features lo..hi
                    let sum = |lo: usize, hi: usize| -> (i64, i64) {
                        (lo..hi).fold((0, 0), |(a, b), k| {
                            let xv = i64::from(xq[k]);
                            (a + xv * i64::from(un.u[o * cols + k]), b + xv)
                        })
                    };
                    let mut total = 0.0f32;
                    for (c, &sx) in scales.iter().enumerate() {
                        // each scale's features are one ggml block (K types) or one group
                        let blk = o * per_row + c;
                        let d = un.d[blk].to_f32();
                        if k_type {
                            let (mut big_s, mut big_m) = (0i64, 0i64);
                            for sub in 0..subs {
                                let lo = c * SUPER + sub * sub_len;
                                let (s, xs) = sum(lo, lo + sub_len);
                                let at = o * per_row * subs + lo / sub_len;
                                if *t == BlockType::Q6K {
                                    big_s += i64::from(un.sc[at]) * (s - 32 * xs);
                                } else {
                                    big_s += i64::from(un.sc[at]) * s;
                                    big_m += i64::from(un.mn[at]) * xs;
                                }
                            }
                            total += (big_s as f32) * (d * sx);
                            if has_min(t.id()) {
                                total -= (big_m as f32) * (un.dmin[blk].to_f32() * sx);
                            }
                            continue;
                        }
                        let (s, xs) = sum(c * GROUP, (c + 1) * GROUP);
                        if has_min(t.id()) {
                            total += (s as f32) * (d * sx);
                            total += un.dmin[blk].to_f32() * (sx * xs as f32);
                        } else {
                            let off = i64::from(offset(t.id()));
                            total += ((s - off * xs) as f32) * (d * sx);
                        }
                    }
                    out[r * rows + o0 + o] = if bad { f32::NAN } else { total };
                }
                o0 += prow;
            }
        }
        out
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    fn matrix(parts: &[(BlockType, Vec<u8>, usize)], cols: usize) -> GgufMatrix {
        let views: Vec<_> = parts
            .iter()
            .map(|(t, raw, rows)| (*t, &raw[..], *rows))
            .collect();
        GgufMatrix::from_blocks(&views, cols).unwrap()
    }

    type Parts = Vec<(BlockType, Vec<u8>, usize)>;

    fn cases() -> Vec<(Parts, usize)> {
        use BlockType::{Q4K, Q4_0, Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0};
        let mut out = vec![];
        for (i, t) in BlockType::ALL.into_iter().enumerate() {
            for &(rows, cols) in &[(16, 256), (5, 512), (33, 768)] {
                let seed = (i * 100 + rows) as u64;
                out.push((vec![(t, random_blocks(t, rows, cols, seed), rows)], cols));
            }
        }
        for t in [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1] {
            out.push((vec![(t, random_blocks(t, 7, 64, 3), 7)], 64));
            // a width of 3 groups: the last record half empty
            out.push((vec![(t, random_blocks(t, 17, 96, 4), 17)], 96));
        }
        // Gemma 3's and Qwen2.5 0.5B's Q4_K_M mixes: q/k/v of Q5_0 and Q8_0, every small type
        out.push((
            vec![
                (Q5_0, random_blocks(Q5_0, 32, 640, 41), 32),
                (Q8_0, random_blocks(Q8_0, 16, 640, 42), 16),
                (Q5_0, random_blocks(Q5_0, 3, 640, 43), 3),
            ],
            640,
        ));
        out.push((
            vec![
                (Q4_0, random_blocks(Q4_0, 16, 768, 51), 16),
                (Q4_1, random_blocks(Q4_1, 16, 768, 52), 16),
                (Q5_1, random_blocks(Q5_1, 32, 768, 53), 32),
                (Q4K, random_blocks(Q4K, 16, 768, 54), 16),
                (Q5_0, random_blocks(Q5_0, 5, 768, 55), 5),
            ],
            768,
        ));
        // scales among f16's subnormals, as most of a real Q6_K tensor's are
        for t in BlockType::ALL {
            out.push((vec![(t, tiny(t, random_blocks(t, 16, 256, 31)), 16)], 256));
        }
        // a fused q/k/v of a Q4_K_M file, and every type in one stack
        let cols = 512;
        out.push((
            vec![
                (Q4K, random_blocks(Q4K, 64, cols, 11), 64),
                (Q4K, random_blocks(Q4K, 16, cols, 12), 16),
                (Q6K, random_blocks(Q6K, 16, cols, 13), 16),
            ],
            cols,
        ));
        out.push((
            vec![
                (Q6K, random_blocks(Q6K, 32, cols, 21), 32),
                (Q5K, random_blocks(Q5K, 16, cols, 22), 16),
                (Q8_0, random_blocks(Q8_0, 48, cols, 23), 48),
                (Q4K, random_blocks(Q4K, 9, cols, 24), 9),
            ],
            cols,
        ));
        out
    }

    #[test]
    fn every_kernel_equals_the_reference_bit_for_bit() {
        for (parts, cols) in cases() {
            let m = matrix(&parts, cols);
            for n in [1, 2, 3, 4, 5, 9, 10, 11, 23, 40] {
                // 40 rows: the activations are quantized by both threads
                let mut x = lcg(7 + n as u64, n * cols);
                if n == 5 {
                    x[2 * cols + 3] = f32::NAN; // row 2 only is NaN
                }
                let want = reference(&parts, cols, &x, n);
                for k in kernels() {
                    let mut out = vec![0.0; n * m.rows()];
                    m.matmul(&x, &mut out, k).unwrap();
                    let types: Vec<_> = m.types().iter().map(|t| t.0.name()).collect();
                    assert!(
                        same_bits(&out, &want),
                        "{k:?} {types:?} x {n} rows, {cols} cols"
                    );
                }
            }
        }
    }

    #[test]
    fn the_reference_catches_a_wrong_start_or_scale() {
        // The negative controls: Q6_K without its -32 Σ xq, Q8_0 read as unsigned, Q4_K's minimum
        // with the wrong sign each differ from the kernels' output.
        let cols = 256;
        let x = lcg(5, 3 * cols);
        for t in BlockType::ALL {
            let raw = random_blocks(t, 16, cols, 77);
            let m = matrix(&[(t, raw.clone(), 16)], cols);
            let mut out = vec![0.0; 3 * 16];
            m.matmul(&x, &mut out, Kernel::best()).unwrap();
            // the same blocks read as another type of matrix: a different product
            let mut flipped = raw.clone();
            match t {
                BlockType::Q6K => flipped[192] ^= 0x80, // the first sub-block's scale's sign
                BlockType::Q8_0 => flipped[2] ^= 0x80,  // a value's sign bit
                // Q4_0: a value's low bit; Q5_0: a fifth bit
                BlockType::Q4_0 | BlockType::Q5_0 => flipped[2] ^= 0x01,
                BlockType::Q4_1 => flipped[3] ^= 0x80, // m's sign
                // K types: the first group's sc; Q5_1: a fifth bit
                _ => flipped[4] ^= 1,
            }
            let wrong = reference(&[(t, flipped, 16)], cols, &x, 3);
            assert!(
                !same_bits(&out, &wrong),
                "{t:?}: a changed block went unnoticed"
            );
        }
    }

    #[test]
    fn extreme_values_do_not_overflow_any_kernel() {
        // Every value at its largest (and Q8_0 at -128 too) against activations all at ±127:
        // the sums the AVX2 kernels keep in i16 are at their bounds here.
        let cols = 512;
        for t in BlockType::ALL {
            for fill in [0xFFu8, 0x80, 0x7F] {
                let mut raw = random_blocks(t, 16, cols, 5);
                let bb = t.block_bytes();
                for b in raw.chunks_exact_mut(bb) {
                    let (lo, hi) = match t {
                        BlockType::Q6K => (0, 192), // values; the scales stay random
                        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => (2, bb),
                        BlockType::Q4_1 | BlockType::Q5_1 => (4, bb),
                        BlockType::Q4K | BlockType::Q5K => (16, bb),
                    };
                    b[lo..hi].fill(fill);
                    if t == BlockType::Q6K {
                        b[192..208].fill(0x7F); // sc = 127
                    }
                }
                let parts = vec![(t, raw, 16)];
                let m = matrix(&parts, cols);
                let mut x = vec![1.0f32; cols];
                x.extend(std::iter::repeat_n(-1.0f32, cols));
                let want = reference(&parts, cols, &x, 2);
                for k in kernels() {
                    let mut out = vec![0.0; 2 * 16];
                    m.matmul(&x, &mut out, k).unwrap();
                    assert!(same_bits(&out, &want), "{k:?} {t:?} filled with {fill:#x}");
                }
            }
        }
    }

    #[test]
    fn rows_of_a_pass_are_independent() {
        let (parts, cols) = cases().pop().unwrap();
        let m = matrix(&parts, cols);
        let n = 9;
        let x = lcg(3, n * cols);
        for k in kernels() {
            let mut all = vec![0.0; n * m.rows()];
            m.matmul(&x, &mut all, k).unwrap();
            for r in 0..n {
                let mut one = vec![0.0; m.rows()];
                m.matmul(&x[r * cols..(r + 1) * cols], &mut one, k).unwrap();
                assert!(
                    same_bits(&one, &all[r * m.rows()..(r + 1) * m.rows()]),
                    "{k:?} row {r}"
                );
            }
        }
    }

    #[test]
    fn dequantize_follows_the_decoded_blocks() {
        for (parts, cols) in cases() {
            let m = matrix(&parts, cols);
            let w = m.dequantize();
            let mut o0 = 0;
            for (t, raw, rows) in &parts {
                let un = unpack(*t, raw, *rows, cols);
                let per_row = cols / t.block_values();
                let subs = subs_per_block(*t);
                let sub_len = t.block_values() / subs;
                for o in 0..*rows {
                    for k in 0..cols {
                        let blk = o * per_row + k / t.block_values();
                        let at = o * per_row * subs + k / sub_len;
                        let (d, u) = (un.d[blk].to_f32(), f32::from(un.u[o * cols + k]));
                        let want = match t {
                            BlockType::Q4K | BlockType::Q5K => {
                                (d * f32::from(un.sc[at])) * u
                                    - un.dmin[blk].to_f32() * f32::from(un.mn[at])
                            }
                            BlockType::Q6K => (d * f32::from(un.sc[at])) * (u - 32.0),
                            BlockType::Q4_1 | BlockType::Q5_1 => d * u + un.dmin[blk].to_f32(),
                            _ => d * (u - offset(t.id()) as f32),
                        };
                        assert_eq!(
                            w[(o0 + o) * cols + k].to_bits(),
                            want.to_bits(),
                            "{t:?} ({o}, {k})"
                        );
                    }
                }
                o0 += rows;
            }
        }
    }

    #[test]
    fn q8_0_values_are_the_signed_bytes() {
        // A Q8_0 block of known values: d = 0.5, q = -128..-96.
        let mut b = vec![0u8; 34 * 2];
        for blk in b.chunks_exact_mut(34) {
            blk[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
            for (i, v) in blk[2..].iter_mut().enumerate() {
                *v = (i as u8).wrapping_add(0x80); // q = -128 + i
            }
        }
        let m = GgufMatrix::from_blocks(&[(BlockType::Q8_0, &b, 1)], 64).unwrap();
        let w = m.dequantize();
        assert_eq!(w[0].to_bits(), (-64.0f32).to_bits());
        assert_eq!(w[31].to_bits(), (0.5f32 * -97.0).to_bits());
        assert_eq!(w[32].to_bits(), (-64.0f32).to_bits());
    }

    #[test]
    fn bad_parts_are_refused() {
        let q4k = random_blocks(BlockType::Q4K, 16, 256, 1);
        let err = |parts: &[(BlockType, &[u8], usize)], cols| {
            GgufMatrix::from_blocks(parts, cols)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(err(&[(BlockType::Q4K, &q4k[1..], 16)], 256).contains("bytes"));
        assert!(err(&[(BlockType::Q4K, &q4k, 16)], 128).contains("multiple of 256"));
        let q8 = random_blocks(BlockType::Q8_0, 1, 32, 3);
        assert!(err(&[(BlockType::Q8_0, &q8, 1)], 48).contains("multiple of 32"));
        let five = random_blocks(BlockType::Q4K, 5, 256, 2);
        assert!(err(
            &[(BlockType::Q4K, &five, 5), (BlockType::Q4K, &q4k, 16)],
            256
        )
        .contains("multiple of 16 rows"));
        assert!(err(&[], 256).contains("at least one part"));
        assert!(BlockType::from_name("Q3_K")
            .unwrap_err()
            .to_string()
            .contains("Q4_K"));
        let mut nan = q4k.clone();
        nan[..2].copy_from_slice(&f16::NAN.to_le_bytes());
        assert!(err(&[(BlockType::Q4K, &nan, 16)], 256).contains("finite"));
        let m = GgufMatrix::from_blocks(&[(BlockType::Q4K, &q4k, 16)], 256).unwrap();
        let mut out = vec![0.0; 16];
        assert!(m.matmul(&[0.0; 255], &mut out, Kernel::Scalar).is_err());
    }

    #[test]
    fn bytes_read_are_the_files_plus_the_padded_headers() {
        // bits a weight, in 1/1000ths
        for (t, bits) in [
            (BlockType::Q4K, 4625),
            (BlockType::Q5K, 5625),
            (BlockType::Q6K, 6625),
            (BlockType::Q8_0, 8500),
            (BlockType::Q4_0, 4500),
            (BlockType::Q4_1, 5000),
            (BlockType::Q5_0, 5500),
            (BlockType::Q5_1, 6000),
        ] {
            let (rows, cols) = (32, 512);
            let m = matrix(&[(t, random_blocks(t, rows, cols, 1), rows)], cols);
            assert_eq!(m.nbytes() * 8000 / (rows * cols), bits, "{t:?}");
        }
    }
}

/// The machine's vpdpbusd rate, the floor of a many-row pass:
/// `cargo test --release vpdpbusd_rate -- --ignored --nocapture` (one core).
#[cfg(all(test, target_arch = "x86_64"))]
mod rate {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn chains(n: usize) -> i32 {
        // 12 independent accumulators: more than the instruction's latency times its rate
        let (w, x) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..n {
            for a in &mut acc {
                *a = _mm512_dpbusd_epi32(*a, w, x);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_epi32(a)).sum()
    }

    /// vpdpbusd zmm a second on this core.
    fn peak() -> f64 {
        let n = 20_000_000;
        let start = std::time::Instant::now();
        // SAFETY: callers check the CPU has AVX-512 VNNI.
        let sum = unsafe { chains(n) };
        std::hint::black_box(sum);
        (12 * n) as f64 / start.elapsed().as_secs_f64()
    }

    #[test]
    #[ignore = "a measurement, not a check"]
    fn vpdpbusd_rate() {
        if !crate::int8::Kernel::Avx512Vnni.supported() {
            return;
        }
        println!("vpdpbusd zmm: {:.2} G/s on one core", peak() / 1e9);
    }

    /// The AVX-512 kernels' products a second on one core, weights in L2 (so the kernel's own
    /// work, not memory), as a share of vpdpbusd's rate measured beside them (64 products an
    /// instruction): `cargo test --release kernels_share -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn kernels_share_of_the_vpdpbusd_rate() {
        use super::{Activations, BlockType, GgufMatrix, SuperActs, Woven, BLOCK, VNNI_ROWS};
        use crate::int8::Kernel;
        if !Kernel::Avx512Vnni.supported() {
            return;
        }
        let (rows, cols) = (256, 1536);
        for t in [
            BlockType::Q4K,
            BlockType::Q5K,
            BlockType::Q6K,
            BlockType::Q8_0,
            BlockType::Q5_0,
        ] {
            let raw = super::tests::random_blocks(t, rows, cols, 7);
            let m = GgufMatrix::from_blocks(&[(t, &raw, rows)], cols).unwrap();
            let p = &m.parts[0];
            for n in [1, 9] {
                let x = crate::int8::tests::lcg(3, n * cols);
                let woven = if super::small(t.id()) {
                    Woven::new(
                        &Activations::quantize(&x, n, cols, cols),
                        n,
                        cols,
                        &m.parts,
                        VNNI_ROWS,
                    )
                } else {
                    Woven::new_k(
                        &SuperActs::quantize(&x, n, cols, cols),
                        n,
                        cols,
                        &m.parts,
                        VNNI_ROWS,
                    )
                };
                let mut acc = [0.0f32; VNNI_ROWS * BLOCK];
                let mut best = f64::INFINITY;
                let mut rate = 0.0f64;
                for _ in 0..7 {
                    rate = rate.max(peak());
                    let start = std::time::Instant::now();
                    for _ in 0..50 {
                        for b in 0..p.blocks() {
                            m.dot_block(Kernel::Avx512Vnni, p, b, &woven, 0, n, &mut acc);
                        }
                    }
                    best = best.min(start.elapsed().as_secs_f64() / 50.0);
                    std::hint::black_box(&acc);
                }
                let products = (rows * cols * n) as f64 / best;
                println!(
                    "{t:?} {n} rows: {:.1} G products/s, {:.0} % of vpdpbusd's {:.2} G/s",
                    products / 1e9,
                    100.0 * products / 64.0 / rate,
                    rate / 1e9
                );
            }
        }
    }
}
