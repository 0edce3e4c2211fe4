//! The simulator end to end, through the public API: determinism, the acceptance bar, capacity.

use autoscaler::sim::bench::{self, Entry};
use autoscaler::sim::trace::{self, PeriodicSpec};
use autoscaler::sim::{NodeSpec, SimConfig, oracle, simulate};
use autoscaler::{Combined, Fixed, Policy, Reactive, ReactiveConfig};

#[test]
fn the_same_seed_gives_the_same_report() {
    // A small periodic trace, every policy of the benchmark.
    let spec = PeriodicSpec { burst: 200, bursts: 5, ..PeriodicSpec::default() };
    let cfg = SimConfig::default();
    let entries = bench::standard_entries();
    let a = bench::run_suite(&cfg, &trace::periodic(7, &spec), &entries);
    let b = bench::run_suite(&cfg, &trace::periodic(7, &spec), &entries);
    assert_eq!(a, b);
    let c = bench::run_suite(&cfg, &trace::periodic(8, &spec), &entries);
    assert_ne!(a, c, "another seed is another trace");
}

#[test]
fn combined_meets_the_bar_on_the_periodic_rl_trace() {
    // The trace: 1,000 episodes every 5 minutes, DSec episode lengths, 12 scored bursts.
    let cfg = SimConfig::default();
    for seed in 1..=2 {
        let trace = trace::periodic(seed, &PeriodicSpec::default());
        let floor = oracle(&trace, &cfg.nodes).idle_sandbox_s;
        for declare in [false, true] {
            let r = simulate(&cfg, &trace, &mut Combined::default(), declare);
            assert!(r.warm_pct >= 99.0, "seed {seed}, declared {declare}: {r:?}");
            assert!(r.idle_sandbox_s <= 1.5 * floor, "seed {seed}, declared {declare}: {r:?} vs oracle {floor}");
            assert_eq!((r.unserved, r.infeasible_reservations), (0, 0));
        }
        // The baselines beside it: a small fixed pool is cold, a reactive pool wastes.
        let fixed = simulate(&cfg, &trace, &mut Fixed(100), false);
        assert!(fixed.warm_pct < 20.0, "{fixed:?}");
        let kpa = simulate(&cfg, &trace, &mut Reactive::new(ReactiveConfig::knative()), false);
        assert!(kpa.idle_sandbox_s > 3.0 * floor, "{kpa:?}");
    }
}

#[test]
fn nodes_never_exceed_capacity() {
    // Tight nodes: 800 sandboxes each; a fixed pool of 1,000 would need more, so capacity binds.
    let node = NodeSpec { max_sandboxes: 800, ..NodeSpec::default() };
    let cfg = SimConfig { drain_limit_ms: 60_000, ..SimConfig::with_nodes(2, node) };
    let spec = PeriodicSpec { burst: 400, bursts: 6, ..PeriodicSpec::default() };
    let trace = trace::periodic(3, &spec);
    let policies: Vec<Box<dyn Policy>> = vec![Box::new(Fixed(1_000)), Box::new(Combined::default())];
    let peaks: Vec<u64> =
        policies.into_iter().map(|mut p| simulate(&cfg, &trace, p.as_mut(), true).peak_sandboxes).collect();
    assert_eq!(peaks[0], 1_600, "the fixed pool fills both nodes");
    assert!(peaks[1] <= 1_600, "{peaks:?}");
    let entries = [Entry { label: "combined", make: || Box::new(Combined::default()), declare: false }];
    let rows = bench::run_suite(&cfg, &trace, &entries);
    assert_eq!(rows.len(), 2);
    assert!(bench::markdown(&rows).contains("| combined |"));
}
