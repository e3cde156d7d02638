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
    /// Also serve a Hugging Face hub on loopback: every file under DIR/OWNER/NAME/ becomes
    /// OWNER/NAME:FILE (as an LFS file, behind a separate file host).
    #[arg(long, value_name = "DIR")]
    hub_dir: Option<std::path::PathBuf>,
    /// The hub's port (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    hub_port: u16,
    /// Pause before each 64 KiB chunk of a hub download, in milliseconds (to watch progress).
    #[arg(long, default_value_t = 0)]
    hub_chunk_delay_ms: u64,
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
    let hub = match &args.hub_dir {
        Some(dir) => {
            let options = baton_testserver::hub::HubOptions {
                chunk_delay: std::time::Duration::from_millis(args.hub_chunk_delay_ms),
                ..Default::default()
            };
            let hub = baton_testserver::hub::TestHub::start_on(args.hub_port, options)
                .await
                .context("could not bind the hub on 127.0.0.1")?;
            let mut served = 0;
            for owner in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
                let owner = owner?.path();
                for repo in std::fs::read_dir(&owner).into_iter().flatten() {
                    let repo = repo?.path();
                    for file in std::fs::read_dir(&repo).into_iter().flatten() {
                        let file = file?.path();
                        if !file.is_file() {
                            continue;
                        }
                        let name = |p: &std::path::Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
                        let (Some(o), Some(r), Some(f)) = (name(&owner), name(&repo), name(&file)) else { continue };
                        hub.add(&format!("{o}/{r}"), &f, std::fs::read(&file)?);
                        served += 1;
                    }
                }
            }
            println!("hub on {} ({served} files)", hub.endpoint());
            Some(hub)
        }
        None => None,
    };
    match hub {
        Some(hub) => {
            tokio::select! {
                () = server.serve_forever() => {}
                () = hub.serve_forever() => {}
            }
        }
        None => server.serve_forever().await,
    }
    Ok(())
}
