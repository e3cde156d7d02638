//! `baton serve`: the pool as one OpenAI-compatible model on this machine (see `baton-serve`).
//! `baton serve token` prints the token clients send, made once and kept in the keychain.

use baton_runner::LocalModels;
use baton_runner::serve::{self, ServeRequest};
use tokio_util::sync::CancellationToken;

use crate::conductor_setup::Loader;
use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The address to listen on (default: the pool's [serve] host, else 127.0.0.1). Anything
    /// but loopback needs a token.
    #[arg(long)]
    host: Option<String>,
    /// The port (default: the pool's [serve] port, else 8765; 0 picks a free one).
    #[arg(long)]
    port: Option<u16>,
    #[command(flatten)]
    pool: PoolArg,
    #[command(flatten)]
    conductor: crate::conductor_setup::ConductorArgs,
    #[command(flatten)]
    db: crate::history_cmd::DbArg,
    /// Take the token clients must send from this environment variable instead of the keychain.
    #[arg(long, value_name = "VAR", conflicts_with = "no_token")]
    token_env: Option<String>,
    /// Accept requests without a token: loopback only, and any process of any user on this
    /// machine can then spend your provider keys.
    #[arg(long)]
    no_token: bool,
    /// Let a web client at this origin (e.g. http://localhost:3000) call the server from a
    /// browser; repeat for more. Without it, requests from web pages are refused.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    allow_origin: Vec<String>,
    /// Runs at once; more requests wait their turn (default: the pool's [serve]
    /// max_concurrent_runs, else 8).
    #[arg(long, value_name = "N")]
    max_concurrent_runs: Option<usize>,
    /// Requests that may wait for a run slot; one more gets 429 with Retry-After (default: the
    /// pool's [serve] max_queued_runs, else 256).
    #[arg(long, value_name = "N")]
    max_queued_runs: Option<usize>,
    /// The most the server spends in a day (UTC), all requests together (default: the pool's
    /// [serve] daily_max_cost_usd, else no cap).
    #[arg(long, value_name = "USD", value_parser = crate::numbers::cost_usd)]
    daily_max_cost_usd: Option<f64>,
    /// Do not record runs in the history.
    #[arg(long)]
    no_history: bool,
    /// Pin the server's worker threads one per core (Linux). Lowers the latency of bursts of
    /// requests on machines whose scheduler keeps threads on one busy core while another is idle
    /// (some VMs); on a desktop shared with other busy programs, leave it off.
    #[arg(long)]
    pub(crate) pin_threads: bool,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Print the token clients send (`Authorization: Bearer TOKEN`), making one the first time.
    Token {
        /// Replace the token with a new one (clients with the old one are refused).
        #[arg(long)]
        new: bool,
    },
}

/// A token failure: a variable the user must set is bad input; a keychain failure is not.
fn token_failure(e: baton_serve::TokenError) -> Failure {
    match e {
        baton_serve::TokenError::VariableUnset(_) | baton_serve::TokenError::FromVariable(_) => {
            Failure::BadInput(e.to_string())
        }
        _ => Failure::Failed(e.to_string()),
    }
}

pub async fn run(args: Args) -> Outcome {
    if let Some(Command::Token { new }) = args.command {
        // Always the keychain's: a token from a variable is the user's own to print.
        println!("{}", baton_serve::token(None, new).map_err(token_failure)?);
        return Ok(());
    }
    // An unsafe bind is refused before anything loads (and again once the pool has its say).
    if let Some(host) = &args.host {
        baton_serve::guard::check_bind(host, !args.no_token).map_err(Failure::BadInput)?;
    }
    let pool = args.pool.load()?;
    let request = ServeRequest {
        host: args.host.clone(),
        port: args.port,
        token_env: args.token_env.clone(),
        no_token: args.no_token,
        allow_origins: args.allow_origin.clone(),
        max_concurrent_runs: args.max_concurrent_runs,
        max_queued_runs: args.max_queued_runs,
        daily_max_cost_usd: args.daily_max_cost_usd,
    };
    if args.no_token {
        eprintln!(
            "warning: no token: any program of any user on this machine can use this server and spend your provider keys"
        );
    }
    let token_from = serve::token_source(&pool.options.serve, &request);
    let store = if args.no_history { None } else { Some(args.db.open().await?) };
    let io = crate::io::Io::terminal();
    let loader = Loader::new(&args.conductor, false, &io);
    let models = LocalModels::default();
    let serving = serve::start(pool.clone(), store.as_ref(), &request, loader.context(&pool, &models)).await?;
    eprintln!("serving on {} as {}", serving.url, serving.service.model_ids().join(", "));
    if let Some(warning) = &serving.warning {
        eprintln!("{warning}");
    }
    if !serving.answers_as_pool {
        eprintln!("the pool names no conductor: only the workers alone are served (baton/<worker>)");
    } else if !serving.conductor {
        eprintln!(
            "the pool names no conductor: `baton` sends each question to one worker, without a plan (route = \"always\")"
        );
    }
    if !args.no_token {
        eprintln!("clients send Authorization: Bearer TOKEN (from {token_from}); Ctrl-C stops");
    }
    let shutdown = CancellationToken::new();
    let ctrl_c = crate::cancel_on_ctrl_c(&shutdown);
    let served = baton_serve::serve(serving.listener, serving.service, shutdown).await;
    ctrl_c.abort();
    if let Some(store) = &store {
        store.close().await;
    }
    served.map_err(|e| Failure::Failed(format!("the server stopped: {e}")))
}
