//! Generated code for the test protos, in modules that mirror their packages.
#![forbid(unsafe_code)]
#![allow(missing_docs, clippy::all)]

pub mod acme {
    pub mod common {
        pub mod v1 {
            rpc_core::include_proto!("acme.common.v1");
        }
    }
    pub mod inventory {
        pub mod v1 {
            rpc_core::include_proto!("acme.inventory.v1");
        }
    }
}

pub mod echo {
    pub mod v1 {
        rpc_core::include_proto!("echo.v1");
    }
}

pub mod kv {
    pub mod v1 {
        rpc_core::include_proto!("kv.v1");
    }
}

/// The package-less `plain.proto`.
pub mod plain {
    rpc_core::include_proto!("_");
}
