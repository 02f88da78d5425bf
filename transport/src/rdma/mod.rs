//! The RDMA backend: decode's pool registered with the NIC, one reliable-connected queue pair
//! per (prefill worker, decode worker) pair, page runs moved by RDMA WRITE into the pages decode
//! granted, and the queue pair's drain as the proof that no write of it can land any more.
//!
//! Sans-IO parts, built and tested everywhere:
//! - [`plan`]: the work requests of one write (coalesced page runs, checked against the grant
//!   and its remote key, signalled every N, closed by a WRITE_WITH_IMM naming the attempt);
//! - [`qp`]: the queue pair's states, its send queue's bookkeeping, and the drain;
//! - [`fence`]: decode's [`crate::Fence`] over its queue pairs: an aborted attempt's pages stay
//!   quarantined until its queue pair is drained (the marker flushed) or destroyed;
//! - [`fallback`]: which backend a pair uses next (`auto`: shm on one host, rdma on one fabric,
//!   tcp otherwise; rdma failures fall back to tcp with a doubling back-off, counted).
//!
//! The verbs themselves (`libibverbs`) come with the `rdma` cargo feature ([`probe`] finds a
//! device and its port; without the feature it says the build has none).

pub mod fallback;
pub mod fence;
pub mod plan;
pub mod qp;

pub use fallback::{Fabric, LinkLayer, PairOffer, PairPolicy, Wanted};
pub use fence::QpFence;
pub use plan::{RemoteGrant, RemoteRegion, WorkRequest, WrKind, WrLimits};
pub use qp::{Completed, Completion, QpState, QueuePair, WcStatus};

/// A worker's RDMA settings (`[serving]` or `[serving.node.NAME]`: `rdma_device`,
/// `rdma_gid_index`, `rdma_mtu`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The device by name (`mlx5_0`); `None`: the first one.
    pub device: Option<String>,
    /// The port (1 unless the NIC has several).
    pub port: u8,
    /// The GID table index (RoCE v2 is usually 3 on Mellanox NICs; InfiniBand 0).
    pub gid_index: u32,
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub mtu: u32,
}

impl Default for RdmaConfig {
    fn default() -> RdmaConfig {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: 0,
            mtu: 4096,
        }
    }
}

/// The path MTUs the verbs know.
pub const MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

/// A device and port ready to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaPort {
    /// The device's name.
    pub device: String,
    /// Its port's fabric.
    pub fabric: Fabric,
}

/// Why the RDMA backend cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdmaError {
    /// This build has no verbs.
    #[error(
        "this build of Duet has no RDMA backend (build it with `--features rdma`, which needs libibverbs)"
    )]
    NotBuilt,
    /// No device at all (no NIC, no soft-RoCE).
    #[error("no RDMA device on this machine: {0}")]
    NoDevice(String),
    /// The named device is not there.
    #[error("no RDMA device named `{wanted}` (this machine has: {have})")]
    NotFound {
        /// Asked for.
        wanted: String,
        /// Present.
        have: String,
    },
    /// The port or GID index does not exist on the device.
    #[error("{device} has no GID {gid_index} on port {port}")]
    NoGid {
        /// Device.
        device: String,
        /// Port.
        port: u8,
        /// GID index.
        gid_index: u32,
    },
    /// A verbs call failed.
    #[error("{0}")]
    Verbs(String),
}

/// Finds the device and port `cfg` names. Never panics: without the `rdma` feature, without a
/// device or without kernel support it says which.
pub fn probe(cfg: &RdmaConfig) -> Result<RdmaPort, RdmaError> {
    #[cfg(feature = "rdma")]
    {
        verbs::probe(cfg)
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = cfg;
        Err(RdmaError::NotBuilt)
    }
}

#[cfg(feature = "rdma")]
mod verbs {
    use super::{Fabric, LinkLayer, RdmaConfig, RdmaError, RdmaPort};

    pub(super) fn probe(cfg: &RdmaConfig) -> Result<RdmaPort, RdmaError> {
        let list = ibverbs::devices().map_err(|e| RdmaError::NoDevice(e.to_string()))?;
        let names: Vec<String> = list
            .iter()
            .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        if names.is_empty() {
            return Err(RdmaError::NoDevice(
                "ibv_get_device_list returned none (no NIC, and no rdma_rxe soft-RoCE)".into(),
            ));
        }
        let index = match &cfg.device {
            None => 0,
            Some(w) => names
                .iter()
                .position(|n| n == w)
                .ok_or_else(|| RdmaError::NotFound {
                    wanted: w.clone(),
                    have: names.join(", "),
                })?,
        };
        let device = list
            .get(index)
            .ok_or_else(|| RdmaError::Verbs("device list changed while read".into()))?;
        let ctx = device
            .open()
            .map_err(|e| RdmaError::Verbs(format!("{}: open: {e}", names[index])))?;
        let entry = ctx
            .gid_table()
            .iter()
            .find(|g| g.port_num == u32::from(cfg.port) && g.gid_index == cfg.gid_index)
            .cloned()
            .ok_or_else(|| RdmaError::NoGid {
                device: names[index].clone(),
                port: cfg.port,
                gid_index: cfg.gid_index,
            })?;
        // IBV_GID_TYPE_IB is 0; RoCE v1 and v2 (1, 2) run over Ethernet.
        let link_layer = if entry.gid_type == 0 {
            LinkLayer::InfiniBand
        } else {
            LinkLayer::Ethernet
        };
        Ok(RdmaPort {
            device: names[index].clone(),
            fabric: Fabric {
                link_layer,
                subnet_prefix: entry.gid.subnet_prefix(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_device_the_probe_says_why_and_never_panics() {
        match probe(&RdmaConfig::default()) {
            // A machine with a NIC or soft-RoCE (the GPU check reports which): a real port.
            Ok(port) => assert!(!port.device.is_empty()),
            Err(e) => {
                let text = e.to_string();
                eprintln!("rdma probe: {text}");
                if cfg!(feature = "rdma") {
                    assert!(
                        matches!(e, RdmaError::NoDevice(_) | RdmaError::NoGid { .. }),
                        "{text}"
                    );
                } else {
                    assert_eq!(e, RdmaError::NotBuilt);
                    assert!(text.contains("--features rdma"), "{text}");
                }
            }
        }
    }
}
