//! `duet chaos`'s report as a person reads it: the verdict first, then what was dealt and what
//! broke (the JSON report stays the record; this is its text).

/// The report as a person reads it: the verdict first, then what was dealt and what broke.
pub(super) fn summary(r: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let n = |k: &str| r[k].as_i64().unwrap_or(0);
    let listed = |k: &str| -> (i64, String) {
        let Some(m) = r[k].as_object() else {
            return (0, String::new());
        };
        let total: f64 = m.values().filter_map(|v| v.as_f64()).sum();
        let parts: Vec<String> = m
            .iter()
            .map(|(name, v)| format!("{name} {}", v.as_f64().unwrap_or(0.0)))
            .collect();
        let detail = if parts.is_empty() {
            String::new()
        } else {
            format!(" ({})", parts.join(", "))
        };
        (total as i64, detail)
    };
    let requests = n("requests");
    let pct = |k: &str| {
        if requests > 0 {
            format!("{:5.1} %", 100.0 * n(k) as f64 / requests as f64)
        } else {
            "    - ".to_string()
        }
    };
    let bad = n("unfinished") != 0 || n("corrupted") != 0 || n("stranded_pages") != 0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "duet chaos: {} ({} requests in {:.0} s of load)",
        if bad { "FAIL" } else { "PASS" },
        requests,
        r["load_seconds"].as_f64().unwrap_or(0.0)
    );
    let (_, phases) = listed("failed_by_phase");
    for (key, label, note) in [
        (
            "succeeded",
            "succeeded",
            " (output equal to the engine's greedy reference)",
        ),
        ("failed", "failed", phases.as_str()),
        ("unfinished", "unfinished", " (no answer within 120 s)"),
        (
            "corrupted",
            "corrupted",
            " (answered, but not the reference output)",
        ),
    ] {
        let _ = writeln!(out, "  {label:<11} {:>6}  {}{note}", n(key), pct(key));
    }
    let stranded = match n("stranded_pages") {
        -1 => "unknown (a worker's pool could not be read)".to_string(),
        s => format!("{s} pages held after the load"),
    };
    let _ = writeln!(out, "  stranded KV {stranded}");
    let (kills, kd) = listed("kills");
    let (pauses, pd) = listed("pauses");
    let (crashes, cd) = listed("crashes");
    let _ = writeln!(
        out,
        "faults: {kills} actor kills{kd}, {pauses} pauses{pd}, {crashes} crashes{cd}"
    );
    let (restarts, rd) = listed("restarts_by_kind");
    let _ = writeln!(out, "restarts seen in the metrics: {restarts}{rd}");
    if let Some(errors) = r["errors"].as_array().filter(|e| !e.is_empty()) {
        let _ = writeln!(out, "errors (up to 8 distinct):");
        for e in errors {
            let _ = writeln!(out, "  - {}", e.as_str().unwrap_or_default());
        }
    }
    if bad {
        let _ = writeln!(
            out,
            "FAIL: a request never finished, an answer was wrong, or KV pages stayed held"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_summary_gives_the_verdict_and_what_was_dealt() {
        let mut r = json!({
            "requests": 200, "succeeded": 198, "failed": 2, "unfinished": 0, "corrupted": 0,
            "stranded_pages": 0, "success_rate": 0.99,
            "failed_by_phase": {"decode transfer": 2},
            "errors": ["decode transfer: the prefill node d0 restarted"],
            "kills": {"router": 3, "sender": 2}, "pauses": {}, "crashes": {"p0": 1},
            "restarts_by_kind": {"router": 3.0}, "load_seconds": 40.2,
        });
        let text = summary(&r);
        assert!(
            text.starts_with("duet chaos: PASS (200 requests in 40 s"),
            "{text}"
        );
        assert!(text.contains("succeeded      198   99.0 %"), "{text}");
        assert!(text.contains("(decode transfer 2)"), "{text}");
        assert!(
            text.contains("5 actor kills (router 3, sender 2)"),
            "{text}"
        );
        assert!(text.contains("1 crashes (p0 1)"), "{text}");
        assert!(
            text.contains("- decode transfer: the prefill node d0 restarted"),
            "{text}"
        );
        r["corrupted"] = json!(1);
        let text = summary(&r);
        assert!(text.starts_with("duet chaos: FAIL"), "{text}");
        assert!(text.contains("corrupted        1"), "{text}");
        r["corrupted"] = json!(0);
        r["stranded_pages"] = json!(-1);
        assert!(
            summary(&r).contains("stranded KV unknown"),
            "{}",
            summary(&r)
        );
    }
}
