//! One test per identity check, each built so that it fails when that one
//! check is removed (docs/testing.md, "Mutation testing"): the source's
//! check of the destination certificate's issuer, the destination's of the
//! source's, the source's demand that every channel present the main
//! channel's certificate, and the destination's demand that an
//! authenticated hello name the session and channel the key exchange
//! covered. The other side of each case accepts, so only the check under
//! test can refuse.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use tern_engine::transport::security::secure_client;
use tern_engine::transport::tls;
use tern_engine::{
    AuthKey, Channel, Destination, GuestControl, GuestMemory, Listener, MigrationConfig,
    MigrationError, ReceiveConfig, Security, Source, TlsConfig,
};
use tern_wire::{
    ChannelHello, DigestAlgorithm, Handshake, Hello, Message, PostcopyResume, RegionInfo,
    SessionSetup, Welcome,
};

fn tls_security(config: TlsConfig) -> Security {
    {
        let mut engine_config = Security::default();
        engine_config.tls = Some(Arc::new(config));
        engine_config
    }
}

/// A TLS configuration trusting `trusted`'s CA and presenting an identity
/// `issuer` signed for `names`.
fn mixed(trusted: &TestPki, issuer: &TestPki, names: &[&str]) -> TlsConfig {
    let identity = issuer.identity(names);
    TlsConfig::from_pem(
        trusted.ca.as_bytes(),
        identity.chain.as_bytes(),
        identity.key.as_bytes(),
    )
    .expect("TLS configuration")
}

/// A destination on its own thread with `config`; returns the thread, its
/// statistics (for the reason it refused a connection) and its cancel
/// token.
fn receiving(
    listener: Listener,
    config: ReceiveConfig,
) -> (
    std::thread::JoinHandle<DestinationResult>,
    Arc<tern_engine::ReceiveStats>,
    tern_engine::CancelToken,
) {
    let destination = Destination::new(config);
    let stats = destination.stats();
    let cancel = destination.cancel_token();
    let thread = std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    (thread, stats, cancel)
}

/// The destination's reason for the first connection it refused.
fn first_refusal(stats: &tern_engine::ReceiveStats) -> String {
    wait_until("the destination refuses a connection", || {
        stats.refused_connections() > 0
    });
    stats.last_refusal().expect("a refusal's reason")
}

fn migration(security: Security) -> MigrationConfig {
    {
        let mut config = migration_config(1);
        config.security = security;
        config
    }
}

/// The source's error for a migration of a running guest that must fail;
/// the guest runs on.
fn source_refuses(address: &tern_engine::Address, config: MigrationConfig) -> MigrationError {
    let mut guest = guest(4 * MIB, 0);
    guest.resume().unwrap();
    let failure = exit_after_deadline("the source's refused migration", || {
        Source::new(config).unwrap().migrate(&mut guest, address)
    })
    .expect_err("the migration must fail");
    assert!(guest.is_running(), "the source guest runs on");
    failure.error
}

/// The destination trusts the source's CA, so it would accept; only the
/// source's check of the destination certificate's issuer refuses.
#[test]
fn the_source_refuses_a_destination_certificate_from_another_ca() {
    let pki = TestPki::new("tern test CA");
    let stranger = TestPki::new("another CA");
    let (listener, address) = tcp_listener();
    let receive = {
        let mut config = receive_config();
        config.security = tls_security(mixed(&pki, &stranger, &["127.0.0.1"]));
        config
    };
    let (destination, _stats, cancel) = receiving(listener, receive);
    let error = source_refuses(
        &address,
        migration(tls_security(pki.config(&pki.identity(&["source.test"])))),
    );
    let chain = error.chain();
    assert!(
        chain.contains("destination's certificate is not signed by a CA")
            && chain.contains("UnknownIssuer"),
        "{chain}"
    );
    cancel.cancel();
    assert!(join_within(destination, "the destination").is_err());
}

/// The source trusts the destination's CA, so it would go on; only the
/// destination's check of the source certificate's issuer refuses.
#[test]
fn the_destination_refuses_a_source_certificate_from_another_ca() {
    let pki = TestPki::new("tern test CA");
    let stranger = TestPki::new("another CA");
    let (listener, address) = tcp_listener();
    let receive = {
        let mut engine_config = receive_config();
        engine_config.security = tls_security(pki.config(&pki.identity(&["127.0.0.1"])));
        engine_config
    };
    let (destination, stats, cancel) = receiving(listener, receive);
    let _ = source_refuses(
        &address,
        migration(tls_security(mixed(&pki, &stranger, &["source.test"]))),
    );
    let refusal = first_refusal(&stats);
    assert!(
        refusal.contains("source's certificate is not signed by a CA")
            && refusal.contains("UnknownIssuer"),
        "{refusal}"
    );
    cancel.cancel();
    assert!(join_within(destination, "the destination").is_err());
}

/// A fake destination presents one certificate on the main channel and
/// another, from the same CA and for the same name, on the page channel.
/// Both pass the TLS checks; only the source's comparison refuses.
#[test]
fn the_source_refuses_a_page_channel_with_another_destination_certificate() {
    let pki = TestPki::new("tern test CA");
    let first = pki.config(&pki.identity(&["127.0.0.1"]));
    let second = pki.config(&pki.identity(&["127.0.0.1"]));
    let source_config = pki.config(&pki.identity(&["source.test"]));
    let (listener, address) = tcp_listener();
    let fake = std::thread::spawn(move || {
        let accept = || {
            let mut channel = listener.accept_timeout(DEADLINE).expect("accept");
            channel.set_timeouts(DEADLINE).unwrap();
            channel
        };
        let mut main = tls::accept(accept(), &first).expect("the main channel's TLS");
        let Message::Hello(hello) = main.read_message().expect("a hello") else {
            panic!("no hello")
        };
        main.send_message(&Message::Welcome(Welcome {
            session_id: hello.handshake.session_id,
            channel_index: 0,
        }))
        .unwrap();
        // The source closes the page channel once it has seen the
        // certificate: the handshake's own outcome does not matter here.
        let _ = tls::accept(accept(), &second);
        // What the source says on the main channel before it closes it.
        let mut said = Vec::new();
        while let Ok(message) = main.read_message() {
            said.push(message);
        }
        said
    });
    let error = source_refuses(&address, migration(tls_security(source_config)));
    assert!(
        matches!(error, MigrationError::Channel { index: 1, .. }),
        "{}",
        error.chain()
    );
    assert!(
        error
            .chain()
            .contains("another certificate than on the main channel"),
        "{}",
        error.chain()
    );
    let said = join_within(fake, "the fake destination");
    assert!(
        !said
            .iter()
            .any(|message| matches!(message, Message::Dictionary(_) | Message::Complete(_))),
        "nothing of the session follows: {said:?}"
    );
}

fn key() -> Security {
    {
        let mut config = Security::default();
        config.auth_key = Some(Arc::new(
            AuthKey::from_bytes(b"the key of the identity checks").unwrap(),
        ));
        config
    }
}

/// A small session's setup for a hand-made source.
fn setup() -> SessionSetup {
    let guest = guest(4 * MIB, 0);
    SessionSetup {
        page_size: 4096,
        channel_count: 1,
        codecs: 0,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: guest
            .regions()
            .iter()
            .map(|region| RegionInfo {
                id: region.id(),
                guest_addr: region.guest_addr(),
                len: region.len(),
            })
            .collect(),
        guest_kind: String::new(),
        dictionaries: 0,
        vmm_config_len: 0,
    }
}

/// A hand-made source proves the key for one session and then says hello
/// for `hello`; the destination's answer.
fn hello_after_key_exchange(proved: Handshake, hello: Handshake) -> (Message, String) {
    opening_after_key_exchange(
        proved,
        Message::Hello(Hello {
            handshake: hello,
            setup: setup(),
        }),
    )
}

/// A hand-made source proves the key for `proved` and then sends
/// `opening`; the destination's answer and its first refusal.
fn opening_after_key_exchange(proved: Handshake, opening: Message) -> (Message, String) {
    let answered = answer_after_key_exchange(proved, opening);
    let refusal = (!matches!(answered.answer, Message::Welcome(_))).then(|| {
        // A refusal that ends the session (not one connection) is counted
        // nowhere: the destination's end stops the wait instead, so a
        // wrong refusal fails at once rather than at the deadline.
        wait_until("the destination refuses a connection or ends", || {
            answered.stats.refused_connections() > 0 || answered.destination.is_finished()
        });
        answered
            .stats
            .last_refusal()
            .unwrap_or_else(|| "no connection refused: the session ended".into())
    });
    let answer = answered.answer.clone();
    let _ = answered.outcome();
    (answer, refusal.unwrap_or_default())
}

/// The destination's answer to an opening sent after a key exchange, with
/// what the test needs to read its statistics and end it.
struct Answered {
    answer: Message,
    stats: Arc<tern_engine::ReceiveStats>,
    destination: std::thread::JoinHandle<DestinationResult>,
    cancel: tern_engine::CancelToken,
}

impl Answered {
    /// Cancels the destination and returns its outcome.
    fn outcome(self) -> DestinationResult {
        self.cancel.cancel();
        join_within(self.destination, "the destination")
    }
}

/// The destination's answer to `opening`, sent after a key exchange that
/// proved `proved`.
fn answer_after_key_exchange(proved: Handshake, opening: Message) -> Answered {
    let (listener, address) = tcp_listener();
    let receive = {
        let mut config = receive_config();
        config.security = key();
        config
    };
    let (destination, stats, cancel) = receiving(listener, receive);
    let mut channel = Channel::connect(&address, Duration::from_secs(5)).expect("connect");
    channel.set_timeouts(DEADLINE).unwrap();
    let mut main = secure_client(channel, &key(), None, proved).expect("the key exchange");
    main.send_message(&opening).unwrap();
    let answer = main.read_message().expect("the destination's answer");
    Answered {
        answer,
        stats,
        destination,
        cancel,
    }
}

#[test]
fn an_authenticated_hello_for_another_session_is_refused() {
    let proved = Handshake {
        session_id: 0x0a,
        channel_index: 0,
    };
    let (answer, refusal) = hello_after_key_exchange(
        proved,
        Handshake {
            session_id: 0x0b,
            ..proved
        },
    );
    let Message::Abort(abort) = answer else {
        panic!("expected an abort, got {answer:?}")
    };
    let reason = "the hello names another session or channel than the authentication";
    assert!(abort.message.contains(reason), "{}", abort.message);
    assert!(refusal.contains(reason), "{refusal}");
}

/// The control case: the same hand-made source, naming the session it
/// proved, is welcomed (so the refusal above is the check's, not the fake
/// source's).
#[test]
fn an_authenticated_hello_for_the_proved_session_is_welcomed() {
    let proved = Handshake {
        session_id: 0x0a,
        channel_index: 0,
    };
    let (answer, _) = hello_after_key_exchange(proved, proved);
    assert!(matches!(answer, Message::Welcome(_)), "{answer:?}");
}

/// The identity check covers every opening that names a session: a page
/// channel's hello and a postcopy reconnection's, not only the main hello.
#[test]
fn an_authenticated_channel_hello_or_resume_for_another_channel_is_refused() {
    let reason = "the hello names another session or channel than the authentication";
    let page_channel = Handshake {
        session_id: 0x0a,
        channel_index: 1,
    };
    let main = Handshake {
        channel_index: 0,
        ..page_channel
    };
    let openings = [
        (
            page_channel,
            Message::ChannelHello(ChannelHello {
                handshake: Handshake {
                    channel_index: 2,
                    ..page_channel
                },
            }),
        ),
        (
            main,
            Message::PostcopyResume(PostcopyResume {
                handshake: Handshake {
                    session_id: 0x0b,
                    ..main
                },
            }),
        ),
    ];
    for (proved, opening) in openings {
        let kind = opening.kind();
        let (answer, refusal) = opening_after_key_exchange(proved, opening);
        let Message::Abort(abort) = answer else {
            panic!("{kind:?}: expected an abort, got {answer:?}")
        };
        assert!(
            abort.message.contains(reason),
            "{kind:?}: {}",
            abort.message
        );
        assert!(refusal.contains(reason), "{kind:?}: {refusal}");
    }
}

/// A hello with every region the protocol allows is welcomed once sealed
/// (a real source with many regions must not be refused). The guest kind
/// is the test guest's own, `synthetic`, so the hello is 55 bytes short of
/// the longest: the next test covers the longest.
#[test]
fn a_hello_with_every_region_is_welcomed_sealed() {
    let proved = Handshake {
        session_id: 0x0c,
        channel_index: 0,
    };
    let mut largest = setup();
    largest.regions = every_region();
    largest.guest_kind = "synthetic".into();
    let hello = Message::Hello(Hello {
        handshake: proved,
        setup: largest,
    });
    let short_of_longest_kind = tern_wire::MAX_GUEST_KIND_LEN - "synthetic".len();
    assert_eq!(
        hello.to_bytes().len(),
        tern_wire::MAX_OPENING_FRAME - short_of_longest_kind
    );
    assert!(short_of_longest_kind < 2 * tern_wire::SEAL_LEN);
    let (answer, refusal) = opening_after_key_exchange(proved, hello);
    assert!(
        matches!(answer, Message::Welcome(_)),
        "{answer:?}: {refusal}"
    );
}

/// The longest hello the protocol allows (every region, the longest guest
/// kind: exactly `MAX_OPENING_FRAME`) is read whole once sealed: the
/// sealed frame's bound is the plain one plus the seal, not less. The
/// guest kind is not the test guest's, so the destination answers with
/// that refusal, which it can only give after decoding the whole frame; a
/// bound short of the seal refuses the frame's length instead.
#[test]
fn the_longest_hello_is_read_whole_sealed() {
    let proved = Handshake {
        session_id: 0x0d,
        channel_index: 0,
    };
    let mut longest = setup();
    longest.regions = every_region();
    longest.guest_kind = "k".repeat(tern_wire::MAX_GUEST_KIND_LEN);
    let hello = Message::Hello(Hello {
        handshake: proved,
        setup: longest,
    });
    assert_eq!(hello.to_bytes().len(), tern_wire::MAX_OPENING_FRAME);
    let answered = answer_after_key_exchange(proved, hello);
    let Message::Abort(abort) = &answered.answer else {
        panic!(
            "expected the guest kind's refusal, got {:?}",
            answered.answer
        )
    };
    let reason = "the source sends a kkkk";
    assert!(abort.message.contains(reason), "{}", abort.message);
    let failure = answered.outcome().expect_err("a guest of another kind");
    assert!(failure.to_string().contains(reason), "{failure}");
}

/// As many 1 MiB regions as the protocol allows.
fn every_region() -> Vec<RegionInfo> {
    (0..tern_wire::MAX_REGIONS)
        .map(|id| RegionInfo {
            id: u32::try_from(id).unwrap(),
            guest_addr: u64::try_from(id).unwrap() << 20,
            len: 1 << 20,
        })
        .collect()
}
