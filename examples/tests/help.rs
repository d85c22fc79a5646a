//! Every example answers `--help` and `-h` with its usage and exit status
//! 0, and rejects an unknown flag or a bad value with clap's message and a
//! non-zero status; the streaming and balancing examples run over every
//! transport, the TLS example (feature `tls`) over tls:// and rdma+tls://.
//!
//! Cargo gives integration tests the paths of binaries, not of examples, so
//! this looks for the examples where `cargo test` builds them: in
//! `examples/` beside the `deps/` folder this test runs from. A plain
//! `cargo test` (or `cargo test -p rdma-rpc-examples`) builds them first;
//! `cargo test --test help` alone does not, and this test then says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The examples every build has; [`examples`] adds the TLS one where it is built.
const EXAMPLES: [&str; 10] = [
    "balance",
    "chat",
    "echo",
    "echo_client",
    "echo_server",
    "grpc",
    "metrics",
    "tower_stack",
    "upload",
    "watch",
];

/// Every example this build has: [`EXAMPLES`], and `tls` with feature `tls`.
fn examples() -> Vec<&'static str> {
    let mut all = EXAMPLES.to_vec();
    if cfg!(feature = "tls") {
        all.push("tls");
    }
    all
}

/// The built example `name`.
fn example(name: &str) -> PathBuf {
    let test = std::env::current_exe().expect("own path");
    let profile = test
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is not built: run `cargo test -p rdma-rpc-examples` (which builds the examples), \
         not only `--test help`",
        path.display()
    );
    path
}

fn run(name: &str, args: &[&str]) -> Output {
    Command::new(example(name))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap_or_else(|error| panic!("start {name}: {error}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_prints_usage_and_exits_zero() {
    for name in examples() {
        for flag in ["--help", "-h"] {
            let output = run(name, &[flag]);
            let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
            assert!(
                output.status.success(),
                "{name} {flag}: {}\nstdout: {stdout}\nstderr: {stderr}",
                output.status
            );
            // Every example takes an endpoint; grpc takes two, as options.
            let endpoint = if name == "grpc" {
                "--grpc <GRPC>"
            } else {
                "[ENDPOINT]"
            };
            assert!(
                stdout.contains("Usage:") && stdout.contains(endpoint),
                "{name} {flag} printed no usage: {stdout}"
            );
            assert!(!stderr.contains("panicked"), "{name} {flag}: {stderr}");
        }
    }
}

#[test]
fn unknown_flag_is_an_error_not_a_panic() {
    for name in examples() {
        let output = run(name, &["--bogus"]);
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
fn bad_values_and_extra_arguments_are_errors() {
    for (name, args) in [
        ("echo_client", &["tcp://127.0.0.1:1", "many"][..]),
        ("echo", &["mem://echo", "extra"]),
        ("echo_server", &["tcp://127.0.0.1:0", "extra"]),
        ("tower_stack", &["mem://kv", "extra"]),
        ("metrics", &["mem://metrics", "not-an-address"]),
        ("upload", &["mem://upload", "--chunk-bytes", "many"]),
        ("watch", &["mem://watch", "--count", "-1"]),
        ("grpc", &["--rdma", "rdma://127.0.0.1:0", "extra"]),
        ("balance", &["mem://balance", "--calls", "0"]),
    ] {
        let output = run(name, args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{name} {args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{name} {args:?}: {stderr}");
    }
}

#[test]
fn streaming_examples_run_over_every_transport() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/lib.rs");
    for endpoint in ["mem://streams", "tcp://127.0.0.1:0", "rdma://127.0.0.1:0"] {
        for (name, args, says) in [
            (
                "watch",
                &["--count", "3", "--interval-ms", "5"][..],
                "DeadlineExceeded, as it should",
            ),
            (
                "upload",
                &["--file", file, "--chunk-bytes", "1000"],
                "size and checksum",
            ),
            ("chat", &[], "bob hears ada: hello, is anyone here?"),
        ] {
            let mut all = vec![endpoint];
            all.extend_from_slice(args);
            let output = run(name, &all);
            let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
            assert!(
                output.status.success() && stdout.contains(says),
                "{name} {all:?}: {}\nstdout: {stdout}\nstderr: {stderr}",
                output.status
            );
            assert!(
                stdout.contains("server shut down gracefully"),
                "{name}: {stdout}"
            );
        }
    }
}

/// The grpc example serves one service over rdma:// and grpc:// at once and
/// calls it with the Rust client over both and with Python's grpcio (which
/// must run where `RDMA_RPC_REQUIRE_PYTHON` is set, as in CI).
#[test]
fn grpc_example_is_called_over_rdma_and_grpc_by_rust_and_python() {
    // Python's grpcio, installed under target/ where python3 lacks it.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/python-grpcio");
    let grpcio = Command::new(&script).output();
    let output = match &grpcio {
        Ok(found) if found.status.success() => {
            let path = text(&found.stdout).trim().to_owned();
            Command::new(example("grpc"))
                .env("RUST_BACKTRACE", "1")
                .envs((!path.is_empty()).then_some(("PYTHONPATH", path)))
                .output()
                .expect("start grpc")
        }
        _ => run("grpc", &[]),
    };
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "grpc: {stdout}\n{stderr}");
    for says in [
        "rust client over rdma://",
        "rust client over grpc://",
        "servers shut down gracefully",
    ] {
        assert!(stdout.contains(says), "{says}: {stdout}");
    }
    let python = "python grpcio: Say('hello from Python') -> 'hello from Python'";
    if stdout.contains(python) {
        return;
    }
    assert!(
        std::env::var_os("RDMA_RPC_REQUIRE_PYTHON").is_none(),
        "the Python client did not run: {stdout}"
    );
    let why = match &grpcio {
        Ok(found) if !found.status.success() => text(&found.stderr),
        Ok(_) => String::new(),
        Err(error) => format!("scripts/python-grpcio did not run: {error}"),
    };
    println!("skipped: the grpc example's Python call: {why}{stdout}");
}

/// The balancing example spreads calls over its three servers, then stops
/// one: once the balancer has ejected it, every call succeeds on the other
/// two (the example exits non-zero otherwise, or when a server took none).
#[test]
fn balance_example_spreads_calls_and_goes_on_without_a_stopped_server() {
    for endpoint in ["mem://balance", "tcp://127.0.0.1:0", "rdma://127.0.0.1:0"] {
        let output = run("balance", &[endpoint, "--calls", "150"]);
        let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
        assert!(
            output.status.success(),
            "balance {endpoint}: {}\nstdout: {stdout}\nstderr: {stderr}",
            output.status
        );
        for says in [
            "150 calls, 16 in flight, over 3 servers: 150 succeeded, 0 failed",
            "150 calls over the 2 servers left: 150 succeeded, 0 failed",
            "server 1 (stopped): 0 calls",
            "servers shut down gracefully; done",
        ] {
            assert!(
                stdout.contains(says),
                "balance {endpoint}: {says}: {stdout}"
            );
        }
    }
}

/// The TLS example serves over tls:// and rdma+tls://, is called by a client
/// that trusts its certificate authority, and refuses one that does not.
#[cfg(feature = "tls")]
#[test]
fn tls_example_calls_with_a_trusted_ca_and_refuses_a_stranger() {
    let output = run("tls", &[]);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(
        output.status.success(),
        "tls: {}\nstdout: {stdout}\nstderr: {stderr}",
        output.status
    );
    for scheme in ["tls", "rdma+tls"] {
        assert!(
            stdout.contains(&format!("say -> \"hello over {scheme}://\"")),
            "{scheme}: {stdout}"
        );
    }
    // Once per scheme, with rustls' reason.
    for says in [
        "client trusting another CA: refused, as it should: ",
        "invalid peer certificate: UnknownIssuer",
        "after the refusal, the trusting client: say -> \"still here\"",
    ] {
        assert_eq!(stdout.matches(says).count(), 2, "{says}: {stdout}");
    }
    assert!(stdout.ends_with("done\n"), "{stdout}");
}

/// A `cross_host serve` on rdma:// (the soft provider here), and where it
/// listens.
fn cross_host_server() -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut server = Command::new(example("cross_host"))
        .args(["serve", "rdma://127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start cross_host serve");
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("the server's first line");
    let endpoint = line
        .trim()
        .strip_prefix("cross_host server listening on ")
        .unwrap_or_else(|| panic!("cross_host serve said {line:?}"))
        .to_owned();
    (server, endpoint)
}

/// The two-host suite's tool (the VM stage runs it between two guests),
/// here between two processes: its checks pass against a live server, and
/// its load runs tell a fault that was expected from one that was not.
#[test]
fn cross_host_checks_a_server_and_tells_expected_faults_from_violations() {
    let help = run("cross_host", &["--help"]);
    assert!(
        help.status.success() && text(&help.stdout).contains("Usage: cross_host <COMMAND>"),
        "{}",
        text(&help.stdout)
    );

    let (mut server, endpoint) = cross_host_server();
    let check = run(
        "cross_host",
        &[
            "check",
            &endpoint,
            "--concurrent",
            "500",
            "--large-mib",
            "4",
        ],
    );
    let stdout = text(&check.stdout);
    assert!(
        check.status.success() && stdout.contains("test result: ok. 8 passed; 0 failed"),
        "{stdout}\n{}",
        text(&check.stderr)
    );

    let load = |expect: &str, fault: &str| {
        let mut args = vec![
            "load",
            &endpoint,
            "--label",
            "test",
            "--seconds",
            "2",
            "--fault-at",
            "0.5",
            "--large-kib",
            "256",
            "--expect",
            expect,
        ];
        if !fault.is_empty() {
            args.extend(["--fault", fault]);
        }
        let output = run("cross_host", &args);
        (output.status.success(), text(&output.stdout))
    };
    let (ok, row) = load("complete", "");
    assert!(
        ok && row.contains("| none |") && row.ends_with("| 0 | ok |\n"),
        "{row}"
    );
    // Killing the server where every call must complete is a violation...
    let kill = format!("kill -9 {}", server.id());
    let (ok, row) = load("complete", &kill);
    assert!(!ok && row.contains("VIOLATED: calls failed"), "{row}");
    let _ = server.wait();
    // ... and where the server's death is the point, it is what must happen.
    let (mut server, endpoint) = cross_host_server();
    let kill = format!("kill -9 {}", server.id());
    let output = run(
        "cross_host",
        &[
            "load",
            &endpoint,
            "--label",
            "killed",
            "--seconds",
            "2",
            "--fault-at",
            "0.5",
            "--expect",
            "dead",
            "--fault",
            &kill,
        ],
    );
    let row = text(&output.stdout);
    assert!(
        output.status.success() && row.contains("Unavailable") && row.contains("| ok |"),
        "{row}"
    );
    let _ = server.wait();
}
