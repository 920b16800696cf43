//! How far along a replica's prompts are: this router's requests there whose first token has
//! not come back ([`Prefills`], one per replica), and a fit of first-token time against
//! uncached prompt tokens ([`PrefillTimes`], one per model: its replicas run the same engine,
//! and one fit learns from all of them), from the prompts that started with no other prompt
//! of this router's ahead of them.
//!
//! A count of prompts in their prefill cannot tell a prompt that just arrived from one a few
//! milliseconds from its first token; counted alike, a replica whose lone prompt has just
//! started looked better than one whose prompt was nearly done plus a decoding sequence, and
//! took the next request to wait behind the whole prefill.

use std::collections::BTreeMap;
use std::time::Instant;

use npufleet_contract::scheduling::{LONG_PREFILL_TOKEN_THRESHOLD, LONGER_PROMPT_RATIO};

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
    /// By id, which is in the order they started.
    open: BTreeMap<u64, Open>,
    next: u64,
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

    /// The prompt's first token came back at `now`: it is no longer ahead of the next one.
    /// When it ran alone, its uncached tokens and first-token time in ms, to teach the fit.
    pub fn first_token(&mut self, id: u64, now: Instant) -> Option<(u32, f64)> {
        let open = self.open.remove(&id).filter(|open| open.alone)?;
        let took = now.saturating_duration_since(open.started);
        Some((open.tokens, took.as_secs_f64() * 1e3))
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

    /// The prompts ahead of a new one of `tokens` uncached tokens at `now`. In `prompts`
    /// the replica runs them first come, first served: a prompt's own time starts when the
    /// one ahead of it is expected to finish, so one waiting behind another still counts
    /// whole. The new prompt's wait follows the worker's order, the shortest first
    /// ([`LONGER_PROMPT_RATIO`]): it waits for the prompts not much longer than itself, and
    /// for a chunk of a longer one begun (`chunk`, the positions the replica computes of one
    /// prompt in a step as it reports them; else the workers' default,
    /// [`LONG_PREFILL_TOKEN_THRESHOLD`]), not the rest of it.
    pub fn ahead(
        &self,
        now: Instant,
        times: &PrefillTimes,
        tokens: u32,
        chunk: Option<u32>,
    ) -> Ahead {
        let mut prompts = 0.0;
        let mut wait_ms = Some(0.0);
        // When the prompt ahead is expected to finish, in ms from now.
        let mut ahead_done = f64::NEG_INFINITY;
        let chunk = chunk.unwrap_or(LONG_PREFILL_TOKEN_THRESHOLD as u32);
        let chunk_ms = times.expected_ms(chunk);
        let passed =
            |open: &Open| u64::from(open.tokens) > LONGER_PROMPT_RATIO as u64 * u64::from(tokens);
        for open in self.open.values() {
            let Some(expected) = times.expected_ms(open.tokens) else {
                prompts += 1.0;
                wait_ms = None;
                continue;
            };
            let age_ms = now.saturating_duration_since(open.started).as_secs_f64() * 1e3;
            let starts = (-age_ms).max(ahead_done);
            let done = (starts + expected).max(OVERDUE_SHARE * expected);
            let left_ms = done - starts.max(0.0);
            prompts += (left_ms / expected).clamp(OVERDUE_SHARE, 1.0);
            let waited_ms = if !passed(open) {
                left_ms
            } else if starts <= 0.0 {
                left_ms.min(chunk_ms.unwrap_or(left_ms))
            } else {
                0.0
            };
            wait_ms = wait_ms.map(|wait| wait + waited_ms);
            ahead_done = done;
        }
        Ahead { prompts, wait_ms }
    }
}

/// The prompts in their prefill ahead of a new one at a replica.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ahead {
    /// Each counted by the share of its expected prefill still to run (at least
    /// [`OVERDUE_SHARE`]), or whole until the fit has seen enough prompts.
    pub prompts: f64,
    /// How long the new prompt waits for those it does not pass, in ms from now; unknown
    /// until the fit has seen enough prompts.
    pub wait_ms: Option<f64>,
}

/// Prompts a fit needs before its predictions are used.
const FIT_MIN_SAMPLES: u32 = 3;

/// How much each new prompt weighs in the fit once it has [`FIT_WINDOW`] behind it: recent
/// prompts count most, so the fit follows a replica whose speed changes (a busier batch, a
/// different mix of lengths).
const FIT_WINDOW: u32 = 32;

/// The spread of uncached prompt lengths (standard deviation, in tokens) below which the fit
/// does not tell a fixed cost from a cost a token.
const MIN_SPREAD_TOKENS: f64 = 16.0;

/// A model's first-token time of a lone prompt against its uncached tokens.
#[derive(Debug, Default)]
pub struct PrefillTimes {
    fit: LineFit,
}

impl PrefillTimes {
    /// A prompt of `tokens` uncached tokens that ran alone answered after `ms`.
    pub fn observe(&mut self, tokens: u32, ms: f64) {
        self.fit.observe(f64::from(tokens), ms);
    }

    /// The expected first-token time, in ms, of a lone prompt of `tokens` uncached tokens,
    /// once the fit has seen enough prompts.
    pub fn expected_ms(&self, tokens: u32) -> Option<f64> {
        self.fit.predict(f64::from(tokens)).filter(|&ms| ms > 0.0)
    }
}

/// A least-squares line y = a + b·x over exponentially weighted moments; the intercept is
/// the fixed cost of a request (the router's hop, tokenising, the first step), the slope the
/// cost of a token. With prompts of too alike a length to tell the cost of a token
/// ([`MIN_SPREAD_TOKENS`]), the line goes through the origin; with prompts of almost no
/// uncached tokens there is no line: the prompts seen say nothing of what a long one costs.
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
        // Over a spread of a few tokens, the timing noise decides the slope: a fleet's first
        // prompts, all of one length, fitted a slope of 0, and every replica then looked as
        // fast for a prompt it held as for one it would compute whole. Dividing by what is
        // left of a spread that has decayed made slopes of millions of ms a token.
        let spread = self.xx - self.x * self.x;
        let fitted = (spread >= MIN_SPREAD_TOKENS * MIN_SPREAD_TOKENS)
            .then(|| (self.xy - self.x * self.y) / spread)
            .filter(|&slope| slope > 0.0);
        let slope = match fitted {
            Some(slope) => slope,
            None if self.x >= MIN_SPREAD_TOKENS => self.y / self.x,
            None => return None,
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

    /// Lone prompts through `prefills`, taking 20 ms plus 1 ms a token, taught to `times`.
    fn taught(prefills: &mut Prefills, times: &mut PrefillTimes, t0: Instant) {
        for (i, tokens) in [100u32, 300, 200, 50].into_iter().enumerate() {
            let start = t0 + ms(1000 * i as u64);
            let id = prefills.start(tokens, start);
            let (tokens, took) = prefills
                .first_token(id, start + ms(20 + u64::from(tokens)))
                .unwrap();
            times.observe(tokens, took);
        }
    }

    #[test]
    fn the_fit_learns_a_fixed_cost_and_a_cost_a_token() {
        let (mut prefills, mut times) = (Prefills::default(), PrefillTimes::default());
        assert_eq!(times.expected_ms(100), None);
        taught(&mut prefills, &mut times, Instant::now());
        let expected = times.expected_ms(400).unwrap();
        assert!((expected - 420.0).abs() < 1.0, "{expected}");
        let mut same_length = PrefillTimes::default();
        for _ in 0..3 {
            same_length.observe(100, 50.0);
        }
        let through_origin = same_length.expected_ms(200).unwrap();
        assert!((through_origin - 100.0).abs() < 1e-6, "{through_origin}");
    }

    #[test]
    fn a_spread_long_decayed_does_not_make_a_steep_line() {
        // One prompt of a few tokens, then hundreds of fully cached ones: what is left of its
        // spread is far below a token's, and they tell nothing of a long prompt's cost.
        let mut times = PrefillTimes::default();
        times.observe(2, 30.0);
        for _ in 0..600 {
            times.observe(0, 20.0);
        }
        for tokens in [0, 8, 500] {
            assert_eq!(times.expected_ms(tokens), None);
        }
    }

    #[test]
    fn prompts_of_nearly_one_length_make_no_flat_line() {
        // Short prompts a few tokens apart, whose times the noise decides: fitted, the slope
        // came out at or below 0, and a prompt of 300 uncached tokens looked as quick as one
        // of 20. Through the origin it costs more, as it must.
        let mut times = PrefillTimes::default();
        for (tokens, ms) in [(20, 27.0), (24, 25.0), (22, 26.0), (26, 24.0), (21, 26.5)] {
            times.observe(tokens, ms);
        }
        let (short, long) = (
            times.expected_ms(20).unwrap(),
            times.expected_ms(300).unwrap(),
        );
        assert!(long > 10.0 * short, "{short} ms and {long} ms");
    }

    #[test]
    fn a_prompt_counts_by_the_share_of_its_prefill_still_ahead() {
        let (mut prefills, mut times) = (Prefills::default(), PrefillTimes::default());
        let t0 = Instant::now();
        let id = prefills.start(180, t0);
        let unknown = prefills.ahead(t0 + ms(150), &times, 180, None);
        assert_eq!(unknown.prompts, 1.0, "whole until the fit knows");
        assert_eq!(unknown.wait_ms, None);
        prefills.abandon(id);
        taught(&mut prefills, &mut times, t0);
        let now = t0 + ms(10_000);
        // 200 ms expected: a quarter done, then three quarters, then overdue.
        prefills.start(180, now - ms(50));
        let share = |at| prefills.ahead(at, &times, 180, None).prompts;
        assert!((share(now) - 0.75).abs() < 0.01);
        assert!((share(now + ms(100)) - 0.25).abs() < 0.01);
        assert_eq!(share(now + ms(500)), OVERDUE_SHARE);
    }

    #[test]
    fn a_prompt_waiting_behind_another_counts_whole_unless_the_new_one_is_much_shorter() {
        let (mut prefills, mut times) = (Prefills::default(), PrefillTimes::default());
        let t0 = Instant::now();
        taught(&mut prefills, &mut times, t0);
        let now = t0 + ms(10_000);
        // Two 200 ms prompts sent 50 ms apart: the first has 100 ms left, the second has
        // not begun.
        prefills.start(180, now - ms(100));
        prefills.start(180, now - ms(50));
        let ahead = prefills.ahead(now, &times, 180, None);
        assert!((ahead.prompts - 1.5).abs() < 0.01, "{ahead:?}");
        assert!((ahead.wait_ms.unwrap() - 300.0).abs() < 0.5, "{ahead:?}");
        // A prompt less than half as long waits for the first only: the worker takes it
        // before the second. The load counts both alike.
        let short = prefills.ahead(now, &times, 20, None);
        assert!((short.wait_ms.unwrap() - 100.0).abs() < 0.5, "{short:?}");
        assert_eq!(short.prompts, ahead.prompts);
        // The first overdue: it still counts its least, and the second has not begun.
        let later = prefills.ahead(now + ms(300), &times, 180, None);
        assert!(
            (later.prompts - (OVERDUE_SHARE + 1.0)).abs() < 0.01,
            "{later:?}"
        );
        assert!((later.wait_ms.unwrap() - 240.0).abs() < 0.5, "{later:?}");
    }

    #[test]
    fn a_short_prompt_waits_for_a_chunk_of_a_long_prompt_begun() {
        let (mut prefills, mut times) = (Prefills::default(), PrefillTimes::default());
        let t0 = Instant::now();
        taught(&mut prefills, &mut times, t0);
        let now = t0 + ms(10_000);
        // 420 ms expected, 370 ms left; a chunk of the workers' default takes 148 ms.
        prefills.start(400, now - ms(50));
        let short = prefills.ahead(now, &times, 20, None);
        let chunk = 20.0 + LONG_PREFILL_TOKEN_THRESHOLD as f64;
        assert!((short.wait_ms.unwrap() - chunk).abs() < 0.5, "{short:?}");
        let alike = prefills.ahead(now, &times, 300, None);
        assert!((alike.wait_ms.unwrap() - 370.0).abs() < 0.5, "{alike:?}");
        // A replica that reports its chunk: a worker run with a threshold of 64 positions.
        let reported = prefills.ahead(now, &times, 20, Some(64));
        assert!(
            (reported.wait_ms.unwrap() - 84.0).abs() < 0.5,
            "{reported:?}"
        );
    }

    #[test]
    fn only_prompts_that_ran_alone_are_timed() {
        let mut prefills = Prefills::default();
        let t0 = Instant::now();
        let first = prefills.start(100, t0);
        let queued = prefills.start(120, t0);
        // The second waited behind the first: not its own prefill's time.
        assert_eq!(
            prefills.first_token(first, t0 + ms(100)),
            Some((100, 100.0))
        );
        assert_eq!(prefills.first_token(queued, t0 + ms(200)), None);
        let abandoned = prefills.start(100, t0);
        prefills.abandon(abandoned);
        assert_eq!(prefills.in_prefill(), 0);
        assert_eq!(prefills.first_token(abandoned, t0 + ms(300)), None);
    }
}
