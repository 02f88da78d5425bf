//! The prefix cache: a radix tree over full KV pages, keyed by the token ids they hold.
//!
//! Each node is one full page: the `page_size` tokens it holds (its edge label) and the page.
//! A path from the root spells a prefix. The cache holds one reference on every cached page;
//! a sequence that reuses a page takes its own. Only full pages are cached, and a full page is
//! never written again, so sharing is read-only. When pages run short, leaves that nobody but
//! the cache references are evicted, least recently used first.
//!
//! A cache may *keep* what it was given for a while ([`PrefixCache::set_keep`]): prefill keeps
//! a finished prompt's pages so that a stream whose decode worker died can be re-sent without
//! recomputing it. Kept leaves are evicted only after every other candidate, so the keep
//! never starves admissions, and it ends by itself: it holds no reference of its own.
//!
//! No clock inside: the cache's time is what its owner last told it ([`PrefixCache::tick`],
//! milliseconds on the owner's clock), so a simulation drives it as it drives the scheduler
//! and the ledger.

use std::collections::HashMap;
use std::time::Duration;

use duet_gpu::{PageAllocator, PageId, PoolError};

#[derive(Debug)]
struct Node {
    page: PageId,
    parent: Option<usize>,
    key: Vec<u32>,
    children: HashMap<Vec<u32>, usize>,
    last_used: u64,
    /// Evicted last until then (the cache's time, milliseconds).
    kept_until: Option<u64>,
}

/// A radix tree of cached pages.
#[derive(Debug)]
pub struct PrefixCache {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    free_slots: Vec<usize>,
    roots: HashMap<Vec<u32>, usize>,
    clock: u64,
    keep: Duration,
    /// The owner's time, milliseconds (see [`PrefixCache::tick`]).
    now_ms: u64,
    /// Pages reused by sequences (for metrics and tests).
    pub hits: u64,
    /// Kept pages that memory pressure evicted before their time.
    pub keeps_broken: u64,
}

impl PrefixCache {
    /// An empty cache for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> PrefixCache {
        PrefixCache {
            page_size,
            nodes: Vec::new(),
            free_slots: Vec::new(),
            roots: HashMap::new(),
            clock: 0,
            keep: Duration::ZERO,
            now_ms: 0,
            hits: 0,
            keeps_broken: 0,
        }
    }

    /// Keeps every page inserted from now on for `keep` after its insertion (evicted only
    /// when nothing else can be).
    pub fn set_keep(&mut self, keep: Duration) {
        self.keep = keep;
    }

    /// The owner's time is now `now_ms` (milliseconds on its clock; it never goes back). Keep
    /// windows are measured on it.
    pub fn tick(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Pages still inside their keep window.
    pub fn kept(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| self.is_kept(n))
            .count()
    }

    fn is_kept(&self, n: &Node) -> bool {
        n.kept_until.is_some_and(|t| t > self.now_ms)
    }

    /// Pages held by the cache.
    pub fn len(&self) -> usize {
        self.nodes.iter().flatten().count()
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn node(&self, i: usize) -> &Node {
        // Indices come from `roots`/`children`, which only hold live slots.
        self.nodes[i]
            .as_ref()
            .unwrap_or_else(|| unreachable!("dangling cache node {i}"))
    }

    fn child(&self, parent: Option<usize>, key: &[u32]) -> Option<usize> {
        match parent {
            None => self.roots.get(key).copied(),
            Some(p) => self.node(p).children.get(key).copied(),
        }
    }

    /// The longest cached run of full pages that prefixes `tokens`, at most `max_pages`; each
    /// returned page gets a reference for the caller.
    pub fn acquire(
        &mut self,
        tokens: &[u32],
        max_pages: usize,
        alloc: &mut PageAllocator,
    ) -> Result<Vec<PageId>, PoolError> {
        self.clock += 1;
        let mut pages = Vec::new();
        let mut at = None;
        for key in tokens.chunks_exact(self.page_size).take(max_pages) {
            let Some(i) = self.child(at, key) else { break };
            let page = self.node(i).page;
            alloc.retain(page)?;
            pages.push(page);
            if let Some(n) = self.nodes[i].as_mut() {
                n.last_used = self.clock;
            }
            at = Some(i);
        }
        self.hits += pages.len() as u64;
        Ok(pages)
    }

    /// Caches the full pages of a sequence: `pages[i]` holds `tokens[i * page_size..]`. Pages
    /// already cached under the same prefix are kept (the sequence's copy stays its own).
    pub fn insert(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        alloc: &mut PageAllocator,
    ) -> Result<(), PoolError> {
        self.clock += 1;
        let keep_ms = u64::try_from(self.keep.as_millis()).unwrap_or(u64::MAX);
        let kept_until = (keep_ms > 0).then(|| self.now_ms.saturating_add(keep_ms));
        let mut at: Option<usize> = None;
        for (key, &page) in tokens.chunks_exact(self.page_size).zip(pages) {
            let i = match self.child(at, key) {
                Some(i) => i,
                None => {
                    alloc.retain(page)?;
                    let node = Node {
                        page,
                        parent: at,
                        key: key.to_vec(),
                        children: HashMap::new(),
                        last_used: self.clock,
                        kept_until,
                    };
                    let i = match self.free_slots.pop() {
                        Some(slot) => {
                            self.nodes[slot] = Some(node);
                            slot
                        }
                        None => {
                            self.nodes.push(Some(node));
                            self.nodes.len() - 1
                        }
                    };
                    match at {
                        None => {
                            self.roots.insert(key.to_vec(), i);
                        }
                        Some(p) => {
                            if let Some(parent) = self.nodes[p].as_mut() {
                                parent.children.insert(key.to_vec(), i);
                            }
                        }
                    }
                    i
                }
            };
            if let Some(n) = self.nodes[i].as_mut() {
                n.last_used = self.clock;
                n.kept_until = n.kept_until.max(kept_until);
            }
            at = Some(i);
        }
        Ok(())
    }

    /// Frees up to `want` pages: least recently used leaves that only the cache references.
    /// Returns how many were freed.
    pub fn evict(&mut self, want: usize, alloc: &mut PageAllocator) -> usize {
        let mut freed = 0;
        while freed < want {
            // Leaves past their keep go first (least recently used first), then kept ones.
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(_, n)| n.children.is_empty() && alloc.refs(n.page) == 1)
                .min_by_key(|(_, n)| (self.is_kept(n), n.last_used))
                .map(|(i, n)| (i, self.is_kept(n)));
            let Some((i, kept)) = victim else { break };
            if kept {
                self.keeps_broken += 1;
            }
            let Some(node) = self.nodes[i].take() else {
                break;
            };
            self.free_slots.push(i);
            match node.parent {
                None => {
                    self.roots.remove(&node.key);
                }
                Some(p) => {
                    if let Some(parent) = self.nodes[p].as_mut() {
                        parent.children.remove(&node.key);
                    }
                }
            }
            if alloc.release(node.page).is_ok() {
                freed += 1;
            }
        }
        freed
    }

    /// Pages that only the cache references (what `evict` could free now).
    pub fn evictable(&self, alloc: &PageAllocator) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| alloc.refs(n.page) == 1 && alloc.pins(n.page) == 0)
            .count()
    }

    /// Drops every page nobody else holds (for shutdown and the "quiet pool" check).
    pub fn clear(&mut self, alloc: &mut PageAllocator) {
        self.evict(usize::MAX, alloc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_full_pages_and_evicts_unreferenced_leaves() {
        let mut alloc = PageAllocator::new(8);
        let mut cache = PrefixCache::new(2);
        let tokens = [1, 2, 3, 4, 5];
        let pages = alloc.alloc(3).unwrap();
        cache.insert(&tokens, &pages, &mut alloc).unwrap();
        assert_eq!(cache.len(), 2); // only the two full pages
        // Another sequence with the same first 4 tokens reuses both pages.
        let got = cache.acquire(&[1, 2, 3, 4, 9], 2, &mut alloc).unwrap();
        assert_eq!(got, pages[..2]);
        assert_eq!(cache.hits, 2);
        // A different second page: only the first is shared.
        let got2 = cache.acquire(&[1, 2, 7, 7], 2, &mut alloc).unwrap();
        assert_eq!(got2, pages[..1]);
        // Nothing is evictable while sequences hold the pages.
        alloc.release_all(&pages).unwrap();
        assert_eq!(cache.evict(8, &mut alloc), 0);
        alloc.release_all(&got).unwrap();
        alloc.release_all(&got2).unwrap();
        assert_eq!(cache.evict(8, &mut alloc), 2);
        assert!(cache.is_empty());
        assert_eq!(alloc.stats().free, 8);
    }

    #[test]
    fn kept_pages_are_evicted_after_every_other_leaf() {
        let mut alloc = PageAllocator::new(8);
        let mut cache = PrefixCache::new(2);
        cache.set_keep(Duration::from_secs(60));
        let kept = alloc.alloc(1).unwrap();
        cache.insert(&[1, 2], &kept, &mut alloc).unwrap();
        cache.set_keep(Duration::ZERO);
        let plain = alloc.alloc(1).unwrap();
        cache.insert(&[3, 4], &plain, &mut alloc).unwrap();
        alloc.release_all(&kept).unwrap();
        alloc.release_all(&plain).unwrap();
        // The kept page is older, yet the plain one goes first.
        assert_eq!(cache.kept(), 1);
        assert_eq!(cache.evict(1, &mut alloc), 1);
        assert_eq!(cache.acquire(&[1, 2, 0], 1, &mut alloc).unwrap(), kept);
        alloc.release_all(&kept).unwrap();
        assert_eq!(cache.keeps_broken, 0);
        // Under pressure the keep gives way, and says so.
        assert_eq!(cache.evict(1, &mut alloc), 1);
        assert_eq!(cache.keeps_broken, 1);
        assert_eq!(alloc.stats().free, 8);
    }

    #[test]
    fn a_keep_ends_when_the_owners_time_passes_it() {
        let mut alloc = PageAllocator::new(4);
        let mut cache = PrefixCache::new(2);
        cache.tick(1_000);
        cache.set_keep(Duration::from_secs(30));
        let pages = alloc.alloc(1).unwrap();
        cache.insert(&[1, 2], &pages, &mut alloc).unwrap();
        alloc.release_all(&pages).unwrap();
        cache.tick(30_999);
        assert_eq!(cache.kept(), 1, "inside its window");
        cache.tick(31_000);
        assert_eq!(cache.kept(), 0, "the window is over");
        cache.tick(5); // time never goes back
        assert_eq!(cache.kept(), 0);
        assert_eq!(cache.evict(1, &mut alloc), 1);
        assert_eq!(cache.keeps_broken, 0, "an expired keep is no broken keep");
    }
}
