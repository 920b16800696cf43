//! Token sampling: greedy, temperature, top-k and top-p, each sequence with its own seeded
//! random stream, so a request's output depends only on its logits and its seed, never on
//! which other requests shared its batches.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::api::SamplingParams;

pub struct Sampler {
    temperature: f32,
    /// 0 means no top-k cut.
    top_k: usize,
    top_p: f32,
    rng: StdRng,
}

impl Sampler {
    /// `params` must already be validated (finite temperature ≥ 0, top_p in (0, 1]).
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Self {
            temperature: params.temperature,
            top_k: params.top_k as usize,
            top_p: params.top_p,
            rng,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
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

    fn histogram(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.sample(logits) as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut sampler = Sampler::new(&params(0.0, 0, 1.0, 1));
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
            let mut sampler = Sampler::new(&params(0.8, 40, 0.9, seed));
            (0..50).map(|_| sampler.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln(), f32::NEG_INFINITY];
        let mut sampler = Sampler::new(&params(1.0, 0, 1.0, 3));
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
        let mut top2 = Sampler::new(&params(1.0, 2, 1.0, 5));
        let counts = histogram(&mut top2, &logits, 2000);
        assert_eq!(&counts[2..], &[0, 0]);
        assert!(counts[0] > 0 && counts[1] > 0);

        // 0.4 + 0.3 reaches 0.7: the top-p set is the two most likely tokens.
        let mut nucleus = Sampler::new(&params(1.0, 0, 0.7, 5));
        let counts = histogram(&mut nucleus, &logits, 2000);
        assert_eq!(&counts[2..], &[0, 0]);

        // Top-p applies to the renormalised top-k set: within {0.4, 0.3}, 0.5 needs only
        // the first.
        let mut both = Sampler::new(&params(1.0, 2, 0.5, 5));
        let counts = histogram(&mut both, &logits, 500);
        assert_eq!(counts, vec![500, 0, 0, 0]);
    }

    #[test]
    fn top_p_widens_past_the_first_candidates() {
        // 1000 equally likely tokens: top_p 0.5 needs 500 of them, beyond the first 64.
        let logits = vec![0.0f32; 1000];
        let mut sampler = Sampler::new(&params(1.0, 0, 0.5, 11));
        let counts = histogram(&mut sampler, &logits, 4000);
        assert!(counts[..500].iter().filter(|&&c| c > 0).count() > 400);
        assert_eq!(counts[500..].iter().sum::<usize>(), 0);
    }
}
