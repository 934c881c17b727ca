//! The test guest: a few dozen bytes of 32-bit x86 code of our own.
//!
//! The guest is entered in 32-bit protected mode with paging off and flat
//! 4 GiB segments (set up through `kvm_sregs`, with a matching GDT in guest
//! memory so the descriptors are real). It never takes an interrupt
//! (`EFLAGS.IF` is clear) and needs no stack. Its program:
//!
//! ```text
//! start:  esi = WORKING_SET_BASE; ecx = working-set pages
//!         for each page: byte [page] = 0          ; a known start, even
//!                                                  ; over image contents
//! pass:   for each page: byte [page] += 1          ; dirties every page
//!         dword [PASS_COUNTER] += 1
//!         out 0x3f8, low byte of the counter       ; one exit per pass
//!         jmp pass
//! ```
//!
//! So at any instant the first bytes of the working set read
//! `v+1, …, v+1, v, …, v` (the guest is in the middle of a pass) and the last
//! page's byte equals the pass counter's low byte (or is one ahead of it
//! between the last increment and the counter update): the property
//! [`crate::KvmGuest::consistency_check`] verifies after a migration. The
//! serial port receives exactly one byte per pass, after the counter's
//! increment: a pause lands between any two instructions, so a paused vCPU
//! may have counted a pass whose byte it has not sent yet (its instruction
//! pointer is then on one of the three instructions after the increment,
//! see [`pass_report`]). Bytes received plus that one unreported pass
//! ([`crate::KvmGuest::unreported_passes`]) equal the pass counter whenever
//! the vCPU is paused; never more bytes than passes.

/// Guest-physical address of the GDT.
pub const GDT_ADDR: u64 = 0x500;
/// Guest-physical address where the code is loaded and entered.
pub const CODE_ADDR: u64 = 0x1000;
/// Guest-physical address of the 32-bit pass counter.
pub const PASS_COUNTER_ADDR: u64 = 0x2000;
/// Guest-physical address of the first working-set page (1 MiB).
pub const WORKING_SET_BASE: u64 = 0x10_0000;
/// The serial port the guest reports on (COM1's data register).
pub const SERIAL_PORT: u16 = 0x3f8;
/// Initial stack pointer (unused by the code, set for tidiness).
pub const STACK_TOP: u64 = 0x8000;

/// Code segment selector (GDT entry 1).
pub const CODE_SELECTOR: u16 = 0x08;
/// Data segment selector (GDT entry 2).
pub const DATA_SELECTOR: u16 = 0x10;

/// The GDT: null, flat 32-bit code (exec/read), flat 32-bit data (read/write).
pub fn gdt() -> [u64; 3] {
    [
        0,
        // base 0, limit 0xfffff pages, G=1 D=1 P=1 DPL=0 S=1 type=0xb
        0x00cf_9b00_0000_ffff,
        // base 0, limit 0xfffff pages, G=1 B=1 P=1 DPL=0 S=1 type=0x3
        0x00cf_9300_0000_ffff,
    ]
}

/// A tiny assembler for the handful of instructions the guest uses, with
/// backward labels for the loops.
#[derive(Debug, Default)]
struct Asm {
    code: Vec<u8>,
}

impl Asm {
    fn label(&self) -> usize {
        self.code.len()
    }

    fn emit(&mut self, bytes: &[u8]) {
        self.code.extend_from_slice(bytes);
    }

    /// `mov r32, imm32` (B8+r id).
    fn mov_imm32(&mut self, reg: u8, value: u32) {
        self.emit(&[0xb8 + reg]);
        self.emit(&value.to_le_bytes());
    }

    /// `mov dst, src` between 32-bit registers (89 /r, mod=11).
    fn mov_reg(&mut self, dst: u8, src: u8) {
        self.emit(&[0x89, 0xc0 | (src << 3) | dst]);
    }

    /// `mov byte [eax], imm8` (C6 /0, mod=00 rm=eax).
    fn mov_byte_at_eax(&mut self, value: u8) {
        self.emit(&[0xc6, 0x00, value]);
    }

    /// `inc byte [eax]` (FE /0, mod=00 rm=eax).
    fn inc_byte_at_eax(&mut self) {
        self.emit(&[0xfe, 0x00]);
    }

    /// `add eax, imm32` (05 id).
    fn add_eax(&mut self, value: u32) {
        self.emit(&[0x05]);
        self.emit(&value.to_le_bytes());
    }

    /// `dec r32` (48+r, the one-byte form of 32-bit mode).
    fn dec(&mut self, reg: u8) {
        self.emit(&[0x48 + reg]);
    }

    /// `inc dword [disp32]` (FF /0, mod=00 rm=101).
    fn inc_dword_at(&mut self, address: u32) {
        self.emit(&[0xff, 0x05]);
        self.emit(&address.to_le_bytes());
    }

    /// `mov al, [moffs32]` (A0).
    fn mov_al_from(&mut self, address: u32) {
        self.emit(&[0xa0]);
        self.emit(&address.to_le_bytes());
    }

    /// `mov dx, imm16` (66 BA iw).
    fn mov_dx(&mut self, value: u16) {
        self.emit(&[0x66, 0xba]);
        self.emit(&value.to_le_bytes());
    }

    /// `out dx, al` (EE).
    fn out_dx_al(&mut self) {
        self.emit(&[0xee]);
    }

    /// A short jump (`opcode rel8`) back to `target`.
    fn jump_back(&mut self, opcode: u8, target: usize) {
        let after = self.code.len() + 2;
        let rel = i16::try_from(after - target)
            .ok()
            .and_then(|back| i8::try_from(-back).ok())
            .expect("loop fits a rel8 jump");
        self.emit(&[opcode, rel.to_le_bytes()[0]]);
    }

    /// `jnz target` (75 cb).
    fn jnz(&mut self, target: usize) {
        self.jump_back(0x75, target);
    }

    /// `jmp target` (EB cb).
    fn jmp(&mut self, target: usize) {
        self.jump_back(0xeb, target);
    }

    /// `add r32, imm32` (81 /0 id, mod=11).
    fn add_imm32(&mut self, reg: u8, value: u32) {
        self.emit(&[0x81, 0xc0 | reg]);
        self.emit(&value.to_le_bytes());
    }

    /// `imul r32, r32, imm32` with the same register (69 /r id, mod=11).
    fn imul_self_imm32(&mut self, reg: u8, value: u32) {
        self.emit(&[0x69, 0xc0 | (reg << 3) | reg]);
        self.emit(&value.to_le_bytes());
    }

    /// `mov [dst], src` (89 /r, mod=00; `dst` not esp or ebp).
    fn mov_to_mem(&mut self, dst: u8, src: u8) {
        self.emit(&[0x89, (src << 3) | dst]);
    }

    /// `and r32, imm32` (81 /4 id, mod=11).
    fn and_imm32(&mut self, reg: u8, value: u32) {
        self.emit(&[0x81, 0xe0 | reg]);
        self.emit(&value.to_le_bytes());
    }

    /// `push r32` (50+r).
    fn push(&mut self, reg: u8) {
        self.emit(&[0x50 + reg]);
    }

    /// `pop r32` (58+r).
    fn pop(&mut self, reg: u8) {
        self.emit(&[0x58 + reg]);
    }

    /// `rep movsd` (F3 A5): ecx dwords from [esi] to [edi].
    fn rep_movsd(&mut self) {
        self.emit(&[0xf3, 0xa5]);
    }
}

/// What the guest does to each working-set page on every pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Workload {
    /// Adds one to the page's first byte: a one-byte change, the best case
    /// for delta encoding.
    #[default]
    Increment,
    /// Adds one to the first byte, writes a new pseudo-random word (a
    /// linear congruential generator) at bytes 4..8 and copies 4088 bytes
    /// from a random offset of a 256 KiB buffer of pseudo-random words (filled
    /// once, after the working set) over the rest: a whole new,
    /// incompressible page every pass, unlike any other, where deltas cannot
    /// help. Needs [`REWRITE_BUFFER_BYTES`] of RAM after the working set.
    Rewrite,
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "increment" => Ok(Self::Increment),
            "rewrite" => Ok(Self::Rewrite),
            other => Err(format!("'{other}' is neither increment nor rewrite")),
        }
    }
}

/// RAM the rewrite workload uses after its working set: the random buffer
/// and the longest copy from its end.
pub const REWRITE_BUFFER_BYTES: u64 = (256 << 10) + 4096;

const EAX: u8 = 0;
const ECX: u8 = 1;
const EDX: u8 = 2;
const EBX: u8 = 3;
const EBP: u8 = 5;
const ESI: u8 = 6;
const EDI: u8 = 7;
const PAGE: u32 = 4096;

/// The guest's machine code for a working set of `pages` pages at
/// [`WORKING_SET_BASE`]. Load it at [`CODE_ADDR`].
pub fn code(pages: u32) -> Vec<u8> {
    code_for(pages, Workload::Increment)
}

/// The guest's machine code running `workload` over `pages` pages.
pub fn code_for(pages: u32, workload: Workload) -> Vec<u8> {
    let base = u32::try_from(WORKING_SET_BASE).expect("below 4 GiB");
    let buffer = base + pages * PAGE;
    let mut asm = Asm::default();
    if workload == Workload::Rewrite {
        fill_random_buffer(&mut asm, buffer);
    }
    asm.mov_imm32(ESI, base); // esi = first page
    asm.mov_imm32(ECX, pages); // ecx = pages
    asm.mov_reg(EAX, ESI); // eax = page pointer
    asm.mov_reg(EDX, ECX); // edx = pages left
    let init = asm.label();
    asm.mov_byte_at_eax(0); // byte [page] = 0
    asm.add_eax(PAGE); // next page
    asm.dec(EDX);
    asm.jnz(init);
    let pass = asm.label();
    asm.mov_reg(EAX, ESI);
    asm.mov_reg(EDX, ECX);
    let page = asm.label();
    asm.inc_byte_at_eax(); // byte [page] += 1
    if workload == Workload::Rewrite {
        rewrite_page_tail(&mut asm, buffer);
    }
    asm.add_eax(PAGE);
    asm.dec(EDX);
    asm.jnz(page);
    asm.emit(&pass_report().bytes);
    asm.jmp(pass);
    asm.code
}

/// The instructions that close a pass, and where in them a pass is counted
/// but not yet reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassReport {
    /// `inc dword [counter]; mov al, [counter]; mov dx, 0x3f8; out dx, al`.
    pub bytes: Vec<u8>,
    /// Offsets into `bytes` of the instructions after the increment, up to
    /// and including the `out`: a vCPU paused with its instruction pointer
    /// at one of them has counted the pass and not yet sent its byte.
    pub unreported_at: Vec<usize>,
}

/// The end of every pass: count it, then report the counter's low byte on
/// the serial port (the only exit). The same for every workload.
pub fn pass_report() -> PassReport {
    let counter = u32::try_from(PASS_COUNTER_ADDR).expect("below 4 GiB");
    let mut asm = Asm::default();
    asm.inc_dword_at(counter); // passes += 1
    let mut unreported_at = vec![asm.label()];
    asm.mov_al_from(counter); // al = passes (low byte)
    unreported_at.push(asm.label());
    asm.mov_dx(SERIAL_PORT);
    unreported_at.push(asm.label());
    asm.out_dx_al(); // report the pass
    PassReport {
        bytes: asm.code,
        unreported_at,
    }
}

/// Fills [`REWRITE_BUFFER_BYTES`] at `buffer` with the generator in `ebx`
/// (Numerical Recipes' LCG constants).
fn fill_random_buffer(asm: &mut Asm, buffer: u32) {
    asm.mov_imm32(EDI, buffer);
    asm.mov_imm32(
        EBP,
        u32::try_from(REWRITE_BUFFER_BYTES / 4).expect("a small buffer"),
    );
    let word = asm.label();
    next_random(asm);
    asm.mov_to_mem(EDI, EBX);
    asm.add_imm32(EDI, 4);
    asm.dec(EBP);
    asm.jnz(word);
}

fn next_random(asm: &mut Asm) {
    asm.imul_self_imm32(EBX, 1_664_525);
    asm.add_imm32(EBX, 1_013_904_223);
}

/// Bytes 4.. of the page at `eax`: a new random word, then 1022 words from
/// a random offset of the buffer (one `rep movsd`); `eax`, `ecx`, `edx` and
/// `esi` are kept.
fn rewrite_page_tail(asm: &mut Asm, buffer: u32) {
    asm.push(ESI);
    asm.push(ECX);
    next_random(asm);
    asm.mov_reg(EDI, EAX);
    asm.add_imm32(EDI, 4);
    asm.mov_to_mem(EDI, EBX);
    asm.add_imm32(EDI, 4);
    asm.mov_reg(ESI, EBX);
    asm.and_imm32(ESI, 0x0003_fffc);
    asm.add_imm32(ESI, buffer);
    asm.mov_imm32(ECX, PAGE / 4 - 2);
    asm.rep_movsd();
    asm.pop(ECX);
    asm.pop(ESI);
}

/// The multiboot (version 1) header's magic number.
pub const MULTIBOOT_MAGIC: u32 = 0x1bad_b002;
/// Multiboot flag 16: the header carries the load addresses (the "a.out
/// kludge"), so the image is a flat binary, not an ELF file.
pub const MULTIBOOT_AOUT_KLUDGE: u32 = 1 << 16;
/// Where the multiboot header sits in the image (after the code, 4-byte
/// aligned, within the first 8 KiB as the specification requires).
const MULTIBOOT_HEADER_OFFSET: usize = 0x100;

/// The test guest as a flat multiboot image, for running the very same code
/// under another VMM (QEMU's `-kernel`).
///
/// A multiboot loader enters 32-bit protected mode with flat segments and
/// paging off, as this crate's VMM does, so the code runs unchanged. The
/// image loads at [`CODE_ADDR`] and is entered there; it spans
/// `CODE_ADDR..PASS_COUNTER_ADDR + 0x1000`, so the page holding the pass
/// counter is loaded as zeros (as the VMM zeroes it) and a loader placing its
/// information structures right after the image cannot touch the counter.
/// The working-set size is baked into the code, as for [`code`]. The GDT at
/// [`GDT_ADDR`] is not part of the image: the code never reloads a segment
/// register, so the loader's own flat descriptors serve.
pub fn multiboot_image(pages: u32) -> Vec<u8> {
    multiboot_image_for(pages, Workload::Increment)
}

/// [`multiboot_image`] running `workload`.
pub fn multiboot_image_for(pages: u32, workload: Workload) -> Vec<u8> {
    let code = code_for(pages, workload);
    assert!(
        code.len() <= MULTIBOOT_HEADER_OFFSET,
        "code overlaps the header"
    );
    let load = u32::try_from(CODE_ADDR).expect("below 4 GiB");
    let end = u32::try_from(PASS_COUNTER_ADDR).expect("below 4 GiB") + PAGE;
    let mut image = vec![0u8; (end - load) as usize];
    image[..code.len()].copy_from_slice(&code);
    let header_addr = load + u32::try_from(MULTIBOOT_HEADER_OFFSET).expect("a small offset");
    let flags = MULTIBOOT_AOUT_KLUDGE;
    let checksum = 0u32.wrapping_sub(MULTIBOOT_MAGIC).wrapping_sub(flags);
    let header = [
        MULTIBOOT_MAGIC,
        flags,
        checksum,
        header_addr, // header_addr
        load,        // load_addr
        end,         // load_end_addr
        end,         // bss_end_addr: no bss beyond the image
        load,        // entry_addr: the code's first byte
    ];
    for (index, word) in header.iter().enumerate() {
        let at = MULTIBOOT_HEADER_OFFSET + index * 4;
        image[at..at + 4].copy_from_slice(&word.to_le_bytes());
    }
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rewrite_workload_fills_its_buffer_then_copies_into_each_page() {
        let code = code_for(0x100, Workload::Rewrite);
        assert!(
            code.len() <= MULTIBOOT_HEADER_OFFSET,
            "{} bytes",
            code.len()
        );
        // The buffer after the working set: 1 MiB + 256 pages * 4 KiB.
        let buffer = (0x10_0000u32 + 0x100 * 4096).to_le_bytes();
        assert_eq!(
            &code[..5],
            &[0xbf, buffer[0], buffer[1], buffer[2], buffer[3]]
        );
        assert_eq!(code.windows(2).filter(|w| w == &[0xf3, 0xa5]).count(), 1);
        let image = multiboot_image_for(0x100, Workload::Rewrite);
        assert_eq!(&image[..code.len()], &code[..]);
    }

    #[test]
    fn code_matches_hand_assembly() {
        let code = code(0x100);
        #[rustfmt::skip]
        let expected: &[u8] = &[
            0xbe, 0x00, 0x00, 0x10, 0x00,       // mov esi, 0x100000
            0xb9, 0x00, 0x01, 0x00, 0x00,       // mov ecx, 0x100
            0x89, 0xf0,                         // mov eax, esi
            0x89, 0xca,                         // mov edx, ecx
            0xc6, 0x00, 0x00,                   // init: mov byte [eax], 0
            0x05, 0x00, 0x10, 0x00, 0x00,       // add eax, 0x1000
            0x4a,                               // dec edx
            0x75, 0xf5,                         // jnz init
            0x89, 0xf0,                         // pass: mov eax, esi
            0x89, 0xca,                         // mov edx, ecx
            0xfe, 0x00,                         // page: inc byte [eax]
            0x05, 0x00, 0x10, 0x00, 0x00,       // add eax, 0x1000
            0x4a,                               // dec edx
            0x75, 0xf6,                         // jnz page
            0xff, 0x05, 0x00, 0x20, 0x00, 0x00, // inc dword [0x2000]
            0xa0, 0x00, 0x20, 0x00, 0x00,       // mov al, [0x2000]
            0x66, 0xba, 0xf8, 0x03,             // mov dx, 0x3f8
            0xee,                               // out dx, al
            0xeb, 0xe0,                         // jmp pass
        ];
        assert_eq!(code, expected);
    }

    #[test]
    fn multiboot_image_holds_the_code_and_a_valid_header() {
        let image = multiboot_image(0x100);
        assert_eq!(image.len(), 0x2000);
        assert_eq!(&image[..code(0x100).len()], code(0x100).as_slice());
        let word = |index: usize| {
            let at = MULTIBOOT_HEADER_OFFSET + index * 4;
            u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
        };
        assert_eq!(word(0), MULTIBOOT_MAGIC);
        assert_eq!(word(0).wrapping_add(word(1)).wrapping_add(word(2)), 0);
        assert_eq!(word(4), 0x1000);
        assert_eq!(word(5), 0x3000);
        assert_eq!(word(7), 0x1000);
        // The counter page is loaded, as zeros.
        assert!(image[0x1000..].iter().all(|&byte| byte == 0));
    }
}
