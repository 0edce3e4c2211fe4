//! Creating a sandbox: its container, its agent channel and the watcher that fails it when
//! the channel is lost.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use config::{Template, User};
use ledger::GoneReason;
use wire::ExecMode;

use super::{AGENT_READY_TIMEOUT, CreateError, Leftover, Node, PULL_FAILED, random_hex_id};
use crate::channel::AgentConn;
use crate::runtime::DockerExec;
use crate::sandbox::Sandbox;

/// How long a new sandbox's agent has to open its direct channel (it binds the socket right
/// after its start) before the attach stream serves instead.
const DIRECT_CONNECT_WAIT: Duration = Duration::from_secs(2);
/// How long a new sandbox's warm-up command may take.
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long giving a docker-exec sandbox's workdir to its user may take.
const DOCKER_CHOWN_TIMEOUT: Duration = Duration::from_secs(10);

impl Node {
    /// Creates, starts and readies one sandbox (state `creating` in the ledger). On failure
    /// nothing is left behind.
    pub(crate) async fn create_sandbox(
        self: &Arc<Self>,
        template: &Arc<Template>,
    ) -> Result<Arc<Sandbox>, CreateError> {
        let id = random_hex_id(&self.id, 6);
        tracing::Span::current().record("sandbox", id.as_str());
        self.ledger.sandbox_add(&self.id, &id, &template.name).await?;
        match self.start_container(&id, template).await {
            Ok(sb) => {
                self.insert(sb.clone());
                Ok(sb)
            }
            Err((container, e)) => {
                self.agent_files.remove_run_dir(&id);
                let left = Leftover { sandbox: id, container, forget: Some(GoneReason::CreateFailed) };
                self.finish_or_retry(left).await;
                Err(CreateError::Failed(e))
            }
        }
    }

    async fn start_container(
        self: &Arc<Self>,
        id: &str,
        template: &Arc<Template>,
    ) -> Result<Arc<Sandbox>, (Option<String>, anyhow::Error)> {
        let agent_mode = template.exec == ExecMode::Agent;
        // A template made from an image: the node pulls it on first need (the pull counts
        // toward the create, and so toward the waiting request's time).
        if crate::images::is_pulled(&template.image) {
            self.images
                .ensure(&template.image)
                .await
                .map_err(|e| (None, anyhow::anyhow!("{PULL_FAILED}{}", e.reason)))?;
        }
        let container =
            self.engine.create(id, template, agent_mode.then_some(&self.agent_files)).await.map_err(|e| (None, e))?;
        let fail = |e: anyhow::Error| (Some(container.clone()), e);
        self.ledger.sandbox_set_container(&self.id, id, &container).await.map_err(|e| fail(e.into()))?;
        let join_egress = || async {
            let initial = template.egress.as_ref().map(|e| e.initial.clone());
            self.join_egress(id, &container, template, initial).await.context("join the egress network").map_err(fail)
        };
        let agent = if agent_mode {
            // Attach before start so nothing the agent says is lost.
            let attached = self.engine.attach(&container).await.map_err(fail)?;
            self.engine.start(&container).await.map_err(fail)?;
            join_egress().await?;
            // The direct channel when the agent serves one (dropping the attach: Docker keeps
            // the agent's stdin open and discards what it writes, log driver `none`).
            let direct = match self.engine.direct_channel(template) {
                true => crate::channel::Link::connect_socket(&self.agent_files.run_dir(id), DIRECT_CONNECT_WAIT).await,
                false => None,
            };
            if direct.is_some() {
                // Before any tenant code runs: from now on the sandbox cannot touch the directory.
                self.agent_files.seal_run_dir(id).context("seal the agent's socket directory").map_err(fail)?;
            }
            let conn = self.watch(id, direct.unwrap_or(attached));
            conn.ping(AGENT_READY_TIMEOUT).await.map_err(|e| fail(anyhow::anyhow!("agent not ready: {e}")))?;
            warm_up(&conn).await;
            Some(conn)
        } else {
            self.engine.start(&container).await.map_err(fail)?;
            join_egress().await?;
            self.give_workdir(&container, template).await.map_err(fail)?;
            None
        };
        Ok(Arc::new(Sandbox::new(id, template.clone(), container, agent, self.engine.clone(), 0, false)))
    }

    /// A docker-exec sandbox of a non-root template: its user gets the workdir (Docker creates
    /// it as root). The agent does the same for itself at start.
    async fn give_workdir(&self, container: &str, template: &Template) -> anyhow::Result<()> {
        // Never a path the platform mounts (the config and the envelope refuse those already).
        if template.user == User::Root || agent_proto::layout::workdir_problem(&template.workdir).is_some() {
            return Ok(());
        }
        let argv = ["chown", &template.user.spec(), &template.workdir].map(String::from).to_vec();
        let req = DockerExec {
            argv,
            user: None,
            env: vec![],
            cwd: None,
            stdin: None,
            timeout: DOCKER_CHOWN_TIMEOUT,
            max_output: 4096,
        };
        let out = self.engine.exec(container, req).await?;
        anyhow::ensure!(
            out.exit_code == 0,
            "chown {}: {}",
            template.workdir,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }

    /// Starts the agent channel and a watcher that fails the sandbox if the channel is lost.
    pub(super) fn watch(self: &Arc<Self>, id: &str, attached: crate::channel::Link) -> AgentConn {
        let (conn, lost) = AgentConn::start(id, attached, &self.tracker, self.cancel.child_token());
        let node = self.clone();
        let id = id.to_string();
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = lost.cancelled() => node.channel_lost(&id).await,
            }
        });
        conn
    }

    /// The agent channel of a sandbox broke: the sandbox is failed, forgotten and replaced.
    async fn channel_lost(&self, id: &str) {
        // A sandbox we are destroying on purpose is no longer in the map.
        if self.sandbox(id).is_none() {
            return;
        }
        tracing::warn!(sandbox = %id, "agent channel lost; failing the sandbox");
        self.destroy(id, GoneReason::SandboxFailed).await;
    }
}

/// Runs the shell once in a new sandbox (`/bin/sh -c :`), so its binary is in the sandbox's
/// page cache before a tenant's first command: on a btrfs data root (disk bounds on a kernel
/// without XFS quotas) containers do not share the page cache of their image's files, and the
/// first command of each sandbox would read its binary through the loop device (about 3 ms).
/// Every shell-string command starts with this binary (with busybox images, every applet is
/// it). An image without `/bin/sh` simply gains nothing.
async fn warm_up(conn: &AgentConn) {
    let spec = agent_proto::ExecSpec {
        argv: ["/bin/sh", "-c", ":"].map(String::from).to_vec(),
        timeout_ms: WARM_UP_TIMEOUT.as_millis() as u64,
        max_output: 4096,
        ..Default::default()
    };
    if let Err(e) = conn.exec(spec, None, WARM_UP_TIMEOUT).await {
        tracing::debug!(error = %e, "warm-up command");
    }
}
