//! `baton models`: download model files from the Hugging Face hub (resumable, verified), find,
//! list and delete them, and show the curated conductor models that suit this computer.

use std::io::IsTerminal;
use std::time::Duration;

use baton_models::catalog::{Fit, Machine};
use baton_models::{Cache, Hub, ModelRef, Phase, PullError, human_bytes};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Download a model file from the Hugging Face hub (or HF_ENDPOINT) and print its path. An
    /// interrupted download resumes; the file's SHA-256 is checked before it is used.
    Pull {
        /// OWNER/NAME:FILE (OWNER/NAME@REVISION:FILE), or the file's address on the hub.
        reference: String,
        /// Print the result as one JSON object instead of the path.
        #[arg(long)]
        json: bool,
    },
    /// Print where a downloaded model file is; fails when it has not been downloaded.
    Path { reference: String },
    /// List downloaded model files, and downloads that were interrupted.
    List {
        /// One JSON object per file.
        #[arg(long)]
        json: bool,
    },
    /// Delete a downloaded (or partly downloaded) model file.
    Rm { reference: String },
    /// The curated conductor models, and how each would run on this computer.
    Catalog {
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(cmd: Command) -> Outcome {
    let cache = Cache::new(Cache::default_root());
    match cmd {
        Command::Pull { reference, json } => pull(&cache, &parse(&reference)?, json).await,
        Command::Path { reference } => {
            let reference = parse(&reference)?;
            match cache.find(&reference) {
                Some(path) => {
                    println!("{}", path.display());
                    Ok(())
                }
                None => Err(Failure::Failed(format!(
                    "{reference} is not downloaded (in {}); `baton models pull {reference}` downloads it",
                    cache.root().display()
                ))),
            }
        }
        Command::List { json } => list(&cache, json),
        Command::Rm { reference } => {
            let reference = parse(&reference)?;
            match cache.remove(&reference) {
                Ok(true) => {
                    println!("deleted {reference}");
                    Ok(())
                }
                Ok(false) => Err(Failure::Failed(format!(
                    "{reference} is not downloaded (in {}); `baton models list` shows what is",
                    cache.root().display()
                ))),
                Err(e) => Err(Failure::Failed(format!("cannot delete {reference}: {e}"))),
            }
        }
        Command::Catalog { json } => catalog(&cache, json),
    }
}

fn parse(reference: &str) -> Result<ModelRef, Failure> {
    ModelRef::parse(reference).map_err(|e| Failure::BadInput(e.to_string()))
}

/// The hub from `HF_ENDPOINT`, with `HF_TOKEN` or else a token stored with `baton keys set
/// huggingface` (a keychain that cannot be reached just means no token).
pub fn hub() -> Hub {
    Hub::from_env(|endpoint| {
        let store = baton_secrets::KeyStore::open().ok()?;
        let key = store.get(&baton_models::token_account(endpoint)).ok()??;
        Some(key.expose().to_owned())
    })
}

async fn pull(cache: &Cache, reference: &ModelRef, json: bool) -> Outcome {
    let hub = hub();
    let stop = CancellationToken::new();
    let on_interrupt = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            on_interrupt.cancel();
        }
    });

    let bar = if std::io::stderr().is_terminal() { ProgressBar::new(0) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{msg:12} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    eprintln!("pulling {reference} from {}", hub.endpoint());
    let mut phase = None;
    let mut on_progress = |p: baton_models::Progress| {
        if phase != Some(p.phase) {
            phase = Some(p.phase);
            let (msg, from) = match p.phase {
                Phase::Resolving => ("resolving", 0),
                Phase::Checking => ("checking", 0),
                Phase::Downloading => ("downloading", p.done),
                Phase::Reconnecting => ("reconnecting", p.done),
            };
            bar.set_message(msg);
            if p.phase == Phase::Downloading {
                // Speed and ETA count from here, not from bytes already on disk.
                bar.reset();
                bar.set_position(from);
            }
        }
        bar.set_length(p.total);
        bar.set_position(p.done);
    };
    let result = hub.pull(cache, reference, &mut on_progress, &stop).await;
    bar.finish_and_clear();
    match result {
        Ok(pulled) => {
            let how = if pulled.cached {
                "already downloaded".to_owned()
            } else if pulled.resumed_from > 0 {
                format!("resumed at {}, fetched {}", human_bytes(pulled.resumed_from), human_bytes(pulled.fetched))
            } else {
                format!("fetched {}", human_bytes(pulled.fetched))
            };
            let check = match &pulled.sha256 {
                Some(sha) => format!("SHA-256 {sha} checked"),
                None => "size checked (the hub lists no SHA-256 for this small file)".to_owned(),
            };
            eprintln!("{reference}: {} ({how}; {check})", human_bytes(pulled.size));
            if json {
                println!("{}", crate::json::line(&pulled));
            } else {
                println!("{}", pulled.path.display());
            }
            Ok(())
        }
        Err(PullError::Cancelled { have, size }) => {
            eprintln!(
                "stopped with {} of {} on disk; `baton models pull {reference}` resumes from there",
                human_bytes(have),
                human_bytes(size)
            );
            Err(Failure::Interrupted)
        }
        Err(e) => Err(Failure::Failed(e.to_string())),
    }
}

fn list(cache: &Cache, json: bool) -> Outcome {
    let entries = cache
        .list()
        .map_err(|e| Failure::Failed(format!("cannot read the model folder {}: {e}", cache.root().display())))?;
    if json {
        for e in &entries {
            println!("{}", crate::json::line(e));
        }
        return Ok(());
    }
    if entries.is_empty() {
        eprintln!("no model files in {} (`baton models pull REPO:FILE` downloads one)", cache.root().display());
        return Ok(());
    }
    for e in &entries {
        let state = if e.complete {
            human_bytes(e.size)
        } else {
            format!(
                "partial: {} of {} ({:.0}%), `baton models pull` resumes it",
                human_bytes(e.bytes),
                human_bytes(e.size),
                100.0 * e.bytes as f64 / e.size.max(1) as f64
            )
        };
        println!("{}\t{state}\t{}", e.reference, e.path.display());
    }
    Ok(())
}

fn catalog(cache: &Cache, json: bool) -> Outcome {
    let models = baton_models::catalog::catalog();
    let machine = Machine::detect(baton_local::BUILD_DEVICE != "cpu");
    let recommended = machine.recommend(&models).map(|m| m.id.clone());
    for m in &models {
        let fit = machine.fit(m);
        let downloaded = m.model_ref().and_then(|r| cache.find(&r));
        if json {
            let line = json!({
                "model": m, "fit": fit, "recommended": recommended.as_deref() == Some(m.id.as_str()),
                "path": downloaded,
            });
            println!("{}", crate::json::line(&line));
            continue;
        }
        let fit = match fit {
            Fit::Gpu => "runs on the GPU",
            Fit::Cpu => "runs on the CPU",
            Fit::Slow => "slow on a CPU",
            Fit::TooBig => "too big for this computer",
        };
        let mark = if recommended.as_deref() == Some(m.id.as_str()) { "* " } else { "  " };
        let state = if downloaded.is_some() { ", downloaded" } else { "" };
        println!(
            "{mark}{} ({}, {:.1} GB, needs {:.1} GB; {}): {fit}{state}\n    {}\n    baton models pull {}",
            m.name, m.quantization, m.size_gb, m.memory_gb, m.licence, m.summary, m.reference
        );
    }
    if !json {
        println!("\n* recommended for this computer ({})", machine_line(&machine));
        if let Some(advice) = machine.gpu_advice() {
            println!("{advice}");
        }
    }
    Ok(())
}

fn machine_line(machine: &Machine) -> String {
    let ram = machine.ram_bytes.map_or("memory unknown".to_owned(), |r| format!("{} memory", human_bytes(r)));
    match &machine.gpu {
        Some(gpu) => format!("{ram}, {} with {}", gpu.name, human_bytes(gpu.memory_bytes)),
        None => format!("{ram}, no GPU found"),
    }
}
