//! Every benchmark binary answers `--help` and `-h` with its usage and exit
//! status 0, rejects an unknown flag or a bad value with clap's message and
//! a non-zero status (not a panic), and still reaches the server modes it
//! starts itself in through its hidden flags; those servers answer `STATS`
//! on stdin with their counters.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Every binary of this package, by name and path.
const BINARIES: [(&str, &str); 7] = [
    ("bulk_probe", env!("CARGO_BIN_EXE_bulk_probe")),
    ("compare", env!("CARGO_BIN_EXE_compare")),
    ("idle_connections", env!("CARGO_BIN_EXE_idle_connections")),
    ("latency", env!("CARGO_BIN_EXE_latency")),
    ("scale", env!("CARGO_BIN_EXE_scale")),
    ("soak", env!("CARGO_BIN_EXE_soak")),
    ("transports", env!("CARGO_BIN_EXE_transports")),
];

fn run(path: &str, args: &[&str]) -> Output {
    Command::new(path)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap_or_else(|error| panic!("start {path}: {error}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_prints_usage_and_exits_zero() {
    for (name, path) in BINARIES {
        for flag in ["--help", "-h"] {
            let output = run(path, &[flag]);
            let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
            assert!(
                output.status.success(),
                "{name} {flag}: {}\nstdout: {stdout}\nstderr: {stderr}",
                output.status
            );
            assert!(
                stdout.contains("Usage:") && stdout.contains(name),
                "{name} {flag} printed no usage: {stdout}"
            );
            assert!(!stderr.contains("panicked"), "{name} {flag}: {stderr}");
        }
    }
}

#[test]
fn unknown_flag_is_an_error_not_a_panic() {
    for (name, path) in BINARIES {
        let output = run(path, &["--bogus"]);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{name} --bogus: {stderr}");
        assert!(
            stderr.contains("unexpected argument '--bogus'"),
            "{name} --bogus: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{name} --bogus: {stderr}");
    }
}

#[test]
fn bad_values_are_errors_not_panics() {
    for (name, args) in [
        ("compare", &["--only", "rdma,quic"][..]),
        ("compare", &["--load", "many"]),
        ("bulk_probe", &["rdma", "1,x"]),
        ("bulk_probe", &["rdma", "64", "0"]),
        ("idle_connections", &["mem", "10"]),
        ("latency", &["--calls", "lots"]),
        ("scale", &["--connections", "10,lots"]),
        ("scale", &["--transports", "rdma,mem"]),
        ("soak", &["--in-flight", "0"]),
        ("transports", &["--seconds", "-1"]),
    ] {
        let path = BINARIES.iter().find(|(n, _)| *n == name).expect("known").1;
        let output = run(path, args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{name} {args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{name} {args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name} {args:?}: {stderr}");
    }
}

#[test]
fn idle_connections_without_arguments_prints_its_help() {
    let output = run(env!("CARGO_BIN_EXE_idle_connections"), &[]);
    assert!(output.status.success());
    assert!(text(&output.stdout).contains("Usage:"));
}

/// Starts `path args`, waits (up to a minute) for its `LISTENING <address>`
/// line, and kills it.
fn listens(path: &str, args: &[&str]) -> Result<String, String> {
    let mut child = Command::new(path)
        .args(args)
        // The soft provider, whatever the machine has or the caller's
        // environment says: these servers only need to start.
        .env("RDMA_PROVIDER", "soft")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| error.to_string())?;
    let stdout = child.stdout.take().expect("piped");
    let (address_tx, address_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let address = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| line.strip_prefix("LISTENING ").map(str::to_owned));
        let _ = address_tx.send(address);
    });
    let address = address_rx.recv_timeout(Duration::from_secs(60));
    let _ = child.kill();
    let output = child
        .wait_with_output()
        .map_err(|error| error.to_string())?;
    match address {
        Ok(Some(address)) => Ok(address),
        Ok(None) => Err(format!(
            "exited: {}: {}",
            output.status,
            text(&output.stderr)
        )),
        Err(_) => Err(format!(
            "no LISTENING line in 60 s: {}",
            text(&output.stderr)
        )),
    }
}

#[test]
fn hidden_server_modes_still_start() {
    for (name, args) in [
        ("compare", &["--serve", "tcp"][..]),
        ("bulk_probe", &["--serve", "tcp"]),
        ("soak", &["--serve", "tcp"]),
        ("transports", &["--serve", "tcp://127.0.0.1:0"]),
        ("idle_connections", &["--serve", "tcp"]),
        ("scale", &["--serve", "tcp"]),
    ] {
        let path = BINARIES.iter().find(|(n, _)| *n == name).expect("known").1;
        let address = listens(path, args).unwrap_or_else(|why| panic!("{name} {args:?}: {why}"));
        assert!(!address.is_empty(), "{name} {args:?}");
    }
}

/// Starts `path args`, waits for its `LISTENING` line, writes `STATS` on
/// its stdin and returns the next line it prints (a minute for each).
fn counters_line(path: &str, args: &[&str]) -> Result<String, String> {
    use std::io::Write;
    let mut child = Command::new(path)
        .args(args)
        .env("RDMA_PROVIDER", "soft")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|error| error.to_string())?;
    let stdout = child.stdout.take().expect("piped");
    let mut stdin = child.stdin.take().expect("piped");
    let (line_tx, line_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });
    let answer = (|| {
        let wait = Duration::from_secs(60);
        while !line_rx
            .recv_timeout(wait)
            .map_err(|_| "no LISTENING line in 60 s")?
            .starts_with("LISTENING ")
        {}
        writeln!(stdin, "STATS").map_err(|error| error.to_string())?;
        line_rx
            .recv_timeout(wait)
            .map_err(|_| "no answer to STATS in 60 s".to_owned())
    })();
    let _ = child.kill();
    let _ = child.wait();
    answer
}

#[test]
fn servers_report_their_counters() {
    let line = counters_line(env!("CARGO_BIN_EXE_compare"), &["--serve", "tcp"])
        .unwrap_or_else(|why| panic!("compare --serve tcp: {why}"));
    let fields: Vec<&str> = line.split(' ').collect();
    assert_eq!(fields.len(), 4, "{line}");
    assert_eq!(fields[0], "STATS", "{line}");
    for field in &fields[1..] {
        // CPU ns, voluntary switches, allocations (counted: compare installs the counting allocator).
        assert!(field.parse::<u64>().is_ok(), "{line}");
    }
    assert!(fields[3].parse::<u64>().unwrap() > 0, "{line}");

    let line = counters_line(env!("CARGO_BIN_EXE_soak"), &["--serve", "tcp"])
        .unwrap_or_else(|why| panic!("soak --serve tcp: {why}"));
    assert!(
        line.starts_with("STATS ") && line.ends_with(" -"),
        "soak counts no allocations: {line}"
    );
}
