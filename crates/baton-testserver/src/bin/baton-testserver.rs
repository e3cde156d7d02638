//! Serves the OpenAI, Anthropic and Gemini wire formats on loopback, for demos and for tests
//! that drive the `baton` binary from outside.

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Require this API key in each wire's auth header.
    #[arg(long, env = "BATON_TESTSERVER_KEY")]
    key: Option<String>,
    /// Append every request (path, headers, body) to this file as JSON lines.
    #[arg(long)]
    log: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = baton_testserver::TestServer::start_with(baton_testserver::Options {
        key: args.key,
        port: args.port,
        log: args.log,
    })
    .await
    .context("could not bind 127.0.0.1")?;
    // The first line of stdout is the address, for scripts that start the server.
    println!("listening on http://{}", server.addr());
    server.serve_forever().await;
    Ok(())
}
