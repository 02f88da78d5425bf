//! PNG plots of the interference experiment (plotters, bitmap backend): ITL histograms of both
//! modes overlaid, ITL over time with the long prompts' arrivals marked, TTFT CDFs.
//!
//! Text needs a font: the first of a few common system TrueType fonts is registered; without
//! one the plots are drawn without labels (still useful, and never a failure).

use std::path::Path;

use plotters::prelude::*;

use super::experiment::{ModeRun, Params};
use super::stats;

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font for plot text once; false when none is found.
pub(crate) fn font() -> bool {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        for path in FONTS {
            if let Ok(bytes) = std::fs::read(path) {
                // The font data must live as long as the process: leak it once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

const COLORS: [RGBColor; 2] = [RGBColor(214, 39, 40), RGBColor(31, 119, 180)];

fn err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// Writes `itl_histogram.png`, `itl_over_time.png` and `ttft_cdf.png` into `dir`.
pub fn interference(dir: &Path, runs: &[ModeRun], p: &Params) -> Result<(), String> {
    let labels = font();
    itl_histogram(&dir.join("itl_histogram.png"), runs, labels)?;
    itl_over_time(&dir.join("itl_over_time.png"), runs, p, labels)?;
    ttft_cdf(&dir.join("ttft_cdf.png"), runs, labels)?;
    Ok(())
}

fn steady_itl_ms(run: &ModeRun) -> Vec<f64> {
    run.records
        .iter()
        .filter(|r| r.class == "steady")
        .flat_map(|r| r.itl.iter().map(|(g, _)| g * 1e3))
        .collect()
}

fn itl_histogram(path: &Path, runs: &[ModeRun], labels: bool) -> Result<(), String> {
    let all: Vec<Vec<f64>> = runs.iter().map(steady_itl_ms).collect();
    let max = all
        .iter()
        .flat_map(|v| v.iter().copied())
        .fold(1.0f64, f64::max);
    let bins = 60;
    let hists: Vec<Vec<f64>> = all
        .iter()
        .map(|v| {
            let n = v.len().max(1) as f64;
            stats::histogram(v, 0.0, max * 1.0001, bins)
                .into_iter()
                .map(|c| c as f64 / n)
                .collect()
        })
        .collect();
    let top = hists
        .iter()
        .flat_map(|h| h.iter().copied())
        .fold(0.01f64, f64::max);
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root);
    chart.margin(15).x_label_area_size(40).y_label_area_size(60);
    if labels {
        chart.caption(
            "Inter-token latency of the steady sequences",
            ("sans-serif", 22),
        );
    }
    let mut chart = chart
        .build_cartesian_2d(0.0..max, (1e-4f64..top * 1.5).log_scale())
        .map_err(err)?;
    if labels {
        chart
            .configure_mesh()
            .x_desc("ITL (ms)")
            .y_desc("share of gaps (log)")
            .draw()
            .map_err(err)?;
    }
    let width = max / bins as f64;
    for (i, (run, h)) in runs.iter().zip(&hists).enumerate() {
        let color = COLORS[i % 2];
        let series = chart
            .draw_series(
                h.iter()
                    .enumerate()
                    .filter(|(_, y)| **y > 0.0)
                    .map(|(b, y)| {
                        let x0 = b as f64 * width;
                        Rectangle::new([(x0, 1e-4), (x0 + width, *y)], color.mix(0.45).filled())
                    }),
            )
            .map_err(err)?;
        if labels {
            series.label(run.name).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
            });
        }
    }
    if labels {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)
}

fn itl_over_time(path: &Path, runs: &[ModeRun], p: &Params, labels: bool) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1000, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let panels = root.split_evenly((runs.len().max(1), 1));
    let max = runs.iter().flat_map(steady_itl_ms).fold(1.0f64, f64::max);
    for (i, (run, area)) in runs.iter().zip(panels.iter()).enumerate() {
        let points: Vec<(f64, f64)> = run
            .records
            .iter()
            .filter(|r| r.class == "steady")
            .flat_map(|r| r.itl.iter().map(|(g, t)| (*t, g * 1e3)))
            .collect();
        let arrivals: Vec<f64> = run
            .records
            .iter()
            .filter(|r| r.class == "long")
            .map(|r| r.sent_s)
            .collect();
        let end = points.iter().map(|(t, _)| *t).fold(p.duration_s, f64::max);
        let mut chart = ChartBuilder::on(area);
        chart.margin(12).x_label_area_size(35).y_label_area_size(60);
        if labels {
            chart.caption(
                format!("{}: ITL over time (dashes: long prompts arrive)", run.name),
                ("sans-serif", 18),
            );
        }
        let mut chart = chart
            .build_cartesian_2d(0.0..end, 0.0..max * 1.05)
            .map_err(err)?;
        if labels {
            chart
                .configure_mesh()
                .x_desc("time (s)")
                .y_desc("ITL (ms)")
                .draw()
                .map_err(err)?;
        }
        for t in arrivals {
            chart
                .draw_series(DashedLineSeries::new(
                    [(t, 0.0), (t, max * 1.05)],
                    6,
                    4,
                    BLACK.mix(0.6).stroke_width(1),
                ))
                .map_err(err)?;
        }
        let color = COLORS[i % 2];
        chart
            .draw_series(
                points
                    .iter()
                    .map(|(t, y)| Circle::new((*t, *y), 2, color.filled())),
            )
            .map_err(err)?;
    }
    root.present().map_err(err)
}

fn ttft_cdf(path: &Path, runs: &[ModeRun], labels: bool) -> Result<(), String> {
    let curves: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| {
            let ttft: Vec<f64> = r
                .records
                .iter()
                .filter(|r| r.class == "long")
                .filter_map(|r| r.ttft_s.map(|t| t * 1e3))
                .collect();
            stats::cdf(&ttft)
        })
        .collect();
    let max = curves
        .iter()
        .flat_map(|c| c.iter().map(|(x, _)| *x))
        .fold(1.0f64, f64::max);
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root);
    chart.margin(15).x_label_area_size(40).y_label_area_size(60);
    if labels {
        chart.caption(
            "Time to first token of the long prompts (CDF)",
            ("sans-serif", 22),
        );
    }
    let mut chart = chart
        .build_cartesian_2d(0.0..max * 1.05, 0.0..1.0)
        .map_err(err)?;
    if labels {
        chart
            .configure_mesh()
            .x_desc("TTFT (ms)")
            .y_desc("fraction of long prompts")
            .draw()
            .map_err(err)?;
    }
    for (i, (run, curve)) in runs.iter().zip(&curves).enumerate() {
        let color = COLORS[i % 2];
        // A step function: each point holds until the next.
        let mut steps = vec![(0.0, 0.0)];
        let mut prev = 0.0;
        for (x, y) in curve {
            steps.push((*x, prev));
            steps.push((*x, *y));
            prev = *y;
        }
        steps.push((max * 1.05, prev));
        let series = chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))
            .map_err(err)?;
        if labels {
            series.label(run.name).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
            });
        }
    }
    if labels {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)
}

/// `--sweep`'s curve: output tokens per second (x) against TTFT p50 and p99 and ITL p99 (y,
/// ms), a point per request rate, labelled with its rate.
pub fn sweep(path: &Path, points: &[(f64, stats::Summary)]) -> Result<(), String> {
    let labels = font();
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let x_max = points
        .iter()
        .map(|(_, s)| s.throughput_tok_s)
        .fold(1.0, f64::max)
        * 1.1;
    let y_max = points
        .iter()
        .map(|(_, s)| s.ttft_p99_ms.max(s.itl_p99_ms))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&root);
    chart.margin(20).x_label_area_size(40).y_label_area_size(60);
    if labels {
        chart.caption(
            "Throughput against latency, a point per request rate",
            ("sans-serif", 22),
        );
    }
    let mut chart = chart
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    if labels {
        chart
            .configure_mesh()
            .x_desc("output tokens / s")
            .y_desc("ms")
            .draw()
            .map_err(err)?;
    }
    type Figure = fn(&stats::Summary) -> f64;
    let series: [(&str, RGBColor, Figure); 3] = [
        ("TTFT p50", COLORS[1], |s| s.ttft_p50_ms),
        ("TTFT p99", COLORS[0], |s| s.ttft_p99_ms),
        ("ITL p99", RGBColor(44, 160, 44), |s| s.itl_p99_ms),
    ];
    for (name, colour, y) in series {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|(_, s)| (s.throughput_tok_s, y(s)))
            .collect();
        let drawn = chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
            .map_err(err)?;
        if labels {
            drawn
                .label(name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour));
        }
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 4, colour.filled())))
            .map_err(err)?;
    }
    if labels {
        for (rate, s) in points {
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{rate} req/s"),
                    (s.throughput_tok_s, s.ttft_p99_ms),
                    ("sans-serif", 13).into_font(),
                )))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
