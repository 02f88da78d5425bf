//! `duet trace TRACE_ID`: one request's spans across router, prefill and decode, read from
//! Jaeger's query API (`GET /api/traces/ID`) and drawn as a waterfall, in the terminal and, with
//! `--png FILE`, as an image. For a Jaeger without its UI (a Go-built one has no UI assets), or
//! a terminal without a browser.
//!
//! Spans are laid out depth first from the roots, children by start time, each row indented
//! under its parent; a bar's position and length are its start and duration against the whole
//! trace. A span whose parent is not in the trace (the client's own span, say) is a root.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use duet_runtime::admin::client::{self, Method};
use plotters::prelude::*;
use serde_json::Value;

/// Where Jaeger's query API answers unless `--jaeger` says otherwise (its default port).
pub const DEFAULT_JAEGER: &str = "http://127.0.0.1:16686";

/// One span of the waterfall.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The process that recorded it (`duet-router`, `duet-p0`...).
    pub service: String,
    /// The span's name.
    pub name: String,
    /// Levels below its root.
    pub depth: usize,
    /// Microseconds after the trace's first span started.
    pub start_us: u64,
    /// Microseconds it lasted.
    pub duration_us: u64,
}

/// Lays out the first trace of a Jaeger query answer; an error names what is missing.
pub fn rows(answer: &Value) -> Result<Vec<Row>, String> {
    let trace = answer["data"]
        .get(0)
        .ok_or("Jaeger has no such trace (yet: spans arrive a few seconds after the request)")?;
    let spans = trace["spans"]
        .as_array()
        .ok_or("the trace has no `spans` list")?;
    struct Span<'a> {
        id: &'a str,
        parent: Option<&'a str>,
        service: String,
        name: &'a str,
        start: u64,
        duration: u64,
    }
    let mut all = Vec::with_capacity(spans.len());
    for s in spans {
        let id = s["spanID"].as_str().ok_or("a span without `spanID`")?;
        let parent = s["references"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["refType"] == "CHILD_OF"))
            .and_then(|r| r["spanID"].as_str());
        let process = s["processID"].as_str().unwrap_or_default();
        let service = trace["processes"][process]["serviceName"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        all.push(Span {
            id,
            parent,
            service,
            name: s["operationName"].as_str().unwrap_or("?"),
            start: s["startTime"]
                .as_u64()
                .ok_or("a span without `startTime`")?,
            duration: s["duration"].as_u64().unwrap_or(0),
        });
    }
    let known: std::collections::HashSet<&str> = all.iter().map(|s| s.id).collect();
    let mut children: HashMap<Option<&str>, Vec<usize>> = HashMap::new();
    for (i, s) in all.iter().enumerate() {
        let parent = s.parent.filter(|p| known.contains(p));
        children.entry(parent).or_default().push(i);
    }
    for list in children.values_mut() {
        list.sort_by_key(|&i| (all[i].start, std::cmp::Reverse(all[i].duration)));
    }
    let origin = all.iter().map(|s| s.start).min().unwrap_or(0);
    let mut out = Vec::with_capacity(all.len());
    // Depth first, iteratively (a hostile answer could nest deeply).
    let mut stack: Vec<(usize, usize)> = children
        .get(&None)
        .map(|roots| roots.iter().rev().map(|&i| (i, 0)).collect())
        .unwrap_or_default();
    while let Some((i, depth)) = stack.pop() {
        let s = &all[i];
        out.push(Row {
            service: s.service.clone(),
            name: s.name.to_string(),
            depth,
            start_us: s.start - origin,
            duration_us: s.duration,
        });
        if let Some(kids) = children.get(&Some(s.id)) {
            stack.extend(kids.iter().rev().map(|&k| (k, depth + 1)));
        }
    }
    Ok(out)
}

/// Microseconds from the trace's first start to its last end (at least 1, a divisor).
fn span_us(rows: &[Row]) -> u64 {
    rows.iter()
        .map(|r| r.start_us + r.duration_us)
        .max()
        .unwrap_or(0)
        .max(1)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

/// The waterfall as text, `width` columns of timeline.
pub fn text(trace_id: &str, rows: &[Row], width: usize) -> String {
    let total = span_us(rows);
    let services: std::collections::BTreeSet<&str> =
        rows.iter().map(|r| r.service.as_str()).collect();
    let name_width = rows
        .iter()
        .map(|r| 2 * r.depth + r.name.chars().count())
        .max()
        .unwrap_or(4)
        .max(4);
    let service_width = services.iter().map(|s| s.len()).max().unwrap_or(7).max(7);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "trace {trace_id}: {} spans, {} services ({}), {:.1} ms",
        rows.len(),
        services.len(),
        services.iter().copied().collect::<Vec<_>>().join(", "),
        ms(total)
    );
    let _ = writeln!(
        out,
        "{:<service_width$}  {:<name_width$}  {:>10}  {:>10}  timeline",
        "service", "span", "start ms", "took ms"
    );
    for r in rows {
        let from = (r.start_us as u128 * width as u128 / total as u128) as usize;
        let len = ((r.duration_us as u128 * width as u128).div_ceil(total as u128) as usize)
            .max(1)
            .min(width.saturating_sub(from).max(1));
        let bar = format!("{}{}", " ".repeat(from), "#".repeat(len));
        let name = format!("{}{}", "  ".repeat(r.depth), r.name);
        let _ = writeln!(
            out,
            "{:<service_width$}  {:<name_width$}  {:>10.1}  {:>10.1}  |{:<width$}|",
            r.service,
            name,
            ms(r.start_us),
            ms(r.duration_us),
            bar
        );
    }
    out
}

/// The waterfall as a PNG: a row per span, its bar coloured by service, labelled when a
/// system font is found.
pub fn png(path: &Path, trace_id: &str, rows: &[Row]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let total = span_us(rows);
    let (row_h, label_w, bar_w) = (22u32, 360u32, 900u32);
    let height = 40 + row_h * rows.len().max(1) as u32 + 30;
    let root = BitMapBackend::new(path, (label_w + bar_w + 20, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let labels = crate::bench::plots::font();
    let mut services: Vec<&str> = rows.iter().map(|r| r.service.as_str()).collect();
    services.sort_unstable();
    services.dedup();
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    let colour = |s: &str| {
        let i = services.iter().position(|x| *x == s).unwrap_or(0);
        palette[i % palette.len()]
    };
    let text_style = ("sans-serif", 14).into_font().color(&BLACK);
    if labels {
        root.draw(&Text::new(
            format!("trace {trace_id}: {:.1} ms", ms(total)),
            (10, 10),
            text_style.clone(),
        ))
        .map_err(|e| err(&e))?;
    }
    for (i, r) in rows.iter().enumerate() {
        let y = 40 + i as i32 * row_h as i32;
        let x0 = label_w as i32 + (r.start_us as f64 / total as f64 * bar_w as f64) as i32;
        let w = ((r.duration_us as f64 / total as f64 * bar_w as f64) as i32).max(2);
        root.draw(&Rectangle::new(
            [(x0, y + 3), (x0 + w, y + row_h as i32 - 3)],
            colour(&r.service).filled(),
        ))
        .map_err(|e| err(&e))?;
        if labels {
            let label = format!(
                "{}{} [{}] {:.1} ms",
                "  ".repeat(r.depth),
                r.name,
                r.service,
                ms(r.duration_us)
            );
            root.draw(&Text::new(label, (10, y + 4), text_style.clone()))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// `host:port` of an `http://` URL (the query API is plain HTTP on loopback or a cluster net).
async fn address(url: &str) -> Result<SocketAddr, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("--jaeger {url}: give an http:// URL"))?;
    let host = rest.split('/').next().unwrap_or_default();
    tokio::net::lookup_host(host)
        .await
        .map_err(|e| format!("--jaeger {url}: {e}"))?
        .next()
        .ok_or_else(|| format!("--jaeger {url}: the name resolves to no address"))
}

/// Runs `duet trace`.
pub async fn run(trace_id: &str, jaeger: &str, png_path: Option<&Path>, width: usize) -> ExitCode {
    match fetch_and_draw(trace_id, jaeger, png_path, width).await {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: trace: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn fetch_and_draw(
    trace_id: &str,
    jaeger: &str,
    png_path: Option<&Path>,
    width: usize,
) -> Result<String, String> {
    if trace_id.is_empty() || !trace_id.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "{trace_id:?} is not a trace id (hex, as a traceparent's second field)"
        ));
    }
    let addr = address(jaeger).await?;
    let path = format!("/api/traces/{trace_id}");
    let (status, body) =
        client::exchange(addr, "", Method::GET, &path, None, Duration::from_secs(10))
            .await
            .map_err(|e| format!("Jaeger's query API at {jaeger}: {e}"))?;
    let answer: Value = serde_json::from_slice(&body)
        .map_err(|e| format!("Jaeger at {jaeger} answered {status} with no JSON: {e}"))?;
    if !status.is_success() {
        let why = answer["errors"][0]["msg"]
            .as_str()
            .unwrap_or("no reason given");
        return Err(format!("Jaeger at {jaeger} answered {status}: {why}"));
    }
    let rows = rows(&answer)?;
    if let Some(p) = png_path {
        png(p, trace_id, &rows)?;
    }
    Ok(text(trace_id, &rows, width))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer() -> Value {
        let span = |id: &str, parent: Option<&str>, p: &str, name: &str, start: u64, d: u64| {
            json!({
                "spanID": id, "operationName": name, "processID": p,
                "startTime": start, "duration": d,
                "references": parent.map_or(json!([]), |p| json!([{"refType": "CHILD_OF", "spanID": p}])),
            })
        };
        json!({"data": [{
            "traceID": "ab",
            "processes": {"p1": {"serviceName": "duet-router"}, "p2": {"serviceName": "duet-d0"}},
            "spans": [
                span("d", Some("r"), "p2", "decode", 1_300, 600),
                span("r", Some("client"), "p1", "POST /v1/completions", 1_000, 1_000),
                span("x", Some("d"), "p2", "decoding", 1_500, 400),
                span("q", Some("r"), "p1", "queue_wait", 1_100, 100),
            ],
        }]})
    }

    #[test]
    fn spans_are_laid_out_depth_first_by_start_under_their_parents() {
        let rows = rows(&answer()).expect("rows");
        let names: Vec<(&str, usize, u64)> = rows
            .iter()
            .map(|r| (r.name.as_str(), r.depth, r.start_us))
            .collect();
        // The client's span is not in the trace: the router's request is the root.
        assert_eq!(
            names,
            [
                ("POST /v1/completions", 0, 0),
                ("queue_wait", 1, 100),
                ("decode", 1, 300),
                ("decoding", 2, 500),
            ]
        );
        assert_eq!(rows[2].service, "duet-d0");
    }

    #[test]
    fn the_text_waterfall_scales_bars_to_the_trace() {
        let text = text("ab", &rows(&answer()).expect("rows"), 20);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("trace ab: 4 spans, 2 services (duet-d0, duet-router), 1.0 ms")
        );
        // The root spans the whole timeline; decode starts at 30 % and lasts 60 %.
        assert!(
            lines[2].ends_with(&format!("|{}|", "#".repeat(20))),
            "{text}"
        );
        assert!(lines[4].contains("  decode"), "{text}");
        assert!(
            lines[4].ends_with(&format!(
                "|{}{}{}|",
                " ".repeat(6),
                "#".repeat(12),
                " ".repeat(2)
            )),
            "{text}"
        );
    }

    #[test]
    fn a_missing_trace_and_a_bad_answer_are_errors_not_panics() {
        assert!(
            rows(&json!({"data": []}))
                .unwrap_err()
                .contains("no such trace")
        );
        assert!(rows(&json!({"data": [{"spans": [{"spanID": "a"}]}]})).is_err());
        assert!(rows(&json!("nonsense")).is_err());
    }

    #[test]
    fn the_png_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.png");
        png(&path, "ab", &rows(&answer()).expect("rows")).expect("png");
        let bytes = std::fs::read(&path).expect("read");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    }
}
