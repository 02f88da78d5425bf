//! The lane against a real TCP receiver as decode's end.

use duet_gpu::KvPool;
use duet_transport::{FrameEvent, Grants, TcpReceiver, coalesce};

use super::*;
use crate::outbox::Outgoing;
use crate::testing::small_layout as layout;

#[test]
fn a_lane_skips_a_cancelled_attempts_writes_and_lands_the_live_ones_behind_them() {
    let l = layout();
    // Decode's end: a real TCP receiver; both attempts hold grants, so whatever the lane
    // writes lands, and only the lane's skipping keeps page 2 clean.
    let dst = KvPool::new(l, 8).unwrap();
    let grants = Grants::default();
    grants.grant(7, &l, &[1]);
    grants.grant(9, &l, &[2]);
    // Frames of attempt 9 that reached decode at all (landing, or dropped).
    let reached = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = reached.clone();
    let rx = TcpReceiver::start(
        "127.0.0.1:0".parse().unwrap(),
        dst.memory(),
        grants,
        Arc::new(move |e| {
            if let FrameEvent::Landing { attempt: 9, .. } | FrameEvent::Dropped { attempt: 9, .. } =
                e
            {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        }),
    )
    .unwrap();
    let mut src = KvPool::new(l, 8).unwrap();
    src.write_token(0, 0, 0, &[1.0; 8], &[2.0; 8]);
    let (outbox, mut sent) = Outbox::channel();
    let (done, _done_rx) = std_mpsc::channel();
    let mut sender = KvSender {
        memory: src.memory(),
        layout: l,
        outbox,
        done,
        stop: Arc::default(),
        links: HashMap::new(),
        progress: HashMap::new(),
        layer_spans: HashMap::new(),
        checksum: false,
        corrupt: 0,
        fail_rate: 0.0,
        id: 1,
        stall_once: None,
        stall_mid_write: None,
    };
    let target = |attempt: u64, aborted: bool| Target {
        span: tracing::Span::none(),
        node: "d0".into(),
        incarnation: 1,
        endpoint: duet_transport::Endpoint {
            host: "test".into(),
            local: None,
            shm: None,
            claims: None,
            tcp: Some(rx.endpoint()),
        },
        backend: Backend::Tcp,
        room: attempt,
        attempt,
        grant: WriteGrant::unslotted(attempt),
        aborted: Arc::new(AtomicBool::new(aborted)),
    };
    let (jobs, queue) = std_mpsc::channel();
    let write = |attempt, aborted, (src, dst)| Job::Write {
        seq: attempt,
        to: target(attempt, aborted),
        runs: coalesce([(src, dst)]),
        pages_so_far: 1,
    };
    // Queued before the abort reached the engine thread; aborted before the lane got there.
    jobs.send(write(9, true, (0, 2))).unwrap();
    jobs.send(write(7, false, (0, 1))).unwrap();
    drop(jobs);
    sender.run_jobs(queue);
    // The live attempt's write is fenced, so everything the lane sent has landed.
    let live = target(7, false);
    sender.fence(&live).unwrap();
    let page = |p: PageId| dst.copy_bytes(l.run_bytes(p, 1)).unwrap();
    assert_eq!(page(1), src.copy_bytes(l.run_bytes(0, 1)).unwrap());
    assert!(
        page(2).iter().all(|b| *b == 0),
        "the cancelled write landed"
    );
    assert_eq!(reached.load(Ordering::SeqCst), 0, "it was sent at all");
    let chunks: Vec<Outgoing> = std::iter::from_fn(|| sent.try_recv().ok()).collect();
    assert_eq!(chunks.len(), 1, "only the live attempt reports a chunk");
    assert_eq!(chunks[0].kind, kinds::CHUNK);
}
