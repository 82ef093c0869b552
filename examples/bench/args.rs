//! The benchmark's flags, each with its default (`scripts/bench.sh` passes
//! its own arguments through).

pub struct Args {
    pub binary: String,
    /// The floor example (examples/floor.rs): the gateway's listener and
    /// upstream pool with no layers.
    pub floor: String,
    pub database: String,
    pub redis: String,
    pub seconds: u64,
    pub rounds: usize,
    pub connections: usize,
    pub storm: usize,
    /// Replica counts for the scale-out table (empty: skipped).
    pub replicas: Vec<usize>,
    pub only: Option<String>,
    /// Another build of idemgate whose new-key rows run beside this one's
    /// (before and after a change, in one run).
    pub baseline: Option<String>,
}

pub fn args() -> Args {
    let mut a = Args {
        binary: "target/release/idemgate".into(),
        floor: "target/release/examples/floor".into(),
        database: "postgres://postgres@127.0.0.1:5432/postgres".into(),
        redis: "redis://127.0.0.1:6379/15".into(),
        seconds: 10,
        rounds: 3,
        connections: 32,
        storm: 10_000,
        replicas: vec![1, 2, 4],
        only: None,
        baseline: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--binary" => a.binary = value,
            "--floor" => a.floor = value,
            "--database" => a.database = value,
            "--redis" => a.redis = value,
            "--seconds" => a.seconds = value.parse().expect("--seconds N"),
            "--rounds" => a.rounds = value.parse().expect("--rounds N"),
            "--connections" => a.connections = value.parse().expect("--connections N"),
            "--storm" => a.storm = value.parse().expect("--storm N"),
            "--replicas" => {
                a.replicas = value
                    .split(',')
                    .filter(|v| !v.is_empty() && *v != "0")
                    .map(|v| v.parse().expect("--replicas 1,2,4"))
                    .collect()
            }
            "--only" => a.only = Some(value),
            "--baseline" => a.baseline = Some(value),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}
