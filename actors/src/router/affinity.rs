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
//! The choice ([`choose`]) takes the worker with the least work once the prompt is added (its
//! queue plus the part of the prompt it does not hold), so a cached prefix counts for exactly
//! the compute it saves; when no worker holds any of the prompt it falls back to the load-only
//! choice. Sans-IO: time is a counter, and the tests
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

/// One prompt's block hashes, computed once per page size however many workers are compared
/// (routing runs on every request: the prompt is hashed at most once per layout).
#[derive(Debug)]
pub struct PromptBlocks<'a> {
    prompt: &'a [u32],
    by_page: Vec<(usize, Vec<u64>)>,
}

impl<'a> PromptBlocks<'a> {
    /// The prompt, not hashed yet.
    pub fn new(prompt: &'a [u32]) -> PromptBlocks<'a> {
        PromptBlocks {
            prompt,
            by_page: Vec::new(),
        }
    }

    /// Tokens of the prompt.
    pub fn len(&self) -> usize {
        self.prompt.len()
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.prompt.is_empty()
    }

    /// The hashes of its `page`-token blocks.
    pub fn of(&mut self, page: usize) -> &[u64] {
        let i = match self.by_page.iter().position(|(p, _)| *p == page) {
            Some(i) => i,
            None => {
                self.by_page.push((page, block_hashes(self.prompt, page)));
                self.by_page.len() - 1
            }
        };
        &self.by_page[i].1
    }
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

/// The candidate with the least work once this prompt is added: its queue plus the part of
/// the prompt it does not hold. A cached prefix is worth exactly the compute it saves, so a
/// worker holding a long prefix wins over an idle one only while its queue is shorter than
/// that prefix ("when load allows"), and a burst of requests sharing a short prefix still
/// spreads. Ties go to the longer match, then the lighter load. `None` when nobody holds any
/// of the prompt (the caller picks by load alone, with its randomness).
pub fn choose(candidates: &[Candidate], prompt_tokens: usize) -> Option<&Candidate> {
    if candidates.iter().all(|c| c.matched_tokens == 0) {
        return None;
    }
    candidates.iter().min_by(|a, b| {
        let cost = |c: &Candidate| c.load + prompt_tokens.saturating_sub(c.matched_tokens);
        cost(a)
            .cmp(&cost(b))
            .then(b.matched_tokens.cmp(&a.matched_tokens))
            .then(a.load.cmp(&b.load))
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
    fn a_prompt_is_hashed_once_per_page_size() {
        let p: Vec<u32> = (0..64).collect();
        let mut b = PromptBlocks::new(&p);
        assert_eq!(b.of(16), block_hashes(&p, 16).as_slice());
        assert_eq!(b.of(32), block_hashes(&p, 32).as_slice());
        assert_eq!(b.of(16).len(), 4);
        assert_eq!(b.by_page.len(), 2);
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
    fn a_cached_prefix_counts_for_the_compute_it_saves() {
        // A 600-token prompt; d1 holds 512 of it and has 300 tokens queued: 300 + 88 < 0 + 600.
        let cs = [c("d0", 0, 0), c("d1", 300, 512)];
        assert_eq!(choose(&cs, 600).map(|c| c.worker.as_str()), Some("d1"));
        // d1 is far busier than its prefix saves: the idle worker wins.
        let cs = [c("d0", 0, 0), c("d1", 5000, 512)];
        assert_eq!(choose(&cs, 600).map(|c| c.worker.as_str()), Some("d0"));
        // A short shared prefix (a chat template) does not herd a burst: one queued request
        // outweighs it.
        let cs = [c("d0", 56, 32), c("d1", 0, 0)];
        assert_eq!(choose(&cs, 40).map(|c| c.worker.as_str()), Some("d1"));
        // Equal cost: the longer match; then the lighter load.
        let cs = [c("d0", 0, 256), c("d1", 256, 512), c("d2", 10, 512)];
        assert_eq!(choose(&cs, 600).map(|c| c.worker.as_str()), Some("d2"));
        assert_eq!(choose(&[], 10), None);
        assert_eq!(
            choose(&[c("d0", 0, 0), c("d1", 9, 0)], 10),
            None,
            "nobody matches"
        );
    }
}
