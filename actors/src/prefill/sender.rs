//! Prefill's KV sender: the threads that run the engine thread's jobs in order (write runs of
//! pages into decode's pool, fence, send the done, drain an aborted flight), one thread (a
//! lane) per decode node with one transport per decode worker incarnation, and the supervised
//! actor's hand-off of those threads.
//!
//! One lane per decode node, because a write blocks while its peer is unreachable (a TCP send
//! buffer full towards a host that was cut off, until TCP's retransmission gives up or the
//! peer answers): with one thread for every decode node, transfers to healthy decode workers
//! waited behind it, and a 6 s cut of one decode host stalled every transfer of the prefill
//! worker for about 10 s more (`tests/six_hosts.rs`). Jobs of one attempt all go to one node,
//! so each lane keeps their order.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use duet_gpu::{PageId, PoolMemory};
use duet_runtime::metrics as m;
use duet_transport::{
    Backend, ClaimError, Endpoint, KvTransport, PageRun, TransportError, WriteGrant, WriteStage,
};

use super::Cmd;
use crate::history;
use crate::outbox::Outbox;
use crate::protocol::{
    AbortAck, ChunkWritten, RunChecksum, ServingError, TransferDone, TransferFailed,
    WORKER_SERVICE, kinds,
};

pub(super) enum Job {
    Write {
        seq: u64,
        to: Target,
        runs: Vec<PageRun>,
        pages_so_far: usize,
    },
    /// One layer of the last chunk's pages, sent while the later layers compute.
    Layer {
        seq: u64,
        to: Target,
        runs: Arc<Vec<PageRun>>,
        layer: usize,
        pages_so_far: usize,
    },
    Finish {
        seq: u64,
        to: Target,
        done: TransferDone,
        compute_end: Instant,
    },
    Drain {
        seq: u64,
        to: Target,
        failed: Option<ServingError>,
    },
}

impl Job {
    /// Where the job writes.
    pub(super) fn target(&self) -> &Target {
        match self {
            Job::Write { to, .. }
            | Job::Layer { to, .. }
            | Job::Finish { to, .. }
            | Job::Drain { to, .. } => to,
        }
    }

    /// What the job is, for logs.
    fn name(&self) -> &'static str {
        match self {
            Job::Write { .. } => "write",
            Job::Layer { .. } => "layer",
            Job::Finish { .. } => "finish",
            Job::Drain { .. } => "drain",
        }
    }
}

/// A job that holds its lane this long is logged: every later transfer to that decode node
/// waited behind it.
const SLOW_JOB: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub(super) struct Target {
    /// The request's prefill span (parent of the write spans).
    pub(super) span: tracing::Span,
    pub(super) node: String,
    pub(super) incarnation: u64,
    pub(super) endpoint: Endpoint,
    pub(super) backend: Backend,
    pub(super) room: u64,
    pub(super) attempt: u64,
    /// What every write of the attempt carries (decode revokes it to stop them).
    pub(super) grant: WriteGrant,
    /// The flight's abort flag (set by the engine thread): once set, the attempt's writes
    /// and its Finish are skipped (its Drain is not).
    pub(super) aborted: Arc<AtomicBool>,
}

/// Which decode pool a transport writes, and how: its node, worker incarnation, backend, and
/// (for TCP) the receiver's address and secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct LinkKey {
    pub(super) node: String,
    pub(super) incarnation: u64,
    pub(super) backend: Backend,
    pub(super) tcp: Option<(std::net::SocketAddr, u64)>,
}

impl LinkKey {
    pub(super) fn of(to: &Target) -> LinkKey {
        LinkKey {
            node: to.node.clone(),
            incarnation: to.incarnation,
            backend: to.backend,
            tcp: (to.backend == Backend::Tcp)
                .then_some(to.endpoint.tcp)
                .flatten(),
        }
    }
}

pub(super) struct KvSender {
    pub(super) memory: PoolMemory,
    pub(super) layout: duet_gpu::KvLayout,
    pub(super) outbox: Outbox,
    pub(super) done: std_mpsc::Sender<Cmd>,
    pub(super) stop: Arc<std::sync::atomic::AtomicBool>,
    pub(super) links: HashMap<LinkKey, Box<dyn KvTransport>>,
    /// Per attempt: bytes written, seconds spent writing, or the error that ended it.
    pub(super) progress: HashMap<u64, Progress>,
    /// The span of a last chunk being written layer by layer, and its bytes so far.
    pub(super) layer_spans: HashMap<u64, (tracing::Span, u64)>,
    /// Whether each written run gets a checksum for decode to check.
    pub(super) checksum: bool,
    /// Fault injection (`DUET_FAULT_CORRUPT_KV=N`): corrupt one byte of the first run of the
    /// next N transfers after writing it, to prove decode's check catches it.
    pub(super) corrupt: u32,
    /// Fault injection (`DUET_FAULT_TRANSFER_FAIL_RATE=P`): each run of pages fails with
    /// probability P after its bytes were written (a transport that broke mid-transfer).
    pub(super) fail_rate: f64,
    /// The worker incarnation this sender belongs to (for the transfer history).
    pub(super) id: u64,
    /// Fault injection (`DUET_FAULT_STALL_TRANSFER_MS=N`): the sender's first write waits N
    /// ms first, a partition of the transfer path that outlasts decode's waiting deadline.
    pub(super) stall_once: Option<Duration>,
    /// Fault injection (`DUET_FAULT_STALL_MID_WRITE_MS=N`): the sender's first write stops
    /// for N ms halfway through its first copy, holding its claim (for TCP: a frame half
    /// sent), as a writer paused mid-copy would.
    pub(super) stall_mid_write: Option<Duration>,
}

#[derive(Default)]
pub(super) struct Progress {
    pub(super) bytes: u64,
    pub(super) secs: f64,
    pub(super) error: Option<String>,
    pub(super) checksums: Vec<RunChecksum>,
}

impl KvSender {
    pub(super) fn run(mut self, jobs: std_mpsc::Receiver<Job>) {
        let id = self.id;
        self.run_jobs(jobs);
        // Its transports close with it: no write of this sender can land from here on.
        drop(self);
        history::record_with(
            "sender_stopped",
            "",
            0,
            0,
            &[],
            serde_json::json!({ "sender": format!("{id:016x}") }),
        );
    }

    /// Records a transfer-history event of this sender about `to`'s attempt.
    pub(super) fn record(&self, event: &str, to: &Target, pages: &[PageId]) {
        record_write(self.id, event, to, pages);
    }

    pub(super) fn run_jobs(&mut self, jobs: std_mpsc::Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let (what, attempt, t0) = (job.name(), job.target().attempt, Instant::now());
            self.run_job(job);
            let took = t0.elapsed();
            if took >= SLOW_JOB {
                tracing::warn!(
                    job = what,
                    attempt,
                    ?took,
                    "a KV sender job blocked its lane"
                );
            }
        }
    }

    fn run_job(&mut self, job: Job) {
        match job {
            Job::Write {
                seq,
                to,
                runs,
                pages_so_far,
            } => {
                if self.skipped(&to) {
                    return;
                }
                let span = tracing::info_span!(
                    parent: &to.span,
                    "kv_write",
                    backend = to.backend.name(),
                    pages = runs.iter().map(|r| r.n as usize).sum::<usize>(),
                    bytes = tracing::field::Empty,
                );
                let t = Instant::now();
                match self.write(&to, &runs, None) {
                    Ok(n) => {
                        span.record("bytes", n);
                        if let Err(error) = self.after_write(&to, &runs) {
                            self.failed(seq, to.attempt, error);
                            return;
                        }
                        let bytes = self.account(&to, n, t);
                        self.chunk_written(&to, pages_so_far, bytes);
                    }
                    Err(error) => self.failed(seq, to.attempt, error),
                }
            }
            Job::Layer {
                seq,
                to,
                runs,
                layer,
                pages_so_far,
            } => {
                if self.skipped(&to) {
                    return;
                }
                if layer == 0 {
                    let span = tracing::info_span!(
                        parent: &to.span,
                        "kv_write",
                        backend = to.backend.name(),
                        pages = runs.iter().map(|r| r.n as usize).sum::<usize>(),
                        layer_by_layer = true,
                        bytes = tracing::field::Empty,
                    );
                    self.layer_spans.insert(to.attempt, (span, 0));
                }
                let t = Instant::now();
                match self.write(&to, &runs, Some(layer)) {
                    Ok(n) => {
                        let bytes = self.account(&to, n, t);
                        if let Some((_, b)) = self.layer_spans.get_mut(&to.attempt) {
                            *b += n;
                        }
                        if layer + 1 == self.layout.n_layers {
                            if let Some((span, b)) = self.layer_spans.remove(&to.attempt) {
                                span.record("bytes", b);
                            }
                            if let Err(error) = self.after_write(&to, &runs) {
                                self.failed(seq, to.attempt, error);
                                return;
                            }
                            self.chunk_written(&to, pages_so_far, bytes);
                        }
                    }
                    Err(error) => self.failed(seq, to.attempt, error),
                }
            }
            Job::Finish {
                seq,
                to,
                mut done,
                compute_end,
            } => {
                if self.skipped(&to) {
                    return; // the engine aborts it and a Drain follows
                }
                let fence_span = tracing::info_span!(parent: &to.span, "fence");
                let fence_start = Instant::now();
                if let Err(error) = fence_span.in_scope(|| self.fence(&to)) {
                    self.failed(seq, to.attempt, error);
                    return;
                }
                let exposed = compute_end.elapsed().as_secs_f64();
                let mut p = self.progress.remove(&to.attempt).unwrap_or_default();
                p.secs += fence_start.elapsed().as_secs_f64();
                metrics::histogram!(m::TRANSFER_EXPOSED).record(exposed);
                metrics::histogram!(m::TRANSFER_WRITE).record(p.secs);
                if p.secs > 0.0 {
                    metrics::histogram!(m::TRANSFER_GBPS).record(p.bytes as f64 / p.secs / 1e9);
                }
                done.bytes = p.bytes;
                done.checksums = p.checksums;
                drop(fence_span);
                tracing::debug!(
                    parent: &to.span,
                    bytes = p.bytes,
                    exposed_ms = exposed * 1e3,
                    "transfer done"
                );
                self.outbox
                    .send(&to.node, WORKER_SERVICE, kinds::DONE, &done);
                let _ = self.done.send(Cmd::Sent { seq });
            }
            Job::Drain { seq, to, failed } => {
                let _drain = tracing::info_span!(parent: &to.span, "drain").entered();
                self.layer_spans.remove(&to.attempt);
                let broken = self.progress_of(to.attempt).error.is_some();
                // A broken connection was dropped: nothing of it can land any more. Else
                // the fence proves every earlier write landed.
                let fenced = broken || self.fence(&to).is_ok();
                if !fenced {
                    self.drop_link(&to);
                }
                self.progress.remove(&to.attempt);
                match failed {
                    Some(error) => self.outbox.send(
                        &to.node,
                        WORKER_SERVICE,
                        kinds::FAILED,
                        &TransferFailed::new(to.room, Some(to.attempt), &error),
                    ),
                    None => self.outbox.send(
                        &to.node,
                        WORKER_SERVICE,
                        kinds::ABORT_ACK,
                        &AbortAck {
                            room: to.room,
                            attempt: to.attempt,
                        },
                    ),
                };
                let _ = self.done.send(Cmd::Drained { seq });
            }
        }
    }

    /// Whether `to`'s writes and Finish are skipped: its attempt failed here, or the engine
    /// thread aborted it.
    fn skipped(&self, to: &Target) -> bool {
        to.aborted.load(Ordering::SeqCst)
            || self
                .progress
                .get(&to.attempt)
                .is_some_and(|p| p.error.is_some())
    }

    /// Marks an attempt failed (its later jobs are skipped) and tells the engine thread.
    pub(super) fn failed(&mut self, seq: u64, attempt: u64, error: String) {
        tracing::warn!(attempt, %error, "a KV transfer failed on prefill's side");
        self.progress_of(attempt).error = Some(error.clone());
        let _ = self.done.send(Cmd::SendFailed { seq, error });
    }

    /// Counts `n` bytes written since `started`; returns the attempt's bytes so far.
    pub(super) fn account(&mut self, to: &Target, n: u64, started: Instant) -> u64 {
        metrics::counter!(m::KV_BYTES_SENT, "backend" => to.backend.name()).increment(n);
        let p = self.progress_of(to.attempt);
        p.bytes += n;
        p.secs += started.elapsed().as_secs_f64();
        p.bytes
    }

    /// Tells decode how far the transfer is.
    pub(super) fn chunk_written(&self, to: &Target, pages: usize, bytes: u64) {
        self.outbox.send(
            &to.node,
            WORKER_SERVICE,
            kinds::CHUNK,
            &ChunkWritten {
                room: to.room,
                attempt: to.attempt,
                pages,
                bytes,
            },
        );
    }

    /// Once a run's pages are all written: its checksum, and the fault injection if asked.
    pub(super) fn after_write(&mut self, to: &Target, runs: &[PageRun]) -> Result<(), String> {
        let src: Vec<PageId> = runs.iter().flat_map(|r| r.src..r.src + r.n).collect();
        let dst: Vec<PageId> = runs.iter().flat_map(|r| r.dst..r.dst + r.n).collect();
        if self.checksum {
            let crc = duet_transport::pages_crc(&self.memory, &self.layout, &src)
                .map_err(|e| e.to_string())?;
            self.progress_of(to.attempt).checksums.push(RunChecksum {
                pages: dst.clone(),
                crc,
            });
        }
        if self.corrupt > 0
            && let (Some(&s), Some(&d)) = (src.first(), dst.first())
        {
            self.corrupt -= 1;
            let at = self.layout.run_bytes(s, 1).start;
            // SAFETY: the page is pinned at the source (a queued write holds it).
            #[allow(unsafe_code)]
            let byte = unsafe { self.memory.slice(at, 1) }.map_err(|e| e.to_string())?[0];
            let dst_at = self.layout.run_bytes(d, 1).start;
            tracing::warn!(
                attempt = to.attempt,
                page = d,
                "fault injection: corrupting a KV byte"
            );
            self.link(to)?
                .inject(to.grant, dst_at, &[byte ^ 0xFF])
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    pub(super) fn progress_of(&mut self, attempt: u64) -> &mut Progress {
        self.progress.entry(attempt).or_default()
    }

    pub(super) fn link(&mut self, to: &Target) -> Result<&mut Box<dyn KvTransport>, String> {
        let key = LinkKey::of(to);
        if !self.links.contains_key(&key) {
            // A decode worker that restarted has a new pool, and a restarted KV receiver a
            // new address: forget links to older ones.
            self.links.retain(|k, _| k.node != to.node);
            let t = duet_transport::connect(&to.endpoint, to.backend)
                .map_err(|e| format!("connecting to {} by {}: {e}", to.node, to.backend.name()))?;
            self.links.insert(key.clone(), t);
        }
        self.links
            .get_mut(&key)
            .ok_or_else(|| "no transport".to_string())
    }

    /// Writes whole pages of `runs`, or one layer of them; a failed transport is dropped.
    pub(super) fn write(
        &mut self,
        to: &Target,
        runs: &[PageRun],
        layer: Option<usize>,
    ) -> Result<u64, String> {
        let (memory, layout) = (self.memory.clone(), self.layout);
        if let Some(stall) = self.stall_once.take() {
            tracing::warn!(
                ?stall,
                attempt = to.attempt,
                "fault injection: the transfer path stalls"
            );
            std::thread::sleep(stall);
        }
        let (id, mid_stall) = (self.id, self.stall_mid_write.take());
        let dst: Vec<PageId> = if history::enabled() {
            runs.iter().flat_map(|r| r.dst..r.dst + r.n).collect()
        } else {
            Vec::new()
        };
        // The history marks a write begun once its grant held (a refused claim wrote nothing)
        // and ended before its claim is let go, so the checker can order it against decode's
        // release.
        let mut watch = |stage: WriteStage| match stage {
            WriteStage::Started => record_write(id, "write_begin", to, &dst),
            WriteStage::Midway => {
                if let Some(stall) = mid_stall {
                    tracing::warn!(
                        ?stall,
                        attempt = to.attempt,
                        "fault injection: the writer stops mid-copy"
                    );
                    std::thread::sleep(stall);
                }
            }
            WriteStage::Copied => record_write(id, "write_end", to, &[]),
        };
        let link = self.link(to)?;
        let written = match layer {
            None => link.write(to.grant, &memory, &layout, runs, &mut watch),
            Some(l) => link.write_layer(to.grant, &memory, &layout, runs, l, &mut watch),
        };
        if let Err(TransportError::Claim(e @ ClaimError::Revoked { .. })) = &written {
            // Decode took the grant back (it aborted the attempt): nothing was written and
            // the transport is fine for other attempts.
            metrics::counter!(m::KV_WRITES_REFUSED, "backend" => to.backend.name()).increment(1);
            tracing::warn!(attempt = to.attempt, node = %to.node, "decode refused a write: it had revoked the grant");
            return Err(format!("decode stopped the transfer: {e}"));
        }
        let mut result = written.map_err(|e| e.to_string());
        // Once per run: a layer-by-layer run draws at its first layer only.
        if self.fail_rate > 0.0
            && result.is_ok()
            && layer.is_none_or(|l| l == 0)
            && rand::random::<f64>() < self.fail_rate
        {
            tracing::warn!(
                attempt = to.attempt,
                "fault injection: a run of pages failed"
            );
            result = Err("fault injection: the transport failed mid-run".to_string());
        }
        if result.is_err() {
            self.drop_link(to);
        }
        result
    }

    pub(super) fn fence(&mut self, to: &Target) -> Result<(), String> {
        let result = self.link(to)?.fence(to.attempt).map_err(|e| e.to_string());
        if result.is_err() {
            self.drop_link(to);
        } else {
            self.record("fenced", to, &[]);
        }
        result
    }

    /// Tears down the transport to `to`'s decode worker: nothing sent on it lands later.
    pub(super) fn drop_link(&mut self, to: &Target) {
        self.links.remove(&LinkKey::of(to));
        self.record("dropped", to, &[]);
    }
}

/// Records a transfer-history event of sender `id` about `to`'s attempt.
pub(super) fn record_write(id: u64, event: &str, to: &Target, pages: &[PageId]) {
    if history::enabled() {
        history::record_with(
            event,
            &to.node,
            to.incarnation,
            to.attempt,
            pages,
            serde_json::json!({
                "sender": format!("{id:016x}"),
                "backend": to.backend.name(),
                // Which receiver a TCP write goes to (decode records when it stops one).
                "via": (to.backend == Backend::Tcp)
                    .then(|| to.endpoint.tcp.map(|(addr, _)| addr.to_string()))
                    .flatten(),
            }),
        );
    }
}

#[cfg(test)]
mod tests;
