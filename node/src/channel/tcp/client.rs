//! The pulling side of the TCP channel: a ticket on the QUIC link, then the payload over
//! one or more sockets, each share hashed as it lands and finished over QUIC if its socket
//! fails.

use std::{net::SocketAddr, time::Duration};

use iroh::endpoint::RecvStream;
use tb_dashboard::{Direction, Meter};
use tb_proto::{
    ByteRange, ChannelKind, DataRequest, DataResponse, TcpHello, TensorMeta, TensorName, frame,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tracing::debug;

use super::{SOCKETS, TcpRoute, sockets_for};
use crate::{
    channel::{
        Channel, ChannelError,
        quic::{self, Striped},
        verify::{PieceHash, Pieces, RunHasher, VerifyError},
    },
    client::{self, Pulled},
    ctx::NodeCtx,
    error::{Error, Result},
    wire,
};

/// Pieces (hashed subtrees) per socket's share.
const PIECES_PER_SOCKET: usize = 4;
/// Bytes hashed at once: large enough for the blake3 crate to spread them over cores.
const HASH_BATCH: usize = 1 << 20;

/// What one socket's share came to.
struct Share {
    /// Bytes that came over TCP.
    reached: u64,
    /// Whether the rest came over QUIC.
    fell_back: bool,
    /// The share's piece hashes.
    hashes: Vec<PieceHash>,
}

/// How the holder answered a TCP pull: the version, and where its payload comes from.
struct Answer {
    meta: TensorMeta,
    version: u64,
    via: Via,
}

enum Via {
    /// A ticket: the payload over TCP sockets presenting this token.
    Tcp([u8; 32]),
    /// A plain QUIC answer (a small tensor, a version still arriving, ...): the payload
    /// follows on the ticket's own stream.
    Quic(RecvStream),
}

impl Channel for TcpRoute {
    async fn pull_into<B, F>(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>, ChannelError>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send,
    {
        let what = describe(name, version, self);
        let Answer { meta, version, via } = self.ask(ctx, name, version, &what).await?;
        let mut buffer = alloc(&meta).map_err(ChannelError::Final)?;
        let dest = buffer.as_mut();
        if dest.len() as u64 != meta.byte_len {
            return Err(ChannelError::Final(Error::InvalidTensor(format!(
                "destination buffer has {} bytes, the tensor {}",
                dest.len(),
                meta.byte_len
            ))));
        }
        let by_tcp = match via {
            Via::Tcp(token) => {
                let striped = Striped {
                    link: &self.link,
                    name,
                    version,
                    meta: &meta,
                    what: &what,
                };
                let received = self.receive(ctx, &striped, &token, dest).await;
                received.map_err(ChannelError::Final)?
            }
            Via::Quic(mut recv) => {
                let watchdog = ctx.quic_watchdog(Direction::In);
                let hash = wire::recv_payload(&mut recv, dest, watchdog).await;
                let hash = hash.map_err(ChannelError::Final)?;
                if hash != meta.hash {
                    let expected = meta.hash;
                    let err = format!("{what}: expected hash {expected}, got {hash}");
                    return Err(ChannelError::Final(Error::Corrupt(err)));
                }
                0
            }
        };
        // The bytes were counted as they moved, on the channel that carried each.
        let carried = if by_tcp > 0 {
            ChannelKind::Tcp
        } else {
            ChannelKind::Quic
        };
        ctx.metrics.channels.finished(carried);
        Ok(Pulled {
            name: name.clone(),
            version,
            meta,
            buffer,
        })
    }
}

impl TcpRoute {
    /// Asks the peer for the tensor on the QUIC link: a ticket, or the payload right there.
    /// A link that fails before any answer leaves the pull to QUIC; errors the peer answers
    /// are the pull's.
    async fn ask(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
        what: &str,
    ) -> Result<Answer, ChannelError> {
        let request = DataRequest::TcpPull {
            name: name.clone(),
            version,
            sockets: SOCKETS,
        };
        let asked = async {
            let (mut send, mut recv) = client::open(ctx, &self.link).await?;
            wire::write_frame(&mut send, &request).await?;
            let _ = send.finish();
            let answer = client::read_response(ctx, &mut recv, what).await?;
            Ok::<_, Error>((answer, recv))
        };
        let (answer, recv) = asked.await.map_err(|err| {
            debug!(%err, "{what}: no answer: pulling over QUIC");
            ChannelError::ViaQuic
        })?;
        let (meta, version, via) = match answer {
            DataResponse::TcpTicket {
                meta,
                version,
                token,
            } => (meta, version, Via::Tcp(token)),
            DataResponse::Header { meta, version } => (meta, version, Via::Quic(recv)),
            DataResponse::Error { code, message } => {
                let err = client::remote_error(&self.link, code, message);
                return Err(ChannelError::Final(err));
            }
            other => {
                let err = format!("{what}: unexpected answer to a TcpPull: {other:?}");
                return Err(ChannelError::Final(Error::Io(err)));
            }
        };
        let max = ctx.config.max_tensor_bytes;
        meta.validate(max)
            .map_err(|e| ChannelError::Final(e.into()))?;
        Ok(Answer { meta, version, via })
    }

    /// Receives the payload into `dest` over [`sockets_for`] sockets, each share hashed as
    /// it lands and finished over QUIC when its socket fails; checks the merged root. Bytes
    /// that do not hash to the ticket's root (tampered on the wire, or a fault TCP's checksum
    /// missed) are pulled again, whole, over QUIC; only a second mismatch is `Corrupt`.
    /// Returns the bytes that came over TCP and stayed (0 after such a re-pull). A transfer
    /// that fell back is counted once in `tb_channel_fallbacks_total{channel="tcp"}`.
    async fn receive(
        &self,
        ctx: &NodeCtx,
        pull: &Striped<'_>,
        token: &[u8; 32],
        dest: &mut [u8],
    ) -> Result<u64> {
        let len = dest.len() as u64;
        let sockets = sockets_for(len);
        let pieces = Pieces::split(len, sockets * PIECES_PER_SOCKET);
        let mut rest = &mut *dest;
        let mut shares = Vec::with_capacity(sockets);
        for run in pieces.group(sockets) {
            let span = pieces.span(&run);
            let (mine, tail) = rest.split_at_mut((span.end - span.start) as usize);
            rest = tail;
            let hasher = RunHasher::new(&pieces, run);
            let share = ByteRange {
                offset: span.start,
                len: span.end - span.start,
            };
            shares.push(self.receive_share(ctx, pull, token, share, mine, hasher));
        }
        let (mut by_tcp, mut fell_back) = (0, false);
        let mut hashes: Vec<PieceHash> = Vec::new();
        for share in n0_future::try_join_all(shares).await? {
            by_tcp += share.reached;
            fell_back |= share.fell_back;
            hashes.extend(share.hashes);
        }
        let fallback = || ctx.metrics.channels.fallback(ChannelKind::Tcp);
        match pieces.verify(hashes, pull.meta.hash) {
            Ok(_) => {
                if fell_back {
                    fallback();
                }
                Ok(by_tcp)
            }
            Err(VerifyError::Mismatch { .. }) => {
                debug!(
                    "{}: TCP bytes did not verify: pulling them again over QUIC",
                    pull.what
                );
                ctx.channels.failed(&self.peer(), ChannelKind::Tcp);
                fallback();
                let whole = Pieces::split(len, 1);
                let hasher = RunHasher::new(&whole, 0..1);
                let all = ByteRange { offset: 0, len };
                let hashes = quic::pull_range(ctx, pull, all, dest, hasher).await?;
                let verified = whole.verify(hashes, pull.meta.hash);
                verified.map_err(|e| quic::verify_error(pull.what, e))?;
                Ok(0)
            }
            Err(err) => Err(quic::verify_error(pull.what, err)),
        }
    }

    /// One socket's share: over TCP, and the rest over QUIC from where the socket failed. A
    /// socket that could not even start (nothing reached: the port is unreachable from here,
    /// or refused us) withdraws TCP for the peer; one cut part-way only falls back.
    async fn receive_share(
        &self,
        ctx: &NodeCtx,
        pull: &Striped<'_>,
        token: &[u8; 32],
        share: ByteRange,
        dest: &mut [u8],
        mut hasher: RunHasher,
    ) -> Result<Share> {
        let stall = ctx.config.stall_timeout;
        let connect = ctx.config.connect_timeout;
        let hello = TcpHello {
            token: *token,
            range: share,
        };
        let meter = ctx.metrics.meter(ChannelKind::Tcp, Direction::In);
        let (reached, outcome) = recv_socket(
            self.addr,
            &hello,
            dest,
            &mut hasher,
            &meter,
            (connect, stall),
        )
        .await;
        if let Err(err) = outcome {
            debug!(%err, reached, "{}: TCP socket failed: the rest over QUIC", pull.what);
            if reached == 0 {
                ctx.channels.failed(&self.peer(), ChannelKind::Tcp);
            }
            let rest = ByteRange {
                offset: share.offset + reached as u64,
                len: share.len - reached as u64,
            };
            let hashes = quic::pull_range(ctx, pull, rest, &mut dest[reached..], hasher).await?;
            return Ok(Share {
                reached: reached as u64,
                fell_back: true,
                hashes,
            });
        }
        let hashes = hasher.finish();
        let hashes = hashes.map_err(|e| quic::verify_error(pull.what, e))?;
        Ok(Share {
            reached: reached as u64,
            fell_back: false,
            hashes,
        })
    }
}

/// Connects to `addr` (within `connect`), presents `hello` and reads its range into `dest`
/// (each read within `stall`), hashing as the bytes land and counting them on `meter`;
/// returns how many bytes arrived (all hashed) and whether the socket held.
async fn recv_socket(
    addr: SocketAddr,
    hello: &TcpHello,
    dest: &mut [u8],
    hasher: &mut RunHasher,
    meter: &Meter,
    (connect, stall): (Duration, Duration),
) -> (usize, Result<()>) {
    let (mut filled, mut hashed) = (0, 0);
    let received = async {
        let mut stream = match tokio::time::timeout(connect, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(Error::io(&format!("connecting to {addr}"), e)),
            Err(_) => {
                return Err(Error::timeout(
                    format!("a TCP connection to {addr}"),
                    connect,
                ));
            }
        };
        let _ = stream.set_nodelay(true);
        let hello = frame::encode(hello).map_err(|e| Error::Io(e.to_string()))?;
        let io = |e| Error::io("on a TCP channel socket", e);
        match tokio::time::timeout(connect, stream.write_all(&hello)).await {
            Ok(written) => written.map_err(io)?,
            Err(_) => return Err(Error::timeout(format!("a TCP hello to {addr}"), connect)),
        }
        let total = dest.len();
        // Bounded: each round reads at least one byte or fails.
        while filled < total {
            let read = stream.read(&mut dest[filled..]);
            filled += match tokio::time::timeout(stall, read).await {
                Ok(Ok(0)) => {
                    return Err(Error::Io(format!(
                        "the TCP socket closed after {filled} of {total} bytes"
                    )));
                }
                Ok(Ok(n)) => {
                    meter.add(n as u64);
                    n
                }
                Ok(Err(e)) => return Err(io(e)),
                Err(_) => {
                    let what = format!("TCP channel bytes ({filled} of {total})");
                    return Err(Error::timeout(what, stall));
                }
            };
            if filled - hashed >= HASH_BATCH {
                hash(hasher, &dest[hashed..filled])?;
                hashed = filled;
            }
        }
        Ok(())
    }
    .await;
    // What arrived before a failure is hashed too: the QUIC fallback continues from it.
    let tail = hash(hasher, &dest[hashed..filled]);
    (filled, received.and(tail))
}

fn hash(hasher: &mut RunHasher, bytes: &[u8]) -> Result<()> {
    hasher.update(bytes).map_err(|e| Error::Io(e.to_string()))
}

fn describe(name: &TensorName, version: Option<u64>, route: &TcpRoute) -> String {
    let peer = route.peer().fmt_short();
    match version {
        Some(v) => format!("tensor \"{name}\" v{v} at {peer} (tcp)"),
        None => format!("tensor \"{name}\" at {peer} (tcp)"),
    }
}
