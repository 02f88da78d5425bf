//! Local actors subscribe to membership: they hear a peer come up and go down.

mod common;

use std::time::Duration;

use duet_runtime::membership::MembershipEvent;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;

/// Forwards every event it receives to the test.
struct Watcher;

impl Actor for Watcher {
    type Msg = MembershipEvent;
    type State = mpsc::UnboundedSender<MembershipEvent>;
    type Arguments = mpsc::UnboundedSender<MembershipEvent>;

    async fn pre_start(
        &self,
        _: ActorRef<MembershipEvent>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle(
        &self,
        _: ActorRef<MembershipEvent>,
        event: MembershipEvent,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let _ = tx.send(event);
        Ok(())
    }
}

async fn next(rx: &mut mpsc::UnboundedReceiver<MembershipEvent>) -> MembershipEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an event within 10 s")
        .expect("channel open")
}

#[tokio::test(flavor = "multi_thread")]
async fn subscribers_see_up_then_down() {
    let p = common::pair_with("[membership]\nheartbeat_interval_ms = 50\nfailure_threshold = 4\n")
        .await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (watcher, _) = Actor::spawn(None, Watcher, tx)
        .await
        .expect("spawn watcher");
    p.a.context()
        .membership
        .events
        .subscribe(watcher.clone(), Some);

    // b may already be up before the subscription; then the first event we see is its Down.
    if p.a.context().membership.is_up("b") {
        p.b.stop().await;
        assert_eq!(
            next(&mut rx).await,
            MembershipEvent::Down { peer: "b".into() }
        );
    } else {
        match next(&mut rx).await {
            MembershipEvent::Up { peer, .. } => assert_eq!(peer, "b"),
            other => panic!("expected b up, got {other:?}"),
        }
        p.b.stop().await;
        assert_eq!(
            next(&mut rx).await,
            MembershipEvent::Down { peer: "b".into() }
        );
    }
    assert!(!p.a.context().membership.is_up("b"));
    watcher.stop(None);
    p.a.stop().await;
}
