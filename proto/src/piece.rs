//! Pieces: how a large version is cut for fetching from several sources at once.
//!
//! Every node cuts a version of `byte_len` bytes the same way, from `byte_len` alone:
//! [`piece_len`] is a power of two of at least [`MIN_PIECE_LEN`], chosen so that there are at
//! most [`MAX_PIECES`], and piece `i` is bytes `i * piece_len ..` up to the next piece or the
//! end ([`piece_range`]). Because BLAKE3 is a binary tree over 1 KiB chunks whose left
//! subtrees are powers of two, each such piece is one subtree of the version's hash tree:
//! its chaining value can be checked on its own, and the pieces' chaining values merge into
//! the version's hash (the root). A puller gets every piece's chaining value first (the
//! version's *outline*, [`DataResponse::Outline`](crate::DataResponse::Outline)), checks
//! that they merge into the hash the registry lists, then checks each piece as it lands —
//! the scheme of bao's outboard encoding, cut at one level of the tree.

use std::ops::Range;

/// The smallest piece: a few MiB, so that a request's round trip is small next to its bytes.
pub const MIN_PIECE_LEN: u64 = 4 << 20;
/// The most pieces one version is cut into (bounds an outline to 32 KiB).
pub const MAX_PIECES: usize = 1024;
/// The most sources one fetch pulls pieces from at once.
pub const MAX_SOURCES: usize = 4;
/// Versions of at least this many bytes (four pieces) are fetched in pieces from several
/// sources; smaller ones in one stream from one source at a time.
pub const MULTI_SOURCE_MIN_BYTES: u64 = 4 * MIN_PIECE_LEN;

/// The length of every piece but the last of a `byte_len`-byte version.
pub fn piece_len(byte_len: u64) -> u64 {
    let even = byte_len.div_ceil(MAX_PIECES as u64);
    even.checked_next_power_of_two()
        .unwrap_or(1 << 63)
        .max(MIN_PIECE_LEN)
}

/// How many pieces a `byte_len`-byte version has (none for an empty one).
pub fn piece_count(byte_len: u64) -> usize {
    // At most MAX_PIECES by the choice of piece_len.
    byte_len.div_ceil(piece_len(byte_len)) as usize
}

/// The bytes of piece `index` of a `byte_len`-byte version (empty past the last piece).
pub fn piece_range(byte_len: u64, index: usize) -> Range<u64> {
    let len = piece_len(byte_len);
    let start = (index as u64).saturating_mul(len).min(byte_len);
    start..start.saturating_add(len).min(byte_len)
}

/// Why an outline or a list of piece indexes does not fit the version it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PieceError {
    /// The outline's piece length is not the one every node uses for this size.
    #[error("piece length {got}, a {byte_len}-byte version has pieces of {want}")]
    PieceLen {
        /// The version's size.
        byte_len: u64,
        /// What the outline said.
        got: u64,
        /// What it must be.
        want: u64,
    },
    /// The outline has a chaining value per piece, and this one has not.
    #[error("{got} chaining values, a {byte_len}-byte version has {want} pieces")]
    Count {
        /// The version's size.
        byte_len: u64,
        /// Values given.
        got: usize,
        /// Pieces there are.
        want: usize,
    },
    /// More pieces (values or indexes) than any version has.
    #[error("{got} pieces named, a version has at most {MAX_PIECES}")]
    TooMany {
        /// How many were named.
        got: usize,
    },
    /// A piece index past the last piece.
    #[error("piece {index} of {count}")]
    Index {
        /// The index given.
        index: u32,
        /// Pieces there are.
        count: usize,
    },
}

/// Checks an outline (`piece_len`, one chaining value each) against a `byte_len`-byte version.
pub fn check_outline(byte_len: u64, piece_len_got: u64, values: usize) -> Result<(), PieceError> {
    let want = piece_len(byte_len);
    if piece_len_got != want {
        return Err(PieceError::PieceLen {
            byte_len,
            got: piece_len_got,
            want,
        });
    }
    let count = piece_count(byte_len);
    if values != count {
        return Err(PieceError::Count {
            byte_len,
            got: values,
            want: count,
        });
    }
    Ok(())
}

/// Checks that every index names one of `count` pieces.
pub fn check_indexes(indexes: &[u32], count: usize) -> Result<(), PieceError> {
    match indexes.iter().find(|&&i| i as usize >= count) {
        Some(&index) => Err(PieceError::Index { index, count }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_powers_of_two_at_least_the_minimum_and_at_most_max_pieces() {
        for len in [
            0,
            1,
            MIN_PIECE_LEN - 1,
            MIN_PIECE_LEN,
            MIN_PIECE_LEN + 1,
            256 << 20,
            (4 << 30) + 1,
            1 << 40,
            u64::MAX,
        ] {
            let p = piece_len(len);
            assert!(p.is_power_of_two() && p >= MIN_PIECE_LEN, "{len}: {p}");
            assert!(piece_count(len) <= MAX_PIECES, "{len}");
            let last = piece_count(len).saturating_sub(1);
            assert_eq!(piece_range(len, last).end, len, "{len}");
            assert!(piece_range(len, piece_count(len)).is_empty());
        }
        assert_eq!(piece_count(0), 0);
        assert_eq!(piece_count(MIN_PIECE_LEN + 1), 2);
        assert_eq!(
            piece_range(MIN_PIECE_LEN + 1, 1),
            MIN_PIECE_LEN..MIN_PIECE_LEN + 1
        );
        assert_eq!(piece_count(256 << 20), 64);
        // Past 4 GiB the pieces grow instead of their number.
        assert_eq!(piece_len((4 << 30) + 1), 8 << 20);
    }

    #[test]
    fn outlines_and_indexes_are_checked() {
        let len = 10 << 20;
        assert_eq!(check_outline(len, MIN_PIECE_LEN, 3), Ok(()));
        assert!(matches!(
            check_outline(len, 1 << 20, 3),
            Err(PieceError::PieceLen { .. })
        ));
        assert!(matches!(
            check_outline(len, MIN_PIECE_LEN, 2),
            Err(PieceError::Count {
                got: 2,
                want: 3,
                ..
            })
        ));
        assert_eq!(check_indexes(&[0, 2], 3), Ok(()));
        assert_eq!(
            check_indexes(&[0, 3], 3),
            Err(PieceError::Index { index: 3, count: 3 })
        );
    }
}
