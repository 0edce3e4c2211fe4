//! `sandpool`: one binary for every role. `up` runs a whole single-node platform in one
//! process; `gateway` and `pool-manager` run one role each; `token` mints a dev JWT; `quota`
//! reads and sets tenants' quotas; `sessions`, `exec`, `shell`, `cp` and `fn` talk to a gateway;
//! `images convert` publishes a lazy image.

mod client;
mod functions_cli;
mod images_cli;
mod quota;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use config::{Config, Overrides};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "sandpool", version, about = "Pooled sandboxes for agentic RL")]
struct Cli {
    /// Config file (TOML).
    #[arg(long, global = true, env = "SANDPOOL_CONFIG", default_value = config::DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    #[arg(long, global = true, env = "SANDPOOL_REDIS_URL")]
    redis_url: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_REDIS_PREFIX")]
    redis_prefix: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_DOCKER_SOCKET")]
    docker_socket: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_GATEWAY_LISTEN")]
    gateway_listen: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_POOL_MANAGER_LISTEN")]
    pool_manager_listen: Option<String>,
    /// URL gateways use to reach this node's pool-manager.
    #[arg(long, global = true, env = "SANDPOOL_POOL_MANAGER_ADVERTISE")]
    pool_manager_advertise: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_NODE_ID")]
    node_id: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_JWT_KEY", hide_env_values = true)]
    jwt_key: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_JWT_ALGORITHM")]
    jwt_algorithm: Option<String>,
    #[arg(long, global = true, env = "SANDPOOL_INTERNAL_SECRET", hide_env_values = true)]
    internal_secret: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Gateway, autoscaler and pool-manager(s) in one process (one machine), until Ctrl-C /
    /// SIGTERM.
    Up {
        /// Pool-managers to run, each a node of its own (ids `<id>-1`..`<id>-N`, internal
        /// listeners on consecutive ports, their own container labels) on one Docker engine:
        /// many nodes on one machine, for tests and demos.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
        nodes: u16,
    },
    /// The public API alone.
    Gateway,
    /// The node agent alone.
    PoolManager,
    /// The autoscaler alone (one per deployment is enough; more do no harm).
    Autoscaler,
    /// Print a JWT signed with the configured key.
    Token {
        /// The principal: a path such as `acme` or `acme/rl/ppo-7`.
        #[arg(long, default_value = "dev")]
        tenant: String,
        /// Grant the admin scope.
        #[arg(long)]
        admin: bool,
        /// Lifetime, e.g. "1h", "7d".
        #[arg(long, default_value = "24h")]
        ttl: humantime::Duration,
    },
    /// Quotas of principal paths: get, set, rm, verify.
    Quota {
        #[command(subcommand)]
        op: quota::QuotaOp,
    },
    /// Sessions on a gateway: create, get, rm.
    Sessions {
        #[command(flatten)]
        remote: client::Remote,
        #[command(subcommand)]
        op: client::SessionsOp,
    },
    /// Runs a command in a session; its output and exit code are this command's.
    Exec {
        #[command(flatten)]
        remote: client::Remote,
        session: String,
        /// Environment, `KEY=VALUE` (repeatable).
        #[arg(long = "env", value_parser = client::key_value)]
        env: Vec<(String, String)>,
        #[arg(long)]
        cwd: Option<String>,
        /// Seconds (default 300).
        #[arg(long)]
        timeout: Option<f64>,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// An interactive terminal in a session (a shell unless a command follows `--`); its exit
    /// code is this command's.
    Shell {
        #[command(flatten)]
        remote: client::Remote,
        session: String,
        #[arg(last = true)]
        cmd: Vec<String>,
    },
    /// Copies a file into or out of a session: `SESSION:PATH` on one side, a local path or
    /// `-` (stdin/stdout) on the other.
    Cp {
        #[command(flatten)]
        remote: client::Remote,
        src: String,
        dst: String,
    },
    /// Files in a session: exists, rm, mv, mkdir (`cp` moves contents in and out).
    Fs {
        #[command(flatten)]
        remote: client::Remote,
        #[command(subcommand)]
        op: client::FsOp,
    },
    /// Functions on a gateway: deploy, invoke, map, result, ls, get, rm.
    #[command(name = "fn")]
    Functions {
        #[command(flatten)]
        remote: client::Remote,
        #[command(subcommand)]
        op: functions_cli::FnOp,
    },
    /// Print the metric catalog as a markdown table (the README's metrics list).
    Metrics,
    /// The configuration: `check` validates it and prints it as it takes effect.
    Config {
        #[command(subcommand)]
        op: ConfigOp,
    },
    /// Lazy images: `convert` publishes a registry image in the lazy (EROFS) form.
    Images {
        #[command(subcommand)]
        op: images_cli::ImagesOp,
    },
}

#[derive(Subcommand)]
enum ConfigOp {
    /// Validates the config (file, then `SANDPOOL__SECTION__KEY` variables, then flags) and
    /// prints the effective config, defaults included and secrets hidden; exit code 2 and the
    /// field at fault when it is invalid.
    Check,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Command::Metrics = cli.command {
        print!("{}", telemetry::metrics::catalog_markdown());
        return std::process::ExitCode::SUCCESS;
    }
    if let Command::Images { op } = cli.command {
        return images_cli::run(op);
    }
    if matches!(
        cli.command,
        Command::Sessions { .. }
            | Command::Exec { .. }
            | Command::Cp { .. }
            | Command::Fs { .. }
            | Command::Shell { .. }
            | Command::Functions { .. }
    ) {
        return user_command(cli.command);
    }
    let overrides = Overrides {
        redis_url: cli.redis_url,
        redis_prefix: cli.redis_prefix,
        docker_socket: cli.docker_socket,
        gateway_listen: cli.gateway_listen,
        pool_manager_listen: cli.pool_manager_listen,
        pool_manager_advertise: cli.pool_manager_advertise,
        node_id: cli.node_id,
        jwt_key: cli.jwt_key,
        jwt_algorithm: cli.jwt_algorithm,
        internal_secret: cli.internal_secret,
    };
    let config = match Config::load(&cli.config, &overrides) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("sandpool: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Command::Config { op: ConfigOp::Check } = &cli.command {
        let mut from_env: Vec<String> = std::env::vars_os()
            .filter(|(k, v)| !v.is_empty() && k.to_string_lossy().starts_with(config::env::PREFIX))
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        from_env.sort();
        println!("# {}: valid", cli.config.display());
        if !from_env.is_empty() {
            println!("# from the environment: {}", from_env.join(", "));
        }
        println!("{:#?}", config.redacted());
        return std::process::ExitCode::SUCCESS;
    }
    if let Command::Token { tenant, admin, ttl } = &cli.command {
        if let Some(problem) = wire::quotas::path_problem(tenant) {
            eprintln!("sandpool: --tenant {tenant:?} is not a principal path: {problem}");
            return std::process::ExitCode::from(2);
        }
        return match gateway::mint(&config.auth, tenant, *admin, (*ttl).into()) {
            Ok(t) => {
                println!("{t}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("sandpool: mint token: {e:#}");
                std::process::ExitCode::from(2)
            }
        };
    }
    // Logs, and traces when an OTLP endpoint is configured; the guard flushes the spans still
    // buffered when `main` returns (declared before the runtime, so dropped after it).
    let log_format = match config.log.format {
        config::LogFormat::Text => telemetry::trace::LogFormat::Text,
        config::LogFormat::Json => telemetry::trace::LogFormat::Json,
    };
    let _traces =
        telemetry::trace::init(service_name(&cli.command), config.telemetry.otlp_endpoint.as_deref(), log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandpool: start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Command::Quota { op } = cli.command {
        return match rt.block_on(quota::run(&config, op)) {
            Ok(true) => std::process::ExitCode::SUCCESS,
            Ok(false) => std::process::ExitCode::FAILURE,
            Err(e) => {
                eprintln!("sandpool: {e:#}");
                std::process::ExitCode::from(2)
            }
        };
    }
    match rt.block_on(run(config, cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A command that talks to a gateway: no config, no logs, its own exit code.
fn user_command(command: Command) -> std::process::ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandpool: start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async move {
        match command {
            Command::Sessions { remote, op } => client::sessions(remote, op).await,
            Command::Exec { remote, session, env, cwd, timeout, cmd } => {
                client::exec(remote, session, cmd, env, cwd, timeout).await
            }
            Command::Cp { remote, src, dst } => client::cp(remote, src, dst).await,
            Command::Fs { remote, op } => client::fs(remote, op).await,
            Command::Shell { remote, session, cmd } => client::shell(remote, session, cmd).await,
            Command::Functions { remote, op } => functions_cli::run(remote, op).await,
            _ => unreachable!("only user commands come here"),
        }
    });
    r.unwrap_or_else(|e| {
        eprintln!("sandpool: {e:#}");
        std::process::ExitCode::FAILURE
    })
}

/// The OpenTelemetry `service.name` of a role (`OTEL_SERVICE_NAME` overrides it).
fn service_name(command: &Command) -> &'static str {
    match command {
        Command::Gateway => "sandpool-gateway",
        Command::PoolManager => "sandpool-pool-manager",
        Command::Autoscaler => "sandpool-autoscaler",
        Command::Up { .. }
        | Command::Token { .. }
        | Command::Quota { .. }
        | Command::Metrics
        | Command::Config { .. }
        | Command::Sessions { .. }
        | Command::Exec { .. }
        | Command::Cp { .. }
        | Command::Fs { .. }
        | Command::Shell { .. }
        | Command::Functions { .. }
        | Command::Images { .. } => "sandpool",
    }
}

async fn run(config: Arc<Config>, command: Command) -> anyhow::Result<()> {
    // Two stages, so shutdown is ordered: the gateway drains first (readiness fails, the
    // listener closes, in-flight requests and sockets finish), and only then do the
    // autoscaler and the pool-manager stop, so a request in flight still finds its node.
    let front = CancellationToken::new();
    let back = CancellationToken::new();
    // One metrics endpoint per process, for every role in it; it stops last. The recorder is
    // installed before any role starts, so nothing they record is lost.
    let metrics_stop = CancellationToken::new();
    let metrics = match config.telemetry.metrics_listen {
        Some(listen) => Some(telemetry::metrics::serve(listen, metrics_stop.clone()).await?.1),
        None => None,
    };
    let (mut pms, mut gw, mut scaler) = (Vec::new(), None, None);
    match command {
        Command::Up { nodes } => {
            for node in node_configs(&config, nodes).await? {
                pms.push(pool_manager::start(node, back.clone()).await?);
            }
            gw = Some(gateway::start(config.clone(), None, front.clone()).await?);
            scaler = Some(autoscaler::live::start(config.clone(), back.clone()).await?);
        }
        Command::Gateway => gw = Some(gateway::start(config.clone(), None, front.clone()).await?),
        Command::PoolManager => pms.push(pool_manager::start(config.clone(), back.clone()).await?),
        Command::Autoscaler => scaler = Some(autoscaler::live::start(config.clone(), back.clone()).await?),
        Command::Token { .. }
        | Command::Quota { .. }
        | Command::Metrics
        | Command::Config { .. }
        | Command::Sessions { .. }
        | Command::Exec { .. }
        | Command::Cp { .. }
        | Command::Fs { .. }
        | Command::Shell { .. }
        | Command::Functions { .. }
        | Command::Images { .. } => return Ok(()),
    }
    shutdown_signal().await.context("wait for shutdown signal")?;
    tracing::info!("shutting down: draining the gateway");
    front.cancel();
    if let Some(gw) = gw {
        // The gateway bounds its own drain (drain_grace + drain_timeout); this is a backstop.
        let bound = config.gateway.drain_grace + config.gateway.drain_timeout + Duration::from_secs(5);
        if tokio::time::timeout(bound, gw.wait()).await.is_err() {
            tracing::warn!(?bound, "the gateway did not drain in time; stopping the rest anyway");
        }
    }
    tracing::info!("shutting down: stopping the autoscaler and the pool-manager");
    back.cancel();
    let rest = async {
        if let Some(s) = scaler {
            s.wait().await;
        }
        for pm in pms {
            pm.wait().await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(20), rest).await.is_err() {
        tracing::warn!("shutdown did not finish within 20s; exiting anyway");
    }
    metrics_stop.cancel();
    if let Some(m) = metrics {
        let _ = tokio::time::timeout(Duration::from_secs(2), m).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// The config of each of `n` nodes of `sandpool up --nodes n`: one node is the config as it
/// is; more get ids `<id>-<i>` (the id given, or the host's) and internal listeners on
/// consecutive ports from the configured one (an advertised address follows its listener).
async fn node_configs(config: &Arc<Config>, n: u16) -> anyhow::Result<Vec<Arc<Config>>> {
    if n == 1 {
        return Ok(vec![config.clone()]);
    }
    let base = pool_manager::node_id(config).await?;
    let listen = config.pool_manager.listen;
    let mut out = Vec::new();
    for i in 1..=n {
        let mut c = (**config).clone();
        c.node.id = Some(format!("{}-{i}", &base[..base.len().min(29)]));
        if listen.port() != 0 {
            let port = listen.port().checked_add(i - 1).context("pool_manager.listen: no room for the nodes' ports")?;
            c.pool_manager.listen.set_port(port);
            let suffix = format!(":{}", listen.port());
            if let Some(host) = config.pool_manager.advertise.strip_suffix(&suffix) {
                c.pool_manager.advertise = format!("{host}:{port}");
            }
        }
        out.push(Arc::new(c));
    }
    Ok(out)
}

async fn shutdown_signal() -> std::io::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r,
        _ = term.recv() => Ok(()),
    }
}
