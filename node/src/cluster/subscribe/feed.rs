//! [`Feed`]: what one subscription has told its subscriber and what it has yet to tell, per
//! name. Pure: the reader task feeds it broker events and catch-up listings, the delivery task
//! takes the next item from it.
//!
//! The rules, per name: versions are told in increasing order; news of a version not newer
//! than one already heard is dropped; versions waiting to be told coalesce into the newest
//! (so a subscriber that falls behind, or a fetch that takes long, gets the newest version
//! next), and every version between the last one told and the next is reported as skipped,
//! so nothing is skipped silently. A delete waits in line between the versions around it.
//! Names take turns: one item per name, then the name goes to the back of the line.

use std::collections::{HashMap, HashSet, VecDeque};

use tb_proto::{TensorMeta, TensorName};

use crate::{error::Error, tensor::Tensor};

/// Most items one name keeps waiting (alternating versions and deletes); beyond it the oldest
/// goes (a version that goes is still reported as skipped).
const MAX_PENDING_PER_NAME: usize = 8;

/// A version's bytes, as they came with its news.
#[derive(Debug)]
pub(crate) enum Carried {
    /// Here: verified against the metadata, or mapped from a trusted publisher's memfd.
    Here(Tensor),
    /// Still arriving on a same-host watch, which sends them once read (and drops the sender
    /// if the read fails: the subscription then fetches the version itself). News of the
    /// version from the broker meanwhile is old news: the bytes are not fetched twice.
    Coming(tokio::sync::oneshot::Receiver<Tensor>),
    /// Expected on the same-host watch of the version's publisher, whose offer and the
    /// broker's event raced and the event won: the offer, when it comes, is handed over here
    /// ([`Feed::published_carrying`]) instead of being dropped as old news. Dropped (the
    /// subscription fetches the version) when newer news comes first.
    Expected(tokio::sync::oneshot::Receiver<Carried>),
}

/// Something waiting to be told about one name.
#[derive(Debug)]
enum Item {
    Version {
        version: u64,
        meta: TensorMeta,
        /// The version itself, when it came (or is coming) with the event or a watch; boxed,
        /// being large beside the other items.
        inline: Option<Box<Carried>>,
    },
    Deleted,
}

#[derive(Debug, Default)]
struct NameFeed {
    /// Newest version told to the subscriber (or live when the subscription started).
    told: Option<u64>,
    /// Whether the subscriber was last told the name is live.
    live: bool,
    /// Newest version heard of.
    heard: Option<u64>,
    /// First version after `told` that was not told and is not pending any more (a fetch that
    /// failed while a newer version waited): the next skipped range starts there.
    untold_from: Option<u64>,
    /// Items not yet told, oldest first.
    pending: VecDeque<Item>,
    /// The version heard from the broker whose bytes are expected on a same-host watch, and
    /// where to hand them ([`Carried::Expected`]).
    expected: Option<(u64, tokio::sync::oneshot::Sender<Carried>)>,
}

impl NameFeed {
    /// Whether the name is live once everything pending is told.
    fn will_be_live(&self) -> bool {
        match self.pending.back() {
            Some(Item::Version { .. }) => true,
            Some(Item::Deleted) => false,
            None => self.live,
        }
    }

    fn push(&mut self, item: Item) {
        if self.pending.len() >= MAX_PENDING_PER_NAME
            && let Some(Item::Version { version, .. }) = self.pending.pop_front()
        {
            self.lose(version);
        }
        self.pending.push_back(item);
    }

    /// `version` will not be told on its own: it must be in the next skipped range. Only
    /// needs noting while nothing was told (after that, ranges start at the version told).
    fn lose(&mut self, version: u64) {
        if self.told.is_none() {
            self.untold_from = Some(self.untold_from.map_or(version, |u| u.min(version)));
        }
    }
}

/// The next thing to tell the subscriber.
#[derive(Debug)]
pub(crate) enum Next {
    /// A version to tell (after fetching it, with auto-fetch); `skipped` is the range of
    /// versions between the last one told and this one, if any.
    Version {
        name: TensorName,
        version: u64,
        meta: TensorMeta,
        skipped: Option<(u64, u64)>,
        /// The version itself, when it came (or is coming) with the event or a watch.
        inline: Option<Carried>,
    },
    /// The name was deleted.
    Deleted { name: TensorName },
    /// The subscription ended with this error (after everything pending was told).
    Failed(Error),
}

/// Per-name state of one subscription and the line of names with news.
#[derive(Debug, Default)]
pub(crate) struct Feed {
    names: HashMap<TensorName, NameFeed>,
    /// Names with pending items, each once, in the order their news came.
    queue: VecDeque<TensorName>,
    failed: Option<Error>,
}

impl Feed {
    /// Notes versions live when the subscription started: told already, not news.
    pub(crate) fn baseline(&mut self, live: impl IntoIterator<Item = (TensorName, u64)>) {
        for (name, version) in live {
            let feed = self.names.entry(name).or_default();
            feed.told = Some(version);
            feed.heard = Some(version);
            feed.live = true;
        }
    }

    /// A version of `name` was published; false if it is old news (dropped).
    pub(crate) fn published(&mut self, name: &TensorName, version: u64, meta: TensorMeta) -> bool {
        self.published_with(name, version, meta, None)
    }

    /// [`published`](Self::published), for a version whose publisher offers this subscription
    /// its versions on a same-host watch: the offer and this news race, and when this news
    /// wins, the offer that follows is taken as the version's bytes rather than dropped
    /// ([`Carried::Expected`]), so the version is not fetched a second time.
    pub(crate) fn published_expected(
        &mut self,
        name: &TensorName,
        version: u64,
        meta: TensorMeta,
    ) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let news = self.published_carrying(name, version, meta, Some(Carried::Expected(rx)));
        if news && let Some(feed) = self.names.get_mut(name) {
            feed.expected = Some((version, tx));
        }
        news
    }

    /// [`published`](Self::published), with the version itself when it came with the news.
    pub(crate) fn published_with(
        &mut self,
        name: &TensorName,
        version: u64,
        meta: TensorMeta,
        inline: Option<Tensor>,
    ) -> bool {
        self.published_carrying(name, version, meta, inline.map(Carried::Here))
    }

    /// [`published`](Self::published), with the version's bytes here or coming.
    pub(crate) fn published_carrying(
        &mut self,
        name: &TensorName,
        version: u64,
        meta: TensorMeta,
        inline: Option<Carried>,
    ) -> bool {
        let feed = self.names.entry(name.clone()).or_default();
        if feed.heard.is_some_and(|h| h >= version) {
            // Old news, unless it brings the bytes of the version expected on a watch.
            if let Some(carried) = inline
                && feed.expected.as_ref().is_some_and(|(v, _)| *v == version)
                && let Some((_, tx)) = feed.expected.take()
            {
                // Gone if the subscription stopped waiting: it fetches the version itself.
                let _ = tx.send(carried);
            }
            return false;
        }
        feed.heard = Some(version);
        // Newer news: a version still expected on a watch is fetched instead (its
        // subscription stops waiting when the sender drops).
        feed.expected = None;
        let was_idle = feed.pending.is_empty();
        match feed.pending.back_mut() {
            Some(Item::Version {
                version: v,
                meta: m,
                inline: i,
            }) => {
                let replaced = std::mem::replace(v, version);
                *m = meta;
                *i = inline.map(Box::new);
                feed.lose(replaced);
            }
            _ => feed.push(Item::Version {
                version,
                meta,
                inline: inline.map(Box::new),
            }),
        }
        if was_idle {
            self.queue.push_back(name.clone());
        }
        true
    }

    /// `name` was deleted; false if the subscriber will know it already (dropped).
    pub(crate) fn deleted(&mut self, name: &TensorName) -> bool {
        let feed = self.names.entry(name.clone()).or_default();
        let known = feed.heard.is_some();
        if known && !feed.will_be_live() {
            return false;
        }
        let was_idle = feed.pending.is_empty();
        feed.push(Item::Deleted);
        if was_idle {
            self.queue.push_back(name.clone());
        }
        true
    }

    /// Takes in a listing made after a reconnection: newer versions become news (with the
    /// versions missed meanwhile reported as skipped when told) and, when the listing is
    /// `complete`, names that were live but are missing from it were deleted.
    pub(crate) fn caught_up(
        &mut self,
        listing: Vec<(TensorName, u64, TensorMeta)>,
        complete: bool,
    ) {
        let listed: HashSet<TensorName> = listing.iter().map(|(n, _, _)| n.clone()).collect();
        for (name, version, meta) in listing {
            self.published(&name, version, meta);
        }
        if !complete {
            return;
        }
        let gone: Vec<TensorName> = self
            .names
            .iter()
            .filter(|(name, feed)| feed.will_be_live() && !listed.contains(*name))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            self.deleted(&name);
        }
    }

    /// Ends the subscription with `error` once everything pending is told.
    pub(crate) fn fail(&mut self, error: Error) {
        self.failed.get_or_insert(error);
    }

    /// The next thing to tell, taking turns between names.
    pub(crate) fn pop(&mut self) -> Option<Next> {
        while let Some(name) = self.queue.pop_front() {
            let Some(feed) = self.names.get_mut(&name) else {
                continue;
            };
            let Some(item) = feed.pending.pop_front() else {
                continue;
            };
            if !feed.pending.is_empty() {
                self.queue.push_back(name.clone());
            }
            return Some(match item {
                Item::Version {
                    version,
                    meta,
                    inline,
                } => Next::Version {
                    inline: inline.map(|c| *c),
                    skipped: feed
                        .told
                        .map(|t| t.saturating_add(1))
                        .or(feed.untold_from)
                        .filter(|from| *from < version)
                        .map(|from| (from, version - 1)),
                    name,
                    version,
                    meta,
                },
                Item::Deleted => Next::Deleted { name },
            });
        }
        self.failed.take().map(Next::Failed)
    }

    /// Whether a version of `name` newer than `version` waits to be told.
    pub(crate) fn has_newer(&self, name: &TensorName, version: u64) -> bool {
        self.names.get(name).is_some_and(|f| {
            f.pending
                .iter()
                .any(|i| matches!(i, Item::Version { version: v, .. } if *v > version))
        })
    }

    /// The subscriber was told `version` of `name` (or that it was skipped).
    pub(crate) fn told_version(&mut self, name: &TensorName, version: u64) {
        let feed = self.names.entry(name.clone()).or_default();
        feed.told = Some(feed.told.map_or(version, |t| t.max(version)));
        feed.untold_from = None;
        feed.live = true;
    }

    /// `version` of `name` (and the versions `skipped` before it) will not be told on their
    /// own: the next version told reports them as skipped.
    pub(crate) fn untold(&mut self, name: &TensorName, version: u64, skipped: Option<(u64, u64)>) {
        let feed = self.names.entry(name.clone()).or_default();
        feed.lose(skipped.map_or(version, |(from, _)| from));
    }

    /// The subscriber was told `name` was deleted.
    pub(crate) fn told_deleted(&mut self, name: &TensorName) {
        self.names.entry(name.clone()).or_default().live = false;
    }
}

#[cfg(test)]
mod tests {
    use tb_proto::{ContentHash, DType};

    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    fn meta(v: u64) -> TensorMeta {
        TensorMeta::new(DType::U8, vec![4], ContentHash([v as u8; 32])).expect("meta")
    }

    /// Pops everything, telling each item as delivered, as `(name, what)` strings.
    fn drain(feed: &mut Feed) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(next) = feed.pop() {
            match next {
                Next::Version {
                    name,
                    version,
                    skipped,
                    ..
                } => {
                    if let Some((from, to)) = skipped {
                        out.push(format!("{name} skipped {from}..={to}"));
                    }
                    out.push(format!("{name} v{version}"));
                    feed.told_version(&name, version);
                }
                Next::Deleted { name } => {
                    out.push(format!("{name} deleted"));
                    feed.told_deleted(&name);
                }
                Next::Failed(e) => out.push(format!("failed: {e}")),
            }
        }
        out
    }

    #[test]
    fn a_version_whose_bytes_are_coming_makes_the_brokers_news_of_it_old() {
        let (a, mut feed) = (name("c/a"), Feed::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<Tensor>();
        assert!(feed.published_carrying(&a, 3, meta(3), Some(Carried::Coming(rx))));
        assert!(
            !feed.published(&a, 3, meta(3)),
            "the broker's event is old news"
        );
        match feed.pop() {
            Some(Next::Version {
                version: 3,
                inline: Some(Carried::Coming(mut rx)),
                ..
            }) => {
                // The channel the watch was handed is the one the subscription waits on.
                let sent = Tensor::from_bytes(vec![7u8; 3]);
                assert!(tx.send(sent.clone()).is_ok());
                let got = rx.try_recv().expect("the watch's bytes");
                assert_eq!(got.data(), sent.data());
            }
            other => panic!("{other:?}"),
        }
        assert!(feed.pop().is_none());
    }

    #[test]
    fn a_version_heard_from_the_broker_first_takes_the_bytes_its_watch_brings_after() {
        let (a, mut feed) = (name("c/a"), Feed::default());
        assert!(feed.published_expected(&a, 3, meta(3)));
        let popped = feed.pop();
        // The watch's offer of the same version, after: old news, but its bytes are handed
        // to the version being told rather than dropped.
        let sent = Tensor::from_bytes(vec![7u8; 3]);
        assert!(!feed.published_with(&a, 3, meta(3), Some(sent.clone())));
        match popped {
            Some(Next::Version {
                version: 3,
                inline: Some(Carried::Expected(mut rx)),
                ..
            }) => match rx.try_recv() {
                Ok(Carried::Here(got)) => assert_eq!(got.data(), sent.data()),
                other => panic!("the watch's bytes, got {other:?}"),
            },
            other => panic!("{other:?}"),
        }
        // A second offer of it is old news like any other.
        assert!(!feed.published_with(&a, 3, meta(3), Some(sent)));
        assert!(feed.pop().is_none());
    }

    #[test]
    fn newer_news_ends_the_wait_for_a_watchs_bytes() {
        let (a, mut feed) = (name("c/a"), Feed::default());
        assert!(feed.published_expected(&a, 3, meta(3)));
        let Some(Next::Version {
            inline: Some(Carried::Expected(mut rx)),
            ..
        }) = feed.pop()
        else {
            panic!("v3, expected on a watch");
        };
        assert!(feed.published(&a, 4, meta(4)));
        // The subscription stops waiting (and fetches v3) rather than waiting out its grace.
        assert!(matches!(
            rx.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed)
        ));
        // v3's offer coming late is dropped.
        let late = Tensor::from_bytes(vec![7u8; 3]);
        assert!(!feed.published_with(&a, 3, meta(3), Some(late)));
        assert!(matches!(feed.pop(), Some(Next::Version { version: 4, .. })));
    }

    #[test]
    fn versions_come_in_order_and_gaps_are_skipped() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.baseline([(a.clone(), 3)]);
        assert!(!feed.published(&a, 3, meta(3)), "known at start");
        assert!(feed.published(&a, 4, meta(4)));
        assert_eq!(drain(&mut feed), ["m/a v4"]);
        assert!(feed.published(&a, 7, meta(7)));
        assert!(!feed.published(&a, 6, meta(6)), "older than heard");
        assert_eq!(drain(&mut feed), ["m/a skipped 5..=6", "m/a v7"]);
    }

    #[test]
    fn a_subscriber_that_falls_behind_gets_the_newest_and_the_rest_as_skipped() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        assert!(feed.published(&a, 1, meta(1)));
        assert_eq!(drain(&mut feed), ["m/a v1"]);
        for v in 2..=9 {
            feed.published(&a, v, meta(v));
        }
        match feed.pop() {
            Some(Next::Version {
                version: 9,
                skipped: Some((2, 8)),
                meta: m,
                ..
            }) => assert_eq!(m, meta(9)),
            other => panic!("{other:?}"),
        }
        assert!(feed.pop().is_none());
    }

    #[test]
    fn a_newer_version_during_a_fetch_waits_and_the_failed_one_is_skipped_with_it() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.baseline([(a.clone(), 1)]);
        feed.published(&a, 2, meta(2));
        let Some(Next::Version { version: 2, .. }) = feed.pop() else {
            panic!("v2 first")
        };
        // While v2 is fetched, v3 arrives; the fetch of v2 fails.
        feed.published(&a, 3, meta(3));
        assert!(feed.has_newer(&a, 2));
        assert!(!feed.has_newer(&a, 3));
        feed.untold(&a, 2, None);
        assert_eq!(drain(&mut feed), ["m/a skipped 2..=2", "m/a v3"]);
    }

    #[test]
    fn versions_coalesced_before_the_first_one_told_are_skipped() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.published(&a, 1, meta(1));
        feed.published(&a, 2, meta(2));
        assert_eq!(drain(&mut feed), ["m/a skipped 1..=1", "m/a v2"]);
        let (b, mut feed) = (name("m/b"), Feed::default());
        feed.published(&b, 4, meta(4));
        assert_eq!(drain(&mut feed), ["m/b v4"], "what came before is not news");
    }

    #[test]
    fn failed_first_versions_are_skipped_too() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.published(&a, 1, meta(1));
        let Some(Next::Version {
            version: 1,
            skipped: None,
            ..
        }) = feed.pop()
        else {
            panic!("v1 first")
        };
        feed.published(&a, 2, meta(2));
        feed.untold(&a, 1, None);
        let Some(Next::Version {
            version: 2,
            skipped,
            ..
        }) = feed.pop()
        else {
            panic!("v2 next")
        };
        assert_eq!(skipped, Some((1, 1)));
        feed.published(&a, 5, meta(5));
        feed.untold(&a, 2, skipped);
        assert_eq!(drain(&mut feed), ["m/a skipped 1..=4", "m/a v5"]);
    }

    #[test]
    fn deletes_wait_between_versions_and_repeats_are_dropped() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.published(&a, 1, meta(1));
        assert!(feed.deleted(&a));
        assert!(!feed.deleted(&a), "already deleted");
        feed.published(&a, 2, meta(2));
        feed.published(&a, 3, meta(3));
        assert_eq!(
            drain(&mut feed),
            ["m/a v1", "m/a deleted", "m/a skipped 2..=2", "m/a v3"]
        );
        assert!(feed.deleted(&a));
        assert_eq!(drain(&mut feed), ["m/a deleted"]);
        assert!(!feed.deleted(&a));
        assert!(
            feed.deleted(&name("m/unknown")),
            "a stranger's delete is told"
        );
    }

    #[test]
    fn names_take_turns() {
        let (a, b, mut feed) = (name("m/a"), name("m/b"), Feed::default());
        feed.published(&a, 1, meta(1));
        feed.deleted(&a);
        feed.published(&a, 2, meta(2));
        feed.published(&b, 1, meta(1));
        assert_eq!(
            drain(&mut feed),
            ["m/a v1", "m/b v1", "m/a deleted", "m/a v2"]
        );
    }

    #[test]
    fn catching_up_reports_missed_versions_and_deletes() {
        let (a, b, c, d) = (name("m/a"), name("m/b"), name("m/c"), name("m/d"));
        let mut feed = Feed::default();
        feed.baseline([(a.clone(), 2), (b.clone(), 5), (c.clone(), 1)]);
        let listing = vec![
            (a.clone(), 4, meta(4)),
            (b.clone(), 5, meta(5)),
            (d, 1, meta(1)),
        ];
        feed.caught_up(listing.clone(), false);
        assert_eq!(drain(&mut feed), ["m/a skipped 3..=3", "m/a v4", "m/d v1"]);
        feed.caught_up(listing.clone(), true);
        assert_eq!(drain(&mut feed), ["m/c deleted"]);
        feed.caught_up(listing, true);
        assert!(drain(&mut feed).is_empty(), "nothing new the second time");
    }

    #[test]
    fn failure_comes_after_what_is_pending() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.published(&a, 1, meta(1));
        feed.fail(Error::NoBroker {
            tried: 2,
            failures: Vec::new(),
        });
        let told = drain(&mut feed);
        assert_eq!(told.len(), 2);
        assert_eq!(told[0], "m/a v1");
        assert!(
            told[1].contains("no broker reachable: tried 2"),
            "{}",
            told[1]
        );
    }

    #[test]
    fn a_long_alternation_keeps_the_newest_items() {
        let (a, mut feed) = (name("m/a"), Feed::default());
        feed.baseline([(a.clone(), 1)]);
        for v in 2..=20 {
            feed.published(&a, v, meta(v));
            feed.deleted(&a);
        }
        let told = drain(&mut feed);
        assert!(told.len() <= MAX_PENDING_PER_NAME + 4, "{told:?}");
        assert_eq!(told.last().map(String::as_str), Some("m/a deleted"));
        assert!(told.contains(&"m/a v20".to_string()), "{told:?}");
        assert!(told[0].starts_with("m/a skipped 2..="), "{told:?}");
    }
}
