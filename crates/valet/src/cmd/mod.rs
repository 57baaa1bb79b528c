//! One module per subcommand.

pub(crate) mod control_plane;
pub(crate) mod ctl;
pub(crate) mod envoy_bootstrap;
pub(crate) mod load;
pub(crate) mod router;
pub(crate) mod up;
pub(crate) mod worker;
