//! Compute devices.

use std::fmt;

/// Where a worker computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The host CPU (all cores given to the worker).
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Why a device cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No CUDA driver library on this machine.
    #[error("CUDA is not available: {0}")]
    NoCuda(String),
    /// The device exists and opens, but the engine does not run on it yet.
    #[error("{0} is present, but this build of Duet runs the engine on the CPU only")]
    Unsupported(Device),
    /// The driver has fewer devices than the ordinal asked for.
    #[error("there is no cuda:{ordinal}: this machine has {count} CUDA device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A byte range outside an allocation.
    #[error("bytes {range:?} are outside an allocation of {len} bytes")]
    OutOfRange {
        /// The range asked for.
        range: std::ops::Range<usize>,
        /// The allocation's bytes.
        len: usize,
    },
    /// The KV pool's shape is unusable.
    #[error(transparent)]
    Pool(#[from] crate::kv::PoolError),
    /// NVRTC, the runtime compiler the kernels need, is missing.
    #[error("{0}")]
    NoNvrtc(String),
    /// The kernels did not compile (NVRTC's log).
    #[error("the CUDA kernels did not compile:\n{0}")]
    Compile(String),
}

impl DeviceError {
    /// Whether retrying can help: a driver error may be transient (another process held the
    /// device); a missing driver, device or compiler, or a bad shape, stays so.
    pub fn is_transient(&self) -> bool {
        matches!(self, DeviceError::Driver(_))
    }
}

/// Names the CUDA driver library goes by on Linux.
const CUDA_DRIVER_LIBS: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Whether the CUDA driver library can be loaded. cudarc panics when it is absent, so this
/// probe must come first; it never panics.
pub fn cuda_driver_present() -> Result<(), DeviceError> {
    let mut last = String::from("not found");
    for name in CUDA_DRIVER_LIBS {
        match load(name) {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(DeviceError::NoCuda(format!(
        "cannot load {}: {last}",
        CUDA_DRIVER_LIBS.join(" or ")
    )))
}

#[allow(unsafe_code)]
fn load(name: &str) -> Result<(), String> {
    // SAFETY: loading a shared library runs its initialisers. The CUDA driver library's
    // initialisers do not touch our process state; we only check that it loads.
    unsafe { libloading::Library::new(name) }
        .map(drop)
        .map_err(|e| e.to_string())
}

impl Device {
    /// Parses a device as `cluster.toml` and the command line name it: `cpu`, `cuda` (device
    /// 0) or `cuda:N`.
    pub fn parse(s: &str) -> Option<Device> {
        match s.trim() {
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda),
        }
    }

    /// The device to use when asked for `wanted`: the CPU always works; a CUDA device is
    /// refused with the reason (no driver, or no CUDA kernels in this build).
    pub fn open(wanted: Device) -> Result<Device, DeviceError> {
        match wanted {
            Device::Cpu => Ok(Device::Cpu),
            Device::Cuda(ordinal) => {
                // The driver and the ordinal are checked without creating a context: only
                // the worker that owns the device opens one (crate::context).
                crate::cuda::check_ordinal(ordinal)?;
                Err(DeviceError::Unsupported(wanted))
            }
        }
    }

    /// The best device on this machine that this build can use.
    pub fn detect() -> Device {
        Device::Cpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_as_the_config_names_them() {
        assert_eq!(Device::parse("cpu"), Some(Device::Cpu));
        assert_eq!(Device::parse("cuda"), Some(Device::Cuda(0)));
        assert_eq!(Device::parse("cuda:3"), Some(Device::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            assert_eq!(Device::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    }

    #[test]
    fn cpu_always_opens_and_cuda_never_panics() {
        assert_eq!(Device::open(Device::Cpu), Ok(Device::Cpu));
        // Either no driver, or a driver but no CUDA kernels: an error either way, no panic.
        assert!(Device::open(Device::Cuda(0)).is_err());
        assert_eq!(Device::detect().to_string(), "cpu");
    }
}
