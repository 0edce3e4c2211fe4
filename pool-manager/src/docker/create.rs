//! A hardened sandbox container: its create, and what decides its shape (the disk bound
//! probe, the image's declared volumes, the node's labels and names).

use std::collections::HashMap;
use std::path::PathBuf;

use agent_proto::layout::SHIM_GROUP_ENV;
use anyhow::Context as _;
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig};
use bollard::query_parameters::CreateContainerOptionsBuilder;
use config::{Template, User};
use wire::Network;

use super::*;
use crate::disk::{DiskSupport, ETC_FILES, SANDBOX_HOSTNAME};

impl Dock {
    /// This client with sandboxes mounting their `/etc` network files read-only from `dir`.
    pub fn with_sandbox_etc(self, dir: PathBuf) -> Dock {
        Dock { etc_dir: Some(dir), ..self }
    }

    /// Whether this engine bounds a container's writable layer (`StorageOpt size`: overlay2 on
    /// XFS mounted with `pquota`, btrfs with quotas). Docker only tells when asked for such a
    /// container, so this creates one (never started) of the first image present, `images`
    /// first, then any, and removes it.
    pub async fn probe_disk_bounds(&self, images: &[&str]) -> anyhow::Result<DiskSupport> {
        use bollard::errors::Error::DockerResponseServerError;
        use bollard::query_parameters::ListImagesOptions;
        let mut candidates: Vec<String> = images.iter().map(|s| s.to_string()).collect();
        let any = timed("list images", self.docker.list_images(None::<ListImagesOptions>)).await?;
        candidates.extend(any.into_iter().flat_map(|i| i.repo_tags).filter(|t| t != "<none>:<none>").take(1));
        let labels = HashMap::from([
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
        ]);
        for image in candidates {
            let body = ContainerCreateBody {
                image: Some(image.clone()),
                labels: Some(labels.clone()),
                network_disabled: Some(true),
                host_config: Some(HostConfig {
                    network_mode: Some("none".into()),
                    log_config: Some(HostConfigLogConfig { typ: Some("none".into()), config: None }),
                    storage_opt: Some(HashMap::from([("size".to_string(), "64M".to_string())])),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let name = format!("sp-{}-probe-{:08x}", self.prefix, rand::random::<u32>());
            let opts = CreateContainerOptionsBuilder::new().name(&name).build();
            let created = tokio::time::timeout(DOCKER_TIMEOUT, self.docker.create_container(Some(opts), body)).await;
            match created {
                Ok(Ok(c)) => {
                    self.remove(&c.id).await?;
                    return Ok(DiskSupport::Enforced);
                }
                // No such image: try the next.
                Ok(Err(DockerResponseServerError { status_code: 404, .. })) => continue,
                Ok(Err(DockerResponseServerError { message, .. })) => return Ok(DiskSupport::Unsupported(message)),
                Ok(Err(e)) => anyhow::bail!("create a container with a bounded disk: {e}"),
                Err(_) => anyhow::bail!("create a container with a bounded disk: no answer within {DOCKER_TIMEOUT:?}"),
            }
        }
        Ok(DiskSupport::Unsupported("no image on this node to ask Docker with".into()))
    }

    /// What a create needs of `image`'s config (cached: an image's config never changes).
    async fn image_facts(&self, image: &str) -> anyhow::Result<ImageFacts> {
        let cached = self.image_facts.lock().unwrap_or_else(|e| e.into_inner()).get(image).cloned();
        if let Some(v) = cached {
            return Ok(v);
        }
        let inspect = timed("inspect image", self.docker.inspect_image(image)).await?;
        let config = inspect.config.unwrap_or_default();
        let names_shim_group =
            config.env.iter().flatten().any(|e| e.split_once('=').is_some_and(|(k, _)| k == SHIM_GROUP_ENV));
        let facts = ImageFacts {
            names_shim_group,
            volumes: config.volumes.unwrap_or_default().into(),
            lazy_image: config.labels.and_then(|mut l| l.remove(crate::lazy::LABEL_LAZY_IMAGE)),
        };
        let mut cache = self.image_facts.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED_IMAGES {
            cache.clear();
        }
        cache.insert(image.to_string(), facts.clone());
        Ok(facts)
    }

    /// A label filter for this deployment's and node's objects that carry `flag=true`.
    pub(super) fn own(&self, flag: &str) -> HashMap<&'static str, Vec<String>> {
        HashMap::from([(
            "label",
            vec![
                format!("{flag}=true"),
                format!("{LABEL_PREFIX}={}", self.prefix),
                format!("{LABEL_NODE}={}", self.node),
            ],
        )])
    }

    fn container_name(&self, sandbox: &str) -> String {
        format!("sp-{}-{}", self.prefix, sandbox.replace('.', "-"))
    }

    /// Creates (not starts) a hardened sandbox container for `sandbox` of `template`.
    pub async fn create(
        &self,
        sandbox: &str,
        template: &Template,
        agent_files: Option<&crate::agent_bin::AgentFiles>,
    ) -> anyhow::Result<String> {
        // A lazy image runs from its stub image; it and snapshots of its sandboxes carry the
        // lazy label, and run on the lazy runtime over the node's mount of the image (`lazy.rs`).
        let image = self.lazy.container_image(&template.image);
        let facts = self.image_facts(&image).await?;
        let runtime = match &facts.lazy_image {
            Some(lazy) => crate::lazy::runtime_for(&self.lazy.lazyd, lazy, &template.runtime).await?,
            None => template.runtime.clone(),
        };
        let labels = HashMap::from([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
            (LABEL_TEMPLATE.to_string(), template.name.clone()),
            (LABEL_SANDBOX.to_string(), sandbox.to_string()),
        ]);
        let memory = (template.memory_mb * 1024 * 1024) as i64;
        let (cfs_period_us, cfs_quota_us) = template.cfs_period_and_quota_us();
        // A non-root user: the agent (root, PID 1) needs to switch to them (SETUID, SETGID), give
        // them the workdir (CHOWN) and signal their processes (KILL); their processes have no
        // capability at all (a setuid to non-root clears them; no-new-privileges keeps them so).
        let (agent_args, cap_add) = match template.user {
            User::Root => (vec![], vec![]),
            user => (
                vec!["--user".to_string(), user.spec(), "--workdir".to_string(), template.workdir.clone()],
                ["SETUID", "SETGID", "CHOWN", "KILL"].map(String::from).to_vec(),
            ),
        };
        let (entrypoint, cmd, mut binds, init) = match agent_files {
            Some(files) => {
                let mut args = agent_args;
                let mut binds = vec![
                    format!("{}:{}:ro", files.agent.display(), AGENT_PATH_IN_SANDBOX),
                    format!("{}:{}:ro", files.python.display(), crate::agent_bin::PYTHON_DIR_IN_SANDBOX),
                ];
                if direct_channel(template) {
                    let dir = files.make_run_dir(sandbox).context("make the agent's socket directory")?;
                    binds.push(format!("{}:{}", dir.display(), crate::agent_bin::SOCKET_DIR_IN_SANDBOX));
                    let socket =
                        format!("{}/{}", crate::agent_bin::SOCKET_DIR_IN_SANDBOX, crate::agent_bin::SOCKET_NAME);
                    args.extend(["--socket".to_string(), socket]);
                }
                (vec![AGENT_PATH_IN_SANDBOX.to_string()], args, binds, false)
            }
            // docker-exec mode: something must keep the container alive; docker's init reaps.
            None => (
                vec!["/bin/sh".to_string(), "-c".to_string()],
                vec!["trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done".to_string()],
                vec![],
                true,
            ),
        };
        let egress = match template.network {
            Network::Egress => Some(self.egress.as_ref().context("no egress network on this node")?),
            _ => None,
        };
        if template.network == Network::Bridge {
            // Its host rule is installed at every start; the network itself may be new here.
            self.ensure_bridge_network().await.context("create the sandboxes' bridge network")?;
        }
        if let Some(dir) = &self.etc_dir {
            for (file, at) in ETC_FILES {
                // Egress sandboxes ask the node's DNS, on their network's gateway.
                let from = match egress {
                    Some(net) if at == "/etc/resolv.conf" => net.resolv_conf.clone(),
                    _ => dir.join(file),
                };
                binds.push(format!("{}:{at}:ro", from.display()));
            }
        }
        let mut env: Vec<String> = egress.map(|net| net.proxy_env()).unwrap_or_default();
        // The shim group is the node's to name (a tenant's template may not pick one).
        let ours = |k: &String| k.as_str() == SHIM_GROUP_ENV;
        env.extend(template.env.iter().filter(|(k, _)| !ours(k)).map(|(k, v)| format!("{k}={v}")));
        // Agent-mode sandboxes on the shared-kernel runtimes share containerd shims
        // (`shim_groups.rs`; gVisor's and lazy images' runtimes keep a shim each); the agent
        // keeps the variable from commands.
        let grouped = agent_files.is_some() && matches!(runtime.as_str(), "runc" | "crun");
        let shim = grouped.then(|| self.shims.join()).flatten();
        // Where the node names no group but the image's own `ENV` does, an empty value
        // overrides it (sandpool-shim reads the container's whole environment; empty is none).
        let group = match &shim {
            Some(ticket) => Some(ticket.name.as_str()),
            None => facts.names_shim_group.then_some(""),
        };
        if let Some(group) = group {
            env.push(format!("{SHIM_GROUP_ENV}={group}"));
        }
        // The image's own settings that would reach past the template: its `VOLUME`s become
        // tmpfs mounts bounded by the template's disk and charged to its memory (not anonymous
        // volumes outside every bound), its `HEALTHCHECK` never runs (it would run as the
        // image's user, beside the agent), and its `USER` does not apply to PID 1 (the agent
        // starts as root and runs tenant code as the template's user). Its `ENTRYPOINT` and
        // `CMD` are replaced above; `EXPOSE`d ports stay unpublished (no port is ever published).
        let tmpfs_mb = match template.disk_mb {
            0 => template.memory_mb,
            disk => disk.min(template.memory_mb),
        };
        let tmpfs: HashMap<String, String> = facts
            .volumes
            .iter()
            .filter(|v| v.starts_with('/'))
            .map(|v| (v.clone(), format!("rw,nosuid,nodev,size={tmpfs_mb}m,mode=1777")))
            .collect();
        let storage_opt = (self.disk_bounds && template.disk_mb > 0)
            .then(|| HashMap::from([("size".to_string(), format!("{}M", template.disk_mb))]));
        let host_config = HostConfig {
            storage_opt,
            cap_drop: Some(vec!["ALL".into()]),
            cap_add: Some(cap_add),
            security_opt: Some(vec!["no-new-privileges".into()]),
            pids_limit: Some(template.pids as i64),
            memory: Some(memory),
            memory_swap: Some(memory),
            // Quota and period rather than NanoCpus (Docker's fixed 100 ms period): see
            // `Template::cpu_period`.
            cpu_period: Some(cfs_period_us),
            cpu_quota: Some(cfs_quota_us),
            network_mode: Some(match (template.network, egress) {
                (Network::Bridge, _) => BRIDGE_NETWORK.into(),
                (Network::Egress, Some(net)) => net.name.clone(),
                _ => "none".into(),
            }),
            log_config: Some(HostConfigLogConfig { typ: Some("none".into()), config: None }),
            binds: Some(binds),
            tmpfs: (!tmpfs.is_empty()).then_some(tmpfs),
            init: Some(init),
            runtime: Some(runtime),
            ..Default::default()
        };
        let body = ContainerCreateBody {
            image: Some(image),
            entrypoint: Some(entrypoint),
            cmd: Some(cmd),
            env: Some(env),
            working_dir: Some(template.workdir.clone()),
            user: Some("0:0".into()),
            healthcheck: Some(bollard::models::HealthConfig { test: Some(vec!["NONE".into()]), ..Default::default() }),
            hostname: Some(SANDBOX_HOSTNAME.into()),
            labels: Some(labels),
            open_stdin: Some(true),
            stdin_once: Some(false),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            network_disabled: Some(template.network == Network::None),
            host_config: Some(host_config),
            ..Default::default()
        };
        let opts = CreateContainerOptionsBuilder::new().name(&self.container_name(sandbox)).build();
        let created = timed("create container", self.docker.create_container(Some(opts), body)).await?;
        if let Some(ticket) = shim {
            ticket.created(&created.id);
        }
        Ok(created.id)
    }
}
