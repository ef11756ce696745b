//! The table of request services on `tb/data/1`: a kind nobody serves is answered
//! `Unsupported`, a service added from outside tb-node answers its kind, and a built-in taken
//! out can be put back. Over QUIC only: the same-host shm socket is a channel of the
//! built-ins, not a link served through the table.

use std::{sync::Arc, time::Duration};

use tb_node::{
    Config, Error, Node, ServeCtx, Service, ServiceFuture, ServiceStream,
    proto::{ChannelKind, DataRequest, DataResponse, ErrorCode, RequestKind},
};
use tb_tests::{f32_tensor, node, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);

fn quic_only() -> Config {
    Config {
        channels: vec![ChannelKind::Quic],
        ..test_config()
    }
}

/// A pull service of a test's own: it answers every pull with a `Busy` error naming itself
/// and the tensor asked for.
struct Refusing;

impl Service for Refusing {
    fn serve<'a>(&'a self, node: &'a ServeCtx, mut stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let DataRequest::Pull { name, .. } = &stream.request else {
                return;
            };
            let answer = DataResponse::Error {
                code: ErrorCode::Busy,
                message: format!("the test's own service refuses \"{name}\""),
            };
            let write = tb_node::framing::write_frame(&mut stream.send, &answer);
            let _ = tokio::time::timeout(node.stall_timeout(), write).await;
            let _ = stream.send.finish();
        })
    }
}

async fn pull_error(from: &Node, holder: &Node) -> Error {
    match within(LIMIT, "pull", from.pull(holder.addr(), "t", None)).await {
        Ok(_) => panic!("the pull was served"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_nobody_serves_is_unsupported_and_a_service_from_outside_answers_its_kind() {
    let holder = node(quic_only()).await;
    let puller = node(quic_only()).await;
    let tensor = f32_tensor(1024, 3);
    holder.publish_local("t", tensor.clone()).expect("publish");

    // Built-in kinds are taken: a second pull service is refused.
    let taken = holder.add_service(RequestKind::Pull, Arc::new(Refusing));
    assert!(matches!(taken, Err(Error::InUse(_))), "{taken:?}");

    // Taken out: a pull is answered Unsupported, on a link that goes on serving.
    let builtin = holder
        .remove_service(RequestKind::Pull)
        .expect("pull is served");
    match pull_error(&puller, &holder).await {
        Error::Remote { code, message, .. } => {
            assert_eq!(code, ErrorCode::Unsupported, "{message}");
            assert!(message.contains("pull"), "{message}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(holder.remove_service(RequestKind::Pull).is_none());

    // A service from outside tb-node answers the kind.
    holder
        .add_service(RequestKind::Pull, Arc::new(Refusing))
        .expect("the kind is free");
    match pull_error(&puller, &holder).await {
        Error::Remote { code, message, .. } => {
            assert_eq!(code, ErrorCode::Busy);
            assert!(message.contains("the test's own service"), "{message}");
            assert!(message.contains("\"t\""), "{message}");
        }
        other => panic!("expected the service's refusal, got {other:?}"),
    }

    // The built-in put back serves the bytes again, on the same pooled link.
    holder.remove_service(RequestKind::Pull).expect("ours");
    holder
        .add_service(RequestKind::Pull, builtin)
        .expect("the kind is free");
    let pulled = within(LIMIT, "pull", puller.pull(holder.addr(), "t", None))
        .await
        .expect("pull");
    assert_eq!(pulled.buffer.data(), tensor.data(), "bytes equal");
    assert_eq!(puller.pool_size(), 1, "one link all along");

    puller.shutdown().await;
    holder.shutdown().await;
}
