use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    npufleet_router::run(npufleet_router::Args::parse()).await
}
