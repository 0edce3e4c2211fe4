//! One sandbox as its node holds it: its container, its backend (how its exec and file calls
//! reach it), its agent channel and the per-session state the routes share (fence, shells,
//! ports, function worker).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use config::Template;

use crate::backend::{AgentBackend, Backend, EngineBackend};
use crate::channel::AgentConn;
use crate::runtime::Runtime;

/// One sandbox this node owns and can serve.
pub struct Sandbox {
    pub id: String,
    pub template: Arc<Template>,
    pub container: String,
    /// The agent channel (agent mode), `None` in docker-exec mode.
    pub agent: Option<AgentConn>,
    /// Carries its exec and file calls: the agent's channel, or the runtime's own calls.
    pub(crate) backend: Box<dyn Backend>,
    /// Highest fencing token seen; requests with a lower one are refused.
    pub max_fence: AtomicU64,
    /// Frozen by a pause call. Changed only through `Node::mark_paused`, which keeps the
    /// node's paused counts with it.
    pub paused: AtomicBool,
    /// The session's persistent shells (agent mode).
    pub shells: crate::shells::Shells,
    /// Its open port connections (`ports`).
    pub ports: crate::ports::open::Open,
    /// The function worker when the sandbox is a runtime-mode function's environment.
    pub runtime: crate::functions::Runtime,
    /// Its CPU accounting as last read (`Node::cpu_use`), so each read adds only what is new
    /// to the per-template totals.
    pub cpu_seen: Mutex<crate::runtime::CpuUse>,
}

impl Sandbox {
    /// A sandbox of `template` in `container`, served by its `agent` when it has one, else
    /// by `engine`'s own calls; its lease's fence and its frozen state as known now.
    pub(crate) fn new(
        id: &str,
        template: Arc<Template>,
        container: String,
        agent: Option<AgentConn>,
        engine: Arc<dyn Runtime>,
        fence: u64,
        paused: bool,
    ) -> Sandbox {
        let backend: Box<dyn Backend> = match &agent {
            Some(conn) => Box::new(AgentBackend { id: id.to_string(), conn: conn.clone() }),
            None => Box::new(EngineBackend {
                id: id.to_string(),
                container: container.clone(),
                user: template.user,
                engine,
            }),
        };
        Sandbox {
            id: id.to_string(),
            template,
            container,
            agent,
            backend,
            max_fence: AtomicU64::new(fence),
            paused: AtomicBool::new(paused),
            shells: Default::default(),
            ports: Default::default(),
            runtime: Default::default(),
            cpu_seen: Default::default(),
        }
    }

    /// Accepts `fence` if it is not older than any seen before.
    pub fn admit(&self, fence: u64) -> bool {
        self.max_fence.fetch_max(fence, Ordering::AcqRel) <= fence
    }
}
