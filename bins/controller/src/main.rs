use clap::Parser;

mod init_store;

// One thread runs every controller. The controller waits on the apiserver far more than it
// computes (a small part of a core at the apiserver's full write rate), and a second
// worker only adds cross-thread wake-ups on the cores it shares with the apiserver: measured
// A/B, one thread spent less CPU per bind and attach at the same throughput
// (docs/benchmarks-history.md, "One runtime thread"). Blocking work (image files of the built-in driver) runs on tokio's
// blocking pool either way.
#[tokio::main(flavor = "current_thread")]
async fn main() {
    // The install step takes none of the controller's flags: handled before they are parsed.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == init_store::NAME) {
        std::process::exit(init_store::main(&argv[1..]));
    }
    let args = stowage_controller::Args::parse();
    stowage_common::observe::logging::init(&args.log);
    if let Err(e) = stowage_controller::run(args).await {
        // One line a person can act on, not a panic trace.
        eprintln!("stowage-controller: {e:#}");
        std::process::exit(1);
    }
}
