//! A persistent corpus: the drafter's configuration and corpus documents in a versioned,
//! checksummed binary file. The live sequence is not saved: a corpus is the earlier documents.
//!
//! Format version 1, all integers little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `\x89SFNGRM\n` (the high byte and newline catch 7-bit and newline-mangling copies) |
//! | 4 | format version (u32) |
//! | 1 | policy: 0 earliest, 1 recent, 2 frequent |
//! | 8 | min_match (u64) |
//! | 8 | k_factor (f64) |
//! | 8 | k_offset (f64) |
//! | 8 | max_corpus_tokens (u64) |
//! | 4 + n | tokenizer fingerprint: length (u32, at most 64 KiB), then UTF-8 |
//! | 8 | number of documents (u64) |
//! | 4 each | length of each document (u32, at least 1) |
//! | 4 each | the tokens of every document, in order (u32) |
//! | 4 | CRC-32 (IEEE) of every byte before it |
//!
//! Loading checks the magic and the version first (a newer version may lay out the rest
//! differently), then the checksum, then every field; each length is checked against the bytes
//! actually remaining before anything is allocated for it, so a damaged or hostile file costs no
//! more memory than its own size. Loading re-indexes the documents once, in time linear in their
//! size, under the memory rule of [`Drafter::add_document`].

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::automaton::MAX_TOKENS;
use crate::drafter::{Config, Drafter, Policy};
use crate::error::{Error, Result};

/// The first bytes of a saved corpus file.
pub const MAGIC: [u8; 8] = *b"\x89SFNGRM\n";
/// The format version this code writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
/// The longest tokenizer fingerprint, in bytes.
pub const MAX_FINGERPRINT: usize = 1 << 16;

/// Magic and version: what is read before the rest of the file.
const PREAMBLE: usize = MAGIC.len() + 4;
const CONFIG_BYTES: usize = 1 + 8 + 8 + 8 + 8;
/// Larger than any file this code writes (every document holds at least one token, and at most
/// `MAX_TOKENS` tokens are kept), so reading stops early on a file that cannot be a corpus.
const MAX_FILE_BYTES: u64 =
    (PREAMBLE + CONFIG_BYTES + 4 + MAX_FINGERPRINT + 8 + 8 * MAX_TOKENS + 4) as u64;

fn policy_code(p: Policy) -> u8 {
    match p {
        Policy::Earliest => 0,
        Policy::Recent => 1,
        Policy::Frequent => 2,
    }
}

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::value(format!("malformed corpus file: {what}"))
}

/// Writes through to `inner` and keeps a CRC-32 of everything written.
struct Checksummed<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Checksummed<W> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.crc.update(bytes);
        self.inner.write_all(bytes)?;
        Ok(())
    }
}

/// Reads fields from the body of a file whose size is known, checking every length first.
struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(malformed(format!(
                "{what} needs {n} bytes at offset {}, but only {} remain (truncated?)",
                self.pos,
                self.remaining()
            )));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn f64(&mut self, what: &str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }

    fn usize(&mut self, what: &str) -> Result<usize> {
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| malformed(format!("{what} {v} is too large")))
    }
}

/// Checks the magic bytes and the version: the part of the format every version keeps.
fn check_preamble(pre: &[u8]) -> Result<()> {
    if pre.len() < MAGIC.len() || pre[..MAGIC.len()] != MAGIC {
        if pre.len() < MAGIC.len() && MAGIC.starts_with(pre) {
            return Err(malformed(format!(
                "only {} bytes, truncated before the format version",
                pre.len()
            )));
        }
        return Err(Error::value(
            "not a specfast corpus file (its first bytes are not the corpus magic \
             \"\\x89SFNGRM\\n\"); a corpus file is written by NgramDrafter.save",
        ));
    }
    if pre.len() < PREAMBLE {
        return Err(malformed(format!(
            "only {} bytes, truncated before the format version",
            pre.len()
        )));
    }
    let version = u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]);
    if version > FORMAT_VERSION {
        return Err(Error::value(format!(
            "corpus format version {version} was written by a newer specfast; this one reads \
             versions up to {FORMAT_VERSION}: upgrade specfast to load it"
        )));
    }
    if version == 0 {
        return Err(malformed("format version 0 does not exist"));
    }
    Ok(())
}

/// Parses a whole file (preamble included) into a drafter.
fn parse(bytes: &[u8], expected_fingerprint: Option<&str>) -> Result<Drafter> {
    check_preamble(bytes)?;
    if bytes.len() < PREAMBLE + 4 {
        return Err(malformed(format!(
            "only {} bytes, truncated before the checksum",
            bytes.len()
        )));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([sum[0], sum[1], sum[2], sum[3]]);
    let actual = crc32fast::hash(body);
    if stored != actual {
        return Err(Error::value(format!(
            "corpus file is damaged: checksum {actual:#010x} does not match the stored \
             {stored:#010x} (truncated or corrupted)"
        )));
    }
    let mut f = Fields {
        buf: body,
        pos: PREAMBLE,
    };
    let config = parse_config(&mut f)?;
    let fp_len = f.u32("fingerprint length")? as usize;
    if fp_len > MAX_FINGERPRINT {
        return Err(malformed(format!(
            "fingerprint length {fp_len} exceeds {MAX_FINGERPRINT}"
        )));
    }
    let fingerprint = std::str::from_utf8(f.take(fp_len, "fingerprint")?)
        .map_err(|_| malformed("the fingerprint is not UTF-8"))?;
    if let Some(expected) = expected_fingerprint {
        if expected != fingerprint {
            return Err(Error::value(format!(
                "the corpus was built with another tokenizer: its fingerprint is \
                 {fingerprint:?}, the expected one is {expected:?}"
            )));
        }
    }
    parse_documents(f, config)
}

fn parse_config(f: &mut Fields<'_>) -> Result<Config> {
    let policy = match f.u8("policy")? {
        0 => Policy::Earliest,
        1 => Policy::Recent,
        2 => Policy::Frequent,
        other => return Err(malformed(format!("unknown policy code {other}"))),
    };
    let config = Config {
        policy,
        min_match: f.usize("min_match")?,
        k_factor: f.f64("k_factor")?,
        k_offset: f.f64("k_offset")?,
        max_corpus_tokens: f.usize("max_corpus_tokens")?,
    };
    config.validate().map_err(malformed)?;
    Ok(config)
}

/// The document lengths and tokens, which must fill the rest of the body exactly.
fn parse_documents(mut f: Fields<'_>, config: Config) -> Result<Drafter> {
    let n_docs = f.usize("document count")?;
    if n_docs > f.remaining() / 4 {
        return Err(malformed(format!(
            "{n_docs} documents cannot fit in the {} bytes that remain",
            f.remaining()
        )));
    }
    let mut lengths = Vec::with_capacity(n_docs);
    let mut total = 0usize;
    for (i, raw) in f
        .take(4 * n_docs, "document lengths")?
        .chunks_exact(4)
        .enumerate()
    {
        let n = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]) as usize;
        if n == 0 {
            return Err(malformed(format!("document {i} is empty")));
        }
        lengths.push(n);
        total += n; // at most n_docs * 2^32: no overflow on 64-bit, where n_docs < 2^62
    }
    if total > config.max_corpus_tokens {
        return Err(malformed(format!(
            "{total} corpus tokens exceed the file's own max_corpus_tokens ({})",
            config.max_corpus_tokens
        )));
    }
    if total.checked_mul(4) != Some(f.remaining()) {
        return Err(malformed(format!(
            "the documents hold {total} tokens ({} bytes), but {} bytes remain",
            total.saturating_mul(4),
            f.remaining()
        )));
    }
    let tokens: Vec<u32> = f
        .take(4 * total, "tokens")?
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let docs = lengths.iter().scan(0usize, |at, &n| {
        *at += n;
        Some(&tokens[*at - n..*at])
    });
    Drafter::from_documents(config, docs)
}

/// Names `path` in an error that does not name a file yet; with `value`, in format errors too.
fn naming(err: Error, path: &Path, value: bool) -> Error {
    match err {
        Error::Value(m) if value => Error::Value(format!("{}: {m}", path.display())),
        Error::Io {
            errno,
            message,
            path: None,
        } => Error::Io {
            errno,
            message,
            path: Some(path.to_path_buf()),
        },
        err @ (Error::Value(_) | Error::Io { .. }) => err,
    }
}

/// A name for the temporary file next to `path` that no other writer uses at the same time.
fn temp_path(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        Error::value(format!(
            "cannot save the corpus to {}: the path names no file",
            path.display()
        ))
    })?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".{}.{nanos}.tmp", std::process::id()));
    Ok(path.with_file_name(tmp))
}

impl Drafter {
    /// Writes the configuration, `fingerprint` (the caller's name for its tokenizer, such as its
    /// vocabulary size and a hash of the vocabulary) and the corpus documents to `w`.
    pub fn save_to(&self, w: impl Write, fingerprint: &str) -> Result<()> {
        if fingerprint.len() > MAX_FINGERPRINT {
            return Err(Error::value(format!(
                "fingerprint must be at most {MAX_FINGERPRINT} bytes of UTF-8, got {}",
                fingerprint.len()
            )));
        }
        let c = self.config();
        let mut out = Checksummed {
            inner: w,
            crc: crc32fast::Hasher::new(),
        };
        out.put(&MAGIC)?;
        out.put(&FORMAT_VERSION.to_le_bytes())?;
        out.put(&[policy_code(c.policy)])?;
        out.put(&(c.min_match as u64).to_le_bytes())?;
        out.put(&c.k_factor.to_le_bytes())?;
        out.put(&c.k_offset.to_le_bytes())?;
        out.put(&(c.max_corpus_tokens as u64).to_le_bytes())?;
        out.put(&(fingerprint.len() as u32).to_le_bytes())?;
        out.put(fingerprint.as_bytes())?;
        out.put(&(self.corpus_documents() as u64).to_le_bytes())?;
        let mut chunk = Vec::with_capacity(1 << 16);
        for doc in self.documents() {
            chunk.extend_from_slice(&(doc.len() as u32).to_le_bytes());
        }
        out.put(&chunk)?;
        for doc in self.documents() {
            for part in doc.chunks(1 << 14) {
                chunk.clear();
                for &t in part {
                    chunk.extend_from_slice(&t.to_le_bytes());
                }
                out.put(&chunk)?;
            }
        }
        let sum = out.crc.clone().finalize();
        out.inner.write_all(&sum.to_le_bytes())?;
        Ok(())
    }

    /// Reads a drafter written by [`save_to`](Self::save_to), with an empty live sequence. With
    /// `expected_fingerprint`, a file whose fingerprint differs is refused.
    pub fn load_from(mut r: impl Read, expected_fingerprint: Option<&str>) -> Result<Drafter> {
        // The preamble first, so that a file that is not a corpus is not read whole.
        let mut bytes = Vec::with_capacity(PREAMBLE);
        (&mut r).take(PREAMBLE as u64).read_to_end(&mut bytes)?;
        check_preamble(&bytes)?;
        r.take(MAX_FILE_BYTES + 1 - PREAMBLE as u64)
            .read_to_end(&mut bytes)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(malformed(format!(
                "larger than any corpus ({MAX_FILE_BYTES} bytes)"
            )));
        }
        parse(&bytes, expected_fingerprint)
    }

    /// Saves to `path` atomically: a temporary file in the same directory is written, flushed
    /// and synced, then renamed over `path`, so a crash mid-save leaves the previous file whole.
    pub fn save_file(&self, path: &Path, fingerprint: &str) -> Result<()> {
        let tmp = temp_path(path)?;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(&e, Some(path)))?;
        if let Ok(meta) = fs::metadata(path) {
            // Keep the permissions of the file being replaced (best effort).
            let _ = file.set_permissions(meta.permissions());
        }
        let written = (|| {
            let mut w = BufWriter::with_capacity(1 << 20, file);
            self.save_to(&mut w, fingerprint)?;
            let file = w
                .into_inner()
                .map_err(|e| Error::io(e.error(), Some(path)))?;
            file.sync_all().map_err(|e| Error::io(&e, Some(path)))?;
            fs::rename(&tmp, path).map_err(|e| Error::io(&e, Some(path)))
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(naming(e, path, false));
        }
        // Make the rename itself durable (best effort: not every file system syncs directories).
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Loads a drafter saved by [`save_file`](Self::save_file). Format errors name the file.
    pub fn load_file(path: &Path, expected_fingerprint: Option<&str>) -> Result<Drafter> {
        let file = File::open(path).map_err(|e| Error::io(&e, Some(path)))?;
        Drafter::load_from(file, expected_fingerprint).map_err(|e| naming(e, path, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn drafter(policy: Policy, cap: usize, docs: &[Vec<u32>]) -> Drafter {
        let mut d = Drafter::new(Config {
            policy,
            min_match: 2,
            k_factor: 1.5,
            k_offset: 1.0,
            max_corpus_tokens: cap,
        })
        .unwrap();
        for doc in docs {
            d.add_document(doc).unwrap();
        }
        d
    }

    fn saved(d: &Drafter, fingerprint: &str) -> Vec<u8> {
        let mut out = Vec::new();
        d.save_to(&mut out, fingerprint).unwrap();
        out
    }

    fn small_file() -> Vec<u8> {
        let d = drafter(
            Policy::Recent,
            100,
            &[vec![1, 2, 3, 4], vec![5, 6, 7], vec![u32::MAX, 0, 9]],
        );
        saved(&d, "v3:abc")
    }

    /// Rewrites the checksum, so a test can reach the field checks behind it.
    fn resum(bytes: &mut [u8]) {
        let n = bytes.len();
        let sum = crc32fast::hash(&bytes[..n - 4]);
        bytes[n - 4..].copy_from_slice(&sum.to_le_bytes());
    }

    fn load(bytes: &[u8]) -> Result<Drafter> {
        Drafter::load_from(bytes, None)
    }

    fn message(r: Result<Drafter>) -> String {
        match r {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn round_trip_keeps_config_documents_and_proposals() {
        let docs = vec![vec![1, 2, 3, 4, 5], vec![2, 3, 9, 9], vec![7]];
        let d = drafter(Policy::Frequent, 1000, &docs);
        let bytes = saved(&d, "fp");
        let e = Drafter::load_from(bytes.as_slice(), Some("fp")).unwrap();
        assert_eq!(e.config(), d.config());
        assert_eq!(
            e.documents().collect::<Vec<_>>(),
            d.documents().collect::<Vec<_>>()
        );
        assert_eq!(e.len(), 0);
        let mut a = d.clone();
        let mut b = e;
        for t in [2, 3, 4, 9, 2, 3] {
            a.extend(&[t]).unwrap();
            b.extend(&[t]).unwrap();
            assert_eq!(a.propose(8).unwrap(), b.propose(8).unwrap());
        }
        // Saving again gives the same bytes.
        assert_eq!(
            saved(&Drafter::load_from(bytes.as_slice(), None).unwrap(), "fp"),
            bytes
        );
    }

    #[test]
    fn live_sequence_is_not_saved() {
        let mut d = drafter(Policy::Earliest, 100, &[vec![1, 2, 3]]);
        let before = saved(&d, "");
        d.extend(&[5, 6, 7, 5, 6]).unwrap();
        assert_eq!(saved(&d, ""), before);
    }

    #[test]
    fn empty_corpus_round_trips() {
        let d = drafter(Policy::Earliest, 8, &[]);
        let e = load(&saved(&d, "")).unwrap();
        assert_eq!(e.corpus_len(), 0);
        assert_eq!(e.corpus_documents(), 0);
    }

    #[test]
    fn fingerprint_mismatch_names_both() {
        let bytes = small_file();
        let m = message(Drafter::load_from(bytes.as_slice(), Some("v4:def")));
        assert!(m.contains("\"v3:abc\"") && m.contains("\"v4:def\""), "{m}");
        assert!(Drafter::load_from(bytes.as_slice(), Some("v3:abc")).is_ok());
        assert!(Drafter::load_from(bytes.as_slice(), None).is_ok());
        let d = drafter(Policy::Earliest, 8, &[]);
        let long = "x".repeat(MAX_FINGERPRINT + 1);
        assert!(d.save_to(Vec::new(), &long).is_err());
        assert!(d.save_to(Vec::new(), &long[1..]).is_ok());
    }

    #[test]
    fn newer_version_and_foreign_files_refused() {
        let mut bytes = small_file();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        let m = message(load(&bytes));
        assert!(m.contains("version 2") && m.contains("newer"), "{m}");
        // Even with the rest of the file unreadable: the version decides first.
        assert!(message(load(&bytes[..12])).contains("newer"));
        bytes[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(message(load(&bytes)).contains("version 0"));
        assert!(message(load(b"PK\x03\x04 a zip file")).contains("not a specfast corpus"));
        assert!(message(load(b"")).contains("truncated"));
        assert!(message(load(&MAGIC[..5])).contains("truncated"));
    }

    /// Every single-byte change and every truncation is refused: CRC-32 catches every error burst
    /// of at most 32 bits, and the structural checks catch every truncation on their own.
    #[test]
    fn every_flip_and_truncation_refused() {
        let bytes = small_file();
        assert!(load(&bytes).is_ok());
        for i in 0..bytes.len() {
            for mask in [0x01u8, 0x10, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= mask;
                assert!(load(&b).is_err(), "flip {mask:#x} at {i} loaded");
            }
            assert!(load(&bytes[..i]).is_err(), "truncation to {i} loaded");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(load(&longer).is_err());
    }

    #[test]
    fn absurd_fields_behind_a_valid_checksum_refused() {
        let base = small_file();
        // Offsets in the small file.
        let policy = PREAMBLE;
        let min_match = policy + 1;
        let k_factor = min_match + 8;
        let cap = k_factor + 16;
        let fp_len = cap + 8;
        let n_docs = fp_len + 4 + "v3:abc".len();
        let first_len = n_docs + 8;
        let cases: Vec<(usize, Vec<u8>, &str)> = vec![
            (policy, vec![7], "policy"),
            (min_match, 0u64.to_le_bytes().to_vec(), "min_match"),
            (k_factor, f64::NAN.to_le_bytes().to_vec(), "k_factor"),
            (cap, u64::MAX.to_le_bytes().to_vec(), "max_corpus_tokens"),
            (cap, 3u64.to_le_bytes().to_vec(), "exceed"),
            (
                fp_len,
                u32::MAX.to_le_bytes().to_vec(),
                "fingerprint length",
            ),
            (fp_len, 1000u32.to_le_bytes().to_vec(), "fingerprint needs"),
            (fp_len + 4, vec![0xff], "UTF-8"),
            (n_docs, u64::MAX.to_le_bytes().to_vec(), "cannot fit"),
            (n_docs, (1u64 << 40).to_le_bytes().to_vec(), "cannot fit"),
            (n_docs, 4u64.to_le_bytes().to_vec(), "bytes remain"),
            (first_len, 0u32.to_le_bytes().to_vec(), "empty"),
            (first_len, u32::MAX.to_le_bytes().to_vec(), "exceed"),
            (first_len, 5u32.to_le_bytes().to_vec(), "bytes remain"),
        ];
        for (at, patch, want) in cases {
            let mut b = base.clone();
            b[at..at + patch.len()].copy_from_slice(&patch);
            resum(&mut b);
            let m = message(load(&b));
            assert!(m.contains(want), "patch at {at}: {m:?} lacks {want:?}");
        }
    }

    #[test]
    fn files_on_disk() {
        let dir = std::env::temp_dir().join(format!("specfast-corpus-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.sfc");
        let d = drafter(Policy::Recent, 100, &[vec![1, 2, 3]]);
        d.save_file(&path, "fp").unwrap();
        let e = Drafter::load_file(&path, Some("fp")).unwrap();
        assert_eq!(e.corpus_len(), 3);
        // Overwriting leaves no temporary file behind.
        drafter(Policy::Recent, 100, &[vec![4, 5]])
            .save_file(&path, "fp")
            .unwrap();
        assert_eq!(Drafter::load_file(&path, None).unwrap().corpus_len(), 2);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        match Drafter::load_file(&dir.join("missing"), None) {
            Err(Error::Io {
                errno: Some(2),
                path: Some(p),
                ..
            }) => assert!(p.ends_with("missing")),
            other => panic!("{other:?}"),
        }
        fs::write(&path, b"garbage").unwrap();
        let m = message(Drafter::load_file(&path, None));
        assert!(
            m.contains("c.sfc") && m.contains("not a specfast corpus"),
            "{m}"
        );
        // Saving into a missing directory fails cleanly and creates nothing.
        assert!(matches!(
            d.save_file(&dir.join("no/such/dir/c.sfc"), ""),
            Err(Error::Io { .. })
        ));
        // A directory in the way: the rename fails, the temporary file is removed.
        let sub = dir.join("sub");
        fs::create_dir_all(&sub).unwrap();
        assert!(matches!(d.save_file(&sub, ""), Err(Error::Io { .. })));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 2);
        fs::remove_dir_all(&dir).unwrap();
    }

    // ---- property tests

    fn docs_strategy() -> impl Strategy<Value = Vec<Vec<u32>>> {
        prop::collection::vec(prop::collection::vec(0u32..5, 0..20), 0..8)
    }

    fn policy_strategy() -> impl Strategy<Value = Policy> {
        prop_oneof![
            Just(Policy::Earliest),
            Just(Policy::Recent),
            Just(Policy::Frequent)
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Proposals after save -> load equal the original's, at every step of a live sequence.
        #[test]
        fn proposals_survive_round_trip(
            policy in policy_strategy(),
            docs in docs_strategy(),
            live in prop::collection::vec(0u32..5, 0..30),
            cap in prop_oneof![Just(1usize << 22), Just(10), Just(25)],
            k in 0usize..10,
        ) {
            let d = drafter(policy, cap, &docs);
            let mut e = Drafter::load_from(saved(&d, "f").as_slice(), Some("f")).unwrap();
            let mut a = d.clone();
            prop_assert_eq!(e.documents().collect::<Vec<_>>(), d.documents().collect::<Vec<_>>());
            for &t in &live {
                a.extend(&[t]).unwrap();
                e.extend(&[t]).unwrap();
                prop_assert_eq!(a.propose(k).unwrap(), e.propose(k).unwrap());
            }
        }

        /// Building from documents at once keeps what adding them one by one keeps.
        #[test]
        fn from_documents_equals_adding(
            docs in docs_strategy(),
            cap in prop_oneof![Just(1usize << 22), Just(7), Just(16), Just(0)],
        ) {
            let d = drafter(Policy::Earliest, cap, &docs);
            let e = Drafter::from_documents(*d.config(), docs.iter().map(Vec::as_slice)).unwrap();
            prop_assert_eq!(e.documents().collect::<Vec<_>>(), d.documents().collect::<Vec<_>>());
        }

        /// Random damage, with the checksum rewritten to let it through, never panics.
        #[test]
        fn damage_behind_a_valid_checksum_never_panics(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let mut b = small_file();
            let body = b.len() - 4;
            for (i, v) in &edits {
                b[i.index(body)] = *v;
            }
            if truncate {
                let n = cut.index(body).max(PREAMBLE);
                b.truncate(n);
                b.extend_from_slice(&[0; 4]);
            }
            resum(&mut b);
            if let Ok(d) = load(&b) {
                prop_assert!(d.corpus_len() <= d.config().max_corpus_tokens);
                let _ = d.propose(4);
            }
        }
    }
}
