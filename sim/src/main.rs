//! replica-sim: serves N simulated vLLM-style replicas from one process.

mod api;
mod cli;
mod engine;
mod fault;
mod hash;
mod kv;
mod messages;
mod metrics;
mod metrics_fault;
mod openai;
mod preset;
mod replica;
mod responses;
mod template;
mod tokenizer;

use std::io::Write;
use std::process::ExitCode;

use axum::serve::ListenerExt;
use clap::Parser;
use tokio::net::TcpListener;

use crate::cli::Cli;
use crate::replica::{Replica, Settings};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let checked = cli
        .validate_metrics_fault()
        .and_then(|()| cli.engine_config())
        .and_then(|c| {
            (0..cli.replicas).try_for_each(|i| cli.replica_config(&c, i).map(drop))?;
            Ok(c)
        });
    let cfg = match checked {
        Ok(c) => c,
        Err(e) => {
            eprintln!("replica-sim: {e}");
            return ExitCode::from(2);
        }
    };
    let settings = Settings {
        cfg,
        model: cli.model.clone(),
        loras: cli.lora.iter().filter(|l| !l.is_empty()).cloned().collect(),
        default_max_tokens: cli.default_max_tokens.max(1),
        fail_rate: cli.fail_rate,
        slow_ms: cli.slow_ms,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("replica-sim: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(&cli, settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replica-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Binds every replica first (so a port clash fails fast), announces each
/// on stdout, then serves until a server fails.
async fn serve(cli: &Cli, settings: Settings) -> std::io::Result<()> {
    let mut servers = tokio::task::JoinSet::new();
    for i in 0..cli.replicas {
        let port = match cli.port {
            0 => 0,
            p => p
                .checked_add(i)
                .ok_or_else(|| std::io::Error::other("port range overflows 65535"))?,
        };
        let listener = TcpListener::bind((cli.host.as_str(), port))
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("bind {}:{port}: {e}", cli.host)))?;
        let addr = listener.local_addr()?;
        let mut own = settings.clone();
        own.cfg = cli
            .replica_config(&settings.cfg, i)
            .map_err(std::io::Error::other)?;
        let replica = Replica::start(addr, own, cli.metrics_fault_for(i));
        let app = api::router(replica);
        // TCP_NODELAY like uvicorn (vLLM, SGLang) does: without it small SSE
        // writes meet delayed ACKs and TTFT gains a spurious 40 ms.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        servers.spawn(async move { axum::serve(listener, app).await });
        println!("replica-sim listening on {addr}");
        // Tests and scripts wait for these lines; a pipe would buffer them.
        std::io::stdout().flush()?;
    }
    match servers.join_next().await {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(std::io::Error::other(e)),
        None => Ok(()),
    }
}
