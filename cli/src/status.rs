//! `tb status`: the cluster's members — role, addresses, liveness — and each worker's pool,
//! store and throughput figures from its freshest heartbeat, and how old they are. Every broker
//! in the ticket is asked at once: each knows the figures of the workers that heartbeat to it.
//!
//! The table has one whitespace-free cell per column (`8MiB`, `1.5MiB/s`, `-` when unknown),
//! so scripts can split rows on whitespace; `--json` prints the same as one JSON object.

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use tb_node::proto::{MemberStatus, NodeId, NodeStats, Role};

use crate::{cluster::Join, fmt::bytes};

/// Options of `tb status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Print one JSON object (`{"answered": [...], "unanswered": [...], "members": [...]}`)
    /// instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `tb status`: asks every broker in the ticket at once and prints the members of the
/// cluster, each with the freshest heartbeat figures any broker heard.
pub async fn status(join: &Join, args: &StatusArgs) -> Result<()> {
    let node = join.node().await?;
    let view = node.members_with_stats().await;
    crate::cluster::close(&node).await;
    let view = view.context("asking for the members")?;
    let answered: Vec<String> = view.answered.iter().map(ToString::to_string).collect();
    let unanswered: Vec<Unanswered> = view
        .unanswered
        .iter()
        .map(|(broker, e)| Unanswered {
            broker: broker.to_string(),
            error: e.to_string(),
        })
        .collect();
    if args.json {
        let out = StatusView {
            answered,
            unanswered,
            members: view.members.iter().map(MemberView::from).collect(),
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let total = answered.len() + unanswered.len();
    println!("brokers answering: {} of {total}", answered.len());
    for u in &unanswered {
        println!("  no answer from {}: {}", u.broker, u.error);
    }
    for line in table(&view.members) {
        println!("{line}");
    }
    for line in link_lines(&view.members) {
        println!("{line}");
    }
    Ok(())
}

/// What `tb status --json` prints.
#[derive(Debug, Serialize)]
struct StatusView {
    /// The brokers that answered (`<node-id>@<ip:port>`).
    answered: Vec<String>,
    /// The brokers that did not, with why.
    unanswered: Vec<Unanswered>,
    members: Vec<MemberView>,
}

/// A broker `tb status` got no table from.
#[derive(Debug, Serialize)]
struct Unanswered {
    broker: String,
    error: String,
}

/// One member in `tb status --json`.
#[derive(Debug, Serialize)]
struct MemberView {
    node_id: String,
    role: &'static str,
    alive: bool,
    addrs: Vec<String>,
    epoch: u64,
    /// The freshest heartbeat's figures (`null` when no broker that answered has any); its
    /// `links` as `{"peer": hex id, "channel": "quic"}`.
    stats: Option<serde_json::Value>,
    /// Seconds since that heartbeat.
    heartbeat_age_s: Option<f64>,
}

impl From<&MemberStatus> for MemberView {
    fn from(row: &MemberStatus) -> Self {
        let m = &row.member;
        MemberView {
            node_id: m.node.to_hex(),
            role: role(m.role),
            alive: m.alive,
            addrs: m.addrs.clone(),
            epoch: m.epoch,
            stats: row.heartbeat.as_ref().map(|h| stats_json(&h.stats)),
            heartbeat_age_s: row.heartbeat.as_ref().map(|h| h.age_ms as f64 / 1000.0),
        }
    }
}

/// `stats` as JSON, each link's peer in hex (not as 32 numbers).
fn stats_json(stats: &NodeStats) -> serde_json::Value {
    let mut json = serde_json::to_value(stats).unwrap_or_default();
    let links: Vec<serde_json::Value> = stats
        .links
        .iter()
        .map(|l| serde_json::json!({ "peer": l.peer.to_hex(), "channel": l.channel.as_str() }))
        .collect();
    json["links"] = serde_json::Value::from(links);
    json
}

/// One line per member whose heartbeat listed pooled links: `links of 3f2a0b1c:
/// 9d8e7f6a=quic 11223344=shm` (each peer's short id and the channel negotiated with it).
fn link_lines(rows: &[MemberStatus]) -> Vec<String> {
    let mut out = Vec::new();
    for row in rows {
        let Some(h) = row.heartbeat.as_ref().filter(|h| !h.stats.links.is_empty()) else {
            continue;
        };
        let links: Vec<String> = h
            .stats
            .links
            .iter()
            .map(|l| format!("{}={}", short_id(&l.peer), l.channel.as_str()))
            .collect();
        if out.is_empty() {
            out.push(String::new());
        }
        out.push(format!(
            "links of {}: {}",
            short_id(&row.member.node),
            links.join(" ")
        ));
    }
    out
}

fn role(role: Role) -> &'static str {
    match role {
        Role::Broker => "broker",
        Role::Worker => "worker",
    }
}

/// The first 8 hex digits of a node id, as the dashboard and `tb ls` show it.
pub fn short_id(node: &NodeId) -> String {
    node.to_hex().chars().take(8).collect()
}

/// The column titles of [`table`].
const HEADER: [&str; 10] = [
    "NODE", "ROLE", "STATE", "ADDRESS", "LINKS", "TENSORS", "STORED", "IN", "OUT", "HEARD",
];

/// The status table: a header, then one line per member, in node id order.
fn table(rows: &[MemberStatus]) -> Vec<String> {
    let line = |cells: [&str; 10]| {
        format!(
            "{:<8}  {:<6}  {:<5}  {:<22}  {:>5}  {:>7}  {:>9}  {:>11}  {:>11}  {:>6}",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            cells[5],
            cells[6],
            cells[7],
            cells[8],
            cells[9]
        )
        .trim_end()
        .to_string()
    };
    let mut out = vec![line(HEADER)];
    for row in rows {
        let cells = cells(row);
        out.push(line(cells.each_ref().map(String::as_str)));
    }
    out
}

/// One member's cells, none with spaces; `-` for figures no broker has heard.
fn cells(row: &MemberStatus) -> [String; 10] {
    let m = &row.member;
    let address = match m.addrs.as_slice() {
        [] => "-".to_string(),
        [one] => one.clone(),
        [first, rest @ ..] => format!("{first},+{}", rest.len()),
    };
    let dash = || "-".to_string();
    let (links, tensors, stored, rate_in, rate_out, heard) = match &row.heartbeat {
        None => (dash(), dash(), dash(), dash(), dash(), dash()),
        Some(h) => (
            h.stats.pool_links.to_string(),
            h.stats.tensors.to_string(),
            compact(h.stats.store_bytes),
            rate(h.stats.in_bytes_per_s),
            rate(h.stats.out_bytes_per_s),
            age(h.age_ms),
        ),
    };
    [
        short_id(&m.node),
        role(m.role).to_string(),
        if m.alive { "alive" } else { "dead" }.to_string(),
        address,
        links,
        tensors,
        stored,
        rate_in,
        rate_out,
        heard,
    ]
}

/// `8MiB`: a size without the space, so a table cell stays one word.
fn compact(n: u64) -> String {
    bytes(n).replace(' ', "")
}

/// `1.5MiB/s` from a (finite, non-negative: validated on receipt) bytes-per-second figure.
fn rate(bytes_per_s: f64) -> String {
    format!("{}/s", compact(bytes_per_s.round() as u64))
}

/// `0.4s`, `12s`, `5m`: how long ago a heartbeat arrived.
fn age(ms: u64) -> String {
    match ms {
        0..10_000 => format!("{:.1}s", ms as f64 / 1000.0),
        10_000..120_000 => format!("{}s", ms / 1000),
        _ => format!("{}m", ms / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use tb_node::proto::{LastHeartbeat, Member, Stamp};

    use super::*;

    fn member(b: u8, role: Role, alive: bool, addrs: &[&str]) -> Member {
        Member {
            node: NodeId([b; 32]),
            role,
            addrs: addrs.iter().map(|a| a.to_string()).collect(),
            epoch: 3,
            alive,
            stamp: Stamp::ZERO,
        }
    }

    #[test]
    fn the_table_shows_figures_where_heard_and_dashes_elsewhere() {
        let worker = MemberStatus {
            member: member(
                0xab,
                Role::Worker,
                true,
                &["127.0.0.1:7510", "10.0.0.2:7510"],
            ),
            heartbeat: Some(LastHeartbeat {
                stats: NodeStats {
                    pool_links: 2,
                    tensors: 5,
                    store_bytes: 8 << 20,
                    in_bytes_per_s: 1536.0,
                    out_bytes_per_s: 0.0,
                    ..NodeStats::default()
                },
                age_ms: 420,
            }),
        };
        let rows = [
            MemberStatus::without_stats(member(0x01, Role::Broker, true, &["127.0.0.1:7410"])),
            worker,
            MemberStatus::without_stats(member(0xcd, Role::Worker, false, &[])),
        ];
        let lines = table(&rows);
        let split: Vec<Vec<&str>> = lines
            .iter()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(split[0], HEADER);
        assert_eq!(
            split[1],
            [
                "01010101",
                "broker",
                "alive",
                "127.0.0.1:7410",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-"
            ]
        );
        assert_eq!(
            split[2],
            [
                "abababab",
                "worker",
                "alive",
                "127.0.0.1:7510,+1",
                "2",
                "5",
                "8MiB",
                "1.5KiB/s",
                "0B/s",
                "0.4s"
            ]
        );
        assert_eq!(split[3][..4], ["cdcdcdcd", "worker", "dead", "-"]);
        assert!(lines.iter().all(|l| l.is_ascii() && !l.ends_with(' ')));
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(0), "0.0s");
        assert_eq!(age(9_949), "9.9s");
        assert_eq!(age(42_000), "42s");
        assert_eq!(age(600_000), "10m");
    }

    #[test]
    fn the_json_view_names_every_figure() {
        let row = MemberStatus {
            member: member(0x11, Role::Worker, true, &["h:1"]),
            heartbeat: Some(LastHeartbeat {
                stats: NodeStats {
                    tensors: 4,
                    links: vec![tb_node::proto::LinkChannel {
                        peer: NodeId([0x22; 32]),
                        channel: tb_node::proto::ChannelKind::Quic,
                    }],
                    ..NodeStats::default()
                },
                age_ms: 1500,
            }),
        };
        let json = serde_json::to_value(MemberView::from(&row)).expect("json");
        assert_eq!(json["role"], "worker");
        assert_eq!(json["stats"]["tensors"], 4);
        assert_eq!(json["stats"]["links"][0]["channel"], "quic");
        assert_eq!(json["stats"]["links"][0]["peer"], "22".repeat(32));
        assert_eq!(link_lines(&[row]), ["", "links of 11111111: 22222222=quic"]);
        assert_eq!(json["heartbeat_age_s"], 1.5);
        let none = serde_json::to_value(MemberView::from(&MemberStatus::without_stats(member(
            0x11,
            Role::Broker,
            true,
            &[],
        ))))
        .expect("json");
        assert!(none["stats"].is_null() && none["heartbeat_age_s"].is_null());
    }
}
