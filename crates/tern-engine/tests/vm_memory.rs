//! The vm-memory embedding example, run as a test (feature `vm-memory`): a
//! `GuestMemoryMmap<AtomicBitmap>` guest written by a device thread migrates
//! between two threads over a Unix socket, and the destination's memory and
//! device state must equal the source's.

#[path = "../examples/embed_vm_memory.rs"]
mod embed_vm_memory;

#[test]
fn the_embedding_example_migrates_a_vm_memory_guest() {
    if let Err(error) = embed_vm_memory::main() {
        panic!("the embedding example failed: {error}");
    }
}
