//! The paged KV pool and its page allocator.
//!
//! # Layout
//!
//! The pool is one array of `n_pages` pages. A page holds `page_size` consecutive token slots of
//! one sequence, for **every** layer, K and V:
//!
//! ```text
//! pool   = page[0] page[1] ... page[n_pages-1]                      (page-major)
//! page   = layer[0].K layer[0].V layer[1].K layer[1].V ... layer[L-1].V
//! block  = slot[0] slot[1] ... slot[page_size-1]                    (one layer's K or V)
//! slot   = head[0][0..head_dim] ... head[n_kv_heads-1][0..head_dim]  (one token)
//! ```
//!
//! So a page is `page_bytes()` contiguous bytes, a run of consecutive pages is one contiguous
//! range (`run_bytes`), and one layer of one page is one contiguous range (`layer_bytes`, K
//! then V). Transports copy those ranges as they are; both sides must agree on the layout
//! (page size, dtype, layers, KV heads, head dim), which the pairing handshake checks.
//!
//! # Allocation
//!
//! Pages are reference counted (a page shared by the prefix cache and two sequences has
//! three references) and pinned (a transfer may still write it). A page returns to the free
//! list only when it has no reference and no pin. Misuse (releasing a free page, unpinning an
//! unpinned one) is an error, never a silent corruption.

use std::ops::Range;

use half::f16;
use serde::{Deserialize, Serialize};

/// Index of a page in its pool.
pub type PageId = u32;

/// Element type of the stored K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE half precision (default: half the memory and transfer bytes).
    F16,
    /// Single precision (exact: what the reference uses).
    F32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    /// Parses `f16` or `f32`.
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f16" => Some(KvDtype::F16),
            "f32" => Some(KvDtype::F32),
            _ => None,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        })
    }
}

/// The shape of a pool; equal layouts can exchange pages byte for byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub n_layers: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Token slots per page.
    pub page_size: usize,
    /// Element type.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Elements of one token's K (or V) in one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Elements of one layer's K (or V) in one page.
    pub fn block_elems(&self) -> usize {
        self.page_size * self.kv_dim()
    }

    /// Elements of one page (all layers, K and V).
    pub fn page_elems(&self) -> usize {
        self.n_layers * 2 * self.block_elems()
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.page_elems() * self.dtype.size()
    }

    /// Bytes of KV per token (all layers).
    pub fn token_bytes(&self) -> usize {
        self.n_layers * 2 * self.kv_dim() * self.dtype.size()
    }

    /// Element offset of `slot` in layer `layer`'s K (`v = false`) or V block of `page`.
    pub fn slot_offset(&self, page: PageId, layer: usize, v: bool, slot: usize) -> usize {
        page as usize * self.page_elems()
            + (layer * 2 + usize::from(v)) * self.block_elems()
            + slot * self.kv_dim()
    }

    /// Byte range of `n` consecutive pages starting at `first`.
    pub fn run_bytes(&self, first: PageId, n: usize) -> Range<usize> {
        let start = first as usize * self.page_bytes();
        start..start + n * self.page_bytes()
    }

    /// Byte range of one layer (K then V) of one page.
    pub fn layer_bytes(&self, page: PageId, layer: usize) -> Range<usize> {
        let start = self.slot_offset(page, layer, false, 0) * self.dtype.size();
        start..start + 2 * self.block_elems() * self.dtype.size()
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
}

/// What went wrong with the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not enough free pages for an all-or-nothing allocation.
    #[error("out of KV pages: wanted {wanted}, {free} free")]
    OutOfPages {
        /// Pages asked for.
        wanted: usize,
        /// Pages free.
        free: usize,
    },
    /// The page id is outside the pool.
    #[error("page {0} is outside the pool")]
    OutOfRange(PageId),
    /// The page has no reference to release or add to.
    #[error("page {0} is not allocated")]
    NotAllocated(PageId),
    /// The page has no pin to remove.
    #[error("page {0} is not pinned")]
    NotPinned(PageId),
    /// Memory given for the pool is too small or misaligned.
    #[error("unusable pool memory: {0}")]
    BadMemory(String),
    /// The pool would not fit in memory.
    #[error("a pool of {pages} pages of {page_bytes} bytes is too large")]
    TooLarge {
        /// Pages asked for.
        pages: usize,
        /// Bytes per page.
        page_bytes: usize,
    },
}

/// Page counts of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PoolStats {
    /// Pages in the pool.
    pub capacity: usize,
    /// Pages on the free list.
    pub free: usize,
    /// Pages with a reference or a pin.
    pub used: usize,
    /// Pages with at least one pin.
    pub pinned: usize,
}

/// Reference counts and pins of every page, and the free list.
#[derive(Debug, Clone)]
pub struct PageAllocator {
    refs: Vec<u32>,
    pins: Vec<u32>,
    free: Vec<PageId>,
    pinned: usize,
}

impl PageAllocator {
    /// An allocator of `capacity` free pages.
    pub fn new(capacity: usize) -> PageAllocator {
        PageAllocator {
            refs: vec![0; capacity],
            pins: vec![0; capacity],
            // Pop from the end: low page ids are handed out first.
            free: (0..capacity as PageId).rev().collect(),
            pinned: 0,
        }
    }

    /// Current counts.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.refs.len(),
            free: self.free.len(),
            used: self.refs.len() - self.free.len(),
            pinned: self.pinned,
        }
    }

    /// Free pages.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// `n` pages with one reference each, or none at all.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::OutOfPages {
                wanted: n,
                free: self.free.len(),
            });
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            self.refs[p as usize] = 1;
        }
        Ok(pages)
    }

    /// Adds a reference to an allocated page.
    pub fn retain(&mut self, page: PageId) -> Result<(), PoolError> {
        let r = self.ref_mut(page)?;
        if *r == 0 {
            return Err(PoolError::NotAllocated(page));
        }
        *r += 1;
        Ok(())
    }

    /// Drops a reference; the page is freed when it has neither references nor pins.
    pub fn release(&mut self, page: PageId) -> Result<(), PoolError> {
        let r = self.ref_mut(page)?;
        if *r == 0 {
            return Err(PoolError::NotAllocated(page));
        }
        *r -= 1;
        self.maybe_free(page);
        Ok(())
    }

    /// Drops one reference to each page.
    pub fn release_all(&mut self, pages: &[PageId]) -> Result<(), PoolError> {
        pages.iter().try_for_each(|&p| self.release(p))
    }

    /// Pins an allocated page: it cannot be freed until unpinned.
    pub fn pin(&mut self, page: PageId) -> Result<(), PoolError> {
        if *self.ref_mut(page)? == 0 && self.pins[page as usize] == 0 {
            return Err(PoolError::NotAllocated(page));
        }
        let p = &mut self.pins[page as usize];
        if *p == 0 {
            self.pinned += 1;
        }
        *p += 1;
        Ok(())
    }

    /// Removes a pin; frees the page if nothing else holds it.
    pub fn unpin(&mut self, page: PageId) -> Result<(), PoolError> {
        self.ref_mut(page)?;
        let p = &mut self.pins[page as usize];
        if *p == 0 {
            return Err(PoolError::NotPinned(page));
        }
        *p -= 1;
        if *p == 0 {
            self.pinned -= 1;
        }
        self.maybe_free(page);
        Ok(())
    }

    /// References held on `page`.
    pub fn refs(&self, page: PageId) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    /// Pins held on `page`.
    pub fn pins(&self, page: PageId) -> u32 {
        self.pins.get(page as usize).copied().unwrap_or(0)
    }

    fn ref_mut(&mut self, page: PageId) -> Result<&mut u32, PoolError> {
        self.refs
            .get_mut(page as usize)
            .ok_or(PoolError::OutOfRange(page))
    }

    fn maybe_free(&mut self, page: PageId) {
        let i = page as usize;
        if self.refs[i] == 0 && self.pins[i] == 0 {
            self.free.push(page);
        }
    }
}

/// Memory a pool can live in instead of the heap, such as a shared-memory region that a
/// transport maps into another process. It must be 8-byte aligned and at least as long as the
/// pool; [`KvPool::with_memory`] checks both.
pub trait KvMemory: Send + Sync + std::fmt::Debug {
    /// The memory as bytes.
    fn bytes(&self) -> &[u8];
    /// The memory as writable bytes.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// Where the elements are stored: always bytes, viewed as f16 or f32 per the layout.
#[derive(Debug)]
enum Storage {
    /// Heap memory (u64 words, so every view is aligned).
    Heap(Vec<u64>),
    /// Memory given by the caller.
    External(Box<dyn KvMemory>),
}

/// Read access to one layer's K or V block of a page.
#[derive(Debug, Clone, Copy)]
pub enum BlockView<'a> {
    /// Half-precision elements.
    F16(&'a [f16]),
    /// Single-precision elements.
    F32(&'a [f32]),
}

/// The paged KV pool: storage plus allocator.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    storage: Storage,
    len: usize,
    /// Page references and pins.
    pub alloc: PageAllocator,
}

impl KvPool {
    /// Allocates `n_pages` pages of `layout` on the heap, zeroed, once.
    pub fn new(layout: KvLayout, n_pages: usize) -> Result<KvPool, PoolError> {
        let len = Self::pool_bytes(&layout, n_pages)?;
        Ok(KvPool {
            layout,
            storage: Storage::Heap(vec![0u64; len.div_ceil(8)]),
            len,
            alloc: PageAllocator::new(n_pages),
        })
    }

    /// A pool of `n_pages` pages of `layout` in `memory` (whose contents are kept).
    pub fn with_memory(
        layout: KvLayout,
        n_pages: usize,
        memory: Box<dyn KvMemory>,
    ) -> Result<KvPool, PoolError> {
        let len = Self::pool_bytes(&layout, n_pages)?;
        let bytes = memory.bytes();
        if bytes.len() < len || !(bytes.as_ptr() as usize).is_multiple_of(8) {
            return Err(PoolError::BadMemory(format!(
                "{} bytes at {:p}: the pool needs {len} bytes, 8-byte aligned",
                bytes.len(),
                bytes.as_ptr()
            )));
        }
        Ok(KvPool {
            layout,
            storage: Storage::External(memory),
            len,
            alloc: PageAllocator::new(n_pages),
        })
    }

    fn pool_bytes(layout: &KvLayout, n_pages: usize) -> Result<usize, PoolError> {
        layout
            .page_bytes()
            .checked_mul(n_pages)
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or(PoolError::TooLarge {
                pages: n_pages,
                page_bytes: layout.page_bytes(),
            })
    }

    /// The pool's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.alloc.stats().capacity
    }

    /// Stores one token's K and V (`kv_dim` values each) in `slot` of `page`, layer `layer`.
    pub fn write_token(&mut self, page: PageId, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.kv_dim();
        let ko = self.layout.slot_offset(page, layer, false, slot);
        let vo = self.layout.slot_offset(page, layer, true, slot);
        let dtype = self.layout.dtype;
        let bytes = self.bytes_mut();
        // The casts cannot fail: the storage is 8-byte aligned and a whole number of elements
        // (checked at construction).
        match dtype {
            KvDtype::F16 => {
                let s: &mut [f16] = bytemuck::cast_slice_mut(bytes);
                for (dst, src) in s[ko..ko + d].iter_mut().zip(k) {
                    *dst = f16::from_f32(*src);
                }
                for (dst, src) in s[vo..vo + d].iter_mut().zip(v) {
                    *dst = f16::from_f32(*src);
                }
            }
            KvDtype::F32 => {
                let s: &mut [f32] = bytemuck::cast_slice_mut(bytes);
                s[ko..ko + d].copy_from_slice(&k[..d]);
                s[vo..vo + d].copy_from_slice(&v[..d]);
            }
        }
    }

    /// One layer's K (`v = false`) or V block of `page`: `page_size` slots of `kv_dim`.
    pub fn block(&self, page: PageId, layer: usize, v: bool) -> BlockView<'_> {
        let start = self.layout.slot_offset(page, layer, v, 0);
        let end = start + self.layout.block_elems();
        match self.layout.dtype {
            KvDtype::F16 => {
                BlockView::F16(&bytemuck::cast_slice::<u8, f16>(self.bytes())[start..end])
            }
            KvDtype::F32 => {
                BlockView::F32(&bytemuck::cast_slice::<u8, f32>(self.bytes())[start..end])
            }
        }
    }

    /// The whole pool as bytes (for transports; ranges from [`KvLayout`]).
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(words) => &bytemuck::cast_slice(words)[..self.len],
            Storage::External(m) => &m.bytes()[..self.len],
        }
    }

    /// The whole pool as writable bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        match &mut self.storage {
            Storage::Heap(words) => &mut bytemuck::cast_slice_mut(words)[..len],
            Storage::External(m) => &mut m.bytes_mut()[..len],
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 4,
            page_size: 4,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn pages_and_runs_are_contiguous_byte_ranges() {
        let l = layout();
        assert_eq!(l.page_bytes(), 3 * 2 * 4 * 8 * 4);
        assert_eq!(l.run_bytes(2, 3), 2 * l.page_bytes()..5 * l.page_bytes());
        assert_eq!(l.layer_bytes(1, 2).len(), 2 * 4 * 8 * 4);
        assert_eq!(l.layer_bytes(1, 2).end, l.run_bytes(1, 1).end);
        let mut pool = KvPool::new(l, 4).unwrap();
        let k = [1.0f32; 8];
        let v = [2.0f32; 8];
        pool.write_token(1, 2, 3, &k, &v);
        let range = l.layer_bytes(1, 2);
        let bytes = &pool.bytes()[range];
        let floats: &[f32] = bytemuck::cast_slice(bytes);
        // K block then V block; slot 3 is the last of each.
        assert_eq!(&floats[24..32], &k);
        assert_eq!(&floats[56..64], &v);
    }

    #[derive(Debug)]
    struct Words(Vec<u64>);

    impl KvMemory for Words {
        fn bytes(&self) -> &[u8] {
            bytemuck::cast_slice(&self.0)
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            bytemuck::cast_slice_mut(&mut self.0)
        }
    }

    #[test]
    fn a_pool_can_live_in_given_memory() {
        let l = layout();
        let mut pool =
            KvPool::with_memory(l, 4, Box::new(Words(vec![0; l.page_bytes() * 4 / 8]))).unwrap();
        pool.write_token(3, 1, 2, &[5.0; 8], &[6.0; 8]);
        let floats: &[f32] = bytemuck::cast_slice(&pool.bytes()[l.layer_bytes(3, 1)]);
        assert_eq!(&floats[16..24], &[5.0; 8]);
        let small = KvPool::with_memory(l, 4, Box::new(Words(vec![0; 8])));
        assert!(matches!(small, Err(PoolError::BadMemory(_))));
    }

    #[test]
    fn f16_pool_rounds_to_half() {
        let l = KvLayout {
            dtype: KvDtype::F16,
            ..layout()
        };
        let mut pool = KvPool::new(l, 1).unwrap();
        pool.write_token(0, 0, 0, &[1.0 / 3.0; 8], &[0.5; 8]);
        match pool.block(0, 0, false) {
            BlockView::F16(b) => assert_eq!(b[0], f16::from_f32(1.0 / 3.0)),
            BlockView::F32(_) => panic!("f16 pool"),
        }
    }

    #[test]
    fn pins_hold_pages_past_their_last_reference() {
        let mut a = PageAllocator::new(2);
        let p = a.alloc(1).unwrap()[0];
        a.pin(p).unwrap();
        a.release(p).unwrap();
        assert_eq!(
            a.stats(),
            PoolStats {
                capacity: 2,
                free: 1,
                used: 1,
                pinned: 1
            }
        );
        a.unpin(p).unwrap();
        assert_eq!(
            a.stats(),
            PoolStats {
                capacity: 2,
                free: 2,
                used: 0,
                pinned: 0
            }
        );
        assert_eq!(a.release(p), Err(PoolError::NotAllocated(p)));
        assert_eq!(a.unpin(p), Err(PoolError::NotPinned(p)));
        assert_eq!(a.retain(9), Err(PoolError::OutOfRange(9)));
        assert_eq!(
            a.alloc(3),
            Err(PoolError::OutOfPages { wanted: 3, free: 2 })
        );
    }

    proptest! {
        /// Random operations keep the books balanced: free + used = capacity, a page is free
        /// exactly when it has no reference and no pin, and no page is handed out twice.
        #[test]
        fn allocator_books_balance(ops in proptest::collection::vec((0u8..5, 0usize..8), 1..300)) {
            let mut a = PageAllocator::new(8);
            let mut held: Vec<PageId> = Vec::new();
            let mut pinned: Vec<PageId> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => if let Ok(pages) = a.alloc(n % 3 + 1) {
                        for p in &pages { prop_assert!(!held.contains(p) && !pinned.contains(p)); }
                        held.extend(pages);
                    },
                    1 if !held.is_empty() => { let p = held.swap_remove(n % held.len()); a.release(p).unwrap(); }
                    2 if !held.is_empty() => { let p = held[n % held.len()]; a.retain(p).unwrap(); held.push(p); }
                    3 if !held.is_empty() => { let p = held[n % held.len()]; a.pin(p).unwrap(); pinned.push(p); }
                    4 if !pinned.is_empty() => { let p = pinned.swap_remove(n % pinned.len()); a.unpin(p).unwrap(); }
                    _ => {}
                }
                let s = a.stats();
                prop_assert_eq!(s.free + s.used, 8);
                for p in 0..8u32 {
                    let busy = held.contains(&p) || pinned.contains(&p);
                    prop_assert_eq!(a.refs(p) > 0 || a.pins(p) > 0, busy);
                }
            }
            for p in held { a.release(p).unwrap(); }
            for p in pinned { a.unpin(p).unwrap(); }
            prop_assert_eq!(a.stats().free, 8);
        }
    }
}
