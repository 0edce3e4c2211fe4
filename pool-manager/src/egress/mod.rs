// One file over 600 lines on purpose (for now): the proxy's connection path (accept, original
// destination, proxy request, policy check, relay, cut on switch) is one sequence over the
// same member map and protected set; DNS, the firewall, inspection and refusals are apart.
//! Named egress: sandboxes of `network = "egress"` templates sit on a bridge of their node
//! whose only way out is this proxy (`firewall`), and every connection they open is checked
//! against their session's current policy (`config::egress`), by the sandbox's address.
//!
//! - **Every TCP connection** lands here with its original destination (`SO_ORIGINAL_DST`).
//!   To `<gateway>:3128` (the `HTTP(S)_PROXY` every egress sandbox gets) it is an HTTP proxy
//!   request: `CONNECT host:port` or an absolute URL, checked by host name, a denial answered
//!   `403` naming the policy. Anything else is checked by its destination: a stand-in address
//!   of the node's DNS stands for its name, any other address for itself; a denial resets the
//!   connection at once.
//! - **DNS** (`dns`): names the policy covers resolve to stand-ins; others are NXDOMAIN.
//! - **A name resolved on the host** (not pinned by `[egress.hosts]`) is screened: an address
//!   that is loopback, private, link-local, shared, multicast, reserved or the node's own
//!   (`config::egress::screened`) is used only if an address rule of the policy allows it (the
//!   node's own: a /32), so a tenant controlling an allowed name's DNS reaches nothing more.
//! - **The name inside** (`inspect`): a connection admitted by a name rule may present only a
//!   name that rule covers, in a plain-HTTP request's `Host` (or absolute target) and in the
//!   SNI of a TLS ClientHello (after `CONNECT`, or to a stand-in address); otherwise it is
//!   refused (403, or a reset once the tunnel is up) before its bytes go upstream.
//! - **Refusals** are counted (`sandpool_egress_connections_total`) and logged at a bounded
//!   rate (`refusals`).
//! - **Switching** a session's policy takes effect at once for new connections, and open ones
//!   the new policy would refuse are cut.
//! - **Whatever the policy**, nothing reaches the node's own services (gateway, internal API,
//!   Redis, metrics, Docker's TCP ports on any of the host's addresses) or another sandbox.
//!   Any other port of the host itself only through a rule naming it exactly (a name, or the
//!   address as a /32): a wide rule such as `0.0.0.0/0` never covers the node.

pub mod dns;
pub mod firewall;
pub mod inspect;
mod refusals;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use config::egress::{Dest, Policy, in_cidr, screened};
use config::{Config, EgressConfig};
use telemetry::names;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::sync::lock;

/// The explicit proxy's port on the gateway address (virtual: the firewall redirects every
/// connection to the proxy's real port, which tells them apart by their original destination).
pub const PROXY_PORT: u16 = 3128;
/// Docker's API over TCP, refused on the host's addresses whatever the policy.
const DOCKER_PORTS: [u16; 2] = [2375, 2376];
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the admin API's policies are re-read: a change is in force within this.
const POLICY_REFRESH: Duration = Duration::from_secs(1);
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_HEAD: usize = 16 * 1024;
/// Per direction of a relayed connection: 64 KiB, eight times tokio's default, so a MiB takes
/// fewer system calls (CPU per MiB relayed: BENCHMARKS.md).
const RELAY_BUFFER: usize = 64 * 1024;

/// The node's egress network, as Docker made it.
#[derive(Debug, Clone)]
pub struct EgressNet {
    /// The node whose network it is.
    pub node: String,
    /// The Docker network's name (`sandpool-egress-<prefix>-<node>`).
    pub name: String,
    /// Its bridge interface, which the firewall rules name.
    pub iface: String,
    /// The network's gateway address on this host, where the proxy and the DNS listen.
    pub gateway: Ipv4Addr,
    /// The network's subnet (address, prefix length).
    pub subnet: (Ipv4Addr, u8),
    /// The `resolv.conf` egress sandboxes mount (the gateway as their name server).
    pub resolv_conf: std::path::PathBuf,
}

impl EgressNet {
    /// What every egress sandbox's environment names as its proxy.
    pub fn proxy_env(&self) -> Vec<String> {
        let url = format!("http://{}:{PROXY_PORT}", self.gateway);
        let mut env = Vec::new();
        for k in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
            env.push(format!("{k}={url}"));
        }
        for k in ["no_proxy", "NO_PROXY"] {
            env.push(format!("{k}=localhost,127.0.0.1"));
        }
        env
    }
}

/// A sandbox on the egress network: its current policy (connections watch it).
struct Member {
    sandbox: String,
    policy: watch::Sender<Arc<Policy>>,
}

/// What the node never lets a sandbox reach.
#[derive(Debug, Clone)]
struct Protected {
    /// On loopback and every address of this host.
    ports: Vec<u16>,
    /// Sandbox networks (other sandboxes).
    nets: Vec<(Ipv4Addr, u8)>,
}

impl Protected {
    fn covers(&self, addr: SocketAddrV4) -> bool {
        let ip = *addr.ip();
        if self.nets.iter().any(|(net, bits)| in_cidr(ip, *net, *bits)) {
            return true;
        }
        self.ports.contains(&addr.port()) && is_local(ip)
    }
}

/// Whether `ip` is one of this host's addresses (it can be bound).
fn is_local(ip: Ipv4Addr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// The node's egress proxy and DNS: which policy each egress sandbox is under, and the connections
/// and names it checks against it.
pub struct Egress {
    node: String,
    /// The network the proxy serves.
    pub net: EgressNet,
    config: EgressConfig,
    /// The config's policies and those defined through the admin API (`refresh`).
    policies: RwLock<BTreeMap<String, Arc<Policy>>>,
    protected: Protected,
    members: Mutex<HashMap<Ipv4Addr, Member>>,
    addresses: Mutex<HashMap<String, Ipv4Addr>>,
    names: Mutex<dns::Names>,
    refusals: Mutex<refusals::RefusalLog>,
}

/// Why a policy switch was refused.
#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    /// The sandbox has no address on the egress network here.
    #[error("sandbox {0} is not on the egress network")]
    NotMember(String),
    /// Neither the config nor the admin API defines a policy of that name.
    #[error("no egress policy named {0:?}")]
    NoPolicy(String),
}

impl Egress {
    /// Binds the proxy and the DNS on the network's gateway, puts the firewall in place, and
    /// serves until `cancel`. `own_ports`: the node's listeners beyond those in `config`.
    pub async fn start(
        config: &Config,
        ledger: ledger::Ledger,
        net: EgressNet,
        own_ports: &[u16],
        other_nets: &[(Ipv4Addr, u8)],
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) -> anyhow::Result<Arc<Egress>> {
        let proxy = TcpListener::bind((net.gateway, 0)).await.context("bind the egress proxy")?;
        let dns = UdpSocket::bind((net.gateway, 0)).await.context("bind the egress DNS")?;
        let (proxy_port, dns_port) = (proxy.local_addr()?.port(), dns.local_addr()?.port());
        firewall::install(&net.iface, net.gateway, proxy_port, dns_port).await?;
        let mut ports = vec![config.gateway.listen.port(), config.pool_manager.listen.port()];
        ports.extend(redis_ports(&config.redis.url));
        ports.extend(config.telemetry.metrics_listen.map(|a| a.port()));
        ports.extend(DOCKER_PORTS);
        ports.extend(own_ports);
        ports.retain(|p| *p != 0);
        let mut nets = vec![net.subnet];
        nets.extend(other_nets);
        let egress = Arc::new(Egress {
            node: net.node.clone(),
            net,
            policies: RwLock::new(config.egress.policies.clone()),
            config: config.egress.clone(),
            protected: Protected { ports, nets },
            members: Mutex::new(HashMap::new()),
            addresses: Mutex::new(HashMap::new()),
            names: Mutex::new(dns::Names::default()),
            refusals: Mutex::new(refusals::RefusalLog::default()),
        });
        tracker.spawn(egress.clone().serve_proxy(proxy, tracker.clone(), cancel.clone()));
        if let Err(e) = egress.refresh(&ledger).await {
            tracing::warn!(error = %e, "egress: read the API's policies");
        }
        tracker.spawn(egress.clone().refresh_loop(ledger, cancel.clone()));
        tracker.spawn(egress.clone().serve_dns(Arc::new(dns), cancel));
        Ok(egress)
    }

    /// The policy named `name` as last read (config or admin API), if any.
    pub fn policy(&self, name: &str) -> Option<Arc<Policy>> {
        self.policies.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(name).cloned()
    }

    /// Re-reads the policies defined through the admin API; sandboxes under a policy that
    /// changed are put under its new rules at once (open connections it now refuses are cut);
    /// a removed policy allows nothing to those still under it.
    pub async fn refresh(&self, ledger: &ledger::Ledger) -> anyhow::Result<()> {
        let stored = ledger.egress_policies().await?;
        let mut next = self.config.policies.clone();
        for (name, allow) in stored {
            if next.contains_key(&name) {
                continue; // the config's own wins (the API refuses to shadow it)
            }
            match Policy::new(&name, &allow) {
                Ok(p) => {
                    next.insert(name, Arc::new(p));
                }
                Err(e) => tracing::warn!(policy = %name, error = %e, "egress: a stored policy does not parse; ignored"),
            }
        }
        let changed = {
            let mut current = self.policies.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *current == next {
                return Ok(());
            }
            let changed: Vec<String> =
                current.keys().chain(next.keys()).filter(|n| current.get(*n) != next.get(*n)).cloned().collect();
            *current = next;
            changed
        };
        for m in lock(&self.members).values() {
            let name = m.policy.borrow().name.clone();
            if changed.contains(&name) {
                // A policy that is gone allows nothing (until it is defined again).
                let now = self.policy(&name).unwrap_or_else(|| Arc::new(Policy::new(&name, &[]).expect("no rules")));
                m.policy.send_replace(now);
            }
        }
        tracing::info!(?changed, "egress policies changed");
        Ok(())
    }

    async fn refresh_loop(self: Arc<Self>, ledger: ledger::Ledger, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(POLICY_REFRESH) => {}
            }
            if let Err(e) = self.refresh(&ledger).await {
                tracing::debug!(error = %e, "egress: read the API's policies");
            }
        }
    }

    /// Puts a sandbox (at `ip`) under `policy`.
    pub fn admit(&self, sandbox: &str, ip: Ipv4Addr, policy: &str) -> Result<(), SwitchError> {
        let p = self.policy(policy).ok_or_else(|| SwitchError::NoPolicy(policy.to_string()))?;
        let (tx, _) = watch::channel(p);
        lock(&self.members).insert(ip, Member { sandbox: sandbox.to_string(), policy: tx });
        lock(&self.addresses).insert(sandbox.to_string(), ip);
        Ok(())
    }

    /// Switches a sandbox's policy: new connections are checked against it at once, and open
    /// ones it would refuse are cut.
    pub fn switch(&self, sandbox: &str, policy: &str) -> Result<(), SwitchError> {
        let p = self.policy(policy).ok_or_else(|| SwitchError::NoPolicy(policy.to_string()))?;
        let ip = lock(&self.addresses).get(sandbox).copied().ok_or_else(|| SwitchError::NotMember(sandbox.into()))?;
        match lock(&self.members).get(&ip) {
            Some(m) if m.sandbox == sandbox => {
                m.policy.send_replace(p);
                Ok(())
            }
            _ => Err(SwitchError::NotMember(sandbox.into())),
        }
    }

    /// Forgets a sandbox; its open connections are cut.
    pub fn forget(&self, sandbox: &str) {
        lock(&self.refusals).forget(sandbox);
        if let Some(ip) = lock(&self.addresses).remove(sandbox) {
            let mut members = lock(&self.members);
            if members.get(&ip).is_some_and(|m| m.sandbox == sandbox) {
                members.remove(&ip);
            }
        }
    }

    /// The sandbox at `ip` and its policy.
    fn member(&self, ip: IpAddr) -> Option<(Arc<str>, watch::Receiver<Arc<Policy>>)> {
        let IpAddr::V4(ip) = ip else { return None };
        lock(&self.members).get(&ip).map(|m| (Arc::from(m.sandbox.as_str()), m.policy.subscribe()))
    }

    fn count(&self, policy: &str, outcome: &'static str) {
        metrics::counter!(names::EGRESS_CONNECTIONS, "node" => self.node.clone(), "policy" => policy.to_string(), "outcome" => outcome)
            .increment(1);
    }

    /// Counts a refused connection and logs it, at most once per sandbox per
    /// `refusals::EVERY` (with how many went unlogged since).
    fn refused(&self, sandbox: &str, policy: &str, outcome: &'static str, dest: &Dest, port: u16, why: &str) {
        self.count(policy, outcome);
        let logged = lock(&self.refusals).admit(sandbox, std::time::Instant::now());
        if let Some(unlogged) = logged {
            tracing::info!(sandbox, policy, outcome, %dest, port, why, unlogged, "egress refused (one line per sandbox per {:?})", refusals::EVERY);
        }
    }

    // ---------- DNS ----------

    async fn serve_dns(self: Arc<Self>, socket: Arc<UdpSocket>, cancel: CancellationToken) {
        let mut buf = vec![0u8; 1500];
        loop {
            let (n, from) = tokio::select! {
                _ = cancel.cancelled() => return,
                r = socket.recv_from(&mut buf) => match r {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "egress dns receive");
                        continue;
                    }
                },
            };
            let query = &buf[..n];
            let Some((_, policy)) = self.member(from.ip()) else { continue };
            let reply = match dns::parse(query) {
                Ok(q) => {
                    let allowed = policy.borrow().names(&q.name);
                    let ip = allowed.then(|| lock(&self.names).stand_in(&q.name));
                    let outcome = if allowed { "answered" } else { "refused" };
                    metrics::counter!(names::EGRESS_DNS, "node" => self.node.clone(), "outcome" => outcome)
                        .increment(1);
                    Some(dns::answer(query, &q, ip))
                }
                Err(rcode) => {
                    metrics::counter!(names::EGRESS_DNS, "node" => self.node.clone(), "outcome" => "malformed")
                        .increment(1);
                    dns::error(query, rcode)
                }
            };
            if let Some(reply) = reply
                && let Err(e) = socket.send_to(&reply, from).await
            {
                tracing::debug!(error = %e, "egress dns reply");
            }
        }
    }

    // ---------- proxy ----------

    async fn serve_proxy(self: Arc<Self>, listener: TcpListener, tracker: TaskTracker, cancel: CancellationToken) {
        loop {
            let (stream, peer) = tokio::select! {
                _ = cancel.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "egress proxy accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some((sandbox, policy)) = self.member(peer.ip()) else {
                reset(stream);
                continue;
            };
            let me = self.clone();
            let cancel = cancel.clone();
            tracker.spawn(async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = me.handle(stream, &sandbox, policy) => {}
                }
            });
        }
    }

    async fn handle(&self, stream: TcpStream, sandbox: &str, policy: watch::Receiver<Arc<Policy>>) {
        let original = match original_destination(&stream) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "egress: no original destination");
                return reset(stream);
            }
        };
        if *original.ip() == self.net.gateway && original.port() == PROXY_PORT {
            self.explicit(stream, sandbox, policy).await
        } else {
            self.transparent(stream, sandbox, policy, original).await
        }
    }

    /// A connection made to an address: a stand-in stands for its name.
    async fn transparent(
        &self,
        stream: TcpStream,
        sandbox: &str,
        policy: watch::Receiver<Arc<Policy>>,
        original: SocketAddrV4,
    ) {
        let ip = *original.ip();
        let dest = if in_cidr(ip, dns::STAND_IN_NET.0, dns::STAND_IN_NET.1) {
            match lock(&self.names).name_of(ip) {
                Some(name) => Dest::Name(name.to_string()),
                None => return reset(stream),
            }
        } else {
            Dest::Ip(ip)
        };
        let port = original.port();
        match self.open(sandbox, &dest, port, &policy).await {
            Ok(upstream) => {
                self.splice(stream, upstream, sandbox, dest, port, policy, Inspect::First(Vec::new())).await
            }
            Err(_) => reset(stream),
        }
    }

    /// An HTTP proxy request: `CONNECT host:port`, or a request for an absolute `http://` URL.
    async fn explicit(&self, mut stream: TcpStream, sandbox: &str, policy: watch::Receiver<Arc<Policy>>) {
        let Ok(Ok(Some((head, rest)))) = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await else {
            return respond(&mut stream, 400, "Bad Request", None, "sandpool egress: no complete HTTP request head\n")
                .await;
        };
        let req = match ProxyRequest::parse(&head) {
            Ok(r) => r,
            Err(why) => {
                return respond(&mut stream, 400, "Bad Request", None, &format!("sandpool egress: {why}\n")).await;
            }
        };
        let name = policy.borrow().name.clone();
        let misnamed = match (&req.dest, req.connect) {
            (Dest::Name(_), false) if policy.borrow().allows(&req.dest, req.port) => match inspect::head_names(&head) {
                Ok(names) => self.check_names(&req.dest, req.port, &policy, &names).err(),
                Err(why) => Some(why.to_string()),
            },
            _ => None,
        };
        if let Some(why) = misnamed {
            self.refused(sandbox, &name, "misnamed", &req.dest, req.port, &why);
            let body = format!("sandpool egress: policy {name:?} admits {}:{}, but {why}\n", req.dest, req.port);
            return respond(&mut stream, 403, "Forbidden", Some(&name), &body).await;
        }
        match self.open(sandbox, &req.dest, req.port, &policy).await {
            Ok(mut upstream) => {
                let (sent, inspect) = if req.connect {
                    (stream.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await, Inspect::First(rest))
                } else {
                    (upstream.write_all(&req.origin_head(&head)).await, Inspect::Checked(rest))
                };
                if sent.is_ok() {
                    self.splice(stream, upstream, sandbox, req.dest, req.port, policy, inspect).await;
                }
            }
            Err(Refused::Denied) => {
                let body = format!("sandpool egress: policy {name:?} does not allow {}:{}\n", req.dest, req.port);
                respond(&mut stream, 403, "Forbidden", Some(&name), &body).await
            }
            Err(Refused::Protected) => {
                let body = format!(
                    "sandpool egress: {}:{} is the node's own or another sandbox's (never allowed)\n",
                    req.dest, req.port
                );
                respond(&mut stream, 403, "Forbidden", Some(&name), &body).await
            }
            Err(Refused::Screened(why)) => {
                let body =
                    format!("sandpool egress: policy {name:?} does not allow {}:{}: {why}\n", req.dest, req.port);
                respond(&mut stream, 403, "Forbidden", Some(&name), &body).await
            }
            Err(Refused::Failed(why)) => {
                let body = format!("sandpool egress: {}:{}: {why}\n", req.dest, req.port);
                respond(&mut stream, 502, "Bad Gateway", Some(&name), &body).await
            }
        }
    }

    /// Checks `dest:port` against the policy, resolves it (screening what a name resolved to
    /// on the host), checks the protected set, and connects.
    async fn open(
        &self,
        sandbox: &str,
        dest: &Dest,
        port: u16,
        policy: &watch::Receiver<Arc<Policy>>,
    ) -> Result<TcpStream, Refused> {
        let p = policy.borrow().clone();
        if !p.allows(dest, port) {
            self.refused(sandbox, &p.name, "denied", dest, port, "no rule allows it");
            return Err(Refused::Denied);
        }
        let (found, by_dns) = match self.resolve(dest, port).await {
            Ok(a) => a,
            Err(why) => {
                self.count(&p.name, "failed");
                return Err(Refused::Failed(why));
            }
        };
        let addr = if by_dns {
            match pick_resolved(&found, port, &p, is_local) {
                Ok(a) => a,
                Err(why) => {
                    self.refused(sandbox, &p.name, "screened", dest, port, &why);
                    return Err(Refused::Screened(why));
                }
            }
        } else {
            found[0]
        };
        let own_address = !by_dns && is_local(*addr.ip()) && !p.names_exactly(dest, port);
        if own_address || self.protected.covers(addr) {
            let why = format!("{addr} is the node's own or another sandbox's");
            self.refused(sandbox, &p.name, "protected", dest, port, &why);
            return Err(Refused::Protected);
        }
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => {
                self.count(&p.name, "allowed");
                let _ = s.set_nodelay(true);
                Ok(s)
            }
            Ok(Err(e)) => {
                self.count(&p.name, "failed");
                Err(Refused::Failed(format!("connect {addr}: {e}")))
            }
            Err(_) => {
                self.count(&p.name, "failed");
                Err(Refused::Failed(format!("connect {addr}: no answer within {CONNECT_TIMEOUT:?}")))
            }
        }
    }

    /// The addresses of `dest` (never empty), and whether they came from the host's resolver
    /// (an address and a name the config pins are the operator's word: not screened).
    async fn resolve(&self, dest: &Dest, port: u16) -> Result<(Vec<SocketAddrV4>, bool), String> {
        match dest {
            Dest::Ip(ip) => Ok((vec![SocketAddrV4::new(*ip, port)], false)),
            Dest::Name(name) => {
                if let Some(ip) = self.config.hosts.get(name) {
                    return Ok((vec![SocketAddrV4::new(*ip, port)], false));
                }
                let found = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::lookup_host((name.as_str(), port)))
                    .await
                    .map_err(|_| format!("resolve {name}: no answer"))?
                    .map_err(|e| format!("resolve {name}: {e}"))?;
                let v4: Vec<SocketAddrV4> = found
                    .filter_map(|a| match a {
                        SocketAddr::V4(a) => Some(a),
                        SocketAddr::V6(_) => None,
                    })
                    .collect();
                if v4.is_empty() {
                    return Err(format!("resolve {name}: no IPv4 address"));
                }
                Ok((v4, true))
            }
        }
    }

    /// Checks the first bytes a client sends on a connection admitted for `dest:port`: the name
    /// an HTTP head or a TLS ClientHello presents must be covered by the rule that admitted
    /// the connection (`Policy::admits_as`). A connection admitted by address is not held to
    /// a name.
    fn check_first(
        &self,
        dest: &Dest,
        port: u16,
        policy: &watch::Receiver<Arc<Policy>>,
        buf: &[u8],
    ) -> Result<FirstVerdict, String> {
        if matches!(dest, Dest::Ip(_)) {
            return Ok(FirstVerdict::Pass);
        }
        match inspect::classify(buf) {
            inspect::First::NeedMore => Ok(FirstVerdict::NeedMore),
            inspect::First::Other | inspect::First::Tls(None) => Ok(FirstVerdict::Pass),
            inspect::First::Unreadable(why) => Err(why.to_string()),
            inspect::First::Tls(Some(sni)) => {
                if policy.borrow().admits_as(dest, port, &sni) {
                    Ok(FirstVerdict::Pass)
                } else {
                    Err(format!("its TLS SNI names {sni:?}"))
                }
            }
            inspect::First::Http { names, end } => {
                self.check_names(dest, port, policy, &names).map(|()| FirstVerdict::Http(end))
            }
        }
    }

    /// Whether every name an HTTP request presents is covered by the rule that admitted it.
    fn check_names(
        &self,
        dest: &Dest,
        port: u16,
        policy: &watch::Receiver<Arc<Policy>>,
        names: &[String],
    ) -> Result<(), String> {
        let p = policy.borrow();
        match names.iter().find(|n| !p.admits_as(dest, port, n)) {
            Some(n) => Err(format!("its HTTP request names {n:?}")),
            None => Ok(()),
        }
    }

    /// Reads what the client of a connection admitted for `dest:port` sends first, unless the
    /// server speaks first, and checks it (`check_first`). Returns the bytes to send upstream:
    /// as read, or an HTTP head rewritten to end the connection after it (a later request
    /// would not be read). Once the client has begun, the rest of what names the host must
    /// follow within `HEAD_TIMEOUT`.
    async fn first_flight(
        &self,
        down: &mut TcpStream,
        up: &TcpStream,
        dest: &Dest,
        port: u16,
        policy: &watch::Receiver<Arc<Policy>>,
        mut buf: Vec<u8>,
    ) -> Result<Vec<u8>, FirstFailed> {
        let mut deadline = (!buf.is_empty()).then(|| tokio::time::Instant::now() + HEAD_TIMEOUT);
        let mut chunk = vec![0u8; 4096];
        loop {
            match self.check_first(dest, port, policy, &buf).map_err(FirstFailed::Refused)? {
                FirstVerdict::Pass => return Ok(buf),
                FirstVerdict::Http(end) => {
                    let mut out = inspect::close_after(&buf[..end]);
                    out.extend_from_slice(&buf[end..]);
                    return Ok(out);
                }
                FirstVerdict::NeedMore if buf.len() >= inspect::MAX_FIRST => {
                    return Err(FirstFailed::Refused("its first bytes name no host within their bound".into()));
                }
                FirstVerdict::NeedMore => {}
            }
            let read = match deadline {
                None => {
                    let mut one = [0u8; 1];
                    tokio::select! {
                        r = down.read(&mut chunk) => r,
                        // The server speaks first (SSH, SMTP...): no name to check.
                        _ = up.peek(&mut one) => return Ok(buf),
                    }
                }
                Some(at) => match tokio::time::timeout_at(at, down.read(&mut chunk)).await {
                    Ok(r) => r,
                    Err(_) => return Err(FirstFailed::Gone),
                },
            };
            match read {
                Ok(0) if buf.is_empty() => return Ok(buf),
                Ok(0) | Err(_) => return Err(FirstFailed::Gone),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            deadline.get_or_insert_with(|| tokio::time::Instant::now() + HEAD_TIMEOUT);
        }
    }

    /// Relays both ways until either side closes, or a policy switch refuses the destination.
    /// What the client sends first is checked (`first_flight`) unless it was already.
    #[allow(clippy::too_many_arguments)]
    async fn splice(
        &self,
        mut down: TcpStream,
        mut up: TcpStream,
        sandbox: &str,
        dest: Dest,
        port: u16,
        mut policy: watch::Receiver<Arc<Policy>>,
        inspect: Inspect,
    ) {
        let early = match inspect {
            Inspect::Checked(early) => early,
            Inspect::First(early) => match self.first_flight(&mut down, &up, &dest, port, &policy, early).await {
                Ok(first) => first,
                Err(FirstFailed::Refused(why)) => {
                    let name = policy.borrow().name.clone();
                    self.refused(sandbox, &name, "misnamed", &dest, port, &why);
                    return reset(down);
                }
                Err(FirstFailed::Gone) => return reset(down),
            },
        };
        if !early.is_empty() && up.write_all(&early).await.is_err() {
            return;
        }
        {
            let copy = tokio::io::copy_bidirectional_with_sizes(&mut down, &mut up, RELAY_BUFFER, RELAY_BUFFER);
            tokio::pin!(copy);
            loop {
                tokio::select! {
                    _ = &mut copy => return,
                    changed = policy.changed() => {
                        let allowed = changed.is_ok() && policy.borrow_and_update().allows(&dest, port);
                        if !allowed {
                            let name = policy.borrow().name.clone();
                            self.count(&name, "cut");
                            tracing::debug!(policy = %name, %dest, port, "egress connection cut by a policy switch");
                            break;
                        }
                    }
                }
            }
        }
        reset(down);
    }
}

/// What `splice` does with the client's first bytes.
enum Inspect {
    /// Read and check them; these came already.
    First(Vec<u8>),
    /// Already checked (a proxied HTTP request's head): these follow it.
    Checked(Vec<u8>),
}

/// Why `first_flight` sends nothing upstream.
enum FirstFailed {
    /// What the client sent names another host, or cannot be read as it claims to be.
    Refused(String),
    /// The client went quiet, closed or failed before it had named a host.
    Gone,
}

/// `check_first`'s answer.
enum FirstVerdict {
    /// Nothing (more) to check.
    Pass,
    /// An HTTP head of this many bytes, checked.
    Http(usize),
    NeedMore,
}

/// Of the addresses the host's resolver gave for a name, the first one it may connect to: one
/// not screened and not the node's own (`own`), or one an address rule allows by itself.
fn pick_resolved(
    found: &[SocketAddrV4],
    port: u16,
    policy: &Policy,
    own: impl Fn(Ipv4Addr) -> bool,
) -> Result<SocketAddrV4, String> {
    let mut first_why = None;
    for a in found {
        let ip = *a.ip();
        let mine = own(ip);
        let class = screened(IpAddr::V4(ip)).or(mine.then_some("the node's own"));
        match class {
            None => return Ok(*a),
            Some(_) if policy.allows_address(ip, port, mine) => return Ok(*a),
            Some(class) => {
                first_why.get_or_insert_with(|| format!("it resolved to {ip}, {class}, which no address rule allows"));
            }
        }
    }
    Err(first_why.unwrap_or_else(|| "it resolved to no address".into()))
}

enum Refused {
    Denied,
    Protected,
    Screened(String),
    Failed(String),
}

/// The ports of the ledger's Redis: of each seed of a cluster (comma-separated), with its
/// cluster bus port (+10000).
fn redis_ports(url: &str) -> Vec<u16> {
    if !url.contains(',') {
        return vec![redis_port(url)];
    }
    let seeds = url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(redis_port);
    seeds.flat_map(|p| [Some(p), p.checked_add(10_000)]).flatten().collect()
}

fn redis_port(url: &str) -> u16 {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host_port = rest.split(['/', '?']).next().unwrap_or("");
    let host_port = host_port.rsplit_once('@').map_or(host_port, |(_, h)| h);
    host_port.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(6379)
}

/// Ends a connection with a reset: the client learns at once, nothing hangs. (A zero linger
/// does not block on drop: the kernel discards the buffers and sends RST.)
#[allow(deprecated)]
fn reset(stream: TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
    drop(stream);
}

async fn respond(stream: &mut TcpStream, status: u16, reason: &str, policy: Option<&str>, body: &str) {
    let policy = policy.map(|p| format!("x-sandpool-egress-policy: {p}\r\n")).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n{policy}content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Reads up to the end of an HTTP head; returns it and what came after it.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok(Some((buf, rest)));
        }
        if buf.len() > MAX_HEAD {
            return Ok(None);
        }
    }
}

/// An HTTP proxy request's target.
#[derive(Debug, PartialEq, Eq)]
struct ProxyRequest {
    connect: bool,
    dest: Dest,
    port: u16,
    /// The request line in origin form (absolute-URL requests).
    origin_line: String,
}

impl ProxyRequest {
    fn parse(head: &[u8]) -> Result<ProxyRequest, String> {
        let text = std::str::from_utf8(head).map_err(|_| "the request head is not UTF-8".to_string())?;
        let line = text.lines().next().unwrap_or("");
        let mut parts = line.split(' ');
        let (Some(method), Some(target), Some(version), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(format!("not an HTTP request line: {line:?}"));
        };
        if !version.starts_with("HTTP/1.") {
            return Err(format!("unsupported protocol {version:?}"));
        }
        if method == "CONNECT" {
            let (dest, port) = authority(target, None)?;
            return Ok(ProxyRequest { connect: true, dest, port, origin_line: String::new() });
        }
        let Some(rest) = target.strip_prefix("http://") else {
            return Err(format!("a proxy request needs an absolute http:// URL or CONNECT, not {target:?}"));
        };
        let (auth, path) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let path = if path.starts_with('?') { format!("/{path}") } else { path.to_string() };
        let (dest, port) = authority(auth, Some(80))?;
        Ok(ProxyRequest { connect: false, dest, port, origin_line: format!("{method} {path} {version}") })
    }

    /// The head to send upstream: the origin-form request line, the client's headers without
    /// the proxy's own, and `connection: close` (one request per proxied connection).
    fn origin_head(&self, head: &[u8]) -> Vec<u8> {
        let text = String::from_utf8_lossy(head);
        let mut out = format!("{}\r\n", self.origin_line);
        for h in text.split("\r\n").skip(1).filter(|h| !h.is_empty()) {
            let lower = h.to_ascii_lowercase();
            if lower.starts_with("proxy-") || lower.starts_with("connection:") || lower.starts_with("keep-alive:") {
                continue;
            }
            out.push_str(h);
            out.push_str("\r\n");
        }
        out.push_str("connection: close\r\n\r\n");
        out.into_bytes()
    }
}

/// `host:port` (or `host` with `default_port`): an IPv4 address or a name.
fn authority(s: &str, default_port: Option<u16>) -> Result<(Dest, u16), String> {
    let s = s.rsplit_once('@').map_or(s, |(_, h)| h);
    if s.starts_with('[') {
        return Err("IPv6 destinations are not supported".into());
    }
    let (host, port) = match (s.rsplit_once(':'), default_port) {
        (Some((h, p)), _) => (h, p.parse::<u16>().map_err(|_| format!("{s:?}: bad port"))?),
        (None, Some(p)) => (s, p),
        (None, None) => return Err(format!("{s:?}: CONNECT needs host:port")),
    };
    if host.is_empty() {
        return Err(format!("{s:?}: no host"));
    }
    let dest = match host.parse::<Ipv4Addr>() {
        Ok(ip) => Dest::Ip(ip),
        Err(_) => Dest::Name(host.trim_end_matches('.').to_ascii_lowercase()),
    };
    Ok((dest, port))
}

/// Where a redirected connection was going (`SO_ORIGINAL_DST`).
fn original_destination(stream: &TcpStream) -> std::io::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd as _;
    let mut addr =
        libc::sockaddr_in { sin_family: 0, sin_port: 0, sin_addr: libc::in_addr { s_addr: 0 }, sin_zero: [0; 8] };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `addr` is a valid, writable sockaddr_in and `len` its size; the kernel writes at
    // most `len` bytes and the fd is a live socket owned by `stream`.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)), u16::from_be(addr.sin_port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_requests_name_their_destination() {
        let r = ProxyRequest::parse(b"CONNECT task.test:8443 HTTP/1.1\r\nHost: task.test:8443\r\n\r\n").unwrap();
        assert_eq!((r.connect, r.dest, r.port), (true, Dest::Name("task.test".into()), 8443));
        let head = b"GET http://Task.Test/a/b?c=1 HTTP/1.1\r\nHost: task.test\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n";
        let r = ProxyRequest::parse(head).unwrap();
        assert_eq!((r.connect, r.dest.clone(), r.port), (false, Dest::Name("task.test".into()), 80));
        let sent = String::from_utf8(r.origin_head(head)).unwrap();
        assert_eq!(sent, "GET /a/b?c=1 HTTP/1.1\r\nHost: task.test\r\nAccept: */*\r\nconnection: close\r\n\r\n");
        let r = ProxyRequest::parse(b"GET http://127.0.0.2:8080 HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!(
            (r.dest, r.port, r.origin_line.as_str()),
            (Dest::Ip(Ipv4Addr::new(127, 0, 0, 2)), 8080, "GET / HTTP/1.0")
        );
        for bad in [
            &b"GET /relative HTTP/1.1\r\n\r\n"[..],
            b"CONNECT host HTTP/1.1\r\n\r\n",
            b"CONNECT [::1]:80 HTTP/1.1\r\n\r\n",
            b"garbage\r\n\r\n",
        ] {
            assert!(ProxyRequest::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_name_resolved_on_the_host_reaches_no_screened_address_an_address_rule_does_not_allow() {
        let a = |s: &str| SocketAddrV4::new(s.parse().unwrap(), 443);
        let own = |ip: Ipv4Addr| ip == Ipv4Addr::new(203, 0, 113, 7);
        let p = Policy::new("p", &["*.tenant.test:443".into(), "10.9.0.0/16:443".into()]).unwrap();
        // The metadata service, the LAN, the host's loopback and public address: refused.
        for bad in ["169.254.169.254", "192.168.1.1", "127.0.0.1", "203.0.113.7", "100.64.0.1"] {
            let why = pick_resolved(&[a(bad)], 443, &p, own).unwrap_err();
            assert!(why.contains(bad), "{why}");
        }
        // The first usable answer is taken, screened ones skipped.
        assert_eq!(pick_resolved(&[a("169.254.169.254"), a("192.0.2.10")], 443, &p, own), Ok(a("192.0.2.10")));
        // An address rule covering a private address opens it to names too.
        assert_eq!(pick_resolved(&[a("10.9.1.2")], 443, &p, own), Ok(a("10.9.1.2")));
        // The node's own only through a /32.
        let exact = Policy::new("e", &["*.tenant.test:443".into(), "203.0.113.7:443".into()]).unwrap();
        assert_eq!(pick_resolved(&[a("203.0.113.7")], 443, &exact, own), Ok(a("203.0.113.7")));
        let wide = Policy::new("w", &["*.tenant.test:443".into(), "0.0.0.0/0".into()]).unwrap();
        assert!(pick_resolved(&[a("203.0.113.7")], 443, &wide, own).is_err());
    }

    #[test]
    fn the_nodes_own_services_and_other_sandboxes_are_protected() {
        let p = Protected { ports: vec![6379, 8081], nets: vec![(Ipv4Addr::new(172, 30, 0, 0), 16)] };
        assert!(p.covers(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 6379)));
        assert!(p.covers(SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 8081)));
        assert!(p.covers(SocketAddrV4::new(Ipv4Addr::new(172, 30, 0, 9), 80)), "another sandbox");
        assert!(!p.covers(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 18080)), "a test server on loopback");
        assert!(!p.covers(SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 6379)), "another host's Redis");
        assert_eq!(redis_port("redis://127.0.0.1:6390/0"), 6390);
        assert_eq!(redis_port("redis://:pw@redis.internal"), 6379);
        assert_eq!(redis_ports("redis://127.0.0.1:6390/0"), [6390]);
        assert_eq!(redis_ports("redis://a:7001,redis://b:7002"), [7001, 17001, 7002, 17002]);
    }
}
