//! The vm-memory embedding examples, run as tests (feature `vm-memory`):
//! each migrates a guest written by a device thread between two threads
//! over a Unix socket, and the destination's memory and device state must
//! equal the source's.

#[path = "../examples/embed_vm_memory.rs"]
mod embed_vm_memory;

#[path = "../examples/embed_firecracker.rs"]
mod embed_firecracker;

#[test]
fn the_embedding_example_migrates_a_vm_memory_guest() {
    if let Err(error) = embed_vm_memory::main() {
        panic!("the embedding example failed: {error}");
    }
}

#[test]
fn a_firecracker_shaped_guest_migrates_its_plugged_slots() {
    if let Err(error) = embed_firecracker::main() {
        panic!("the Firecracker example failed: {error}");
    }
}

#[path = "../examples/embed_cloud_hypervisor.rs"]
mod embed_cloud_hypervisor;

#[test]
fn a_cloud_hypervisor_shaped_guest_migrates_and_refuses_a_hot_plug() {
    if let Err(error) = embed_cloud_hypervisor::main() {
        panic!("the Cloud Hypervisor example failed: {error}");
    }
}

#[path = "../examples/embed_cloud_hypervisor_local.rs"]
mod embed_cloud_hypervisor_local;

#[test]
fn a_cloud_hypervisor_shaped_shared_memory_guest_is_handed_over() {
    if let Err(error) = embed_cloud_hypervisor_local::main() {
        panic!("the Cloud Hypervisor hand-over example failed: {error}");
    }
}
