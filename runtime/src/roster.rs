//! Who is in the cluster: the nodes of `cluster.toml`, and the nodes that joined since.
//!
//! A node not listed in the file joins by dialing the file's nodes with the cluster
//! credentials (TLS with the pinned cluster certificate, then the token); its hello carries its
//! entry (role, link and admin addresses), and whoever accepts it records it here. Every
//! membership heartbeat's answer carries the joined entries its sender knows, so a node learns
//! of members that joined through others, and links to them, without a central registry: the
//! file's nodes are the seeds, the credentials the admission. An unknown certificate or token
//! is refused before anything is recorded.
//!
//! Entries are never removed: a joined node that leaves is marked down by membership like any
//! other peer (and comes back up if it returns, at whatever address its hello then says).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::config::{ClusterConfig, NodeConfig};

/// What recording a joined node's entry changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A node this one did not know: it needs a link and a membership entry.
    New,
    /// A joined node seen again at another address: its link dials the new one from now on.
    Moved,
    /// Nothing: known as it is, a node of the file (the file wins), or this node itself.
    Known,
}

/// The file's nodes and the joined ones.
pub struct Roster {
    file: Arc<ClusterConfig>,
    me: String,
    joined: RwLock<BTreeMap<String, NodeConfig>>,
}

impl Roster {
    /// The roster of node `me` (its own entry is in `joined` when it is not in the file).
    pub fn new(file: Arc<ClusterConfig>, me: &NodeConfig) -> Roster {
        let mut joined = BTreeMap::new();
        if file.node(&me.name).is_none() {
            joined.insert(me.name.clone(), me.clone());
        }
        Roster {
            file,
            me: me.name.clone(),
            joined: RwLock::new(joined),
        }
    }

    fn joined_map(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, NodeConfig>> {
        self.joined.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The entry of node `name`, from the file or from its hello.
    pub fn node(&self, name: &str) -> Option<NodeConfig> {
        self.file
            .node(name)
            .cloned()
            .or_else(|| self.joined_map().get(name).cloned())
    }

    /// Every node: the file's, then the joined ones (this node included).
    pub fn nodes(&self) -> Vec<NodeConfig> {
        let mut all = self.file.nodes.clone();
        all.extend(self.joined_map().values().cloned());
        all
    }

    /// The nodes that joined (this node too, if it did).
    pub fn joined(&self) -> Vec<NodeConfig> {
        self.joined_map().values().cloned().collect()
    }

    /// Records a joined node's entry.
    pub fn admit(&self, n: &NodeConfig) -> Admission {
        if n.name == self.me || self.file.node(&n.name).is_some() {
            return Admission::Known;
        }
        let mut joined = self.joined.write().unwrap_or_else(|p| p.into_inner());
        match joined.insert(n.name.clone(), n.clone()) {
            None => Admission::New,
            Some(old) if old == *n => Admission::Known,
            Some(_) => Admission::Moved,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Role;

    fn file() -> Arc<ClusterConfig> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cluster.toml");
        std::fs::write(
            &path,
            "[[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:7100\"\n\
             [[node]]\nname = \"p0\"\nrole = \"prefill\"\naddress = \"127.0.0.1:7101\"\n",
        )
        .expect("write");
        Arc::new(ClusterConfig::load(&path).expect("config"))
    }

    #[test]
    fn joined_nodes_are_recorded_once_and_follow_their_address() {
        let file = file();
        let d7 = file
            .joiner(
                "d7",
                Role::Decode,
                "127.0.0.1:7107".parse().expect("addr"),
                None,
                None,
            )
            .expect("a joiner");
        let me = file.node("router").expect("router").clone();
        let roster = Roster::new(file.clone(), &me);
        assert_eq!(roster.admit(&d7), Admission::New);
        assert_eq!(roster.admit(&d7), Admission::Known);
        let moved = NodeConfig {
            address: "127.0.0.1:7207".parse().expect("addr"),
            ..d7.clone()
        };
        assert_eq!(roster.admit(&moved), Admission::Moved);
        assert_eq!(roster.node("d7").map(|n| n.address), Some(moved.address));
        assert_eq!(roster.nodes().len(), 3);
        // The file wins: a hello cannot move a node of the file.
        let fake = NodeConfig {
            name: "p0".into(),
            ..d7.clone()
        };
        assert_eq!(roster.admit(&fake), Admission::Known);
        assert_eq!(roster.node("p0").map(|n| n.role), Some(Role::Prefill));
        // A joiner keeps its own entry.
        let own = Roster::new(file, &d7);
        assert_eq!(own.node("d7"), Some(d7.clone()));
        assert_eq!(own.admit(&d7), Admission::Known);
    }

    #[test]
    fn a_joiner_is_checked_against_the_file() {
        let file = file();
        let addr = |a: &str| a.parse().expect("addr");
        for (name, address, admin, why) in [
            ("p0", "127.0.0.1:7200", None, "in"),
            ("d 7", "127.0.0.1:7200", None, "not a valid node name"),
            ("d7", "127.0.0.1:7101", None, "address of node `p0`"),
            (
                "d7",
                "127.0.0.1:7200",
                Some("127.0.0.1:7100"),
                "already used by node `router`",
            ),
        ] {
            let e = file
                .joiner(name, Role::Decode, addr(address), admin.map(addr), None)
                .expect_err(why);
            assert!(e.contains(why), "{e}");
        }
    }
}
