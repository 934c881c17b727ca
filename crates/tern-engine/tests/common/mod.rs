//! Helpers shared by the integration tests.

#![allow(dead_code)]

pub(crate) mod snapshot;

use std::thread::JoinHandle;
use std::time::Duration;

use tern_engine::{
    Address, Destination, GuestError, Listener, MigrationConfig, MigrationError, ReceiveConfig,
    Received,
};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

pub(crate) const MIB: u64 = 1 << 20;

/// A synthetic guest of `memory` bytes with the default mix.
pub(crate) fn guest(memory: u64, dirty_rate: u64) -> SyntheticGuest {
    SyntheticGuest::new(&SyntheticConfig {
        memory_bytes: memory,
        regions: 1,
        mix: ContentMix::default(),
        seed: 11,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: memory / 4,
        dirtier_threads: 1,
    })
    .expect("synthetic guest")
}

pub(crate) fn guest_with(config: SyntheticConfig) -> SyntheticGuest {
    SyntheticGuest::new(&config).expect("synthetic guest")
}

pub(crate) fn make_destination_guest(
    setup: &tern_wire::SessionSetup,
) -> Result<SyntheticGuest, GuestError> {
    let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
    SyntheticGuest::empty(&lens).map_err(|error| GuestError::with_source("destination", error))
}

/// A listener on a free TCP port of 127.0.0.1.
pub(crate) fn tcp_listener() -> (Listener, Address) {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).expect("bind");
    let address = listener.local_address().expect("address");
    (listener, address)
}

/// Short timeouts so failing tests fail fast.
pub(crate) fn receive_config() -> ReceiveConfig {
    {
        let mut config = ReceiveConfig::default();
        config.accept_timeout = Duration::from_secs(20);
        config.io_timeout = Duration::from_secs(10);
        config
    }
}

pub(crate) fn migration_config(channels: u16) -> MigrationConfig {
    {
        let mut config = MigrationConfig::default();
        config.channels = channels;
        config.io_timeout = Duration::from_secs(10);
        config.connect_timeout = Duration::from_secs(5);
        // A migration that does not converge fails the test instead of
        // hanging it.
        config.max_time = Some(Duration::from_secs(60));
        config
    }
}

pub(crate) type DestinationResult = Result<Received<SyntheticGuest>, MigrationError>;

/// Runs a destination on its own thread.
pub(crate) fn spawn_destination(listener: Listener) -> JoinHandle<DestinationResult> {
    std::thread::spawn(move || {
        Destination::new(receive_config()).receive(&listener, make_destination_guest)
    })
}

// The bounded waits (docs/testing.md, "Fail, don't hang"): one copy, in
// tern-test-skip, shared by every crate's tests.
// A call into the product on the test's own thread that waits on a fake or
// failing peer (a source whose destination goes silent, dies or refuses)
// runs under `exit_after_deadline`: only the product's own deadline ends
// it, and a lost one ends the test process, named, instead of hanging it.
pub(crate) use tern_test_skip::wait::{DEADLINE, exit_after_deadline, join_within, wait_until};

/// PEM files of a throwaway CA and hosts it signed, made for one test.
pub(crate) struct TestPki {
    pub(crate) ca: String,
    ca_issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

/// One host's certificate chain and key, in PEM.
pub(crate) struct TestIdentity {
    pub(crate) chain: String,
    pub(crate) key: String,
}

impl TestPki {
    pub(crate) fn new(name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let ca_issuer = rcgen::CertifiedIssuer::self_signed(params, key).unwrap();
        Self {
            ca: ca_issuer.pem(),
            ca_issuer,
        }
    }

    /// A host certificate valid for `names` (DNS names or IP addresses).
    pub(crate) fn identity(&self, names: &[&str]) -> TestIdentity {
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        let params = rcgen::CertificateParams::new(names).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = params.signed_by(&key, &self.ca_issuer).unwrap();
        TestIdentity {
            chain: certificate.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A host certificate for `names` whose validity ended in 2021.
    pub(crate) fn expired_identity(&self, names: &[&str]) -> TestIdentity {
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = params.signed_by(&key, &self.ca_issuer).unwrap();
        TestIdentity {
            chain: certificate.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A TLS configuration trusting this CA and presenting `identity`.
    pub(crate) fn config(&self, identity: &TestIdentity) -> tern_engine::TlsConfig {
        tern_engine::TlsConfig::from_pem(
            self.ca.as_bytes(),
            identity.chain.as_bytes(),
            identity.key.as_bytes(),
        )
        .expect("TLS configuration")
    }
}

/// The header and table of one packet of raw pages of region 0 in
/// `iteration`; the caller appends the pages' 4 KiB each, in order.
pub(crate) fn raw_pages_prefix(iteration: u32, pages: &[u32]) -> Vec<u8> {
    let entries: Vec<tern_wire::PageEntry> = pages
        .iter()
        .map(|&page_index| tern_wire::PageEntry {
            page_index,
            kind: tern_wire::PageKind::Raw,
            encoded_len: tern_wire::PAGE_SIZE,
        })
        .collect();
    let mut bytes = Vec::new();
    tern_wire::encode_pages_prefix(&mut bytes, 0, iteration, 0, &entries);
    bytes
}

/// A synthetic destination guest that restores its state but never runs:
/// `resume` only records the call. Its memory stays as the migration left
/// it, so a test can compare it with the paused source's even when the
/// source's guest dirties memory (a running copy would go on writing).
#[derive(Debug)]
pub(crate) struct HeldGuest {
    pub(crate) guest: SyntheticGuest,
    pub(crate) resumed: bool,
}

impl tern_engine::GuestMemory for HeldGuest {
    fn regions(&self) -> &[tern_engine::MemoryRegion] {
        self.guest.regions()
    }
}

impl tern_engine::GuestControl for HeldGuest {
    fn pause(&mut self) -> Result<(), GuestError> {
        self.resumed = false;
        Ok(())
    }

    fn resume(&mut self) -> Result<(), GuestError> {
        self.resumed = true;
        Ok(())
    }

    fn set_throttle(&mut self, percent: u8) -> Result<(), GuestError> {
        self.guest.set_throttle(percent)
    }
}

impl tern_engine::DeviceState for HeldGuest {
    fn save_state(&mut self) -> Result<Vec<tern_engine::StateSection>, GuestError> {
        self.guest.save_state()
    }

    fn restore_state(&mut self, sections: &[tern_engine::StateSection]) -> Result<(), GuestError> {
        self.guest.restore_state(sections)
    }

    fn guest_kind(&self) -> &str {
        self.guest.guest_kind()
    }
}

/// Runs a destination of [`HeldGuest`]s on its own thread.
pub(crate) fn spawn_held_destination(
    listener: Listener,
) -> JoinHandle<Result<Received<HeldGuest>, MigrationError>> {
    std::thread::spawn(move || {
        Destination::new(receive_config()).receive(&listener, |setup| {
            Ok(HeldGuest {
                guest: make_destination_guest(setup)?,
                resumed: false,
            })
        })
    })
}

/// Reads one whole frame, as bytes, from `from`: header, body and, when
/// the header says it is sealed, its seal. `None` once the stream ends,
/// or at a header tern would refuse (the body is allocated only up to
/// what its kind allows, not to what the header declares).
pub(crate) fn read_raw_frame(from: &mut impl std::io::Read) -> Option<Vec<u8>> {
    let mut frame = vec![0u8; tern_wire::FRAME_HEADER_LEN];
    from.read_exact(&mut frame).ok()?;
    let header: [u8; tern_wire::FRAME_HEADER_LEN] = frame[..].try_into().unwrap();
    let body = tern_wire::FrameHeader::decode(&header).ok()?.body_len as usize;
    let seal = if tern_wire::header_is_sealed(&header) {
        tern_wire::SEAL_LEN
    } else {
        0
    };
    frame.resize(tern_wire::FRAME_HEADER_LEN + body + seal, 0);
    from.read_exact(&mut frame[tern_wire::FRAME_HEADER_LEN..])
        .ok()?;
    Some(frame)
}

/// A link of `bytes_per_sec` in front of `destination`, for every
/// connection together, source to destination (the other way is not
/// paced): the proxy forwards what it reads no faster than that. Returns
/// the address the source connects to. The pacing sleeps: that is the
/// link's speed, not a wait for a condition.
pub(crate) fn paced_proxy(destination: &Address, bytes_per_sec: u64) -> Address {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = Address::Tcp(listener.local_addr().unwrap().to_string());
    let Address::Tcp(upstream) = destination.clone() else {
        panic!("a TCP destination")
    };
    // When the link is next free.
    let free_at = Arc::new(Mutex::new(Instant::now()));
    std::thread::spawn(move || {
        for downstream in listener.incoming() {
            let Ok(mut downstream) = downstream else {
                return;
            };
            let Ok(mut upstream) = TcpStream::connect(&upstream) else {
                return;
            };
            let (mut down, mut up) = (
                downstream.try_clone().unwrap(),
                upstream.try_clone().unwrap(),
            );
            let free_at = free_at.clone();
            std::thread::spawn(move || {
                let mut buffer = vec![0u8; 64 << 10];
                while let Ok(read) = down.read(&mut buffer) {
                    if read == 0 {
                        break;
                    }
                    let send_at = {
                        let mut free = free_at.lock().unwrap();
                        let at = (*free).max(Instant::now());
                        *free = at + Duration::from_secs_f64(read as f64 / bytes_per_sec as f64);
                        at
                    };
                    std::thread::sleep(send_at.saturating_duration_since(Instant::now()));
                    if upstream.write_all(&buffer[..read]).is_err() {
                        break;
                    }
                }
                let _ = upstream.shutdown(Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up, &mut downstream);
                let _ = downstream.shutdown(Shutdown::Both);
            });
        }
    });
    address
}
