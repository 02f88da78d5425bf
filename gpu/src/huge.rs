//! Memory the CPU kernels stream through on every step (the model's weights, the KV pool),
//! asked of the kernel on transparent huge pages.
//!
//! Decode reads ~100 MB of weights and, with a few long contexts, tens of MB of KV per step,
//! in pieces spread over the whole allocation (a page's 6 KB block of one layer, then another
//! page's). On 4 KB pages nearly every piece misses the TLB (its 3,072 entries reach 12 MB)
//! and the page walks stall the loads the hardware prefetcher does not cover. On 2 MB pages
//! the same reads hit it. Measured on one Zen 4 core (`cargo bench --bench throughput --
//! --decode-profile`, heap KV pool, THP switched between `always` and `madvise` without the
//! advice): batch 1 after 32 tokens 110-113 -> 123 tok/s, after 480 tokens 79-85 -> 99-103;
//! batch 4 after 512 tokens 134 -> 161.
//!
//! The advice is a hint: where the system's THP setting is `never` (or, for shared memory,
//! `/dev/shm` is mounted without `huge=`), the memory is the same, on 4 KB pages, and nothing
//! fails.
//!
//! Files under `/dev/shm` (the shm transport's pools) follow the `huge=` option of that tmpfs
//! mount, not `shmem_enabled`: that setting governs only the kernel's internal mount (memfds,
//! SysV segments, shared anonymous maps), and reaches other mounts only as `force` or `deny`.
//! A 64 MB file in `/dev/shm`, advised and touched (Linux 6.18): `ShmemPmdMapped` 0 with the
//! mount's default whether `shmem_enabled` was `never` or `advise`, and all 64 MB with
//! `huge=advise` or `huge=within_size` under either.

use memmap2::{Advice, MmapMut};

/// A zeroed, writable, page-aligned anonymous mapping advised for huge pages.
pub struct HugeBuffer {
    map: MmapMut,
    /// `map`'s first byte, taken once through `&mut` so that writes through `&self` (as the
    /// KV pool's memory) use a pointer with write provenance.
    ptr: *mut u8,
    len: usize,
}

impl std::fmt::Debug for HugeBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuffer({} bytes)", self.len)
    }
}

// SAFETY: the buffer owns its mapping, which never moves while the value lives; shared
// writes through `as_ptr` are the KV pool's, whose users keep their byte ranges disjoint.
#[allow(unsafe_code)]
unsafe impl Send for HugeBuffer {}
// SAFETY: as for `Send`.
#[allow(unsafe_code)]
unsafe impl Sync for HugeBuffer {}

impl HugeBuffer {
    /// `len` zeroed bytes. The advice is given before anything touches the memory, so the
    /// first write to each 2 MB range faults in a huge page where the system allows.
    pub fn zeroed(len: usize) -> std::io::Result<HugeBuffer> {
        // A mapping cannot be empty; an empty buffer still has one page behind it.
        let mut map = MmapMut::map_anon(len.max(1))?;
        advise_huge(&map);
        let ptr = map.as_mut_ptr();
        Ok(HugeBuffer { map, ptr, len })
    }

    /// A copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> std::io::Result<HugeBuffer> {
        let mut b = HugeBuffer::zeroed(bytes.len())?;
        b.copy_from_slice(bytes);
        Ok(b)
    }

    /// The first byte, writable through shared references (the KV pool's memory).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Asks for huge pages under `map` (anonymous or shared); a refusal is only logged, since the
/// memory works the same without them.
pub fn advise_huge(map: &MmapMut) {
    if let Err(e) = map.advise(Advice::HugePage) {
        tracing::debug!(error = %e, bytes = map.len(), "no transparent huge pages");
    }
}

/// What the system's transparent-huge-page settings let [`advise_huge`] do, read from
/// `/sys/kernel/mm/transparent_hugepage/` (a setting that cannot be read counts as off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HugePageSettings {
    /// `enabled` is `always` or `madvise`: the weights and a heap KV pool get huge pages.
    pub anonymous: bool,
    /// `/dev/shm` is mounted with `huge=advise`, `always` or `within_size` (or
    /// `shmem_enabled` is `force`, and not `deny`): a KV pool in shared memory (the shm
    /// transport's) gets them too. A mount without the option counts as off (the tmpfs
    /// default).
    pub shared: bool,
}

/// Where the shm transport keeps its files (its pools, claim tables): the mount whose `huge=`
/// option [`settings`] reads.
pub const SHM_DIR: &str = "/dev/shm";

/// Reads the settings of this host.
pub fn settings() -> HugePageSettings {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{name}"))
            .ok()
            .and_then(|s| selected(&s).map(str::to_owned))
    };
    let anonymous = read("enabled").is_some_and(|v| matches!(v.as_str(), "always" | "madvise"));
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let shared = shared_allowed(
        read("shmem_enabled").as_deref(),
        mount_huge(&mounts, SHM_DIR),
    );
    HugePageSettings { anonymous, shared }
}

/// Whether files of a tmpfs mounted with `huge` (its `huge=` option) get huge pages when
/// advised, under the global `shmem_enabled`.
fn shared_allowed(shmem_enabled: Option<&str>, huge: Option<&str>) -> bool {
    match shmem_enabled {
        Some("force") => true,
        Some("deny") => false,
        _ => matches!(huge, Some("advise" | "always" | "within_size")),
    }
}

/// The `huge=` option of the mount at `dir` in a mounts table (`/proc/self/mounts`: device,
/// mount point, type, options, ...); the last such line is the mount on top. `None` where
/// nothing is mounted there or the mount has no such option.
fn mount_huge<'a>(mounts: &'a str, dir: &str) -> Option<&'a str> {
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let point = fields.nth(1)?;
            let options = fields.nth(1)?;
            (point == dir).then_some(options)
        })
        .next_back()?
        .split(',')
        .find_map(|o| o.strip_prefix("huge="))
}

/// The bracketed choice of a sysfs setting: `always [madvise] never` -> `madvise`.
fn selected(setting: &str) -> Option<&str> {
    let start = setting.find('[')? + 1;
    let len = setting[start..].find(']')?;
    Some(&setting[start..start + len])
}

impl std::ops::Deref for HugeBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl std::ops::DerefMut for HugeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_and_keeps_what_is_written() {
        let mut b = HugeBuffer::zeroed(3 << 20).unwrap();
        assert_eq!(b.len(), 3 << 20);
        assert!(b.iter().all(|&x| x == 0));
        b[(2 << 20) + 5] = 7;
        assert_eq!(b[(2 << 20) + 5], 7);
        assert_eq!(HugeBuffer::copy_of(&[1, 2, 3]).unwrap()[..], [1, 2, 3]);
        assert!(HugeBuffer::zeroed(0).unwrap().is_empty());
    }

    #[test]
    fn the_bracketed_choice_is_the_setting() {
        assert_eq!(selected("always [madvise] never\n"), Some("madvise"));
        assert_eq!(
            selected("always within_size advise [never] deny force"),
            Some("never")
        );
        assert_eq!(selected("no choice"), None);
        assert_eq!(selected("[unclosed"), None);
    }

    #[test]
    fn the_shm_mount_decides_and_only_force_or_deny_overrides_it() {
        let mounts = "devtmpfs /dev devtmpfs rw,relatime 0 0\n\
                      tmpfs /dev/shm tmpfs rw,relatime,size=24683784k 0 0\n\
                      tmpfs /run tmpfs rw,huge=always 0 0\n";
        assert_eq!(mount_huge(mounts, "/dev/shm"), None);
        assert_eq!(mount_huge(mounts, "/run"), Some("always"));
        assert_eq!(mount_huge(mounts, "/nowhere"), None);
        // Mounted over: the last line is the mount a path resolves to.
        let over = format!("{mounts}tmpfs /dev/shm tmpfs rw,size=1g,huge=within_size 0 0\n");
        assert_eq!(mount_huge(&over, "/dev/shm"), Some("within_size"));
        assert_eq!(mount_huge("short line\n", "/dev/shm"), None);

        assert!(!shared_allowed(Some("advise"), None));
        assert!(!shared_allowed(Some("never"), Some("never")));
        assert!(shared_allowed(Some("never"), Some("within_size")));
        assert!(shared_allowed(None, Some("advise")));
        assert!(shared_allowed(Some("force"), None));
        assert!(!shared_allowed(Some("deny"), Some("always")));
    }
}
