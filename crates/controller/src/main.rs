use clap::Parser;

#[tokio::main]
async fn main() {
    stowage_common::logging::init();
    let args = stowage_controller::Args::parse();
    if let Err(e) = stowage_controller::run(args).await {
        // One line a person can act on, not a panic trace.
        eprintln!("stowage-controller: {e:#}");
        std::process::exit(1);
    }
}
