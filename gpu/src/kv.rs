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
    /// A byte range outside the pool.
    #[error("bytes {offset}..+{len} are outside the pool of {size} bytes")]
    OutOfBounds {
        /// First byte.
        offset: usize,
        /// Length.
        len: usize,
        /// Pool bytes.
        size: usize,
    },
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

/// Memory a pool can live in: the heap ([`KvPool::new`]) or memory a transport provides, such
/// as a shared-memory region another process maps ([`KvPool::with_memory`]).
///
/// # Safety
///
/// `as_ptr` must return the same pointer for the life of the value, valid for reads and
/// writes of `len` bytes and 8-byte aligned, and the memory must not be touched through any
/// other Rust reference: the pool and its [`PoolMemory`] handles are its only users, and they
/// take byte-range borrows of their own.
#[allow(unsafe_code)]
pub unsafe trait KvMemory: Send + Sync + std::fmt::Debug {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Bytes available.
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: the mapping never moves while the buffer lives; `as_ptr` has write provenance and
// page alignment (so 8-byte alignment), and `len` bytes behind it.
#[allow(unsafe_code)]
unsafe impl KvMemory for crate::huge::HugeBuffer {
    fn as_ptr(&self) -> *mut u8 {
        crate::huge::HugeBuffer::as_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

/// Read access to one layer's K or V block of a page.
#[derive(Debug, Clone, Copy)]
pub enum BlockView<'a> {
    /// Half-precision elements.
    F16(&'a [f16]),
    /// Single-precision elements.
    F32(&'a [f32]),
}

/// A handle on a pool's memory that another thread (a transport's sender or receiver) uses to
/// read or write whole byte ranges of pages while the engine computes on other pages.
///
/// Which thread may touch which page is the transfer ledger's business: a sender reads pages
/// its attempt pinned at the source, a receiver writes pages its attempt was granted at the
/// destination, and the engine touches neither until the ledger releases or publishes them.
/// The methods are `unsafe` because that discipline is the caller's promise.
#[derive(Clone, Debug)]
pub struct PoolMemory {
    memory: std::sync::Arc<dyn KvMemory>,
    len: usize,
}

impl PoolMemory {
    /// Bytes of the pool.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the pool has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), PoolError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(PoolError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// The bytes `offset..offset + len`.
    ///
    /// # Safety
    ///
    /// Nothing may write the range while the slice lives (the source pins of a transfer).
    #[allow(unsafe_code)]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> Result<&[u8], PoolError> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked); no writer (the caller's promise).
        Ok(unsafe { std::slice::from_raw_parts(self.memory.as_ptr().add(offset), len) })
    }

    /// The bytes `offset..offset + len`, writable.
    ///
    /// # Safety
    ///
    /// Nothing else may read or write the range while the slice lives (the destination pages
    /// of an active attempt, which decode does not read until the attempt is published).
    #[allow(unsafe_code, clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], PoolError> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked); exclusive (the caller's promise).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.memory.as_ptr().add(offset), len) })
    }
}

/// The paged KV pool: storage plus allocator.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    memory: PoolMemory,
    /// Page references and pins.
    pub alloc: PageAllocator,
}

impl KvPool {
    /// Allocates `n_pages` pages of `layout` in anonymous memory, zeroed, once.
    pub fn new(layout: KvLayout, n_pages: usize) -> Result<KvPool, PoolError> {
        let len = Self::pool_bytes(&layout, n_pages)?;
        // On huge pages where the system allows: decode reads a 6 KB block of each page in
        // turn, and on 4 KB pages nearly every block missed the TLB (see `crate::huge`).
        let memory = crate::huge::HugeBuffer::zeroed(len)
            .map_err(|e| PoolError::BadMemory(format!("cannot map {len} bytes: {e}")))?;
        Ok(KvPool {
            layout,
            memory: PoolMemory {
                memory: std::sync::Arc::new(memory),
                len,
            },
            alloc: PageAllocator::new(n_pages),
        })
    }

    /// A pool of `n_pages` pages of `layout` in `memory` (whose contents are kept).
    pub fn with_memory(
        layout: KvLayout,
        n_pages: usize,
        memory: std::sync::Arc<dyn KvMemory>,
    ) -> Result<KvPool, PoolError> {
        let len = Self::pool_bytes(&layout, n_pages)?;
        if memory.len() < len || !(memory.as_ptr() as usize).is_multiple_of(8) {
            return Err(PoolError::BadMemory(format!(
                "{} bytes at {:p}: the pool needs {len} bytes, 8-byte aligned",
                memory.len(),
                memory.as_ptr()
            )));
        }
        Ok(KvPool {
            layout,
            memory: PoolMemory { memory, len },
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

    /// A handle for transports (see [`PoolMemory`]).
    pub fn memory(&self) -> PoolMemory {
        self.memory.clone()
    }

    /// Stores one token's K and V (`kv_dim` values each) in `slot` of `page`, layer `layer`.
    pub fn write_token(&mut self, page: PageId, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.kv_dim();
        let size = self.layout.dtype.size();
        let ko = self.layout.slot_offset(page, layer, false, slot) * size;
        let vo = self.layout.slot_offset(page, layer, true, slot) * size;
        for (offset, src) in [(ko, &k[..d]), (vo, &v[..d])] {
            // SAFETY: `&mut self`: the engine writes only slots of pages its sequences own,
            // which no transfer reads or writes (the ledger's pins and grants); the range is
            // bounds-checked and element-aligned (the memory is 8-byte aligned).
            #[allow(unsafe_code)]
            let Ok(bytes) = (unsafe { self.memory.slice_mut(offset, d * size) }) else {
                panic!("slot {slot} of page {page} is outside the pool");
            };
            match self.layout.dtype {
                KvDtype::F16 => {
                    let dst: &mut [f16] = bytemuck::cast_slice_mut(bytes);
                    for (dst, src) in dst.iter_mut().zip(src) {
                        *dst = f16::from_f32(*src);
                    }
                }
                KvDtype::F32 => bytemuck::cast_slice_mut(bytes).copy_from_slice(src),
            }
        }
    }

    /// One layer's K (`v = false`) or V block of `page`: `page_size` slots of `kv_dim`.
    pub fn block(&self, page: PageId, layer: usize, v: bool) -> BlockView<'_> {
        let size = self.layout.dtype.size();
        let start = self.layout.slot_offset(page, layer, v, 0) * size;
        // SAFETY: the engine reads pages of its own sequences, which nothing writes while it
        // computes (transfers write only granted, unpublished pages).
        #[allow(unsafe_code)]
        let Ok(bytes) = (unsafe { self.memory.slice(start, self.layout.block_elems() * size) })
        else {
            panic!("page {page} is outside the pool");
        };
        match self.layout.dtype {
            KvDtype::F16 => BlockView::F16(bytemuck::cast_slice(bytes)),
            KvDtype::F32 => BlockView::F32(bytemuck::cast_slice(bytes)),
        }
    }

    /// A copy of the bytes in `range` (tests and checks; transports use [`PoolMemory`]).
    pub fn copy_bytes(&self, range: Range<usize>) -> Result<Vec<u8>, PoolError> {
        // SAFETY: `&self`: nothing in this process writes through the pool meanwhile; callers
        // use it on pages no transfer targets.
        #[allow(unsafe_code)]
        let bytes = unsafe { self.memory.slice(range.start, range.len())? };
        Ok(bytes.to_vec())
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
        let bytes = pool.copy_bytes(range).unwrap();
        let floats: &[f32] = bytemuck::cast_slice(&bytes);
        // K block then V block; slot 3 is the last of each.
        assert_eq!(&floats[24..32], &k);
        assert_eq!(&floats[56..64], &v);
    }

    fn words(n: usize) -> std::sync::Arc<dyn KvMemory> {
        std::sync::Arc::new(crate::huge::HugeBuffer::zeroed(n * 8).unwrap())
    }

    #[test]
    fn a_pool_can_live_in_given_memory() {
        let l = layout();
        let mut pool = KvPool::with_memory(l, 4, words(l.page_bytes() * 4 / 8)).unwrap();
        pool.write_token(3, 1, 2, &[5.0; 8], &[6.0; 8]);
        let bytes = pool.copy_bytes(l.layer_bytes(3, 1)).unwrap();
        let floats: &[f32] = bytemuck::cast_slice(&bytes);
        assert_eq!(&floats[16..24], &[5.0; 8]);
        let small = KvPool::with_memory(l, 4, words(8));
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
