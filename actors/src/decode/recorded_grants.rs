//! Decode's grants as the transfers' fence, each proven revoke recorded in the transfer
//! history.

use duet_transport::{AttemptKey, Fence, Grants, Revocation};

use crate::history;

/// Decode's grants as the transfers' fence: each proven revoke is recorded in the transfer
/// history (`revoked`, when it is on) before the attempt's pages can change hands. It is the
/// proof that frees them, so the history's checker orders writes against it: a writer whose
/// process was killed mid-copy records no `write_end`, and what settles its write is decode
/// taking the claim slot back once the dead process's lock is gone.
#[derive(Debug)]
pub(super) struct RecordedGrants {
    grants: Grants,
    /// This node and worker incarnation, as the history names them.
    node: String,
    incarnation: u64,
}

impl RecordedGrants {
    pub(super) fn new(grants: Grants, node: &str, incarnation: u64) -> RecordedGrants {
        RecordedGrants {
            grants,
            node: node.to_string(),
            incarnation,
        }
    }
}

impl std::ops::Deref for RecordedGrants {
    type Target = Grants;

    fn deref(&self) -> &Grants {
        &self.grants
    }
}

impl Fence for RecordedGrants {
    fn revoke(&mut self, attempt: AttemptKey) -> Revocation {
        let proof = self.grants.revoke(attempt);
        if proof == Revocation::Proven {
            history::record("revoked", &self.node, self.incarnation, attempt, &[]);
        }
        proof
    }
}
