//! FNV-1a, 64-bit: the one hash behind every digest lockstep compares — a checkpoint's
//! checksum (`checkpoint`), a dataset's digest (`data`), the handshake of the processes of
//! a run (`train::processes`), the replicas' fingerprints (`train::replica`) and which
//! processes share a machine (`world::mpi`).
//!
//! Owns the arithmetic only; each caller says what it feeds, in which order. A leaf: it
//! imports nothing of the crate. Digests written to disk and compared between processes
//! depend on every bit of it, so it never changes: the standard FNV-1a over bytes
//! ([`Fnv1a::bytes`], [`Fnv1a::u64_le`]), and, for the replicas' fingerprints, the same
//! step over whole words ([`Fnv1a::word`]: one xor and one multiply per word, not per
//! byte), which is faster and as good at telling bit patterns apart.
//!
//! No signature: FNV is public, so a digest catches accidents (a torn file, other data,
//! another configuration), never a forgery.

/// The FNV-1a offset basis.
const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// The FNV-1a prime for 64 bits.
const PRIME: u64 = 0x100_0000_01b3;

/// A running 64-bit FNV-1a hash: a value (each step returns the next), so that a
/// sequence folds into it: `words.fold(Fnv1a::new(), Fnv1a::u64_le).finish()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a::new()
    }
}

impl Fnv1a {
    /// The hash of nothing (the offset basis).
    pub const fn new() -> Fnv1a {
        Fnv1a(OFFSET)
    }

    /// Hashes `bytes`, one step per byte: standard FNV-1a.
    #[inline]
    pub fn bytes(self, bytes: &[u8]) -> Fnv1a {
        Fnv1a(bytes.iter().fold(self.0, |h, &b| (h ^ b as u64).wrapping_mul(PRIME)))
    }

    /// Hashes the 8 little-endian bytes of `w` (what [`Fnv1a::bytes`] of
    /// `w.to_le_bytes()` does).
    #[inline]
    pub fn u64_le(self, w: u64) -> Fnv1a {
        self.bytes(&w.to_le_bytes())
    }

    /// One FNV-1a step over the whole word `w`: the state xor `w`, times the prime.
    /// Not [`Fnv1a::u64_le`]: a different hash of the same word.
    #[inline]
    pub fn word(self, w: u64) -> Fnv1a {
        Fnv1a((self.0 ^ w).wrapping_mul(PRIME))
    }

    /// The hash so far.
    pub fn finish(self) -> u64 {
        self.0
    }
}

/// FNV-1a of `bytes`: the hash itself, which the tests hold to its published values.
#[cfg(test)]
pub fn fnv1a(bytes: &[u8]) -> u64 {
    Fnv1a::new().bytes(bytes).finish()
}

/// FNV-1a of the bits of `values`, each as its 4 little-endian bytes: a short name for a
/// tensor's exact contents, for summaries (`Debug` of weights and optimiser state).
pub fn fnv1a_f32(values: &[f32]) -> u64 {
    values.iter().fold(Fnv1a::new(), |h, v| h.bytes(&v.to_bits().to_le_bytes())).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_give_the_standard_test_vectors() {
        // FNV-1a 64 of "", "a" and "foobar", the test vectors of the FNV reference
        // (draft-eastlake-fnv, and isthe.com/chongo/tech/comp/fnv); recomputed with
        // Python: h = 0xcbf29ce484222325; for b in s: h = ((h ^ b) * 0x100000001b3) % 2**64.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        // Fed in pieces, the same.
        assert_eq!(Fnv1a::new().bytes(b"foo").bytes(b"").bytes(b"bar").finish(), fnv1a(b"foobar"));
    }

    #[test]
    fn words_whole_and_as_bytes() {
        // The same Python, over the words 0x3f800000 (1.0f32's bits) and
        // 0xdeadbeefcafef00d: whole words (one step each) 0x60576072d24709d6; their 16
        // little-endian bytes 0xb24920ecb403679f.
        let (a, b) = (0x3f80_0000u64, 0xdead_beef_cafe_f00du64);
        assert_eq!(Fnv1a::new().word(a).word(b).finish(), 0x6057_6072_d247_09d6);
        assert_eq!(Fnv1a::new().u64_le(a).u64_le(b).finish(), 0xb249_20ec_b403_679f);
        let mut bytes = a.to_le_bytes().to_vec();
        bytes.extend(b.to_le_bytes());
        assert_eq!(fnv1a(&bytes), 0xb249_20ec_b403_679f);
    }
}
