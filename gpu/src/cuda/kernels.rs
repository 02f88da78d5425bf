//! The engine's CUDA kernels (`kernels.cu`), compiled by NVRTC and loaded into a context.
//!
//! NVRTC is found the way cudarc looks for it (`libnvrtc.so.12` and friends on the library
//! path), or at `DUET_NVRTC_LIB` (a full path: the PyPI wheel's library, as the GPU check and
//! `tools/nvrtc/install.sh` give it). Loading it by path first makes cudarc's own lookup find the
//! library already in the process (the dynamic loader matches its soname).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::device::DeviceError;

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the source defines, by its `extern "C"` name.
pub const NAMES: &[&str] = &[
    "embed",
    "rms_norm",
    "rope",
    "silu_mul",
    "add_assign",
    "matmul_f16",
    "kv_write_f16",
    "kv_write_f32",
    "attention_f16",
    "attention_f32",
    "argmax",
];

/// Makes NVRTC loadable: from `DUET_NVRTC_LIB` when set, else wherever the dynamic loader finds
/// it. An error (never a panic, which is what cudarc does without it) when it is nowhere.
pub fn nvrtc_present() -> Result<(), DeviceError> {
    static PRELOADED: OnceLock<Result<(), String>> = OnceLock::new();
    let r = PRELOADED.get_or_init(|| {
        if let Some(path) = std::env::var_os("DUET_NVRTC_LIB") {
            // SAFETY: loading NVRTC runs its initialisers, which touch no state of ours. The
            // library stays loaded for the process (cudarc keeps its own handle to it).
            #[allow(unsafe_code)]
            let lib = unsafe { libloading::Library::new(&path) }
                .map_err(|e| format!("DUET_NVRTC_LIB={}: {e}", path.to_string_lossy()))?;
            std::mem::forget(lib);
        }
        // SAFETY: only tries to load the library under cudarc's candidate names.
        #[allow(unsafe_code)]
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if present {
            Ok(())
        } else {
            Err(
                "NVRTC (libnvrtc.so.12) not found: set DUET_NVRTC_LIB to its path \
                 (tools/nvrtc/install.sh prints one) or put it on LD_LIBRARY_PATH"
                    .to_string(),
            )
        }
    });
    r.clone().map_err(DeviceError::NoNvrtc)
}

/// Compiles the kernels to PTX for `arch` (such as `compute_90` for an H100/H200; `None`: NVRTC's
/// default). Needs NVRTC, not a GPU.
pub fn compile(arch: Option<&'static str>) -> Result<Ptx, DeviceError> {
    nvrtc_present()?;
    let opts = CompileOptions {
        arch,
        // Exactness first: IEEE division and square roots, no flush-to-zero, as the CPU.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            DeviceError::Compile(log.to_string_lossy().into_owned())
        }
        other => DeviceError::Compile(format!("{other:?}")),
    })
}

/// The kernels loaded into one context.
#[derive(Debug)]
pub struct Kernels {
    module: Arc<CudaModule>,
}

impl Kernels {
    /// Compiles the kernels for the context's device and loads them.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, DeviceError> {
        let (major, minor) = ctx.compute_capability()?;
        // NVRTC wants a static string; the architectures Duet targets.
        let arch = match (major, minor) {
            (8, 0) => "compute_80",
            (8, 6) => "compute_86",
            (8, 9) => "compute_89",
            (9, 0) => "compute_90",
            (10, _) => "compute_100",
            (12, _) => "compute_120",
            _ => "compute_80",
        };
        let module = ctx.load_module(compile(Some(arch))?)?;
        Ok(Kernels { module })
    }

    /// A kernel by name.
    pub fn get(&self, name: &str) -> Result<CudaFunction, DeviceError> {
        Ok(self.module.load_function(name)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wheel's library from tools/nvrtc/install.sh (which fetches it once), unless
    /// DUET_NVRTC_LIB already names one.
    fn nvrtc_lib() -> String {
        if let Ok(p) = std::env::var("DUET_NVRTC_LIB") {
            return p;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/nvrtc/install.sh");
        let out = std::process::Command::new(script)
            .output()
            .expect("run tools/nvrtc/install.sh");
        assert!(
            out.status.success(),
            "tools/nvrtc/install.sh failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn every_kernel_compiles_with_nvrtc_for_the_gpus_duet_targets() {
        // SAFETY of the test: set before any thread of this test binary loads NVRTC.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("DUET_NVRTC_LIB", nvrtc_lib())
        };
        for arch in ["compute_80", "compute_90"] {
            let ptx = compile(Some(arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
            let text = ptx.to_src();
            for name in NAMES {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "{arch}: no kernel {name} in the PTX"
                );
            }
            assert!(
                text.contains(&format!(".target sm_{}", &arch[8..])),
                "{arch}"
            );
        }
    }
}
