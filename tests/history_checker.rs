//! The independent history checker (`tests/python/check_history.py`) that the fault and chaos
//! tests run over every recorded transfer history: it refuses each broken rule by name and
//! passes sound histories.

use std::path::PathBuf;

use serde_json::{Value, json};

/// The checker itself: a history that breaks each rule is refused, naming the rule; a sound
/// one passes. (A checker that passes everything would make the scenarios above prove nothing.)
#[tokio::test]
async fn the_history_checker_catches_each_violation() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/check_history.py");
    let ev = |t: u64, event: &str, attempt: u64, pages: &[u32], extra: Value| {
        let mut v = json!({"t": t, "event": event, "decode": "d0", "inc": "01",
                           "attempt": attempt, "pages": pages});
        if let (Some(o), Value::Object(x)) = (v.as_object_mut(), extra) {
            o.extend(x);
        }
        v.to_string()
    };
    let w = |backend: &str| json!({"sender": "aa", "backend": backend, "via": "r1"});
    let at = |offset: u64| json!({ "offset": offset });
    let sound = vec![
        // tcp: prefill hands bytes to a socket; decode's receiver lands them.
        ev(1, "open", 1, &[1, 2], Value::Null),
        ev(2, "write_begin", 1, &[1, 2], w("tcp")),
        ev(3, "land_begin", 1, &[1, 2], at(100)),
        ev(4, "write_end", 1, &[], w("tcp")),
        ev(5, "land_end", 1, &[], at(100)),
        ev(6, "fenced", 1, &[], w("tcp")),
        ev(7, "publish", 1, &[], Value::Null),
        // shm: the writer copies under its claim.
        ev(8, "open", 2, &[3], Value::Null),
        ev(9, "write_begin", 2, &[3], w("shm")),
        ev(10, "write_end", 2, &[], w("shm")),
        ev(11, "close", 2, &[], Value::Null),
    ];
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("sound", sound.clone()),
        (
            "sound: a tcp write after the release, refused by the receiver",
            {
                let mut h = sound.clone();
                h.push(ev(12, "write_begin", 1, &[1], w("tcp")));
                h
            },
        ),
        (
            // A writer killed mid-copy records no end: decode's proven revoke (its claim slot
            // back once the dead process's lock went) settles the write.
            "sound: a shm write settled by decode's revoke",
            {
                let mut h = sound.clone();
                h.extend([
                    ev(12, "open", 3, &[4], Value::Null),
                    ev(13, "write_begin", 3, &[4], w("shm")),
                    ev(14, "revoked", 3, &[], Value::Null),
                    ev(15, "close", 3, &[], Value::Null),
                ]);
                h
            },
        ),
        ("after its release", {
            let mut h = sound.clone();
            h.push(ev(12, "write_begin", 2, &[3], w("shm")));
            h
        }),
        ("after its release", {
            let mut h = sound.clone();
            h.push(ev(12, "land_begin", 1, &[2], at(200)));
            h
        }),
        ("released twice", {
            let mut h = sound.clone();
            h.push(ev(12, "close", 2, &[], Value::Null));
            h
        }),
        (
            // A frame still landing when decode let the pages go.
            "not settled",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "land_begin", 1, &[1], at(100)),
                ev(3, "land_end", 1, &[], at(300)),
                ev(4, "close", 1, &[], Value::Null),
                ev(5, "land_end", 1, &[], at(100)),
            ],
        ),
        (
            // A shm copy that ended after the release (its claim was not respected).
            "not settled",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "write_begin", 1, &[1], w("shm")),
                ev(3, "close", 1, &[], Value::Null),
                ev(4, "write_end", 1, &[], w("shm")),
            ],
        ),
        (
            // A revoke proven before the copy began proves nothing about the copy.
            "not settled",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "revoked", 1, &[], Value::Null),
                ev(3, "write_begin", 1, &[1], w("shm")),
                ev(4, "close", 1, &[], Value::Null),
            ],
        ),
        (
            // A tcp landing ends only by its own read's end, not by a revoke.
            "not settled",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "land_begin", 1, &[1], at(100)),
                ev(3, "revoked", 1, &[], Value::Null),
                ev(4, "close", 1, &[], Value::Null),
            ],
        ),
        (
            // A landing is not settled by prefill's end of writing.
            "not settled",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "land_begin", 1, &[1], at(100)),
                ev(3, "write_end", 1, &[], w("tcp")),
                ev(4, "close", 1, &[], Value::Null),
            ],
        ),
        (
            "published before prefill fenced",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "write_begin", 1, &[1], w("shm")),
                ev(3, "write_end", 1, &[], w("shm")),
                ev(4, "publish", 1, &[], Value::Null),
            ],
        ),
        (
            "outside its reservation",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "write_begin", 1, &[1, 9], w("shm")),
            ],
        ),
        (
            "outside its reservation",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "land_begin", 1, &[9], at(900)),
            ],
        ),
        (
            "still held it",
            vec![
                ev(1, "open", 1, &[1], Value::Null),
                ev(2, "open", 2, &[1], Value::Null),
            ],
        ),
    ];
    for (rule, lines) in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("1.jsonl"), lines.join("\n")).expect("write");
        let out = tokio::process::Command::new("python3")
            .arg(&script)
            .arg(dir.path())
            .output()
            .await
            .expect("python3");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if rule.starts_with("sound") {
            assert!(
                out.status.success(),
                "a sound history was refused: {stdout}"
            );
        } else {
            assert!(!out.status.success(), "`{rule}` was not caught: {stdout}");
            assert!(stdout.contains(rule), "`{rule}` not named: {stdout}");
        }
    }
}
