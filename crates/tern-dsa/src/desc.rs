//! The 64-byte DSA work descriptor and the 32-byte completion record, laid
//! out field by field as in `struct dsa_hw_desc` and
//! `struct dsa_completion_record` of `<linux/idxd.h>`.
//!
//! The C header uses bit-fields and unions; here the bit-fields are split at
//! byte boundaries (little-endian, which is the only byte order DSA exists
//! in) and each union is one field named after its widest meaning, with
//! accessors for the other meanings this crate uses. Layout is verified by
//! `offset_of!` tests below, so a typo cannot silently make the device read a
//! different field.

/// Opcode: no operation; completes immediately (used to probe a queue).
pub const OPCODE_NOOP: u8 = 0x00;
/// Opcode: batch; `src_addr` points to a list of `desc_count` descriptors.
pub const OPCODE_BATCH: u8 = 0x01;
/// Opcode: drain.
pub const OPCODE_DRAIN: u8 = 0x02;
/// Opcode: memory move.
pub const OPCODE_MEMMOVE: u8 = 0x03;
/// Opcode: memory fill.
pub const OPCODE_MEMFILL: u8 = 0x04;
/// Opcode: compare two buffers.
pub const OPCODE_COMPARE: u8 = 0x05;
/// Opcode: compare a buffer against an 8-byte pattern ("compare value");
/// with pattern 0 this is a zero-page check.
pub const OPCODE_COMPVAL: u8 = 0x06;
/// Opcode: create delta record (`DSA_OPCODE_CR_DELTA`): compare two buffers
/// 8 bytes at a time and write, for each word that differs, its index
/// (`u16`) and the second buffer's value (8 bytes).
pub const OPCODE_CR_DELTA: u8 = 0x07;
/// Opcode: apply delta record (`DSA_OPCODE_AP_DELTA`): write each entry's
/// value at its word of the destination.
pub const OPCODE_AP_DELTA: u8 = 0x08;

/// Create-delta result: the buffers are equal (no record written).
pub const DELTA_RESULT_EQUAL: u8 = 0;
/// Create-delta result: they differ; the record holds `delta_rec_size` bytes.
pub const DELTA_RESULT_DIFFERENT: u8 = 1;
/// Create-delta result: the record would exceed `max_delta_size`.
pub const DELTA_RESULT_OVERFLOW: u8 = 2;

/// Flag: fence (wait for earlier descriptors of the batch).
pub const FLAG_FENCE: u32 = 0x0001;
/// Flag: block on fault. Cleared here: a fault must come back as a partial
/// completion the CPU finishes, not stall the engine on the guest's pages.
pub const FLAG_BOF: u32 = 0x0002;
/// Flag: completion record address valid.
pub const FLAG_CRAV: u32 = 0x0004;
/// Flag: request a completion record even on success.
pub const FLAG_RCR: u32 = 0x0008;
/// Flag: request a completion interrupt.
pub const FLAG_RCI: u32 = 0x0010;
/// Flag: check result (compare against `expected_res`).
pub const FLAG_CR: u32 = 0x0080;
/// Flag: cache control (write destination to cache).
pub const FLAG_CC: u32 = 0x0100;
/// Mask of the 24 bits the flags field occupies.
pub const FLAGS_MASK: u32 = 0x00ff_ffff;

/// Status: not yet written. Completion records are zeroed before
/// submission, so "still 0" means "still running".
pub const STATUS_NONE: u8 = 0x00;
/// Status: success.
pub const STATUS_SUCCESS: u8 = 0x01;
/// Status: success with false predicate (check-result flag).
pub const STATUS_SUCCESS_PRED: u8 = 0x02;
/// Status: page fault with block-on-fault clear; `bytes_completed` and
/// `fault_addr` say where the device stopped.
pub const STATUS_PAGE_FAULT_NOBOF: u8 = 0x03;
/// Status: page fault on the completion record (interrupt requested).
pub const STATUS_PAGE_FAULT_IR: u8 = 0x04;
/// Status (batch record): at least one descriptor of the batch did not
/// complete with success.
pub const STATUS_BATCH_FAIL: u8 = 0x05;
/// Status (batch record): page fault reading the descriptor list.
pub const STATUS_BATCH_PAGE_FAULT: u8 = 0x06;
/// Status: unsupported opcode.
pub const STATUS_BAD_OPCODE: u8 = 0x10;
/// Status: invalid flags.
pub const STATUS_INVALID_FLAGS: u8 = 0x11;
/// Status: a reserved field was non-zero.
pub const STATUS_NOZERO_RESERVE: u8 = 0x12;
/// Status: transfer size out of range.
pub const STATUS_XFER_ERANGE: u8 = 0x13;
/// Status: batch descriptor count out of range (must be 2..=max batch).
pub const STATUS_DESC_CNT_ERANGE: u8 = 0x14;
/// Status: batch descriptor list not aligned.
pub const STATUS_DESCLIST_ALIGN: u8 = 0x18;
/// Status: completion record address not aligned.
pub const STATUS_CRA_ALIGN: u8 = 0x1b;
/// Status: traffic-class configuration error (`DSA_COMP_TRAFFIC_CLASS_CONF`).
pub const STATUS_TRAFFIC_CLASS_CONF: u8 = 0x1e;
/// Status: internal hardware error 1 (`DSA_COMP_HW_ERR1`).
pub const STATUS_HW_ERR1: u8 = 0x20;
/// Status: hardware error reading the descriptor (`DSA_COMP_HW_ERR_DRB`).
pub const STATUS_HW_ERR_DRB: u8 = 0x21;
/// Status: address translation failed (`DSA_COMP_TRANSLATION_FAIL`).
pub const STATUS_TRANSLATION_FAIL: u8 = 0x22;

/// The status byte carries the code in its low 7 bits; bit 7 says a page
/// fault was on a write.
pub const STATUS_MASK: u8 = 0x7f;
/// Bit 7 of the status byte: the faulting access was a write.
pub const STATUS_WRITE_FAULT: u8 = 0x80;

/// What a completion record's status byte means for this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DsaStatus {
    /// Not written yet: the operation is still running (or never started).
    Pending,
    /// Completed; the `result` field is valid.
    Success,
    /// Completed with a false predicate (only with [`FLAG_CR`]).
    SuccessPred,
    /// Stopped at a page fault; `bytes_completed` bytes were processed.
    PageFault {
        /// The faulting access was a write (never the case for COMPVAL).
        write: bool,
    },
    /// Batch record: some descriptor of the batch failed; look at each one.
    BatchFail,
    /// Batch record: the descriptor list itself could not be read.
    BatchPageFault,
    /// Any other code: a programming or device error.
    Error(u8),
}

impl DsaStatus {
    /// Decodes a raw status byte.
    pub fn decode(raw: u8) -> Self {
        match raw & STATUS_MASK {
            STATUS_NONE => DsaStatus::Pending,
            STATUS_SUCCESS => DsaStatus::Success,
            STATUS_SUCCESS_PRED => DsaStatus::SuccessPred,
            STATUS_PAGE_FAULT_NOBOF => DsaStatus::PageFault {
                write: raw & STATUS_WRITE_FAULT != 0,
            },
            STATUS_BATCH_FAIL => DsaStatus::BatchFail,
            STATUS_BATCH_PAGE_FAULT => DsaStatus::BatchPageFault,
            other => DsaStatus::Error(other),
        }
    }

    /// Whether the device has written the record (any status but 0).
    pub fn is_complete(self) -> bool {
        self != DsaStatus::Pending
    }
}

/// One 64-byte DSA work descriptor (`struct dsa_hw_desc`).
///
/// 64-byte alignment is what MOVDIR64B/ENQCMD read in one go and what the
/// batch descriptor list requires.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Bits 0..20 PASID, 20..31 reserved, bit 31 privileged. Left 0: for user
    /// work queues ENQCMD fills the PASID from the thread's MSR and dedicated
    /// queues use the PASID configured on the queue.
    pub pasid_priv: u32,
    /// Bits 0..24 of the second dword: operation flags (`FLAG_*`),
    /// little-endian.
    pub flags: [u8; 3],
    /// Operation code (`OPCODE_*`), the top byte of the second dword.
    pub opcode: u8,
    /// Address of the 32-byte aligned completion record.
    pub completion_addr: u64,
    /// Source address; also `pattern` (MEMFILL) and `desc_list_addr` (BATCH).
    pub src_addr: u64,
    /// Destination address; also `comp_pattern` (COMPVAL) and `src2_addr`.
    pub dst_addr: u64,
    /// Transfer size in bytes; `desc_count` for BATCH.
    pub xfer_size: u32,
    /// Interrupt handle (unused: we poll).
    pub int_handle: u16,
    /// Reserved, must be 0.
    pub rsvd1: u16,
    /// Operation-specific bytes (`expected_res` is byte 0).
    pub op_specific: [u8; 24],
}

impl Descriptor {
    /// The flags as a number.
    pub fn flags(&self) -> u32 {
        u32::from_le_bytes([self.flags[0], self.flags[1], self.flags[2], 0])
    }

    /// Sets the 24 flag bits; higher bits are dropped (they are the opcode).
    pub fn set_flags(&mut self, flags: u32) {
        let b = (flags & FLAGS_MASK).to_le_bytes();
        self.flags = [b[0], b[1], b[2]];
    }

    /// A COMPVAL descriptor: compare `len` bytes at `src` against the 8-byte
    /// `pattern`, report into the record at `completion`.
    ///
    /// Flags are CRAV|RCR (a record is always written, so "status != 0" is the
    /// one completion test) and not BOF (faults come back as partial
    /// completions instead of blocking the device).
    pub fn compval(src: u64, len: u32, pattern: u64, completion: u64) -> Self {
        let mut d = Descriptor {
            opcode: OPCODE_COMPVAL,
            completion_addr: completion,
            src_addr: src,
            dst_addr: pattern,
            xfer_size: len,
            ..Descriptor::default()
        };
        d.set_flags(FLAG_CRAV | FLAG_RCR);
        d
    }

    /// A BATCH descriptor for `count` descriptors at `list` (64-byte
    /// aligned), reporting into the record at `completion`.
    pub fn batch(list: u64, count: u32, completion: u64) -> Self {
        let mut d = Descriptor {
            opcode: OPCODE_BATCH,
            completion_addr: completion,
            src_addr: list,
            xfer_size: count,
            ..Descriptor::default()
        };
        d.set_flags(FLAG_CRAV | FLAG_RCR);
        d
    }

    /// A create-delta-record descriptor: compare `len` bytes at `original`
    /// and `new`, write the record (at most `max_delta_size` bytes) to
    /// `delta`, report into the record at `completion` (its
    /// `delta_rec_size`). Flags as for [`Descriptor::compval`].
    pub fn create_delta(
        original: u64,
        new: u64,
        len: u32,
        delta: u64,
        max_delta_size: u32,
        completion: u64,
    ) -> Self {
        let mut d = Descriptor {
            opcode: OPCODE_CR_DELTA,
            completion_addr: completion,
            src_addr: original,
            dst_addr: new,
            xfer_size: len,
            ..Descriptor::default()
        };
        d.op_specific[..8].copy_from_slice(&delta.to_le_bytes());
        d.op_specific[8..12].copy_from_slice(&max_delta_size.to_le_bytes());
        d.set_flags(FLAG_CRAV | FLAG_RCR);
        d
    }

    /// An apply-delta-record descriptor: apply the `delta_rec_size` bytes of
    /// record at `delta` to the `len` bytes at `destination`.
    pub fn apply_delta(
        delta: u64,
        delta_rec_size: u32,
        destination: u64,
        len: u32,
        completion: u64,
    ) -> Self {
        let mut d = Descriptor {
            opcode: OPCODE_AP_DELTA,
            completion_addr: completion,
            src_addr: delta,
            dst_addr: destination,
            xfer_size: len,
            ..Descriptor::default()
        };
        d.op_specific[..4].copy_from_slice(&delta_rec_size.to_le_bytes());
        d.set_flags(FLAG_CRAV | FLAG_RCR);
        d
    }

    /// Create-delta view of `op_specific`: where the record goes.
    pub fn delta_addr(&self) -> u64 {
        u64::from_le_bytes(self.op_specific[..8].try_into().expect("8 bytes"))
    }

    /// Create-delta view of `op_specific`: the record's largest size.
    pub fn max_delta_size(&self) -> u32 {
        u32::from_le_bytes(self.op_specific[8..12].try_into().expect("4 bytes"))
    }

    /// Apply-delta view of `op_specific`: the record's size.
    pub fn delta_rec_size(&self) -> u32 {
        u32::from_le_bytes(self.op_specific[..4].try_into().expect("4 bytes"))
    }

    /// A NOOP descriptor reporting into `completion`.
    pub fn noop(completion: u64) -> Self {
        let mut d = Descriptor {
            opcode: OPCODE_NOOP,
            completion_addr: completion,
            ..Descriptor::default()
        };
        d.set_flags(FLAG_CRAV | FLAG_RCR);
        d
    }

    /// COMPVAL view of `dst_addr`.
    pub fn comp_pattern(&self) -> u64 {
        self.dst_addr
    }

    /// BATCH view of `src_addr`.
    pub fn desc_list_addr(&self) -> u64 {
        self.src_addr
    }

    /// BATCH view of `xfer_size`.
    pub fn desc_count(&self) -> u32 {
        self.xfer_size
    }

    /// The 64 bytes as submitted to the portal or written to the queue fd.
    pub fn as_bytes(&self) -> &[u8; 64] {
        // SAFETY: Descriptor is repr(C), exactly 64 bytes (asserted below)
        // with no padding (every field is at its natural alignment and they
        // tile the 64 bytes), so every byte is initialised.
        unsafe { &*(self as *const Self).cast::<[u8; 64]>() }
    }
}

/// One 32-byte DSA completion record (`struct dsa_completion_record`).
///
/// The device writes it; software polls `status` (through an atomic load, see
/// [`CompletionRecord::load_status`]) and reads the rest once it is non-zero.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletionRecord {
    /// Status code (`STATUS_*`) in bits 0..7, write-fault flag in bit 7.
    pub status: u8,
    /// Operation result; for COMPVAL 0 = matches the pattern, 1 = differs.
    pub result: u8,
    /// Reserved.
    pub rsvd: u16,
    /// Bytes processed before a fault or mismatch; for BATCH, descriptors
    /// completed.
    pub bytes_completed: u32,
    /// Faulting address for page-fault statuses.
    pub fault_addr: u64,
    /// Operation-specific; `invalid_flags` in the low 24 bits of the first
    /// dword for INVALID_FLAGS.
    pub op_specific: [u8; 16],
}

impl CompletionRecord {
    /// Loads the status byte with Acquire ordering, so the other fields
    /// written before it (by the device or the software device's Release
    /// store) are visible once it reads non-zero.
    ///
    /// # Safety
    ///
    /// `rec` must point to a live completion record; the device may be
    /// writing it concurrently (that is the point).
    pub unsafe fn load_status(rec: *const CompletionRecord) -> u8 {
        // SAFETY: the status byte is the first byte of a live record
        // (caller), u8 and AtomicU8 have the same layout, and every writer of
        // that byte is either the device (a single-copy-atomic byte store) or
        // an atomic store.
        let a = unsafe { &*rec.cast::<std::sync::atomic::AtomicU8>() };
        a.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Decoded status.
    pub fn decoded(&self) -> DsaStatus {
        DsaStatus::decode(self.status)
    }

    /// Create-delta view of `op_specific`: bytes of the record written.
    pub fn delta_rec_size(&self) -> u32 {
        u32::from_le_bytes(self.op_specific[..4].try_into().expect("4 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of, size_of};

    use super::{
        CompletionRecord, Descriptor, DsaStatus, FLAG_BOF, FLAG_CRAV, FLAG_RCR, FLAGS_MASK,
        OPCODE_AP_DELTA, OPCODE_BATCH, OPCODE_COMPVAL, OPCODE_CR_DELTA, OPCODE_NOOP,
        STATUS_BAD_OPCODE, STATUS_DESC_CNT_ERANGE, STATUS_HW_ERR_DRB, STATUS_HW_ERR1,
        STATUS_SUCCESS, STATUS_TRAFFIC_CLASS_CONF, STATUS_TRANSLATION_FAIL,
    };

    #[test]
    fn descriptor_layout_matches_idxd_h() {
        assert_eq!(size_of::<Descriptor>(), 64);
        assert_eq!(align_of::<Descriptor>(), 64);
        assert_eq!(offset_of!(Descriptor, pasid_priv), 0);
        assert_eq!(offset_of!(Descriptor, flags), 4);
        assert_eq!(offset_of!(Descriptor, opcode), 7);
        assert_eq!(offset_of!(Descriptor, completion_addr), 8);
        assert_eq!(offset_of!(Descriptor, src_addr), 16);
        assert_eq!(offset_of!(Descriptor, dst_addr), 24);
        assert_eq!(offset_of!(Descriptor, xfer_size), 32);
        assert_eq!(offset_of!(Descriptor, int_handle), 36);
        assert_eq!(offset_of!(Descriptor, rsvd1), 38);
        assert_eq!(offset_of!(Descriptor, op_specific), 40);
    }

    #[test]
    fn completion_record_layout_matches_idxd_h() {
        assert_eq!(size_of::<CompletionRecord>(), 32);
        assert_eq!(align_of::<CompletionRecord>(), 32);
        assert_eq!(offset_of!(CompletionRecord, status), 0);
        assert_eq!(offset_of!(CompletionRecord, result), 1);
        assert_eq!(offset_of!(CompletionRecord, rsvd), 2);
        assert_eq!(offset_of!(CompletionRecord, bytes_completed), 4);
        assert_eq!(offset_of!(CompletionRecord, fault_addr), 8);
        assert_eq!(offset_of!(CompletionRecord, op_specific), 16);
    }

    /// Reads a little-endian integer of `N` bytes at `off` of the encoding.
    fn le(bytes: &[u8; 64], off: usize, n: usize) -> u64 {
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&bytes[off..off + n]);
        u64::from_le_bytes(v)
    }

    #[test]
    fn compval_encoding() {
        let d = Descriptor::compval(0x1234_5000, 4096, 0, 0xabc0);
        let b = d.as_bytes();
        // Dword 1: flags in bits 0..24, opcode in bits 24..32.
        let dw1 = u32::try_from(le(b, 4, 4)).unwrap();
        assert_eq!(dw1 >> 24, u32::from(OPCODE_COMPVAL));
        assert_eq!(dw1 & FLAGS_MASK, FLAG_CRAV | FLAG_RCR);
        assert_eq!(dw1 & FLAG_BOF, 0, "faults must not block");
        assert_eq!(le(b, 0, 4), 0, "PASID left to ENQCMD / the queue");
        assert_eq!(le(b, 8, 8), 0xabc0);
        assert_eq!(le(b, 16, 8), 0x1234_5000);
        assert_eq!(le(b, 24, 8), 0, "comp_pattern");
        assert_eq!(le(b, 32, 4), 4096);
        assert!(b[36..].iter().all(|&x| x == 0));
        assert_eq!(d.comp_pattern(), 0);
        assert_eq!(d.flags(), FLAG_CRAV | FLAG_RCR);

        let p = Descriptor::compval(1, 8, 0x0102_0304_0506_0708, 64);
        assert_eq!(le(p.as_bytes(), 24, 8), 0x0102_0304_0506_0708);
    }

    #[test]
    fn batch_encoding() {
        let d = Descriptor::batch(0x7000_0040, 128, 0x8000);
        let b = d.as_bytes();
        assert_eq!(b[7], OPCODE_BATCH);
        assert_eq!(le(b, 4, 3), u64::from(FLAG_CRAV | FLAG_RCR));
        assert_eq!(le(b, 8, 8), 0x8000);
        assert_eq!(le(b, 16, 8), 0x7000_0040, "desc_list_addr");
        assert_eq!(le(b, 32, 4), 128, "desc_count");
        assert_eq!(d.desc_list_addr(), 0x7000_0040);
        assert_eq!(d.desc_count(), 128);
        let n = Descriptor::noop(0x40);
        assert_eq!(n.opcode, OPCODE_NOOP);
        assert_eq!(n.completion_addr, 0x40);
    }

    #[test]
    fn delta_encodings_match_idxd_h() {
        // The create-delta union of `struct dsa_hw_desc`: delta_addr at 40,
        // max_delta_size at 48; src2_addr is dst_addr.
        let d = Descriptor::create_delta(0x1000, 0x2000, 4096, 0x3000, 4090, 0x4000);
        let b = d.as_bytes();
        assert_eq!(b[7], OPCODE_CR_DELTA);
        assert_eq!(le(b, 16, 8), 0x1000, "src_addr");
        assert_eq!(le(b, 24, 8), 0x2000, "src2_addr");
        assert_eq!(le(b, 32, 4), 4096, "xfer_size");
        assert_eq!(le(b, 40, 8), 0x3000, "delta_addr");
        assert_eq!(le(b, 48, 4), 4090, "max_delta_size");
        assert_eq!((d.delta_addr(), d.max_delta_size()), (0x3000, 4090));
        // Apply: delta_rec_size at 40.
        let a = Descriptor::apply_delta(0x3000, 90, 0x1000, 4096, 0x4000);
        let b = a.as_bytes();
        assert_eq!(b[7], OPCODE_AP_DELTA);
        assert_eq!(le(b, 16, 8), 0x3000);
        assert_eq!(le(b, 24, 8), 0x1000);
        assert_eq!(le(b, 40, 4), 90, "delta_rec_size");
        assert_eq!(a.delta_rec_size(), 90);
    }

    #[test]
    fn set_flags_keeps_opcode() {
        let mut d = Descriptor::compval(0, 0, 0, 0);
        d.set_flags(0xffff_ffff);
        assert_eq!(d.opcode, OPCODE_COMPVAL);
        assert_eq!(d.flags(), FLAGS_MASK);
    }

    #[test]
    fn status_decoding() {
        assert_eq!(DsaStatus::decode(0), DsaStatus::Pending);
        assert!(!DsaStatus::decode(0).is_complete());
        assert_eq!(DsaStatus::decode(1), DsaStatus::Success);
        assert_eq!(DsaStatus::decode(2), DsaStatus::SuccessPred);
        assert_eq!(DsaStatus::decode(3), DsaStatus::PageFault { write: false });
        assert_eq!(
            DsaStatus::decode(0x83),
            DsaStatus::PageFault { write: true }
        );
        assert_eq!(DsaStatus::decode(5), DsaStatus::BatchFail);
        assert_eq!(DsaStatus::decode(6), DsaStatus::BatchPageFault);
        assert_eq!(DsaStatus::decode(0x10), DsaStatus::Error(STATUS_BAD_OPCODE));
        assert_eq!(
            DsaStatus::decode(0x14),
            DsaStatus::Error(STATUS_DESC_CNT_ERANGE)
        );
        // Values of enum dsa_completion_status in <linux/idxd.h>, counted
        // from DSA_COMP_BAD_OPCODE = 0x10.
        assert_eq!(STATUS_TRAFFIC_CLASS_CONF, 0x1e);
        assert_eq!(STATUS_HW_ERR1, 0x20);
        assert_eq!(STATUS_HW_ERR_DRB, 0x21);
        assert_eq!(STATUS_TRANSLATION_FAIL, 0x22);
        assert_eq!(DsaStatus::decode(0x20), DsaStatus::Error(STATUS_HW_ERR1));
        assert_eq!(
            DsaStatus::decode(0x22),
            DsaStatus::Error(STATUS_TRANSLATION_FAIL)
        );
        assert!(DsaStatus::decode(0x20).is_complete());
        let r = CompletionRecord {
            status: STATUS_SUCCESS,
            ..Default::default()
        };
        assert_eq!(r.decoded(), DsaStatus::Success);
        // SAFETY: `r` is a live record.
        assert_eq!(unsafe { CompletionRecord::load_status(&r) }, 1);
    }
}
