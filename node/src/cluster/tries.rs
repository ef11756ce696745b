//! [`Tries`]: what one get learned about its holders: which it tried, which it dropped, whose
//! bytes are in its buffer, and how the last one failed. Pure bookkeeping, tested here.
//!
//! Bytes that do not hash to the registry's prove that one of the sources that sent them
//! lied, not which. When they all came from one source, it is dropped. When they came from
//! several (the get resumed), none is blamed for the others: each of them not yet dropped is
//! asked for the whole version again, one at a time, where a mismatch has one source; and
//! from then on the get takes the version whole from one source (no moves, no resumes).

use std::collections::HashSet;

use tb_proto::{HolderAddr, MAX_LOOKUP_EXCLUDE, NodeId};

use crate::error::Error;

/// The holders one get tried so far.
#[derive(Debug, Default)]
pub(super) struct Tries {
    /// Holders not to try again in this get (excluded from its look-ups).
    pub(super) dropped: HashSet<NodeId>,
    /// Attempts made.
    pub(super) count: usize,
    last: Option<Error>,
    /// The sources whose bytes are in the buffer now, in the order they sent them.
    contributors: Vec<HolderAddr>,
    /// Set by a hash mismatch: the rest of the get takes the version whole from one source.
    whole: bool,
}

impl Tries {
    /// Notes `holder`'s failure: dropped for this get unless it is a holder still receiving
    /// the version that does not have it yet.
    pub(super) fn failed(&mut self, holder: &HolderAddr, error: Error) {
        let not_yet = !holder.complete && matches!(error, Error::NotFound { .. });
        if !not_yet {
            self.dropped.insert(holder.node);
        }
        self.last = Some(error);
    }

    /// Notes that `holder` put bytes into the buffer.
    pub(super) fn contributed(&mut self, holder: &HolderAddr) {
        if !self.contributors.iter().any(|c| c.node == holder.node) {
            self.contributors.push(holder.clone());
        }
    }

    /// The buffer starts over: nobody's bytes are in it.
    pub(super) fn restarted(&mut self) {
        self.contributors.clear();
    }

    /// Whether the get takes the version whole from one source (after a hash mismatch): no
    /// moves, and a source that fails part-way leaves nothing to resume from.
    pub(super) fn whole(&self) -> bool {
        self.whole
    }

    /// The buffer's bytes, the last of them from `holder`, do not hash to the registry's
    /// (`error`); the buffer starts over. Returns the sources to ask for the whole version
    /// next, in the order they sent their bytes: none when all the bytes came from `holder`
    /// (then it is dropped), else every source that sent some and is not dropped.
    pub(super) fn mismatch(&mut self, holder: &HolderAddr, error: Error) -> Vec<HolderAddr> {
        self.contributed(holder);
        self.whole = true;
        let sources = std::mem::take(&mut self.contributors);
        if sources.len() == 1 {
            self.failed(holder, error);
            return Vec::new();
        }
        self.last = Some(error);
        sources
            .into_iter()
            .filter(|s| !self.dropped.contains(&s.node))
            .collect()
    }

    /// The sources to exclude from a look-up: those dropped, at most the protocol's limit.
    pub(super) fn excluded(&self) -> Vec<NodeId> {
        let mut dropped: Vec<NodeId> = self.dropped.iter().copied().collect();
        dropped.sort();
        dropped.truncate(MAX_LOOKUP_EXCLUDE);
        dropped
    }

    /// The error of a get that ran out of holders.
    pub(super) fn exhausted(self, what: String) -> Error {
        let last = self.last.map_or_else(
            || "the broker named no other holder".into(),
            |e| e.to_string(),
        );
        Error::NoHolder {
            what,
            tried: self.count,
            last,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(n: u8, complete: bool) -> HolderAddr {
        HolderAddr {
            node: NodeId([n; 32]),
            addrs: vec!["127.0.0.1:1".into()],
            complete,
        }
    }

    fn corrupt() -> Error {
        Error::Corrupt("bad hash".into())
    }

    #[test]
    fn holders_still_receiving_are_retried_others_are_dropped() {
        let mut tries = Tries::default();
        let not_found = || Error::NotFound {
            what: "m/w v2".into(),
        };
        tries.failed(&holder(1, false), not_found());
        tries.failed(&holder(2, true), not_found());
        tries.failed(&holder(3, false), Error::Corrupt("bad".into()));
        tries.count = 3;
        assert!(!tries.dropped.contains(&NodeId([1; 32])));
        assert!(tries.dropped.contains(&NodeId([2; 32])));
        assert!(tries.dropped.contains(&NodeId([3; 32])));
        match tries.exhausted("tensor \"m/w\" v2".into()) {
            Error::NoHolder {
                what,
                tried: 3,
                last,
            } => {
                assert!(what.contains("m/w"));
                assert!(last.contains("bad"), "{last}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Tries::default().exhausted(String::new()),
            Error::NoHolder { tried: 0, .. }
        ));
    }

    #[test]
    fn a_mismatch_from_one_source_drops_it() {
        let mut tries = Tries::default();
        tries.contributed(&holder(1, true));
        assert!(!tries.whole());
        assert!(tries.mismatch(&holder(1, true), corrupt()).is_empty());
        assert!(tries.dropped.contains(&NodeId([1; 32])));
        assert!(tries.whole());
        // A source that sent nothing into the buffer yet (a whole channel transfer) is the
        // only one to blame for its own bad bytes.
        let mut tries = Tries::default();
        assert!(tries.mismatch(&holder(2, true), corrupt()).is_empty());
        assert!(tries.dropped.contains(&NodeId([2; 32])));
    }

    #[test]
    fn a_mismatch_after_a_resume_blames_no_one_and_asks_each_for_the_whole_version() {
        // The liar sent the first part and failed (dropped for that); the honest holder
        // resumed and finished.
        let (liar, honest) = (holder(1, true), holder(2, true));
        let mut tries = Tries::default();
        tries.contributed(&liar);
        tries.failed(&liar, Error::Io("stream ended".into()));
        let again = tries.mismatch(&honest, corrupt());
        assert_eq!(again, vec![honest.clone()], "the last source is not blamed");
        assert!(!tries.dropped.contains(&honest.node));
        assert!(tries.whole());
        // Asked for the whole version, the honest one sends it alone: nothing to blame.
        // Had it lied, it would be the only source now.
        tries.contributed(&honest);
        assert!(tries.mismatch(&honest, corrupt()).is_empty());
        assert!(tries.dropped.contains(&honest.node));

        // A source that moved on (not dropped) and the one that finished: both asked again,
        // in the order they sent their bytes.
        let (first, second) = (holder(3, true), holder(4, true));
        let mut tries = Tries::default();
        tries.contributed(&first);
        tries.contributed(&second);
        tries.contributed(&first);
        assert_eq!(tries.mismatch(&second, corrupt()), vec![first, second]);
        assert!(tries.dropped.is_empty());
        // The buffer starts over.
        assert!(tries.mismatch(&holder(5, true), corrupt()).is_empty());
    }

    #[test]
    fn a_restart_forgets_whose_bytes_were_in() {
        let mut tries = Tries::default();
        tries.contributed(&holder(1, true));
        tries.restarted();
        assert!(tries.mismatch(&holder(2, true), corrupt()).is_empty());
        assert!(!tries.dropped.contains(&NodeId([1; 32])));
        assert!(tries.dropped.contains(&NodeId([2; 32])));
    }
}
