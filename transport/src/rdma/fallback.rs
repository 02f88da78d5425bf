//! Which backend a (prefill, decode) pair uses for its next attempt.
//!
//! `kv_transport = "auto"` picks shm on one host, rdma when both workers have an RDMA device on
//! the same fabric, tcp otherwise. A pair whose attempt fails on rdma moves to tcp for its next
//! attempts (counted, as Mooncake's TCP fallback does) and tries rdma again after a back-off
//! that doubles with each rdma failure in a row (1, 2, 4, ... up to 64 attempts), so a broken
//! NIC costs one failed attempt per back-off, not one per request.

use serde::{Deserialize, Serialize};

use crate::backend::Backend;

/// An RDMA port as a worker advertises it (in its layout hello).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fabric {
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: LinkLayer,
    /// The GID's subnet prefix (its upper 64 bits): InfiniBand ports on one subnet share it;
    /// RoCE v2 GIDs carry the IPv6 prefix (or `::ffff:0:0/96` for IPv4).
    pub subnet_prefix: u64,
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE).
    Ethernet,
}

impl Fabric {
    /// Whether a queue pair between the two ports can connect: the same link layer and, on
    /// InfiniBand, the same subnet (RoCE v2 is routed: any two Ethernet ports may connect).
    pub fn reaches(&self, other: &Fabric) -> bool {
        self.link_layer == other.link_layer
            && (self.link_layer == LinkLayer::Ethernet || self.subnet_prefix == other.subnet_prefix)
    }
}

/// What a pair's two sides offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairOffer {
    /// Whether both workers are on one host (shared memory works).
    pub same_host: bool,
    /// Prefill's RDMA port, if it has one.
    pub prefill: Option<Fabric>,
    /// Decode's RDMA port, if it has one.
    pub decode: Option<Fabric>,
}

/// What the configuration asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// The best available.
    Auto,
    /// Exactly this backend.
    Only(Backend),
}

/// Counts a pair's policy keeps (exported as metrics by the caller).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FallbackStats {
    /// Attempts sent over tcp because rdma had failed (the fallback counter).
    pub fell_back: u64,
    /// Attempts that failed on rdma.
    pub rdma_failures: u64,
}

/// One pair's choice, across its attempts.
#[derive(Debug, Clone, Default)]
pub struct PairPolicy {
    /// Failures on rdma in a row.
    streak: u32,
    /// Attempts left on tcp before rdma is tried again.
    tcp_left: u32,
    /// The counts.
    pub stats: FallbackStats,
}

/// The longest back-off, in attempts.
const MAX_BACKOFF: u32 = 64;

impl PairPolicy {
    /// A pair with no history.
    pub fn new() -> PairPolicy {
        PairPolicy::default()
    }

    /// The backend for the pair's next attempt. `Only(Rdma)` never falls back (the operator
    /// asked for rdma alone; a failure is an error they should see).
    pub fn choose(&mut self, wanted: Wanted, offer: &PairOffer) -> Backend {
        let rdma_possible = match (&offer.prefill, &offer.decode) {
            (Some(p), Some(d)) => p.reaches(d),
            _ => false,
        };
        match wanted {
            Wanted::Only(b) => b,
            Wanted::Auto if offer.same_host => Backend::Shm,
            Wanted::Auto if !rdma_possible => Backend::Tcp,
            Wanted::Auto if self.tcp_left > 0 => {
                self.tcp_left -= 1;
                self.stats.fell_back += 1;
                Backend::Tcp
            }
            Wanted::Auto => Backend::Rdma,
        }
    }

    /// The attempt on `backend` ended; `failed` says whether the transport failed it (not a
    /// cancel or a dead decode worker).
    pub fn ended(&mut self, backend: Backend, failed: bool) {
        if backend != Backend::Rdma {
            return;
        }
        if failed {
            self.stats.rdma_failures += 1;
            self.streak = self.streak.saturating_add(1);
            self.tcp_left = (1u32 << (self.streak - 1).min(6)).min(MAX_BACKOFF);
        } else {
            self.streak = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ib(prefix: u64) -> Option<Fabric> {
        Some(Fabric {
            link_layer: LinkLayer::InfiniBand,
            subnet_prefix: prefix,
        })
    }

    fn offer(prefill: Option<Fabric>, decode: Option<Fabric>) -> PairOffer {
        PairOffer {
            same_host: false,
            prefill,
            decode,
        }
    }

    #[test]
    fn auto_picks_shm_on_one_host_rdma_on_one_fabric_and_tcp_otherwise() {
        let mut p = PairPolicy::new();
        let mut same = offer(ib(1), ib(1));
        assert_eq!(p.choose(Wanted::Auto, &same), Backend::Rdma);
        same.same_host = true;
        assert_eq!(p.choose(Wanted::Auto, &same), Backend::Shm);
        assert_eq!(
            p.choose(Wanted::Auto, &offer(ib(1), ib(2))),
            Backend::Tcp,
            "two subnets"
        );
        assert_eq!(
            p.choose(Wanted::Auto, &offer(ib(1), None)),
            Backend::Tcp,
            "one side has none"
        );
        let roce = |prefix| {
            Some(Fabric {
                link_layer: LinkLayer::Ethernet,
                subnet_prefix: prefix,
            })
        };
        assert_eq!(
            p.choose(Wanted::Auto, &offer(roce(1), roce(2))),
            Backend::Rdma,
            "RoCE v2 routes"
        );
        assert_eq!(
            p.choose(Wanted::Auto, &offer(roce(1), ib(1))),
            Backend::Tcp,
            "IB and Ethernet"
        );
        assert_eq!(p.stats, FallbackStats::default());
    }

    #[test]
    fn a_pair_failing_on_rdma_falls_back_to_tcp_with_a_doubling_back_off() {
        let mut p = PairPolicy::new();
        let o = offer(ib(1), ib(1));
        let mut seq = Vec::new();
        // Rdma fails every time it is tried: tcp for 1, then 2, then 4 attempts between tries.
        for _ in 0..10 {
            let b = p.choose(Wanted::Auto, &o);
            p.ended(b, true);
            seq.push(b.name());
        }
        assert_eq!(
            seq,
            [
                "rdma", "tcp", "rdma", "tcp", "tcp", "rdma", "tcp", "tcp", "tcp", "tcp"
            ]
        );
        assert_eq!(
            p.stats,
            FallbackStats {
                fell_back: 7,
                rdma_failures: 3
            }
        );
        // A success on rdma resets the streak.
        let b = p.choose(Wanted::Auto, &o);
        assert_eq!(b, Backend::Rdma);
        p.ended(b, false);
        p.ended(Backend::Rdma, true);
        assert_eq!(p.choose(Wanted::Auto, &o), Backend::Tcp);
        assert_eq!(
            p.choose(Wanted::Auto, &o),
            Backend::Rdma,
            "back-off of 1 after a fresh failure"
        );
    }

    #[test]
    fn the_back_off_is_capped_and_only_rdma_never_falls_back() {
        let mut p = PairPolicy::new();
        for _ in 0..20 {
            p.ended(Backend::Rdma, true);
        }
        assert_eq!(p.tcp_left, 64);
        let o = offer(ib(1), ib(1));
        assert_eq!(p.choose(Wanted::Only(Backend::Rdma), &o), Backend::Rdma);
        // Tcp failures do not move the rdma back-off.
        let before = p.tcp_left;
        p.ended(Backend::Tcp, true);
        assert_eq!(p.tcp_left, before);
    }
}
