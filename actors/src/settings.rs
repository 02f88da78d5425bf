//! The `[serving]` table of cluster.toml: the model, the router's HTTP address, the workers'
//! engine settings. Validated like the rest of the file (file, line, key, expectation).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use duet_gpu::{Device, DeviceError, KvDtype};
use duet_runtime::config::{ClusterConfig, ConfigError, key_at};
use duet_runtime::credentials::Token;
use duet_transport::Backend;
use duet_transport::rdma::{self, RdmaConfig, RdmaPort};
use serde::Deserialize;
use toml::Spanned;

/// Serving settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ServingConfig {
    /// The GGUF file (fetched there if missing and it is the default model).
    pub model: PathBuf,
    /// The model id clients ask for.
    pub model_name: String,
    /// The router's OpenAI-compatible HTTP address.
    pub http: SocketAddr,
    /// Several routers of one host share `http` (SO_REUSEPORT): the kernel spreads new
    /// connections over the live ones, so a router that dies takes no new connection.
    pub http_reuse_port: bool,
    /// One info line per HTTP request on the router (`serving.access_log`, default on): method,
    /// path, status, tokens, TTFT and total time, under the log target `duet::access`.
    pub access_log: bool,
    /// Where each worker writes one JSON line per engine step (`serving.step_log`, a folder,
    /// relative to cluster.toml's; off by default): see [`crate::step_log`].
    pub step_log: Option<PathBuf>,
    /// KV pages per worker.
    pub kv_pages: usize,
    /// KV element type.
    pub kv_dtype: KvDtype,
    /// Tokens per page.
    pub page_size: usize,
    /// Compute threads per worker.
    pub threads: usize,
    /// Tokens per engine step at most.
    pub max_batch_tokens: usize,
    /// Sequences per worker at most.
    pub max_running: usize,
    /// How often workers report their load.
    pub load_interval: Duration,
    /// Longest a request may take before it fails.
    pub request_timeout: Duration,
    /// Prompts whose uncached part is shorter than this are prefilled on decode alone.
    pub disagg_threshold: usize,
    /// How prefill writes decode's pages: `auto` (shm on one host, else tcp), or forced.
    pub kv_transport: KvTransportChoice,
    /// How the router chooses workers: `cache_aware` (default) or `load`.
    pub routing: Routing,
    /// API keys the public port accepts (`Authorization: Bearer KEY`); empty: none needed.
    pub api_keys: Vec<Token>,
    /// Longest a request waits in prefill's bootstrap queue for decode's pages.
    pub bootstrap_timeout: Duration,
    /// Longest decode waits for a transfer (notice sent to complete KV).
    pub transfer_timeout: Duration,
    /// Checksum every transferred run of pages; decode checks before it publishes.
    pub kv_checksum: bool,
    /// Bytes of landed KV decode checks per engine step while it has sequences running (a
    /// long transfer's check spreads over several steps instead of stalling one).
    pub kv_verify_step_bytes: usize,
    /// An abort unacknowledged this long is asked again with a drain fence.
    pub drain_fence: Duration,
    /// An abort unacknowledged this long: the prefill side is treated as gone (its pins drop).
    pub drain_backstop: Duration,
    /// Further attempts the router makes for a request whose worker failed.
    pub retries: usize,
    /// A stream whose decode worker failed after tokens were sent continues on another one
    /// (from the tokens the client has) instead of failing.
    pub migration: bool,
    /// How long prefill keeps a finished prompt's KV for such a continuation.
    pub migration_keep: Duration,
    /// On SIGTERM, how long a node waits for its requests before it exits anyway.
    pub shutdown_drain: Duration,
    /// Where a worker computes and keeps its KV pool (`serving.device`, per node
    /// `serving.node.NAME.device`): `cpu` (the default) or `cuda:N`.
    pub device: Device,
    /// Where `device` was set: its key and its byte offset in the file (for errors that come
    /// only when the device is opened).
    device_at: Option<(String, usize)>,
    /// The RDMA device, port, GID index and MTU (`serving.rdma_*`, per node too).
    pub rdma: RdmaConfig,
    /// Where `kv_transport` (or `rdma_device`) was set: key and byte offset, for the error when
    /// the RDMA device cannot be opened.
    rdma_at: (String, usize),
}

/// `serving.routing`: how the router chooses workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// The worker holding the longest cached prefix of the prompt when load allows, else the
    /// less loaded (the default).
    CacheAware,
    /// The less loaded of two, whatever they hold.
    Load,
}

/// `serving.kv_transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvTransportChoice {
    /// Shared memory when both workers share a host, TCP otherwise.
    Auto,
    /// Always this backend.
    Fixed(Backend),
}

impl KvTransportChoice {
    /// The backend for a pair where prefill runs on `my_host` and decode on `their_host`.
    pub fn pick(self, my_host: &str, their_host: &str) -> Backend {
        match self {
            KvTransportChoice::Fixed(b) => b,
            KvTransportChoice::Auto if my_host == their_host => Backend::Shm,
            KvTransportChoice::Auto => Backend::Tcp,
        }
    }
}

#[derive(Deserialize, Default)]
struct File {
    #[serde(default)]
    serving: RawServing,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServing {
    model: Option<String>,
    model_name: Option<Spanned<String>>,
    http: Option<Spanned<String>>,
    kv_pages: Option<Spanned<u64>>,
    kv_dtype: Option<Spanned<String>>,
    page_size: Option<Spanned<u64>>,
    threads: Option<Spanned<u64>>,
    max_batch_tokens: Option<Spanned<u64>>,
    max_running: Option<Spanned<u64>>,
    load_interval_ms: Option<Spanned<u64>>,
    request_timeout_secs: Option<Spanned<u64>>,
    disagg_threshold: Option<Spanned<u64>>,
    kv_transport: Option<Spanned<String>>,
    routing: Option<Spanned<String>>,
    api_keys: Option<Spanned<Vec<String>>>,
    bootstrap_timeout_secs: Option<Spanned<u64>>,
    transfer_timeout_secs: Option<Spanned<u64>>,
    kv_checksum: Option<bool>,
    kv_verify_step_mib: Option<Spanned<u64>>,
    drain_fence_secs: Option<Spanned<u64>>,
    drain_backstop_secs: Option<Spanned<u64>>,
    retries: Option<Spanned<u64>>,
    migration: Option<bool>,
    http_reuse_port: Option<bool>,
    access_log: Option<bool>,
    step_log: Option<Spanned<String>>,
    migration_keep_secs: Option<Spanned<u64>>,
    shutdown_drain_secs: Option<Spanned<u64>>,
    device: Option<Spanned<String>>,
    rdma_device: Option<Spanned<String>>,
    rdma_port: Option<Spanned<u64>>,
    rdma_gid_index: Option<Spanned<u64>>,
    rdma_mtu: Option<Spanned<u64>>,
    #[serde(default)]
    node: std::collections::BTreeMap<String, RawNodeServing>,
}

/// `[serving.node.NAME]`: engine settings that differ on one node.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNodeServing {
    http: Option<Spanned<String>>,
    kv_pages: Option<Spanned<u64>>,
    kv_dtype: Option<Spanned<String>>,
    page_size: Option<Spanned<u64>>,
    threads: Option<Spanned<u64>>,
    device: Option<Spanned<String>>,
    rdma_device: Option<Spanned<String>>,
    rdma_gid_index: Option<Spanned<u64>>,
}

impl ServingConfig {
    /// Reads `[serving]` from a loaded cluster file, as it applies to node `node`.
    pub fn for_node(c: &ClusterConfig, node: &str) -> Result<ServingConfig, ConfigError> {
        Self::read(c, Some(node))
    }

    /// Reads `[serving]` from a loaded cluster file (cluster-wide values).
    pub fn from_cluster(c: &ClusterConfig) -> Result<ServingConfig, ConfigError> {
        Self::read(c, None)
    }

    fn read(c: &ClusterConfig, node: Option<&str>) -> Result<ServingConfig, ConfigError> {
        let text = &c.source;
        let file = c.path.display().to_string();
        let err = |at: usize, key: Option<&str>, message: String| {
            let (line, found) = key_at(text, at);
            ConfigError {
                file: file.clone(),
                line,
                key: key.map_or(found, str::to_string),
                message,
            }
        };
        let raw: File = toml::from_str(text).map_err(|e| {
            err(
                e.span().map_or(0, |s| s.start),
                None,
                e.message().trim().to_string(),
            )
        })?;
        let s = raw.serving;
        let int = |v: &Option<Spanned<u64>>, key: &str, lo: u64, hi: u64, default: u64| match v {
            None => Ok(default),
            Some(v) if (lo..=hi).contains(v.get_ref()) => Ok(*v.get_ref()),
            Some(v) => Err(err(
                v.span().start,
                Some(key),
                format!(
                    "{} is out of range: expected an integer from {lo} to {hi}",
                    v.get_ref()
                ),
            )),
        };
        let dir = c.path.parent().map(PathBuf::from).unwrap_or_default();
        let model = match &s.model {
            Some(p) if PathBuf::from(p).is_absolute() => PathBuf::from(p),
            Some(p) => dir.join(p),
            None => dir.join("models").join(duet_fetch::MODEL_FILE),
        };
        let step_log = match &s.step_log {
            None => None,
            Some(p) if p.get_ref().trim().is_empty() => {
                return Err(err(
                    p.span().start,
                    Some("serving.step_log"),
                    "an empty path: expected the folder the step logs go to, such as \"steps\""
                        .to_string(),
                ));
            }
            Some(p) => Some(dir.join(p.get_ref())),
        };
        let parse_http = |h: &Spanned<String>, key: &str| -> Result<SocketAddr, ConfigError> {
            h.get_ref().parse().map_err(|_| {
                err(
                    h.span().start,
                    Some(key),
                    format!("`{}` is not a socket address: expected IP:PORT, such as \"127.0.0.1:8000\"", h.get_ref()),
                )
            })
        };
        let mut http = match &s.http {
            None => SocketAddr::from(([127, 0, 0, 1], 8000)),
            Some(h) => parse_http(h, "serving.http")?,
        };
        let dtype = |d: &Spanned<String>, key: &str| {
            KvDtype::parse(d.get_ref()).ok_or_else(|| {
                err(
                    d.span().start,
                    Some(key),
                    format!(
                        "`{}` is not a KV dtype: expected \"f16\" or \"f32\"",
                        d.get_ref()
                    ),
                )
            })
        };
        let mut kv_dtype = match &s.kv_dtype {
            None => KvDtype::F16,
            Some(d) => dtype(d, "serving.kv_dtype")?,
        };
        let kv_transport = match &s.kv_transport {
            None => KvTransportChoice::Auto,
            Some(t) => match t.get_ref().as_str() {
                "auto" => KvTransportChoice::Auto,
                "shm" => KvTransportChoice::Fixed(Backend::Shm),
                "tcp" => KvTransportChoice::Fixed(Backend::Tcp),
                "local" => KvTransportChoice::Fixed(Backend::Local),
                "rdma" => KvTransportChoice::Fixed(Backend::Rdma),
                other => {
                    return Err(err(
                        t.span().start,
                        Some("serving.kv_transport"),
                        format!(
                            "`{other}` is not a KV transport: expected \"auto\", \"shm\", \"tcp\", \"rdma\" or \"local\""
                        ),
                    ));
                }
            },
        };
        let routing = match s
            .routing
            .as_ref()
            .map(|r| (r.get_ref().as_str(), r.span().start))
        {
            None | Some(("cache_aware", _)) => Routing::CacheAware,
            Some(("load", _)) => Routing::Load,
            Some((other, at)) => {
                return Err(err(
                    at,
                    Some("serving.routing"),
                    format!(
                        "`{other}` is not a routing policy: expected \"cache_aware\" or \"load\""
                    ),
                ));
            }
        };
        let api_keys = match &s.api_keys {
            None => Vec::new(),
            Some(keys) => {
                if let Some(short) = keys.get_ref().iter().find(|k| k.trim().len() < 16) {
                    return Err(err(
                        keys.span().start,
                        Some("serving.api_keys"),
                        format!(
                            "an API key of {} characters is too easy to guess: use at least 16",
                            short.trim().len()
                        ),
                    ));
                }
                keys.get_ref()
                    .iter()
                    .map(|k| Token::new(k.trim()))
                    .collect()
            }
        };
        let device = |d: &Spanned<String>, key: &str| {
            Device::parse(d.get_ref())
                .map(|dev| (dev, Some((key.to_string(), d.span().start))))
                .ok_or_else(|| {
                    err(
                        d.span().start,
                        Some(key),
                        format!(
                            "`{}` is not a device: expected \"cpu\" or \"cuda:N\" (such as \"cuda:0\")",
                            d.get_ref()
                        ),
                    )
                })
        };
        let mtu = int(&s.rdma_mtu, "serving.rdma_mtu", 256, 4096, 4096)? as u32;
        if !rdma::MTUS.contains(&mtu) {
            let at = s.rdma_mtu.as_ref().map_or(0, |v| v.span().start);
            return Err(err(
                at,
                Some("serving.rdma_mtu"),
                format!("{mtu} is not a path MTU: expected 256, 512, 1024, 2048 or 4096"),
            ));
        }
        let mut rdma = RdmaConfig {
            device: s.rdma_device.as_ref().map(|d| d.get_ref().clone()),
            port: int(&s.rdma_port, "serving.rdma_port", 1, 255, 1)? as u8,
            gid_index: int(&s.rdma_gid_index, "serving.rdma_gid_index", 0, 255, 0)? as u32,
            mtu,
        };
        let mut rdma_at = match (&s.rdma_device, &s.kv_transport) {
            (Some(d), _) => ("serving.rdma_device".to_string(), d.span().start),
            (None, Some(t)) => ("serving.kv_transport".to_string(), t.span().start),
            (None, None) => ("serving.kv_transport".to_string(), 0),
        };
        let (mut dev, mut device_at) = match &s.device {
            None => (Device::Cpu, None),
            Some(d) => device(d, "serving.device")?,
        };
        let mut kv_pages = int(&s.kv_pages, "serving.kv_pages", 4, 1 << 20, 512)? as usize;
        let mut page_size = int(&s.page_size, "serving.page_size", 1, 1024, 16)? as usize;
        let mut threads = int(&s.threads, "serving.threads", 1, 256, 1)? as usize;
        for (name, o) in &s.node {
            if !c.nodes.iter().any(|n| &n.name == name) {
                let at = o
                    .kv_pages
                    .as_ref()
                    .map(|v| v.span().start)
                    .or(o.http.as_ref().map(|v| v.span().start))
                    .or(o.page_size.as_ref().map(|v| v.span().start))
                    .or(o.threads.as_ref().map(|v| v.span().start))
                    .or(o.kv_dtype.as_ref().map(|v| v.span().start))
                    .or(o.device.as_ref().map(|v| v.span().start))
                    .unwrap_or(0);
                return Err(err(
                    at,
                    Some(&format!("serving.node.{name}")),
                    format!("there is no node `{name}` in this cluster"),
                ));
            }
            if node != Some(name.as_str()) {
                continue;
            }
            let key = |k: &str| format!("serving.node.{name}.{k}");
            if let Some(h) = &o.http {
                // Routers on one host need a port each (on their own hosts they may share).
                http = parse_http(h, &key("http"))?;
            }
            if o.kv_pages.is_some() {
                kv_pages = int(&o.kv_pages, &key("kv_pages"), 4, 1 << 20, 512)? as usize;
            }
            if o.page_size.is_some() {
                page_size = int(&o.page_size, &key("page_size"), 1, 1024, 16)? as usize;
            }
            if o.threads.is_some() {
                threads = int(&o.threads, &key("threads"), 1, 256, 1)? as usize;
            }
            if let Some(d) = &o.kv_dtype {
                kv_dtype = dtype(d, &key("kv_dtype"))?;
            }
            if let Some(d) = &o.device {
                (dev, device_at) = device(d, &key("device"))?;
            }
            if let Some(d) = &o.rdma_device {
                rdma.device = Some(d.get_ref().clone());
                rdma_at = (key("rdma_device"), d.span().start);
            }
            if o.rdma_gid_index.is_some() {
                rdma.gid_index = int(&o.rdma_gid_index, &key("rdma_gid_index"), 0, 255, 0)? as u32;
            }
        }
        Ok(ServingConfig {
            model,
            model_name: s
                .model_name
                .map_or_else(|| "SmolLM2-135M-Instruct".to_string(), |n| n.into_inner()),
            http,
            kv_pages,
            kv_dtype,
            page_size,
            threads,
            max_batch_tokens: int(
                &s.max_batch_tokens,
                "serving.max_batch_tokens",
                1,
                1 << 16,
                256,
            )? as usize,
            max_running: int(&s.max_running, "serving.max_running", 1, 4096, 64)? as usize,
            load_interval: Duration::from_millis(int(
                &s.load_interval_ms,
                "serving.load_interval_ms",
                10,
                60_000,
                100,
            )?),
            request_timeout: Duration::from_secs(int(
                &s.request_timeout_secs,
                "serving.request_timeout_secs",
                1,
                86_400,
                600,
            )?),
            disagg_threshold: int(
                &s.disagg_threshold,
                "serving.disagg_threshold",
                0,
                1 << 20,
                32,
            )? as usize,
            kv_transport,
            routing,
            api_keys,
            bootstrap_timeout: Duration::from_secs(int(
                &s.bootstrap_timeout_secs,
                "serving.bootstrap_timeout_secs",
                1,
                86_400,
                60,
            )?),
            transfer_timeout: Duration::from_secs(int(
                &s.transfer_timeout_secs,
                "serving.transfer_timeout_secs",
                1,
                86_400,
                120,
            )?),
            kv_checksum: s.kv_checksum.unwrap_or(true),
            kv_verify_step_bytes: int(
                &s.kv_verify_step_mib,
                "serving.kv_verify_step_mib",
                1,
                1 << 16,
                8,
            )? as usize
                * (1 << 20),
            drain_fence: Duration::from_secs(int(
                &s.drain_fence_secs,
                "serving.drain_fence_secs",
                1,
                3_600,
                2,
            )?),
            drain_backstop: Duration::from_secs(int(
                &s.drain_backstop_secs,
                "serving.drain_backstop_secs",
                1,
                86_400,
                60,
            )?),
            retries: int(&s.retries, "serving.retries", 0, 16, 5)? as usize,
            migration: s.migration.unwrap_or(true),
            http_reuse_port: s.http_reuse_port.unwrap_or(false),
            access_log: s.access_log.unwrap_or(true),
            step_log,
            migration_keep: Duration::from_secs(int(
                &s.migration_keep_secs,
                "serving.migration_keep_secs",
                0,
                3_600,
                30,
            )?),
            shutdown_drain: Duration::from_secs(int(
                &s.shutdown_drain_secs,
                "serving.shutdown_drain_secs",
                1,
                3_600,
                30,
            )?),
            device: dev,
            device_at,
            rdma,
            rdma_at,
        })
    }

    /// Everything a worker's start opens on this machine, checked before anything starts (by
    /// `duet up` for every node, by `duet node` for itself): its device and its KV transport.
    pub fn check_start(&self, c: &ClusterConfig) -> Result<(), ConfigError> {
        self.open_device(c)?;
        self.open_kv_transport(c)?;
        Ok(())
    }

    /// Checks, before a worker starts, that the KV transport it is told to use can be used
    /// here: `kv_transport = "rdma"` needs a build with the `rdma` feature and an RDMA device
    /// (named by `rdma_device`, or the first), with the port and GID index asked for. The
    /// error names the key and line that asked for it. Other transports need nothing.
    pub fn open_kv_transport(&self, c: &ClusterConfig) -> Result<Option<RdmaPort>, ConfigError> {
        if self.kv_transport != KvTransportChoice::Fixed(Backend::Rdma) {
            return Ok(None);
        }
        rdma::probe(&self.rdma).map(Some).map_err(|e| {
            let (key, at) = self.rdma_at.clone();
            let (line, _) = key_at(&c.source, at);
            ConfigError {
                file: c.path.display().to_string(),
                line,
                key,
                message: format!("kv_transport = \"rdma\" cannot be used on this machine: {e}"),
            }
        })
    }

    /// Opens this node's device before its worker starts: the CPU always opens; a CUDA device
    /// needs the driver (probed first: cudarc panics without it) and a build with CUDA
    /// kernels. The error names the key and line that asked for it.
    pub fn open_device(&self, c: &ClusterConfig) -> Result<Device, ConfigError> {
        Device::open(self.device).map_err(|e: DeviceError| {
            let (key, at) = self
                .device_at
                .clone()
                .unwrap_or_else(|| ("serving.device".to_string(), 0));
            let (line, _) = key_at(&c.source, at);
            ConfigError {
                file: c.path.display().to_string(),
                line,
                key,
                message: format!("`{}` cannot be used on this machine: {e}", self.device),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn a_device_is_cluster_wide_or_per_node_and_a_bad_one_names_its_key_and_line() {
        let s = read("[serving]\ndevice = \"cuda:1\"\n", "p0").expect("cuda");
        assert_eq!(s.device, Device::Cuda(1));
        assert_eq!(read("", "p0").expect("default").device, Device::Cpu);
        let text = "[serving]\ndevice = \"cuda:1\"\n[serving.node.p0]\ndevice = \"cpu\"\n";
        assert_eq!(read(text, "p0").expect("p0").device, Device::Cpu);
        assert_eq!(
            read(text, "router").expect("router").device,
            Device::Cuda(1)
        );
        let e = read("[serving]\n\ndevice = \"gpu0\"\n", "p0").expect_err("bad");
        assert_eq!((e.key.as_str(), e.line), ("serving.device", 3));
        assert!(e.message.contains("\"cuda:N\""), "{e}");
        let e = read("[serving.node.p0]\ndevice = \"cuda:x\"\n", "p0").expect_err("bad");
        assert_eq!(e.key, "serving.node.p0.device");
    }

    #[test]
    fn a_cuda_device_this_machine_cannot_open_is_a_configuration_error_naming_the_key() {
        let text = format!("[serving]\n[serving.node.p0]\ndevice = \"cuda:0\"\n\n{NODES}");
        let c = ClusterConfig::parse(&text, Path::new("/x/cluster.toml")).expect("cluster");
        let s = ServingConfig::for_node(&c, "p0").expect("p0");
        // No driver here (CI), or a driver and no CUDA kernels in this build: refused either way.
        let e = s.open_device(&c).expect_err("cuda:0 opened");
        assert_eq!((e.key.as_str(), e.line), ("serving.node.p0.device", 3));
        assert!(e.message.contains("cuda:0"), "{e}");
        let cpu = ServingConfig::for_node(&c, "router").expect("router");
        assert_eq!(cpu.open_device(&c), Ok(Device::Cpu));
    }

    const NODES: &str = "[[node]]\nname = \"router\"\nrole = \"router\"\naddress = \"127.0.0.1:7100\"\n\
                         [[node]]\nname = \"p0\"\nrole = \"prefill\"\naddress = \"127.0.0.1:7101\"\n";

    fn read(serving: &str, node: &str) -> Result<ServingConfig, ConfigError> {
        let text = format!("{serving}\n{NODES}");
        let c = ClusterConfig::parse(&text, Path::new("/x/cluster.toml")).expect("cluster");
        ServingConfig::for_node(&c, node)
    }

    #[test]
    fn defaults_and_node_overrides() {
        let s = read("[serving]\n", "p0").expect("defaults");
        assert_eq!(s.disagg_threshold, 32);
        assert_eq!(s.kv_transport, KvTransportChoice::Auto);
        assert!(s.kv_checksum);
        assert_eq!(s.kv_verify_step_bytes, 8 << 20);
        let two = read("[serving]\nkv_verify_step_mib = 2\n", "p0").expect("2 MiB");
        assert_eq!(two.kv_verify_step_bytes, 2 << 20);
        let e = read("[serving]\nkv_verify_step_mib = 0\n", "p0").expect_err("0 MiB");
        assert_eq!((e.key.as_str(), e.line), ("serving.kv_verify_step_mib", 2));
        assert_eq!(s.step_log, None);
        let logged = read("[serving]\nstep_log = \"steps\"\n", "p0").expect("step log");
        assert_eq!(logged.step_log, Some(PathBuf::from("/x/steps")));
        let e = read("[serving]\nstep_log = \" \"\n", "p0").expect_err("empty step log");
        assert_eq!((e.key.as_str(), e.line), ("serving.step_log", 2));
        assert_eq!(
            (s.drain_fence, s.drain_backstop),
            (Duration::from_secs(2), Duration::from_secs(60))
        );
        let text = "[serving]\npage_size = 16\n[serving.node.p0]\npage_size = 32\nthreads = 2\n";
        assert_eq!(read(text, "p0").expect("p0").page_size, 32);
        assert_eq!(read(text, "router").expect("router").page_size, 16);
        assert_eq!(
            KvTransportChoice::Auto.pick("a", "a"),
            Backend::Shm,
            "same host"
        );
        assert_eq!(KvTransportChoice::Auto.pick("a", "b"), Backend::Tcp);
    }

    #[test]
    fn rdma_is_a_transport_whose_device_is_checked_at_start_naming_the_key() {
        let text = format!(
            "[serving]\nkv_transport = \"rdma\"\nrdma_gid_index = 3\n[serving.node.d0]\nrdma_device = \"mlx5_1\"\n\n{NODES}\
             [[node]]\nname = \"d0\"\nrole = \"decode\"\naddress = \"127.0.0.1:7102\"\n"
        );
        let c = ClusterConfig::parse(&text, Path::new("cluster.toml")).expect("cluster");
        let p0 = ServingConfig::for_node(&c, "p0").expect("p0");
        assert_eq!(p0.kv_transport, KvTransportChoice::Fixed(Backend::Rdma));
        assert_eq!(
            (p0.rdma.device.as_deref(), p0.rdma.gid_index, p0.rdma.mtu),
            (None, 3, 4096)
        );
        let d0 = ServingConfig::for_node(&c, "d0").expect("d0");
        assert_eq!(d0.rdma.device.as_deref(), Some("mlx5_1"));
        // This machine has no RDMA device (and a default build no verbs): a configuration
        // error at start, naming the key that asked for rdma and its line, not a panic.
        match p0.open_kv_transport(&c) {
            Ok(port) => assert!(port.is_some(), "rdma opened without a port"),
            Err(e) => {
                assert_eq!((e.key.as_str(), e.line), ("serving.kv_transport", 2), "{e}");
                assert!(
                    e.message.contains("--features rdma") || e.message.contains("no RDMA device"),
                    "{e}"
                );
            }
        }
        if let Err(e) = d0.open_kv_transport(&c) {
            assert_eq!(
                (e.key.as_str(), e.line),
                ("serving.node.d0.rdma_device", 5),
                "{e}"
            );
        }
        // Other transports need nothing.
        let tcp = read("[serving]\nkv_transport = \"tcp\"\n", "p0").expect("tcp");
        let c2 = ClusterConfig::parse(&format!("[serving]\n\n{NODES}"), Path::new("cluster.toml"))
            .expect("cluster");
        assert_eq!(tcp.open_kv_transport(&c2), Ok(None));
        let e = read("[serving]\nrdma_mtu = 1000\n", "p0").expect_err("mtu");
        assert_eq!((e.line, e.key.as_str()), (2, "serving.rdma_mtu"));
    }

    #[test]
    fn errors_name_the_line_and_the_key() {
        let e = read("[serving]\nkv_transport = \"rdam\"\n", "p0").expect_err("bad transport");
        assert_eq!((e.line, e.key.as_str()), (2, "serving.kv_transport"));
        assert!(e.message.contains("\"shm\""), "{e}");
        let e = read("[serving]\nrouting = \"random\"\n", "p0").expect_err("routing");
        assert_eq!((e.line, e.key.as_str()), (2, "serving.routing"));
        assert_eq!(
            read("[serving]\nrouting = \"load\"\n", "p0").map(|s| s.routing),
            Ok(Routing::Load)
        );
        assert_eq!(read("", "p0").map(|s| s.routing), Ok(Routing::CacheAware));
        let e = read("[serving]\n\ndrain_backstop_secs = 0\n", "p0").expect_err("range");
        assert_eq!((e.line, e.key.as_str()), (3, "serving.drain_backstop_secs"));
        let r = read(
            "[serving]\nhttp = \"127.0.0.1:8000\"\n[serving.node.router]\nhttp = \"127.0.0.1:8001\"\n",
            "router",
        )
        .expect("a router's own HTTP address");
        assert_eq!(r.http.port(), 8001);
        let e = read("[serving.node.router]\nhttp = \"nowhere\"\n", "router").expect_err("bad");
        assert_eq!(e.key, "serving.node.router.http");
        let e = read("[serving.node.q9]\nthreads = 2\n", "p0").expect_err("unknown node");
        assert_eq!(e.key, "serving.node.q9");
        assert!(e.message.contains("no node `q9`"), "{e}");
    }
}
