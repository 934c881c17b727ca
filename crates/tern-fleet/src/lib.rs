//! tern's host coordinator: every migration on a host joins one agent,
//! which gives out inbound and outbound slots (a migration beyond them
//! waits, queued, with its place in line), divides the host's bandwidth
//! budget among the running migrations as they start, converge and finish,
//! and applies each one's policy in KubeVirt's terms (completion and
//! progress timeouts, auto-converge, postcopy, priority). docs/fleet.md
//! describes the protocol, the division and how KubeVirt's and Nova's
//! settings map onto it.
//!
//! * [`agent::Agent`]: the daemon (`tern agent`), a Unix socket.
//! * [`member::join`]: the one call a migration joins with, from `tern
//!   migrate|receive|vm --agent PATH` or from a VMM embedding the engine.
//! * [`division`], [`limits`], [`registry`]: the decisions, pure and
//!   tested apart from the I/O.
//!
//! A separate crate, not a module of the `tern` binary, so that an
//! embedder joins with one call and without the CLI's dependencies.
//!
//! ```no_run
//! # fn example(source: &tern_engine::Source) -> Result<(), tern_fleet::FleetError> {
//! use tern_fleet::member::{JoinOptions, Steered, join};
//! let membership = join(
//!     std::path::Path::new("/run/tern/agent.sock"),
//!     Steered::Source(source.handle()),
//!     JoinOptions::new("vm-17"),
//! )?;
//! // ... source.migrate(&mut guest, &address) ...
//! drop(membership); // leaves the agent
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod agent;
pub mod division;
mod error;
pub mod limits;
mod line;
pub mod member;
pub mod peer;
pub mod protocol;
pub mod registry;

pub use agent::Agent;
pub use division::Division;
pub use error::FleetError;
pub use member::{JoinOptions, MemberState, Membership, Steered, join};
pub use protocol::{FLEET_PROTOCOL_VERSION, FleetSettings, FleetView, MigrationPolicy};
pub use registry::Settings;
