//! How a call runs across brokers, generic over what an attempt yields (so it is tested with
//! plain futures and paused time):
//! - [`staggered`]: the race of a call that needs one broker. The preferred broker first, the
//!   next one whenever the newest attempt has gone [`STAGGER`] without an outcome (or at once
//!   when one fails); the first success wins, and the losers are dropped, which cancels them.
//! - [`all_with_grace`]: a question asked of every broker (`tb status`): all at once, and
//!   [`EACH_GRACE`] for the others once one has answered.
//!
//! Racing with a short stagger instead of trying brokers one after another means a dead
//! broker listed first costs a call one stagger, not a whole connect timeout.

use std::{future::Future, time::Duration};

use n0_future::{FuturesUnordered, StreamExt};
use tokio::time::Instant;

use super::failover::Failure;
use crate::error::Error;

/// How long an attempt at one broker runs alone before the next broker is tried beside it: a
/// live broker on a LAN completes a dial and hello in a few ms, so a broker silent this long is
/// likely dead or far, and trying another costs at most one extra connection.
pub(crate) const STAGGER: Duration = Duration::from_millis(200);

/// How long a question asked of every broker at once waits for the others once one has
/// answered: live brokers answer within milliseconds of each other, a dead one not before its
/// connect timeout.
pub(crate) const EACH_GRACE: Duration = Duration::from_secs(1);

/// How a race ended without a winner.
#[derive(Debug)]
pub(crate) enum Lost {
    /// Broker `usize` gave a final answer (see [`Failure::Answered`]): the call ends with it.
    Answered(usize, Error),
    /// Every broker was tried and failed; the failures are in the caller's list.
    Exhausted,
}

/// Runs `attempt` for the brokers of `order`, in that order, staggered by `stagger`; returns
/// the first success with its broker. Each unusable broker's error is pushed onto `failed`.
pub(crate) async fn staggered<T, F, Fut>(
    order: &[usize],
    stagger: Duration,
    failed: &mut Vec<(usize, Error)>,
    attempt: F,
) -> Result<(usize, T), Lost>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let mut waiting = order.iter().copied();
    let mut running = FuturesUnordered::new();
    let launch = |i: usize| {
        let outcome = attempt(i);
        async move { (i, outcome.await) }
    };
    let mut next_at = Instant::now();
    // Each turn starts an attempt or ends one: two turns per broker at most.
    for _ in 0..=2 * order.len() {
        if running.is_empty() {
            let Some(i) = waiting.next() else { break };
            running.push(launch(i));
            next_at = Instant::now() + stagger;
        }
        let more = waiting.len() > 0;
        tokio::select! {
            Some((i, outcome)) = running.next() => match outcome {
                Ok(value) => return Ok((i, value)),
                Err(Failure::Answered(e)) => return Err(Lost::Answered(i, e)),
                // The next broker starts on the next turn if nothing else runs; otherwise
                // its stagger still applies.
                Err(Failure::Unusable(e)) => failed.push((i, e)),
            },
            () = tokio::time::sleep_until(next_at), if more => {
                if let Some(i) = waiting.next() {
                    running.push(launch(i));
                    next_at = Instant::now() + stagger;
                }
            }
        }
    }
    Err(Lost::Exhausted)
}

/// Runs every one of `attempts` at once and returns their outcomes in the same order; once one
/// has succeeded, the others get `grace` more, and those still running then are dropped
/// (cancelled) and come back `None`.
pub(crate) async fn all_with_grace<T, E, Fut>(
    attempts: Vec<Fut>,
    grace: Duration,
) -> Vec<Option<Result<T, E>>>
where
    Fut: Future<Output = Result<T, E>>,
{
    let count = attempts.len();
    let mut running = FuturesUnordered::new();
    for (i, attempt) in attempts.into_iter().enumerate() {
        running.push(async move { (i, attempt.await) });
    }
    let mut outcomes: Vec<Option<Result<T, E>>> = (0..count).map(|_| None).collect();
    let mut deadline = None;
    for _ in 0..count {
        let next = match deadline {
            None => running.next().await,
            Some(at) => tokio::time::timeout_at(at, running.next())
                .await
                .ok()
                .flatten(),
        };
        let Some((i, outcome)) = next else { break };
        if outcome.is_ok() && deadline.is_none() {
            deadline = Some(Instant::now() + grace);
        }
        outcomes[i] = Some(outcome);
    }
    outcomes
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// What a fake broker does when tried: answer after `after`, with `outcome`.
    #[derive(Clone, Copy)]
    enum Fake {
        Works(u64),
        Unusable(u64),
        Refuses(u64),
        Hangs,
    }

    /// Races fakes; returns the outcome, when it came (ms since start) and which were started.
    async fn race(fakes: &[Fake]) -> (Result<usize, String>, u64, Vec<usize>, Vec<usize>) {
        let started = Mutex::new(Vec::new());
        let t0 = Instant::now();
        let order: Vec<usize> = (0..fakes.len()).collect();
        let mut failed = Vec::new();
        let outcome = staggered(&order, STAGGER, &mut failed, |i| {
            started.lock().expect("lock").push(i);
            let fake = fakes[i];
            async move {
                let wait = |ms| tokio::time::sleep(Duration::from_millis(ms));
                match fake {
                    Fake::Works(ms) => wait(ms).await,
                    Fake::Unusable(ms) => {
                        wait(ms).await;
                        return Err(Failure::Unusable(Error::Io(format!("b{i} down"))));
                    }
                    Fake::Refuses(ms) => {
                        wait(ms).await;
                        return Err(Failure::Answered(Error::Unauthorized(format!("b{i}"))));
                    }
                    Fake::Hangs => wait(3_600_000).await,
                }
                Ok(i)
            }
        })
        .await;
        let at = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
        let outcome = match outcome {
            Ok((i, v)) => {
                assert_eq!(i, v);
                Ok(i)
            }
            Err(Lost::Answered(i, e)) => Err(format!("b{i} answered {e}")),
            Err(Lost::Exhausted) => Err("exhausted".into()),
        };
        let failed = failed.into_iter().map(|(i, _)| i).collect();
        let started = started.into_inner().expect("lock");
        (outcome, at, started, failed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_first_broker_is_the_only_one_tried() {
        let (won, at, started, _) = race(&[Fake::Works(5), Fake::Works(1)]).await;
        assert_eq!((won, at, started), (Ok(0), 5, vec![0]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_first_broker_costs_one_stagger() {
        let (won, at, started, failed) = race(&[Fake::Hangs, Fake::Works(5)]).await;
        assert_eq!((won, at, started, failed), (Ok(1), 205, vec![0, 1], vec![]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_starts_the_next_broker_at_once() {
        let (won, at, _, failed) = race(&[Fake::Unusable(10), Fake::Works(5)]).await;
        assert_eq!((won, at, failed), (Ok(1), 15, vec![0]));
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_to_finish_wins_even_if_started_first() {
        let (won, at, started, _) = race(&[Fake::Works(250), Fake::Works(100)]).await;
        assert_eq!((won, at, started), (Ok(0), 250, vec![0, 1]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_final_answer_ends_the_race_while_others_hang() {
        let (won, at, _, _) = race(&[Fake::Hangs, Fake::Refuses(3), Fake::Hangs]).await;
        assert_eq!(won, Err("b1 answered unauthorized: b1".into()));
        assert_eq!(at, 203, "not after the hanging brokers");
    }

    #[tokio::test(start_paused = true)]
    async fn asking_all_waits_a_grace_after_the_first_answer_not_for_the_dead() {
        let after = |ms: u64, ok: bool| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            if ok { Ok(ms) } else { Err(ms) }
        };
        let t0 = Instant::now();
        let attempts = vec![
            after(3_600_000, true),
            after(10, true),
            after(500, true),
            after(5, false),
        ];
        let outcomes = all_with_grace(attempts, Duration::from_secs(1)).await;
        assert_eq!(
            outcomes,
            vec![None, Some(Ok(10)), Some(Ok(500)), Some(Err(5))]
        );
        assert_eq!(
            t0.elapsed(),
            Duration::from_millis(1_010),
            "one grace after the first"
        );
        // Failures alone start no grace: every attempt is waited for.
        let outcomes = all_with_grace(vec![after(5, false), after(2_000, false)], EACH_GRACE).await;
        assert_eq!(outcomes, vec![Some(Err(5)), Some(Err(2_000))]);
    }

    #[tokio::test(start_paused = true)]
    async fn all_failing_reports_each() {
        let fakes = [Fake::Unusable(1), Fake::Unusable(300), Fake::Unusable(2)];
        let (won, _, started, mut failed) = race(&fakes).await;
        assert_eq!(won, Err("exhausted".into()));
        assert_eq!(started, vec![0, 1, 2]);
        failed.sort_unstable();
        assert_eq!(failed, vec![0, 1, 2]);
        let (won, ..) = race(&[]).await;
        assert_eq!(won, Err("exhausted".into()));
    }
}
