use clap::{Parser, Subcommand};

/// npufleet inference worker.
#[derive(Parser)]
#[command(name = "npufleet-worker", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over the Open Inference Protocol (gRPC) and the OpenAI HTTP API.
    Serve(Box<npufleet_worker::startup::ServeArgs>),
    /// Measure the engine on a model: prefill, decode and batched decode throughput.
    Bench(npufleet_worker::tools::bench::BenchArgs),
    /// Measure ring all-reduce bus bandwidth for the in-process and TCP transports.
    CollectiveBench(npufleet_worker::tools::collective_bench::CollectiveBenchArgs),
    /// Run an HCCL all-reduce self-test across the ranks of a rank table (Ascend hosts).
    HcclSelftest(npufleet_worker::tools::ascend_selftest::SelftestArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => npufleet_worker::startup::run(*args),
        Command::Bench(args) => npufleet_worker::tools::bench::run(args),
        Command::CollectiveBench(args) => npufleet_worker::tools::collective_bench::run(args),
        Command::HcclSelftest(args) => npufleet_worker::tools::ascend_selftest::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}
