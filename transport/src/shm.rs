//! Shared-memory regions: a decode pool that a prefill process on the same host maps and
//! writes at memcpy speed.
//!
//! The region is a file under `/dev/shm` mapped by both processes. Writes land with plain
//! copies; who may write which bytes is decided by the transfer ledger (a destination page is
//! written only while its attempt is active, and read by decode only once published), so the
//! mapping itself carries no locks.

#![allow(unsafe_code)] // file mappings; the safety argument is on each `unsafe` block

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

/// A shared-memory transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// Creating, sizing or mapping the file failed.
    #[error("shared memory {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A write outside the region.
    #[error("a write of {len} bytes at {offset} does not fit a region of {size} bytes")]
    OutOfBounds {
        /// Where.
        offset: usize,
        /// How much.
        len: usize,
        /// The region's size.
        size: usize,
    },
}

/// A mapped shared-memory region.
pub struct ShmRegion {
    path: PathBuf,
    map: MmapMut,
    /// `map`'s first byte, taken once through `&mut` so that writes through `&self` (as the
    /// pool's memory) use a pointer with write provenance.
    ptr: *mut u8,
    owner: bool,
}

impl std::fmt::Debug for ShmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRegion")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .finish()
    }
}

pub(crate) fn shm_path(name: &str) -> PathBuf {
    PathBuf::from(duet_gpu::huge::SHM_DIR).join(format!("duet-{name}"))
}

/// Maps the shared-memory file at `path`: created with `len` zeroed bytes (`Some`: this
/// process owns it; it must not exist yet), or opened as its creator made it.
pub(crate) fn map_shared(path: &Path, len: Option<usize>) -> std::io::Result<(File, MmapMut)> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    if len.is_some() {
        options.create_new(true);
    }
    let file = options.open(path)?;
    if let Some(len) = len {
        file.set_len(len as u64)?;
    }
    // SAFETY: a Duet file under /dev/shm is shared on purpose, and its users agree on who
    // touches which bytes when (a pool: the ledger's grants and claims; a claim table: atomics
    // only); its size is fixed by its creator before anyone else can open it.
    let map = unsafe { MmapMut::map_mut(&file) }?;
    // Decode's attention reads this pool a 6 KB block at a time all over it: huge pages where
    // the /dev/shm mount allows them (`huge=advise` or `within_size`; the tmpfs default keeps
    // 4 KB pages, and the advice changes nothing; `duet_gpu::huge` says why not
    // `shmem_enabled`).
    duet_gpu::huge::advise_huge(&map);
    Ok((file, map))
}

impl ShmRegion {
    /// Removes regions named `{prefix}-{pid}-...` whose creating process is gone (a decode
    /// process killed with SIGKILL never unlinks its pool). Returns how many were removed.
    /// A name whose pid is alive, or that does not follow the pattern, is left alone.
    pub fn remove_stale(prefix: &str) -> usize {
        let start = format!("duet-{prefix}-");
        let Ok(dir) = std::fs::read_dir(duet_gpu::huge::SHM_DIR) else {
            return 0;
        };
        let mut removed = 0;
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&start)) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            let alive = PathBuf::from(format!("/proc/{pid}")).exists();
            if !alive && std::fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// Creates a zeroed region of `len` bytes named `name` (removed when this owner drops).
    pub fn create(name: &str, len: usize) -> Result<ShmRegion, ShmError> {
        let path = shm_path(name);
        let (_, mut map) = map_shared(&path, Some(len)).map_err(|source| ShmError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(ShmRegion {
            path,
            ptr: map.as_mut_ptr(),
            map,
            owner: true,
        })
    }

    /// Maps an existing region created by another process.
    pub fn open(name: &str) -> Result<ShmRegion, ShmError> {
        let path = shm_path(name);
        let (_, mut map) = map_shared(&path, None).map_err(|source| ShmError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(ShmRegion {
            path,
            ptr: map.as_mut_ptr(),
            map,
            owner: false,
        })
    }

    /// The region's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The region's bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        let size = self.map.len();
        let end =
            offset
                .checked_add(src.len())
                .filter(|e| *e <= size)
                .ok_or(ShmError::OutOfBounds {
                    offset,
                    len: src.len(),
                    size,
                })?;
        self.map[offset..end].copy_from_slice(src);
        Ok(())
    }
}

// SAFETY: the mapping lives as long as the region and never moves; pages are the unit of
// access and the ledger keeps writers and readers of a page apart.
unsafe impl Send for ShmRegion {}
unsafe impl Sync for ShmRegion {}

// SAFETY: the pointer is the mapping's start (page-aligned, so 8-byte aligned), valid for
// `len` bytes while the region lives; once a pool owns the region it is reached only through
// the pool's byte-range borrows.
unsafe impl duet_gpu::KvMemory for ShmRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_regions_of_dead_processes_are_removed_and_live_ones_kept() {
        let prefix = format!("stale-{}", std::process::id());
        // No pid reaches this value on Linux (pid_max is at most 2^22).
        let dead = ShmRegion::create(&format!("{prefix}-999999999-0"), 4096).unwrap();
        let live = ShmRegion::create(&format!("{prefix}-{}-0", std::process::id()), 4096).unwrap();
        let odd = ShmRegion::create(&format!("{prefix}-notapid"), 4096).unwrap();
        let (dead_path, live_path) = (dead.path.clone(), live.path.clone());
        // Forget the dead one's owner: a SIGKILLed process never unlinks.
        std::mem::forget(dead);
        assert_eq!(ShmRegion::remove_stale(&prefix), 1);
        assert!(!dead_path.exists());
        assert!(live_path.exists());
        drop(live);
        drop(odd);
    }

    #[test]
    fn a_second_mapping_sees_the_writes() {
        let name = format!("test-{}", std::process::id());
        let mut owner = ShmRegion::create(&name, 1 << 16).unwrap();
        let mut writer = ShmRegion::open(&name).unwrap();
        writer.write(4096, &[7u8; 100]).unwrap();
        assert_eq!(&owner.bytes()[4096..4196], &[7u8; 100]);
        assert!(writer.write((1 << 16) - 10, &[1u8; 11]).is_err());
        owner.bytes_mut()[0] = 1;
        assert_eq!(writer.bytes()[0], 1);
        drop(writer);
        drop(owner);
        assert!(
            ShmRegion::open(&name).is_err(),
            "the owner removes the file"
        );
    }

    #[test]
    fn a_kv_pool_in_shared_memory_is_visible_to_a_second_mapping() {
        use duet_gpu::{KvDtype, KvLayout, KvPool};
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 16,
            page_size: 4,
            dtype: KvDtype::F16,
        };
        let name = format!("pool-{}", std::process::id());
        let region = ShmRegion::create(&name, layout.page_bytes() * 8).unwrap();
        let mut pool = KvPool::with_memory(layout, 8, std::sync::Arc::new(region)).unwrap();
        let peer = ShmRegion::open(&name).unwrap();
        pool.write_token(5, 1, 3, &[1.5; 16], &[2.5; 16]);
        // The other mapping sees the token at the layout's byte offsets.
        let range = layout.layer_bytes(5, 1);
        assert_eq!(
            &peer.bytes()[range.clone()],
            &pool.copy_bytes(range.clone()).unwrap()[..]
        );
        assert!(peer.bytes()[range].iter().any(|b| *b != 0));
    }
}
