//! rpc-transport-rdma: RDMA for rdma-rpc.
//!
//! Today this crate holds [`verbs`], the RDMA vocabulary of the project behind
//! provider traits, with the `soft` provider: a software RDMA device with RC
//! semantics for processes on one host. The RPC transport over it
//! (`rdma://`) builds on these traits.

pub mod protocol;
pub mod setup;
pub mod verbs;
