//! The link layer between two real nodes (in this process, over loopback QUIC): requests,
//! ordering, remote failures, and what a misbehaving peer's frames do to its connection.

mod common;

use std::time::Duration;

use common::{Pair, pair};

use duet_runtime::credentials::{CLUSTER_SERVER_NAME, Credentials};
use duet_runtime::echo;
use duet_runtime::link::{Hello, LinkError, Welcome, close_code, kinds, tls};
use duet_runtime::wire::{self, Envelope, Flow, WIRE_VERSION};

fn metrics_line(name: &str, labels: &[&str]) -> f64 {
    let text = duet_runtime::metrics::install().render();
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_answers_order_and_remote_failures() {
    let p = pair().await;
    let link = p.a.context().links.get("b").expect("handle").clone();
    let t = Duration::from_secs(2);

    let body = link
        .request(echo::PING, "test", echo::SERVICE, b"hello".to_vec(), t)
        .await
        .expect("echo");
    assert_eq!(body, b"hello");

    // One-way messages arrive in order, before a request sent after them.
    for _ in 0..500 {
        link.send(echo::NOTE, "test", echo::SERVICE, Vec::new())
            .await
            .expect("note");
    }
    let count = link
        .request(echo::COUNT, "test", echo::SERVICE, Vec::new(), t)
        .await
        .expect("count");
    assert_eq!(wire::decode_body::<u64>(&count), Ok(500));

    match link.request("x.y", "test", "nope", Vec::new(), t).await {
        Err(LinkError::Remote { message, .. }) => {
            assert!(message.contains("no service `nope`"), "{message}")
        }
        other => panic!("expected a remote failure, got {other:?}"),
    }
    match link
        .request("echo.unknown", "test", echo::SERVICE, Vec::new(), t)
        .await
    {
        Err(LinkError::Remote { message, .. }) => assert!(message.contains("does not handle")),
        other => panic!("expected a remote failure, got {other:?}"),
    }
    // Too big to send: refused locally, with a typed error, before touching the wire.
    let huge = vec![0u8; p.config.link.max_frame_bytes as usize];
    match link.send(echo::NOTE, "test", echo::SERVICE, huge).await {
        Err(LinkError::Wire { .. }) => {}
        other => panic!("expected a wire error, got {other:?}"),
    }
    p.a.stop().await;
    p.b.stop().await;
}

/// A client holding the cluster credentials that speaks raw frames to node `b` as node `a`.
async fn raw_client(p: &Pair) -> (quinn::Connection, quinn::SendStream, quinn::RecvStream) {
    let creds = Credentials::load(&p.config.credentials).expect("creds");
    let hello = Hello {
        cluster: p.config.name.clone(),
        node: "a".into(),
        token: creds.token.expose().to_string(),
        wire: wire::Versions::BUILD,
        build: "a raw test client".into(),
        member: None,
    };
    let (conn, send, recv, welcome) = raw_hello(p, &wire::encode_body(&hello)).await;
    assert_eq!(welcome.expect("welcome").kind, kinds::WELCOME);
    (conn, send, recv)
}

/// Sends `hello` (an encoded body) to node `b` as node `a`; the answer envelope.
async fn raw_hello(
    p: &Pair,
    hello: &[u8],
) -> (
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Result<Envelope, (quinn::VarInt, String)>,
) {
    let creds = Credentials::load(&p.config.credentials).expect("creds");
    let (_, client) =
        tls::endpoint_configs(&creds, Duration::from_secs(1), Duration::from_secs(5)).expect("tls");
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    endpoint.set_default_client_config(client);
    let b = p.config.node("b").expect("b").address;
    let conn = endpoint
        .connect(b, CLUSTER_SERVER_NAME)
        .expect("connect")
        .await
        .expect("handshake");
    let (mut send, mut recv) = conn.open_bi().await.expect("stream");
    let env = Envelope::one_way(kinds::HELLO, "a/link", "link", hello.to_vec());
    send.write_all(&wire::encode_frame(&env))
        .await
        .expect("hello");
    let mut header = [0u8; 4];
    let answer = match recv.read_exact(&mut header).await {
        Ok(()) => {
            let mut payload = vec![0u8; u32::from_be_bytes(header) as usize];
            recv.read_exact(&mut payload).await.expect("answer");
            Ok(wire::decode_payload(&payload).expect("decode"))
        }
        // A refusal closes the connection at once: its frame may not arrive, its reason does.
        Err(_) => match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => Err((
                c.error_code,
                String::from_utf8_lossy(&c.reason).into_owned(),
            )),
            other => panic!("no answer to the hello: {other:?}"),
        },
    };
    (conn, send, recv, answer)
}

/// Two builds link when their wire versions overlap, on the newest both speak; otherwise the
/// dialer is refused with both ranges named (a rolling upgrade never splits on garbage).
#[tokio::test(flavor = "multi_thread")]
async fn hellos_negotiate_the_wire_version() {
    let p = pair().await;
    let creds = Credentials::load(&p.config.credentials).expect("creds");
    let hello = |min, max| Hello {
        cluster: p.config.name.clone(),
        node: "a".into(),
        token: creds.token.expose().to_string(),
        wire: wire::Versions { min, max },
        build: "duet 9.9.9".into(),
        member: None,
    };
    let b = wire::Versions::BUILD;
    // A later build that still speaks this one's newest version: that one is used.
    let (_c, _s, _r, answer) = raw_hello(&p, &wire::encode_body(&hello(b.max, b.max + 3))).await;
    let answer = answer.expect("welcome");
    assert_eq!(answer.kind, kinds::WELCOME);
    let welcome: Welcome = wire::decode_body(&answer.body).expect("a welcome");
    assert_eq!(welcome.wire, b.max);
    assert_eq!(welcome.build, duet_runtime::link::build());
    // A build before versions were negotiated sends three fields: it speaks version 1.
    #[derive(serde::Serialize)]
    struct OldHello {
        cluster: String,
        node: String,
        token: String,
    }
    let old = OldHello {
        cluster: p.config.name.clone(),
        node: "a".into(),
        token: creds.token.expose().to_string(),
    };
    let (_c, _s, _r, answer) = raw_hello(&p, &wire::encode_body(&old)).await;
    let answer = answer.expect("welcome");
    let welcome: Welcome = wire::decode_body(&answer.body).expect("a welcome");
    assert_eq!(welcome.wire, 1);
    // No version in common: refused, naming both ranges, counted.
    let before = metrics_line(
        "duet_link_handshake_failures_total",
        &["reason=\"version\""],
    );
    let (_c, _s, _r, answer) =
        raw_hello(&p, &wire::encode_body(&hello(b.max + 1, b.max + 2))).await;
    let reason = match answer {
        Ok(env) => {
            assert_eq!(env.kind, kinds::REFUSED);
            wire::decode_body::<String>(&env.body).expect("a reason")
        }
        Err((code, reason)) => {
            assert_eq!(code, close_code::REFUSED.into());
            reason
        }
    };
    assert!(
        reason.contains("incompatible builds")
            && reason.contains("duet 9.9.9")
            && reason.contains(&format!("{} to {}", b.max + 1, b.max + 2)),
        "{reason}"
    );
    assert_eq!(
        metrics_line(
            "duet_link_handshake_failures_total",
            &["reason=\"version\""]
        ),
        before + 1.0
    );
    p.a.stop().await;
    p.b.stop().await;
}

async fn closed_with_protocol_error(conn: &quinn::Connection) -> String {
    let reason = tokio::time::timeout(Duration::from_secs(5), conn.closed())
        .await
        .expect("b closes the connection");
    match reason {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, close_code::PROTOCOL.into());
            String::from_utf8_lossy(&c.reason).into_owned()
        }
        other => panic!("closed for another reason: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_frames_are_counted_and_close_the_link() {
    let p = pair().await;

    // Oversized: refused from the length prefix alone.
    let before = metrics_line("duet_link_frame_errors_total", &["reason=\"oversized\""]);
    let (conn, mut send, _recv) = raw_client(&p).await;
    send.write_all(&u32::MAX.to_be_bytes())
        .await
        .expect("write");
    let reason = closed_with_protocol_error(&conn).await;
    assert!(reason.contains("exceeds the limit"), "{reason}");
    assert_eq!(
        metrics_line("duet_link_frame_errors_total", &["reason=\"oversized\""]),
        before + 1.0
    );

    // Garbage payload of a plausible length.
    let before = metrics_line("duet_link_frame_errors_total", &["reason=\"malformed\""]);
    let (conn, mut send, _recv) = raw_client(&p).await;
    let mut frame = 64u32.to_be_bytes().to_vec();
    frame.extend((0..64u8).map(|i| i.wrapping_mul(37)));
    send.write_all(&frame).await.expect("write");
    let reason = closed_with_protocol_error(&conn).await;
    assert!(reason.contains("malformed"), "{reason}");
    assert!(
        metrics_line("duet_link_frame_errors_total", &["reason=\"malformed\""]) >= before + 1.0
    );

    // A well-formed envelope claiming to come from another node.
    let (conn, mut send, _recv) = raw_client(&p).await;
    let env = Envelope {
        version: WIRE_VERSION,
        kind: echo::NOTE.into(),
        flow: Flow::OneWay,
        sender: "b/someone".into(),
        target: echo::SERVICE.into(),
        request_id: 0,
        traceparent: None,
        body: vec![],
        tracestate: None,
    };
    send.write_all(&wire::encode_frame(&env))
        .await
        .expect("write");
    let reason = closed_with_protocol_error(&conn).await;
    assert!(reason.contains("sender `b/someone`"), "{reason}");

    // The real link from a to b is untouched by all this.
    let link = p.a.context().links.get("b").expect("handle").clone();
    let body = link
        .request(
            echo::PING,
            "test",
            echo::SERVICE,
            b"still".to_vec(),
            Duration::from_secs(2),
        )
        .await
        .expect("echo after the bad frames");
    assert_eq!(body, b"still");
    p.a.stop().await;
    p.b.stop().await;
}
