//! The combined policy: reservations first, then learned bursts, then reactive demand, fitted to capacity.
//!
//! Per template, the three tiers ask for idle sandboxes; the pool's target is the largest ask, and the
//! capacity step ([`fit_to_capacity`]) places the reservation's part first (with the template's configured
//! warm floor, `min_idle`), then what the forecast adds on top, then what reactive demand adds on top of both.

use serde::{Deserialize, Serialize};

use super::{
    BurstForecast, LearnedBursts, LearnedConfig, Policy, Reactive, ReactiveConfig, ReservationConfig, Targets,
    TemplateTargets, fit_to_capacity, plan_reservations,
};
use crate::signals::Observation;

/// Tuning of [`Combined`]: one section per tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CombinedConfig {
    /// The reactive tier ([`ReactiveConfig::lean`] by default: bursts are the other tiers' job).
    pub reactive: ReactiveConfig,
    /// The forecast tier.
    pub learned: LearnedConfig,
    /// The reservation tier.
    pub reservations: ReservationConfig,
}

impl Default for CombinedConfig {
    fn default() -> Self {
        Self {
            reactive: ReactiveConfig::lean(),
            learned: LearnedConfig::default(),
            reservations: ReservationConfig::default(),
        }
    }
}

/// Reservations, then learned bursts, then reactive, within node capacity. The policy `sandpool` runs.
#[derive(Debug)]
pub struct Combined {
    cfg: CombinedConfig,
    reactive: Reactive,
    learned: LearnedBursts,
    /// What each tier asked for in the last decision (before fitting), for the metrics.
    asks: Asks,
}

/// Each tier's ask of one decision, by template, before the capacity step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Asks {
    /// Reservations, with the configured warm floor.
    pub reservations: TemplateTargets,
    /// The learned-burst forecast.
    pub forecast: TemplateTargets,
    /// Reactive demand.
    pub reactive: TemplateTargets,
}

impl Default for Combined {
    fn default() -> Self {
        Self::new(CombinedConfig::default())
    }
}

impl Combined {
    /// A combined policy with this tuning.
    pub fn new(cfg: CombinedConfig) -> Self {
        Self {
            reactive: Reactive::new(cfg.reactive.clone()),
            learned: LearnedBursts::new(cfg.learned.clone()),
            asks: Asks::default(),
            cfg,
        }
    }

    /// What each tier asked for in the last decision, by template (before the capacity step).
    pub fn asks(&self) -> &Asks {
        &self.asks
    }

    /// The burst forecasts made by the last decision, by template.
    pub fn forecasts(&self) -> &std::collections::BTreeMap<String, BurstForecast> {
        self.learned.forecasts()
    }
}

impl Policy for Combined {
    fn name(&self) -> String {
        "combined".into()
    }

    fn decide(&mut self, obs: &Observation) -> Targets {
        let plan = plan_reservations(obs, &self.cfg.reservations);
        let learned = self.learned.desired_idle(obs);
        let reactive = self.reactive.desired_idle(obs);
        let mut reserved = plan.targets;
        for (t, s) in &obs.templates {
            if s.min_idle > 0 {
                let r = reserved.entry(t.clone()).or_insert(0);
                *r = (*r).max(s.min_idle);
            }
        }
        let mut forecast = TemplateTargets::new();
        for (t, &n) in &learned {
            let extra = n.saturating_sub(reserved.get(t).copied().unwrap_or(0));
            if extra > 0 {
                forecast.insert(t.clone(), extra);
            }
        }
        let mut demand = TemplateTargets::new();
        for (t, &n) in &reactive {
            let above = reserved.get(t).copied().unwrap_or(0).max(learned.get(t).copied().unwrap_or(0));
            let extra = n.saturating_sub(above);
            if extra > 0 {
                demand.insert(t.clone(), extra);
            }
        }
        let idle = fit_to_capacity(obs, &[reserved.clone(), forecast, demand]);
        self.asks = Asks { reservations: reserved, forecast: learned, reactive };
        Targets { idle, reservations: plan.statuses }
    }
}
