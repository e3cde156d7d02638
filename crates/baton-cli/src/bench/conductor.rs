//! `bench conductor`: a local conductor model's speed, writing plans for a fixed set of questions.

use std::sync::Arc;
use std::time::Instant;

use baton_conductor::{ConductorOptions, LocalConductor, PromptBuilder};
use baton_engine::{PlanningContext, WorkerInfo};
use baton_local::{GenerateOptions, Generated, LocalModel, LocalModelConfig};
use baton_providers::ProviderKind;

use super::{ConductorArgs, median_max};
use crate::{Failure, Outcome};

const QUESTIONS: &[&str] = &[
    "What is the sum of the first 100 prime numbers?",
    "Write a Python function that checks whether a string is a palindrome, ignoring punctuation.",
    "Who wrote 'The Master and Margarita', and when was it first published?",
    "A rectangle's perimeter is 46 cm and its area is 120 cm^2. What are its sides?",
    "Explain the difference between TCP and UDP to a new programmer.",
    "Is 2^31 - 1 prime? Justify the answer.",
];

/// One plan's figures.
struct Sample {
    plan_s: f64,
    first_token_s: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    tokens: u64,
    /// Tokens after the first, per second of the time after the first.
    decode_tps: f64,
    stop_reason: String,
    cut: bool,
}

impl Sample {
    fn new(generated: &Generated, secs: f64) -> Sample {
        let first = generated.time_to_first_token.map_or(secs, |d| d.as_secs_f64());
        let tokens = generated.usage.output_tokens;
        let decode_tps = if secs > first { tokens.saturating_sub(1) as f64 / (secs - first) } else { 0.0 };
        Sample {
            plan_s: secs,
            first_token_s: first,
            prompt_tokens: generated.usage.input_tokens,
            cached_tokens: generated.usage.cached_input_tokens,
            tokens,
            decode_tps,
            stop_reason: generated.finish_reason.clone().unwrap_or_default(),
            cut: generated.cut_after_complete,
        }
    }
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() { f64::NAN } else { median_max(&mut v).0 }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The process's peak resident memory (`VmHWM` in `/proc/self/status`; Linux only).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The threads candle's CPU kernels use: `RAYON_NUM_THREADS` when set, else every core.
fn threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get))
}

pub async fn run(a: ConductorArgs) -> Outcome {
    if a.runs == 0 || a.workers == 0 {
        return Err(Failure::BadInput("--runs and --workers must be at least 1".into()));
    }
    let config = LocalModelConfig {
        path: a.model.clone(),
        chat_template: a.chat_template.clone(),
        force_cpu: a.cpu,
        isq: a.isq.clone(),
        ..LocalModelConfig::default()
    };
    eprintln!("loading {} …", a.model.display());
    let model = Arc::new(LocalModel::load(&config).await.map_err(|e| Failure::BadInput(e.to_string()))?);
    eprintln!("loaded in {:.2} s on {}", model.load_time.as_secs_f64(), model.device);
    let workers: Vec<WorkerInfo> = (0..a.workers)
        .map(|i| WorkerInfo {
            index: i,
            name: format!("w{i}"),
            provider: ProviderKind::OpenAi,
            model: "m".into(),
            description: Some(["strong at math", "careful reviewer", "fast and cheap", "strong at code"][i % 4].into()),
        })
        .collect();
    let defaults = ConductorOptions::default();
    let version = baton_conductor::PromptVersion::parse(&a.prompt).ok_or_else(|| {
        Failure::BadInput(format!(
            "--prompt {}: expected one of {}",
            a.prompt,
            baton_conductor::PromptVersion::NAMES.join(", ")
        ))
    })?;
    let options = ConductorOptions {
        prompt_version: version,
        max_reasoning_chars: a.max_reasoning_chars.unwrap_or(version.default_reasoning_chars()),
        temperature: a.temperature.or(defaults.temperature),
        ..defaults
    };
    let prompts = PromptBuilder::new(workers.clone()).with_version(version);
    let conductor = LocalConductor::new(model.clone(), workers, options.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let mut samples = Vec::with_capacity(a.runs);
    for i in 0..a.runs {
        let question = QUESTIONS[i % QUESTIONS.len()];
        let ctx = PlanningContext::question(question, a.workers, 5);
        let started = Instant::now();
        let mut progress = LiveLine::new(format!("[{}/{}]", i + 1, a.runs));
        let mut on_text = |t: &str| progress.add(t);
        let ledger = baton_engine::accounting::Ledger::new(baton_engine::Budget::default());
        let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
        let (planned, stats) =
            conductor.plan_with_stats(&ctx, &mut on_text, meter).await.map_err(|e| Failure::Failed(e.to_string()))?;
        progress.clear();
        let sample = Sample::new(&stats, started.elapsed().as_secs_f64());
        eprintln!(
            "[{}/{}] {} steps; prompt {} tokens ({} cached), first token {:.2} s; {} tokens in {:.2} s ({})",
            i + 1,
            a.runs,
            planned.plan.steps.len(),
            sample.prompt_tokens,
            sample.cached_tokens,
            sample.first_token_s,
            sample.tokens,
            sample.plan_s,
            if sample.cut { "cut after the fence".to_owned() } else { sample.stop_reason.clone() },
        );
        samples.push(sample);
    }

    // The same prompt and length again without the grammar: what the grammar costs per
    // token. The prompt is cached by now, so this is decoding alone.
    let plan_tokens = median(samples.iter().map(|s| s.tokens as f64));
    let ctx = PlanningContext::question(QUESTIONS[0], a.workers, 5);
    let free = GenerateOptions {
        grammar: None,
        max_tokens: plan_tokens.max(16.0) as usize,
        temperature: options.temperature,
        top_p: None,
        complete_at: None,
    };
    let started = Instant::now();
    let generated = model
        .generate(Some(&prompts.system(&ctx)), &prompts.messages(&ctx), &free, &mut |_| {})
        .await
        .map_err(|e| Failure::Failed(e.to_string()))?;
    let free = Sample::new(&generated, started.elapsed().as_secs_f64());

    let cold = &samples[0];
    let warm = &samples[1..];
    let prompt_tps_cold = (cold.prompt_tokens - cold.cached_tokens) as f64 / cold.first_token_s;
    let decode = median(samples.iter().map(|s| s.decode_tps));
    let grammar_ms = 1000.0 / decode - 1000.0 / free.decode_tps;
    let first_warm = median(warm.iter().map(|s| s.first_token_s));
    let plan_warm = median(warm.iter().map(|s| s.plan_s));
    let cached_warm = median(warm.iter().map(|s| s.cached_tokens as f64));
    let plan_max = samples.iter().map(|s| s.plan_s).fold(0.0, f64::max);
    let cut = samples.iter().filter(|s| s.cut).count();
    let stopped = samples.iter().filter(|s| s.stop_reason == "stop").count();
    // What loading took beyond the weights themselves: on the CPU the engine keeps each weight
    // once (as tiles within 3% of the file's bytes); of the rest, the program's code read in
    // to load it is backed by its file, and what remains is the engine's working memory.
    // On a GPU the weights are in its memory, not the process's.
    let weights = (model.device == "cpu").then(|| baton_local::weights_bytes(&a.model)).flatten();
    let engine =
        model.memory_bytes.zip(weights).map(|(m, w)| m.saturating_sub(w).saturating_sub(model.code_bytes.unwrap_or(0)));
    if a.json {
        println!(
            "{}",
            crate::json::line(&serde_json::json!({
                "model": a.model.display().to_string(), "device": model.device,
                "simd": baton_local::cpu::simd_level(), "threads": threads(), "runs": a.runs,
                "load_s": model.load_time.as_secs_f64(),
                "prompt_tokens": cold.prompt_tokens, "prompt_tokens_per_s_cold": prompt_tps_cold,
                "cached_prompt_tokens_warm": cached_warm,
                "first_token_s_cold": cold.first_token_s, "first_token_s_warm": first_warm,
                "plan_s_cold": cold.plan_s, "plan_s_warm": plan_warm, "plan_s_max": plan_max,
                "plan_tokens_median": plan_tokens,
                "decode_tokens_per_s": decode, "decode_tokens_per_s_without_grammar": free.decode_tps,
                "grammar_ms_per_token": grammar_ms,
                "plans_ended_by_stop_token": stopped, "plans_cut_after_fence": cut,
                "model_memory_mb": model.memory_bytes.map(mib), "peak_rss_mb": peak_rss_bytes().map(mib),
                "weights_mb": weights.map(mib), "code_memory_mb": model.code_bytes.map(mib),
                "engine_memory_mb": engine.map(mib),
            }))
        );
    } else {
        let na = |v: f64| if v.is_nan() { "n/a (one run)".to_owned() } else { format!("{v:.2} s") };
        println!("model        {} on {}", a.model.display(), model.device);
        println!("build        {}, {} threads", baton_local::cpu::simd_level(), threads());
        println!("load         {:.2} s", model.load_time.as_secs_f64());
        println!(
            "prompt       {} tokens, {prompt_tps_cold:.0} tokens/s cold; {cached_warm:.0} cached when warm (median)",
            cold.prompt_tokens
        );
        println!("first token  {:.2} s cold, {} warm (median)", cold.first_token_s, na(first_warm));
        println!(
            "plan         {:.2} s cold, {} warm (median), {plan_max:.2} s worst; {plan_tokens:.0} tokens (median)",
            cold.plan_s,
            na(plan_warm)
        );
        println!(
            "decode       {decode:.1} tokens/s under the grammar, {:.1} without: the grammar adds {grammar_ms:.1} ms a token",
            free.decode_tps
        );
        println!("ended        {stopped} of {} by the end token, {cut} cut after the closing fence", a.runs);
        let shown = |b: Option<u64>| b.map_or_else(|| "n/a".to_owned(), |b| format!("{:.0} MiB", mib(b)));
        println!(
            "memory       {} taken by loading the model: {} of weights (the model's files), {} of the program's code, {} of the engine's working memory (tokenizer, grammar tables, buffers); {} peak resident, with the plans' attention caches",
            shown(model.memory_bytes),
            shown(weights),
            shown(model.code_bytes),
            shown(engine),
            shown(peak_rss_bytes())
        );
    }
    Ok(())
}

/// A progress line on a terminal's stderr, redrawn at most ten times a second while the plan
/// is written: characters so far and their rate. Nothing when stderr is not a terminal.
struct LiveLine {
    label: String,
    tty: bool,
    started: Instant,
    drawn: Option<Instant>,
    chars: usize,
}

impl LiveLine {
    fn new(label: String) -> Self {
        use std::io::IsTerminal;
        LiveLine { label, tty: std::io::stderr().is_terminal(), started: Instant::now(), drawn: None, chars: 0 }
    }

    fn add(&mut self, text: &str) {
        self.chars += text.chars().count();
        if !self.tty || self.drawn.is_some_and(|d| d.elapsed().as_millis() < 100) {
            return;
        }
        self.drawn = Some(Instant::now());
        let secs = self.started.elapsed().as_secs_f64();
        eprint!("\r{} writing the plan: {} chars, {:.1} s\x1b[K", self.label, self.chars, secs);
    }

    fn clear(&self) {
        if self.tty && self.drawn.is_some() {
            eprint!("\r\x1b[K");
        }
    }
}
