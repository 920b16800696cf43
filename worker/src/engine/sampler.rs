//! Token sampling: greedy, temperature, top-k, top-p and min-p, each sequence with its own
//! seeded random stream, so a request's output depends only on its logits and its seed, never
//! on which other requests shared its batches.
//!
//! Before a token is drawn the row of logits may be adjusted, in vLLM's order: the ids that
//! would end the request are masked until `min_tokens` are generated, then the repetition,
//! frequency and presence penalties apply, then temperature and min-p, then top-k and top-p.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::api::{SamplingParams, SubmitError};

/// Refuses settings the sampler cannot run with, naming the field.
pub fn check(params: &SamplingParams) -> Result<(), SubmitError> {
    let within = |param: &'static str, value: f32, ok: bool, wanted: &str| {
        if ok {
            Ok(())
        } else {
            Err(SubmitError::invalid(
                param,
                format!("{param} must be {wanted}, got {value}"),
            ))
        }
    };
    let t = params.temperature;
    within(
        "temperature",
        t,
        t.is_finite() && t >= 0.0,
        "a finite number ≥ 0",
    )?;
    let p = params.top_p;
    within("top_p", p, p > 0.0 && p <= 1.0, "in (0, 1]")?;
    let m = params.min_p;
    within("min_p", m, (0.0..=1.0).contains(&m), "in [0, 1]")?;
    let r = params.repetition_penalty;
    within(
        "repetition_penalty",
        r,
        r.is_finite() && r > 0.0,
        "a finite number > 0",
    )?;
    for (param, value) in [
        ("presence_penalty", params.presence_penalty),
        ("frequency_penalty", params.frequency_penalty),
    ] {
        within(param, value, (-2.0..=2.0).contains(&value), "in [-2, 2]")?;
    }
    Ok(())
}

/// The penalties of one request; all zero (and a repetition penalty of 1) changes nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

impl Penalties {
    fn of(params: &SamplingParams) -> Self {
        Self {
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
        }
    }

    fn apply(self) -> bool {
        self.repetition != 1.0 || self.presence != 0.0 || self.frequency != 0.0
    }
}

/// The tokens a sequence has seen, as the penalties read them.
#[derive(Debug, Default)]
pub struct History {
    /// Distinct ids of the prompt.
    prompt: HashSet<u32>,
    /// How often each id occurs in the output.
    output: HashMap<u32, u32>,
}

impl History {
    pub fn new(prompt: &[u32]) -> Self {
        Self {
            prompt: prompt.iter().copied().collect(),
            output: HashMap::new(),
        }
    }

    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_default() += 1;
    }
}

/// vLLM's penalties: the repetition penalty over every id of the prompt or the output, then
/// the frequency and presence penalties over the output's ids.
pub fn apply_penalties(logits: &mut [f32], history: &History, penalties: Penalties) {
    if penalties.repetition != 1.0 {
        let output_only = history
            .output
            .keys()
            .filter(|id| !history.prompt.contains(id));
        for &id in history.prompt.iter().chain(output_only) {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit = if *logit > 0.0 {
                    *logit / penalties.repetition
                } else {
                    *logit * penalties.repetition
                };
            }
        }
    }
    for (&id, &count) in &history.output {
        if let Some(logit) = logits.get_mut(id as usize) {
            *logit -= penalties.frequency * count as f32 + penalties.presence;
        }
    }
}

/// Makes `ids` impossible to sample.
pub fn mask(logits: &mut [f32], ids: &[u32]) {
    for &id in ids {
        if let Some(logit) = logits.get_mut(id as usize) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// Masks every token whose probability at `temperature` is below `min_p` times the most
/// likely token's. Such a token's logit is more than `temperature * ln(1 / min_p)` below the
/// largest.
pub fn apply_min_p(logits: &mut [f32], min_p: f32, temperature: f32) {
    if min_p <= 0.0 {
        return;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let threshold = max + temperature * min_p.ln();
    for logit in logits.iter_mut() {
        if *logit < threshold {
            *logit = f32::NEG_INFINITY;
        }
    }
}

pub struct Sampler {
    temperature: f32,
    /// 0 means no top-k cut.
    top_k: usize,
    top_p: f32,
    min_p: f32,
    penalties: Penalties,
    /// Kept only while the penalties need it.
    history: History,
    /// The ids that would end the request, masked until `min_tokens` are generated.
    end_ids: Vec<u32>,
    min_tokens: usize,
    generated: usize,
    rng: StdRng,
    /// The adjusted row of logits, reused by every step that adjusts one.
    adjusted: Vec<f32>,
}

impl Sampler {
    /// `params` must pass [`check`]. `end_ids` are the ids that end the request (the model's
    /// end-of-sequence ids unless ignored, and the requested stop ids). Every token this
    /// sampler returns must be appended to the sequence: the penalties and `min_tokens`
    /// count them.
    pub fn new(params: &SamplingParams, prompt: &[u32], end_ids: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        let penalties = Penalties::of(params);
        Self {
            temperature: params.temperature,
            top_k: params.top_k as usize,
            top_p: params.top_p,
            min_p: params.min_p,
            penalties,
            history: if penalties.apply() {
                History::new(prompt)
            } else {
                History::default()
            },
            end_ids: end_ids.to_vec(),
            min_tokens: params.min_tokens as usize,
            generated: 0,
            rng,
            adjusted: Vec::new(),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn masks_end_ids(&self) -> bool {
        self.generated < self.min_tokens && !self.end_ids.is_empty()
    }

    fn adjusts_logits(&self) -> bool {
        self.masks_end_ids() || self.penalties.apply() || (self.min_p > 0.0 && !self.is_greedy())
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = if self.adjusts_logits() {
            let mut adjusted = std::mem::take(&mut self.adjusted);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            if self.masks_end_ids() {
                mask(&mut adjusted, &self.end_ids);
            }
            if self.penalties.apply() {
                apply_penalties(&mut adjusted, &self.history, self.penalties);
            }
            if !self.is_greedy() {
                apply_min_p(&mut adjusted, self.min_p, self.temperature);
            }
            let token = self.draw(&adjusted);
            self.adjusted = adjusted;
            token
        } else {
            self.draw(logits)
        };
        self.generated += 1;
        if self.penalties.apply() {
            self.history.push(token);
        }
        token
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        let inv_temperature = 1.0 / f64::from(self.temperature);
        let weight = |logit: f32| (f64::from(logit - max) * inv_temperature).exp();
        let vocab = logits.len();
        let top_k = if self.top_k == 0 {
            vocab
        } else {
            self.top_k.min(vocab)
        };

        if top_k == vocab && self.top_p >= 1.0 {
            let total: f64 = logits.iter().map(|&l| weight(l)).sum();
            let target = self.rng.random::<f64>() * total;
            let mut cumulative = 0.0;
            for (id, &logit) in logits.iter().enumerate() {
                cumulative += weight(logit);
                if cumulative > target {
                    return id as u32;
                }
            }
            return argmax(logits);
        }

        // Candidates in descending order of probability. Top-p needs only as many of the
        // most likely tokens as it takes to cover its mass, so widen a partial sort until
        // they do instead of sorting the whole vocabulary.
        let total: f64 = if top_k == vocab {
            logits.iter().map(|&l| weight(l)).sum()
        } else {
            0.0
        };
        let mut width = if top_k == vocab { 64.min(vocab) } else { top_k };
        let candidates = loop {
            let candidates = top_indices(logits, width);
            let mass_needed = if top_k == vocab {
                f64::from(self.top_p) * total
            } else {
                let top_k_total: f64 = candidates.iter().map(|&i| weight(logits[i])).sum();
                f64::from(self.top_p) * top_k_total
            };
            let mut cumulative = 0.0;
            let covering = candidates.iter().position(|&i| {
                cumulative += weight(logits[i]);
                cumulative >= mass_needed
            });
            match covering {
                Some(last) => break candidates[..=last].to_vec(),
                None if width == top_k => break candidates,
                None => width = (width * 4).min(top_k),
            }
        };
        let kept: f64 = candidates.iter().map(|&i| weight(logits[i])).sum();
        let target = self.rng.random::<f64>() * kept;
        let mut cumulative = 0.0;
        for &id in &candidates {
            cumulative += weight(logits[id]);
            if cumulative > target {
                return id as u32;
            }
        }
        candidates[0] as u32
    }
}

/// The highest logit's id; the lowest id wins a tie. NaN logits are never chosen over
/// numbers.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes, the maximum and then its first position, so that each loop is a plain
    // lane-wise compare the compiler vectorises: greedy decoding runs this over the whole
    // vocabulary for every sequence of every step. NaN never wins either comparison.
    const LANES: usize = 16;
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The ids of the `n` largest logits, largest first, ties broken by lower id.
fn top_indices(logits: &[f32], n: usize) -> Vec<usize> {
    let descending = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n, descending);
        ids.truncate(n);
    }
    ids.sort_unstable_by(descending);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    fn sampler(params: &SamplingParams) -> Sampler {
        Sampler::new(params, &[], &[])
    }

    fn histogram(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(logits) as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut sampler = sampler(&params(0.0, 0, 1.0, 1));
        assert_eq!(sampler.sample(&[0.1, 3.0, -1.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), 0);
        // Past one vector of lanes: the first of two equal maxima, whichever lane holds it.
        let mut long: Vec<f32> = (0..100).map(|i| (i % 7) as f32).collect();
        long[37] = 9.0;
        long[21] = 9.0;
        assert_eq!(argmax(&long), 21);
        long.push(10.0);
        assert_eq!(argmax(&long), 100);
    }

    #[test]
    fn same_seed_gives_the_same_stream() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let draw = |seed| {
            let mut sampler = sampler(&params(0.8, 40, 0.9, seed));
            (0..50).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln(), f32::NEG_INFINITY];
        let mut sampler = sampler(&params(1.0, 0, 1.0, 3));
        let counts = histogram(&mut sampler, &logits, 8000);
        // Expected shares 1/8, 2/8, 5/8, 0.
        assert_eq!(counts[3], 0);
        assert!(
            (counts[0] as f64 / 8000.0 - 0.125).abs() < 0.02,
            "{counts:?}"
        );
        assert!(
            (counts[1] as f64 / 8000.0 - 0.25).abs() < 0.02,
            "{counts:?}"
        );
        assert!(
            (counts[2] as f64 / 8000.0 - 0.625).abs() < 0.02,
            "{counts:?}"
        );
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
        let mut top2 = sampler(&params(1.0, 2, 1.0, 5));
        let counts = histogram(&mut top2, &logits, 2000);
        assert_eq!(&counts[2..], &[0, 0]);
        assert!(counts[0] > 0 && counts[1] > 0);

        // 0.4 + 0.3 reaches 0.7: the top-p set is the two most likely tokens.
        let mut nucleus = sampler(&params(1.0, 0, 0.7, 5));
        let counts = histogram(&mut nucleus, &logits, 2000);
        assert_eq!(&counts[2..], &[0, 0]);

        // Top-p applies to the renormalised top-k set: within {0.4, 0.3}, 0.5 needs only
        // the first.
        let mut both = sampler(&params(1.0, 2, 0.5, 5));
        let counts = histogram(&mut both, &logits, 500);
        assert_eq!(counts, vec![500, 0, 0, 0]);
    }

    #[test]
    fn top_p_widens_past_the_first_candidates() {
        // 1000 equally likely tokens: top_p 0.5 needs 500 of them, beyond the first 64.
        let logits = vec![0.0f32; 1000];
        let mut sampler = sampler(&params(1.0, 0, 0.5, 11));
        let counts = histogram(&mut sampler, &logits, 4000);
        assert!(counts[..500].iter().filter(|&&c| c > 0).count() > 400);
        assert_eq!(counts[500..].iter().sum::<usize>(), 0);
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let base = SamplingParams::default;
        for (params, param) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..base()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.5,
                    ..base()
                },
                "frequency_penalty",
            ),
        ] {
            match check(&params) {
                Err(SubmitError::Invalid {
                    param: Some(named),
                    message,
                }) => {
                    assert_eq!(named, param);
                    assert!(message.starts_with(param), "{message}");
                }
                other => panic!("{param}: {other:?}"),
            }
        }
        assert_eq!(check(&base()), Ok(()));
        assert_eq!(
            check(&SamplingParams {
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                min_p: 1.0,
                ..base()
            }),
            Ok(())
        );
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        // Token 0 is in the prompt and twice in the output, 1 only in the output, 2 only in
        // the prompt, 3 nowhere.
        let mut history = History::new(&[0, 2, 2]);
        for token in [0, 1, 0] {
            history.push(token);
        }
        let mut logits = vec![4.0, -1.0, 3.0, 5.0];
        let penalties = Penalties {
            repetition: 2.0,
            presence: 0.0,
            frequency: 0.0,
        };
        apply_penalties(&mut logits, &history, penalties);
        assert_eq!(logits, vec![2.0, -2.0, 1.5, 5.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_count_the_output_only() {
        let mut history = History::new(&[2]);
        for token in [0, 0, 0, 1] {
            history.push(token);
        }
        let mut logits = vec![1.0, 1.0, 1.0];
        let penalties = Penalties {
            repetition: 1.0,
            presence: 0.5,
            frequency: 0.25,
        };
        apply_penalties(&mut logits, &history, penalties);
        assert_eq!(logits, vec![1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0]);
        // A negative penalty favours what was said.
        let mut logits = vec![0.0, 0.0, 0.0];
        let penalties = Penalties {
            repetition: 1.0,
            presence: -1.0,
            frequency: 0.0,
        };
        apply_penalties(&mut logits, &history, penalties);
        assert_eq!(logits, vec![1.0, 1.0, 0.0]);
    }

    #[test]
    fn penalties_steer_greedy_decoding_away_from_repeats() {
        let logits = [3.0f32, 2.5, 0.0];
        let greedy = |penalties: SamplingParams| {
            let mut sampler = Sampler::new(&penalties, &[], &[]);
            (0..3).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(greedy(params(0.0, 0, 1.0, 1)), vec![0, 0, 0]);
        // 3.0 - 1.0 falls below 2.5 after the first pick, then 2.5 - 1.0 below 2.0.
        let presence = SamplingParams {
            presence_penalty: 1.0,
            ..params(0.0, 0, 1.0, 1)
        };
        assert_eq!(greedy(presence), vec![0, 1, 0]);
        let frequency = SamplingParams {
            frequency_penalty: 0.75,
            ..params(0.0, 0, 1.0, 1)
        };
        assert_eq!(greedy(frequency), vec![0, 1, 0]);
        // Token 0 is in the prompt: 3.0 / 2 is below 2.5 from the start.
        let mut sampler = Sampler::new(
            &SamplingParams {
                repetition_penalty: 2.0,
                ..params(0.0, 0, 1.0, 1)
            },
            &[0],
            &[],
        );
        assert_eq!(sampler.sample(&logits), 1);
        assert_eq!(sampler.sample(&logits), 0, "2.5 / 2 is now below 1.5");
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_most_likely() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps those of at least 0.125.
        let probabilities = [0.5f32, 0.3, 0.15, 0.05];
        let mut logits: Vec<f32> = probabilities.iter().map(|p| p.ln()).collect();
        apply_min_p(&mut logits, 0.25, 1.0);
        assert!(logits[..3].iter().all(|l| l.is_finite()));
        assert_eq!(logits[3], f32::NEG_INFINITY);
        // At temperature 2 the distribution flattens: 0.05 is then sqrt(0.1) ≈ 0.32 of 0.5's
        // weight, so it stays.
        let mut logits: Vec<f32> = probabilities.iter().map(|p| p.ln()).collect();
        apply_min_p(&mut logits, 0.25, 2.0);
        assert!(logits.iter().all(|l| l.is_finite()));

        let logits: Vec<f32> = probabilities.iter().map(|p| p.ln()).collect();
        let mut sampler = sampler(&SamplingParams {
            min_p: 0.5,
            ..params(1.0, 0, 1.0, 9)
        });
        let counts = histogram(&mut sampler, &logits, 2000);
        assert_eq!(&counts[2..], &[0, 0]);
        assert!(counts[0] > counts[1] && counts[1] > 0, "{counts:?}");
    }

    #[test]
    fn top_k_keeps_exactly_k_candidates() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        let mut top3 = sampler(&params(5.0, 3, 1.0, 13));
        let counts = histogram(&mut top3, &logits, 3000);
        assert_eq!(&counts[..2], &[0, 0]);
        assert!(counts[2..].iter().all(|&c| c > 0), "{counts:?}");
        // top_k 0 is no cut: every token turns up at a high temperature.
        let mut all = sampler(&params(5.0, 0, 1.0, 13));
        assert!(histogram(&mut all, &logits, 3000).iter().all(|&c| c > 0));
    }

    #[test]
    fn end_ids_are_masked_until_min_tokens() {
        // Token 2 ends the request and is always the most likely.
        let logits = [1.0f32, 0.5, 9.0];
        let with_min = SamplingParams {
            min_tokens: 3,
            ..params(0.0, 0, 1.0, 1)
        };
        let mut sampler = Sampler::new(&with_min, &[], &[2]);
        let drawn: Vec<u32> = (0..5).map(|_| sampler.sample(&logits)).collect();
        assert_eq!(drawn, vec![0, 0, 0, 2, 2]);
        // Sampling at a temperature never draws a masked id either.
        let hot = SamplingParams {
            min_tokens: 200,
            ..params(1.0, 0, 1.0, 4)
        };
        let mut sampler = Sampler::new(&hot, &[], &[2]);
        assert_eq!(histogram(&mut sampler, &logits, 200)[2], 0);
        // Without end ids (ignore_eos, no stop ids) nothing is masked.
        let mut sampler = Sampler::new(&with_min, &[], &[]);
        assert_eq!(sampler.sample(&logits), 2);
    }
}
