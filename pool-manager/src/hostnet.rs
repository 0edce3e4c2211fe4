//! The node's own services out of the sandboxes' reach. No packet from the sandboxes' bridge
//! (`docker::BRIDGE_IFACE`) to this host is accepted, whatever host address it is sent to: not
//! the gateway, the pool-manager's internal API, Redis, the Docker API over TCP, nor anything
//! else listening here. (`network = "none"` sandboxes have no route anywhere. Traffic forwarded
//! out to other hosts is for named egress policies to decide.)

use anyhow::Context as _;
use tokio::process::Command;

/// Puts `iptables -I INPUT -i <iface> -j DROP` in place unless it is there already. `-w`
/// waits for the tables' lock, which Docker takes too.
pub(crate) async fn guard(iface: &str) -> anyhow::Result<()> {
    let rule = ["INPUT", "-i", iface, "-j", "DROP"];
    let check = Command::new("iptables").args(["-w", "-C"]).args(rule).output().await.context("run iptables")?;
    if check.status.success() {
        return Ok(());
    }
    let add = Command::new("iptables").args(["-w", "-I"]).args(rule).output().await.context("run iptables")?;
    anyhow::ensure!(
        add.status.success(),
        "iptables -I {}: {}",
        rule.join(" "),
        String::from_utf8_lossy(&add.stderr).trim()
    );
    tracing::info!(iface, "the host refuses every packet from the sandboxes' bridge");
    Ok(())
}
