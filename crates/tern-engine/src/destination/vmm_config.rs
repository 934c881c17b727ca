//! The source VMM's opaque configuration: announced in the hello
//! (`vmm_config_len`), sent right after it, before the welcome, and given
//! to the embedder's setup callback with the session setup (Cloud
//! Hypervisor's destination builds the VM from its `Config` first).

use tern_wire::{FRAME_HEADER_LEN, FrameDecoder, Message, VmmConfig};

use super::handshake::peer_aborted;
use super::stream::{FrameSource, read_message_within};
use crate::error::MigrationError;

/// Reads the configuration the hello announced, at most `max` bytes: a
/// longer announcement is refused before anything more is read, and a
/// frame longer than announced is refused at its header, before its body
/// is read. Empty when none was announced.
pub(super) fn receive(
    main: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    hello: &Message,
    max: usize,
) -> Result<Vec<u8>, MigrationError> {
    let Message::Hello(hello) = hello else {
        return Ok(Vec::new());
    };
    let announced = hello.setup.vmm_config_len as usize;
    if announced == 0 {
        return Ok(Vec::new());
    }
    if announced > max {
        return Err(MigrationError::Incompatible(format!(
            "the source's VMM configuration is {announced} bytes; this destination accepts \
             at most {max} (max_vmm_config)"
        )));
    }
    let max_frame = FRAME_HEADER_LEN + VmmConfig::HEADER_LEN + announced;
    match read_message_within(main, decoder, max_frame).map_err(MigrationError::channel(0))? {
        Message::VmmConfig(config) if config.data.len() == announced => Ok(config.data),
        Message::VmmConfig(config) => Err(MigrationError::Protocol(format!(
            "the VMM configuration has {} bytes, the hello announced {announced}",
            config.data.len()
        ))),
        Message::Abort(abort) => Err(peer_aborted(abort)),
        other => Err(MigrationError::Protocol(format!(
            "expected the VMM configuration after the hello, got {:?}",
            other.kind()
        ))),
    }
}
