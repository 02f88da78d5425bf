//! The supervision tree as data: what `duet tree` prints and the admin API returns.

use serde::{Deserialize, Serialize};

/// One actor in the tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorInfo {
    /// `NODE/actor/child/...`; the root supervisor's path is the node name.
    pub path: String,
    /// The actor's name among its siblings.
    pub name: String,
    /// Its kind (the restart policy that applies to it).
    pub kind: String,
    /// `running`, `restarting`, `stopped` (on purpose) or `failed`.
    pub status: String,
    /// Restarts by its supervisor since the supervisor itself started.
    pub restarts: u32,
    /// Why it last exited, if it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
    /// Children, for supervisors.
    #[serde(default)]
    pub children: Vec<ActorInfo>,
}

impl ActorInfo {
    /// Every path in this subtree, depth first.
    pub fn paths(&self) -> Vec<String> {
        let mut out = vec![self.path.clone()];
        for c in &self.children {
            out.extend(c.paths());
        }
        out
    }

    /// The actor at `path`, if it is in this subtree.
    pub fn find(&self, path: &str) -> Option<&ActorInfo> {
        if self.path == path {
            return Some(self);
        }
        self.children.iter().find_map(|c| c.find(path))
    }
}

/// One node's entry in `duet tree --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTree {
    /// The node's name.
    pub node: String,
    /// Its role.
    pub role: String,
    /// `up` when its admin API answered, `unreachable` otherwise.
    pub status: String,
    /// Why it is unreachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its root supervisor, when reachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<ActorInfo>,
    /// The node process's id on its host, when reachable (`duet chaos --pause/--crash`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Times `duet up` restarted the node's process after it died.
    #[serde(default)]
    pub process_restarts: u32,
    /// The device its worker owns now (`cpu`, `cuda:N`); none on a router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// The `limit` known paths closest to `wanted` (edit distance), for "did you mean" errors.
pub fn nearest<'a>(
    wanted: &str,
    known: impl IntoIterator<Item = &'a str>,
    limit: usize,
) -> Vec<String> {
    let mut scored: Vec<(usize, &str)> = known
        .into_iter()
        .map(|k| (strsim::levenshtein(wanted, k), k))
        .collect();
    scored.sort();
    scored
        .into_iter()
        .take(limit)
        .map(|(_, k)| k.to_string())
        .collect()
}

/// Renders trees as indented text, one actor per line.
pub fn render(nodes: &[NodeTree]) -> String {
    let mut out = String::new();
    for n in nodes {
        match &n.root {
            Some(root) => {
                let restarts = match n.process_restarts {
                    0 => String::new(),
                    1 => ", process restarted once".to_string(),
                    r => format!(", process restarted {r} times"),
                };
                let device = n
                    .device
                    .as_ref()
                    .map_or_else(String::new, |d| format!(", device {d}"));
                out.push_str(&format!(
                    "{} ({}, {}{device}{restarts})\n",
                    n.node, n.role, n.status
                ));
                render_actor(root, "", true, &mut out);
            }
            None => out.push_str(&format!(
                "{} ({}, unreachable: {})\n",
                n.node,
                n.role,
                n.error.as_deref().unwrap_or("no answer")
            )),
        }
    }
    out
}

fn render_actor(a: &ActorInfo, prefix: &str, last: bool, out: &mut String) {
    let branch = if last { "└─ " } else { "├─ " };
    let restarts = if a.restarts > 0 {
        format!(", {} restarts", a.restarts)
    } else {
        String::new()
    };
    out.push_str(&format!(
        "{prefix}{branch}{} [{}] {}{restarts}   {}\n",
        a.name, a.kind, a.status, a.path
    ));
    let child_prefix = format!("{prefix}{}", if last { "   " } else { "│  " });
    for (i, c) in a.children.iter().enumerate() {
        render_actor(c, &child_prefix, i + 1 == a.children.len(), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(path: &str) -> ActorInfo {
        ActorInfo {
            path: path.into(),
            name: path.rsplit('/').next().unwrap_or_default().into(),
            kind: "echo".into(),
            status: "running".into(),
            restarts: 0,
            last_exit: None,
            children: vec![],
        }
    }

    #[test]
    fn nearest_paths_rank_by_edit_distance() {
        let known = ["p0/prefill/echo", "p0/links/d0", "p0/membership"];
        assert_eq!(nearest("p0/prefil/echo", known, 1), ["p0/prefill/echo"]);
        assert_eq!(nearest("p0/links/d1", known, 2)[0], "p0/links/d0");
    }

    #[test]
    fn finds_and_lists_paths() {
        let mut root = leaf("p0");
        root.children.push(leaf("p0/echo"));
        assert_eq!(root.paths(), ["p0", "p0/echo"]);
        assert!(root.find("p0/echo").is_some());
        assert!(root.find("p0/nope").is_none());
    }
}
