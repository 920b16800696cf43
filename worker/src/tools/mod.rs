//! What the worker binary offers besides serving, kept out of the serving layers so that
//! each layer only calls the one below it: the engine benchmark beside llama.cpp, the
//! collective and tensor-parallel benchmarks, the Ascend self-test and the test-model
//! generator. Tools may call any layer; no layer calls a tool.

pub mod ascend_selftest;
pub mod bench;
pub mod collective_bench;
pub mod testmodel;
pub mod tp_bench;

/// Each rank thread's result, in rank order; a thread that panicked is an error.
fn join_ranks<T>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, anyhow::Result<T>>>,
) -> Vec<anyhow::Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank thread panicked")))
        })
        .collect()
}
