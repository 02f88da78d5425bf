//! Separate hosts on this machine, for tests of a cluster spread over a network.
//!
//! Each host is a network namespace joined by a veth to one bridge, with its own UTS name, and
//! a mount namespace in which `/dev/shm` is a private tmpfs and `/etc/hostname` names the host
//! (so Duet's same-host check, which reads both, sees different hosts). A small holder process
//! keeps the host's namespaces alive; every process of the host enters them with `nsenter`.
//!
//! Addresses come from 198.18.0.0/15 (the benchmarking range) and exist only inside
//! namespaces the harness creates: the bridge lives in a namespace of its own with no uplink,
//! no namespace has a default route, so nothing leaves the machine. Everything is removed when
//! [`Hosts`] drops, also when the test fails; namespaces left by a test that was killed are
//! removed by the next harness (their names carry the dead test's pid).
//!
//! Faults: cut a host off (its link down) and join it back, cut one pair of hosts only
//! (a blackhole route on each side: their packets go nowhere, every other path works), crash a
//! host (every process on it, its `/dev/shm` lost) and start it again.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Every namespace and interface the harness makes starts with this.
const PREFIX: &str = "duetmh";

/// One host: its namespaces (held by `holder`) and its address on the bridge.
pub struct Host {
    pub name: String,
    pub ip: Ipv4Addr,
    netns: String,
    /// The switch-side end of the host's veth.
    port: String,
    /// Behind a lock so a host can crash and boot while others hold the [`Hosts`] (a load
    /// running on the other hosts).
    holder: std::sync::Mutex<Option<Child>>,
}

impl Host {
    /// The pid whose namespaces the host's processes join.
    fn holder_pid(&self) -> u32 {
        self.holder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|c| c.id())
            .unwrap_or_else(|| panic!("host {} is down", self.name))
    }
}

/// A set of hosts on one bridge.
pub struct Hosts {
    pub hosts: Vec<Host>,
    switch: String,
    dir: tempfile::TempDir,
}

/// Runs a setup command; panics with its stderr when it fails.
fn sh(args: &[&str]) {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "`{}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs a command whose failure is fine (cleanup of what may not exist).
fn sh_quiet(args: &[&str]) {
    let _ = std::process::Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Kills every process in a network namespace.
/// SIGKILLs every process in `netns`; how many there were.
fn kill_all_in(netns: &str) -> usize {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", netns])
        .output();
    let mut n = 0;
    if let Ok(out) = out {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                n += 1;
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
    n
}

/// Removes namespaces of harnesses whose test process is gone.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let alive = Path::new("/proc").join(&pid).exists();
        if !pid.is_empty() && !alive {
            kill_all_in(&name);
            sh_quiet(&["ip", "netns", "del", &name]);
        }
    }
}

impl Hosts {
    /// Hosts named `names`, at 198.18.0.2, .3, ... on one bridge.
    pub fn new(names: &[&str]) -> Hosts {
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata("/proc/self").map(|m| m.uid());
        assert_eq!(
            uid.ok(),
            Some(0),
            "the multi-host harness needs root (network namespaces)"
        );
        sweep_stale();
        let tag = format!("{PREFIX}{}", std::process::id());
        let switch = format!("{tag}sw");
        let mut me = Hosts {
            hosts: Vec::new(),
            switch: switch.clone(),
            dir: tempfile::tempdir().expect("tempdir"),
        };
        sh(&["ip", "netns", "add", &switch]);
        sh(&["ip", "-n", &switch, "link", "add", "br0", "type", "bridge"]);
        sh(&["ip", "-n", &switch, "link", "set", "br0", "up"]);
        for (i, name) in names.iter().enumerate() {
            let netns = format!("{tag}h{i}");
            let ip = Ipv4Addr::new(198, 18, 0, 2 + i as u8);
            // Interface names are at most 15 bytes; both ends are renamed or moved at once.
            let (inner, port) = (format!("{tag}a{i}"), format!("{tag}b{i}"));
            let (inner, port) = (short(&inner), short(&port));
            sh(&["ip", "netns", "add", &netns]);
            sh(&[
                "ip", "link", "add", &inner, "type", "veth", "peer", "name", &port,
            ]);
            sh(&["ip", "link", "set", &inner, "netns", &netns]);
            sh(&["ip", "link", "set", &port, "netns", &switch]);
            sh(&["ip", "-n", &netns, "link", "set", &inner, "name", "eth0"]);
            sh(&[
                "ip",
                "-n",
                &netns,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ]);
            sh(&["ip", "-n", &netns, "link", "set", "eth0", "up"]);
            sh(&["ip", "-n", &netns, "link", "set", "lo", "up"]);
            sh(&["ip", "-n", &switch, "link", "set", &port, "master", "br0"]);
            sh(&["ip", "-n", &switch, "link", "set", &port, "up"]);
            me.hosts.push(Host {
                name: name.to_string(),
                ip,
                netns,
                port,
                holder: std::sync::Mutex::new(None),
            });
        }
        me
    }

    fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name}"))
    }

    /// The address of `host`.
    pub fn ip(&self, host: &str) -> Ipv4Addr {
        self.host(host).ip
    }

    /// Boots `host`: a holder process in its network namespace with a new UTS name and a new
    /// mount namespace (private `/dev/shm`, its own `/etc/hostname`).
    pub async fn boot(&self, host: &str) {
        let hostname_file: PathBuf = self.dir.path().join(format!("{host}.hostname"));
        std::fs::write(&hostname_file, format!("{host}\n")).expect("hostname file");
        let h = self.host(host);
        assert!(
            h.holder.lock().unwrap_or_else(|p| p.into_inner()).is_none(),
            "host {host} is already up"
        );
        let script = format!(
            "hostname {host} && mount -t tmpfs -o size=512m duet-shm /dev/shm && \
             mount --bind {} /etc/hostname && echo up && exec sleep 1000000",
            hostname_file.display()
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", &h.netns])
            .args(["unshare", "--uts", "--mount", "--propagation", "private"])
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the host's holder");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .ok()
            .and_then(|l| l.ok().flatten());
        assert_eq!(line.as_deref(), Some("up"), "host {host} did not boot");
        *h.holder.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
    }

    /// A command that runs on `host` (its network, name and mounts), not yet started.
    pub fn command(&self, host: &str, program: &str) -> Command {
        let pid = self.host(host).holder_pid().to_string();
        let mut cmd = Command::new("nsenter");
        cmd.args(["--target", &pid, "--net", "--uts", "--mount", "--"])
            .arg(program)
            .kill_on_drop(true);
        cmd
    }

    /// Cuts `host` off the network (its link goes down) or joins it back.
    pub fn set_link(&self, host: &str, up: bool) {
        let port = &self.host(host).port;
        let state = if up { "up" } else { "down" };
        sh(&["ip", "-n", &self.switch, "link", "set", port, state]);
    }

    /// Cuts the path between two hosts only, or heals it: a blackhole route on each side.
    pub fn set_pair(&self, a: &str, b: &str, cut: bool) {
        let (ha, hb) = (self.host(a), self.host(b));
        let verb = if cut { "add" } else { "del" };
        for (from, to) in [(ha, hb), (hb, ha)] {
            let dst = format!("{}/32", to.ip);
            sh(&["ip", "-n", &from.netns, "route", verb, "blackhole", &dst]);
        }
    }

    /// Crashes `host`: every process on it dies at once (SIGKILL), its `/dev/shm` is lost.
    pub async fn crash(&self, host: &str) {
        let h = self.host(host);
        // Until no process is left in it: a killed process holds its sockets (the node's
        // port) until it has finished exiting.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while kill_all_in(&h.netns) > 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let holder = h.holder.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut holder) = holder {
            let _ = holder.wait().await;
        }
    }
}

/// The last 15 bytes of an interface name (the kernel's limit), keeping its unique tail.
fn short(name: &str) -> String {
    let start = name.len().saturating_sub(15);
    name[start..].to_string()
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in &self.hosts {
            kill_all_in(&h.netns);
            sh_quiet(&["ip", "netns", "del", &h.netns]);
        }
        kill_all_in(&self.switch);
        sh_quiet(&["ip", "netns", "del", &self.switch]);
    }
}
