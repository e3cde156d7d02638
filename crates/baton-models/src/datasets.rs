//! Evaluation sets from the Hugging Face hub, read through its dataset viewer API
//! (`datasets-server`): `GET /splits?dataset=` lists a dataset's configs and splits, and
//! `GET /rows?dataset=&config=&split=&offset=&length=` pages through a split's rows as JSON,
//! at most 100 a page. The standard sets are stored on the hub as Parquet; the viewer serves
//! them as JSON, so no Parquet reader is needed. The token is the hub's (`HF_TOKEN`, or the
//! one stored for it), for gated sets.

use std::time::Duration;

use serde::Deserialize;

/// The viewer's official address; `$HF_DATASETS_SERVER` names another (a mirror, or a test).
pub const DEFAULT_DATASETS_SERVER: &str = "https://datasets-server.huggingface.co";

/// Rows per page: the most the viewer serves at once.
const PAGE: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error(
        "the dataset {dataset} was not found on {server}, or it is gated or private{}: check its name on the hub; for a gated one accept its terms on its page, then set HF_TOKEN (or `baton keys set huggingface`){}",
        if *had_token { " and the token given has no access" } else { "" },
        message.as_deref().map(|m| format!(" (the server said: {m})")).unwrap_or_default()
    )]
    NotFound { dataset: String, server: String, had_token: bool, message: Option<String> },
    #[error("{dataset} has no split {config}/{split}; it has: {available}")]
    NoSuchSplit { dataset: String, config: String, split: String, available: String },
    #[error("{dataset} has several configs ({available}): name one, as {dataset}:CONFIG[:SPLIT]")]
    WhichConfig { dataset: String, available: String },
    #[error("{dataset}: {what}, so it cannot be used whole; download the split yourself and pass it as a JSONL suite")]
    Incomplete { dataset: String, what: String },
    #[error("cannot reach {server}: {message}; check the connection (HF_DATASETS_SERVER names another server)")]
    Unreachable { server: String, message: String },
    #[error("{server} answered {status} for {what}: {message}")]
    Server { server: String, status: u16, what: String, message: String },
}

/// The dataset viewer, with the hub's token.
#[derive(Clone)]
pub struct DatasetsServer {
    server: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl std::fmt::Debug for DatasetsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetsServer").field("server", &self.server).field("token", &self.token.is_some()).finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitName {
    pub config: String,
    pub split: String,
}

#[derive(Deserialize)]
struct Splits {
    splits: Vec<SplitRow>,
}

#[derive(Deserialize)]
struct SplitRow {
    config: String,
    split: String,
}

#[derive(Deserialize)]
struct Rows {
    rows: Vec<RowEntry>,
    num_rows_total: usize,
    /// The viewer converted only part of the split (a very large one).
    #[serde(default)]
    partial: bool,
}

#[derive(Deserialize)]
struct RowEntry {
    row: serde_json::Value,
    /// Cells the viewer cut short (too long to serve whole).
    #[serde(default)]
    truncated_cells: Vec<String>,
}

impl DatasetsServer {
    pub fn new(server: &str, token: Option<String>) -> DatasetsServer {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(15))
            .timeout(Duration::from_secs(60))
            .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        let token = token.filter(|t| !t.trim().is_empty()).map(|t| t.trim().to_owned());
        DatasetsServer { server: server.trim().trim_end_matches('/').to_owned(), token, http }
    }

    /// `$HF_DATASETS_SERVER` (else the official viewer), with `$HF_TOKEN` (or
    /// `$HUGGING_FACE_HUB_TOKEN`) when set, as the hub's downloads take it. A token stored in
    /// the keychain belongs to the hub it was saved for, so `keychain_token(hub)` is asked for
    /// the official hub's only, and only when the viewer is the official one too: a mirror's
    /// token never goes to huggingface.co, nor the official one to another viewer.
    pub fn from_env(keychain_token: impl FnOnce(&str) -> Option<String>) -> DatasetsServer {
        let server = std::env::var("HF_DATASETS_SERVER").ok().filter(|e| !e.trim().is_empty());
        let server = server.as_deref().unwrap_or(DEFAULT_DATASETS_SERVER).trim().trim_end_matches('/').to_owned();
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.trim().is_empty());
        let official_hub =
            endpoint.as_deref().is_none_or(|e| e.trim().trim_end_matches('/') == crate::hub::DEFAULT_ENDPOINT);
        let token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|t| !t.trim().is_empty()))
            .or_else(|| {
                (official_hub && server == DEFAULT_DATASETS_SERVER)
                    .then(|| keychain_token(crate::hub::DEFAULT_ENDPOINT))
                    .flatten()
            });
        DatasetsServer::new(&server, token)
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    /// A dataset's configs and splits.
    pub async fn splits(&self, dataset: &str) -> Result<Vec<SplitName>, DatasetError> {
        let splits: Splits = self.get(dataset, "/splits", &[("dataset", dataset)], "its splits").await?;
        Ok(splits.splits.into_iter().map(|s| SplitName { config: s.config, split: s.split }).collect())
    }

    /// Which split `config`/`split` mean: when left out, the only config (or `default`), and
    /// `test`, else the only split.
    pub async fn choose(
        &self,
        dataset: &str,
        config: Option<&str>,
        split: Option<&str>,
    ) -> Result<SplitName, DatasetError> {
        let all = self.splits(dataset).await?;
        let mut configs: Vec<&str> = all.iter().map(|s| s.config.as_str()).collect();
        configs.sort_unstable();
        configs.dedup();
        let config = match config {
            Some(c) => c.to_owned(),
            None if configs.len() == 1 => configs[0].to_owned(),
            None if configs.contains(&"default") => "default".to_owned(),
            None => {
                return Err(DatasetError::WhichConfig { dataset: dataset.to_owned(), available: configs.join(", ") });
            }
        };
        let of_config: Vec<&SplitName> = all.iter().filter(|s| s.config == config).collect();
        let chosen = match split {
            Some(s) => of_config.iter().find(|n| n.split == s),
            None => of_config.iter().find(|n| n.split == "test").or(if of_config.len() == 1 {
                of_config.first()
            } else {
                None
            }),
        };
        chosen.map(|s| (*s).clone()).ok_or_else(|| DatasetError::NoSuchSplit {
            dataset: dataset.to_owned(),
            config,
            split: split.unwrap_or("test").to_owned(),
            available: all.iter().map(|s| format!("{}/{}", s.config, s.split)).collect::<Vec<_>>().join(", "),
        })
    }

    /// Every row of a split, in order; `progress(rows so far, total)` after each page.
    pub async fn rows(
        &self,
        dataset: &str,
        split: &SplitName,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Vec<serde_json::Value>, DatasetError> {
        let mut rows = Vec::new();
        loop {
            let offset = rows.len().to_string();
            let length = PAGE.to_string();
            let query = [
                ("dataset", dataset),
                ("config", split.config.as_str()),
                ("split", split.split.as_str()),
                ("offset", offset.as_str()),
                ("length", length.as_str()),
            ];
            let page: Rows = self.get(dataset, "/rows", &query, "its rows").await?;
            // A suite must hold the items whole: a cut test or question scores nonsense.
            if page.partial {
                return Err(DatasetError::Incomplete {
                    dataset: dataset.to_owned(),
                    what: format!("the viewer serves only part of {}/{}", split.config, split.split),
                });
            }
            if let Some((i, cut)) = page.rows.iter().enumerate().find(|(_, r)| !r.truncated_cells.is_empty()) {
                return Err(DatasetError::Incomplete {
                    dataset: dataset.to_owned(),
                    what: format!("row {} has cells cut short ({})", rows.len() + i, cut.truncated_cells.join(", ")),
                });
            }
            let got = page.rows.len();
            rows.extend(page.rows.into_iter().map(|r| r.row));
            progress(rows.len(), page.num_rows_total);
            if got == 0 || rows.len() >= page.num_rows_total {
                return Ok(rows);
            }
        }
    }

    /// A GET of the viewer's JSON, retried on the errors a busy server gives (429, 5xx) and on
    /// a dropped connection, three times with a growing pause.
    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        dataset: &str,
        path: &str,
        query: &[(&str, &str)],
        what: &str,
    ) -> Result<T, DatasetError> {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.server), query).map_err(|e| {
            DatasetError::Unreachable { server: self.server.clone(), message: format!("not an address: {e}") }
        })?;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let mut request = self.http.get(url.clone());
            if let Some(token) = &self.token {
                request = request.bearer_auth(token);
            }
            let retry = attempt < 4;
            let pause = Duration::from_millis(250 * u64::from(attempt * attempt));
            let response = match request.send().await {
                Ok(r) => r,
                Err(e) if retry => {
                    tracing::debug!("{url}: {e}; retrying");
                    tokio::time::sleep(pause).await;
                    continue;
                }
                Err(e) => {
                    return Err(DatasetError::Unreachable { server: self.server.clone(), message: e.to_string() });
                }
            };
            let status = response.status();
            if status.is_success() {
                return response.json::<T>().await.map_err(|e| DatasetError::Server {
                    server: self.server.clone(),
                    status: status.as_u16(),
                    what: format!("{dataset} ({what})"),
                    message: format!("not the dataset viewer's JSON: {e}"),
                });
            }
            if retry && (status.as_u16() == 429 || status.is_server_error()) {
                tokio::time::sleep(pause).await;
                continue;
            }
            // The viewer's errors are `{"error": "..."}`.
            let body = response.text().await.unwrap_or_default();
            let message = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .or_else(|| (!body.trim().is_empty()).then(|| body.trim().chars().take(300).collect()));
            return Err(match status.as_u16() {
                401 | 403 | 404 => DatasetError::NotFound {
                    dataset: dataset.to_owned(),
                    server: self.server.clone(),
                    had_token: self.token.is_some(),
                    message,
                },
                code => DatasetError::Server {
                    server: self.server.clone(),
                    status: code,
                    what: format!("{dataset} ({what})"),
                    message: message.unwrap_or_default(),
                },
            });
        }
    }
}
