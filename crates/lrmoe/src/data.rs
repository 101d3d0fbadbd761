//! The training corpus: byte-level tokens, a held-out validation split,
//! seeded batches, and the unigram baseline.

use std::path::Path;

/// Errors of corpus handling.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The corpus file cannot be read.
    #[error("cannot read corpus {path}: {error}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error (shown in the message, not chained, so the CLI's
        /// one-line error does not repeat it).
        error: std::io::Error,
    },
    /// A setting does not fit the corpus (or any corpus).
    #[error("{0}")]
    Setting(String),
    /// The corpus is not usable text.
    #[error("corpus {path} looks corrupted: {reason}")]
    Corrupted {
        /// The path.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// A tokenised corpus. Tokens index `vocab` (the distinct bytes, sorted).
#[derive(Debug, Clone, PartialEq)]
pub struct Corpus {
    /// Byte of each token id.
    pub vocab: Vec<u8>,
    /// Training tokens.
    pub train: Vec<u32>,
    /// Validation tokens (the last `val_fraction` of the file).
    pub val: Vec<u32>,
}

/// Smallest corpus accepted, in bytes.
pub const MIN_CORPUS_BYTES: usize = 4096;

/// The default corpus, built into the binary so that `lrmoe train` runs
/// from any folder: Shakespeare's plays and poems (public domain; packaging
/// CC-BY 2.5 by the Open Knowledge Foundation, see `data/README.md`).
pub const SHAKESPEARE: &[u8] = include_bytes!("../data/shakespeare.txt");

/// The name [`load_corpus`] gives the built-in corpus in messages.
pub const SHAKESPEARE_NAME: &str = "the built-in Shakespeare corpus";

/// Loads the text corpus at `path` (`None`: the built-in [`SHAKESPEARE`])
/// and splits off the last `val_fraction` as validation.
pub fn load_corpus(path: Option<&Path>, val_fraction: f64) -> Result<Corpus, DataError> {
    match path {
        None => corpus_from_bytes(SHAKESPEARE, SHAKESPEARE_NAME, val_fraction),
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|error| DataError::Read {
                path: path.display().to_string(),
                error,
            })?;
            corpus_from_bytes(&bytes, &path.display().to_string(), val_fraction)
        }
    }
}

/// Tokenises `bytes` (named `name` in errors) and splits off the last
/// `val_fraction` as validation.
pub fn corpus_from_bytes(bytes: &[u8], name: &str, val_fraction: f64) -> Result<Corpus, DataError> {
    if !(val_fraction > 0.0 && val_fraction < 0.5) {
        return Err(DataError::Setting(format!(
            "data.val_fraction = {val_fraction} must be in (0, 0.5)"
        )));
    }
    let corrupted = |reason: String| DataError::Corrupted {
        path: name.to_string(),
        reason,
    };
    if bytes.len() < MIN_CORPUS_BYTES {
        return Err(corrupted(format!(
            "{} bytes, need at least {MIN_CORPUS_BYTES}",
            bytes.len()
        )));
    }
    if let Some(pos) = bytes.iter().position(|&b| b == 0) {
        return Err(corrupted(format!(
            "NUL byte at offset {pos} (binary data?)"
        )));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(corrupted(format!("not UTF-8 text ({e})")));
    }
    let mut present = [false; 256];
    bytes.iter().for_each(|&b| present[b as usize] = true);
    let vocab: Vec<u8> = (0..=255u8).filter(|&b| present[b as usize]).collect();
    let mut id = [0u32; 256];
    for (i, &b) in vocab.iter().enumerate() {
        id[b as usize] = i as u32;
    }
    let tokens: Vec<u32> = bytes.iter().map(|&b| id[b as usize]).collect();
    let split = ((1.0 - val_fraction) * tokens.len() as f64) as usize;
    Ok(Corpus {
        vocab,
        train: tokens[..split].to_vec(),
        val: tokens[split..].to_vec(),
    })
}

/// Checks that windows of `seq_len + 1` tokens fit in both splits, so
/// [`random_batch`] and [`eval_batch`] cannot run past either.
pub fn check_seq_len(corpus: &Corpus, seq_len: usize) -> Result<(), DataError> {
    let shortest = corpus.train.len().min(corpus.val.len());
    if seq_len.saturating_add(2) > shortest {
        return Err(DataError::Setting(format!(
            "data.seq_len = {seq_len} does not fit the corpus: the validation split has {} tokens and the training split {} (lower data.seq_len below {}, or raise data.val_fraction)",
            corpus.val.len(),
            corpus.train.len(),
            shortest.saturating_sub(1)
        )));
    }
    Ok(())
}

/// Cross-entropy (nats per token) of the validation split under the
/// training split's unigram distribution (add-one smoothing): the loss a
/// model that ignores context would reach.
pub fn unigram_baseline(corpus: &Corpus) -> f64 {
    let v = corpus.vocab.len();
    let mut counts = vec![1.0f64; v];
    corpus.train.iter().for_each(|&t| counts[t as usize] += 1.0);
    let total: f64 = counts.iter().sum();
    let nll: f64 = corpus
        .val
        .iter()
        .map(|&t| -(counts[t as usize] / total).ln())
        .sum();
    nll / corpus.val.len().max(1) as f64
}

/// SplitMix64: small, seedable, and its state fits in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// `n_seq` random windows of `seq + 1` tokens: inputs and next-token targets.
pub fn random_batch(
    data: &[u32],
    n_seq: usize,
    seq: usize,
    rng: &mut SplitMix,
) -> (Vec<u32>, Vec<u32>) {
    windows(data, &random_starts(data.len(), n_seq, seq, rng), seq)
}

/// Where [`random_batch`]'s sequences start (the same draws).
pub fn random_starts(len: usize, n_seq: usize, seq: usize, rng: &mut SplitMix) -> Vec<usize> {
    let span = len - seq - 1;
    (0..n_seq)
        .map(|_| (rng.next_u64() % span as u64) as usize)
        .collect()
}

/// Fixed validation windows evenly spread over `data` (the same every eval).
pub fn eval_batch(
    data: &[u32],
    n_seq: usize,
    seq: usize,
    index: usize,
    batches: usize,
) -> (Vec<u32>, Vec<u32>) {
    windows(
        data,
        &eval_starts(data.len(), n_seq, seq, index, batches),
        seq,
    )
}

/// Where [`eval_batch`]'s sequences start.
pub fn eval_starts(
    len: usize,
    n_seq: usize,
    seq: usize,
    index: usize,
    batches: usize,
) -> Vec<usize> {
    let span = len - seq - 1;
    let total = n_seq * batches;
    (0..n_seq)
        .map(|i| (index * n_seq + i) * span / total.max(1))
        .collect()
}

/// Tokens and next-token targets of the windows of `seq` at `starts`.
pub fn windows(data: &[u32], starts: &[usize], seq: usize) -> (Vec<u32>, Vec<u32>) {
    let mut x = Vec::with_capacity(starts.len() * seq);
    let mut y = Vec::with_capacity(starts.len() * seq);
    for &at in starts {
        x.extend_from_slice(&data[at..at + seq]);
        y.extend_from_slice(&data[at + 1..at + seq + 1]);
    }
    (x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_corpus_loads_and_beats_nothing_yet() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare.txt");
        let c = load_corpus(Some(&path), 0.1).unwrap();
        assert_eq!(
            load_corpus(None, 0.1).unwrap(),
            c,
            "the built-in corpus is the file"
        );
        assert!(c.vocab.len() > 60 && c.vocab.len() < 128);
        assert!(c.val.len() > 400_000);
        let u = unigram_baseline(&c);
        assert!(u > 2.5 && u < 3.5, "unigram baseline {u}");
    }

    #[test]
    fn missing_and_corrupted_corpora_are_errors() {
        let dir = std::env::temp_dir().join(format!("lrmoe-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(
            load_corpus(Some(&dir.join("nope.txt")), 0.1),
            Err(DataError::Read { .. })
        ));
        let small = dir.join("small.txt");
        std::fs::write(&small, "tiny").unwrap();
        assert!(matches!(
            load_corpus(Some(&small), 0.1),
            Err(DataError::Corrupted { .. })
        ));
        let bin = dir.join("bin.txt");
        let mut b = vec![b'a'; 5000];
        b[10] = 0;
        std::fs::write(&bin, &b).unwrap();
        let e = load_corpus(Some(&bin), 0.1).unwrap_err().to_string();
        assert!(e.contains("NUL byte at offset 10"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn batches_are_next_token_windows() {
        let data: Vec<u32> = (0..100).collect();
        let mut rng = SplitMix(1);
        let (x, y) = random_batch(&data, 3, 5, &mut rng);
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(a + 1, *b);
        }
        let (x2, _) = eval_batch(&data, 3, 5, 1, 2);
        assert_eq!(x2.len(), 15);
    }
}
