//! The `idemgate` binary: parse, load settings, run.

use std::process::ExitCode;

use clap::Parser;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use idemgate::app::{self, Listeners};
use idemgate::config::{Cli, Command, Settings, WorkerRuntime};
use idemgate_operations::cli::{self, JobsCommand};

use idemgate_store::postgres::Postgres;
use idemgate_store::sqlite::Sqlite;
use idemgate_store::{StoreError, StoreSettings};
use idemgate_telemetry::{self as telemetry, Chain};
use idemgate_upkeep::probe;

/// mimalloc: a gateway allocates many small, short-lived buffers per
/// request; in the benchmark it cut the CPU per passed-through request by
/// about a fifth against the system allocator (docs/performance.md, item 4).
/// Heap profilers see only the system allocator: the `system-allocator`
/// feature leaves it in place for them.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Settings are read before the runtime is built: its size is one of them.
    let job = match Job::load(cli) {
        Ok(job) => job,
        Err(e) => return fail(e),
    };
    let (threads, shape) = job.threads();
    let Runtimes { main, workers } = match runtimes(threads, shape) {
        Ok(runtimes) => runtimes,
        Err(e) => return fail(format!("cannot start the runtime: {e}")),
    };
    let per_thread = !workers.is_empty();
    let code = main.block_on(async {
        let (traces, logs) = match telemetry::init() {
            Ok(ends) => ends,
            Err(e) => return fail(e),
        };
        let code = job.run(workers).await;
        if let Some(traces) = traces {
            // Blocks while the last spans go out through this runtime.
            let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
        }
        // Waits for the log's thread to write every line it holds: no
        // line is lost at a graceful exit (docs/design.md §12).
        drop(logs);
        code
    });
    if per_thread {
        // The other workers' runtimes run until the process ends, and
        // their idle tasks may hold timers of this one: dropped first, it
        // would tell them it is shutting down, with a panic's message.
        // Everything the gateway had to finish has finished (`app::run`).
        std::mem::forget(main);
    }
    code
}

/// The runtime the main thread runs, and the other workers' runtimes when
/// each thread has its own.
struct Runtimes {
    main: tokio::runtime::Runtime,
    workers: Vec<tokio::runtime::Handle>,
}

/// Tokio's current-thread runtime for one worker thread (nothing is handed
/// between threads: docs/performance.md, item 15); for more, its
/// multi-thread runtime, or with `worker_runtime = "per_thread"` a
/// current-thread runtime on each, the main thread's among them
/// (docs/design.md §12, "Threads").
fn runtimes(threads: usize, shape: WorkerRuntime) -> std::io::Result<Runtimes> {
    let current = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    if threads == 1 || shape == WorkerRuntime::PerThread {
        let workers = (1..threads)
            .map(|index| worker(index, current()?))
            .collect::<std::io::Result<_>>()?;
        return Ok(Runtimes {
            main: current()?,
            workers,
        });
    }
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    Ok(Runtimes {
        main,
        workers: Vec::new(),
    })
}

/// A thread that runs `runtime` as worker `index` for as long as the
/// process lives; the runtime's handle, to spawn on it.
fn worker(
    index: usize,
    runtime: tokio::runtime::Runtime,
) -> std::io::Result<tokio::runtime::Handle> {
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name(format!("idemgate-worker-{index}"))
        .spawn(move || {
            idemgate_domain::worker::enter(index);
            // A current-thread runtime runs what is spawned on it only
            // while a thread blocks on it.
            runtime.block_on(std::future::pending::<()>());
        })?;
    Ok(handle)
}

/// A command with its settings read.
enum Job {
    Serve(Settings),
    Check(Settings),
    Jobs(JobsCommand),
    /// With `--json`, and `--timeout`.
    VerifyProviders(Settings, bool, Option<std::time::Duration>),
    Migrate(StoreSettings),
}

impl Job {
    fn load(cli: Cli) -> Result<Job, idemgate::config::ConfigError> {
        let config = cli.config.as_deref();
        Ok(match cli.command {
            Command::Serve(flags) => Job::Serve(Settings::load(config, flags)?),
            Command::Check(flags) => Job::Check(Settings::load(config, flags)?),
            Command::Jobs(command) => Job::Jobs(command),
            Command::VerifyProviders(verify) => Job::VerifyProviders(
                Settings::load(config, verify.flags)?,
                verify.json,
                verify.timeout,
            ),
            Command::Migrate(flags) => Job::Migrate(Settings::load_store(config, flags)?),
        })
    }

    /// Its worker threads, and how they share the work.
    fn threads(&self) -> (usize, WorkerRuntime) {
        match self {
            Job::Serve(settings) => (settings.worker_threads, settings.worker_runtime),
            // Probes are few; one runtime takes them.
            Job::VerifyProviders(settings, ..) => (settings.worker_threads, WorkerRuntime::Shared),
            // Migrations run one statement at a time; a check runs nothing.
            Job::Migrate(_) | Job::Check(_) | Job::Jobs(_) => (1, WorkerRuntime::Shared),
        }
    }

    /// Runs the job; `workers` are the runtimes of the other worker threads.
    async fn run(self, workers: Vec<tokio::runtime::Handle>) -> ExitCode {
        match self {
            Job::Serve(settings) => serve(settings, workers).await,
            Job::Jobs(command) => match cli::run(command).await {
                Ok(out) => {
                    print!("{out}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("idemgate: {e}");
                    ExitCode::FAILURE
                }
            },
            Job::Check(settings) => match app::check(&settings) {
                Ok(report) => {
                    print!("{report}");
                    println!("configuration ok");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(Chain(&e)),
            },
            Job::VerifyProviders(settings, json, timeout) => {
                let print = if json {
                    probe::Print::Json
                } else {
                    probe::Print::Table
                };
                if app::verify_providers(&settings, timeout, print).await {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Job::Migrate(store) => match migrate(store).await {
                Ok(()) => {
                    println!("migrations applied");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(Chain(&e)),
            },
        }
    }
}

async fn migrate(store: StoreSettings) -> Result<(), StoreError> {
    match store {
        StoreSettings::Postgres(pg) => Postgres::new(&pg, uuid::Uuid::nil())?.migrate().await,
        // Opening the embedded store applies its migrations.
        StoreSettings::Embedded { path } => Sqlite::open(&path).await.map(drop),
    }
}

async fn serve(settings: Settings, workers: Vec<tokio::runtime::Handle>) -> ExitCode {
    let proxy = match TcpListener::bind(settings.listen).await {
        Ok(l) => l,
        Err(e) => {
            return fail(format!(
                "cannot listen on {} (`listen`): {e}",
                settings.listen
            ))
        }
    };
    let admin = match TcpListener::bind(settings.admin_listen).await {
        Ok(l) => l,
        Err(e) => {
            return fail(format!(
                "cannot listen on {} (`admin_listen`): {e}",
                settings.admin_listen
            ))
        }
    };
    let (Ok(proxy_addr), Ok(admin_addr)) = (proxy.local_addr(), admin.local_addr()) else {
        return fail("cannot read the listeners' addresses");
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(on_signal(shutdown.clone()));
    // Tests and scripts read this line to learn OS-assigned ports, and that
    // the gateway is ready.
    let ready = || {
        // Start-up's lines first: whoever waits for this line reads them.
        telemetry::logs::flush();
        println!("idemgate listening on http://{proxy_addr} (admin on http://{admin_addr})");
    };
    match app::run(
        settings,
        Listeners {
            proxy,
            admin,
            workers,
        },
        shutdown,
        ready,
    )
    .await
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(Chain(&e)),
    }
}

async fn on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down");
    shutdown.cancel();
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    // After the lines logged before it (they are written in batches).
    telemetry::logs::flush();
    eprintln!("idemgate: {e}");
    ExitCode::from(2)
}
