//! The node's networks on Docker: the egress network, the sandboxes' bridge, addresses.

use std::collections::HashMap;

use anyhow::Context as _;

use super::*;

impl Dock {
    /// The name of this node's egress network (one per deployment prefix and node) and of its
    /// bridge interface, which the host rules name: `spe-` and `wire::stable_hash::tag32` of
    /// the prefix and node, the same in every build.
    pub fn egress_network_name(&self) -> (String, String) {
        let tag = wire::stable_hash::tag32(&["egress-bridge", &self.prefix, &self.node]);
        (format!("sandpool-egress-{}-{}", self.prefix, self.node), format!("spe-{tag}"))
    }

    /// Creates, when missing, this node's egress network: a bridge of its own whose sandboxes
    /// cannot reach one another (`enable_icc=false`) nor, through the firewall, anything but
    /// the node's proxy. Returns its name, its bridge interface, gateway and subnet.
    ///
    /// A network of that name whose bridge has another interface name (made by a build that
    /// derived it otherwise) is made anew when no container is on it, its host rules removed;
    /// with containers on it, it is kept and its actual interface returned, so the firewall
    /// always names the interface that exists.
    pub async fn ensure_egress_network(
        &self,
    ) -> anyhow::Result<(String, String, std::net::Ipv4Addr, (std::net::Ipv4Addr, u8))> {
        let (name, mut iface) = self.egress_network_name();
        let mut existing = self.inspect_network(&name).await?;
        if let Some(net) = &existing {
            let actual = bridge_iface(net).unwrap_or_default();
            if actual != iface {
                let in_use = net.containers.as_ref().is_some_and(|c| !c.is_empty());
                if in_use || actual.is_empty() {
                    tracing::warn!(network = %name, %actual, expected = %iface, "egress network keeps its bridge name while containers are on it");
                    if !actual.is_empty() {
                        iface = actual;
                    }
                } else {
                    tracing::info!(network = %name, old = %actual, new = %iface, "egress network's bridge renamed: made anew");
                    let old = actual.clone();
                    tokio::task::spawn_blocking(move || crate::egress::firewall::remove(&old))
                        .await?
                        .context("remove the old egress bridge's host rules")?;
                    timed_or("remove network", "remove network", self.docker.remove_network(&name), &[404]).await?.ok();
                    existing = None;
                }
            }
        }
        if existing.is_none() {
            let options = HashMap::from([
                ("com.docker.network.bridge.name".to_string(), iface.clone()),
                ("com.docker.network.bridge.enable_icc".to_string(), "false".to_string()),
            ]);
            let labels = HashMap::from([
                (LABEL_MANAGED.to_string(), "true".to_string()),
                (LABEL_PREFIX.to_string(), self.prefix.clone()),
                (LABEL_NODE.to_string(), self.node.clone()),
            ]);
            let req = bollard::models::NetworkCreateRequest {
                name: name.clone(),
                driver: Some("bridge".into()),
                options: Some(options),
                labels: Some(labels),
                ..Default::default()
            };
            timed_or("create network", "create network", self.docker.create_network(req), &[409]).await?.ok();
        }
        let (gateway, subnet) = self
            .network_ipv4(&name)
            .await?
            .and_then(|(gw, subnet)| Some((gw?, subnet)))
            .ok_or_else(|| anyhow::anyhow!("network {name} has no IPv4 subnet and gateway"))?;
        Ok((name, iface, gateway, subnet))
    }

    /// A network as Docker describes it, or `None` if there is none of that name.
    async fn inspect_network(&self, name: &str) -> anyhow::Result<Option<bollard::models::NetworkInspect>> {
        let opts = None::<bollard::query_parameters::InspectNetworkOptions>;
        let found =
            timed_or("inspect network", "inspect network", self.docker.inspect_network(name, opts), &[404]).await?;
        Ok(found.ok())
    }

    /// A network's IPv4 gateway (if it names one) and subnet, if the network exists.
    pub async fn network_ipv4(
        &self,
        name: &str,
    ) -> anyhow::Result<Option<(Option<std::net::Ipv4Addr>, (std::net::Ipv4Addr, u8))>> {
        let net = self.inspect_network(name).await?;
        Ok(net.and_then(|n| n.ipam?.config).into_iter().flatten().find_map(|c| {
            let (ip, bits) = c.subnet.as_deref()?.split_once('/')?;
            let subnet = (ip.parse().ok()?, bits.parse().ok()?);
            Some((c.gateway.and_then(|g| g.parse().ok()), subnet))
        }))
    }

    /// A running container's address on `network`.
    pub async fn container_ip(&self, container: &str, network: &str) -> anyhow::Result<std::net::Ipv4Addr> {
        let c = timed("inspect container", self.docker.inspect_container(container, None)).await?;
        let ip = c
            .network_settings
            .and_then(|n| n.networks)
            .and_then(|mut n| n.remove(network))
            .and_then(|e| e.ip_address)
            .filter(|ip| !ip.is_empty())
            .ok_or_else(|| anyhow::anyhow!("container {container} has no address on {network}"))?;
        ip.parse().with_context(|| format!("container {container}: address {ip:?}"))
    }

    /// The bridge interfaces of this node's egress networks that Docker has (normally one; a
    /// network of an earlier run counts too, whatever this run's config says).
    pub async fn egress_bridges(&self) -> anyhow::Result<Vec<String>> {
        use bollard::query_parameters::ListNetworksOptionsBuilder;
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_PREFIX}={}", self.prefix), format!("{LABEL_NODE}={}", self.node)],
        )]);
        let opts = ListNetworksOptionsBuilder::new().filters(&filters).build();
        let nets = timed("list networks", self.docker.list_networks(Some(opts))).await?;
        Ok(nets
            .into_iter()
            .filter(|n| n.name.as_deref().is_some_and(|name| name.starts_with("sandpool-egress-")))
            .filter_map(|n| n.options?.get("com.docker.network.bridge.name").cloned())
            .filter(|i| !i.is_empty())
            .collect())
    }

    /// Creates, when missing, the network `network = "bridge"` sandboxes join: a bridge of its
    /// own (so the host firewall can name it, `hostnet::guard`) on which sandboxes cannot
    /// reach one another (`enable_icc=false`: one tenant's sandbox is no neighbour of
    /// another's). Nodes and test stacks share it; a concurrent create is no error.
    pub async fn ensure_bridge_network(&self) -> anyhow::Result<()> {
        use std::sync::atomic::Ordering;
        if self.bridge_ready.load(Ordering::Relaxed) || self.inspect_network(BRIDGE_NETWORK).await?.is_some() {
            self.bridge_ready.store(true, Ordering::Relaxed);
            return Ok(());
        }
        let options = HashMap::from([
            ("com.docker.network.bridge.name".to_string(), BRIDGE_IFACE.to_string()),
            ("com.docker.network.bridge.enable_icc".to_string(), "false".to_string()),
        ]);
        let req = bollard::models::NetworkCreateRequest {
            name: BRIDGE_NETWORK.into(),
            driver: Some("bridge".into()),
            options: Some(options),
            labels: Some(HashMap::from([(LABEL_MANAGED.to_string(), "true".to_string())])),
            ..Default::default()
        };
        timed_or("create network", "create network", self.docker.create_network(req), &[409]).await?.ok();
        self.bridge_ready.store(true, Ordering::Relaxed);
        Ok(())
    }
}

/// The interface name of a bridge network (its `com.docker.network.bridge.name` option).
fn bridge_iface(net: &bollard::models::NetworkInspect) -> Option<String> {
    net.options.as_ref()?.get("com.docker.network.bridge.name").cloned()
}
