//! Authenticated and encrypted channels, and the destination's policy:
//! real migrations over real sockets, checked by digest, and the failures
//! (wrong key, wrong CA or host name, an expired certificate, a client
//! without one, another identity on a page channel, plaintext against TLS,
//! an unauthenticated or unverified session the destination does not
//! accept), each refused with a clear one-line error on both sides (the
//! destination's is the reason it logs and keeps in its statistics), with
//! nothing written to the destination's guest and the source guest running.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use tern_engine::{
    Address, AuthCrypto, AuthKey, Channel, Connector, Destination, GuestControl, Listener,
    MigrationConfig, MigrationError, MigrationStatus, ReceiveConfig, Security, Source,
    UnauthenticatedPolicy,
};
use tern_synthetic::SyntheticGuest;
use tern_wire::{ChannelHello, Handshake, Hello, Message};

fn key(text: &str) -> Option<Arc<AuthKey>> {
    Some(Arc::new(AuthKey::from_bytes(text.as_bytes()).unwrap()))
}

/// Security with only an auth key of `secret`.
fn keyed(secret: &str) -> Security {
    let mut config = Security::default();
    config.auth_key = key(secret);
    config
}

/// A destination thread, and whether it ever built a guest.
struct Receiving {
    thread: JoinHandle<DestinationResult>,
    cancel: tern_engine::CancelToken,
    stats: Arc<tern_engine::ReceiveStats>,
    guest_made: Arc<AtomicBool>,
}

impl Receiving {
    /// The destination's one-line reason for the first connection it
    /// refused, once it refused one.
    fn refusal(&self) -> String {
        wait_until("the destination refuses a connection", || {
            self.stats.refused_connections() > 0
        });
        self.stats.last_refusal().expect("a refusal's reason")
    }
}

/// Both sides' errors for a refused migration.
struct Refused {
    source: String,
    destination: String,
}

impl Refused {
    /// Each side's error is one line and names `what`.
    fn both_say(&self, what: &str) {
        for (side, text) in [("source", &self.source), ("destination", &self.destination)] {
            assert!(!text.contains('\n'), "{side}: one line: {text}");
            assert!(
                text.to_lowercase().contains(&what.to_lowercase()),
                "{side} must say '{what}': {text}"
            );
        }
    }
}

fn receive_with(listener: Listener, config: ReceiveConfig) -> Receiving {
    let destination = Destination::new(config);
    let cancel = destination.cancel_token();
    let stats = destination.stats();
    let guest_made = Arc::new(AtomicBool::new(false));
    let made = guest_made.clone();
    let thread = std::thread::spawn(move || {
        destination.receive(&listener, |setup| {
            made.store(true, Ordering::SeqCst);
            make_destination_guest(setup)
        })
    });
    Receiving {
        thread,
        cancel,
        stats,
        guest_made,
    }
}

fn secured_receive(security: Security) -> ReceiveConfig {
    {
        let mut config = receive_config();
        config.security = security;
        config
    }
}

fn secured_migration(channels: u16, security: Security) -> MigrationConfig {
    {
        let mut config = migration_config(channels);
        config.security = security;
        config
    }
}

/// Migrates and checks the destination's memory by digest.
fn migrate_and_verify(
    listener: Listener,
    address: &Address,
    receive: ReceiveConfig,
    migrate: MigrationConfig,
) -> tern_engine::MigrationStats {
    // Not dirtying: the destination guest runs once resumed, and a guest
    // that writes there would no longer equal the paused source by digest.
    let mut guest = guest(32 * MIB, 0);
    let receiving = receive_with(listener, receive);
    let stats = Source::new(migrate)
        .unwrap()
        .migrate(&mut guest, address)
        .expect("migration");
    let received = join_within(receiving.thread, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    let mut destination = received.guest;
    destination.pause().unwrap();
    assert_eq!(destination.digest(), guest.digest());
    stats
}

/// Runs a migration that must fail at the source; the destination, which
/// logs the refused connection and keeps waiting for a source it accepts,
/// is cancelled and must not have built a guest. Returns both sides' errors.
fn migrate_refused(
    listener: Listener,
    address: &Address,
    receive: ReceiveConfig,
    migrate: MigrationConfig,
) -> Refused {
    let mut guest = guest(8 * MIB, MIB);
    guest.resume().unwrap();
    let receiving = receive_with(listener, receive);
    let failure = exit_after_deadline("the source's refused migration", || {
        Source::new(migrate).unwrap().migrate(&mut guest, address)
    })
    .expect_err("the migration must fail");
    assert!(guest.is_running(), "the source guest runs on");
    let destination = receiving.refusal();
    receiving.cancel.cancel();
    let result = join_within(receiving.thread, "the destination");
    assert!(result.is_err(), "the destination must not complete");
    assert!(
        !receiving.guest_made.load(Ordering::SeqCst),
        "nothing may be written to a guest for a refused session"
    );
    Refused {
        source: failure.error.chain(),
        destination,
    }
}

#[test]
fn auth_key_migration_verifies() {
    let (listener, address) = tcp_listener();
    let security = keyed("a shared secret of the test");
    let stats = migrate_and_verify(
        listener,
        &address,
        secured_receive(security.clone()),
        secured_migration(2, security),
    );
    let security = stats.security.expect("the session's security");
    assert_eq!(security.transport, "tcp");
    assert!(security.authenticated);
    assert_eq!(security.tls, None);
}

/// An embedder's hash primitives: ring's here, counted, or deliberately
/// not HMAC.
#[derive(Default)]
struct EmbedderCrypto {
    calls: AtomicU64,
    not_hmac: bool,
}

impl AuthCrypto for EmbedderCrypto {
    fn hmac_sha256(&self, key: &[u8], message: &[u8]) -> [u8; 32] {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.not_hmac {
            return self.sha256(&[key, message].concat());
        }
        tern_engine::RingCrypto.hmac_sha256(key, message)
    }

    fn sha256(&self, data: &[u8]) -> [u8; 32] {
        tern_engine::RingCrypto.sha256(data)
    }
}

#[test]
fn an_embedders_auth_crypto_carries_the_session() {
    let (listener, address) = tcp_listener();
    let crypto = Arc::new(EmbedderCrypto::default());
    let secret = b"a shared secret of the test";
    let source = {
        let mut config = Security::default();
        config.auth_key = Some(Arc::new(
            AuthKey::from_bytes_with(secret, crypto.clone()).unwrap(),
        ));
        config
    };
    let destination = keyed("a shared secret of the test");
    let stats = migrate_and_verify(
        listener,
        &address,
        secured_receive(destination),
        secured_migration(2, source),
    );
    assert!(stats.security.expect("security").authenticated);
    // Three channels' proofs, the session keys and the sealed control
    // frames of the main channel all went through the embedder's HMAC.
    assert!(crypto.calls.load(Ordering::Relaxed) >= 8);
}

#[test]
fn an_auth_crypto_that_is_not_hmac_is_refused() {
    let (listener, address) = tcp_listener();
    let crypto = Arc::new(EmbedderCrypto {
        not_hmac: true,
        ..EmbedderCrypto::default()
    });
    let source = {
        let mut config = Security::default();
        config.auth_key = Some(Arc::new(
            AuthKey::from_bytes_with(b"a shared secret of the test", crypto).unwrap(),
        ));
        config
    };
    let destination = keyed("a shared secret of the test");
    migrate_refused(
        listener,
        &address,
        secured_receive(destination),
        secured_migration(1, source),
    )
    .both_say("auth key");
}

#[test]
fn a_wrong_auth_key_is_refused() {
    let (listener, address) = tcp_listener();
    let receive = secured_receive(keyed("the destination's secret"));
    let migrate = secured_migration(1, keyed("the source's other secret"));
    let refused = migrate_refused(listener, &address, receive, migrate);
    refused.both_say("auth key");
    assert!(
        refused
            .source
            .contains("does not match this side's auth key"),
        "{}",
        refused.source
    );
}

#[test]
fn a_source_without_the_key_is_refused() {
    let (listener, address) = tcp_listener();
    let receive = secured_receive(keyed("the destination's secret"));
    let refused = migrate_refused(listener, &address, receive, migration_config(1));
    refused.both_say("requires an auth key");
}

#[test]
fn a_destination_without_a_key_is_refused_by_a_source_with_one() {
    let (listener, address) = tcp_listener();
    let migrate = secured_migration(1, keyed("the source's secret key"));
    let refused = migrate_refused(listener, &address, receive_config(), migrate);
    refused.both_say("this destination has none");
}

fn tls(config: tern_engine::TlsConfig) -> Security {
    {
        let mut engine_config = Security::default();
        engine_config.tls = Some(Arc::new(config));
        engine_config
    }
}

#[test]
fn tls_migration_verifies_with_a_key_too() {
    let pki = TestPki::new("tern test CA");
    let destination = pki.identity(&["localhost", "127.0.0.1"]);
    let source = pki.identity(&["source.test"]);
    let (listener, address) = tcp_listener();
    let mut receive = tls(pki.config(&destination));
    receive.auth_key = key("and a shared key on top");
    let mut migrate = tls(pki.config(&source));
    migrate.auth_key = key("and a shared key on top");
    let stats = migrate_and_verify(
        listener,
        &address,
        secured_receive(receive),
        secured_migration(3, migrate),
    );
    let security = stats.security.expect("the session's security");
    assert!(security.authenticated);
    let tls = security.tls.expect("TLS");
    assert_eq!(tls.version, "TLSv1_3");
    // This machine has no kernel TLS; where one has, either is right.
    if !std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp")
        .unwrap_or_default()
        .contains("tls")
    {
        assert!(!tls.kernel_offload, "fell back to user space");
    }
}

/// A channel's zstd stream (protocol 14) under TLS: the stream's packets
/// are records like any others, decoded on their channel in order.
#[test]
fn tls_carries_each_channels_zstd_stream() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let mut migrate = secured_migration(3, tls(pki.config(&pki.identity(&["source.test"]))));
    migrate.compression = tern_page::codec::CodecChoice::Zstd;
    migrate.stream_frames = true;
    let stats = migrate_and_verify(
        listener,
        &address,
        secured_receive(tls(pki.config(&pki.identity(&["127.0.0.1"])))),
        migrate,
    );
    assert!(
        stats
            .security
            .expect("the session's security")
            .tls
            .is_some()
    );
    let report = stats.compression.expect("compression report");
    assert!(
        report.codecs["zstd-stream"].compressed > 0,
        "{:?}",
        report.codecs
    );
}

#[test]
fn tls_over_a_unix_socket_checks_the_given_host_name() {
    let pki = TestPki::new("tern test CA");
    let destination = pki.identity(&["destination.test"]);
    let source = pki.identity(&["source.test"]);
    let dir = tempfile::tempdir().unwrap();
    let address = Address::Unix(dir.path().join("tls.sock"));
    let listener = Listener::bind(&address).unwrap();
    let mut source_config = pki.config(&source);
    source_config.hostname = Some("destination.test".into());
    migrate_and_verify(
        listener,
        &address,
        secured_receive(tls(pki.config(&destination))),
        secured_migration(2, tls(source_config)),
    );
}

#[test]
fn a_destination_from_another_ca_is_refused() {
    let pki = TestPki::new("tern test CA");
    let stranger = TestPki::new("another CA");
    let (listener, address) = tcp_listener();
    let receive = secured_receive(tls(stranger.config(&stranger.identity(&["127.0.0.1"]))));
    let migrate = secured_migration(1, tls(pki.config(&pki.identity(&["source.test"]))));
    let refused = migrate_refused(listener, &address, receive, migrate);
    refused.both_say("TLS");
    refused.both_say("CA");
}

#[test]
fn a_destination_certificate_for_another_host_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receive = secured_receive(tls(pki.config(&pki.identity(&["elsewhere.test"]))));
    let migrate = secured_migration(1, tls(pki.config(&pki.identity(&["source.test"]))));
    let refused = migrate_refused(listener, &address, receive, migrate);
    refused.both_say("certificate");
    assert!(refused.source.contains("name"), "{}", refused.source);
}

#[test]
fn a_plaintext_source_against_a_tls_destination_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receive = secured_receive(tls(pki.config(&pki.identity(&["127.0.0.1"]))));
    let refused = migrate_refused(listener, &address, receive, migration_config(1));
    refused.both_say("--tls-dir");
}

#[test]
fn a_tls_source_against_a_plaintext_destination_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let migrate = secured_migration(1, tls(pki.config(&pki.identity(&["source.test"]))));
    let refused = migrate_refused(listener, &address, receive_config(), migrate);
    refused.both_say("--tls-dir");
}

#[test]
fn an_expired_source_certificate_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receive = secured_receive(tls(pki.config(&pki.identity(&["127.0.0.1"]))));
    let migrate = secured_migration(1, tls(pki.config(&pki.expired_identity(&["source.test"]))));
    let refused = migrate_refused(listener, &address, receive, migrate);
    refused.both_say("expired");
}

#[test]
fn an_expired_destination_certificate_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receive = secured_receive(tls(pki.config(&pki.expired_identity(&["127.0.0.1"]))));
    let migrate = secured_migration(1, tls(pki.config(&pki.identity(&["source.test"]))));
    let refused = migrate_refused(listener, &address, receive, migrate);
    refused.both_say("expired");
}

/// A client that trusts the destination's CA but presents no certificate
/// of its own (rustls directly: a tern source always presents one).
#[test]
fn a_client_without_a_certificate_is_refused() {
    use rustls::pki_types::pem::PemObject;
    use std::io::{Read, Write};
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receiving = receive_with(
        listener,
        secured_receive(tls(pki.config(&pki.identity(&["127.0.0.1"])))),
    );
    let mut roots = rustls::RootCertStore::empty();
    for certificate in rustls::pki_types::CertificateDer::pem_slice_iter(pki.ca.as_bytes()) {
        roots.add(certificate.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let Address::Tcp(host_port) = &address else {
        unreachable!()
    };
    let mut socket = std::net::TcpStream::connect(host_port.as_str()).unwrap();
    socket.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut connection =
        rustls::ClientConnection::new(Arc::new(config), "127.0.0.1".try_into().unwrap()).unwrap();
    let mut stream = rustls::Stream::new(&mut connection, &mut socket);
    let hello = Message::Hello(Hello {
        handshake: Handshake {
            session_id: 1,
            channel_index: 0,
        },
        setup: tern_wire::SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: tern_wire::DigestAlgorithm::Xxh3Pages,
            regions: vec![tern_wire::RegionInfo {
                id: 0,
                guest_addr: 0,
                len: MIB,
            }],
            guest_kind: String::new(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    });
    // TLS 1.3 finishes the client's side of the handshake before the
    // server judges its (missing) certificate: the refusal comes as an
    // alert on the first read.
    let client = stream
        .write_all(&hello.to_bytes())
        .and_then(|()| stream.read(&mut [0u8; 64]).map(|_| ()))
        .expect_err("the destination must refuse");
    let refused = Refused {
        source: client.to_string(),
        destination: receiving.refusal(),
    };
    refused.both_say("certificate");
    receiving.cancel.cancel();
    assert!(join_within(receiving.thread, "the destination").is_err());
    assert!(!receiving.guest_made.load(Ordering::SeqCst));
}

/// A TLS peer that sends one record of one byte every 300 ms: each record
/// arrives well inside the 1 s I/O timeout, so only the deadline on the
/// whole transfer (here a frame header) stops it, as on a plain socket.
#[test]
fn a_peer_trickling_tls_records_is_cut_off_at_the_transfer_deadline() {
    let pki = TestPki::new("tern test CA");
    let server_config = pki.config(&pki.identity(&["127.0.0.1"]));
    let client_config = pki.config(&pki.identity(&["source.test"]));
    let (listener, address) = tcp_listener();
    let server = std::thread::spawn(move || {
        let channel = listener.accept_timeout(DEADLINE).unwrap();
        let mut channel = tern_engine::transport::tls::accept(channel, &server_config).unwrap();
        channel.set_timeouts(Duration::from_secs(1)).unwrap();
        channel.read_message()
    });
    let channel = Channel::connect(&address, DEADLINE).unwrap();
    let mut client =
        tern_engine::transport::tls::connect(channel, &client_config, "127.0.0.1").unwrap();
    let frame = Message::Heartbeat(Default::default()).to_bytes();
    let trickle = std::thread::spawn(move || {
        for byte in frame.iter().cycle().take(60) {
            if client.write_all(std::slice::from_ref(byte)).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let error = join_within(server, "the server").expect_err("the trickle is cut off");
    assert!(
        error.chain().contains("outlasted the I/O timeout"),
        "{}",
        error.chain()
    );
    join_within(trickle, "the trickling peer");
}

/// A hand-made source: the main channel with one certificate, a page
/// channel with another from the same CA. The page channel is refused.
#[test]
fn a_page_channel_with_another_identity_is_refused() {
    let pki = TestPki::new("tern test CA");
    let (listener, address) = tcp_listener();
    let receiving = receive_with(
        listener,
        secured_receive(tls(pki.config(&pki.identity(&["127.0.0.1"])))),
    );
    let first = pki.config(&pki.identity(&["source.test"]));
    let second = pki.config(&pki.identity(&["intruder.test"]));
    let open = |config: &tern_engine::TlsConfig| -> Channel {
        let mut channel = Channel::connect(&address, Duration::from_secs(5)).unwrap();
        channel.set_timeouts(Duration::from_secs(10)).unwrap();
        tern_engine::transport::tls::connect(channel, config, "127.0.0.1").unwrap()
    };
    let session_id = 0x5e55;
    let mut main = open(&first);
    let guest = guest(4 * MIB, 0);
    let regions = tern_engine::GuestMemory::regions(&guest);
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id,
            channel_index: 0,
        },
        setup: tern_wire::SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: tern_wire::DigestAlgorithm::Xxh3Pages,
            regions: regions
                .iter()
                .map(|region| tern_wire::RegionInfo {
                    id: region.id(),
                    guest_addr: region.guest_addr(),
                    len: region.len(),
                })
                .collect(),
            guest_kind: String::new(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    }))
    .unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let mut page = open(&second);
    page.send_message(&Message::ChannelHello(ChannelHello {
        handshake: Handshake {
            session_id,
            channel_index: 1,
        },
    }))
    .unwrap();
    match page.read_message().unwrap() {
        Message::Abort(abort) => assert!(
            abort.message.contains("another certificate"),
            "{}",
            abort.message
        ),
        other => panic!("expected an abort, got {other:?}"),
    }
    let refusal = receiving.refusal();
    assert!(refusal.contains("another certificate"), "{refusal}");
    receiving.cancel.cancel();
    assert!(join_within(receiving.thread, "the destination").is_err());
}

#[test]
fn an_unauthenticated_destination_on_every_interface_refuses_to_start() {
    let listener = Listener::bind(&"tcp::0".parse().unwrap()).unwrap();
    let error = Destination::new(receive_config())
        .receive(&listener, make_destination_guest)
        .expect_err("must refuse");
    assert!(
        matches!(
            error,
            MigrationError::InvalidConfig {
                field: "unauthenticated",
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("--insecure"), "{error}");
    // Loopback is accepted by default; refused when the policy says so.
    let (listener, _) = tcp_listener();
    let refuse = {
        let mut config = receive_config();
        config.unauthenticated = UnauthenticatedPolicy::Refuse;
        config
    };
    // The policy's own refusal, at once: not the accept timeout's.
    let error = Destination::new(refuse)
        .receive(&listener, make_destination_guest)
        .expect_err("must refuse");
    assert!(
        matches!(
            error,
            MigrationError::InvalidConfig {
                field: "unauthenticated",
                ..
            }
        ),
        "{error}"
    );
}

/// The other half of the policy: a destination that authenticates its
/// peer (here with a key) may listen on every interface.
#[test]
fn a_destination_with_a_key_may_listen_on_every_interface() {
    let listener = Listener::bind(&"tcp::0".parse().unwrap()).unwrap();
    let port = match listener.local_address().unwrap() {
        Address::Tcp(address) => address.rsplit(':').next().unwrap().to_owned(),
        other => panic!("a TCP listener at {other:?}"),
    };
    let address = Address::Tcp(format!("127.0.0.1:{port}"));
    let security = keyed("a shared secret of the test");
    let stats = migrate_and_verify(
        listener,
        &address,
        secured_receive(security.clone()),
        secured_migration(1, security),
    );
    assert!(
        stats
            .security
            .expect("the session's security")
            .authenticated
    );
}

#[test]
fn skipping_the_digest_is_the_destination_s_choice() {
    let (listener, address) = tcp_listener();
    let mut migrate = migration_config(1);
    migrate.verify = tern_engine::Verify::None;
    let refused = migrate_refused(listener, &address, receive_config(), migrate.clone());
    refused.both_say("--allow-unverified");
    let (listener, address) = tcp_listener();
    let mut guest = guest(8 * MIB, 0);
    let receiving = receive_with(listener, {
        let mut config = receive_config();
        config.allow_unverified = true;
        config
    });
    let stats = Source::new(migrate)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("migration");
    assert!(!stats.digest_verified);
    join_within(receiving.thread, "the destination").expect("destination");
}

/// Sockets connected beforehand, as a VMM would pass them: one per
/// channel, no address dialled.
#[test]
fn an_embedder_s_connected_sockets_carry_a_verified_migration() {
    let (tcp, address) = tcp_listener();
    let channels = 2u16;
    let mut source_ends = Vec::new();
    let mut destination_ends = std::collections::VecDeque::new();
    for _ in 0..=channels {
        let Address::Tcp(host_port) = &address else {
            unreachable!()
        };
        source_ends.push(std::os::fd::OwnedFd::from(
            std::net::TcpStream::connect(host_port.as_str()).unwrap(),
        ));
        destination_ends.push_back(tcp.accept_timeout(DEADLINE).unwrap());
    }
    let listener = Listener::Custom(Box::new(tern_engine::transport::socket::Preconnected::new(
        Address::Fd(vec![]),
        destination_ends,
    )));
    let receive = {
        let mut config = receive_config();
        config.unauthenticated = UnauthenticatedPolicy::Allow;
        config
    };
    // Not dirtying: the resumed destination guest would write and differ
    // from the paused source by digest.
    let mut guest = guest(16 * MIB, 0);
    let receiving = receive_with(listener, receive);
    let connector = Connector::from_sockets(Address::Fd(vec![]), source_ends);
    let stats = Source::new(migration_config(channels))
        .unwrap()
        .migrate_via(&mut guest, &connector)
        .expect("migration");
    assert!(stats.digest_verified);
    let mut received: SyntheticGuest = join_within(receiving.thread, "the destination")
        .expect("destination")
        .guest;
    received.pause().unwrap();
    assert_eq!(received.digest(), guest.digest());
}

#[test]
fn too_few_passed_sockets_are_a_clear_error() {
    use tern_engine::Connect;
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let connector = Connector::from_sockets(Address::Fd(vec![]), vec![a.into()]);
    connector
        .connect(0, DEADLINE)
        .expect("the main channel's socket");
    let error = connector
        .connect(1, DEADLINE)
        .expect_err("no socket for channel 1");
    let text = format!("{error}: {}", std::error::Error::source(&error).unwrap());
    assert!(text.contains("one socket per channel"), "{text}");
}

#[test]
fn vsock_loopback_migration_verifies_where_the_kernel_has_it() {
    let address = Address::Vsock {
        cid: 1,
        port: 0x7e57,
    };
    let listener = match Listener::bind(&address) {
        Ok(listener) => listener,
        Err(error) => {
            println!("SKIPPED: no vsock here ({error}); vsock is not tested on this machine");
            return;
        }
    };
    // Probe: vsock_loopback must be loaded for CID 1 to connect.
    if let Err(error) = Channel::connect(&address, Duration::from_secs(1)) {
        println!("SKIPPED: vsock loopback (CID 1) unavailable ({error})");
        return;
    }
    let _ = listener.accept_timeout(DEADLINE);
    let receive = {
        let mut config = receive_config();
        config.unauthenticated = UnauthenticatedPolicy::Allow;
        config
    };
    migrate_and_verify(listener, &address, receive, migration_config(2));
}

// An attacker on the path, in key mode: a proxy that forwards every
// channel and rewrites the main channel's frames (docs/security.md, "Sealed
// control frames").

/// Which way a frame goes through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    ToDestination,
    ToSource,
}

/// What the attacker does to each frame of the main channel (header, body
/// and seal, as read).
type Rewrite = Arc<std::sync::Mutex<dyn FnMut(Way, &mut Vec<u8>) + Send>>;

/// Copies frames from `from` to `to`, through `rewrite`, until either
/// side closes.
fn pump_frames(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    way: Way,
    rewrite: Rewrite,
) {
    use std::io::Write;
    while let Some(mut frame) = read_raw_frame(&mut from) {
        (rewrite.lock().unwrap())(way, &mut frame);
        if to.write_all(&frame).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

/// A proxy in front of `destination`: the first connection (the main
/// channel) goes frame by frame through `rewrite`, the others byte for
/// byte. Returns the address sources connect to.
fn proxy(destination: &Address, rewrite: Rewrite) -> Address {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = Address::Tcp(listener.local_addr().unwrap().to_string());
    let Address::Tcp(upstream) = destination.clone() else {
        panic!("a TCP destination")
    };
    std::thread::spawn(move || {
        for (index, downstream) in listener.incoming().enumerate() {
            let Ok(downstream) = downstream else { return };
            let upstream = std::net::TcpStream::connect(&upstream).unwrap();
            let (down, up) = (
                downstream.try_clone().unwrap(),
                upstream.try_clone().unwrap(),
            );
            if index == 0 {
                let rewrite_back = rewrite.clone();
                let rewrite = rewrite.clone();
                std::thread::spawn(move || {
                    pump_frames(down, upstream, Way::ToDestination, rewrite)
                });
                std::thread::spawn(move || {
                    pump_frames(up, downstream, Way::ToSource, rewrite_back)
                });
            } else {
                for (mut from, mut to) in [(down, upstream), (up, downstream)] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        }
    });
    address
}

/// The frame kind byte of a frame.
fn kind_of(frame: &[u8]) -> u8 {
    frame[0]
}

/// A key-mode migration of a running, dirtying guest through a proxy that
/// applies `rewrite`: the source's result, the source guest, and the
/// destination's result.
fn migrate_through(
    rewrite: impl FnMut(Way, &mut Vec<u8>) + Send + 'static,
) -> (
    Result<tern_engine::MigrationStats, tern_engine::MigrationFailure>,
    SyntheticGuest,
    DestinationResult,
) {
    let (listener, address) = tcp_listener();
    let receiving = receive_with(
        listener,
        secured_receive(keyed("the key both sides of the path hold")),
    );
    let through = proxy(&address, Arc::new(std::sync::Mutex::new(rewrite)));
    let mut guest = guest(8 * MIB, MIB);
    guest.resume().unwrap();
    let started = std::time::Instant::now();
    let result = exit_after_deadline("the source's migration through the proxy", || {
        Source::new(secured_migration(
            2,
            keyed("the key both sides of the path hold"),
        ))
        .unwrap()
        .migrate(&mut guest, &through)
    });
    let source_done = started.elapsed();
    let received = join_within(receiving.thread, "the destination");
    // The figure of docs/security.md's threat table.
    eprintln!(
        "key-mode migration through the proxy: source {} after {:.0} ms, destination {} \
         after {:.0} ms",
        if result.is_ok() {
            "succeeded"
        } else {
            "failed"
        },
        source_done.as_secs_f64() * 1e3,
        if received.is_ok() {
            "succeeded"
        } else {
            "failed"
        },
        started.elapsed().as_secs_f64() * 1e3,
    );
    (result, guest, received)
}

/// The guest runs on exactly one side.
fn runs_once(source_guest: &SyntheticGuest, destination: &DestinationResult) {
    let destination_runs = destination
        .as_ref()
        .is_ok_and(|received| received.guest.is_running());
    assert!(
        source_guest.is_running() != destination_runs,
        "the guest must run on exactly one host: source {}, destination {}",
        source_guest.is_running(),
        destination_runs
    );
}

fn one_line_naming(side: &str, text: &str, what: &str) {
    assert!(!text.contains('\n'), "{side}: one line: {text}");
    assert!(text.contains(what), "{side} must say '{what}': {text}");
}

#[test]
fn a_forged_outcome_in_key_mode_is_refused_and_the_guest_runs_once() {
    // The attack that made the guest run twice on v6: the destination
    // resumes and says so; the proxy turns "verified" into "not verified",
    // which would make the source resume its copy too.
    let (result, guest, received) = migrate_through(|way, frame| {
        if way == Way::ToSource && kind_of(frame) == tern_wire::FrameKind::Outcome as u8 {
            frame[8] = 0;
        }
    });
    let failure = result.expect_err("the forged outcome must not pass");
    let source = failure.error.chain();
    assert_eq!(
        failure.stats.status,
        MigrationStatus::OutcomeUnknown,
        "{source}"
    );
    one_line_naming("source", &source, "failed its authentication");
    assert!(received.is_ok(), "the destination resumed, as it said");
    runs_once(&guest, &received);
    assert!(!guest.is_running(), "the source keeps its copy paused");
}

#[test]
fn a_forged_ready_in_key_mode_is_refused_and_the_source_runs_on() {
    let (result, guest, received) = migrate_through(|way, frame| {
        if way == Way::ToSource && kind_of(frame) == tern_wire::FrameKind::Ready as u8 {
            frame[8] ^= 1;
        }
    });
    let failure = result.expect_err("the forged ready must not pass");
    let source = failure.error.chain();
    one_line_naming("source", &source, "failed its authentication");
    assert!(guest.is_running(), "no commit: the source resumes");
    let destination = received.as_ref().map(|_| ()).expect_err("no commit came");
    one_line_naming(
        "destination",
        &destination.chain(),
        "failed its authentication",
    );
    runs_once(&guest, &received);
}

#[test]
fn a_commit_replayed_from_another_session_is_refused_and_the_guest_runs_once() {
    // The attacker records a sealed commit of one session...
    let recorded: Arc<std::sync::Mutex<Option<Vec<u8>>>> = Arc::default();
    let record = recorded.clone();
    let (first, _, first_received) = migrate_through(move |way, frame| {
        if way == Way::ToDestination && kind_of(frame) == tern_wire::FrameKind::Commit as u8 {
            *record.lock().unwrap() = Some(frame.clone());
        }
    });
    first.unwrap_or_else(|failure| panic!("{}", failure.error.chain()));
    first_received.unwrap_or_else(|error| panic!("{}", error.chain()));
    let old_commit = recorded.lock().unwrap().clone().expect("a commit went by");
    // ...and plays it in place of the next session's.
    let (result, guest, received) = migrate_through(move |way, frame| {
        if way == Way::ToDestination && kind_of(frame) == tern_wire::FrameKind::Commit as u8 {
            *frame = old_commit.clone();
        }
    });
    let destination = received
        .as_ref()
        .map(|_| ())
        .expect_err("no valid commit came");
    let destination = destination.chain();
    // The old commit fails its tag (or, were the sessions' frame counts to
    // differ, its sequence number).
    let named = if destination.contains("replayed") {
        "replayed, dropped or reordered"
    } else {
        "failed its authentication"
    };
    one_line_naming("destination", &destination, named);
    let failure = result.expect_err("the destination did not resume");
    assert_eq!(
        failure.stats.status,
        MigrationStatus::Failed,
        "{}",
        failure.error.chain()
    );
    one_line_naming(
        "source",
        &failure.error.chain(),
        "the destination did not resume the guest",
    );
    assert!(guest.is_running(), "its abort proves it did not resume");
    runs_once(&guest, &received);
}

#[test]
fn an_injected_unsealed_abort_in_key_mode_fails_the_session_it_reaches() {
    // The page channels may be torn down by anyone on the path; what must
    // not happen is that an unauthenticated frame is believed.
    let injected = Message::Abort(tern_wire::Abort {
        reason: tern_wire::AbortReason::Other,
        message: "injected".into(),
    })
    .to_bytes();
    let (result, guest, received) = migrate_through(move |way, frame| {
        if way == Way::ToSource && kind_of(frame) == tern_wire::FrameKind::Ready as u8 {
            *frame = injected.clone();
        }
    });
    let failure = result.expect_err("the injected abort is not the destination's");
    one_line_naming(
        "source",
        &failure.error.chain(),
        "unauthenticated Abort frame",
    );
    assert!(guest.is_running());
    runs_once(&guest, &received);
}
