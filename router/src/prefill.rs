//! How far along one replica's prompts are: this router's requests there whose first token
//! has not come back, and a fit of first-token time against uncached prompt tokens, learnt
//! from the ones that started with no other prompt of this router's ahead of them.
//!
//! A count of prompts in their prefill cannot tell a prompt that just arrived from one a few
//! milliseconds from its first token; counted alike, a replica whose lone prompt has just
//! started looked better than one whose prompt was nearly done plus a decoding sequence, and
//! took the next request to wait behind the whole prefill.

use std::collections::HashMap;
use std::time::Instant;

/// A prompt still in its prefill, as the router sees it.
#[derive(Clone, Copy, Debug)]
struct Open {
    started: Instant,
    /// Prompt tokens the replica does not hold in its prefix cache (estimated).
    tokens: u32,
    /// No other prompt of this router's was in its prefill there when it started: its
    /// first-token time is its own prefill's.
    alone: bool,
}

/// A share below which a prompt past its expected prefill time is never counted: it has not
/// answered yet, so some of it is still ahead of the next prompt.
const OVERDUE_SHARE: f64 = 0.2;

#[derive(Debug, Default)]
pub struct Prefills {
    open: HashMap<u64, Open>,
    next: u64,
    fit: LineFit,
}

impl Prefills {
    /// Counts a prompt of `tokens` uncached tokens sent to the replica now; the id ends it.
    pub fn start(&mut self, tokens: u32, now: Instant) -> u64 {
        let id = self.next;
        self.next += 1;
        let alone = self.open.is_empty();
        self.open.insert(
            id,
            Open {
                started: now,
                tokens,
                alone,
            },
        );
        id
    }

    /// The prompt's first token came back at `now`: it is no longer ahead of the next one,
    /// and when it ran alone its time teaches the fit.
    pub fn first_token(&mut self, id: u64, now: Instant) {
        if let Some(open) = self.open.remove(&id)
            && open.alone
        {
            let took = now.saturating_duration_since(open.started);
            self.fit
                .observe(f64::from(open.tokens), took.as_secs_f64() * 1e3);
        }
    }

    /// The prompt left without a timed first token (failed, cancelled, answered whole): it
    /// teaches nothing.
    pub fn abandon(&mut self, id: u64) {
        self.open.remove(&id);
    }

    #[cfg(test)]
    pub fn in_prefill(&self) -> usize {
        self.open.len()
    }

    /// The prompts ahead of a new one at `now`, each counted by the share of its expected
    /// prefill time still to run (at least [`OVERDUE_SHARE`]); each counts whole until the
    /// fit has seen enough prompts.
    pub fn left(&self, now: Instant) -> f64 {
        self.open
            .values()
            .map(|open| match self.fit.predict(f64::from(open.tokens)) {
                Some(expected_ms) if expected_ms > 0.0 => {
                    let age_ms = now.saturating_duration_since(open.started).as_secs_f64() * 1e3;
                    (1.0 - age_ms / expected_ms).clamp(OVERDUE_SHARE, 1.0)
                }
                _ => 1.0,
            })
            .sum()
    }
}

/// Prompts a fit needs before its predictions are used.
const FIT_MIN_SAMPLES: u32 = 3;

/// How much each new prompt weighs in the fit once it has [`FIT_WINDOW`] behind it: recent
/// prompts count most, so the fit follows a replica whose speed changes (a busier batch, a
/// different mix of lengths).
const FIT_WINDOW: u32 = 32;

/// A least-squares line y = a + b·x over exponentially weighted moments; the intercept is
/// the fixed cost of a request (the router's hop, tokenising, the first step), the slope the
/// cost of a token. With no spread in x yet, the line goes through the origin.
#[derive(Debug, Default, Clone, Copy)]
struct LineFit {
    samples: u32,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl LineFit {
    fn observe(&mut self, x: f64, y: f64) {
        self.samples = self.samples.saturating_add(1);
        let weight = 1.0 / f64::from(self.samples.min(FIT_WINDOW));
        let blend = |mean: &mut f64, value: f64| *mean += weight * (value - *mean);
        blend(&mut self.x, x);
        blend(&mut self.y, y);
        blend(&mut self.xx, x * x);
        blend(&mut self.xy, x * y);
    }

    fn predict(&self, x: f64) -> Option<f64> {
        if self.samples < FIT_MIN_SAMPLES {
            return None;
        }
        let spread = self.xx - self.x * self.x;
        let slope = if spread > 1e-6 * self.xx.max(1.0) {
            ((self.xy - self.x * self.y) / spread).max(0.0)
        } else if self.x > 0.0 {
            self.y / self.x
        } else {
            0.0
        };
        let intercept = (self.y - slope * self.x).max(0.0);
        Some(intercept + slope * x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Teaches `prefills` lone prompts taking 20 ms plus 1 ms a token.
    fn taught(prefills: &mut Prefills, t0: Instant) {
        for (i, tokens) in [100u32, 300, 200, 50].into_iter().enumerate() {
            let start = t0 + ms(1000 * i as u64);
            let id = prefills.start(tokens, start);
            prefills.first_token(id, start + ms(20 + u64::from(tokens)));
        }
    }

    #[test]
    fn the_fit_learns_a_fixed_cost_and_a_cost_a_token() {
        let mut prefills = Prefills::default();
        let t0 = Instant::now();
        assert_eq!(prefills.fit.predict(100.0), None);
        taught(&mut prefills, t0);
        let expected = prefills.fit.predict(400.0).unwrap();
        assert!((expected - 420.0).abs() < 1.0, "{expected}");
        let through_origin = {
            let mut fit = LineFit::default();
            for _ in 0..3 {
                fit.observe(100.0, 50.0);
            }
            fit.predict(200.0).unwrap()
        };
        assert!((through_origin - 100.0).abs() < 1e-6, "{through_origin}");
    }

    #[test]
    fn a_prompt_counts_by_the_share_of_its_prefill_still_ahead() {
        let mut prefills = Prefills::default();
        let t0 = Instant::now();
        let id = prefills.start(180, t0);
        assert_eq!(
            prefills.left(t0 + ms(150)),
            1.0,
            "whole until the fit knows"
        );
        prefills.abandon(id);
        taught(&mut prefills, t0);
        let now = t0 + ms(10_000);
        // 200 ms expected: a quarter done, then three quarters, then overdue.
        prefills.start(180, now - ms(50));
        assert!((prefills.left(now) - 0.75).abs() < 0.01);
        assert!((prefills.left(now + ms(100)) - 0.25).abs() < 0.01);
        assert_eq!(prefills.left(now + ms(500)), OVERDUE_SHARE);
    }

    #[test]
    fn only_prompts_that_ran_alone_teach_the_fit() {
        let mut prefills = Prefills::default();
        let t0 = Instant::now();
        for i in 0..4u64 {
            let start = t0 + ms(1000 * i);
            let first = prefills.start(100, start);
            let queued = prefills.start(100, start);
            // The second waited behind the first: twice as long, not taught.
            prefills.first_token(first, start + ms(100));
            prefills.first_token(queued, start + ms(200));
        }
        assert!((prefills.fit.predict(100.0).unwrap() - 100.0).abs() < 1e-6);
        let abandoned = prefills.start(100, t0);
        prefills.abandon(abandoned);
        assert_eq!(prefills.in_prefill(), 0);
        assert!((prefills.fit.predict(100.0).unwrap() - 100.0).abs() < 1e-6);
    }
}
