//! A minimal 16550-style UART at COM1: enough registers for a guest that
//! writes bytes and polls the line status, no interrupts, no input.

use std::collections::VecDeque;

use crate::state::SerialState;

/// First port of COM1.
pub const COM1_BASE: u16 = 0x3f8;
/// Number of ports the UART decodes.
pub const PORT_COUNT: u16 = 8;

const LCR_DLAB: u8 = 0x80;
/// Line status: transmitter holding register empty and transmitter empty.
const LSR_IDLE: u8 = 0x60;
/// Interrupt identification: no interrupt pending.
const IIR_NONE: u8 = 0x01;
/// How many of the last transmitted bytes are kept for inspection.
const TAIL_LEN: usize = 256;

/// The UART's runtime state.
#[derive(Debug, Default)]
pub struct Serial {
    ier: u8,
    lcr: u8,
    mcr: u8,
    scr: u8,
    dll: u8,
    dlm: u8,
    transmitted: u64,
    tail: VecDeque<u8>,
}

impl Serial {
    /// A UART after reset.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `port` belongs to this UART.
    pub fn handles(port: u16) -> bool {
        (COM1_BASE..COM1_BASE + PORT_COUNT).contains(&port)
    }

    /// A guest write of `value` to `port`.
    pub fn write(&mut self, port: u16, value: u8) {
        let dlab = self.lcr & LCR_DLAB != 0;
        match port - COM1_BASE {
            0 if dlab => self.dll = value,
            0 => {
                self.transmitted += 1;
                if self.tail.len() == TAIL_LEN {
                    self.tail.pop_front();
                }
                self.tail.push_back(value);
            }
            1 if dlab => self.dlm = value,
            1 => self.ier = value & 0x0f,
            3 => self.lcr = value,
            4 => self.mcr = value & 0x1f,
            7 => self.scr = value,
            _ => {}
        }
    }

    /// A guest read of `port`.
    pub fn read(&self, port: u16) -> u8 {
        let dlab = self.lcr & LCR_DLAB != 0;
        match port - COM1_BASE {
            0 if dlab => self.dll,
            1 if dlab => self.dlm,
            1 => self.ier,
            2 => IIR_NONE,
            3 => self.lcr,
            4 => self.mcr,
            5 => LSR_IDLE,
            // Modem status: CTS, DSR and DCD asserted.
            6 => 0xb0,
            7 => self.scr,
            _ => 0,
        }
    }

    /// Bytes the guest has transmitted since it booted (carried across
    /// migrations).
    pub fn transmitted(&self) -> u64 {
        self.transmitted
    }

    /// The last bytes transmitted on this host, oldest first.
    pub fn tail(&self) -> Vec<u8> {
        self.tail.iter().copied().collect()
    }

    /// The saved form.
    pub fn save(&self) -> SerialState {
        SerialState {
            ier: self.ier,
            lcr: self.lcr,
            mcr: self.mcr,
            scr: self.scr,
            dll: self.dll,
            dlm: self.dlm,
            transmitted: self.transmitted,
        }
    }

    /// A UART in the saved state.
    pub fn restore(state: &SerialState) -> Self {
        Self {
            ier: state.ier,
            lcr: state.lcr,
            mcr: state.mcr,
            scr: state.scr,
            dll: state.dll,
            dlm: state.dlm,
            transmitted: state.transmitted,
            tail: VecDeque::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisor_latch_and_data() {
        let mut serial = Serial::new();
        serial.write(0x3fb, 0x80);
        serial.write(0x3f8, 12);
        serial.write(0x3fb, 0x03);
        serial.write(0x3f8, b'x');
        assert_eq!(serial.transmitted(), 1);
        assert_eq!(serial.tail(), b"x");
        assert_eq!(serial.read(0x3fd), LSR_IDLE);
        let restored = Serial::restore(&serial.save());
        assert_eq!(restored.save(), serial.save());
        assert_eq!(restored.read(0x3fb), 0x03);
    }
}
