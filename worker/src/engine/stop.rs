//! Stop strings over streamed text: text is held back while it could still be the start
//! of a stop string, and a stop string itself is never released.

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released. By construction no stop string can begin before it.
    held: String,
}

#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that can no longer be part of a stop string.
    Release(String),
    /// A stop string was found; this is the text before it, and generation ends.
    Stopped(String),
}

impl StopMatcher {
    /// `stops` must not contain the empty string.
    pub fn new(stops: Vec<String>) -> Self {
        debug_assert!(stops.iter().all(|s| !s.is_empty()));
        Self {
            stops,
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Release(text.to_owned());
        }
        self.held.push_str(text);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.held.truncate(at);
            return StopOutcome::Stopped(std::mem::take(&mut self.held));
        }
        let keep = self.longest_stop_prefix_suffix();
        let release_len = self.held.len() - keep;
        let kept = self.held.split_off(release_len);
        StopOutcome::Release(std::mem::replace(&mut self.held, kept))
    }

    /// Everything held back, for when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of the held text that is a proper prefix of a stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let max = longest_stop.saturating_sub(1).min(self.held.len());
        (1..=max)
            .rev()
            .filter(|&len| self.held.is_char_boundary(self.held.len() - len))
            .find(|&len| {
                let suffix = &self.held[self.held.len() - len..];
                self.stops.iter().any(|stop| stop.starts_with(suffix))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            match matcher.push(piece) {
                StopOutcome::Release(text) => out.push_str(&text),
                StopOutcome::Stopped(text) => {
                    out.push_str(&text);
                    return (out, true);
                }
            }
        }
        out.push_str(&matcher.flush());
        (out, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_not_released() {
        assert_eq!(
            run(&["\nUser:"], &["Hi", " there", "\nUs", "er:", " more"]),
            ("Hi there".to_owned(), true)
        );
    }

    #[test]
    fn held_text_is_released_once_it_cannot_be_a_stop() {
        let mut matcher = StopMatcher::new(vec!["END".into()]);
        assert_eq!(matcher.push("abE"), StopOutcome::Release("ab".into()));
        assert_eq!(matcher.push("N"), StopOutcome::Release(String::new()));
        assert_eq!(matcher.push("x"), StopOutcome::Release("ENx".into()));
        assert_eq!(matcher.push("EN"), StopOutcome::Release(String::new()));
        assert_eq!(matcher.flush(), "EN");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["cd", "b"], &["abcd"]),
            ("a".to_owned(), true),
            "b occurs before cd"
        );
        assert_eq!(run(&["zz"], &["no stop"]), ("no stop".to_owned(), false));
    }

    #[test]
    fn multibyte_text_is_held_on_character_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "é!", "x"]),
            ("café".to_owned(), true)
        );
        assert_eq!(run(&["éa"], &["ü", "é"]), ("üé".to_owned(), false));
    }
}
