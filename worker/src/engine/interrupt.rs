//! Lets a request stop a running step that none of its sequences outranks.
//!
//! A step of lower-priority sequences can take as long as an urgent request's own prompt
//! (a long prompt chunk, or a batch of decodes on a busy CPU), and the urgent request would
//! wait for it before its first step even begins. The engine arms the interrupt with the
//! step's highest priority before running it; a submission above that raises it, and the
//! forward pass stops at its next layer. The stopped step changes nothing the engine keeps
//! (no token sampled, no position counted), so scheduling again runs the urgent prompt and
//! later the same step in full.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

#[derive(Debug)]
pub(super) struct StepInterrupt {
    /// The lowest priority that stops the running step; above every priority when no step
    /// may be stopped.
    floor: AtomicI64,
    raised: AtomicBool,
}

impl Default for StepInterrupt {
    fn default() -> Self {
        Self {
            floor: AtomicI64::new(i64::MAX),
            raised: AtomicBool::new(false),
        }
    }
}

impl StepInterrupt {
    /// Arms for the step about to run, whose most urgent sequence has priority `top`.
    /// Called with the engine's state locked, as [`StepInterrupt::offer`] is: a submission
    /// either was scheduled with the step or is offered after it was armed.
    pub(super) fn arm(&self, top: i32) {
        self.raised.store(false, Ordering::Relaxed);
        self.floor.store(i64::from(top) + 1, Ordering::Relaxed);
    }

    /// A request of `priority` was queued.
    pub(super) fn offer(&self, priority: i32) {
        if i64::from(priority) >= self.floor.load(Ordering::Relaxed) {
            self.raised.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the running step should stop.
    pub(super) fn raised(&self) -> bool {
        self.raised.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_priority_above_the_whole_step_raises_it() {
        let interrupt = StepInterrupt::default();
        interrupt.offer(i32::MAX);
        assert!(!interrupt.raised(), "no step armed");
        interrupt.arm(0);
        interrupt.offer(0);
        interrupt.offer(-3);
        assert!(
            !interrupt.raised(),
            "equal and lower priorities wait their turn"
        );
        interrupt.offer(1);
        assert!(interrupt.raised());
        interrupt.arm(i32::MAX);
        assert!(!interrupt.raised(), "arming the next step lowers it");
        interrupt.offer(i32::MAX);
        assert!(!interrupt.raised(), "nothing outranks the highest priority");
    }
}
