//! Cache-aware routing: which worker most likely holds the longest cached prefix of a prompt.
//!
//! The router keeps, per worker, the hashes of the page-sized blocks of the prompts it sent
//! there (a chain: block `i`'s hash covers blocks `0..=i`, so a match of block `i` is a match
//! of the whole prefix up to it), in LRU order, bounded by the worker's KV pages. That is the
//! router's estimate of the worker's prefix cache, as SGLang's cache-aware router keeps an
//! approximate radix tree per worker: no message from the workers, wrong only where the
//! worker evicted (then the worker computes more than the router hoped; nothing is wrong).
//! A worker whose incarnation changes lost its cache: its entries are dropped.
//!
//! The choice ([`choose`]) prefers the longest match among the workers whose load is within a
//! slack of the least loaded one ("when load allows"); when no worker matches, or the loads
//! are apart, it falls back to the load-only choice. Sans-IO: time is a counter, and the tests
//! drive it directly.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// The chained hashes of the full `page`-token blocks of `tokens`.
pub fn block_hashes(tokens: &[u32], page: usize) -> Vec<u64> {
    let page = page.max(1);
    let mut prev = 0u64;
    tokens
        .chunks_exact(page)
        .map(|block| {
            // DefaultHasher::new() has fixed keys: the same prompt hashes the same in every
            // router process.
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

#[derive(Debug, Default)]
struct Blocks {
    incarnation: u64,
    /// hash -> last use.
    last: HashMap<u64, u64>,
    /// last use -> hash (LRU order).
    order: BTreeMap<u64, u64>,
}

/// The router's estimate of every worker's prefix cache.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    workers: HashMap<String, Blocks>,
    tick: u64,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> PrefixIndex {
        PrefixIndex::default()
    }

    /// Leading blocks of `hashes` that `worker` (at `incarnation`) holds.
    pub fn matched(&self, worker: &str, incarnation: u64, hashes: &[u64]) -> usize {
        let Some(b) = self
            .workers
            .get(worker)
            .filter(|b| b.incarnation == incarnation)
        else {
            return 0;
        };
        hashes.iter().take_while(|h| b.last.contains_key(h)).count()
    }

    /// `worker` was sent a prompt with these blocks: it will hold them (up to `capacity`
    /// blocks in all, the least recently used go first).
    pub fn record(&mut self, worker: &str, incarnation: u64, hashes: &[u64], capacity: usize) {
        let b = self.workers.entry(worker.to_string()).or_default();
        if b.incarnation != incarnation {
            // A restarted worker starts with an empty cache.
            *b = Blocks {
                incarnation,
                ..Blocks::default()
            };
        }
        for h in hashes {
            self.tick += 1;
            if let Some(old) = b.last.insert(*h, self.tick) {
                b.order.remove(&old);
            }
            b.order.insert(self.tick, *h);
        }
        while b.last.len() > capacity.max(1) {
            let Some((_, h)) = b.order.pop_first() else {
                break;
            };
            b.last.remove(&h);
        }
    }

    /// Forgets a worker that left.
    pub fn forget(&mut self, worker: &str) {
        self.workers.remove(worker);
    }

    /// Blocks held for `worker` (tests, metrics).
    pub fn held(&self, worker: &str) -> usize {
        self.workers.get(worker).map_or(0, |b| b.last.len())
    }
}

/// A candidate worker: its name, its load (lower is less loaded), and its matched tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The worker.
    pub worker: String,
    /// Its load, in prompt tokens of work queued (the router's load key).
    pub load: usize,
    /// Tokens of the prompt it holds cached (by the index).
    pub matched_tokens: usize,
}

/// How much more loaded than the least loaded worker a worker may be and still be chosen
/// for its cache: a prefill chunk's worth of work (a cached prefix saves at least that).
pub const LOAD_SLACK_TOKENS: usize = 512;

/// The candidate with the longest match among those within [`LOAD_SLACK_TOKENS`] (and half
/// again) of the least loaded; `None` when nobody matches (the caller picks by load alone).
pub fn choose(candidates: &[Candidate]) -> Option<&Candidate> {
    let min = candidates.iter().map(|c| c.load).min()?;
    let allowed = min + LOAD_SLACK_TOKENS.max(min / 2);
    candidates
        .iter()
        .filter(|c| c.load <= allowed && c.matched_tokens > 0)
        // Longest match; then the less loaded.
        .max_by(|a, b| {
            a.matched_tokens
                .cmp(&b.matched_tokens)
                .then(b.load.cmp(&a.load))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(worker: &str, load: usize, matched_tokens: usize) -> Candidate {
        Candidate {
            worker: worker.into(),
            load,
            matched_tokens,
        }
    }

    #[test]
    fn block_hashes_chain_so_a_match_is_a_whole_prefix() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // differs in the second block of 16
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 2, "only full blocks");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // The same block after a different prefix hashes differently.
        let c: Vec<u32> = (100..116).chain(16..32).collect();
        assert_ne!(block_hashes(&c, 16)[1], ha[1]);
        assert_eq!(block_hashes(&a, 16), ha, "deterministic");
    }

    #[test]
    fn the_index_matches_leading_blocks_forgets_restarts_and_evicts_least_recent() {
        let mut ix = PrefixIndex::new();
        let sys: Vec<u32> = (0..64).collect();
        let h = block_hashes(&sys, 16);
        ix.record("d0", 7, &h, 100);
        assert_eq!(ix.matched("d0", 7, &h), 4);
        let mut other = sys.clone();
        other[40] = 1;
        assert_eq!(ix.matched("d0", 7, &block_hashes(&other, 16)), 2);
        assert_eq!(ix.matched("d1", 7, &h), 0, "never sent there");
        assert_eq!(
            ix.matched("d0", 8, &h),
            0,
            "a new incarnation has an empty cache"
        );
        ix.record("d0", 8, &h[..1], 100);
        assert_eq!(ix.held("d0"), 1, "the old incarnation's blocks are gone");
        // Capacity 3: recording 4 more evicts the least recently used.
        let mut ix = PrefixIndex::new();
        ix.record("d0", 1, &h[..2], 3);
        let fresh = block_hashes(&(1000..1032).collect::<Vec<u32>>(), 16);
        ix.record("d0", 1, &fresh, 3);
        assert_eq!(ix.held("d0"), 3);
        assert_eq!(ix.matched("d0", 1, &h), 0, "h[0] was least recent");
        assert_eq!(ix.matched("d0", 1, &fresh), 2);
        ix.forget("d0");
        assert_eq!(ix.held("d0"), 0);
    }

    #[test]
    fn the_longest_match_wins_when_load_allows_and_load_wins_otherwise() {
        // d1 holds the prefix and is a little busier: it wins.
        let cs = [c("d0", 100, 0), c("d1", 300, 512)];
        assert_eq!(choose(&cs).map(|c| c.worker.as_str()), Some("d1"));
        // d1 is far busier: its cache does not pay for the queue; the caller picks by load.
        let cs = [c("d0", 100, 0), c("d1", 5000, 512)];
        assert_eq!(choose(&cs), None);
        // Two matches: the longer; equal matches: the less loaded.
        let cs = [c("d0", 0, 256), c("d1", 10, 512), c("d2", 5, 512)];
        assert_eq!(choose(&cs).map(|c| c.worker.as_str()), Some("d2"));
        // The slack grows with the load (half the least loaded's queue).
        let cs = [c("d0", 4000, 0), c("d1", 5900, 64)];
        assert_eq!(choose(&cs).map(|c| c.worker.as_str()), Some("d1"));
        assert_eq!(choose(&[]), None);
        assert_eq!(choose(&[c("d0", 0, 0)]), None, "nobody matches");
    }
}
