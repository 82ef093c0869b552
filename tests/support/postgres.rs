//! A throwaway PostgreSQL server in a temporary folder on a free port, for
//! tests that stop and restart it, or need it set up otherwise (TLS only),
//! never the shared one on 5432. As root, the server runs as the `postgres`
//! user, as PostgreSQL requires.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct ThrowawayPostgres {
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    /// Server settings beyond the defaults, as `-c name=value` options.
    settings: String,
}

impl ThrowawayPostgres {
    pub async fn start() -> ThrowawayPostgres {
        Self::start_with(&[]).await
    }

    /// A server started with `settings` (`name=value`) on its command line.
    pub async fn start_with(settings: &[&str]) -> ThrowawayPostgres {
        let pg = Self::prepare(settings).await;
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    /// A server that speaks TLS with `tls` and accepts connections only as
    /// `hba` (the whole of its pg_hba.conf) allows.
    pub async fn start_tls(tls: &ServerTls, hba: &str) -> ThrowawayPostgres {
        let mut pg = Self::prepare(&[]).await;
        pg.run("initdb", &["-D", &pg.data(), "-U", "postgres", "--no-sync"]);
        let data = pg.dir.path().join("data");
        for (name, text) in [
            ("server.crt", &tls.cert_pem),
            ("server.key", &tls.key_pem),
            ("root.crt", &tls.client_ca_pem),
            ("pg_hba.conf", &hba.to_owned()),
        ] {
            std::fs::write(data.join(name), text).unwrap();
        }
        // PostgreSQL refuses a key others may read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            data.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        pg.own();
        // Relative to the data folder.
        pg.settings.push_str(
            " -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key \
             -c ssl_ca_file=root.crt",
        );
        pg.start_again();
        pg
    }

    /// A connection as the superuser over the server's Unix socket (not
    /// TCP: what a test's pg_hba.conf says of TCP is the test's subject).
    pub async fn socket_client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::Config::new()
            .host_path(self.dir.path())
            .port(self.port)
            .user("postgres")
            .dbname("postgres")
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connect over the throwaway server's socket");
        tokio::spawn(connection);
        client
    }

    /// A streaming-replication standby of `primary` (`pg_basebackup -R`),
    /// started and replaying.
    pub async fn standby_of(primary: &ThrowawayPostgres) -> ThrowawayPostgres {
        let pg = Self::prepare(&["cluster_name=standby"]).await;
        let port = primary.port.to_string();
        pg.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &pg.data(),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        );
        pg.start_again();
        pg
    }

    /// Makes a standby the primary (`pg_ctl promote`, waiting until it is).
    pub fn promote(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-w", "promote"]);
    }

    async fn prepare(settings: &[&str]) -> ThrowawayPostgres {
        let port = super::redis::free_port().await;
        let bin = binaries();
        let dir = tempfile::tempdir().unwrap();
        let pg = ThrowawayPostgres {
            port,
            dir,
            bin,
            as_postgres: is_root(),
            settings: settings.iter().map(|s| format!(" -c {s}")).collect(),
        };
        pg.own();
        pg
    }

    /// As root, gives the folder (and all written into it) to `postgres`.
    fn own(&self) {
        if self.as_postgres {
            assert!(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(self.dir.path())
                    .status()
                    .unwrap()
                    .success(),
                "chown the throwaway cluster's folder"
            );
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off{}",
            self.port,
            self.dir.path().display(),
            self.settings
        );
        let log = self.dir.path().join("log").display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                &log,
                "-w",
                "start",
            ],
        );
    }

    /// Stops the server the way an operator restarting it does (`-m fast`:
    /// sessions are cut, the shutdown is clean).
    pub fn stop_fast(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }

    /// Stops the server at once, as a crash would (`-m immediate`).
    pub fn stop(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let exe = self.bin.join(tool);
        let status = if self.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(args)
                .stdout(std::process::Stdio::null())
                .status()
        } else {
            Command::new(&exe)
                .args(args)
                .stdout(std::process::Stdio::null())
                .status()
        }
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
        assert!(status.success(), "{tool} {args:?} failed");
    }
}

/// A server's certificate, its key, and the CA it checks client
/// certificates against (all PEM).
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
}

impl Drop for ThrowawayPostgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = Command::new(if self.as_postgres { "runuser" } else { "sh" })
            .args(if self.as_postgres {
                vec!["-u", "postgres", "--"]
            } else {
                vec!["-c", "exec \"$0\" \"$@\""]
            })
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", &data, "-m", "immediate", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The newest installed PostgreSQL's binaries.
fn binaries() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<_> = std::fs::read_dir(root)
        .expect("PostgreSQL is not installed; scripts/test.sh installs it")
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().and_then(|v| v.parse::<u32>().ok()))
        .collect();
    versions.sort_unstable();
    root.join(versions.last().expect("a PostgreSQL version").to_string())
        .join("bin")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
