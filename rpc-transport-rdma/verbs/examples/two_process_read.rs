//! Two processes, one RDMA READ, no `unsafe`: the parent registers a buffer
//! the peer may READ, the child (this program run again with `--child`)
//! pulls it with a one-sided READ and prints it. The queue pairs' addresses
//! go over the child's stdin and stdout, as they would over any socket.
//!
//! ```text
//! cargo run -p rdma-verbs --example two_process_read
//! ```
//!
//! `RDMA_PROVIDER=ibverbs RDMA_DEVICE=rxe0` runs it on real rdma-core (with
//! the feature `ibverbs`); the soft provider needs nothing.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_verbs::owned::OwnedQueue;
use rdma_verbs::{
    self as verbs, AccessFlags, ConnectOptions, Context, ProtectionDomain, QpAddress, QpCaps,
    RegisteredBuffer, SendOp, WcStatus,
};

const MESSAGE: &[u8] = b"hello from the parent's memory, read without its CPU";

type Error = Box<dyn std::error::Error>;

/// An opened device and a protection domain on it.
type Opened = (Arc<dyn Context>, Arc<dyn ProtectionDomain>);

fn open() -> Result<Opened, Error> {
    let provider = std::env::var("RDMA_PROVIDER").unwrap_or_else(|_| "soft".into());
    let provider = verbs::provider(&provider)?;
    let device = match std::env::var("RDMA_DEVICE") {
        Ok(device) => device,
        Err(_) => provider.devices()?.remove(0).name,
    };
    let context = provider.open(&device)?;
    let pd = context.alloc_pd()?;
    Ok((context, pd))
}

fn write_frame(out: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&(bytes.len() as u32).to_le_bytes())?;
    out.write_all(bytes)?;
    out.flush()
}

fn read_frame(input: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0; 4];
    input.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 64 << 10 {
        return Err(std::io::Error::other("frame too long"));
    }
    let mut bytes = vec![0; len];
    input.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn parent() -> Result<(), Error> {
    let (context, pd) = open()?;
    // Remote READ only: a buffer a peer may write would give no safe slices.
    let mut memory = RegisteredBuffer::new(&pd, 4096, AccessFlags::REMOTE_READ)?;
    memory.as_mut_slice()[..MESSAGE.len()].copy_from_slice(MESSAGE);
    let queue = OwnedQueue::new(&context, &pd, QpCaps::default())?;
    queue.qp().to_init()?;

    let mut child = Command::new(std::env::current_exe()?)
        .arg("--child")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().ok_or("child stdin")?;
    let mut from_child = child.stdout.take().ok_or("child stdout")?;

    // What the child needs: our QP's address, and where to READ.
    write_frame(&mut to_child, &queue.qp().local_address().to_bytes())?;
    let mut region = Vec::new();
    region.extend_from_slice(&memory.addr().to_le_bytes());
    region.extend_from_slice(&memory.rkey().to_le_bytes());
    region.extend_from_slice(&(MESSAGE.len() as u32).to_le_bytes());
    write_frame(&mut to_child, &region)?;
    let child_address = QpAddress::from_bytes(&read_frame(&mut from_child)?)?;
    queue
        .qp()
        .connect(&child_address, &ConnectOptions::default())?;
    // Connected: the child may READ now.
    write_frame(&mut to_child, b"go")?;

    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the child failed: {status}").into());
    }
    // `memory` (and the QP) live until the child is done with them.
    drop(queue);
    drop(memory);
    Ok(())
}

fn child() -> Result<(), Error> {
    let (context, pd) = open()?;
    let mut queue = OwnedQueue::new(&context, &pd, QpCaps::default())?;
    queue.qp().to_init()?;
    let mut input = std::io::stdin().lock();
    let mut output = std::io::stdout().lock();
    let parent_address = QpAddress::from_bytes(&read_frame(&mut input)?)?;
    let region = read_frame(&mut input)?;
    if region.len() != 16 {
        return Err("malformed region".into());
    }
    let remote_addr = u64::from_le_bytes(region[..8].try_into()?);
    let rkey = u32::from_le_bytes(region[8..12].try_into()?);
    let len = u32::from_le_bytes(region[12..16].try_into()?) as usize;
    write_frame(&mut output, &queue.qp().local_address().to_bytes())?;
    queue
        .qp()
        .connect(&parent_address, &ConnectOptions::default())?;
    read_frame(&mut input)?; // "go"

    // The destination moves into the queue and comes back with the READ's
    // completion: nothing can touch it while the device writes it.
    let destination = RegisteredBuffer::new(&pd, len, AccessFlags::LOCAL_WRITE)?;
    queue
        .post_send(SendOp::RdmaRead { remote_addr, rkey }, destination, len)
        .map_err(|failed| failed.error)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let done = loop {
        if let Some(done) = queue.poll()?.pop() {
            break done;
        }
        if Instant::now() > deadline {
            return Err("no completion within 10 s".into());
        }
        std::thread::sleep(Duration::from_micros(50));
    };
    if done.completion.status != WcStatus::Success {
        return Err(format!("READ failed: {}", done.completion.status).into());
    }
    eprintln!(
        "child READ {} bytes: {:?}",
        done.completion.byte_len,
        String::from_utf8_lossy(&done.buffer.as_slice()[..len])
    );
    Ok(())
}

fn main() -> Result<(), Error> {
    if std::env::args().any(|arg| arg == "--child") {
        child()
    } else {
        parent()
    }
}
