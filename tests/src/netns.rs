//! Network namespaces for tests that need a real network boundary on this host: a namespace
//! linked to the test's own by a veth pair, created with iproute2's `ip` and removed on drop.
//!
//! Creating one needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip`; [`Netns::create`] says
//! why it cannot, so a test can print SKIPPED and return.

use std::{
    net::Ipv4Addr,
    path::Path,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

/// Namespaces this process made so far (each gets its own names and subnet).
static MADE: AtomicU32 = AtomicU32::new(0);
/// Namespaces one test process may make (each takes a /30 of one /24).
const MAX_PER_PROCESS: u32 = 60;

/// A network namespace linked to this one by a veth pair, `.1` on this side and `.2` inside,
/// removed (with the pair) on drop.
pub struct Netns {
    /// The namespace's name (`ip netns`).
    pub name: String,
    /// This side's end of the veth pair.
    pub outer_link: String,
    /// This side's address on the pair.
    pub outer_ip: Ipv4Addr,
    /// The namespace's address on the pair.
    pub inner_ip: Ipv4Addr,
}

impl Netns {
    /// Creates one, or says why it cannot (not root, no `ip`, no namespaces here).
    pub fn create() -> Result<Netns, String> {
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        if n >= MAX_PER_PROCESS {
            return Err(format!("this process made {MAX_PER_PROCESS} already"));
        }
        let pid = std::process::id();
        let subnet = (pid % 250) as u8;
        let host = (n * 4) as u8;
        let tag = format!("{}x{n}", pid % 1_000_000);
        let ns = Netns {
            name: format!("tb-test-{pid}-{n}"),
            outer_link: format!("tb{tag}a"),
            outer_ip: Ipv4Addr::new(10, 213, subnet, host + 1),
            inner_ip: Ipv4Addr::new(10, 213, subnet, host + 2),
        };
        let inner_link = format!("tb{tag}b");
        let (outer, inner) = (format!("{}/30", ns.outer_ip), format!("{}/30", ns.inner_ip));
        ip(&["netns", "add", &ns.name])?;
        // From here on, `ns` removes what exists when dropped, even half set up.
        let steps: [&[&str]; 7] = [
            &[
                "link",
                "add",
                &ns.outer_link,
                "type",
                "veth",
                "peer",
                "name",
                &inner_link,
            ],
            &["link", "set", &inner_link, "netns", &ns.name],
            &["addr", "add", &outer, "dev", &ns.outer_link],
            &["link", "set", &ns.outer_link, "up"],
            &["-n", &ns.name, "addr", "add", &inner, "dev", &inner_link],
            &["-n", &ns.name, "link", "set", &inner_link, "up"],
            &["-n", &ns.name, "link", "set", "lo", "up"],
        ];
        for step in steps {
            ip(step)?;
        }
        Ok(ns)
    }

    /// Takes this side of the link down (`false`: a partition) or back up.
    pub fn link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["link", "set", &self.outer_link, state]).expect("setting the link");
    }

    /// `program` run inside the namespace (`ip netns exec` execs it: same PID).
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end of a veth pair deletes both.
        let _ = ip(&["link", "del", &self.outer_link]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Runs `ip args`; the error says what failed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}
