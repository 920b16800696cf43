//! Replays the committed fuzz corpus (`worker/fuzz/corpus/<target>/`) through the fuzz
//! targets' own entry functions, so every input the fuzzer found interesting, and every
//! crash it once found, keeps passing in an ordinary `cargo test`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use npufleet_worker::fuzz::{CountingAllocator, TARGETS};

// The GGUF target bounds the memory parsing holds; counting needs the allocator installed.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn corpus_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading the corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn every_saved_fuzz_input_is_handled_without_a_panic() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut failures = Vec::new();
    for (target, entry) in TARGETS {
        let files = corpus_files(&corpus.join(target));
        assert!(
            !files.is_empty(),
            "the {target} corpus in {} is empty",
            corpus.display()
        );
        for file in files {
            let data = std::fs::read(&file).expect("reading a corpus file");
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| entry(&data))) {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("{target}: {}: {message}", file.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "inputs that panicked:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_allocation_counter_sees_what_an_entry_holds() {
    let (kept, peak) = npufleet_worker::fuzz::peak_allocation(|| vec![0u8; 1 << 20]);
    assert_eq!(kept.len(), 1 << 20);
    assert!(peak >= 1 << 20, "peak {peak}");
}
