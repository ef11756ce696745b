//! [`Subscription`]: new versions (and deletes) of the names matching a pattern, as a broker
//! announces them.
//!
//! Two tasks per subscription, both owned by the node's `TaskTracker` and stopped when the
//! `Subscription` is dropped or the node shuts down:
//! - the reader holds the `Subscribe` stream to a broker and puts each event into the [`Feed`];
//!   when the stream or its broker goes away it subscribes again (the next broker first, a
//!   bounded number of tries with backoff), then lists the matching names so that what it
//!   missed meanwhile becomes news, gaps included;
//! - the deliverer takes the next item from the feed, fetches the version when auto-fetch is
//!   on, and hands the subscriber `SubEvent`s through a small channel. The reader never waits
//!   for it: while it is busy, pending versions of a name coalesce into the newest.
//!
//! When `subscribe` returns, the subscription is open and the names live at that moment are
//! known; what is published after that is reported.

mod feed;
mod watch;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use iroh::{
    EndpointId,
    endpoint::{Connection, RecvStream, SendStream},
};
use tb_proto::{
    CtlRequest, CtlResponse, Event, ListedEntry, MAX_LIST_LIMIT, NamePattern, TensorMeta,
    TensorName,
};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, warn};

use self::{
    feed::{Carried, Feed, Next},
    watch::{Reach, Watching},
};
use super::{
    Cluster,
    ctl_client::{check_response, read_response},
    failover::{Failure, answer_error},
};
use crate::{
    error::{Error, Result},
    node::{Node, WeakNode},
    tensor::Tensor,
    wire,
};

/// Longest a version heard from the broker waits for its bytes on the publisher's same-host
/// watch ([`Carried::Expected`]) before it is fetched. Both leave the publisher together,
/// the event through the broker: the offer trails it by the event's hop or less, unless the
/// publisher sent none (its watcher had an offer pending).
const WATCH_GRACE: Duration = Duration::from_millis(10);
/// Events the subscriber has not taken yet, at most (each may carry a fetched tensor).
const EVENT_BUFFER: usize = 4;
/// Tries to subscribe again after the stream to a broker is lost.
const RESUBSCRIBE_TRIES: u32 = 8;
/// Wait before the first of those tries; it doubles up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How often a subscription on QUIC looks whether its broker is known to be on this host by
/// now (which a node learns in the background, from its first requests), ...
const MOVE_LOOK: Duration = Duration::from_millis(250);
/// ... and how many times, after each stream opened on QUIC (10 s).
const MOVE_LOOKS: u32 = 40;
/// Longest a stream on QUIC replaced by a socket one is read for what it still had on the
/// way (its end comes one round trip after the subscriber ends its side).
const DRAIN: Duration = Duration::from_secs(2);

/// What a subscription reports about a matching name.
#[derive(Debug, Clone)]
pub enum SubEvent {
    /// A new version. Per name, versions come in increasing order.
    Version {
        /// The tensor's name.
        name: TensorName,
        /// The version.
        version: u64,
        /// What its bytes are.
        meta: TensorMeta,
        /// The tensor itself, fetched and verified, when `Config::auto_fetch` is on.
        tensor: Option<Tensor>,
    },
    /// Versions `from..=to` of `name` were published but are not reported: the subscriber fell
    /// behind (only the newest pending version is fetched), the broker connection dropped
    /// meanwhile, or (with auto-fetch) they could not be fetched. Comes before the version
    /// after them.
    Skipped {
        /// The tensor's name.
        name: TensorName,
        /// First version skipped.
        from: u64,
        /// Last version skipped.
        to: u64,
    },
    /// The name was deleted.
    Deleted {
        /// The tensor's name.
        name: TensorName,
    },
}

/// A live subscription: call [`next`](Self::next) for each event. Dropping it ends it.
#[derive(Debug)]
pub struct Subscription {
    pattern: NamePattern,
    events: mpsc::Receiver<Result<SubEvent>>,
    shared: Arc<Shared>,
    _stop: DropGuard,
}

impl Subscription {
    /// The pattern it watches.
    pub fn pattern(&self) -> &NamePattern {
        &self.pattern
    }

    /// The broker whose events the subscription takes now (it changes when that broker
    /// goes away).
    pub fn events_broker(&self) -> Option<EndpointId> {
        self.source().map(|(broker, _)| broker)
    }

    /// What the broker's events come on now: `Shm`, the same-host socket of a broker on
    /// this host, or `Quic`.
    pub fn events_channel(&self) -> tb_proto::ChannelKind {
        self.source()
            .map_or(tb_proto::ChannelKind::Quic, |(_, channel)| channel)
    }

    /// The broker of the stream the reader holds, and its channel.
    fn source(&self) -> Option<(EndpointId, tb_proto::ChannelKind)> {
        *self.shared.source.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next event; `Some(Err(_))` once if the subscription ended with an error (no broker
    /// could be reached again, the broker refused it, the node shut down), then `None`.
    pub async fn next(&mut self) -> Option<Result<SubEvent>> {
        self.events.recv().await
    }

    /// Like [`next`](Self::next), but `Some(Err(Error::Timeout))` when nothing came within
    /// `timeout`; the subscription goes on after a timeout.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Option<Result<SubEvent>> {
        match tokio::time::timeout(timeout, self.events.recv()).await {
            Ok(event) => event,
            Err(_) => Some(Err(Error::timeout(
                format!("an event for \"{}\"", self.pattern),
                timeout,
            ))),
        }
    }
}

/// The feed both tasks share, and the bell the reader rings.
#[derive(Debug, Default)]
struct Shared {
    feed: std::sync::Mutex<Feed>,
    wake: Notify,
    /// The broker of the stream the reader holds, and the channel it is on.
    source: std::sync::Mutex<Option<(EndpointId, tb_proto::ChannelKind)>>,
}

impl Shared {
    /// Changes the feed with news and rings the bell (the reader's side).
    fn update<R>(&self, f: impl FnOnce(&mut Feed) -> R) -> R {
        let result = self.with(f);
        self.wake.notify_one();
        result
    }

    /// Uses the feed without ringing (the deliverer's side: ringing for its own changes would
    /// wake it at once, forever).
    fn with<R>(&self, f: impl FnOnce(&mut Feed) -> R) -> R {
        f(&mut self.feed.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// An open `Subscribe` stream and the broker it goes to.
struct Stream {
    source: Source,
    broker: EndpointId,
}

/// What a subscription's events come on.
enum Source {
    /// A stream of the broker's QUIC ctl link.
    Quic {
        _send: SendStream,
        recv: RecvStream,
        /// The link the stream is on, probed when the stream has been quiet a while.
        conn: Connection,
    },
    /// A same-host socket connection of its own (a broker on this host): a broker that dies
    /// closes it; one that froze is found by a probe on the socket when the stream has been
    /// quiet a while.
    #[cfg(target_os = "linux")]
    Socket(crate::channel::ShmStream),
}

/// Opens a subscription to `pattern` for `node`.
pub(crate) async fn start(
    node: &Node,
    cluster: &Arc<Cluster>,
    pattern: NamePattern,
) -> Result<Subscription> {
    let stream = open(cluster, &pattern).await?;
    let (live, _) = list_matching(cluster, &pattern).await?;
    let shared = Arc::new(Shared::default());
    shared.with(|f| f.baseline(live.into_iter().map(|e| (e.name, e.version))));
    let ctx = node.ctx();
    let stop = ctx.cancel.child_token();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let reader = Reader {
        cluster: cluster.clone(),
        pattern: pattern.clone(),
        shared: shared.clone(),
        stop: stop.clone(),
        max_tensor_bytes: ctx.config.max_tensor_bytes,
        watching: Watching::new(node, cluster.clone(), shared.clone(), stop.clone()),
    };
    ctx.tracker.spawn(reader.run(stream));
    let auto_fetch = ctx.config.auto_fetch;
    let deliverer = Deliverer {
        node: node.downgrade(),
        shared: shared.clone(),
        tx,
        stop: stop.clone(),
        auto_fetch,
    };
    ctx.tracker.spawn(deliverer.run());
    Ok(Subscription {
        pattern,
        events: rx,
        shared,
        _stop: stop.drop_guard(),
    })
}

/// Opens a `Subscribe` stream and waits for the broker's `Ok`, which it sends once the
/// subscription is registered: every version published after this returns is told on the
/// stream (and the listing that follows covers everything before). A broker that is shutting
/// down or answers nothing usable is avoided and the next one tried; a refusal (too many
/// subscriptions) is the caller's error.
async fn open(cluster: &Cluster, pattern: &NamePattern) -> Result<Stream> {
    let request = CtlRequest::Subscribe {
        pattern: pattern.clone(),
    };
    let timeout = cluster.request_timeout;
    #[cfg(target_os = "linux")]
    if let Some(opened) = open_on_same_host(cluster, &request).await {
        return opened;
    }
    let mut last = None;
    for _ in 0..cluster.ctl.broker_count().max(1) {
        let (send, mut recv, conn) = cluster.ctl.open_stream(&request, timeout).await?;
        let broker = conn.remote_id();
        let label = broker.fmt_short().to_string();
        let max = cluster.ctl.max_tensor_bytes();
        let failure = match read_response(&mut recv, &label, timeout, max).await {
            Ok(CtlResponse::Ok) => {
                let source = Source::Quic {
                    _send: send,
                    recv,
                    conn,
                };
                return Ok(Stream { source, broker });
            }
            Ok(CtlResponse::Error { code, message }) => match answer_error(label, code, message) {
                Failure::Answered(e) => return Err(e),
                Failure::Unusable(e) => e,
            },
            Ok(_) => Error::Io(format!(
                "broker {label} answered a subscription with something other than Ok"
            )),
            Err(e) => e,
        };
        debug!(%failure, "subscription not registered; trying the next broker");
        cluster.ctl.avoid(&broker);
        last = Some(failure);
    }
    Err(last.unwrap_or(Error::NoBroker {
        tried: 0,
        failures: Vec::new(),
    }))
}

/// A subscription on the same-host socket of the broker [`open`] would ask first, when it
/// is known to be on this host (see `cluster/same_host.rs`); `None`: open it over QUIC.
#[cfg(target_os = "linux")]
async fn open_on_same_host(cluster: &Cluster, request: &CtlRequest) -> Option<Result<Stream>> {
    let timeout = cluster.request_timeout;
    let opened = cluster.ctl.subscribe_on_same_host(request, timeout).await?;
    Some(opened.map(|(conn, broker)| Stream {
        source: Source::Socket(conn),
        broker,
    }))
}

/// The live names matching `pattern`, and whether the listing is complete (under the limit).
async fn list_matching(
    cluster: &Cluster,
    pattern: &NamePattern,
) -> Result<(Vec<ListedEntry>, bool)> {
    let prefix = match pattern {
        NamePattern::Exact(name) => name.as_str(),
        NamePattern::Prefix(prefix) => prefix.as_str(),
    };
    let timeout = cluster.request_timeout;
    let mut entries = cluster.ctl.list(prefix, MAX_LIST_LIMIT, timeout).await?;
    let complete = entries.len() < MAX_LIST_LIMIT as usize;
    entries.retain(|e| pattern.matches(&e.name));
    Ok((entries, complete))
}

/// How reading one stream ended.
enum Ended {
    /// The subscription was dropped or the node stops.
    Stopped,
    /// The broker refused the subscription: it ends with this error.
    Refused(Error),
    /// The stream or its broker went away: subscribe again.
    Lost(Error),
    /// A subscription on the same-host socket replaces the stream, which was on QUIC.
    Moved(Stream),
}

/// The reader task's state.
struct Reader {
    cluster: Arc<Cluster>,
    pattern: NamePattern,
    shared: Arc<Shared>,
    stop: CancellationToken,
    max_tensor_bytes: u64,
    /// Watch streams to the publishers of the names heard of (small versions in one hop).
    watching: Arc<Watching>,
}

impl Reader {
    async fn run(self, mut stream: Stream) {
        loop {
            let lost = match self.read(&mut stream).await {
                Ended::Stopped => return,
                Ended::Refused(e) => return self.shared.update(|f| f.fail(e)),
                Ended::Lost(e) => e,
                Ended::Moved(moved) => {
                    debug!(pattern = %self.pattern, "subscription moved to the same-host socket");
                    // Events the old stream still had on the way are read from it; if it
                    // does not end in time, a listing tells what they told.
                    let old = std::mem::replace(&mut stream, moved);
                    if !self.drain(old).await {
                        self.catch_up().await;
                    }
                    continue;
                }
            };
            debug!(pattern = %self.pattern, %lost, "subscription stream lost; subscribing again");
            self.cluster.ctl.avoid(&stream.broker);
            // A same-host broker's socket closes when its process ends; its QUIC link to
            // this node is dead then too, though nothing on it says so yet.
            if !matches!(stream.source, Source::Quic { .. }) {
                self.cluster.ctl.close_link(&stream.broker);
            }
            stream = match self.resubscribe().await {
                Ok(Some(stream)) => stream,
                Ok(None) => return,
                Err(e) => return self.shared.update(|f| f.fail(e)),
            };
            self.catch_up().await;
        }
    }

    /// Lists the matching names after a new stream was opened, so that what was missed
    /// meanwhile becomes news, gaps included.
    async fn catch_up(&self) {
        match list_matching(&self.cluster, &self.pattern).await {
            Ok((entries, complete)) => {
                let listing = entries
                    .into_iter()
                    .map(|e| (e.name, e.version, e.meta))
                    .collect();
                self.shared.update(|f| f.caught_up(listing, complete));
            }
            // Missed versions still show as skipped when the next one comes.
            Err(e) => warn!(pattern = %self.pattern, %e, "could not catch up on a new stream"),
        }
    }

    /// Reads events from `stream` into the feed until it ends.
    async fn read(&self, stream: &mut Stream) -> Ended {
        let broker = stream.broker.fmt_short().to_string();
        let channel = match stream.source {
            Source::Quic { .. } => tb_proto::ChannelKind::Quic,
            #[cfg(target_os = "linux")]
            Source::Socket(_) => tb_proto::ChannelKind::Shm,
        };
        *self.shared.source.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((stream.broker, channel));
        // A quiet stream is probed now and then: its broker may have died without closing
        // the link (SIGKILL), which QUIC would notice only at its idle timeout.
        let every = self.cluster.heartbeat_timeout;
        let mut quiet = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        quiet.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A stream on QUIC looks now and then whether its broker turned out to be on this
        // host (found in the background), and moves to the socket if so.
        let mut look = tokio::time::interval_at(tokio::time::Instant::now() + MOVE_LOOK, MOVE_LOOK);
        let mut looks = 0;
        loop {
            let frame = match &mut stream.source {
                Source::Quic { recv, conn, .. } => {
                    // The read is never dropped half-way (not cancel-safe): a probe only
                    // pauses it, and a move drops the whole stream.
                    let read = wire::read_frame::<CtlResponse>(recv);
                    tokio::pin!(read);
                    loop {
                        tokio::select! {
                            _ = self.stop.cancelled() => return Ended::Stopped,
                            frame = &mut read => break frame.map_err(|e| {
                                Error::from(e.into_error(&format!(
                                    "subscription stream from broker {broker}"
                                )))
                            }),
                            _ = quiet.tick() => {
                                if let Err(e) = self.cluster.ctl.probe(conn, every).await {
                                    return Ended::Lost(e);
                                }
                            }
                            _ = look.tick(), if cfg!(target_os = "linux") && looks < MOVE_LOOKS => {
                                looks += 1;
                                if let Some(moved) = self.on_socket_now().await {
                                    return Ended::Moved(moved);
                                }
                            }
                        }
                    }
                }
                #[cfg(target_os = "linux")]
                Source::Socket(conn) => {
                    let max = self.max_tensor_bytes;
                    let read = crate::channel::shm_read_event(conn, &broker, max);
                    tokio::pin!(read);
                    loop {
                        tokio::select! {
                            _ = self.stop.cancelled() => return Ended::Stopped,
                            frame = &mut read => break frame,
                            _ = quiet.tick() => {
                                let probe = self.cluster.ctl.probe_on_same_host(&stream.broker, every);
                                if let Err(e) = probe.await {
                                    return Ended::Lost(e);
                                }
                            }
                        }
                    }
                }
            };
            quiet.reset();
            if let Some(ended) = self.take(frame, &broker) {
                return ended;
            }
        }
    }

    /// Puts one frame read from a stream of `broker` into the feed; `Some`: the stream ends.
    fn take(&self, frame: Result<CtlResponse>, broker: &str) -> Option<Ended> {
        let frame = frame.and_then(|f| check_response(f, broker, self.max_tensor_bytes));
        match frame {
            Err(e) => return Some(Ended::Lost(e)),
            Ok(CtlResponse::Event(Event::Published {
                name,
                version,
                meta,
                publisher,
            })) if self.pattern.matches(&name) => {
                // Its bytes may be on the way on a same-host watch already.
                if self.watching.offers_all(&name, publisher) {
                    self.shared
                        .update(|f| f.published_expected(&name, version, meta));
                } else {
                    self.shared.update(|f| f.published(&name, version, meta));
                }
                // Its next large versions can come straight from a publisher on this host.
                self.watching.heard(&name, publisher, Reach::SameHost);
            }
            Ok(CtlResponse::Event(Event::PublishedInline {
                name,
                version,
                meta,
                bytes,
                publisher,
            })) if self.pattern.matches(&name) => {
                // Checked against `meta` (length and hash) by `check_response`.
                let inline = Some(Tensor::from_verified(meta.clone(), Bytes::from(bytes)));
                self.shared
                    .update(|f| f.published_with(&name, version, meta, inline));
                // Its next small versions can come straight from their publisher.
                self.watching.heard(&name, publisher, Reach::Any);
            }
            Ok(CtlResponse::Event(Event::Deleted { name })) if self.pattern.matches(&name) => {
                self.shared.update(|f| f.deleted(&name));
            }
            // Events for other names are not ours (the `Ok` was read by `open`).
            Ok(CtlResponse::Event(_)) => {}
            Ok(CtlResponse::Error { code, message }) => {
                return Some(match answer_error(broker.to_owned(), code, message) {
                    Failure::Answered(e) => Ended::Refused(e),
                    Failure::Unusable(e) => Ended::Lost(e),
                });
            }
            Ok(_) => {
                let e = Error::Io(format!(
                    "broker {broker} sent a non-event on a subscription"
                ));
                return Some(Ended::Lost(e));
            }
        }
        None
    }

    /// Reads what a stream on QUIC that a socket one replaced still has on the way: it ends
    /// its side (the broker's unsubscribe), so the broker finishes its own after the last
    /// event it sent, and every event up to that end is taken as any. Whether the stream
    /// ended within [`DRAIN`]: if not, what it had may be lost, and a listing tells it.
    async fn drain(&self, old: Stream) -> bool {
        let Source::Quic {
            _send: mut send,
            mut recv,
            ..
        } = old.source
        else {
            return true;
        };
        let _ = send.finish();
        let broker = old.broker.fmt_short().to_string();
        let deadline = tokio::time::Instant::now() + DRAIN;
        loop {
            let read = wire::read_frame::<CtlResponse>(&mut recv);
            let frame = tokio::select! {
                _ = self.stop.cancelled() => return true,
                _ = tokio::time::sleep_until(deadline) => return false,
                frame = read => frame,
            };
            match frame {
                // The broker's end: everything it sent was read.
                Err(wire::ReadFrameError::Closed(_)) => return true,
                frame => {
                    let frame = frame.map_err(|e| {
                        Error::from(
                            e.into_error(&format!("subscription stream from broker {broker}")),
                        )
                    });
                    if self.take(frame, &broker).is_some() {
                        return false;
                    }
                }
            }
        }
    }

    /// A subscription on the same-host socket, when the broker asked first is now known to
    /// be on this host; `None` otherwise (or when opening it failed: the stream on QUIC
    /// carries on).
    async fn on_socket_now(&self) -> Option<Stream> {
        #[cfg(target_os = "linux")]
        {
            if !self.cluster.ctl.first_broker_is_local() {
                return None;
            }
            let request = CtlRequest::Subscribe {
                pattern: self.pattern.clone(),
            };
            match open_on_same_host(&self.cluster, &request).await? {
                Ok(stream) => Some(stream),
                Err(e) => {
                    debug!(pattern = %self.pattern, %e, "subscription stays on QUIC");
                    None
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// Subscribes again, with backoff; `None` when stopped meanwhile.
    async fn resubscribe(&self) -> Result<Option<Stream>> {
        let mut backoff = FIRST_BACKOFF;
        let mut last = None;
        for _ in 0..RESUBSCRIBE_TRIES {
            tokio::select! {
                _ = self.stop.cancelled() => return Ok(None),
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let opened = tokio::select! {
                _ = self.stop.cancelled() => return Ok(None),
                opened = open(&self.cluster, &self.pattern) => opened,
            };
            match opened {
                Ok(stream) => return Ok(Some(stream)),
                Err(e @ Error::Shutdown) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(Error::NoBroker {
            tried: 0,
            failures: Vec::new(),
        }))
    }
}

/// The delivery task's state.
struct Deliverer {
    node: WeakNode,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Result<SubEvent>>,
    stop: CancellationToken,
    auto_fetch: bool,
}

impl Deliverer {
    /// Takes the feed's next item, fetches it with auto-fetch, and hands it on, until the
    /// subscription ends.
    async fn run(self) {
        while let Some(next) = self.wait_next().await {
            let events = match next {
                Next::Failed(e) => {
                    let _ = self.tx.send(Err(e)).await;
                    return;
                }
                Next::Deleted { name } => {
                    self.shared.with(|f| f.told_deleted(&name));
                    vec![SubEvent::Deleted { name }]
                }
                Next::Version {
                    name,
                    version,
                    meta,
                    skipped,
                    inline,
                } => match self.version(name, version, meta, skipped, inline).await {
                    Some(events) => events,
                    None => return,
                },
            };
            for event in events {
                if self.tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        }
    }

    /// The feed's next item; `None` once the subscription is dropped or the node stops.
    async fn wait_next(&self) -> Option<Next> {
        loop {
            // Popping changes nothing another task waits for: no wake-up (a wake-up here
            // would stay stored and make `notified()` below ready at once, a busy loop).
            let popped = self
                .shared
                .feed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop();
            if let Some(next) = popped {
                return Some(next);
            }
            tokio::select! {
                _ = self.stop.cancelled() => return None,
                _ = self.tx.closed() => return None,
                () = self.shared.wake.notified() => {}
            }
        }
    }

    /// The events telling `version` of `name` (fetched with auto-fetch), after the versions
    /// `skipped` before it; `None` when stopped.
    async fn version(
        &self,
        name: TensorName,
        version: u64,
        meta: TensorMeta,
        skipped: Option<(u64, u64)>,
        inline: Option<Carried>,
    ) -> Option<Vec<SubEvent>> {
        let carried = match (self.auto_fetch, inline) {
            (true, Some(carried)) => self.bytes_of(carried).await?,
            _ => None,
        };
        let tensor = match (self.auto_fetch, carried) {
            (false, _) => None,
            // The version came with the event or a watch, checked against its metadata: no
            // look-up, no pull (and this node does not become a holder of a copy it did not
            // ask for).
            (true, Some(tensor)) => Some(tensor),
            (true, None) => match fetch(&self.node, &self.stop, &name, version).await {
                Fetched::Tensor(t) => Some(t),
                Fetched::Stopped => return None,
                Fetched::Failed(_) if self.shared.with(|f| f.has_newer(&name, version)) => {
                    // Reported as skipped before the newer version.
                    self.shared.with(|f| f.untold(&name, version, skipped));
                    return Some(Vec::new());
                }
                Fetched::Failed(e) => {
                    warn!(%name, version, %e, "subscription could not fetch a version");
                    self.shared.with(|f| f.told_version(&name, version));
                    let from = skipped.map_or(version, |(from, _)| from);
                    let to = version;
                    return Some(vec![SubEvent::Skipped { name, from, to }]);
                }
            },
        };
        self.shared.with(|f| f.told_version(&name, version));
        let skipped = skipped.map(|(from, to)| SubEvent::Skipped {
            name: name.clone(),
            from,
            to,
        });
        let told = SubEvent::Version {
            name,
            version,
            meta,
            tensor,
        };
        Some(skipped.into_iter().chain([told]).collect())
    }

    /// The bytes that came, or are coming, with a version's news; `Some(None)` when they do
    /// not come (the subscription fetches the version), `None` when the subscription stopped.
    async fn bytes_of(&self, carried: Carried) -> Option<Option<Tensor>> {
        let carried = match carried {
            // Its offer lost the race to the broker's event (or was never sent: a watcher
            // with an offer pending gets no other): it comes within `WATCH_GRACE` or not at
            // all, and the version is fetched.
            Carried::Expected(rx) => tokio::select! {
                _ = self.stop.cancelled() => return None,
                got = tokio::time::timeout(WATCH_GRACE, rx) => match got {
                    Ok(Ok(carried)) => carried,
                    Ok(Err(_)) | Err(_) => return Some(None),
                },
            },
            carried => carried,
        };
        match carried {
            Carried::Here(tensor) => Some(Some(tensor)),
            // Still arriving on a same-host watch (bounded by its stall timeout): fetched
            // only if that read fails.
            Carried::Coming(rx) => tokio::select! {
                _ = self.stop.cancelled() => None,
                got = rx => Some(got.ok()),
            },
            Carried::Expected(_) => Some(None),
        }
    }
}

/// What fetching one version for a subscriber came to.
enum Fetched {
    Tensor(Tensor),
    Failed(Error),
    Stopped,
}

async fn fetch(
    node: &WeakNode,
    stop: &CancellationToken,
    name: &TensorName,
    version: u64,
) -> Fetched {
    let Some(node) = node.upgrade() else {
        return Fetched::Stopped;
    };
    // The event says the version exists, but the broker answering the look-up may not know a
    // live holder yet: with several brokers, the publish can reach it by gossip before the
    // holder mark or the publisher's row does. So "not found" is asked again a few times,
    // with growing pauses (bounded: NOT_FOUND_RETRIES tries, ~1.5 s in all).
    let mut pause = NOT_FOUND_PAUSE;
    for attempt in 0..=NOT_FOUND_RETRIES {
        let got = tokio::select! {
            _ = stop.cancelled() => return Fetched::Stopped,
            got = node.get_version(name.as_str(), version) => got,
        };
        match got {
            Ok(pulled) => return Fetched::Tensor(pulled.buffer),
            Err(Error::Shutdown) => return Fetched::Stopped,
            Err(Error::NotFound { .. }) if attempt < NOT_FOUND_RETRIES => {
                tokio::select! {
                    _ = stop.cancelled() => return Fetched::Stopped,
                    () = tokio::time::sleep(pause) => {}
                }
                pause *= 2;
            }
            Err(e) => return Fetched::Failed(e),
        }
    }
    Fetched::Failed(Error::Io(format!("fetching \"{name}\" v{version}")))
}

/// Look-ups again after "not found" for a version an event announced, at most.
const NOT_FOUND_RETRIES: u32 = 5;
/// The pause before the first of them (doubling after each).
const NOT_FOUND_PAUSE: Duration = Duration::from_millis(50);
