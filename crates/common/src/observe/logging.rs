//! Log set-up shared by both binaries: lines on stderr (stdout stays free for output a user
//! asked for), colour only on a terminal, text or JSON, and a kube-controller-manager-style
//! verbosity (`--v`) unless `RUST_LOG` says more precisely what to show.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line (timestamp, level, fields, spans) for log pipelines.
    Json,
}

/// The logging flags of both binaries.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log line format; kube-controller-manager's name for it, --logging-format, is accepted too.
    #[arg(long, alias = "logging-format", value_enum, default_value_t = Format::Text)]
    pub log_format: Format,
    /// Verbosity as klog counts it: 0-2 info, 3-4 debug, 5 and more trace. `RUST_LOG`, when
    /// set, wins (it can also pick modules: `RUST_LOG=stowage_binder=debug`).
    #[arg(short = 'v', long = "v", default_value_t = 2, value_name = "LEVEL")]
    pub verbosity: u8,
}

impl Default for LogArgs {
    fn default() -> Self {
        Self {
            log_format: Format::Text,
            verbosity: 2,
        }
    }
}

/// The filter `--v` stands for.
pub fn level(verbosity: u8) -> &'static str {
    match verbosity {
        0..=2 => "info",
        3..=4 => "debug",
        _ => "trace",
    }
}

/// Installs the process's subscriber. A second call (tests that run several binaries' mains in
/// one process) keeps the first.
pub fn init(args: &LogArgs) {
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = subscriber(args, std::io::stderr, std::io::stderr().is_terminal()).try_init();
}

/// The subscriber `init` installs, writing to `writer` (tests read what it would log).
pub fn subscriber<W>(args: &LogArgs, writer: W, ansi: bool) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level(args.verbosity)));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi);
    match args.log_format {
        Format::Text => Box::new(builder.with_target(false).finish()),
        // Targets (the crate: stowage_binder, …) help pipelines filter by controller.
        Format::Json => Box::new(
            builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .finish(),
        ),
    }
}
