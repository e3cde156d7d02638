//! Model files from the Hugging Face hub, for the conductor and local workers.
//!
//! - [`ModelRef`]: what a user names a file by (`owner/name:file`).
//! - [`Hub`]: the hub's HTTP protocol (`HEAD`/`GET` on `resolve`, the LFS headers, redirects to
//!   a file host, `Range`), honouring `HF_ENDPOINT` and a token for gated repositories.
//! - [`pull`](Hub::pull): a download that resumes where it stopped (after a dropped connection
//!   at once, after a crash or a closed app on the next pull), checks free space first and the
//!   file's SHA-256 against the hub's before the file is used.
//! - [`Cache`]: the hub's own cache layout, so other hub tools find the files and the other way round.
//! - [`datasets`]: evaluation sets read through the hub's dataset viewer (`baton eval run --from-hf`).
//! - [`catalog`]: the curated conductor models (data, in `catalog.toml`) and which fit this machine.

pub mod cache;
pub mod catalog;
pub mod datasets;
mod hub;
mod reference;

pub use cache::{Cache, Entry};
pub use hub::{Hub, Phase, Progress, Pulled};
pub use reference::{ModelRef, RefError};

use std::path::PathBuf;

/// Why a pull failed. Every message says what happened and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error(
        "{repo} on {endpoint} is gated or private and {}: accept its licence on its page on the hub \
         with your account, then set HF_TOKEN to an access token of that account (or store one with \
         `baton keys set huggingface`){}",
        if *had_token { "the token given was refused" } else { "no access token was given" },
        message.as_deref().map(|m| format!(" (the hub said: {m})")).unwrap_or_default()
    )]
    Gated { repo: String, endpoint: String, had_token: bool, message: Option<String> },

    #[error(
        "the repository {repo} was not found on {endpoint}: check its name on the hub (a private \
         repository also needs HF_TOKEN)"
    )]
    RepoNotFound { repo: String, endpoint: String },

    #[error("the revision \"{revision}\" of {repo} was not found on {endpoint}: name a branch, tag or commit it has")]
    RevisionNotFound { repo: String, revision: String, endpoint: String },

    #[error(
        "{file} was not found in {repo} at {revision} on {endpoint}: check the file name on the \
         repository's \"Files\" page"
    )]
    FileNotFound { repo: String, revision: String, file: String, endpoint: String },

    #[error(
        "cannot reach {url}: {cause}. Check the connection; where the hub is blocked, set HF_ENDPOINT \
         to a mirror (for example https://hf-mirror.com), or choose a model file already on disk"
    )]
    Unreachable { url: String, cause: String },

    #[error("{url} answered {status}{}", message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Http { url: String, status: u16, message: Option<String> },

    #[error("{url} answered in a way Baton does not understand: {what}")]
    Protocol { url: String, what: String },

    #[error(
        "the download of {file} is corrupt: its SHA-256 is {actual} but the hub lists {expected}. \
         The downloaded data was deleted; pull again"
    )]
    Checksum { file: String, expected: String, actual: String },

    #[error(
        "not enough free disk space in {}: the download needs {} more and {} is free. Free some \
         space, or set BATON_MODELS_DIR to a folder on a disk with room",
        dir.display(), human_bytes(*need), human_bytes(*free)
    )]
    NoSpace { dir: PathBuf, need: u64, free: u64 },

    #[error(
        "{reference} is being downloaded already (by Baton or `baton models pull`); wait for that \
         download or stop it"
    )]
    Busy { reference: String },

    #[error(
        "the download was stopped with {} of {} on disk; pulling it again resumes from there",
        human_bytes(*have), human_bytes(*size)
    )]
    Cancelled { have: u64, size: u64 },

    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

impl PullError {
    /// A short name for the kind of failure, for scripts (`--json`) and the app.
    pub fn kind(&self) -> &'static str {
        match self {
            PullError::Gated { .. } => "gated",
            PullError::RepoNotFound { .. } | PullError::RevisionNotFound { .. } | PullError::FileNotFound { .. } => {
                "not_found"
            }
            PullError::Unreachable { .. } => "unreachable",
            PullError::Http { .. } | PullError::Protocol { .. } => "hub",
            PullError::Checksum { .. } => "checksum",
            PullError::NoSpace { .. } => "no_space",
            PullError::Busy { .. } => "busy",
            PullError::Cancelled { .. } => "cancelled",
            PullError::Io { .. } => "io",
        }
    }
}

/// Bytes as people read them on the hub: decimal units, three significant figures.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ if value >= 100.0 => format!("{value:.0} {}", UNITS[unit]),
        _ if value >= 10.0 => format!("{value:.1} {}", UNITS[unit]),
        _ => format!("{value:.2} {}", UNITS[unit]),
    }
}

/// The keychain account a hub token is kept under: `huggingface` for the official hub, and
/// `huggingface:<endpoint>` for a mirror, so a token goes only to the host it was saved for.
pub fn token_account(endpoint: &str) -> String {
    let endpoint = endpoint.trim().trim_end_matches('/');
    if endpoint == hub::DEFAULT_ENDPOINT { "huggingface".to_owned() } else { format!("huggingface:{endpoint}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_the_hub_shows_them() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_117_320_736), "1.12 GB");
        assert_eq!(human_bytes(98_000_000), "98.0 MB");
        assert_eq!(human_bytes(4_683_073_888), "4.68 GB");
        assert_eq!(human_bytes(250_000), "250 kB");
    }

    #[test]
    fn a_token_is_kept_for_the_hub_it_was_saved_for() {
        assert_eq!(token_account("https://huggingface.co/"), "huggingface");
        assert_eq!(token_account("https://hf-mirror.com"), "huggingface:https://hf-mirror.com");
    }
}
