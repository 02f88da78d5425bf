//! The router: OpenAI-compatible HTTP in front, workers behind.
//!
//! The HTTP handlers ([`http`]) validate and tokenize a request and choose where it runs:
//! a prompt shorter than `disagg_threshold`, or one with no compatible prefill worker ready,
//! goes to a decode worker alone; any other gets a (prefill, decode) pair with equal KV
//! layouts, each picked by load (power of two choices on queued tokens, then free pages),
//! and a random 63-bit room. Both halves are sent at once: `worker.generate` to decode,
//! `bootstrap.prefill` to prefill. The router actor receives the workers' token batches and load reports and routes each
//! item to the request's channel. A worker that membership marks down, or that comes back as a
//! new incarnation, fails the requests it held; what happens next is the request's
//! [`policy`] (a pure state machine: retries, migrations, waiting for workers), driven by its
//! generation (`generation.rs`, the shell that starts attempts and streams their tokens).

mod access;
pub mod affinity;
mod generation;
pub mod http;
mod openai;
pub mod policy;
mod shared;
mod spans;
mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duet_engine::chat::ChatTemplate;
use duet_engine::gguf::Gguf;
use duet_engine::tokenizer::Tokenizer;
use duet_fetch as fetch;
use duet_runtime::context::NodeContext;
use duet_runtime::membership::MembershipEvent;
use duet_runtime::services::Inbound;
use duet_runtime::wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::Rng;
use tokio::task::JoinHandle;

use crate::protocol::{LoadReport, ROUTER_SERVICE, TokenBatch, kinds};
use crate::settings::ServingConfig;
pub(super) use shared::Started;
pub use shared::{Placement, RouterShared};

/// The router's HTTP listener on `addr`; with `reuse_port`, one of several routers of this
/// host sharing it (SO_REUSEPORT: new connections spread over the live listeners).
fn bind_http(
    addr: std::net::SocketAddr,
    reuse_port: bool,
) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's bind does on Unix: a port in TIME_WAIT is free to take.
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// The router actor.
pub struct RouterActor;

/// Makes `myself` the node's router service and subscribes it to membership.
fn register(ctx: &NodeContext, myself: &ActorRef<RouterMsg>) {
    ctx.services.register(ROUTER_SERVICE, myself.clone());
    ctx.membership
        .events
        .subscribe(myself.clone(), |e| Some(RouterMsg::Membership(e)));
}

/// What the router actor handles.
#[derive(Debug)]
pub enum RouterMsg {
    /// From a worker.
    Inbound(Inbound),
    /// A peer went up or down.
    Membership(MembershipEvent),
}

duet_runtime::inbound_message!(enum RouterMsg::Inbound);

/// What outlives the router actor: its shared state and its HTTP server. The listening
/// socket and the clients' open streams belong to the node, not to one incarnation of the
/// actor, so killing the actor loses no connection: its successor takes them over and every
/// request in flight continues as a new attempt (see [`RouterShared::resync`]).
#[derive(Default)]
pub struct RouterHome {
    slot: Mutex<Option<Arc<RouterShared>>>,
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for RouterHome {
    fn drop(&mut self) {
        if let Some(server) = self.server.get_mut().ok().and_then(Option::take) {
            server.abort();
        }
    }
}

/// The running router incarnation.
pub struct RouterState {
    shared: Arc<RouterShared>,
}

impl Actor for RouterActor {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = (Arc<NodeContext>, Arc<RouterHome>);

    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        (ctx, home): (Arc<NodeContext>, Arc<RouterHome>),
    ) -> Result<RouterState, ActorProcessingErr> {
        let kept = home.slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(shared) = kept {
            // A restart: take over the predecessor's connections, then move every request
            // it was serving to a new attempt (tokens sent while no actor listened are lost).
            register(&ctx, &myself);
            shared.resync();
            tracing::info!("router restarted; requests in flight continue");
            return Ok(RouterState { shared });
        }
        let settings = ServingConfig::for_node(&ctx.config, &ctx.me.name)?;
        let path = settings.model.clone();
        let (tokenizer, chat, max_context) = tokio::task::spawn_blocking(move || {
            let path = if path.exists() || !path.ends_with(fetch::MODEL_FILE) {
                path
            } else {
                fetch::ensure_model(&path, &mut |_| {}).map_err(|e| e.to_string())?
            };
            let g = Gguf::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let tok = Tokenizer::from_gguf(&g).map_err(|e| e.to_string())?;
            let chat = ChatTemplate::from_gguf(&g).ok();
            let ctx_len = g.u64("llama.context_length").map_err(|e| e.to_string())? as usize;
            Ok::<_, String>((tok, chat, ctx_len))
        })
        .await??;
        // A predecessor's server (killed a moment ago) may still be closing its socket.
        let deadline = Instant::now() + Duration::from_secs(2);
        let listener = loop {
            match bind_http(settings.http, settings.http_reuse_port) {
                Ok(l) => break l,
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    return Err(
                        format!("cannot bind the HTTP address {}: {e}", settings.http).into(),
                    );
                }
            }
        };
        let created = std::fs::metadata(&settings.model)
            .and_then(|m| m.modified())
            .unwrap_or_else(|_| std::time::SystemTime::now())
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let shared = Arc::new(RouterShared {
            ctx: ctx.clone(),
            settings,
            tokenizer,
            chat,
            max_context,
            workers: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(rand::rng().random_range(1..1 << 40)),
            open: std::sync::atomic::AtomicUsize::new(0),
            prefixes: Mutex::new(affinity::PrefixIndex::new()),
            created,
        });
        ctx.drain.set_timeout(shared.settings.shutdown_drain);
        let weak = Arc::downgrade(&shared);
        ctx.drain.set_probe("router", move || {
            weak.upgrade().map_or(0, |s| s.open.load(Ordering::SeqCst))
        });
        let app = http::app(shared.clone());
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "router HTTP server stopped");
            }
        });
        *home.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(shared.clone());
        *home.server.lock().unwrap_or_else(|p| p.into_inner()) = Some(server);
        register(&ctx, &myself);
        tracing::info!(http = %shared.settings.http, "router ready");
        Ok(RouterState { shared })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<RouterMsg>,
        state: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        state
            .shared
            .ctx
            .services
            .unregister(ROUTER_SERVICE, myself.get_id());
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        state: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        let shared = &state.shared;
        match msg {
            RouterMsg::Inbound(Inbound { envelope, .. }) => match envelope.kind.as_str() {
                kinds::EVENTS => {
                    if let Ok(batch) = wire::decode_body::<TokenBatch>(&envelope.body) {
                        shared.deliver(batch);
                    }
                }
                kinds::LOAD => {
                    if let Ok(report) = wire::decode_body::<LoadReport>(&envelope.body) {
                        let previous = shared
                            .lock_workers()
                            .insert(report.worker.clone(), (report.clone(), Instant::now()));
                        if let Some((old, _)) =
                            previous.filter(|(o, _)| o.incarnation != report.incarnation)
                        {
                            tracing::warn!(worker = %old.worker, "worker restarted");
                            shared.fail_worker(&old.worker, "it restarted", true);
                        }
                    }
                }
                other => tracing::warn!(kind = other, "router ignored a message"),
            },
            RouterMsg::Membership(MembershipEvent::Down { peer }) => {
                shared.lock_workers().remove(&peer);
                shared.fail_worker(&peer, "membership marked it down", false);
            }
            RouterMsg::Membership(MembershipEvent::Up { .. }) => {}
        }
        Ok(())
    }
}
