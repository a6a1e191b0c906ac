use clap::Parser;

#[tokio::main]
async fn main() {
    stowage_common::logging::init();
    let args = stowage_agent::Args::parse();
    if let Err(e) = stowage_agent::run(args).await {
        eprintln!("stowage-agent: {e:#}");
        std::process::exit(1);
    }
}
