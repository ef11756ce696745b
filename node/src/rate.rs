//! The upload rate limit: [`parse_rate`] reads `200MB/s`-style rates, [`RateLimiter`] is the
//! per-node token bucket every serving stream draws from.
//!
//! The bucket is kept as a virtual clock (the "generic cell rate" form of a token bucket):
//! `next` is the time at which everything reserved so far will have been paid for, never
//! earlier than `now - burst / rate` (a full bucket). A request for `n` bytes may go once
//! `next` has passed, and moves it on by `n / rate`: a request pays for the one before it, so
//! over any span the bytes sent exceed `rate * span` by at most the burst plus one request. Reservations are made under a short lock
//! and waited for outside it, so streams are served in the order they asked, and a stream
//! that gives up (its peer went away) has still spent its bytes: the bucket never hands out
//! more than the rate, only sometimes less.

use std::{sync::Mutex, time::Duration};

use tokio::time::Instant;

/// Bytes a full bucket holds, at least: one stream chunk (1 MiB) goes out without waiting.
pub const MIN_BURST_BYTES: u64 = 1 << 20;
/// The bucket holds this much time's worth of bytes at the configured rate when that is more
/// than [`MIN_BURST_BYTES`].
const BURST_TIME: Duration = Duration::from_millis(50);
/// Largest rate [`parse_rate`] accepts: 1 PB/s (anything above is a typo).
pub const MAX_RATE: u64 = 1_000_000_000_000_000;

/// Why a rate string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateError {
    /// Nothing was given.
    #[error("empty rate (expected e.g. 200MB/s, 1.5GiB/s, or 0 for unlimited)")]
    Empty,
    /// The number part is missing or not a number.
    #[error("bad number in rate {input:?} (expected e.g. 200MB/s, 1.5GiB/s)")]
    Number {
        /// What was given.
        input: String,
    },
    /// The unit is not one of B, kB/KB, MB, GB, TB, KiB, MiB, GiB, TiB (per second).
    #[error(
        "unknown unit {unit:?} in rate {input:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, optionally followed by /s)"
    )]
    Unit {
        /// What was given.
        input: String,
        /// The unit part.
        unit: String,
    },
    /// A rate in bits (`Mb/s`, `Mbit/s`): this limit counts bytes.
    #[error("rate {input:?} is in bits; give bytes per second (e.g. 100Mbit/s = 12.5MB/s)")]
    Bits {
        /// What was given.
        input: String,
    },
    /// Negative, not finite, or above [`MAX_RATE`].
    #[error("rate {input:?} is out of range (0 to 1 PB/s)")]
    Range {
        /// What was given.
        input: String,
    },
}

/// Parses a rate in bytes per second: a number (fractions allowed) and an optional unit —
/// `B`, decimal `KB`/`kB`/`MB`/`GB`/`TB` (powers of 1000) or binary `KiB`/`MiB`/`GiB`/`TiB`
/// (powers of 1024), case-insensitive except that a lowercase `b` after a prefix means bits
/// and is refused — optionally followed by `/s`. `0`, `unlimited` and `none` mean no limit
/// (returned as 0). Fractional bytes round down.
pub fn parse_rate(input: &str) -> Result<u64, RateError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(RateError::Empty);
    }
    if ["unlimited", "none", "off"]
        .iter()
        .any(|w| s.eq_ignore_ascii_case(w))
    {
        return Ok(0);
    }
    let s = s
        .strip_suffix("/s")
        .or_else(|| s.strip_suffix("/S"))
        .or_else(|| s.strip_suffix("ps"))
        .unwrap_or(s)
        .trim_end();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return Err(RateError::Number {
            input: input.into(),
        });
    }
    let value: f64 = number.parse().map_err(|_| RateError::Number {
        input: input.into(),
    })?;
    let multiplier = unit_multiplier(unit).map_err(|bits| match bits {
        true => RateError::Bits {
            input: input.into(),
        },
        false => RateError::Unit {
            input: input.into(),
            unit: unit.into(),
        },
    })?;
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > MAX_RATE as f64 {
        return Err(RateError::Range {
            input: input.into(),
        });
    }
    // In range and finite: the cast truncates the fraction of a byte, as documented.
    Ok(bytes as u64)
}

/// Parses a size in bytes written like a rate without `/s` (`8MiB`, `1.5GB`, `4096`), for
/// command-line parsers: the message says what was wrong with it.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    if s.ends_with("/s") || s.ends_with("/S") || s.ends_with("ps") {
        return Err(format!("{input:?} is a rate; give a size such as 8MiB"));
    }
    if s.chars().all(|c| c.is_ascii_alphabetic()) && !s.is_empty() {
        return Err(format!(
            "{input:?} is not a size (expected e.g. 8MiB, 64MB, 4096)"
        ));
    }
    parse_rate(s).map_err(|e| e.to_string().replace("rate", "size"))
}

/// Bytes per unit; `Err(true)` for a unit in bits, `Err(false)` for an unknown one.
fn unit_multiplier(unit: &str) -> Result<f64, bool> {
    if unit.is_empty() || unit == "B" {
        return Ok(1.0);
    }
    let lower = unit.to_ascii_lowercase();
    if lower.ends_with("bit") || lower.ends_with("bits") || unit.ends_with('b') {
        return Err(true);
    }
    Ok(match lower.as_str() {
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" | "ki" => 1024.0,
        "mib" | "mi" => 1024.0 * 1024.0,
        "gib" | "gi" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(false),
    })
}

/// Formats a rate for people: `200.0 MB/s`, or `unlimited` for 0.
pub fn format_rate(bytes_per_s: u64) -> String {
    if bytes_per_s == 0 {
        return "unlimited".into();
    }
    let v = bytes_per_s as f64;
    let (value, unit) = match v {
        v if v >= 1e12 => (v / 1e12, "TB/s"),
        v if v >= 1e9 => (v / 1e9, "GB/s"),
        v if v >= 1e6 => (v / 1e6, "MB/s"),
        v if v >= 1e3 => (v / 1e3, "kB/s"),
        v => (v, "B/s"),
    };
    format!("{value:.1} {unit}")
}

/// A token bucket shared by every stream that sends payload bytes of one node.
#[derive(Debug)]
pub struct RateLimiter {
    /// Bytes per second (never 0: an unlimited node has no limiter).
    rate: u64,
    /// What a full bucket holds, as time at `rate`.
    burst: Duration,
    /// The time by which every byte reserved so far is paid for.
    next: Mutex<Option<Instant>>,
}

impl RateLimiter {
    /// A limiter of `bytes_per_s`; `None` for 0 (unlimited).
    pub fn new(bytes_per_s: u64) -> Option<RateLimiter> {
        if bytes_per_s == 0 {
            return None;
        }
        let burst_bytes = MIN_BURST_BYTES.max(scale(bytes_per_s, BURST_TIME));
        Some(RateLimiter {
            rate: bytes_per_s,
            burst: time_for(burst_bytes, bytes_per_s),
            next: Mutex::new(None),
        })
    }

    /// The limit in bytes per second.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Reserves `n` bytes at `now`; returns when they may be sent (`now` or later): once
    /// everything reserved before them is paid for. Their own cost is paid by whoever reserves
    /// next, so bytes that arrive at the rate leave at once instead of one chunk's time later
    /// (every hop of a cut-through chain would add that). Pure bookkeeping, no waiting:
    /// [`acquire`](Self::acquire) waits for the answer.
    pub fn reserve(&self, n: u64, now: Instant) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        // A bucket idle long enough is full: it holds `burst`, no more.
        let floor = now.checked_sub(self.burst).unwrap_or(now);
        let start = next.map_or(floor, |t| t.max(floor));
        *next = Some(start + time_for(n, self.rate));
        start.max(now)
    }

    /// Waits until `n` more bytes may be sent.
    pub async fn acquire(&self, n: u64) {
        let at = self.reserve(n, Instant::now());
        tokio::time::sleep_until(at).await;
    }
}

/// How long `bytes` take at `rate` bytes per second.
fn time_for(bytes: u64, rate: u64) -> Duration {
    let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(rate.max(1));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Bytes sent in `time` at `rate` bytes per second.
fn scale(rate: u64, time: Duration) -> u64 {
    let bytes = u128::from(rate) * time.as_nanos() / 1_000_000_000;
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn rates_parse_in_decimal_and_binary_units() {
        let ok = [
            ("200MB/s", 200_000_000),
            ("200 MB/s", 200_000_000),
            ("1.5GiB/s", 1_610_612_736),
            ("1.5 GiB", 1_610_612_736),
            ("100kB/s", 100_000),
            ("100KB", 100_000),
            ("64KiB/s", 65_536),
            ("3MiB/s", 3 << 20),
            ("2gB/s", 2_000_000_000),
            ("1TB/s", 1_000_000_000_000),
            ("12345", 12_345),
            ("12345B/s", 12_345),
            ("0.5B/s", 0),
            ("10MBps", 10_000_000),
            ("  7 MB/s  ", 7_000_000),
            ("0", 0),
            ("0MB/s", 0),
            ("unlimited", 0),
            ("None", 0),
        ];
        for (input, want) in ok {
            assert_eq!(parse_rate(input), Ok(want), "{input}");
        }
    }

    #[test]
    fn sizes_parse_like_rates_without_the_per_second() {
        assert_eq!(parse_size("8MiB"), Ok(8 << 20));
        assert_eq!(parse_size(" 1.5GB "), Ok(1_500_000_000));
        assert_eq!(parse_size("0"), Ok(0));
        for input in ["200MB/s", "10MBps", "unlimited", "big", ""] {
            assert!(parse_size(input).is_err(), "{input}");
        }
        let bits = parse_size("8Mb").expect_err("bits");
        assert!(bits.contains("size") && !bits.contains("rate"), "{bits}");
    }

    #[test]
    fn bad_rates_get_clear_errors() {
        assert_eq!(parse_rate(""), Err(RateError::Empty));
        assert_eq!(parse_rate("   "), Err(RateError::Empty));
        for input in ["MB/s", "fast", ".MB/s", "1.2.3MB/s", "-5MB/s"] {
            assert!(
                matches!(parse_rate(input), Err(RateError::Number { .. })),
                "{input}: {:?}",
                parse_rate(input)
            );
        }
        for input in ["100Mb/s", "100Mbit/s", "1Gbits", "8b"] {
            assert!(
                matches!(parse_rate(input), Err(RateError::Bits { .. })),
                "{input}: {:?}",
                parse_rate(input)
            );
        }
        match parse_rate("5 parsecs/s") {
            Err(e @ RateError::Unit { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("parsecs") && msg.contains("MiB"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_rate("2000PB/s"),
            Err(RateError::Unit { .. })
        ));
        assert!(matches!(
            parse_rate("99999999TB/s"),
            Err(RateError::Range { .. })
        ));
    }

    #[test]
    fn rates_format_for_people() {
        assert_eq!(format_rate(0), "unlimited");
        assert_eq!(format_rate(200_000_000), "200.0 MB/s");
        assert_eq!(format_rate(1_500), "1.5 kB/s");
    }

    #[test]
    fn zero_is_no_limiter() {
        assert!(RateLimiter::new(0).is_none());
        assert_eq!(RateLimiter::new(5).map(|l| l.rate()), Some(5));
    }

    /// The accounting, on a clock that does not move: a full bucket lets the burst through at
    /// once, after that every byte costs `1 / rate` seconds, and reservations queue in order.
    #[test]
    fn a_full_bucket_pays_out_the_burst_then_the_rate() {
        let rate = 100 << 20; // 100 MiB/s: the burst is 5 MiB (50 ms)
        let limiter = RateLimiter::new(rate).expect("limited");
        let t0 = Instant::now();
        let burst = scale(rate, BURST_TIME);
        assert_eq!(burst, 5 << 20);
        // The first 5 MiB go at once, in 1 MiB reservations, and so does the one that
        // overdraws the bucket.
        for _ in 0..6 {
            assert_eq!(limiter.reserve(1 << 20, t0), t0);
        }
        // Each further MiB waits 10 ms more than the one before.
        for i in 1..=10u32 {
            let at = limiter.reserve(1 << 20, t0);
            assert_eq!(
                at - t0,
                Duration::from_millis(10) * i,
                "MiB {i} past the overdraft"
            );
        }
        // 100 MiB reserved at t0 (these 84 MiB and the 16 MiB before) is paid off at
        // t0 + 1 s - burst; the next byte goes then.
        assert_eq!(
            limiter.reserve(84 << 20, t0) - t0,
            Duration::from_millis(110)
        );
        assert_eq!(limiter.reserve(1, t0) - t0, Duration::from_millis(950));
    }

    #[test]
    fn an_idle_bucket_refills_but_never_beyond_the_burst() {
        let limiter = RateLimiter::new(1_000_000).expect("limited"); // 1 MB/s, burst 1 MiB
        let t0 = Instant::now();
        // 2 MB overdraw the full bucket: they go at once, and the next byte waits for them.
        assert_eq!(limiter.reserve(2_000_000, t0), t0);
        assert_eq!(
            limiter.reserve(1, t0) - t0,
            time_for(2_000_000 - (1 << 20), 1_000_000)
        );
        // An hour later the bucket is full again: exactly one burst (and one request) passes
        // at once.
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(limiter.reserve(1 << 20, later), later);
        assert_eq!(limiter.reserve(1_000_000, later), later);
        assert_eq!(limiter.reserve(1, later) - later, Duration::from_secs(1));
    }

    /// With tokio's paused clock, `acquire` really waits the reserved time (virtual time, so
    /// no assertion depends on the machine's speed).
    #[tokio::test(start_paused = true)]
    async fn acquire_waits_on_the_virtual_clock() {
        let limiter = RateLimiter::new(1 << 20).expect("limited"); // 1 MiB/s, burst 1 MiB
        let t0 = Instant::now();
        limiter.acquire(1 << 20).await;
        limiter.acquire(1 << 20).await;
        assert_eq!(Instant::now(), t0);
        for _ in 0..3 {
            limiter.acquire(1 << 20).await;
        }
        assert_eq!(Instant::now() - t0, Duration::from_secs(3));
    }

    proptest! {
        /// Flags are user input: any string is a rate or size in range, or an error; never
        /// a panic (the number and unit are split at a character boundary).
        #[test]
        fn arbitrary_rates_and_sizes_never_panic(
            s in prop_oneof![
                any::<String>(),
                "[ 0-9.eE+-]{0,12}[ kKmMgGtTiIbB/sSpéµ]{0,6}",
            ]
        ) {
            if let Ok(rate) = parse_rate(&s) {
                prop_assert!(rate <= MAX_RATE);
                let _ = format_rate(rate);
            }
            if let Ok(size) = parse_size(&s) {
                prop_assert!(size <= MAX_RATE);
            }
        }
    }
}
