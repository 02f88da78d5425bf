//! Decode's fence in the simulator, modelled on the claim table (`transport/src/claims.rs`):
//! a slot per granted attempt, which each write holds from its check to its landing and decode
//! revokes. A revoke is proven when no write holds the slot; a dead writer's holds drop.

use std::collections::BTreeMap;

use duet_transport::{Fence, Revocation};

/// A grant's slot in decode's fence (the claim table): revoked by decode, held by each write
/// between its check and its landing.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) revoked: bool,
    pub(crate) writers: u32,
}

/// Decode's fence in the simulator (the claim table), a slot per granted attempt: a revoke
/// marks the slot and is proven when no write holds it.
#[derive(Debug, Default)]
pub(crate) struct Slots(BTreeMap<u64, Slot>);

impl std::ops::Deref for Slots {
    type Target = BTreeMap<u64, Slot>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Slots {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Fence for Slots {
    fn revoke(&mut self, attempt: u64) -> Revocation {
        let slot = self.0.entry(attempt).or_default();
        slot.revoked = true;
        if slot.writers == 0 {
            Revocation::Proven
        } else {
            Revocation::Busy
        }
    }
}
