//! The passes the engine runs before it serves. They load the weights into the caches and
//! measure the serving shape: after the first pass fills every dummy row's blocks, the
//! passes take turns over prompt chunks of one row at a few lengths and decodes at every
//! batch size up to the rows, each timed. The worker reports those times
//! (`LoadSnapshot::warmup_prefill_steps`), so the autoscaler's capacity model has a line
//! through several sizes from a worker's first report, before any request was served.

/// One pass: `rows` dummy rows, each computing positions `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pass {
    pub rows: usize,
    pub start: usize,
    pub len: usize,
}

impl Pass {
    /// Whether the pass computes prompt positions (else it decodes one position a row).
    pub fn is_prefill(&self) -> bool {
        self.len > 1
    }

    /// The step's size as the engine's step sums count it: positions, or the batch.
    pub fn size(&self) -> usize {
        if self.is_prefill() {
            self.rows * self.len
        } else {
            self.rows
        }
    }
}

/// Longest dummy row, in blocks: a few, so prompt chunks of several lengths fit.
const BLOCKS_PER_ROW: usize = 4;
/// Most dummy rows, and so the largest decode batch measured.
const MAX_ROWS: usize = 4;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct WarmUpPlan {
    pub rows: usize,
    /// Positions of each row.
    pub span: usize,
    pub blocks_per_row: usize,
    /// The passes after the first, taken in turn.
    cycle: Vec<Pass>,
}

impl WarmUpPlan {
    /// The plan for blocks of `block_size` positions, a context of `context` positions,
    /// prompt chunks of at most `max_chunk`, batches of at most `max_batch` and a cache of
    /// `num_blocks` blocks (at least one).
    pub fn new(
        block_size: usize,
        context: usize,
        max_chunk: usize,
        max_batch: usize,
        num_blocks: usize,
    ) -> Self {
        let blocks_per_row = BLOCKS_PER_ROW
            .min(num_blocks)
            .min(context.div_ceil(block_size))
            .max(1);
        let span = (blocks_per_row * block_size)
            .min(context)
            .min(max_chunk)
            .max(1);
        let rows = max_batch
            .min(MAX_ROWS)
            .min(num_blocks / blocks_per_row)
            .max(1);
        let mut cycle = Vec::new();
        let mut len = block_size.min(span);
        loop {
            cycle.push(Pass {
                rows: 1,
                start: 0,
                len,
            });
            if len >= span {
                break;
            }
            len = (len * 2).min(span);
        }
        cycle.extend((1..=rows).map(|rows| Pass {
            rows,
            start: 0,
            len: 1,
        }));
        Self {
            rows,
            span,
            blocks_per_row,
            cycle,
        }
    }

    /// Iteration `i`'s pass: the first fills every row; then the cycle, decodes at a
    /// position that moves within the written span.
    pub fn pass(&self, i: u32) -> Pass {
        let i = i as usize;
        if i == 0 {
            return Pass {
                rows: self.rows,
                start: 0,
                len: self.span,
            };
        }
        let pass = self.cycle[(i - 1) % self.cycle.len()];
        if pass.is_prefill() {
            pass
        } else {
            Pass {
                start: i % self.span,
                ..pass
            }
        }
    }

    /// Whether iteration `i`'s time counts: not the first pass nor the first round of the
    /// cycle, whose times include touching memory for the first time.
    pub fn timed(&self, i: u32) -> bool {
        i as usize > self.cycle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(plan: &WarmUpPlan, iterations: u32, prefill: bool) -> Vec<usize> {
        let mut sizes: Vec<usize> = (0..iterations)
            .filter(|&i| plan.timed(i))
            .map(|i| plan.pass(i))
            .filter(|p| p.is_prefill() == prefill)
            .map(|p| p.size())
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    #[test]
    fn the_default_warm_up_times_both_kinds_at_several_sizes() {
        let plan = WarmUpPlan::new(16, 2048, 512, 128, 1000);
        assert_eq!((plan.rows, plan.span, plan.blocks_per_row), (4, 64, 4));
        assert_eq!(
            plan.pass(0),
            Pass {
                rows: 4,
                start: 0,
                len: 64
            }
        );
        assert_eq!(sizes(&plan, 100, true), [16, 32, 64]);
        assert_eq!(sizes(&plan, 100, false), [1, 2, 3, 4]);
        let timed = |prefill| {
            (0..100)
                .filter(|&i| plan.timed(i) && plan.pass(i).is_prefill() == prefill)
                .count()
        };
        assert!(
            timed(true) >= 20 && timed(false) >= 20,
            "enough of each to fit a line"
        );
    }

    #[test]
    fn every_pass_stays_inside_its_rows_blocks_and_the_written_span() {
        for (block, context, chunk, batch, blocks) in [
            (16, 2048, 512, 128, 1000),
            (16, 2048, 8, 2, 3),
            (4, 6, 512, 1, 1),
            (16, 8, 512, 8, 64),
            (32, 4096, 1, 1, 1),
        ] {
            let plan = WarmUpPlan::new(block, context, chunk, batch, blocks);
            assert!(plan.rows * plan.blocks_per_row <= blocks, "{plan:?}");
            assert!(plan.span <= plan.blocks_per_row * block && plan.span <= context);
            assert!(plan.span <= chunk.max(1) && plan.rows <= batch);
            for i in 0..50 {
                let pass = plan.pass(i);
                assert!(
                    pass.rows >= 1 && pass.rows <= plan.rows,
                    "{plan:?} {pass:?}"
                );
                assert!(pass.start + pass.len <= plan.span, "{plan:?} {pass:?}");
            }
        }
    }
}
