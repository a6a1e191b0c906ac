use clap::Parser;

#[tokio::main]
async fn main() {
    let args = stowage_agent::Args::parse();
    stowage_common::observe::logging::init(&args.log);
    if let Err(e) = stowage_agent::run(args).await {
        eprintln!("stowage-agent: {e:#}");
        std::process::exit(1);
    }
}
