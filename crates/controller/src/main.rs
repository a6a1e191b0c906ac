use clap::Parser;

#[tokio::main]
async fn main() {
    let args = stowage_controller::Args::parse();
    stowage_common::logging::init(&args.log);
    if let Err(e) = stowage_controller::run(args).await {
        // One line a person can act on, not a panic trace.
        eprintln!("stowage-controller: {e:#}");
        std::process::exit(1);
    }
}
