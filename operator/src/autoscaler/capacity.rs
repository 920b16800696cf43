//! What one replica group of a serving shape can do, learned online from its workers' own
//! step timings: a prefill step takes `a + b·tokens` seconds, a decode step `c + d·batch`.
//!
//! Each worker reports running sums over its steps (count, size, seconds, size², size ×
//! seconds, see `LoadReport`); the differences of two reports add to the service's sums, and
//! an ordinary least-squares line through them is the model. The sums are all the model
//! keeps, so they go to `status.autoscaling.capacity` and a restarted operator carries on
//! from them. A worker seen for the first time brings the passes its warm-up timed at
//! several sizes, which count while a kind has too few steps. Until enough steps with enough
//! spread in size were seen, the line is a conservative default: slower than any shape this
//! project serves, so that a fleet that has not been measured yet is over- rather than
//! under-provisioned.

use npufleet_contract::proto::npufleet::v1::{LoadReport, StepSums};
use npufleet_crds::{CapacityStatus, StepFit};

/// Steps of one kind before their fit replaces the default.
pub const MIN_STEPS: f64 = 20.0;

/// Step time as a line in the step's size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Line {
    pub intercept: f64,
    pub slope: f64,
}

impl Line {
    pub fn at(&self, size: f64) -> f64 {
        self.intercept + self.slope * size
    }
}

/// The conservative prefill line: 50 ms a step and 4 ms a prompt token (a 4,000-token prompt
/// takes 16 s; SmolLM2 on two CPU cores was measured at 2.8 ms).
pub const DEFAULT_PREFILL: Line = Line {
    intercept: 0.05,
    slope: 0.004,
};
/// The conservative decode line: 60 ms a step and 2 ms a running sequence.
pub const DEFAULT_DECODE: Line = Line {
    intercept: 0.06,
    slope: 0.002,
};

/// Least-squares sums of step seconds (y) against step size (x).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sums {
    pub n: f64,
    pub x: f64,
    pub y: f64,
    pub xx: f64,
    pub xy: f64,
}

impl Sums {
    /// The steps between reading `old` and reading `new` of the same worker; `None` when the
    /// worker's counters went back (it restarted), so nothing is known of that interval.
    pub fn between(old: &Sums, new: &Sums) -> Option<Sums> {
        let d = Sums {
            n: new.n - old.n,
            x: new.x - old.x,
            y: new.y - old.y,
            xx: new.xx - old.xx,
            xy: new.xy - old.xy,
        };
        let sane = [d.n, d.x, d.y, d.xx]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0)
            && d.xy.is_finite();
        sane.then_some(d)
    }

    pub fn add(&mut self, other: &Sums) {
        self.n += other.n;
        self.x += other.x;
        self.y += other.y;
        self.xx += other.xx;
        self.xy += other.xy;
    }

    /// The least-squares line, or `default` until `MIN_STEPS` steps are in. With too little
    /// spread in size for a slope (every step the same batch), the default's slope is kept
    /// and the intercept fitted to the mean. Neither coefficient goes below zero: a step
    /// never gets faster with more work.
    pub fn fit(&self, default: Line) -> (Line, bool) {
        if self.n < MIN_STEPS {
            return (default, false);
        }
        let mean_x = self.x / self.n;
        let mean_y = self.y / self.n;
        let var_x = self.xx / self.n - mean_x * mean_x;
        let cov = self.xy / self.n - mean_x * mean_y;
        let slope = if var_x > 1e-6 * mean_x.max(1.0).powi(2) {
            (cov / var_x).max(0.0)
        } else {
            default.slope
        };
        let intercept = (mean_y - slope * mean_x).max(0.0);
        if !(slope.is_finite() && intercept.is_finite()) {
            return (default, false);
        }
        (Line { intercept, slope }, true)
    }
}

/// The capacity model of one service: the sums of both step kinds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Capacity {
    pub prefill: Sums,
    pub decode: Sums,
}

impl Capacity {
    pub fn prefill(&self) -> Line {
        self.prefill.fit(DEFAULT_PREFILL).0
    }

    pub fn decode(&self) -> Line {
        self.decode.fit(DEFAULT_DECODE).0
    }

    /// The warm-up passes a worker reports, as a model of their own.
    pub fn of_warm_up(report: &LoadReport) -> Self {
        let sums = |steps: Option<&StepSums>| {
            steps.map_or_else(Sums::default, |s| {
                let s = Sums {
                    n: s.steps as f64,
                    x: s.size as f64,
                    y: s.seconds,
                    xx: s.size_squared,
                    xy: s.size_seconds,
                };
                Sums::between(&Sums::default(), &s).unwrap_or_default()
            })
        };
        Self {
            prefill: sums(report.warmup_prefill_steps.as_ref()),
            decode: sums(report.warmup_decode_steps.as_ref()),
        }
    }

    /// Adds a newly seen worker's warm-up passes to each kind with too few steps to fit yet:
    /// measured on this serving shape, they beat the conservative default; beside enough
    /// served steps they would only stand for an idle engine.
    pub fn seed(&mut self, warm_up: &Capacity) {
        if self.prefill.n < MIN_STEPS {
            self.prefill.add(&warm_up.prefill);
        }
        if self.decode.n < MIN_STEPS {
            self.decode.add(&warm_up.decode);
        }
    }

    /// The model as `status.autoscaling.capacity` keeps it.
    pub fn to_status(&self) -> CapacityStatus {
        let fit = |sums: &Sums, default| {
            let (line, learned) = sums.fit(default);
            StepFit {
                steps: sums.n,
                size_sum: sums.x,
                seconds_sum: sums.y,
                size_squared_sum: sums.xx,
                size_seconds_sum: sums.xy,
                intercept_seconds: line.intercept,
                seconds_per_unit: line.slope,
                learned,
            }
        };
        CapacityStatus {
            prefill: fit(&self.prefill, DEFAULT_PREFILL),
            decode: fit(&self.decode, DEFAULT_DECODE),
        }
    }

    /// The model a status kept; sums that are not finite and non-negative start over.
    pub fn from_status(status: &CapacityStatus) -> Self {
        let sums = |fit: &StepFit| {
            let s = Sums {
                n: fit.steps,
                x: fit.size_sum,
                y: fit.seconds_sum,
                xx: fit.size_squared_sum,
                xy: fit.size_seconds_sum,
            };
            Sums::between(&Sums::default(), &s).unwrap_or_default()
        };
        Self {
            prefill: sums(&status.prefill),
            decode: sums(&status.decode),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(line: Line, sizes: impl IntoIterator<Item = f64>) -> Sums {
        let mut sums = Sums::default();
        for x in sizes {
            let y = line.at(x);
            sums.add(&Sums {
                n: 1.0,
                x,
                y,
                xx: x * x,
                xy: x * y,
            });
        }
        sums
    }

    #[test]
    fn the_default_holds_until_enough_steps_then_the_line_is_recovered() {
        let truth = Line {
            intercept: 0.01,
            slope: 0.0004,
        };
        let few = steps(truth, (0..19).map(|i| f64::from(i) * 100.0));
        assert_eq!(few.fit(DEFAULT_PREFILL), (DEFAULT_PREFILL, false));
        let enough = steps(truth, (0..40).map(|i| f64::from(i) * 100.0));
        let (line, learned) = enough.fit(DEFAULT_PREFILL);
        assert!(learned);
        assert!((line.intercept - 0.01).abs() < 1e-9, "{line:?}");
        assert!((line.slope - 0.0004).abs() < 1e-12, "{line:?}");
    }

    #[test]
    fn steps_all_of_one_size_keep_the_default_slope_and_fit_the_level() {
        let one_size = steps(
            Line {
                intercept: 0.03,
                slope: 0.0,
            },
            std::iter::repeat_n(8.0, 50),
        );
        let (line, learned) = one_size.fit(DEFAULT_DECODE);
        assert!(learned);
        assert_eq!(line.slope, DEFAULT_DECODE.slope);
        assert!((line.at(8.0) - 0.03).abs() < 1e-9, "{line:?}");
    }

    #[test]
    fn a_worker_restart_is_not_a_negative_interval_and_the_status_round_trips() {
        let before = steps(DEFAULT_DECODE, [1.0, 2.0, 3.0]);
        let after = steps(DEFAULT_DECODE, [1.0]);
        assert_eq!(Sums::between(&before, &after), None);
        let d = Sums::between(&after, &before).unwrap();
        assert_eq!(d.n, 2.0);

        let capacity = Capacity {
            prefill: steps(DEFAULT_PREFILL, (0..30).map(f64::from)),
            decode: before,
        };
        let status = capacity.to_status();
        assert!(status.prefill.learned && !status.decode.learned);
        assert_eq!(Capacity::from_status(&status), capacity);
        let mut corrupt = status.clone();
        corrupt.decode.steps = -1.0;
        assert_eq!(Capacity::from_status(&corrupt).decode, Sums::default());
    }

    #[test]
    fn a_new_workers_warm_up_seeds_only_a_kind_with_too_few_steps() {
        let truth = Line {
            intercept: 0.02,
            slope: 0.0005,
        };
        let sizes = [16.0, 32.0, 64.0].repeat(10);
        let warm = steps(truth, sizes);
        let report = LoadReport {
            warmup_prefill_steps: Some(StepSums {
                steps: warm.n as u64,
                size: warm.x as u64,
                seconds: warm.y,
                size_squared: warm.xx,
                size_seconds: warm.xy,
            }),
            ..LoadReport::default()
        };
        let warm_up = Capacity::of_warm_up(&report);
        assert_eq!(warm_up.prefill, warm);
        assert_eq!(warm_up.decode, Sums::default());

        let mut fresh = Capacity::default();
        fresh.seed(&warm_up);
        let line = fresh.prefill();
        assert!((line.intercept - 0.02).abs() < 1e-9 && (line.slope - 0.0005).abs() < 1e-12);
        assert_eq!(
            fresh.decode(),
            DEFAULT_DECODE,
            "no decode passes: still the default"
        );

        let served = steps(DEFAULT_PREFILL, (0..30).map(f64::from));
        let mut learned = Capacity {
            prefill: served,
            ..Capacity::default()
        };
        learned.seed(&warm_up);
        assert_eq!(
            learned.prefill, served,
            "enough served steps are not diluted"
        );
    }
}
