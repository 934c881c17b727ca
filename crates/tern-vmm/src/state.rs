//! Saved state: what travels in the migration's state sections, separate
//! from the runtime structures that produce and consume it.
//!
//! Encoding: a section is a sequence of chunks `tag: u32, len: u32, bytes`,
//! little endian. KVM's structures travel as their kernel ABI bytes (via
//! `zerocopy`, no `unsafe`), which is what the kernel hands out and takes
//! back; each chunk's length is checked against the structure's size so a
//! section from a different kernel ABI is rejected rather than misread.
//! Unknown tags are an error: a newer source must bump the section version.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use tern_engine::StateSection;
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::{Result, VmmError};

/// Name of the vCPU's section (one vCPU).
pub const VCPU_SECTION: &str = "vcpu0";
/// Name of the VM-wide section (interrupt controllers, clock).
pub const VM_SECTION: &str = "vm";
/// Name of the serial port's section.
pub const SERIAL_SECTION: &str = "serial";
/// Name of the test guest's layout section.
pub const GUEST_SECTION: &str = "test-guest";
/// Layout version of every section this module writes.
pub const SECTION_VERSION: u32 = 1;

/// The saved state of one x86 vCPU.
#[derive(Debug, Default)]
pub struct VcpuState {
    /// General-purpose registers, RIP and RFLAGS.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, APIC base.
    pub sregs: kvm_sregs,
    /// FPU, SSE and AVX state in XSAVE layout.
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Model-specific registers: index and value.
    pub msrs: Vec<(u32, u64)>,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// Pending exceptions, interrupts, NMIs, interrupt shadow, SMM.
    pub events: kvm_vcpu_events,
    /// Multiprocessing state (runnable, halted, waiting for SIPI...).
    pub mp_state: kvm_mp_state,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
}

/// The VM-wide state: the in-kernel PIC pair and IOAPIC, and the clock.
#[derive(Clone, Debug, Default)]
pub struct VmState {
    /// Master 8259 PIC.
    pub pic_master: kvm_irqchip,
    /// Slave 8259 PIC.
    pub pic_slave: kvm_irqchip,
    /// IOAPIC.
    pub ioapic: kvm_irqchip,
    /// The kvmclock base.
    pub clock: kvm_clock_data,
}

/// The saved state of the serial port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SerialState {
    /// Interrupt enable register.
    pub ier: u8,
    /// Line control register.
    pub lcr: u8,
    /// Modem control register.
    pub mcr: u8,
    /// Scratch register.
    pub scr: u8,
    /// Divisor latch, low byte.
    pub dll: u8,
    /// Divisor latch, high byte.
    pub dlm: u8,
    /// Bytes transmitted since boot.
    pub transmitted: u64,
}

/// The test guest's layout, so the destination knows what to check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestLayout {
    /// Pages in the working set.
    pub working_set_pages: u32,
}

mod tag {
    pub(super) const REGS: u32 = 1;
    pub(super) const SREGS: u32 = 2;
    pub(super) const XSAVE: u32 = 3;
    pub(super) const XCRS: u32 = 4;
    pub(super) const MSRS: u32 = 5;
    pub(super) const LAPIC: u32 = 6;
    pub(super) const EVENTS: u32 = 7;
    pub(super) const MP_STATE: u32 = 8;
    pub(super) const DEBUGREGS: u32 = 9;
    pub(super) const PIC_MASTER: u32 = 1;
    pub(super) const PIC_SLAVE: u32 = 2;
    pub(super) const IOAPIC: u32 = 3;
    pub(super) const CLOCK: u32 = 4;
    pub(super) const FIELDS: u32 = 1;
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn chunk(&mut self, tag: u32, bytes: &[u8]) {
        self.0.extend_from_slice(&tag.to_le_bytes());
        let len = u32::try_from(bytes.len()).expect("chunks are small");
        self.0.extend_from_slice(&len.to_le_bytes());
        self.0.extend_from_slice(bytes);
    }

    fn raw<T: IntoBytes + Immutable>(&mut self, tag: u32, value: &T) {
        self.chunk(tag, value.as_bytes());
    }

    fn section(self, name: &str) -> StateSection {
        StateSection {
            name: name.to_owned(),
            version: SECTION_VERSION,
            data: self.0,
        }
    }
}

struct Reader<'a> {
    section: &'a str,
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(section: &'a StateSection, expected: &str) -> Result<Self> {
        let reader = Self {
            section: &section.name,
            data: &section.data,
        };
        if section.name != expected {
            return Err(reader.error(format!("expected section {expected:?}")));
        }
        if section.version != SECTION_VERSION {
            return Err(reader.error(format!(
                "version {} is not the supported {SECTION_VERSION}",
                section.version
            )));
        }
        Ok(reader)
    }

    fn error(&self, reason: String) -> VmmError {
        VmmError::BadState {
            section: self.section.to_owned(),
            reason,
        }
    }

    fn next_chunk(&mut self) -> Result<Option<(u32, &'a [u8])>> {
        if self.data.is_empty() {
            return Ok(None);
        }
        let header = self
            .data
            .get(..8)
            .ok_or_else(|| self.error("truncated chunk header".into()))?;
        let tag = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(header[4..].try_into().expect("4 bytes")) as usize;
        let body = self
            .data
            .get(8..8 + len)
            .ok_or_else(|| self.error(format!("chunk {tag} truncated")))?;
        self.data = &self.data[8 + len..];
        Ok(Some((tag, body)))
    }

    fn decode<T: FromBytes>(&self, tag: u32, bytes: &[u8]) -> Result<T> {
        T::read_from_bytes(bytes).map_err(|_| {
            self.error(format!(
                "chunk {tag} is {} bytes, this host's structure {}",
                bytes.len(),
                std::mem::size_of::<T>()
            ))
        })
    }
}

/// Marks which tags were seen, to reject sections with missing parts.
fn require(reader: &Reader<'_>, seen: u32, tags: &[u32]) -> Result<()> {
    for &tag in tags {
        if seen & (1 << tag) == 0 {
            return Err(reader.error(format!("chunk {tag} is missing")));
        }
    }
    Ok(())
}

impl VcpuState {
    /// Encodes the state as the `vcpu0` section.
    pub fn to_section(&self) -> StateSection {
        let mut writer = Writer::default();
        writer.raw(tag::REGS, &self.regs);
        writer.raw(tag::SREGS, &self.sregs);
        writer.raw(tag::XSAVE, &self.xsave);
        writer.raw(tag::XCRS, &self.xcrs);
        let mut msrs = Vec::with_capacity(self.msrs.len() * 12);
        for (index, value) in &self.msrs {
            msrs.extend_from_slice(&index.to_le_bytes());
            msrs.extend_from_slice(&value.to_le_bytes());
        }
        writer.chunk(tag::MSRS, &msrs);
        writer.raw(tag::LAPIC, &self.lapic);
        writer.raw(tag::EVENTS, &self.events);
        writer.raw(tag::MP_STATE, &self.mp_state);
        writer.raw(tag::DEBUGREGS, &self.debugregs);
        writer.section(VCPU_SECTION)
    }

    /// Decodes the `vcpu0` section.
    pub fn from_section(section: &StateSection) -> Result<Self> {
        let mut reader = Reader::new(section, VCPU_SECTION)?;
        let mut state = Self::default();
        let mut seen = 0u32;
        while let Some((chunk, bytes)) = reader.next_chunk()? {
            match chunk {
                tag::REGS => state.regs = reader.decode(chunk, bytes)?,
                tag::SREGS => state.sregs = reader.decode(chunk, bytes)?,
                tag::XSAVE => state.xsave = reader.decode(chunk, bytes)?,
                tag::XCRS => state.xcrs = reader.decode(chunk, bytes)?,
                tag::MSRS => {
                    if !bytes.len().is_multiple_of(12) {
                        return Err(reader.error("MSR chunk is not a list of entries".into()));
                    }
                    state.msrs = bytes
                        .chunks_exact(12)
                        .map(|entry| {
                            (
                                u32::from_le_bytes(entry[..4].try_into().expect("4 bytes")),
                                u64::from_le_bytes(entry[4..].try_into().expect("8 bytes")),
                            )
                        })
                        .collect();
                }
                tag::LAPIC => state.lapic = reader.decode(chunk, bytes)?,
                tag::EVENTS => state.events = reader.decode(chunk, bytes)?,
                tag::MP_STATE => state.mp_state = reader.decode(chunk, bytes)?,
                tag::DEBUGREGS => state.debugregs = reader.decode(chunk, bytes)?,
                other => return Err(reader.error(format!("unknown chunk {other}"))),
            }
            seen |= 1 << chunk;
        }
        require(
            &reader,
            seen,
            &[
                tag::REGS,
                tag::SREGS,
                tag::XSAVE,
                tag::XCRS,
                tag::MSRS,
                tag::LAPIC,
                tag::EVENTS,
                tag::MP_STATE,
                tag::DEBUGREGS,
            ],
        )?;
        Ok(state)
    }
}

impl VmState {
    /// Encodes the state as the `vm` section.
    pub fn to_section(&self) -> StateSection {
        let mut writer = Writer::default();
        writer.raw(tag::PIC_MASTER, &self.pic_master);
        writer.raw(tag::PIC_SLAVE, &self.pic_slave);
        writer.raw(tag::IOAPIC, &self.ioapic);
        writer.raw(tag::CLOCK, &self.clock);
        writer.section(VM_SECTION)
    }

    /// Decodes the `vm` section.
    pub fn from_section(section: &StateSection) -> Result<Self> {
        let mut reader = Reader::new(section, VM_SECTION)?;
        let mut state = Self::default();
        let mut seen = 0u32;
        while let Some((chunk, bytes)) = reader.next_chunk()? {
            match chunk {
                tag::PIC_MASTER => state.pic_master = reader.decode(chunk, bytes)?,
                tag::PIC_SLAVE => state.pic_slave = reader.decode(chunk, bytes)?,
                tag::IOAPIC => state.ioapic = reader.decode(chunk, bytes)?,
                tag::CLOCK => state.clock = reader.decode(chunk, bytes)?,
                other => return Err(reader.error(format!("unknown chunk {other}"))),
            }
            seen |= 1 << chunk;
        }
        require(
            &reader,
            seen,
            &[tag::PIC_MASTER, tag::PIC_SLAVE, tag::IOAPIC, tag::CLOCK],
        )?;
        Ok(state)
    }
}

impl SerialState {
    /// Encodes the state as the `serial` section.
    pub fn to_section(&self) -> StateSection {
        let mut fields = vec![self.ier, self.lcr, self.mcr, self.scr, self.dll, self.dlm];
        fields.extend_from_slice(&self.transmitted.to_le_bytes());
        let mut writer = Writer::default();
        writer.chunk(tag::FIELDS, &fields);
        writer.section(SERIAL_SECTION)
    }

    /// Decodes the `serial` section.
    pub fn from_section(section: &StateSection) -> Result<Self> {
        let mut reader = Reader::new(section, SERIAL_SECTION)?;
        match reader.next_chunk()? {
            Some((tag::FIELDS, bytes)) if bytes.len() == 14 => Ok(Self {
                ier: bytes[0],
                lcr: bytes[1],
                mcr: bytes[2],
                scr: bytes[3],
                dll: bytes[4],
                dlm: bytes[5],
                transmitted: u64::from_le_bytes(bytes[6..14].try_into().expect("8 bytes")),
            }),
            _ => Err(reader.error("expected one 14-byte chunk of fields".into())),
        }
    }
}

impl GuestLayout {
    /// Encodes the layout as the `test-guest` section.
    pub fn to_section(&self) -> StateSection {
        let mut writer = Writer::default();
        writer.chunk(tag::FIELDS, &self.working_set_pages.to_le_bytes());
        writer.section(GUEST_SECTION)
    }

    /// Decodes the `test-guest` section.
    pub fn from_section(section: &StateSection) -> Result<Self> {
        let mut reader = Reader::new(section, GUEST_SECTION)?;
        match reader.next_chunk()? {
            Some((tag::FIELDS, bytes)) if bytes.len() == 4 => Ok(Self {
                working_set_pages: u32::from_le_bytes(bytes.try_into().expect("4 bytes")),
            }),
            _ => Err(reader.error("expected one 4-byte chunk".into())),
        }
    }
}

/// Finds the section called `name`.
pub fn find<'a>(sections: &'a [StateSection], name: &str) -> Result<&'a StateSection> {
    sections
        .iter()
        .find(|section| section.name == name)
        .ok_or_else(|| VmmError::BadState {
            section: name.to_owned(),
            reason: "missing".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_state_round_trips() {
        let mut state = VcpuState::default();
        state.regs.rip = 0x1234;
        state.regs.rflags = 2;
        state.sregs.cr0 = 0x11;
        state.msrs = vec![(0x10, 99), (0xc000_0080, 0x500)];
        state.mp_state.mp_state = 0;
        state.lapic.regs[0x20] = 7;
        let section = state.to_section();
        let back = VcpuState::from_section(&section).unwrap();
        assert_eq!(back.regs, state.regs);
        assert_eq!(back.sregs, state.sregs);
        assert_eq!(back.msrs, state.msrs);
        assert_eq!(back.lapic.regs[0x20], 7);
    }

    #[test]
    fn rejects_truncated_and_foreign_sections() {
        let mut section = VcpuState::default().to_section();
        section.data.truncate(section.data.len() - 3);
        assert!(VcpuState::from_section(&section).is_err());
        let mut section = VcpuState::default().to_section();
        section.version = 2;
        assert!(VcpuState::from_section(&section).is_err());
        // A chunk of the wrong size (a different kernel ABI) is rejected.
        let mut writer = Writer::default();
        writer.chunk(tag::REGS, &[0; 8]);
        assert!(VcpuState::from_section(&writer.section(VCPU_SECTION)).is_err());
        assert!(SerialState::from_section(&VmState::default().to_section()).is_err());
    }

    #[test]
    fn small_sections_round_trip() {
        let serial = SerialState {
            lcr: 3,
            transmitted: 1 << 40,
            ..SerialState::default()
        };
        assert_eq!(
            SerialState::from_section(&serial.to_section()).unwrap(),
            serial
        );
        let layout = GuestLayout {
            working_set_pages: 77,
        };
        assert_eq!(
            GuestLayout::from_section(&layout.to_section()).unwrap(),
            layout
        );
        let mut vm = VmState::default();
        vm.clock.clock = 42;
        assert_eq!(
            VmState::from_section(&vm.to_section()).unwrap().clock.clock,
            42
        );
    }
}
