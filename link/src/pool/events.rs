//! [`LinkEvents`]: how the pool's owner hears of links, so the pool never names what runs on
//! them (tb-node's request services and channel exchange sit above this crate).
//!
//! The pool calls these from its own handlers and dial tasks, so none may wait on the pool:
//! [`serve`](LinkEvents::serve) and [`link_gone`](LinkEvents::link_gone) must return at once
//! (spawn what takes time), and [`dialed`](LinkEvents::dialed) runs in the dial's task, under
//! the request timeout, before the link is pooled.

use std::{future::Future, pin::Pin};

use iroh::{EndpointId, endpoint::Connection};
use tb_proto::Access;

use super::link::Link;

/// The future of [`LinkEvents::dialed`], boxed so the trait stays object safe (the pool holds
/// its owner's hooks as `Arc<dyn LinkEvents>`).
pub type EventFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What the pool's owner does with new and lost links.
pub trait LinkEvents: Send + Sync + 'static {
    /// A link we dialed passed the hello (its peer proved `access`) and is about to be
    /// pooled under `link_id`: the owner's first exchange on it (tb-node's channel offers).
    /// Bounded by [`LinkConfig::request_timeout`](crate::LinkConfig::request_timeout); a
    /// late or failed exchange never fails the dial.
    fn dialed<'a>(&'a self, conn: &'a Connection, access: Access, link_id: u64) -> EventFuture<'a>;

    /// Serve the streams the peer opens on a link we dialed, as far as its `access` allows.
    /// (Links the peer dialed are served by the owner's protocol handler, which asks the
    /// pool to [`adopt`](crate::Pool::adopt) them.) Must not wait: spawn the serving.
    fn serve(&self, link: Link, access: Access);

    /// `peer`'s link `link_id` is gone (closed, refused or never started); `successor` is the
    /// peer's pooled link now, if it has one.
    fn link_gone(&self, peer: EndpointId, link_id: u64, successor: Option<u64>);
}
