//! Which broker a call tries, in which order, and which failures move it on to the next one.
//! Pure: the transport lives in `ctl_client`.

use tb_proto::ErrorCode;

use crate::{
    client::remote_error_from,
    error::{BrokerFailure, Error},
};

/// Broker indices in the order one call tries them: the one that worked last, then the others
/// in list order (wrapping), each once.
pub(crate) fn order(current: usize, count: usize) -> impl Iterator<Item = usize> {
    let start = current.checked_rem(count).unwrap_or(0);
    (0..count).map(move |i| (start + i) % count)
}

/// [`order`], with the brokers in `lost` (their link closed since it last worked) moved to the
/// end, in the same relative order: a broker that went away is likely still away, and dialing
/// it first would cost a whole connect timeout before the call reaches a live one.
pub(crate) fn order_avoiding(current: usize, count: usize, lost: &[bool]) -> Vec<usize> {
    let is_lost = |i: usize| lost.get(i).copied().unwrap_or(false);
    let (mut live, gone): (Vec<usize>, Vec<usize>) =
        order(current, count).partition(|&i| !is_lost(i));
    live.extend(gone);
    live
}

/// Why one attempt at one broker did not succeed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The broker answered with an error: the call ends with it (another broker holds the same
    /// replicated registry and would say the same).
    Answered(Error),
    /// The broker could not be used (dial, hello, timeout, link lost, shutting down, an answer
    /// that breaks the protocol): try the next one.
    Unusable(Error),
}

/// Classifies an `Error` frame from `broker` (a short node id): a broker that is shutting down
/// is unusable, any other answer ends the call with the matching [`Error`] variant.
pub(crate) fn answer_error(broker: String, code: ErrorCode, message: String) -> Failure {
    match code {
        ErrorCode::ShuttingDown => Failure::Unusable(Error::Remote {
            peer: broker,
            code,
            message,
        }),
        code => Failure::Answered(remote_error_from(broker, code, message)),
    }
}

/// What a call ends with when every broker it tried was unusable: `Unauthorized` when each
/// of them refused our cluster secret (a configuration problem, not a network one), else
/// `NoBroker` naming each broker and why it failed.
pub(crate) fn exhausted(failures: Vec<BrokerFailure>) -> Error {
    let all_refused = !failures.is_empty()
        && failures
            .iter()
            .all(|f| matches!(f.error, Error::Unauthorized(_)));
    match failures.last() {
        Some(last) if all_refused => last.error.clone(),
        _ => Error::NoBroker {
            tried: failures.len(),
            failures,
        },
    }
}

/// Whether a broker's failure to connect ends the call instead of moving it on: a broker that
/// refused our cluster secret (every broker of a cluster shares it, and would refuse too), or
/// this client shutting down.
pub(crate) fn connect_failure(e: Error) -> Failure {
    match e {
        Error::Unauthorized(_) | Error::Shutdown => Failure::Answered(e),
        e => Failure::Unusable(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brokers_whose_link_was_lost_go_last() {
        assert_eq!(order_avoiding(0, 3, &[false; 3]), vec![0, 1, 2]);
        assert_eq!(order_avoiding(1, 3, &[false; 3]), vec![1, 2, 0]);
        assert_eq!(order_avoiding(0, 3, &[true, false, false]), vec![1, 2, 0]);
        assert_eq!(order_avoiding(2, 3, &[false, false, true]), vec![0, 1, 2]);
        assert_eq!(order_avoiding(0, 2, &[true, true]), vec![0, 1]);
        assert!(order_avoiding(0, 0, &[]).is_empty());
    }

    #[test]
    fn order_starts_at_the_current_broker_and_tries_each_once() {
        assert_eq!(order(0, 3).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(order(2, 3).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(order(7, 3).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(order(0, 1).collect::<Vec<_>>(), [0]);
        assert_eq!(order(5, 0).count(), 0);
    }

    #[test]
    fn broker_error_frames_map_onto_typed_errors() {
        let answered = |code| match answer_error("b0".into(), code, "tensor \"m/w\"".into()) {
            Failure::Answered(e) => e,
            Failure::Unusable(e) => panic!("{code:?} gave unusable {e}"),
        };
        assert!(
            matches!(answered(ErrorCode::NotFound), Error::NotFound { what } if what.contains("m/w"))
        );
        assert!(matches!(answered(ErrorCode::TooLarge), Error::TooLarge(_)));
        assert!(matches!(
            answered(ErrorCode::InvalidTensor),
            Error::InvalidTensor(_)
        ));
        assert!(matches!(
            answered(ErrorCode::Unauthorized),
            Error::Unauthorized(_)
        ));
        assert!(matches!(answered(ErrorCode::Corrupt), Error::Corrupt(_)));
        assert!(matches!(
            answered(ErrorCode::Busy),
            Error::Remote {
                code: ErrorCode::Busy,
                ..
            }
        ));
        assert!(matches!(
            answer_error("b0".into(), ErrorCode::ShuttingDown, String::new()),
            Failure::Unusable(_)
        ));
    }

    #[test]
    fn exhausted_names_each_broker_tried() {
        let failure = |broker: &str, error: Error| BrokerFailure {
            broker: broker.into(),
            error,
        };
        let unreachable = Error::PeerUnreachable {
            peer: "b1".into(),
            reason: "no connection within 5s".into(),
        };
        let refused = Error::Unauthorized("b0 refused our cluster secret".into());
        let mixed = vec![
            failure("b0@a", refused.clone()),
            failure("b1@b", unreachable),
        ];
        let e = exhausted(mixed);
        assert!(matches!(&e, Error::NoBroker { tried: 2, failures } if failures.len() == 2));
        let text = e.to_string();
        assert!(
            text.contains("b0@a (unauthorized") && text.contains("b1@b (peer b1"),
            "{text}"
        );
        let all_refused = vec![failure("b0@a", refused.clone()), failure("b1@b", refused)];
        assert!(matches!(exhausted(all_refused), Error::Unauthorized(_)));
        assert!(matches!(
            exhausted(vec![]),
            Error::NoBroker { tried: 0, .. }
        ));
        assert!(matches!(
            connect_failure(Error::Unauthorized(String::new())),
            Failure::Answered(_)
        ));
        assert!(matches!(
            connect_failure(Error::Io(String::new())),
            Failure::Unusable(_)
        ));
    }
}
