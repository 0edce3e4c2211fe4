// One file because recording and reporting share the histogram types; a fifth of it is tests.
//! What a load run records: per-request timings measured from the *intended* send time (so a
//! generator that falls behind cannot hide latency: no coordinated omission), episode logs,
//! HDR histograms over them, and the report (human table and JSON).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::Instant;

/// Highest latency the histograms hold, in µs (one hour); larger values saturate.
const HIST_MAX_US: u64 = 3_600_000_000;
/// Significant figures of the histograms: 0.1 % resolution.
const HIST_SIGFIG: u8 = 3;

/// When one request was meant to go out, went out, and was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub intended: Instant,
    pub sent: Instant,
    pub done: Instant,
}

impl Timing {
    /// The latency the caller saw: from the intended send time, so time spent waiting to be
    /// sent (a full concurrency cap, a late timer) counts.
    pub fn latency(&self) -> Duration {
        self.done.saturating_duration_since(self.intended)
    }

    /// How late the generator sent it.
    pub fn send_lag(&self) -> Duration {
        self.sent.saturating_duration_since(self.intended)
    }
}

/// Whether a session got a pooled sandbox or one created for it (the baseline's `docker run`
/// is always cold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartKind {
    Warm,
    Cold,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The target answered with an error status.
    Status { code: u16, retry_after: bool, message: String },
    /// No answer within the request's deadline.
    Timeout,
    /// Connection or protocol failure, or an answer that could not be read.
    Transport(String),
    /// The docker CLI failed (baseline mode).
    Docker(String),
}

impl Failure {
    /// The key errors are counted under.
    pub fn kind(&self) -> String {
        match self {
            Failure::Status { code, .. } => format!("http {code}"),
            Failure::Timeout => "deadline".into(),
            Failure::Transport(_) => "transport".into(),
            Failure::Docker(_) => "docker".into(),
        }
    }

    fn message(&self) -> String {
        match self {
            Failure::Status { message, .. } | Failure::Transport(message) | Failure::Docker(message) => {
                message.chars().take(200).collect()
            }
            Failure::Timeout => "no answer within the request deadline".into(),
        }
    }
}

/// One request's timing and outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct OpLog<T> {
    pub timing: Timing,
    pub result: Result<T, Failure>,
}

/// Everything one episode did. `create` is `None` only if the run was stopped before it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpisodeLog {
    pub create: Option<OpLog<StartKind>>,
    /// Exec steps in order, each with the command's exit code; stops at the first failure.
    pub execs: Vec<OpLog<i32>>,
    pub delete: Option<OpLog<()>>,
    /// The run was stopped (Ctrl-C) before all planned steps ran.
    pub cancelled: bool,
}

impl EpisodeLog {
    /// Time to first command: create latency plus first exec latency, each from its intended
    /// time. The first exec is planned right after the create's answer, so this is the wall
    /// time from intended create to first answer, with the generator's own lag included.
    pub fn first_command(&self) -> Option<Duration> {
        let c = self.create.as_ref().filter(|c| c.result.is_ok())?;
        let e = self.execs.first().filter(|e| e.result.is_ok())?;
        Some(c.timing.latency() + e.timing.latency())
    }

    /// Whether any request of the episode failed.
    pub fn failed(&self) -> bool {
        self.create.as_ref().is_some_and(|c| c.result.is_err())
            || self.execs.iter().any(|e| e.result.is_err())
            || self.delete.as_ref().is_some_and(|d| d.result.is_err())
    }
}

fn histogram() -> Histogram<u64> {
    // Bounds are constants that hdrhistogram accepts; this cannot fail.
    Histogram::new_with_bounds(1, HIST_MAX_US, HIST_SIGFIG).expect("valid histogram bounds")
}

/// Summary of one histogram, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Stats {
    pub n: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Stats {
    fn of(h: &Histogram<u64>) -> Stats {
        if h.is_empty() {
            return Stats::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Stats {
            n: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
            mean_ms: h.mean() / 1000.0,
        }
    }
}

/// Which latency a histogram holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    Create,
    CreateWarm,
    CreateCold,
    FirstCommand,
    Exec,
    Delete,
    SendLag,
}

impl Metric {
    pub const ALL: [Metric; 7] = [
        Metric::Create,
        Metric::CreateWarm,
        Metric::CreateCold,
        Metric::FirstCommand,
        Metric::Exec,
        Metric::Delete,
        Metric::SendLag,
    ];

    /// Key in the JSON report.
    pub fn key(self) -> &'static str {
        match self {
            Metric::Create => "create",
            Metric::CreateWarm => "create_warm",
            Metric::CreateCold => "create_cold",
            Metric::FirstCommand => "first_command",
            Metric::Exec => "exec",
            Metric::Delete => "delete",
            Metric::SendLag => "send_lag",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Metric::Create => "session create (all)",
            Metric::CreateWarm => "session create, warm",
            Metric::CreateCold => "session create, cold",
            Metric::FirstCommand => "time to first command",
            Metric::Exec => "exec",
            Metric::Delete => "delete",
            Metric::SendLag => "send lag (generator)",
        }
    }
}

#[derive(Debug, Default, Clone)]
struct ErrorCount {
    count: u64,
    with_retry_after: u64,
    sample: String,
}

/// Accumulates episode logs into histograms and counters.
#[derive(Debug)]
pub struct Recorder {
    late: Duration,
    hist: BTreeMap<Metric, Histogram<u64>>,
    episodes: u64,
    failed: u64,
    cancelled: u64,
    requests: u64,
    late_sends: u64,
    warm: u64,
    cold: u64,
    nonzero_exit: u64,
    /// (op, kind) → count.
    errors: BTreeMap<(&'static str, String), ErrorCount>,
}

impl Recorder {
    /// `late`: a request sent more than this after its intended time counts as sent late.
    pub fn new(late: Duration) -> Recorder {
        Recorder {
            late,
            hist: Metric::ALL.iter().map(|m| (*m, histogram())).collect(),
            episodes: 0,
            failed: 0,
            cancelled: 0,
            requests: 0,
            late_sends: 0,
            warm: 0,
            cold: 0,
            nonzero_exit: 0,
            errors: BTreeMap::new(),
        }
    }

    fn add(&mut self, m: Metric, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        if let Some(h) = self.hist.get_mut(&m) {
            h.saturating_record(us);
        }
    }

    /// Common to every request: count it, its send lag, and its failure if any.
    fn op<T>(&mut self, op: &'static str, log: &OpLog<T>) -> bool {
        self.requests += 1;
        let lag = log.timing.send_lag();
        self.add(Metric::SendLag, lag);
        if lag > self.late {
            self.late_sends += 1;
        }
        match &log.result {
            Ok(_) => true,
            Err(f) => {
                let e = self.errors.entry((op, f.kind())).or_default();
                e.count += 1;
                if matches!(f, Failure::Status { retry_after: true, .. }) {
                    e.with_retry_after += 1;
                }
                if e.sample.is_empty() {
                    e.sample = f.message();
                }
                false
            }
        }
    }

    pub fn record(&mut self, ep: &EpisodeLog) {
        self.episodes += 1;
        if ep.cancelled {
            self.cancelled += 1;
        }
        if ep.failed() {
            self.failed += 1;
        }
        if let Some(c) = &ep.create
            && self.op("create", c)
        {
            let lat = c.timing.latency();
            self.add(Metric::Create, lat);
            match c.result {
                Ok(StartKind::Warm) => {
                    self.warm += 1;
                    self.add(Metric::CreateWarm, lat);
                }
                _ => {
                    self.cold += 1;
                    self.add(Metric::CreateCold, lat);
                }
            }
        }
        for e in &ep.execs {
            if self.op("exec", e) {
                self.add(Metric::Exec, e.timing.latency());
                if e.result.as_ref().is_ok_and(|code| *code != 0) {
                    self.nonzero_exit += 1;
                }
            }
        }
        if let Some(d) = &ep.delete
            && self.op("delete", d)
        {
            self.add(Metric::Delete, d.timing.latency());
        }
        if let Some(t) = ep.first_command() {
            self.add(Metric::FirstCommand, t);
        }
    }

    pub fn stats(&self, m: Metric) -> Stats {
        self.hist.get(&m).map(Stats::of).unwrap_or_default()
    }

    /// The report of a run of `planned` episodes that took `wall`.
    pub fn report(&self, target: &str, planned: usize, wall: Duration) -> Report {
        let creates = self.warm + self.cold;
        let mut overload = Overload::default();
        let errors = self
            .errors
            .iter()
            .map(|((op, kind), e)| {
                if kind == "http 429" {
                    overload.http_429 += e.count;
                } else if kind == "http 503" {
                    overload.http_503 += e.count;
                }
                if kind == "http 429" || kind == "http 503" {
                    overload.with_retry_after += e.with_retry_after;
                    overload.without_retry_after += e.count - e.with_retry_after;
                }
                ErrorRow { op: op.to_string(), kind: kind.clone(), count: e.count, sample: e.sample.clone() }
            })
            .collect();
        Report {
            target: target.to_string(),
            wall_s: wall.as_secs_f64(),
            episodes: Episodes {
                planned: planned as u64,
                started: self.episodes,
                failed: self.failed,
                cancelled: self.cancelled,
            },
            requests: self.requests,
            late_sends: self.late_sends,
            late_threshold_ms: self.late.as_secs_f64() * 1000.0,
            creates_warm: self.warm,
            creates_cold: self.cold,
            warm_pct: if creates == 0 { None } else { Some(100.0 * self.warm as f64 / creates as f64) },
            exec_nonzero_exit: self.nonzero_exit,
            latency: Metric::ALL.iter().map(|m| (m.key().to_string(), self.stats(*m))).collect(),
            errors,
            overload,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Episodes {
    pub planned: u64,
    pub started: u64,
    /// Episodes with at least one failed request.
    pub failed: u64,
    /// Episodes cut short because the run was stopped.
    pub cancelled: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ErrorRow {
    pub op: String,
    pub kind: String,
    pub count: u64,
    /// The first such error's message.
    pub sample: String,
}

/// Overload answers: 429 and 503, and whether they said when to come back.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Overload {
    pub http_429: u64,
    pub http_503: u64,
    pub with_retry_after: u64,
    pub without_retry_after: u64,
}

/// The result of one run against one target.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// `sandpool` or `docker` (the baseline).
    pub target: String,
    pub wall_s: f64,
    pub episodes: Episodes,
    pub requests: u64,
    /// Requests sent more than `late_threshold_ms` after their intended time.
    pub late_sends: u64,
    pub late_threshold_ms: f64,
    pub creates_warm: u64,
    pub creates_cold: u64,
    pub warm_pct: Option<f64>,
    /// Exec steps whose command exited non-zero (not a request failure).
    pub exec_nonzero_exit: u64,
    /// Latency summaries by metric key (`create`, `create_warm`, `create_cold`,
    /// `first_command`, `exec`, `delete`, `send_lag`), from intended send times.
    pub latency: BTreeMap<String, Stats>,
    pub errors: Vec<ErrorRow>,
    pub overload: Overload,
}

impl Report {
    pub fn get(&self, m: Metric) -> Stats {
        self.latency.get(m.key()).copied().unwrap_or_default()
    }

    /// The human summary: a header, a latency table, and the errors.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let e = &self.episodes;
        let _ = writeln!(
            s,
            "== {}: {} of {} episodes started, {} failed, {} cancelled; {} requests in {:.1} s",
            self.target, e.started, e.planned, e.failed, e.cancelled, self.requests, self.wall_s
        );
        let lag = self.get(Metric::SendLag);
        let _ = writeln!(
            s,
            "   sent late (> {:.0} ms after intended): {}; generator send lag p99 {:.2} ms, max {:.2} ms",
            self.late_threshold_ms, self.late_sends, lag.p99_ms, lag.max_ms
        );
        match self.warm_pct {
            Some(p) => {
                let _ = writeln!(s, "   warm {p:.1} % ({} warm, {} cold)", self.creates_warm, self.creates_cold);
            }
            None => {
                let _ = writeln!(s, "   warm: no session was created");
            }
        }
        let _ = writeln!(s, "| what | n | p50 ms | p99 ms | p99.9 ms | max ms | mean ms |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for m in
            [Metric::Create, Metric::CreateWarm, Metric::CreateCold, Metric::FirstCommand, Metric::Exec, Metric::Delete]
        {
            let st = self.get(m);
            if st.n == 0 && matches!(m, Metric::CreateWarm | Metric::CreateCold) {
                continue;
            }
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                m.label(),
                st.n,
                st.p50_ms,
                st.p99_ms,
                st.p999_ms,
                st.max_ms,
                st.mean_ms
            );
        }
        if self.exec_nonzero_exit > 0 {
            let _ = writeln!(s, "   exec steps whose command exited non-zero: {}", self.exec_nonzero_exit);
        }
        if self.errors.is_empty() {
            let _ = writeln!(s, "   errors: none");
        } else {
            let _ = writeln!(s, "   errors:");
            for r in &self.errors {
                let _ = writeln!(s, "     {} {} × {}: {}", r.op, r.kind, r.count, r.sample);
            }
            let o = &self.overload;
            if o.http_429 + o.http_503 > 0 {
                let _ = writeln!(
                    s,
                    "   overload: 429 × {}, 503 × {}; Retry-After present on {}, missing on {}",
                    o.http_429, o.http_503, o.with_retry_after, o.without_retry_after
                );
            }
        }
        s
    }
}

/// One line of the sandpool-vs-baseline comparison.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Ratio {
    pub what: String,
    pub sandpool_ms: f64,
    pub baseline_ms: f64,
    /// baseline / sandpool: how many times faster sandpool is.
    pub speedup: Option<f64>,
}

/// The ratios `--compare` prints: create-to-first-command p50 and p99, exec p50.
pub fn compare(sandpool: &Report, baseline: &Report) -> Vec<Ratio> {
    let row = |what: &str, m: Metric, pick: fn(&Stats) -> f64| {
        let (a, b) = (sandpool.get(m), baseline.get(m));
        let (a_ms, b_ms) = (pick(&a), pick(&b));
        let speedup = (a.n > 0 && b.n > 0 && a_ms > 0.0).then(|| b_ms / a_ms);
        Ratio { what: what.to_string(), sandpool_ms: a_ms, baseline_ms: b_ms, speedup }
    };
    vec![
        row("create to first command, p50", Metric::FirstCommand, |s| s.p50_ms),
        row("create to first command, p99", Metric::FirstCommand, |s| s.p99_ms),
        row("exec, p50", Metric::Exec, |s| s.p50_ms),
        row("exec, p99", Metric::Exec, |s| s.p99_ms),
    ]
}

pub fn render_ratios(rows: &[Ratio]) -> String {
    let mut s = String::from("== sandpool vs plain Docker (same schedule)\n");
    let _ = writeln!(s, "| what | sandpool ms | docker ms | docker / sandpool |");
    let _ = writeln!(s, "|---|---|---|---|");
    for r in rows {
        let x = r.speedup.map(|x| format!("{x:.1}x")).unwrap_or_else(|| "n/a".into());
        let _ = writeln!(s, "| {} | {:.2} | {:.2} | {x} |", r.what, r.sandpool_ms, r.baseline_ms);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A request meant for `t0 + at`, sent `lag` later, answered `took` after sending.
    fn timing(t0: Instant, at: u64, lag: u64, took: u64) -> Timing {
        let intended = t0 + ms(at);
        Timing { intended, sent: intended + ms(lag), done: intended + ms(lag + took) }
    }

    fn near(a: f64, b: f64) -> bool {
        (a - b).abs() <= b.abs() * 0.002 + 0.002
    }

    #[test]
    fn latency_counts_from_the_intended_time() {
        let t0 = Instant::now();
        // Sent 50 ms late, answered in 10 ms: the caller waited 60 ms.
        let t = timing(t0, 0, 50, 10);
        assert_eq!(t.latency(), ms(60));
        assert_eq!(t.send_lag(), ms(50));
        // On time.
        let t = timing(t0, 100, 0, 3);
        assert_eq!((t.latency(), t.send_lag()), (ms(3), Duration::ZERO));
    }

    #[test]
    fn first_command_adds_create_and_first_exec() {
        let t0 = Instant::now();
        let ep = EpisodeLog {
            create: Some(OpLog { timing: timing(t0, 0, 0, 4), result: Ok(StartKind::Warm) }),
            execs: vec![
                OpLog { timing: timing(t0, 4, 20, 2), result: Ok(0) },
                OpLog { timing: timing(t0, 300, 0, 2), result: Ok(0) },
            ],
            ..Default::default()
        };
        assert_eq!(ep.first_command(), Some(ms(4 + 22)));
        let failed_create = EpisodeLog {
            create: Some(OpLog { timing: timing(t0, 0, 0, 4), result: Err(Failure::Timeout) }),
            ..Default::default()
        };
        assert_eq!(failed_create.first_command(), None);
        assert!(failed_create.failed());
    }

    #[test]
    fn recorder_splits_warm_cold_and_counts_errors() {
        let t0 = Instant::now();
        let mut r = Recorder::new(ms(10));
        let ok = |start, lag| EpisodeLog {
            create: Some(OpLog { timing: timing(t0, 0, lag, 2), result: Ok(start) }),
            execs: vec![
                OpLog { timing: timing(t0, 2, 0, 1), result: Ok(0) },
                OpLog { timing: timing(t0, 100, 0, 1), result: Ok(1) },
            ],
            delete: Some(OpLog { timing: timing(t0, 101, 0, 1), result: Ok(()) }),
            cancelled: false,
        };
        r.record(&ok(StartKind::Warm, 0));
        r.record(&ok(StartKind::Warm, 0));
        r.record(&ok(StartKind::Cold, 30));
        let overloaded = |retry_after| EpisodeLog {
            create: Some(OpLog {
                timing: timing(t0, 0, 0, 5),
                result: Err(Failure::Status { code: 503, retry_after, message: "no sandbox".into() }),
            }),
            ..Default::default()
        };
        r.record(&overloaded(true));
        r.record(&overloaded(false));
        r.record(&EpisodeLog {
            create: Some(OpLog { timing: timing(t0, 0, 0, 5), result: Ok(StartKind::Warm) }),
            execs: vec![OpLog {
                timing: timing(t0, 5, 0, 5),
                result: Err(Failure::Status { code: 502, retry_after: false, message: "sandbox failed".into() }),
            }],
            delete: Some(OpLog { timing: timing(t0, 10, 0, 1), result: Ok(()) }),
            cancelled: false,
        });

        let rep = r.report("sandpool", 7, Duration::from_secs(1));
        assert_eq!(rep.episodes, Episodes { planned: 7, started: 6, failed: 3, cancelled: 0 });
        assert_eq!((rep.creates_warm, rep.creates_cold), (3, 1));
        assert_eq!(rep.warm_pct, Some(75.0));
        assert_eq!(rep.get(Metric::Create).n, 4);
        assert_eq!(rep.get(Metric::CreateWarm).n, 3);
        let cold = rep.get(Metric::CreateCold);
        assert_eq!(cold.n, 1);
        assert!(near(cold.max_ms, 32.0), "cold create counts its 30 ms send lag: {cold:?}");
        assert_eq!(rep.get(Metric::Exec).n, 6);
        assert_eq!(rep.exec_nonzero_exit, 3);
        assert_eq!(rep.get(Metric::FirstCommand).n, 3, "the failed first exec has none");
        assert_eq!(rep.late_sends, 1);
        assert_eq!(rep.requests, 3 * 4 + 2 + 3);
        let kinds: Vec<_> = rep.errors.iter().map(|e| (e.op.as_str(), e.kind.as_str(), e.count)).collect();
        assert_eq!(kinds, [("create", "http 503", 2), ("exec", "http 502", 1)]);
        assert_eq!(rep.overload, Overload { http_429: 0, http_503: 2, with_retry_after: 1, without_retry_after: 1 });
        assert!(rep.render().contains("Retry-After present on 1, missing on 1"));
    }

    #[test]
    fn percentiles_come_from_the_histogram() {
        let t0 = Instant::now();
        let mut r = Recorder::new(ms(10));
        for i in 1..=1000 {
            r.record(&EpisodeLog {
                create: Some(OpLog { timing: timing(t0, 0, 0, i), result: Ok(StartKind::Warm) }),
                ..Default::default()
            });
        }
        let s = r.stats(Metric::Create);
        assert_eq!(s.n, 1000);
        assert!(near(s.p50_ms, 500.0) && near(s.p99_ms, 990.0) && near(s.p999_ms, 999.0), "{s:?}");
        assert!(near(s.max_ms, 1000.0), "{s:?}");
    }

    #[test]
    fn ratios_are_baseline_over_sandpool() {
        let t0 = Instant::now();
        let report = |create, exec| {
            let mut r = Recorder::new(ms(10));
            r.record(&EpisodeLog {
                create: Some(OpLog { timing: timing(t0, 0, 0, create), result: Ok(StartKind::Warm) }),
                execs: vec![OpLog { timing: timing(t0, 0, 0, exec), result: Ok(0) }],
                ..Default::default()
            });
            r.report("x", 1, Duration::from_secs(1))
        };
        let rows = compare(&report(2, 2), &report(500, 100));
        assert_eq!(rows[0].what, "create to first command, p50");
        assert!(near(rows[0].speedup.unwrap(), 150.0), "{rows:?}");
        assert!(near(rows[2].speedup.unwrap(), 50.0), "{rows:?}");
        assert!(render_ratios(&rows).contains("150.0x"));
    }
}
